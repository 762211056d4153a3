"""The softcap's tanh: where the kernels take the hardware's approximation (16-bit logits
that a fused call computed itself, on a GPU), and how far each tanh is from float64
(``flce.backends.base.softcap_tanh_is_approximate``).

The approximation is PTX, so its accuracy is measured on a GPU only; Triton's
interpreter checks the accurate device function on the CPU. The losses and gradients
with a softcap are judged against float64 with every other feature in the parity
tests (``tests/gpu``, ``flce check``)."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

from flce.backends.base import softcap_tanh_is_approximate
from flce.dispatch import availability
from flce.rows.cross_entropy import ChunkScalars

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton compiles the test kernel

CPU, GPU = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(
    "dtype,device,approximate",
    [
        (torch.bfloat16, GPU, True),
        (torch.float16, GPU, True),
        (torch.float32, GPU, False),
        (torch.bfloat16, CPU, False),  # Triton's interpreter: no PTX
        (torch.float32, CPU, False),
    ],
    ids=str,
)
def test_the_approximation_is_taken_for_16_bit_logits_on_a_gpu(dtype, device, approximate):
    assert softcap_tanh_is_approximate(dtype, device) is approximate


HAS_TRITON = importlib.util.find_spec("numpy") is not None and importlib.util.find_spec("triton") is not None
if HAS_TRITON:
    import triton
    import triton.language as tl

    from flce.backends.triton.common import softcap_tanh_and_derivative

    @triton.jit
    def _tanh_and_derivative_kernel(x_ptr, t_ptr, d_ptr, n, APPROX: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        t, d = softcap_tanh_and_derivative(x, APPROX)
        tl.store(t_ptr + offs, t, mask=mask)
        tl.store(d_ptr + offs, d, mask=mask)


def _errors(approx: bool, device: torch.device, points: int) -> tuple[float, float]:
    """Max relative error of tanh and max absolute error of its derivative over
    ``points`` fp32 values spanning [-12, 12] (saturated at both ends)."""
    if not HAS_TRITON:
        pytest.skip("needs triton and numpy (Triton's interpreter)")
    usable, why = availability("triton", device)
    if not usable:
        pytest.skip(why)
    x = torch.linspace(-12.0, 12.0, points, dtype=torch.float32, device=device)
    x = torch.cat([x, torch.tensor([0.0, 1e-30, -1e-6, 0.625, -0.625, 20.0], device=device)])
    t, d = torch.empty_like(x), torch.empty_like(x)
    block = 1024
    _tanh_and_derivative_kernel[(triton.cdiv(x.numel(), block),)](x, t, d, x.numel(), APPROX=approx, BLOCK=block)
    exact = torch.tanh(x.double())
    nonzero = exact != 0
    rel = ((t.double() - exact).abs()[nonzero] / exact.abs()[nonzero]).max().item()
    assert (t[~nonzero] == 0).all()
    deriv_abs = (d.double() - (1 - exact * exact)).abs().max().item()
    return rel, deriv_abs


def test_the_accurate_tanh_is_within_a_few_ulp():
    rel, deriv_abs = _errors(False, GPU if HAS_CUDA else CPU, 20_001)
    assert rel <= 4 * torch.finfo(torch.float32).eps, rel
    assert deriv_abs <= 4 * torch.finfo(torch.float32).eps, deriv_abs


@pytest.mark.gpu
def test_gpu_the_approximation_is_within_its_documented_bound():
    """PTX documents about 2^-11 relative for ``tanh.approx.f32``: the bound is checked
    with a little room (2^-10.5), and the derivative ``1 - t^2`` from it to 2^-9.5
    absolute, below a bf16 ulp of 1 (2^-8) and near an fp16 one (2^-10)."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    rel, deriv_abs = _errors(True, GPU, 2_000_001)
    assert rel <= 2**-10.5, f"tanh.approx.f32 relative error {rel:.3g} (log2 {math.log2(rel):.2f})"
    assert deriv_abs <= 2**-9.5, f"1 - t^2 absolute error {deriv_abs:.3g} (log2 {math.log2(deriv_abs):.2f})"


@pytest.mark.parametrize(
    "products,softcap,expected",
    [(True, 30.0, True), (False, 30.0, False), (True, None, False)],
    ids=["fused", "given-logits", "no-softcap"],
)
def test_only_the_logits_a_loss_computes_itself_get_the_approximation(monkeypatch, products, softcap, expected):
    """Where the policy allows it (stood in for: the CPU never does), a plan approximates
    the softcap's tanh for the logits its GEMMs compute only (``product_scalars``), not
    for logits the caller gives (``scalars``)."""
    import flce.plan
    from flce.options import LossOptions

    monkeypatch.setattr(flce.plan, "softcap_tanh_is_approximate", lambda dtype, device: True)
    plan = flce.plan.make_plan(LossOptions(softcap=softcap), CPU, torch.tensor([1, 2]), None, 8, torch.bfloat16)
    scalars = plan.product_scalars if products else plan.scalars
    assert scalars.approximate_tanh is expected


def test_the_public_functions_say_whose_logits_they_are(monkeypatch):
    """The scalars each driver receives: approximate for the fused call's own logits, not
    for the logits given to ``cross_entropy``."""
    import flce
    import flce.plan

    monkeypatch.setattr(flce.plan, "softcap_tanh_is_approximate", lambda dtype, device: True)
    seen = []
    for name in ("run_chunks", "run_logits_chunks"):
        original = getattr(flce.plan, name)

        def spy(*args, _original=original, **kwargs):
            seen.append(next(a for a in args if isinstance(a, ChunkScalars)).approximate_tanh)
            return _original(*args, **kwargs)

        monkeypatch.setattr(flce.plan, name, spy)
    # The torch backend's kernels take the accurate torch.tanh whatever the scalars say.
    x, w, y = torch.randn(4, 8), torch.randn(16, 8), torch.tensor([0, 3, 5, 15])
    flce.fused_linear_cross_entropy(x, w, y, softcap=30.0, backend="torch")
    flce.cross_entropy(x @ w.T, y, softcap=30.0, backend="torch")
    assert seen == [True, False]
