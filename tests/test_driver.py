"""The shared driver's behaviours: chunk sizing, the loss-only path, backward scaling
that does not compound, autocast, (B, T, H) and non-contiguous inputs, one host sync."""

import pytest
import torch

import flce
from flce.driver import chunks, gemm, sizing, statistics
from flce.reference import fused_linear_cross_entropy_reference
from flce.testing import relative_error
from tests.budgets import call_of, inside_dw_budget


def _inputs(n=21, h=12, v=17, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=gen).to(dtype)
    w = (torch.randn(v, h, generator=gen) * 0.7).to(dtype)
    b = torch.randn(v, generator=gen).to(dtype)
    t = torch.randint(0, v, (n,), generator=gen)
    t[::4] = -100
    return x, w, b, t


# Where the two factors of each GEMM op are among its arguments.
_GEMMS = {
    torch.ops.aten.mm.default: (0, 1),
    torch.ops.aten.mm.out: (0, 1),
    torch.ops.aten.addmm.default: (1, 2),
    torch.ops.aten.addmm.out: (1, 2),
}
# addmm(out_dtype=...) came in torch 2.8 (flce calls it from then on: fp32_output_gemm_supported).
if hasattr(torch.ops.aten.addmm, "dtype_out"):
    _GEMMS[torch.ops.aten.addmm.dtype_out] = (1, 2)


