"""Parity of the fused loss (torch backend, shared driver) against the float64
reference, with tolerances tied to eager PyTorch's own error in the same dtype
(``flce.testing``: err <= 3 x err_torch + eps)."""

import itertools
import math

import pytest
import torch

import flce
from flce.dispatch import availability
from flce.testing import FEATURES, Case, run_case

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
REDUCTIONS = ["mean", "sum", "none"]
# Which leaves require grad: all, and each alone (Liger returned no weight gradient
# when only the weight required grad).
GRADS = [("input", "weight", "bias"), ("input",), ("weight",), ("bias",)]


def _assert_passes(case: Case, backend: str = "torch") -> None:
    outcome = run_case(case, backend, CPU)
    assert outcome.passed, f"{case.name}: {outcome.failures} errors={outcome.errors}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_feature_matrix(feature, reduction, dtype, bias):
    # Odd shape, several chunks with a ragged last one (47 = 2 x 16 + 15).
    _assert_passes(Case(feature=feature, reduction=reduction, dtype=dtype, bias=bias, chunk_size=16))


@pytest.mark.parametrize("grads", GRADS, ids="+".join)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("feature", ["plain", "all"])
def test_which_tensors_require_grad(grads, reduction, feature):
    _assert_passes(Case(feature=feature, reduction=reduction, bias=True, grads=grads, chunk_size=10))


