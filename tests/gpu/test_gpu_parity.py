"""GPU parity of every GPU backend against float64, at small and real vocabularies,
64-bit indexing, memory stability and the chunk budget. Skipped without CUDA."""

import pytest
import torch

from flce.options import LossOptions
from flce.testing import FEATURES, Case, make_tensors, run_case
from tests.budgets import call_of, inside_dw_budget
from tests.gpu.common import CUDA, skip_unless_usable

if not torch.cuda.is_available():
    pytest.skip("GPU parity suite: needs a CUDA GPU", allow_module_level=True)

pytestmark = pytest.mark.gpu

GPU_BACKENDS = ["torch", "triton", "cutedsl"]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(
    "feature",
    ["plain", "label_smoothing", "z_loss", "softcap", "ce_weight", "token_scaling", "accuracy", "all"],
)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_feature_matrix(backend, dtype, reduction, feature, bias):
    skip_unless_usable(backend)
    case = Case(
        n_rows=93, hidden=64, vocab=1031, dtype=dtype, reduction=reduction, feature=feature, bias=bias, chunk_size=40
    )
    outcome = run_case(case, backend, CUDA)
    assert outcome.passed, f"{case.name}: {outcome.failures} {outcome.errors}"


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("grads", [("input",), ("weight",), ("bias",)], ids="+".join)
def test_which_tensors_require_grad(backend, grads):
    skip_unless_usable(backend)
    case = Case(n_rows=50, hidden=32, vocab=257, feature="all", bias=True, grads=grads, dtype=torch.bfloat16)
    outcome = run_case(case, backend, CUDA)
    assert outcome.passed, f"{case.name}: {outcome.failures} {outcome.errors}"