def _gemms(call) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(a, b, out) of every GEMM ``call`` dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    gemms = []

    class Gemms(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in _GEMMS:
                a, b = (args[i] for i in _GEMMS[func])
                gemms.append((a, b, out))
            return out

    with Gemms():
        call()
    return gemms


def test_chunk_size_follows_the_budget_formula():
    # 512 MiB / (128256 * 2 bytes) = 2093 rows -> 4 balanced chunks of 2048 for N = 8192.
    assert sizing.default_chunk_size(8192, 128256, torch.bfloat16, 0, 512 * 2**20) == 2048
    # The torch backend's fp32 workspace (12 B/logit) shrinks the chunk: 512 MiB / (V * 14)
    # = 299 rows -> 28 chunks -> balanced to 293 rows.
    assert sizing.default_chunk_size(8192, 128256, torch.bfloat16, 12, 512 * 2**20) == 293
    # Balanced: 1000 rows with room for 300 -> 4 chunks of 250, not 300+300+300+100.
    assert sizing.default_chunk_size(1000, 1000, torch.float32, 0, 300 * 1000 * 4) == 250
    assert sizing.default_chunk_size(5, 10, torch.float32, 0, 10**9) == 5  # never above N
    assert sizing.default_chunk_size(5, 10**6, torch.float32, 0, 1) == 1  # at least one row


def test_chunk_grows_to_the_size_of_dw_when_that_costs_no_peak(monkeypatch):
    monkeypatch.delenv("FLCE_CHUNK_BUDGET_MIB", raising=False)
    # bf16 weight, fp32 dW accumulation, N*V*2 <= V*H*4 (N <= 2H): one chunk, dW written
    # directly in bf16, never larger than the fp32 accumulator it replaces.
    assert sizing.whole_row_chunk_size(8192, 128256, 4096, torch.bfloat16, torch.bfloat16, 0, True) == 8192
    # N > 2H: several chunks, the budget raised to V*H*2 = 1 GiB -> 4096 rows at V = 128256.
    assert sizing.whole_row_chunk_size(16384, 128256, 4096, torch.bfloat16, torch.bfloat16, 0, True) == 4096
    # A workspace per logit counts against the one-chunk rule (the torch backend's 12 B).
    assert sizing.whole_row_chunk_size(8192, 128256, 4096, torch.bfloat16, torch.bfloat16, 12, True) == 547
    # No fp32 accumulator (bf16 accumulation, or no weight gradient): the plain 512 MiB budget.
    assert sizing.whole_row_chunk_size(8192, 128256, 4096, torch.bfloat16, torch.bfloat16, 0, False) == 2048
    # An fp32 weight's accumulator is dW itself (no cast at the end): no free room.
    assert sizing.whole_row_chunk_size(8192, 128256, 4096, torch.float32, torch.float32, 0, True) == 1024
    # An explicit budget is honoured as given.
    monkeypatch.setenv("FLCE_CHUNK_BUDGET_MIB", "256")
    assert sizing.whole_row_chunk_size(8192, 128256, 4096, torch.bfloat16, torch.bfloat16, 0, True) == 1024


def test_peak_formula_one_chunk_never_above_several():
    """The one-chunk peak is bounded by the several-chunk peak it replaces."""
    n, v, h = 8192, 128256, 4096
    one = sizing.peak_extra_bytes(n, v, h, 2, 0, chunk=n)
    several = sizing.peak_extra_bytes(n, v, h, 2, 0, chunk=n // 2)
    assert one <= several
    assert one == n * v * 2 + v * h * 2 + n * h * 2 + v * 4


def test_chunk_budget_env_var(monkeypatch):
    monkeypatch.setenv("FLCE_CHUNK_BUDGET_MIB", "1")
    assert sizing.chunk_budget_bytes() == 2**20
    monkeypatch.setenv("FLCE_CHUNK_BUDGET_MIB", "-3")
    with pytest.raises(ValueError, match="FLCE_CHUNK_BUDGET_MIB"):
        sizing.chunk_budget_bytes()


def test_memory_budget_env_var(monkeypatch):
    monkeypatch.delenv("FLCE_MEMORY_BUDGET_MIB", raising=False)
    assert sizing.env_memory_budget_bytes() is None
    monkeypatch.setenv("FLCE_MEMORY_BUDGET_MIB", "1.5")
    assert sizing.env_memory_budget_bytes() == 3 * 2**19
    for bad in ("0", "-1", "nan", "inf", "1 GiB"):
        monkeypatch.setenv("FLCE_MEMORY_BUDGET_MIB", bad)
        with pytest.raises(ValueError, match="FLCE_MEMORY_BUDGET_MIB must be a positive number of MiB"):
            sizing.env_memory_budget_bytes()


def test_default_memory_budget_rule():
    v, h = 128256, 4096

    def budget(call, device_memory=None):
        return sizing.default_memory_budget(call, device_memory)

    # dW of a bf16 weight accumulated in fp32: the accumulator's size, V*H*4 (2 GiB here) ...
    assert budget(sizing.CallShape(8192, v, h)) == v * h * 4
    # ... at least 512 MiB (a small head), and nothing more without that accumulator.
    assert budget(sizing.CallShape(8192, 1000, 64)) == 512 * 2**20
    assert budget(sizing.CallShape(8192, v, h, accumulator_dtype=torch.bfloat16)) == 512 * 2**20
    # Never above 1/16 of the device: 1.5 GiB on a 24 GiB GPU, not binding on an 80 GB one.
    assert budget(sizing.CallShape(8192, v, h), 24 * 2**30) == 3 * 2**29
    assert budget(sizing.CallShape(8192, v, h), 80 * 10**9) == v * h * 4
    # Plus what no scheme can save: db's fp32 sum beyond a bf16 db (2 bytes per class) ...
    assert budget(sizing.CallShape(8192, v, h, bias_dtype=torch.bfloat16)) == v * h * 4 + 2 * v
    assert budget(sizing.CallShape(8192, v, h, bias_dtype=torch.float32)) == v * h * 4
    # ... and an fp32 weight's bf16 copy under autocast (its fp32 dW needs no accumulator).
    autocast = sizing.CallShape(8192, v, h, torch.float32, torch.float32, torch.bfloat16, torch.float32)
    assert budget(autocast) == 512 * 2**20 + v * h * 2
    assert budget(autocast, 24 * 2**30) == 512 * 2**20 + v * h * 2  # the cap bounds the first term only


def test_whole_row_chunk_size_is_the_default_budgets_choice(monkeypatch):
    """run_chunks' own fallback and the plan's chooser agree under the default budget."""
    from flce.driver.schemes import scheme_for_call
    from flce.options import LossOptions

    monkeypatch.delenv("FLCE_CHUNK_BUDGET_MIB", raising=False)
    for n, v, extra, accumulator in ((8192, 128256, 0, torch.float32), (16384, 32000, 12, torch.float32)):
        call = sizing.CallShape(
            n,
            v,
            4096,
            accumulator_dtype=accumulator,
            # A backend's chunk and split-row kernels take the same workspace per logit.
            chunk_extra_bytes_per_logit=extra,
            block_extra_bytes_per_logit=extra,
        )
        rows = sizing.whole_row_chunk_size(n, v, 4096, torch.bfloat16, torch.bfloat16, extra, True)
        assert scheme_for_call(call, LossOptions(), torch.device("cpu")).rows == rows


def test_the_heads_chunks_under_autocast_with_fp32_weights(monkeypatch):
    """The loop of every head sizes its own chunks when no scheme was chosen for it (the
    distillation head): an fp32 weight's bf16 copy is not counted against the logits' 512
    MiB, so a 1 GiB copy no longer leaves one row per chunk."""
    monkeypatch.delenv("FLCE_CHUNK_BUDGET_MIB", raising=False)
    rows = sizing.whole_row_chunk_size(8192, 128256, 4096, torch.bfloat16, torch.float32, 0, True)
    assert rows == sizing.whole_row_chunk_size(8192, 128256, 4096, torch.bfloat16, torch.bfloat16, 0, False) > 1000


def _record_run_chunks(monkeypatch):
    calls = []
    original = chunks.run_chunks

    def spy(*args, **kwargs):
        request = args[9]
        calls.append(dict(grad_input=request.input, grad_weight=request.weight, grad_bias=request.bias))
        return original(*args, **kwargs)

    monkeypatch.setattr("flce.plan.run_chunks", spy)
    return calls


def test_no_gradient_work_when_nothing_requires_grad(monkeypatch):
    calls = _record_run_chunks(monkeypatch)
    x, w, b, t = _inputs()
    flce.fused_linear_cross_entropy(x, w, t, bias=b)
    x.requires_grad_()
    with torch.no_grad():
        flce.fused_linear_cross_entropy(x, w, t, bias=b)
    assert calls == [dict(grad_input=False, grad_weight=False, grad_bias=False)] * 2


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_repeated_backward_does_not_compound(reduction):
    x, w, b, t = _inputs()
    for p in (x, w, b):
        p.requires_grad_()
    loss = flce.fused_linear_cross_entropy(x, w, t, bias=b, reduction=reduction, label_smoothing=0.1)
    upstream = torch.full_like(loss, 3.0)
    loss.backward(upstream, retain_graph=True)
    first = [p.grad.clone() for p in (x, w, b)]
    loss.backward(upstream, retain_graph=True)
    loss.backward(upstream)
    for p, g in zip((x, w, b), first, strict=False):
        torch.testing.assert_close(p.grad, 3 * g, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scale", [2.0**16, 1 / 3, 1e-3], ids=["loss-scaler", "third", "small"])
def test_the_upstream_gradient_scales_16_bit_gradients_in_fp32(monkeypatch, dtype, scale):
    """mean/sum on a device without the one-launch scaling kernel (the CPU without Triton):
    the forward's gradients times the upstream gradient, the product in fp32 and rounded
    once. The scale rounded to fp16 first is Inf at a loss scaler's 2^16 (every gradient
    Inf or NaN) and rounded far from 0 (1e-3 by 4e-4); rounded to bf16, 1/3 biases every
    gradient."""
    monkeypatch.setattr("flce.driver.scaling.device_helper", lambda slot, device: None)
    x, w, b, t = _inputs(dtype=dtype)

    def gradients(upstream):
        leaves = [p.clone().requires_grad_() for p in (x, w, b)]
        flce.fused_linear_cross_entropy(*leaves[:2], t, bias=leaves[2]).backward(torch.tensor(upstream))
        return [p.grad for p in leaves]

    for got, unit in zip(gradients(scale), gradients(1.0), strict=True):
        assert torch.equal(got, (unit.float() * scale).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_strided_and_copied_gradients_are_scaled_in_fp32(dtype):
    """The scaling's paths without the one-launch kernels (a strided gradient; the custom
    op's out-of-place copies): the product in fp32, rounded once, as the kernels'."""
    from flce.driver.scaling import scale_gradients_, scaled_gradients

    gradient = (torch.randn(7, 10) * 1e-2).to(dtype)
    scale = torch.tensor(2.0**16)
    expected = (gradient.float() * scale).to(dtype)
    assert torch.isfinite(expected).all()
    copied, transposed = scaled_gradients([gradient, gradient.t()], scale)
    assert torch.equal(copied, expected) and torch.equal(transposed, expected.t())
    strided = gradient.t().contiguous().t()  # the same values, column-major
    scale_gradients_([strided], scale)
    assert not strided.is_contiguous() and torch.equal(strided, expected)


def test_first_backward_of_a_scalar_loss_scales_the_forwards_gradients_without_the_operands():
    """mean/sum: the forward computed the gradients, the first backward only scales them, so
    it does not unpack the saved operands (host time per step): an operand modified in place
    after the forward still gets the gradient of the loss that was computed. A repeated
    backward recomputes from the operands, and PyTorch refuses the modified one there."""
    x, w, b, t = _inputs()
    expected = [p.clone().requires_grad_() for p in (x, w, b)]
    flce.fused_linear_cross_entropy(*expected[:2], t, bias=expected[2]).backward(torch.tensor(2.0))
    for p in (x, w, b):
        p.requires_grad_()
    loss = flce.fused_linear_cross_entropy(x, w, t, bias=b)
    with torch.no_grad():
        x.add_(1.0)  # bumps x's version counter
    loss.backward(torch.tensor(2.0), retain_graph=True)
    for p, e in zip((x, w, b), expected, strict=True):
        torch.testing.assert_close(p.grad, e.grad, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_batch_statistics_is_the_only_sync_and_runs_once(monkeypatch):
    calls = []
    original = statistics.batch_statistics
    monkeypatch.setattr("flce.plan.batch_statistics", lambda *a: calls.append(1) or original(*a))
    x, w, b, t = _inputs()
    x.requires_grad_()
    flce.fused_linear_cross_entropy(x, w, t, bias=b, reduction="none").sum().backward()
    assert len(calls) == 1


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_batched_time_input_equals_flat(reduction):
    x, w, b, t = _inputs(n=24)
    flat = flce.fused_linear_cross_entropy(x, w, t, bias=b, reduction=reduction, return_predicted_tokens=True)
    batched = flce.fused_linear_cross_entropy(
        x.view(4, 6, -1), w, t.view(4, 6), bias=b, reduction=reduction, return_predicted_tokens=True
    )
    assert batched.predicted_tokens.shape == (4, 6)
    if reduction == "none":
        assert batched.loss.shape == (4, 6)
    torch.testing.assert_close(batched.loss.reshape(-1) if reduction == "none" else batched.loss, flat.loss)


def test_non_contiguous_inputs():
    x, w, b, t = _inputs()
    x_nc = x.t().contiguous().t()  # same values, column-major
    w_nc = torch.stack([w, w], dim=2)[..., 0]  # same values, element stride 2
    assert not x_nc.is_contiguous() and not w_nc.is_contiguous()
    torch.testing.assert_close(
        flce.fused_linear_cross_entropy(x_nc, w_nc, t, bias=b), flce.fused_linear_cross_entropy(x, w, t, bias=b)
    )


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cpu_autocast_with_fp32_parameters(autocast_dtype):
    x, w, b, t = _inputs()
    for p in (x, w, b):
        p.requires_grad_()
    with torch.autocast("cpu", dtype=autocast_dtype):
        loss = flce.fused_linear_cross_entropy(x, w, t, bias=b, lse_square_scale=1e-3, ce_weight=torch.rand(17) + 0.5)
    loss.backward()
    assert loss.dtype == torch.float32
    assert x.grad.dtype == w.grad.dtype == b.grad.dtype == torch.float32
    # The math must be the autocast dtype's: identical to running on inputs cast to it.
    plain = flce.fused_linear_cross_entropy(
        *[p.detach().to(autocast_dtype) for p in (x, w)], t, bias=b.detach().to(autocast_dtype), lse_square_scale=1e-3
    )
    with torch.autocast("cpu", dtype=autocast_dtype):
        auto = flce.fused_linear_cross_entropy(x.detach(), w.detach(), t, bias=b.detach(), lse_square_scale=1e-3)
    torch.testing.assert_close(auto, plain, rtol=0, atol=0)


def test_accumulation_dtype_choices():
    x, w, b, t = _inputs(dtype=torch.bfloat16)
    grads = {}
    for accum in (None, torch.float32, torch.bfloat16):
        wl = w.clone().requires_grad_()
        flce.fused_linear_cross_entropy(x, wl, t, accum_dtype=accum, chunk_size=3).backward()
        assert wl.grad.dtype == torch.bfloat16
        grads[accum] = wl.grad.double()
    torch.testing.assert_close(grads[None], grads[torch.float32], rtol=0, atol=0)  # None means fp32
    leaves = [x.double(), w.double().requires_grad_()]
    fused_linear_cross_entropy_reference(*leaves, t).loss.backward()
    exact = leaves[1].grad
    err = {k: ((g - exact).norm() / exact.norm()).item() for k, g in grads.items()}
    assert err[None] <= err[torch.bfloat16] + 1e-4  # fp32 accumulation is never worse


def test_empty_batch():
    x = torch.randn(0, 8, requires_grad=True)
    w = torch.randn(5, 8, requires_grad=True)
    t = torch.empty(0, dtype=torch.long)
    loss = flce.fused_linear_cross_entropy(x, w, t)
    assert loss.item() == 0.0
    loss.backward()
    assert x.grad.shape == (0, 8) and torch.all(w.grad == 0)
    assert flce.fused_linear_cross_entropy(x, w, t, reduction="none").shape == (0,)


def test_int32_target_accepted():
    x, w, b, t = _inputs()
    torch.testing.assert_close(flce.fused_linear_cross_entropy(x, w, t.int()), flce.fused_linear_cross_entropy(x, w, t))


def test_module_matches_function_and_moves_ce_weight():
    x, w, b, t = _inputs()
    cw = torch.rand(17) + 0.5
    module = flce.FusedLinearCrossEntropyLoss(ce_weight=cw, label_smoothing=0.1)
    assert "ce_weight" in dict(module.named_buffers())
    torch.testing.assert_close(
        module(x, w, t, b), flce.fused_linear_cross_entropy(x, w, t, bias=b, ce_weight=cw, label_smoothing=0.1)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_column_sums_accumulate_in_fp32(dtype):
    """db's helper: the first chunk writes the sum (whatever the buffer held), later ones
    add to it; fp32 sums of the chunk's rows (the CUDA path, a product with a row of ones,
    runs in the GPU tests' bias cases)."""
    from flce.driver.gemm import accumulate_column_sums

    gen = torch.Generator().manual_seed(0)
    chunks_ = [torch.randn(5, 7, generator=gen).to(dtype) for _ in range(3)]
    acc = torch.full((7,), float("nan"))
    for i, a in enumerate(chunks_):
        accumulate_column_sums(acc, a, first=i == 0)
    expected = sum(a.double().sum(dim=0) for a in chunks_)
    torch.testing.assert_close(acc.double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("vocab", [17, 64, 200], ids=lambda v: f"V{v}")
@pytest.mark.parametrize("options", [{}, {"chunk_size": 8}, {"vocab_chunk_size": 128}], ids=["one", "chunks", "blocks"])
def test_logits_rows_are_aligned_for_the_gemms(vocab, options):
    """The logits flce writes have rows a multiple of LOGITS_ROW_ALIGNMENT elements apart,
    whatever V (an aligned leading dimension for the GEMMs: at V = 50257 it took a fwd+bwd
    call from 88.3 to 83.4 ms on an H200), in every chunk and block (the ragged last block
    keeps the full tile's row stride); the kernels read them through the stride, and the
    results equal float64's."""
    n, h = 20, 12
    x, w, b, t = _inputs(n=n, h=h, v=vocab)
    x.requires_grad_()
    w.requires_grad_()
    result = {}

    def call():
        result["loss"] = flce.fused_linear_cross_entropy(x, w, t, backend="torch", **options)
        result["loss"].backward()

    # The logits GEMMs: (rows, columns) from (rows, H) @ (H, columns).
    written = [out.stride(0) for a, _, out in _gemms(call) if a.shape[-1] == h and out.shape[0] <= n]
    loss = result["loss"]
    blocks = "vocab_chunk_size" in options
    stride = sizing.logits_row_stride(min(128, vocab) if blocks else vocab)
    assert written and set(written) == {stride}, written
    assert stride % sizing.LOGITS_ROW_ALIGNMENT == 0
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    expected = fused_linear_cross_entropy_reference(xd, wd, t).loss
    expected.backward()
    assert torch.allclose(loss.double(), expected, rtol=1e-5, atol=1e-6)
    assert torch.allclose(x.grad.double(), xd.grad, rtol=1e-4, atol=1e-6)
    assert torch.allclose(w.grad.double(), wd.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab", [17, 200, 1000], ids=lambda v: f"V{v}")
@pytest.mark.parametrize(
    "options",
    [{}, {"chunk_size": 8}, {"vocab_chunk_size": 128}, {"vocab_chunk_size": 96, "chunk_size": 8}],
    ids=["one", "chunks", "blocks", "blocks-chunks"],
)
def test_biased_logits_rows_are_unpadded_where_the_vocabulary_allows(dtype, vocab, options):
    """A biased logits GEMM writes contiguous rows wherever its columns are a multiple of
    16 bytes (``logits_row_stride``'s ``bias``): cuBLAS adds the bias before its
    one rounding only in the epilogue of a GEMM with a contiguous output, and padded rows
    cost a pass through row slabs (on an H100, V = 50400 took 1.217x the floor with a bias
    against 1.061x at 50432). Every token chunk and vocabulary block, the ragged last
    block included; an unaligned extent keeps the aligned padded rows. The loss and every
    gradient are as close to float64's as eager PyTorch's in the same dtype."""
    n, h = 20, 12
    x, w, b, t = _inputs(n=n, h=h, v=vocab, dtype=dtype)
    for p in (x, w, b):
        p.requires_grad_()
    result = {}

    def call():
        result["loss"] = flce.fused_linear_cross_entropy(x, w, t, bias=b, backend="torch", **options)
        result["loss"].backward()

    # The logits GEMMs, (rows, H) @ (H, columns). Every tile of V = 200 and 1000 (blocks of
    # 128 or 96 and the last of 72, 104, 8 or 40) has aligned columns; V = 17 is split into
    # two column ranges of padded rows.
    written = [out for a, _, out in _gemms(call) if a.shape[-1] == h and out.shape[0] <= n]
    assert written
    for out in written:
        if vocab % (16 // dtype.itemsize) == 0:
            assert out.is_contiguous(), (out.shape, out.stride())
        else:
            assert out.stride(0) % sizing.LOGITS_ROW_ALIGNMENT == 0, (out.shape, out.stride())
    # Against float64, within twice eager PyTorch's error in the same dtype (its logits
    # rounded once to it, the loss in fp32) and a floor of fp32's rounding.
    xd, wd, bd = (p.detach().double().requires_grad_() for p in (x, w, b))
    expected = fused_linear_cross_entropy_reference(xd, wd, t, bias=bd).loss
    expected.backward()
    xe, we, be = (p.detach().clone().requires_grad_() for p in (x, w, b))
    eager = torch.nn.functional.cross_entropy(torch.nn.functional.linear(xe, we, be).float(), t)
    eager.backward()
    pairs = [(result["loss"], eager, expected), (x.grad, xe.grad, xd.grad), (w.grad, we.grad, wd.grad)]
    pairs.append((b.grad, be.grad, bd.grad))
    for ours, theirs, truth in pairs:
        assert relative_error(ours, truth) <= 2 * relative_error(theirs, truth) + 1e-6


def test_biased_logits_row_stride():
    """Unpadded for a bias only where the rows are a multiple of 16 bytes, and only for a
    bias in the buffer's own dtype (the one the GEMM adds)."""

    def biased(vocab: int, dtype: torch.dtype, bias_dtype: torch.dtype | None = None) -> int:
        return sizing.logits_row_stride(vocab, dtype, torch.empty(0, dtype=bias_dtype or dtype))

    assert sizing.logits_row_stride(50400) == 50432
    assert sizing.logits_row_stride(50400, torch.bfloat16) == 50432
    assert biased(50400, torch.bfloat16) == 50400
    assert biased(50400, torch.float32) == 50400
    assert biased(50257, torch.bfloat16) == 50304
    assert biased(1004, torch.bfloat16) == 1024  # 2008 bytes
    assert biased(1004, torch.float32) == 1004  # 4016 bytes
    assert biased(50400, torch.float32, torch.bfloat16) == 50432  # fp32 logits: the bias added apart


def _aligned_or_tail(extent: int, dtype: torch.dtype) -> bool:
    unit = 16 // dtype.itemsize  # 16 bytes: VOCABULARY_EXTENT_ALIGNMENT_BYTES
    return extent % unit == 0 or extent < unit


def _gemm_extents(call) -> list[tuple[int, int, int]]:
    """(M, K, N) of every GEMM ``call`` dispatches."""
    return [(a.shape[0], a.shape[1], b.shape[1]) for a, b, _ in _gemms(call)]


@pytest.mark.parametrize(
    "options",
    [{}, {"chunk_size": 8}, {"vocab_chunk_size": 300}, {"vocab_chunk_size": 384, "chunk_size": 16}, {"inside_dw": 1}],
    ids=["one", "chunks", "unaligned-blocks", "blocks", "inside-dw"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_every_gemm_of_an_odd_vocabulary_has_aligned_extents(monkeypatch, options, dtype):
    """At an odd V every product whose vocabulary extent is unaligned runs as an aligned
    main part and a tail of fewer than 16 bytes (flce.driver.gemm: cuBLAS ran the three
    GEMMs of V = 50257 4.6x slower than the split ones on an H200), in every scheme: the
    logits (bias included), dX, dW and db. The results equal those of the unsplit products
    to two units in the last place (dX's tail is rounded once more); the float64 parity of odd
    vocabularies is the harness's (flce.testing: V = 123, and 6007 inside dW)."""
    options = dict(options)
    inside_dw = options.pop("inside_dw", None) is not None
    # Aligned N and H: only the vocabulary is odd (large enough a dW to hold the workspace).
    n, h, vocab = (64, 256, 6007) if inside_dw else (32, 16, 1031)
    x, w, b, t = _inputs(n=n, h=h, v=vocab, dtype=dtype)
    if inside_dw:
        if dtype == torch.float32:
            pytest.skip("the workspace inside dW holds dX of a 16-bit input only")
        budget, scheme = inside_dw_budget(call_of(x, w, "torch"))
        assert scheme.workspace_in_weight_grad
        options["memory_budget"] = budget
        b = None

    def call():
        leaves = [p.detach().clone().requires_grad_() for p in (x, w, b) if p is not None]
        bias = leaves[2] if b is not None else None
        loss = flce.fused_linear_cross_entropy(leaves[0], leaves[1], t, bias=bias, backend="torch", **options)
        loss.backward()
        return [loss, *(leaf.grad for leaf in leaves)]

    outputs = []
    extents = _gemm_extents(lambda: outputs.append(call()))
    assert extents and all(_aligned_or_tail(extent, dtype) for gemm_ in extents for extent in gemm_), extents
    monkeypatch.setattr(gemm, "VOCABULARY_EXTENT_ALIGNMENT_BYTES", 1)  # no split
    whole = call()
    unsplit = _gemm_extents(call)
    assert not all(_aligned_or_tail(extent, dtype) for gemm_ in unsplit for extent in gemm_)  # the test can fail
    # Two units in the last place: the same sums, in another order (and dX's one more rounding).
    rtol = 2.0**-7 if dtype == torch.bfloat16 else 1e-5
    for name, got, expected in zip(("loss", "dX", "dW", "db"), outputs[0], whole, strict=False):
        torch.testing.assert_close(got, expected, rtol=rtol, atol=1e-6, msg=name)


@pytest.mark.parametrize("head", ["logprobs", "distillation"])
def test_the_heads_gemms_of_an_odd_vocabulary_have_aligned_extents(head):
    """The logprobs and distillation heads run on the same products: split at an odd V
    (the teacher's logits GEMM too), aligned for the dtype each GEMM runs in (on a CPU the
    distillation's are fp32: ``flce.heads.distillation.divergence_dtypes``)."""
    n, h, vocab = 32, 16, 1031
    x, w, _, t = _inputs(n=n, h=h, v=vocab, dtype=torch.bfloat16)
    x.requires_grad_()
    w.requires_grad_()

    def call():
        if head == "logprobs":
            out = flce.fused_linear_logprobs(x, w, t, backend="torch")
            out.logprobs.sum().backward()
        else:
            teacher_x, teacher_w = x.detach() * 0.5, w.detach().flip(0)
            flce.fused_linear_distillation(x, w, teacher_x, teacher_w, t, backend="torch").backward()

    gemms = _gemms(call)
    extents = [(a.shape[0], a.shape[1], b.shape[1]) for a, b, _ in gemms]
    assert any(vocab - 7 <= max(e) < vocab for e in extents), extents  # the split ran
    assert all(_aligned_or_tail(extent, a.dtype) for a, b, _ in gemms for extent in (*a.shape, b.shape[1])), extents


@pytest.mark.parametrize("vocabulary", ["rows", "columns", "reduction"])
@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("vocab", [5, 8, 29], ids=lambda v: f"V{v}")
def test_split_products_equal_the_whole_product(vocabulary, first, vocab):
    """``accumulate_product`` of each vocabulary axis, split or not, equals the product in
    float64 (whose unit of 16 bytes is 2 elements: V = 29 splits, 8 does not, 5 does)."""
    gen = torch.Generator().manual_seed(1)
    shapes = {"rows": ((vocab, 6), (6, 4)), "columns": ((6, 4), (4, vocab)), "reduction": ((6, vocab), (vocab, 4))}
    (m, k), (_, cols) = shapes[vocabulary]
    f64 = dict(generator=gen, dtype=torch.float64)
    a, b, acc = torch.randn(m, k, **f64), torch.randn(k, cols, **f64), torch.randn(m, cols, **f64)
    expected = a @ b if first else acc + a @ b
    gemm.accumulate_product(acc, a, b, first, vocabulary=vocabulary)
    torch.testing.assert_close(acc, expected, rtol=1e-12, atol=1e-12)
    assert gemm.vocabulary_main_extent(vocab, torch.float64) == (vocab if vocab % 2 == 0 or vocab < 2 else vocab - 1)


def test_vocabulary_main_extent():
    assert gemm.vocabulary_main_extent(50257, torch.bfloat16) == 50256
    assert gemm.vocabulary_main_extent(50304, torch.bfloat16) == 50304
    assert gemm.vocabulary_main_extent(32001, torch.float16) == 32000
    assert gemm.vocabulary_main_extent(50258, torch.float32) == 50256
    assert gemm.vocabulary_main_extent(7, torch.bfloat16) == 7  # narrower than 16 bytes: no split


@pytest.mark.parametrize("bias", [False, True])
def test_logits_product_split_equals_the_whole(bias):
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(5, 8, generator=gen, dtype=torch.float64), torch.randn(13, 8, generator=gen, dtype=torch.float64)
    b = torch.randn(13, generator=gen, dtype=torch.float64) if bias else None
    out = torch.empty(5, 16, dtype=torch.float64)[:, :13]  # aligned rows, as the drivers' buffers
    gemm.logits_product(out, x, w.t(), b)
    torch.testing.assert_close(out, x @ w.t() + (0 if b is None else b), rtol=1e-12, atol=1e-12)


# ------------------------------------------------------- full-precision reductions
def _reduction_flags() -> tuple[bool, bool]:
    matmul = torch.backends.cuda.matmul
    return matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction


@pytest.fixture
def reductions_allowed():
    matmul = torch.backends.cuda.matmul
    saved = _reduction_flags()
    matmul.allow_bf16_reduced_precision_reduction = True
    matmul.allow_fp16_reduced_precision_reduction = True
    yield
    matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction = saved


def test_full_precision_reductions_clear_the_flags_inside_and_restore_them_after_an_error(reductions_allowed):
    with pytest.raises(RuntimeError, match="inside"):
        with gemm.full_precision_reductions():
            assert _reduction_flags() == (False, False)
            with gemm.full_precision_reductions():  # nested: still cleared after the inner one
                pass
            assert _reduction_flags() == (False, False)
            raise RuntimeError("inside")
    assert _reduction_flags() == (True, True)


def test_full_precision_reductions_hold_while_any_thread_is_inside(reductions_allowed):
    # Thread A enters, B enters, A leaves while B's dW GEMM would be queued: the flags must
    # stay cleared for B, and be restored once B leaves too.
    import threading

    a_inside, b_inside, a_left, b_may_leave = (threading.Event() for _ in range(4))
    seen_by_b = []

    def thread_a():
        with gemm.full_precision_reductions():
            a_inside.set()
            b_inside.wait(5)
        a_left.set()

    def thread_b():
        a_inside.wait(5)
        with gemm.full_precision_reductions():
            b_inside.set()
            a_left.wait(5)
            seen_by_b.append(_reduction_flags())
            b_may_leave.wait(5)

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for thread in threads:
        thread.start()
    a_left.wait(5)
    b_may_leave.set()
    for thread in threads:
        thread.join(5)
    assert seen_by_b == [(False, False)]
    assert _reduction_flags() == (True, True)


# a row per slab, 3 rows, 200 rows (taken down to 128: two slabs of 128 and one of 44), every row
@pytest.mark.parametrize("slab_bytes", [1, 3 * 13 * 8, 200 * 13 * 8, 2**20])
def test_biased_logits_in_row_slabs_fill_padded_rows(slab_bytes):
    """The path of a biased product into padded rows on CUDA (``_biased_logits``: cuBLAS
    adds a bias before its one rounding only into a contiguous output), its slabs checked
    here in float64."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(300, 8, generator=gen, dtype=torch.float64)
    w, b = torch.randn(13, 8, generator=gen, dtype=torch.float64), torch.randn(13, generator=gen, dtype=torch.float64)
    padded = torch.full((300, 16), float("nan"), dtype=torch.float64)
    gemm._biased_logits_in_row_slabs(padded[:, :13], x, w.t(), b, slab_bytes)
    torch.testing.assert_close(padded[:, :13], x @ w.t() + b, rtol=1e-12, atol=1e-12)
    assert padded[:, 13:].isnan().all()  # the padding is left alone
