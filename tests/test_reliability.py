"""No silent wrong answers: non-finite inputs, extreme logits, degenerate sizes and
determinism, on every backend usable here (on CPU: torch, and triton through its
interpreter)."""

import pytest
import torch

import flce
from flce.dispatch import BACKEND_NAMES, availability
from flce.reference import fused_linear_cross_entropy_reference

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
BACKENDS = [name for name in BACKEND_NAMES if availability(name, DEVICE)[0]]


def _inputs(n=9, h=8, v=13, dtype=torch.float32, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, h, generator=gen) * scale).to(DEVICE, dtype)
    w = torch.randn(v, h, generator=gen).to(DEVICE, dtype)
    t = torch.randint(0, v, (n,), generator=gen).to(DEVICE)
    return x, w, t


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["input", "weight"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_non_finite_inputs_give_non_finite_loss(backend, where, bad, reduction):
    # NaN propagates as NaN; an Inf logit gives an infinite lse, so the loss is +Inf or
    # NaN (as in eager PyTorch): never a finite, wrong number.
    x, w, t = _inputs()
    if where == "input":
        x[2, 3] = bad  # row 2's logits become non-finite
    else:
        w[t[0], 1] = bad  # a class every row sees
    loss = flce.fused_linear_cross_entropy(x, w, t, backend=backend, reduction=reduction)
    assert not torch.isfinite(loss), f"non-finite {where} gave a finite loss {loss.item()}"
    if bad != bad:  # NaN in, NaN out
        assert torch.isnan(loss)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "dtype,magnitude",
    [(torch.float32, 1e4), (torch.float16, 6e4), (torch.bfloat16, 1e4)],
    ids=["fp32-1e4", "fp16-near-max", "bf16-1e4"],
)
def test_extreme_finite_logits_are_finite_and_correct(backend, dtype, magnitude):
    # Logits of size `magnitude` (H = 1 so a logit is exactly x * w, no overflow in the GEMM).
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 1, generator=gen).sign().to(DEVICE, dtype).requires_grad_()
    w = (torch.rand(11, 1, generator=gen) * 2 - 1).mul(magnitude).to(DEVICE, dtype).requires_grad_()
    t = torch.randint(0, 11, (16,), generator=gen).to(DEVICE)
    loss = flce.fused_linear_cross_entropy(x, w, t, backend=backend, label_smoothing=0.1)
    loss.backward()
    ref_leaves = [x.detach().double().requires_grad_(), w.detach().double().requires_grad_()]
    ref = fused_linear_cross_entropy_reference(*ref_leaves, t, label_smoothing=0.1)
    ref.loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()
    torch.testing.assert_close(loss.double(), ref.loss, rtol=1e-3, atol=0)
    torch.testing.assert_close(w.grad.double(), ref_leaves[1].grad, rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_class_vocabulary(backend):
    x, w, t = _inputs(v=1)
    x.requires_grad_()
    out = flce.fused_linear_cross_entropy(x, w, t, backend=backend, return_predicted_tokens=True)
    out.loss.backward()
    assert out.loss.item() == 0.0 and torch.all(x.grad == 0) and torch.all(out.predicted_tokens == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_hidden_size(backend):
    # H = 0: every logit is the bias, so the loss is the CE of the bias row.
    x = torch.empty(5, 0, device=DEVICE)
    w = torch.empty(7, 0, device=DEVICE)
    b = torch.randn(7, device=DEVICE, requires_grad=True)
    t = torch.arange(5, device=DEVICE)
    loss = flce.fused_linear_cross_entropy(x, w, t, bias=b, backend=backend)
    loss.backward()
    expected = torch.nn.functional.cross_entropy(b.detach().expand(5, 7), t)
    torch.testing.assert_close(loss, expected)
    assert b.grad is not None and torch.isfinite(b.grad).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_deterministic(backend, dtype):
    """The same inputs twice give bitwise-identical loss and gradients."""
    results = []
    for _ in range(2):
        x, w, t = _inputs(n=40, h=16, v=300, dtype=dtype)
        b = torch.randn(300, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
        for p in (x, w, b):
            p.requires_grad_()
        out = flce.fused_linear_cross_entropy(
            x,
            w,
            t,
            bias=b,
            backend=backend,
            chunk_size=16,
            label_smoothing=0.1,
            lse_square_scale=1e-3,
            return_z_loss=True,
        )
        out.loss.backward()
        results.append([out.loss, out.z_loss, x.grad, w.grad, b.grad])
    for first, second in zip(*results, strict=False):
        assert torch.equal(first, second)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_autocast_with_fp32_parameters(backend, autocast_dtype):
    """Under autocast every backend computes in the autocast dtype (exactly as on inputs
    cast to it) and returns gradients in the fp32 parameters' dtype."""
    x, w, t = _inputs(n=24, h=16, v=40)
    x.requires_grad_()
    w.requires_grad_()
    with torch.autocast(DEVICE.type, dtype=autocast_dtype):
        loss = flce.fused_linear_cross_entropy(x, w, t, backend=backend, label_smoothing=0.1)
    loss.backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == w.grad.dtype == torch.float32
    x_low = x.detach().to(autocast_dtype).requires_grad_()
    w_low = w.detach().to(autocast_dtype).requires_grad_()
    expected = flce.fused_linear_cross_entropy(x_low, w_low, t, backend=backend, label_smoothing=0.1)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    # dX leaves the GEMM in the autocast dtype either way; dW is accumulated in fp32 and
    # rounded to the autocast dtype only on the cast-input path.
    torch.testing.assert_close(x.grad, x_low.grad.float(), rtol=0, atol=0)
    torch.testing.assert_close(w.grad, w_low.grad.float(), rtol=torch.finfo(autocast_dtype).eps, atol=1e-6)