@pytest.mark.parametrize(
    "n_rows,hidden,vocab,chunk_size",
    [
        (1, 8, 7, None),  # a single row
        (3, 5, 7, 1),  # one row per chunk
        (47 * 31, 123, 1031, None),  # the odd (B*T, H, V) of the contract tests, default chunking
        (47 * 31, 123, 1031, 500),  # several chunks, ragged last (1457 = 2 x 500 + 457)
        (64, 16, 123, 64),  # exactly one chunk
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_shapes(n_rows, hidden, vocab, chunk_size, dtype):
    _assert_passes(
        Case(
            n_rows=n_rows,
            hidden=hidden,
            vocab=vocab,
            chunk_size=chunk_size,
            dtype=dtype,
            feature="all",
            reduction="mean",
            bias=True,
        )
    )


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_ignore_index_equal_to_a_real_class(reduction):
    # Class 3 is both a vocabulary entry and the ignore index: its rows must vanish.
    _assert_passes(Case(feature="all", reduction=reduction, ignore_index=3, vocab=7, ignored_fraction=0.3))


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("feature", ["plain", "all"])
def test_all_rows_ignored(reduction, feature):
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(11, 8, requires_grad=True)
    b = torch.randn(11, requires_grad=True)
    target = torch.full((6,), -100)
    kwargs = dict(FEATURES[feature])
    if kwargs.pop("ce_weight", None):
        kwargs["ce_weight"] = torch.rand(11) + 0.5
    import flce

    out = flce.fused_linear_cross_entropy(x, w, target, bias=b, reduction=reduction, **kwargs)
    loss = out.loss if isinstance(out, flce.CrossEntropyOutput) else out
    assert torch.all(loss == 0)
    loss.sum().backward()
    for t in (x, w, b):
        assert torch.isfinite(t.grad).all() and torch.all(t.grad == 0)
    if isinstance(out, flce.CrossEntropyOutput) and out.predicted_tokens is not None:
        assert torch.all(out.predicted_tokens == -1)
        assert torch.all(out.token_accuracy == 0)


VOCAB_BLOCK_BACKENDS = ["torch"] + (["triton"] if availability("triton", CPU)[0] else [])
VOCAB_BLOCK_FEATURES = ["plain", "label_smoothing", "softcap", "ce_weight", "accuracy", "all"]


def vocabulary_block_cases():
    """Every feature x reduction x dtype on the torch backend. Through Triton's interpreter
    a case takes ~7 s (a launch per token chunk and block, two passes): there every
    feature x reduction in bf16, and every dtype with all the features at once, which
    keeps each dtype's loads and stores and each feature's math covered at a third of the
    CI time."""
    for backend in VOCAB_BLOCK_BACKENDS:
        for dtype in DTYPES:
            for reduction in REDUCTIONS:
                for feature in VOCAB_BLOCK_FEATURES:
                    if backend == "triton" and dtype != torch.bfloat16 and feature != "all":
                        continue
                    case_id = f"{feature}-{reduction}-{dtype}-{backend}"
                    yield pytest.param(backend, dtype, reduction, feature, id=case_id)


@pytest.mark.parametrize(("backend", "dtype", "reduction", "feature"), vocabulary_block_cases())
def test_vocabulary_blocks(backend, dtype, reduction, feature):
    # V = 123 in blocks of 40 (40 + 40 + 40 + 3) x token chunks of 16 (ragged both ways).
    _assert_passes(
        Case(feature=feature, reduction=reduction, dtype=dtype, bias=True, chunk_size=16, vocab_chunk_size=40), backend
    )


@pytest.mark.parametrize("grads", GRADS, ids="+".join)
def test_vocabulary_blocks_which_tensors_require_grad(grads):
    _assert_passes(Case(feature="all", reduction="mean", bias=True, grads=grads, chunk_size=10, vocab_chunk_size=7))


def test_vocabulary_blocks_refuse_a_split_row_backend_that_cannot_run_here():
    # cutedsl has split-row kernels, but they need an sm_90+ CUDA GPU: on the CPU the
    # request is refused with the backend's own reason, not silently rerouted.
    import flce
    from flce.dispatch import BackendUnavailableError

    x, w, t = torch.randn(4, 8), torch.randn(11, 8), torch.randint(0, 11, (4,))
    ok, why = availability("cutedsl", CPU)
    assert not ok
    with pytest.raises(BackendUnavailableError, match="backend 'cutedsl' cannot run on cpu") as info:
        flce.fused_linear_cross_entropy(x, w, t, vocab_chunk_size=4, backend="cutedsl")
    assert why in str(info.value)


def test_split_row_kernels_of_each_backend():
    # Every registered backend fills the split-row slot; building the kernels launches and
    # imports nothing (the in-place ones import their kernel module on first use).
    from flce.dispatch import BACKEND_NAMES, get_backend

    for name in BACKEND_NAMES:
        kernels = get_backend(name).split_rows()
        assert kernels.name == name
        assert kernels.extra_bytes_per_logit == (0 if name != "torch" else get_backend("torch").extra_bytes_per_logit)


# ------------------------------------------------ predicted tokens of rows with a NaN logit

# Columns whose weight row holds one +-inf: their logit is NaN where the row's hidden
# value there is 0 (inf * 0), +-inf elsewhere, so the rows below hold NaN and +inf logits
# in various columns of every vocabulary block (V = 300: the Triton interpreter's blocks of
# 256 leave three steps, [0, 256), [256, 288) and the last 12 columns).
NAN_VOCAB, NAN_HIDDEN = 300, 4
INF_COLUMNS = {5: (0, math.inf), 140: (0, -math.inf), 260: (1, math.inf), 290: (2, math.inf), 299: (2, -math.inf)}


def nan_logit_problem(vocab: int = NAN_VOCAB, inf_columns: dict = INF_COLUMNS):
    """``x, w, target``: every sign pattern of the first three hidden values (27 rows, each
    with NaN and/or +-inf logits), and a row of NaN only; targets at the eager argmax on
    every other row (so token accuracy is 1 there exactly when the NaN's index agrees).
    ``vocab`` columns, of which ``inf_columns`` (column -> (hidden index, +-inf)) are the
    weight rows holding one +-inf."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(vocab, NAN_HIDDEN, generator=gen)
    for column, (k, value) in inf_columns.items():
        w[column] = 0.0
        w[column, k] = value
    signs = torch.tensor(list(itertools.product((0.0, 1.0, -1.0), repeat=3)))
    x = torch.cat([signs, torch.randn(len(signs), 1, generator=gen)], dim=1)
    x = torch.cat([x, torch.full((1, NAN_HIDDEN), math.nan)])
    eager = (x @ w.T).argmax(dim=-1)
    target = torch.randint(0, vocab, (len(x),), generator=gen)
    target[::2] = eager[::2]
    return x, w, target, eager


def predictions_of(x, w, target, backend: str, **options) -> tuple[list[int], list[float]]:
    """The fused loss's predicted tokens and token accuracy per row (``reduction="none"``)."""
    out = flce.fused_linear_cross_entropy(
        x,
        w,
        target,
        reduction="none",
        return_predicted_tokens=True,
        return_token_accuracy=True,
        backend=backend,
        **options,
    )
    return out.predicted_tokens.tolist(), out.token_accuracy.tolist()


NAN_SCHEMES = {
    "whole-rows": dict(),
    "row-chunks": dict(chunk_size=4),
    "vocab-blocks-64": dict(chunk_size=8, vocab_chunk_size=64),
    "vocab-blocks-100": dict(vocab_chunk_size=100),
}


@pytest.mark.parametrize("scheme", list(NAN_SCHEMES))
@pytest.mark.parametrize("backend", VOCAB_BLOCK_BACKENDS)
def test_predicted_tokens_of_rows_with_a_nan_logit_follow_torch_argmax(backend, scheme):
    """torch.argmax ranks a NaN above every number (the first NaN's index wins; among
    numbers the first maximum): every scheme and backend must agree with it, the vocabulary
    blocks' combination included (a block's max shifted away its NaN, or a NaN block max
    never compared equal to the row's, gave column 0 or another block's argmax)."""

    x, w, target, eager = nan_logit_problem()
    assert (x @ w.T).isnan().any(dim=-1).sum() >= 19, "most rows should hold a NaN logit"
    predicted, accuracy = predictions_of(x, w, target, backend, **NAN_SCHEMES[scheme])
    assert predicted == eager.tolist()
    assert accuracy == (eager == target).float().tolist()


def minus_inf_rows_problem(vocab: int = NAN_VOCAB, hidden: int = NAN_HIDDEN):
    """``x, w, target``: rows whose every logit is -inf (each weight row's first value is
    -inf, each row's first hidden value positive), where torch.argmax names column 0."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(vocab, hidden, generator=gen)
    w[:, 0] = -math.inf
    x = torch.randn(6, hidden, generator=gen)
    x[:, 0] = torch.rand(6, generator=gen) + 0.5
    return x, w, torch.randint(0, vocab, (6,), generator=gen)


@pytest.mark.parametrize("scheme", list(NAN_SCHEMES))
@pytest.mark.parametrize("backend", VOCAB_BLOCK_BACKENDS)
def test_predicted_token_of_a_row_of_only_minus_inf_logits_is_column_0(backend, scheme):
    """Every candidate ties at -inf: torch.argmax names the first column, not a sentinel
    past the vocabulary (an index no embedding table holds)."""
    x, w, target = minus_inf_rows_problem()
    assert (x @ w.T).eq(-math.inf).all()
    out = flce.fused_linear_cross_entropy(
        x, w, target, reduction="none", return_predicted_tokens=True, backend=backend, **NAN_SCHEMES[scheme]
    )
    assert out.predicted_tokens.tolist() == [0] * len(x)
    logits = flce.cross_entropy(x @ w.T, target, reduction="none", return_predicted_tokens=True, backend=backend)
    assert logits.predicted_tokens.tolist() == [0] * len(x)


@pytest.mark.parametrize("backend", VOCAB_BLOCK_BACKENDS)
def test_predicted_tokens_of_given_logits_and_logprobs_with_a_nan_follow_torch_argmax(backend):
    import flce

    x, w, target, eager = nan_logit_problem()
    logits = x @ w.T
    logits[3, [17, 280]] = math.nan  # a positive NaN (inf * 0 gives a negative one here)
    eager = logits.argmax(dim=-1)
    out = flce.cross_entropy(logits, target, return_predicted_tokens=True, return_token_accuracy=True, backend=backend)
    assert out.predicted_tokens.tolist() == eager.tolist()
    lp = flce.fused_linear_logprobs(x, w, target, return_predicted_tokens=True, backend=backend)
    assert lp.predicted_tokens.tolist() == (x @ w.T).argmax(dim=-1).tolist()


# ------------------------------------------------ constants made under torch.inference_mode()

INFERENCE_CALLS = {
    "fused": lambda x, w, t, cw, **o: flce.fused_linear_cross_entropy(x, w, t, ce_weight=cw, **o),
    "vocab-blocks": lambda x, w, t, cw, **o: flce.fused_linear_cross_entropy(
        x, w, t, ce_weight=cw, vocab_chunk_size=5, **o
    ),
    "logits": lambda x, w, t, cw, **o: flce.cross_entropy(x @ w.T, t, weight=cw, **o),
    "logprobs": lambda x, w, t, cw, backend, reduction: (
        flce.fused_linear_logprobs(x, w, t, backend=backend, chunk_size=3).logprobs
    ),
}


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("entry", list(INFERENCE_CALLS))
@pytest.mark.parametrize("backend", VOCAB_BLOCK_BACKENDS)
def test_a_target_and_class_weights_made_under_inference_mode_are_constants(backend, entry, reduction):
    """A target or class weights made under torch.inference_mode() are inference tensors,
    which save_for_backward refuses ("Inference tensors cannot be saved for backward"):
    they are constants of the loss, and give the results of the same values made normally,
    a repeated backward (which recomputes from the operands) included."""
    gen = torch.Generator().manual_seed(8)
    x, w = torch.randn(7, 8, generator=gen), torch.randn(13, 8, generator=gen)
    target, class_weights = torch.randint(0, 13, (7,), generator=gen), torch.rand(13, generator=gen) + 0.5
    target[1] = -100
    with torch.inference_mode():
        inference_target, inference_weights = target.clone(), class_weights.clone()

    def run(t, cw):
        leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
        loss = INFERENCE_CALLS[entry](*leaves, t, cw, backend=backend, reduction=reduction)
        grads = torch.autograd.grad(loss.sum(), leaves, retain_graph=True)
        return loss.detach(), grads, torch.autograd.grad(loss.sum(), leaves)

    torch.testing.assert_close(run(inference_target, inference_weights), run(target, class_weights), rtol=0, atol=0)
