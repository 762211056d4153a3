"""The reliability cases of ``tests/test_reliability.py`` on a CUDA GPU, for the triton
and cutedsl backends, in fp32 and bf16: every tensor in every layout, NaN/Inf in an
ignored row, class weights summing to 0 over the valid targets, create_graph refused;
plus the cutedsl loss-only route (the fused forward GEMM on Hopper), which the CPU
cannot reach."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("GPU reliability tests: need a CUDA GPU", allow_module_level=True)

from flce.dispatch import availability
from flce.driver import gemm
from flce.driver.sizing import logits_row_stride
from flce.testing import relative_error
from tests.entry_points import (
    ENTRIES,
    FUSED_ENTRIES,
    Problem,
    assert_close_to_reference,
    assert_matches_reference,
    assert_predictions,
    fused_leaves,
    plain_fused,
    process_group_of_one,  # noqa: F401 (a fixture)
    reference,
    run_entry,
)
from tests.test_reliability import (
    FEATURE_SETS,
    FUSED_LAYOUTS,
    FUSED_ROUTES,
    IGNORED_ROW,
    LOGITS_LAYOUTS,
    NON_FINITE,
    ZERO_WEIGHT_ROUTES,
    check_class_weights_summing_to_zero,
    check_create_graph_refused,
    check_every_tensor_strided,
    check_fused_non_finite_ignored_row,
    check_non_finite_logits_of_an_ignored_row,
    check_strided_fused,
    check_strided_logits,
)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("process_group_of_one")]

CUDA = torch.device("cuda")
GPU_BACKENDS = [
    pytest.param(name, marks=pytest.mark.skipif(not availability(name, CUDA)[0], reason=availability(name, CUDA)[1]))
    for name in ("triton", "cutedsl")
]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("route", list(FUSED_ROUTES))
@pytest.mark.parametrize("layout", FUSED_LAYOUTS, ids=lambda layout: layout.name)
def test_gpu_strided_fused_tensors(backend, dtype, route, layout):
    check_strided_fused(backend, route, layout, dtype)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LOGITS_LAYOUTS, ids=lambda layout: layout.name)
def test_gpu_strided_logits_tensors(backend, dtype, layout):
    check_strided_logits(backend, layout, dtype)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("entry", list(ENTRIES), ids=str)
def test_gpu_every_entry_point_with_every_tensor_strided(backend, dtype, entry):
    check_every_tensor_strided(backend, ENTRIES[entry], dtype)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("route", list(FUSED_ROUTES))
@pytest.mark.parametrize("bad", list(NON_FINITE))
@pytest.mark.parametrize("features", list(FEATURE_SETS))
def test_gpu_fused_non_finite_hidden_state_of_an_ignored_row(backend, dtype, route, bad, features):
    check_fused_non_finite_ignored_row(backend, route, bad, features, dtype)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bad", list(NON_FINITE))
@pytest.mark.parametrize("where", ["row", "one-logit"])
@pytest.mark.parametrize("features", list(FEATURE_SETS))
def test_gpu_non_finite_logits_of_an_ignored_row(backend, dtype, bad, where, features):
    check_non_finite_logits_of_an_ignored_row(backend, bad, where, features, dtype)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("route", list(ZERO_WEIGHT_ROUTES))
@pytest.mark.parametrize("z_loss", [0.0, 0.05], ids=["no-z", "z"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1], ids=["no-ls", "ls"])
def test_gpu_class_weights_summing_to_zero_over_the_valid_targets(backend, dtype, route, z_loss, smoothing):
    check_class_weights_summing_to_zero(backend, route, z_loss, smoothing, dtype)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("entry", list(ENTRIES), ids=str)
def test_gpu_create_graph_is_refused(backend, reduction, entry):
    check_create_graph_refused(backend, reduction, ENTRIES[entry], torch.bfloat16)


# ------------------------------------------------- the cutedsl loss-only route (Hopper)
# Nothing requires grad, bf16, H a multiple of 64: the per-row outputs come from the
# fused forward GEMM's statistics (no logits). Strided operands are made TMA-ready (or the
# call falls back to the chunked driver); an ignored row's NaN stays in its statistics.

LOSS_ONLY_HIDDEN, LOSS_ONLY_VOCAB = 128, 300
LOSS_ONLY_OPTIONS = dict(
    lse_square_scale=1e-3, return_z_loss=True, return_token_accuracy=True, return_predicted_tokens=True
)


def _loss_only_leaves():
    return fused_leaves(16, LOSS_ONLY_HIDDEN, LOSS_ONLY_VOCAB, ignored=(IGNORED_ROW, 5))


LOSS_ONLY_LAYOUTS = {
    "contiguous": plain_fused,
    "input-transposed": lambda L: dict(plain_fused(L), x=L["x"].t().contiguous().t()),
    "input-sliced": lambda L: dict(plain_fused(L), x=L["x"].repeat_interleave(2, dim=1)[:, ::2]),
    "target-sliced": lambda L: dict(plain_fused(L), t=L["t"].repeat_interleave(2)[::2]),
    "target-expanded": lambda L: dict(plain_fused(L), t=L["t"][2:3].expand(16)),
    "weight-transposed": lambda L: dict(plain_fused(L), w=L["w"].t().contiguous().t()),
    "bias-expanded": lambda L: dict(plain_fused(L), bias=L["b"][:1].expand(LOSS_ONLY_VOCAB)),
}


@pytest.mark.skipif(not availability("cutedsl", CUDA)[0], reason=availability("cutedsl", CUDA)[1])
@pytest.mark.parametrize("layout", list(LOSS_ONLY_LAYOUTS))
def test_gpu_cutedsl_loss_only_route_with_strided_operands(layout):
    entry = FUSED_ENTRIES["fused"]
    problem = Problem(_loss_only_leaves(), LOSS_ONLY_LAYOUTS[layout], LOSS_ONLY_OPTIONS, (), dtype=torch.bfloat16)
    outputs, grads = run_entry(entry, problem, "cutedsl")
    assert grads == {}
    assert_matches_reference(entry, problem, outputs, grads)


@pytest.mark.skipif(not availability("cutedsl", CUDA)[0], reason=availability("cutedsl", CUDA)[1])
@pytest.mark.parametrize("bad", list(NON_FINITE))
def test_gpu_cutedsl_loss_only_route_with_a_non_finite_ignored_row(bad):
    entry = FUSED_ENTRIES["fused"]
    leaves = _loss_only_leaves()
    clean = Problem(leaves, plain_fused, LOSS_ONLY_OPTIONS, (), dtype=torch.bfloat16)
    x = leaves["x"].clone()
    x[IGNORED_ROW, 0] = NON_FINITE[bad]
    poisoned = Problem(dict(leaves, x=x), plain_fused, LOSS_ONLY_OPTIONS, (), dtype=torch.bfloat16)
    (loss, z_loss, accuracy, predicted), _ = run_entry(entry, poisoned, "cutedsl")
    truth, _ = reference("fused", clean)
    eager, _ = reference("fused", clean, torch.float32, torch.bfloat16)
    floor = 2 * torch.finfo(torch.bfloat16).eps
    assert_close_to_reference("loss", loss, truth[0], eager[0], floor)
    assert_close_to_reference("z_loss", z_loss, truth[1], eager[1], floor)
    assert predicted[IGNORED_ROW].item() == -1
    assert_predictions("fused", clean, (loss, z_loss, accuracy, predicted), truth)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("masked", ["prefix", "middle"])
@pytest.mark.parametrize("scheme", ["loss-only", "one-chunk", "vocabulary-blocks"])
def test_gpu_a_masked_part_of_the_vocabulary_is_a_zero_probability(backend, dtype, masked, scheme):
    """A -inf bias over whole tiles (the fused forward's 256 columns, a Triton block, a
    vocabulary block) is a zero probability, as in eager PyTorch, on every route."""
    entry = FUSED_ENTRIES["fused"]
    leaves = fused_leaves(16, LOSS_ONLY_HIDDEN, 1000, ignored=(IGNORED_ROW,))
    columns = slice(0, 512) if masked == "prefix" else slice(256, 768)
    leaves["b"][columns] = float("-inf")
    leaves["t"][leaves["t"] >= 0] = 900
    options = dict(vocab_chunk_size=256) if scheme == "vocabulary-blocks" else {}
    differentiable = () if scheme == "loss-only" else ("x", "w", "b")
    problem = Problem(leaves, plain_fused, dict(LOSS_ONLY_OPTIONS, **options), differentiable, dtype=dtype)
    outputs, grads = run_entry(entry, problem, backend)
    assert_matches_reference(entry, problem, outputs, grads)


# ------------------------------------------------ predicted tokens of rows with a NaN logit

NAN_ENTRIES = ["fused-grad", "loss-only", "vocabulary-blocks", "logits", "logprobs"]
# The problem of tests/test_functional.py (V = 300: a row in one CTA of a few warps, two
# tiles of the fused GEMM, vocabulary blocks of 64 columns), and a wide one whose NaN and
# +inf columns lie far apart: V = 40000 splits a row of the CE kernel with the gradient over
# a cluster of CTAs (4 in bf16, 8 in fp32) and streams it through the 8 warps of one CTA
# without it, gives the fused GEMM 157 tiles (4 lanes of the combining kernel per row), and
# the partial kernels blocks of 8192 columns (8 warps).
NAN_WIDTHS = {
    "narrow": (dict(), 64),
    "wide": (
        dict(
            vocab=40000,
            inf_columns={
                17: (0, float("inf")),
                9001: (0, float("-inf")),
                20003: (1, float("inf")),
                31000: (2, float("inf")),
                39998: (2, float("-inf")),
            },
        ),
        8192,
    ),
}


@pytest.mark.parametrize("backend", ["torch", *GPU_BACKENDS])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("entry", NAN_ENTRIES)
@pytest.mark.parametrize("width", list(NAN_WIDTHS))
def test_gpu_predicted_tokens_of_rows_with_a_nan_logit_follow_torch_argmax(backend, dtype, entry, width):
    """torch.argmax ranks a NaN above every number (the first NaN's index wins): every GPU
    kernel's argmax must agree, the CE kernel's (its warps', CTA's and cluster's merges),
    the fused forward GEMM's tile epilogue and its combination, the vocabulary blocks'
    partial kernels, the logits kernel and the logprobs head. The problem's logits are NaN
    or +-inf by construction (inf * 0 and inf * +-1), so the answer does not depend on the
    dtype's rounding."""
    import torch.nn.functional as F

    import flce
    from tests.test_functional import nan_logit_problem, predictions_of

    problem, vocab_chunk_size = NAN_WIDTHS[width]
    x, w, target, _ = nan_logit_problem(**problem)
    # Padded with zero columns to the fused GEMM's K tile; the padding adds exact zeros.
    x, w = (F.pad(t, (0, LOSS_ONLY_HIDDEN - t.shape[1])).to(CUDA, dtype) for t in (x, w))
    target = target.to(CUDA)
    eager = (x.float() @ w.float().T).argmax(dim=-1).tolist()
    if entry == "logits":
        logits = x @ w.T
        logits[3, [17, 280]] = float("nan")
        logits.requires_grad_()  # the CE kernel with the gradient: a wide row on a cluster
        out = flce.cross_entropy(logits, target, return_predicted_tokens=True, backend=backend)
        assert out.predicted_tokens.tolist() == logits.float().argmax(dim=-1).tolist()
        return
    if entry == "logprobs":
        if backend == "cutedsl":
            pytest.skip("cutedsl has no logprobs kernels (the call says so; the Triton ones serve Hopper)")
        out = flce.fused_linear_logprobs(x, w, target, return_predicted_tokens=True, backend=backend)
        assert out.predicted_tokens.tolist() == eager
        return
    options = dict(vocab_chunk_size=vocab_chunk_size) if entry == "vocabulary-blocks" else {}
    x.requires_grad_(entry != "loss-only")
    with torch.set_grad_enabled(entry != "loss-only"):
        predicted, accuracy = predictions_of(x, w, target, backend, **options)
    assert predicted == eager
    assert accuracy == [float(p == t) for p, t in zip(eager, target.tolist(), strict=True)]


@pytest.mark.parametrize("backend", ["torch", *GPU_BACKENDS])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("entry", ["fused-grad", "loss-only", "vocabulary-blocks", "logits"])
@pytest.mark.parametrize("vocab", [300, 40000])
def test_gpu_predicted_token_of_a_row_of_only_minus_inf_logits_is_column_0(backend, dtype, entry, vocab):
    """Every candidate ties at -inf: torch.argmax names column 0, where the kernels' argmax
    started from a sentinel past the vocabulary that no -inf replaced (the CE and partial
    kernels' threads, the fused forward's tile combination)."""
    import torch.nn.functional as F

    import flce
    from tests.test_functional import minus_inf_rows_problem

    x, w, target = minus_inf_rows_problem(vocab)
    x, w = (F.pad(t, (0, LOSS_ONLY_HIDDEN - t.shape[1])).to(CUDA, dtype) for t in (x, w))
    target = target.to(CUDA)
    if entry == "logits":
        logits = (x @ w.T).requires_grad_()
        out = flce.cross_entropy(logits, target, reduction="none", return_predicted_tokens=True, backend=backend)
    else:
        options = dict(vocab_chunk_size=vocab // 5) if entry == "vocabulary-blocks" else {}
        x.requires_grad_(entry != "loss-only")
        with torch.set_grad_enabled(entry != "loss-only"):
            out = flce.fused_linear_cross_entropy(
                x, w, target, reduction="none", return_predicted_tokens=True, backend=backend, **options
            )
    assert out.predicted_tokens.tolist() == [0] * len(x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("vocab", [1000, 50400, 32000])  # padded rows (GPT-J's 50400 with its bias), unpadded
def test_gpu_biased_logits_are_rounded_once_into_padded_rows(dtype, vocab):
    """``x @ W^T + b`` into the drivers' logits buffer (rows padded to
    ``LOGITS_ROW_ALIGNMENT``) as accurate as ``F.linear``'s, which adds the bias before its
    one rounding; CUDA's addmm into padded rows rounds the product before adding the bias
    (1.2-1.8x eager's gradient error under fp16 autocast), which the driver avoids."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(512, 64, generator=gen, device="cuda").to(dtype)
    w = torch.randn(vocab, 64, generator=gen, device="cuda").to(dtype)
    b = (4 * torch.randn(vocab, generator=gen, device="cuda")).to(dtype)
    exact = x.double() @ w.double().t() + b.double()
    out = torch.empty(512, logits_row_stride(vocab), device="cuda", dtype=dtype)[:, :vocab]
    gemm.logits_product(out, x, w.t(), b)
    error, eager_error = relative_error(out, exact), relative_error(torch.nn.functional.linear(x, w, b), exact)
    assert error <= 1.05 * eager_error, f"{error:.3g} against F.linear's {eager_error:.3g}"