@pytest.mark.parametrize("backend", GPU_BACKENDS)
# 50257 (GPT-2) and 32001 (a token added to 32000): odd vocabularies, whose GEMMs run split
# at an aligned column (flce.driver.gemm.vocabulary_main_extent).
@pytest.mark.parametrize("vocab", [32000, 32001, 50257, 128256, 151936, 262144])
@pytest.mark.parametrize("feature", ["plain", "all"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_real_vocabularies(backend, vocab, feature, dtype):
    skip_unless_usable(backend)
    case = Case(n_rows=64, hidden=128, vocab=vocab, dtype=dtype, feature=feature, bias=feature == "all")
    outcome = run_case(case, backend, CUDA)
    assert outcome.passed, f"{case.name}: {outcome.failures} {outcome.errors}"


@pytest.mark.parametrize("backend", ["triton", "cutedsl"])
def test_64bit_offsets_inside_one_chunk(backend):
    """N x V >= 2^31 logits in a single chunk: rows past the 2^31-th element must be as
    right as eager PyTorch in bf16 is (a 32-bit offset would read another row: garbage)."""
    skip_unless_usable(backend)
    import flce
    from flce.reference import fused_linear_cross_entropy_reference
    from flce.testing import EPS, TOLERANCE_FACTOR, relative_error

    n, h, v = 16384, 64, 131104  # n * v = 2^31 + 2^19
    assert n * v >= 2**31
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(v, h, device="cuda", generator=gen) * 0.5).bfloat16()
    t = torch.randint(0, v, (n,), device="cuda", generator=gen)
    loss = flce.fused_linear_cross_entropy(x, w, t, reduction="none", chunk_size=n, backend=backend)
    loss.backward(torch.ones_like(loss))
    rows = torch.arange(n - 8, n, device="cuda")  # their logits start past element 2^31
    results = {}
    for name, dtype, math in (("truth", torch.float64, torch.float64), ("eager", torch.bfloat16, torch.float32)):
        xr = x.detach()[rows].to(dtype).requires_grad_()
        ref = fused_linear_cross_entropy_reference(
            xr, w, t[rows], logits_dtype=dtype, math_dtype=math, reduction="none"
        )
        ref.loss.sum().backward()
        results[name] = (ref.loss.detach(), xr.grad)
    for index, ours in ((0, loss.detach()[rows]), (1, x.grad[rows])):
        err, err_torch = (
            relative_error(ours, results["truth"][index]),
            relative_error(results["eager"][index], results["truth"][index]),
        )
        assert err <= TOLERANCE_FACTOR * err_torch + EPS[torch.bfloat16], (index, err, err_torch)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_no_memory_growth_over_200_steps(backend):
    skip_unless_usable(backend)
    import flce

    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(8192, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 8192, (512,), device="cuda")

    def step():
        flce.fused_linear_cross_entropy(x, w, t, backend=backend, label_smoothing=0.1).backward()
        x.grad = w.grad = None

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(200):
        step()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


@pytest.mark.parametrize("backend", ["triton", "cutedsl", "torch"])
@pytest.mark.parametrize("n,v", [(8192, 32000), (8192, 128256), (4096, 151936)])
def test_peak_memory_follows_the_documented_formula(backend, n, v):
    """Peak extra memory within 10% of the formula in flce/driver/sizing.py's docstring (for the
    torch backend, whose workspace term is an upper bound: at most the formula + 10%)."""
    skip_unless_usable(backend)
    import flce
    from flce.dispatch import get_backend
    from flce.driver.sizing import peak_extra_bytes, whole_row_chunk_size

    h = 4096
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(v, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, v, (n,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    flce.fused_linear_cross_entropy(x, w, t, backend=backend).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    extra = get_backend(backend).extra_bytes_per_logit
    chunk = whole_row_chunk_size(n, v, h, torch.bfloat16, torch.bfloat16, extra, True)
    formula = peak_extra_bytes(n, v, h, 2, extra, chunk)
    message = f"peak {peak / 2**30:.3f} GiB vs formula {formula / 2**30:.3f} GiB"
    assert peak <= 1.1 * formula, message
    if backend != "torch":
        assert peak >= 0.9 * formula, message


# cutedsl on Hopper takes the blocks' first pass from its fused statistics GEMM in bf16
# (in fp32, and for "all", whose class weights come with label smoothing, block by block).
# 50257: the last block has 257 columns, read by cutedsl in 16-byte vectors, the last ragged.
@pytest.mark.parametrize("backend", ["triton", "torch", "cutedsl"])
@pytest.mark.parametrize("vocab", [32000, 50257, 151936])
@pytest.mark.parametrize("feature", ["plain", "all"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_vocabulary_blocks_real_vocabularies(backend, vocab, feature, dtype):
    skip_unless_usable(backend)
    case = Case(
        n_rows=96,
        hidden=128,
        vocab=vocab,
        dtype=dtype,
        feature=feature,
        bias=feature == "all",
        chunk_size=40,
        vocab_chunk_size=10000,
    )
    outcome = run_case(case, backend, CUDA)
    assert outcome.passed, f"{case.name}: {outcome.failures} {outcome.errors}"


@pytest.mark.parametrize("chunk_size", [2048, None], ids=["2048-rows", "one-chunk"])
def test_vocabulary_blocks_peak_memory(chunk_size):
    """Exact fp32 dW with only a block of it in fp32: peak extra within the formula of
    flce.driver.vocab_blocks (+10%), far below the whole-row driver's. With one row
    chunk (the default here) each dW block is written directly: no V_b x H fp32 term."""
    skip_unless_usable("triton")
    import flce

    n, h, v, block = 8192, 4096, 128256, 16032
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(v, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, v, (n,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    flce.fused_linear_cross_entropy(x, w, t, backend="triton", vocab_chunk_size=block, chunk_size=chunk_size).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    # The block buffer is freed before dX's bf16 cast: the larger of the two counts. Its
    # rows are logits_row_stride(block) = 16064 elements apart (aligned for the GEMMs).
    stride = 16064
    if chunk_size is None:
        formula = n * h * 4 + v * h * 2 + max(n * stride * 2, n * h * 2)
    else:
        formula = n * h * 4 + v * h * 2 + max(chunk_size * stride * 2 + block * h * 4, n * h * 2)
    message = f"peak {peak / 2**30:.3f} GiB vs formula {formula / 2**30:.3f} GiB"
    assert 0.99 * formula <= peak <= 1.1 * formula, message


@pytest.mark.parametrize("backend", ["triton", "cutedsl"])
def test_vocabulary_blocks_inside_dw_at_the_reference_shape(backend):
    """N = 8192, H = 4096, V = 128256, bf16: under a budget that holds the blocks' workspace
    inside dW, the call peaks at the predicted bytes (within 1%; the returned gradients and
    one block), and its loss, dX and dW are bit for bit those of the plain blocks of the
    same width (the same GEMMs and kernels, in the same order)."""
    skip_unless_usable(backend)
    import flce

    n, h, v = 8192, 4096, 128256
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda")
    budget, scheme = inside_dw_budget(call_of(x, w, backend))

    def run(**options):
        loss = flce.fused_linear_cross_entropy(x, w, t, backend=backend, **options)
        loss.backward()
        out = loss.detach(), x.grad, w.grad
        x.grad = w.grad = None
        return out

    run(memory_budget=budget)  # compiled
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    inside = run(memory_budget=budget)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base  # the returned gradients included, as in the model
    assert abs(peak / scheme.memory.peak - 1) < 0.01, (peak / 2**30, scheme.memory.peak / 2**30, scheme)
    plain = run(vocab_chunk_size=scheme.block, chunk_size=n)
    for got, expected in zip(inside, plain, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("backend", ["triton", "torch", "cutedsl"])
@pytest.mark.parametrize("vocab", [32000, 151936])
@pytest.mark.parametrize("feature", ["plain", "all"])
def test_vocabulary_blocks_inside_dw_real_vocabularies(monkeypatch, backend, vocab, feature):
    """float64 parity of the vocabulary blocks with their workspace inside dW (bf16: the
    variant needs a 16-bit dX and dW), every output and gradient."""
    skip_unless_usable(backend)
    case = Case(n_rows=96, hidden=128, vocab=vocab, dtype=torch.bfloat16, feature=feature, bias=feature == "all")
    tensors = make_tensors(case, CUDA)
    options = LossOptions(**{k: v for k, v in FEATURES[feature].items() if k != "ce_weight"})
    call = call_of(tensors.input, tensors.weight, backend, tensors.bias, options, tensors.ce_weight is not None)
    budget, _ = inside_dw_budget(call)
    monkeypatch.setenv("FLCE_MEMORY_BUDGET_MIB", repr(budget / 2**20))
    outcome = run_case(case, backend, CUDA)
    assert outcome.passed, f"{case.name}: {outcome.failures} {outcome.errors}"
