"""``flce.cross_entropy`` (loss on given logits) on the GPU, per backend, against float64.

The public call reads the caller's logits and has the kernel write the gradient into a
buffer of its own; the backward then rescales it by the upstream gradient, a pass that
is skipped on the device when that is exactly 1. Both upstream gradients are checked,
and that the caller's logits are left as they were. Tolerance: err(ours) <= 3 x the
error of the same math in fp32 autograd on the same low-precision logits (what eager
PyTorch code does) + a floor of a few units of the output's rounding.
"""

import pytest
import torch

import flce
from flce.reference import cross_entropy_reference
from tests.gpu.common import CUDA, skip_unless_usable

if not torch.cuda.is_available():
    pytest.skip("GPU cross-entropy tests: need a CUDA GPU", allow_module_level=True)

pytestmark = pytest.mark.gpu

K = 3.0
EPS_LOSS = 2e-6
EPS_GRAD = {torch.float32: 2e-6, torch.bfloat16: 1e-4}
FEATURES = {
    "plain": {},
    "all": dict(label_smoothing=0.1, lse_square_scale=1e-3, softcap=20.0, use_token_scaling=True),
}


def _rel(x: torch.Tensor, truth: torch.Tensor) -> float:
    x, truth = x.detach().double(), truth.detach()
    return float((x - truth).norm() / truth.norm().clamp_min(1e-30))


@pytest.mark.parametrize("backend", ["torch", "triton", "cutedsl"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("upstream", [1.0, 0.7])
@pytest.mark.parametrize("vocab", [32000, 128256])
def test_matches_float64(backend, dtype, reduction, feature, upstream, vocab):
    skip_unless_usable(backend)
    gen = torch.Generator(device=CUDA).manual_seed(vocab + len(feature))
    n = 64
    base = (torch.randn(n, vocab, generator=gen, device=CUDA) * 3).to(dtype)
    target = torch.randint(0, vocab, (n,), generator=gen, device=CUDA)
    target[::7] = -100
    weight = torch.rand(vocab, generator=gen, device=CUDA) + 0.5 if feature == "all" else None
    opts = dict(FEATURES[feature], reduction=reduction)
    row_upstream = torch.rand(n, generator=gen, device=CUDA) + 0.5

    def loss_grad(leaf, loss):
        if reduction == "none":
            (loss * row_upstream * upstream).sum().backward()
        elif upstream == 1.0:
            loss.backward()  # an upstream gradient of exactly 1: flce skips the rescale
        else:
            (loss * upstream).backward()
        return leaf.grad

    ours_in = base.clone().requires_grad_()
    ours_loss = flce.cross_entropy(ours_in, target, weight=weight, backend=backend, **opts)  # a tensor here
    ours_grad = loss_grad(ours_in, ours_loss)
    assert torch.equal(ours_in.detach(), base), "the caller's logits must not change"
    assert ours_grad.dtype == dtype

    truth_in = base.double().requires_grad_()
    truth = cross_entropy_reference(truth_in, target, ce_weight=weight, **opts)
    truth_grad = loss_grad(truth_in, truth.loss)
    yard_in = base.clone().requires_grad_()
    yard = cross_entropy_reference(yard_in, target, ce_weight=weight, math_dtype=torch.float32, **opts)
    yard_grad = loss_grad(yard_in, yard.loss)

    failures = []
    for name, ours, yardstick, exact, eps in (
        ("loss", ours_loss, yard.loss, truth.loss.detach(), EPS_LOSS),
        ("grad", ours_grad, yard_grad, truth_grad, EPS_GRAD[dtype]),
    ):
        e_ours, e_yard = _rel(ours, exact), _rel(yardstick, exact)
        if not e_ours <= K * e_yard + eps:
            failures.append(f"{name}: err {e_ours:.3g} > {K:g} x fp32 autograd {e_yard:.3g} + {eps:g}")
    assert not failures, "; ".join(failures)
