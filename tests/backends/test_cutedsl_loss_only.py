"""The loss-only path through the fused forward statistics (``cutedsl`` backend, Hopper).

A call that needs no gradient computes its per-row outputs from
``fused_forward_statistics`` (lse, z'_y, argmax, sum z') where
the backend's ``loss_only`` slot applies (``flce.driver.fused.loss_only_refusal`` for the
options, ``flce.backends.cutedsl.fused_forward_applicable`` for the device and operands),
else from the chunked driver; both must mean the same thing.

The vocabulary-block scheme takes its first pass (the rows' statistics) from the same
slot where it applies, for calls with gradients too.

CPU part (runs in CI): the selection functions' every condition; the row formulas of
``flce.driver.fused.run_fused_statistics`` against the torch backend's chunk kernel on
the same logits; and the whole public call with the kernel replaced by a dense stand-in
computing the same statistics (and asserting the kernel's operand requirements), judged
by the parity harness against float64, with the fallbacks; the same for the vocabulary
blocks' first pass, and the chooser's account of it.

GPU part (sm_90 and nvidia-cutlass-dsl): the public call with ``backend="cutedsl"`` goes
through the real kernel and passes the parity harness for each supported feature, loss
only and through the vocabulary blocks; the kernel's workspace and the blocks' peak
against the memory model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util

import pytest
import torch

import flce
from flce import plan as flce_plan
from flce.backends import cutedsl
from flce.backends.base import LossOnlyStatistics
from flce.backends.cutedsl import fused_forward_applicable
from flce.backends.torch.ce import cross_entropy_chunk as torch_chunk
from flce.dispatch import get_backend, split_rows_of
from flce.driver import fused, vocab_blocks
from flce.driver.chunks import GradRequest, allocate_rows
from flce.driver.schemes import MemoryBudgetError, describe_call, predicted_seconds, scheme_for_call
from flce.driver.statistics import batch_statistics, chunk_scalars
from flce.options import LossOptions
from flce.reference import fused_linear_cross_entropy_reference
from flce.testing import Case, run_case
from tests.aten_ops import NO_KERNEL_OPS, AtenOps, op_name
from tests.backends.cutedsl_gpu import block_gradient_reference

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
HOPPER = (9, 0)

# Every option the fused statistics support at once, without and with class weights (the
# weighted set has no label smoothing: that pair needs a weighted logit sum).
ALL_UNWEIGHTED = (
    ("label_smoothing", 0.2),
    ("lse_square_scale", 1e-3),
    ("return_z_loss", True),
    ("softcap", 4.0),
    ("use_token_scaling", True),
    ("return_token_accuracy", True),
    ("return_predicted_tokens", True),
)
ALL_WEIGHTED = (
    ("ce_weight", True),
    ("lse_square_scale", 1e-3),
    ("return_z_loss", True),
    ("softcap", 4.0),
    ("use_token_scaling", True),
    ("return_token_accuracy", True),
    ("return_predicted_tokens", True),
)
FUSED_FEATURES = {
    "plain": (),
    "label_smoothing": (("label_smoothing", 0.1),),
    "z_loss": (("lse_square_scale", 1e-3), ("return_z_loss", True)),
    "softcap": (("softcap", 4.0),),
    "ce_weight": (("ce_weight", True),),
    "token_scaling": (("use_token_scaling", True),),
    "accuracy": (("return_token_accuracy", True), ("return_predicted_tokens", True)),
    "all_unweighted": ALL_UNWEIGHTED,
    "all_weighted": ALL_WEIGHTED,
}
SMOOTHING_WITH_WEIGHTS = (("label_smoothing", 0.1), ("ce_weight", True), ("return_token_accuracy", True))


# ---------------------------------------------------------------------- selection (CPU)
def _applicable(
    options=None,
    capability=HOPPER,
    dtype=BF16,
    hidden=4096,
    vocab=128256,
    has_ce_weight=False,
    weight_tma_ready=True,
    monkeypatch=None,
):
    """Both selection steps: the options' (any backend), then the device's and operands'."""
    refusal = fused.loss_only_refusal(options or LossOptions(), has_ce_weight)
    if refusal is not None:
        return False, refusal
    monkeypatch.setattr(cutedsl, "_capability", lambda device_type, index: capability)
    return fused_forward_applicable(torch.device("cuda"), dtype, hidden, vocab, weight_tma_ready)


def test_selection_accepts_every_supported_feature(monkeypatch):
    assert _applicable(monkeypatch=monkeypatch) == (True, "")
    assert _applicable(dtype=FP16, hidden=64, vocab=1, monkeypatch=monkeypatch)[0]
    assert _applicable(
        LossOptions(
            label_smoothing=0.1,
            softcap=30.0,
            lse_square_scale=1e-4,
            reduction="none",
            use_token_scaling=True,
            return_token_accuracy=True,
            return_predicted_tokens=True,
            return_z_loss=True,
        ),
        monkeypatch=monkeypatch,
    )[0]
    # Class weights are gathered on the host: fine without smoothing.
    assert _applicable(LossOptions(lse_square_scale=1e-4), has_ce_weight=True, monkeypatch=monkeypatch)[0]
    # A token chunk size bounds the driver's logits buffer; the fused kernel has none.
    assert _applicable(LossOptions(chunk_size=7), monkeypatch=monkeypatch)[0]


def test_only_backends_with_the_slot_have_the_route():
    # The route is the backend's loss_only slot: the Triton and torch backends have none.
    assert get_backend("cutedsl").loss_only is not None
    assert get_backend("triton").loss_only is None and get_backend("torch").loss_only is None


@pytest.mark.parametrize(
    "change,reason",
    [
        (dict(options=LossOptions(vocab_chunk_size=4096)), "vocab_chunk_size"),
        (dict(capability=None), "sm_90a"),
        (dict(capability=(8, 0)), "sm_90a"),
        (dict(capability=(10, 0)), "sm_90a"),  # Blackwell has no WGMMA
        (dict(dtype=FP32), "bfloat16/float16"),
        (dict(hidden=4000), "multiple of 64"),
        (dict(hidden=0), "multiple of 64"),
        (dict(vocab=2**30), "int32"),
        (dict(options=LossOptions(label_smoothing=0.1), has_ce_weight=True), "weighted logit sum"),
        (dict(weight_tma_ready=False), "contiguous"),
    ],
)
def test_selection_falls_back(monkeypatch, change, reason):
    ok, why = _applicable(**change, monkeypatch=monkeypatch)
    assert not ok and reason in why


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl is not installed")
def test_selection_constants_match_the_kernel():
    from flce.backends import cutedsl
    from flce.backends.cutedsl import fused_forward as ff

    assert cutedsl.FUSED_FORWARD_BLOCK_K == ff.BLOCK_K
    assert cutedsl.FUSED_FORWARD_MAX_VOCAB == ff.INT32_MAX // 2


# ---------------------------------------------------------------------- row formulas (CPU)
def _dense_statistics(z: torch.Tensor, target: torch.Tensor) -> dict:
    """What the kernel returns, from given logits ``z'`` (fp32)."""
    vocab = z.shape[1]
    in_range = (target >= 0) & (target < vocab)
    target_logit = z.gather(1, target.clamp(0, vocab - 1).long()[:, None])[:, 0]
    return dict(
        lse=torch.logsumexp(z, 1),
        target_logit=torch.where(in_range, target_logit, torch.zeros_like(target_logit)),
        predicted=z.argmax(1),
        logit_sum=z.sum(1),
    )


def _scalars(options: LossOptions, target, ce_weight, vocab):
    stats = batch_statistics(target, ce_weight, vocab, options.ignore_index)
    return stats, chunk_scalars(options, stats)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("feature", list(FUSED_FEATURES))
@pytest.mark.parametrize("ignore_index", [-100, 5])  # 5: a real class id, and the target of some rows
def test_rows_match_the_chunk_kernel(reduction, feature, ignore_index):
    """Same logits, two formulas: the statistics path and the torch chunk kernel."""
    gen = torch.Generator().manual_seed(len(feature) + ignore_index)
    rows, vocab = 57, 301
    z = torch.randn(rows, vocab, generator=gen) * 3
    z[torch.arange(rows), torch.randint(0, vocab, (rows,), generator=gen)] += 6  # peaked rows
    target = torch.randint(0, vocab, (rows,), generator=gen)
    target[::5] = ignore_index
    target[1::7] = 5
    opts = dict(FUSED_FEATURES[feature])
    ce_weight = (torch.rand(vocab, generator=gen) + 0.5) if opts.pop("ce_weight", False) else None
    options = LossOptions(reduction=reduction, ignore_index=ignore_index, **opts)
    _, scalars = _scalars(options, target, ce_weight, vocab)

    hook = LossOnlyStatistics(
        applicable=None,
        statistics=lambda x, w, y, bias, softcap, with_logit_sum: _dense_statistics(x.float(), y),
        workspace_bytes=cutedsl.fused_forward_workspace_bytes,
    )
    softcapped = z if options.softcap is None else options.softcap * torch.tanh(z / options.softcap)
    # The "GEMM" of an identity weight: the statistics of the given logits.
    ours = fused.run_fused_statistics(
        hook, softcapped, torch.eye(vocab), target, None, ce_weight, options, torch.float32, scalars
    )
    expected = allocate_rows(rows, options, z.device)
    torch_chunk(
        z.clone(), target, ce_weight, scalars, **expected.chunk_kwargs(0, rows), row_grad_scale=None, compute_grad=False
    )
    for name in ("loss", "z_loss", "correct", "predicted"):
        got, want = getattr(ours, name), getattr(expected, name)
        assert (got is None) == (want is None), name
        if got is not None:
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5, msg=name)


# ---------------------------------------------------------------------- the whole call on CPU
def _kernel_stand_in(input, weight, target, bias=None, softcap=None, with_logit_sum=False):
    """``fused_forward_statistics`` computed densely, with the operand requirements the
    real kernel's TMA and WGMMA impose asserted, so the caller's preparation is checked."""
    assert input.dtype in (BF16, FP16) and weight.dtype == input.dtype
    for t in (input, weight):
        assert t.is_contiguous() and t.data_ptr() % 16 == 0
    assert input.shape[1] % 64 == 0
    assert target.dtype in (torch.int64, torch.int32)
    assert bias is None or bias.dtype == input.dtype  # rounded to the compute dtype, as the driver does
    z = input.float() @ weight.float().t()
    if bias is not None:
        z = z + bias.float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    out = _dense_statistics(z, target)
    if not with_logit_sum:
        del out["logit_sum"]
    return out


def _block_gradient_stand_in(
    x, w_block, b_block, out, grad_target, row_max, inv_sum, onehot_coef, smooth_coef, z_coef, weight_sum, softcap
):
    """The ``block_gradient`` slot computed densely (the block's fp32 logits, the kernel's
    formulas, stored in the compute dtype), with the operand demands of the real kernel
    asserted: the driver's preparation is checked."""
    assert x.dtype in (BF16, FP16) and w_block.dtype == x.dtype and out.dtype == x.dtype
    assert w_block.is_contiguous() and w_block.data_ptr() % 16 == 0 and x.shape[1] % 64 == 0
    assert out.shape == (x.shape[0], w_block.shape[0]) and out.stride(-1) == 1
    assert (out.shape[0] <= 1 or out.stride(0) % 2 == 0) and out.data_ptr() % 4 == 0
    assert b_block is None or b_block.dtype == x.dtype
    z = x.float() @ w_block.float().t()
    if b_block is not None:
        z = z + b_block.float()
    z[grad_target < 0] = 0.0  # an ignored row's logits are never used
    out.copy_(
        block_gradient_reference(
            z, grad_target, row_max, inv_sum, onehot_coef, smooth_coef, z_coef, weight_sum, softcap
        )
    )


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """Makes the CPU look like a Hopper GPU with the cutedsl backend: the chunked driver
    runs the torch chunk kernel, the fused paths the dense stand-ins. -> list of calls."""
    spec = dataclasses.replace(
        get_backend("torch"),
        name="cutedsl",
        loss_only=LossOnlyStatistics(
            applicable=fused_forward_applicable,
            statistics=_kernel_stand_in,
            workspace_bytes=cutedsl.fused_forward_workspace_bytes,
        ),
        block_gradient=_block_gradient_stand_in,
    )
    monkeypatch.setattr(flce_plan, "resolve_backend", lambda backend, device: spec)
    monkeypatch.setattr(cutedsl, "_capability", lambda device_type, index: HOPPER)
    return _count_fused_calls(monkeypatch)


def _count_fused_calls(monkeypatch) -> list:
    calls = []
    real = fused.run_fused_statistics

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(flce_plan, "run_fused_statistics", counted)
    return calls


CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("feature", list(FUSED_FEATURES))
def test_cpu_stand_in_matches_float64(fused_on_cpu, dtype, reduction, feature):
    # N = 93: a ragged count of rows; H = 64: the smallest the kernel takes; V = 1031 prime.
    case = Case(
        n_rows=93,
        hidden=64,
        vocab=1031,
        dtype=dtype,
        reduction=reduction,
        feature=feature,
        options=FUSED_FEATURES[feature],
        bias=feature.startswith("all"),
        grads=(),
        seed=len(feature),
    )
    outcome = run_case(case, "cutedsl", CPU)
    assert outcome.passed, f"{case.name}: {outcome.failures} {outcome.errors}"
    assert len(fused_on_cpu) == 1


def _problem(n=45, h=64, v=211, dtype=BF16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=gen).to(dtype)
    w = (torch.randn(v, h, generator=gen) * 0.5).to(dtype)
    b = torch.randn(v, generator=gen).to(dtype)
    y = torch.randint(0, v, (n,), generator=gen)
    y[::4] = -100
    return x, w, b, y


ALL_OPTIONS = dict(
    label_smoothing=0.1,
    lse_square_scale=1e-3,
    softcap=5.0,
    use_token_scaling=True,
    return_z_loss=True,
    return_token_accuracy=True,
    return_predicted_tokens=True,
)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "nothing_requires_grad"])
def test_cpu_every_loss_only_mode_uses_it(fused_on_cpu, mode):
    x, w, b, y = _problem()
    leaves = [t.clone().requires_grad_(mode != "nothing_requires_grad") for t in (x, w, b)]
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode, torch.enable_grad)
    with context():
        out = flce.fused_linear_cross_entropy(*leaves[:2], y, bias=leaves[2], backend="cutedsl", **ALL_OPTIONS)
    assert len(fused_on_cpu) == 1
    assert not out.loss.requires_grad
    # The chunked driver (gradients requested) gives the same outputs, up to its logits
    # being rounded to bf16 where the fused GEMM keeps them in fp32.
    chunked = flce.fused_linear_cross_entropy(
        x.clone().requires_grad_(), w, y, bias=b, backend="cutedsl", **ALL_OPTIONS
    )
    assert len(fused_on_cpu) == 1
    torch.testing.assert_close(out.loss, chunked.loss.detach(), rtol=1e-2, atol=0)
    torch.testing.assert_close(out.z_loss, chunked.z_loss, rtol=1e-2, atol=0)


@pytest.mark.parametrize("budget_from", ["option", "environment"])
def test_cpu_it_runs_only_within_the_memory_budget(fused_on_cpu, monkeypatch, budget_from):
    """The fused statistics' workspace (one launch's tile statistics and the row outputs)
    is the loss-only route's: a memory budget below it runs the chooser's scheme that fits
    instead (token chunks here), and a budget nothing fits is refused as for any call."""
    x, w, _, y = _problem(n=512, h=64, v=2048)
    fused_workspace = cutedsl.fused_forward_workspace_bytes(512, 2048, False, False)

    def loss_under(budget: int) -> torch.Tensor:
        monkeypatch.delenv("FLCE_MEMORY_BUDGET_MIB", raising=False)
        if budget_from == "option":
            return flce.fused_linear_cross_entropy(x, w, y, backend="cutedsl", memory_budget=budget)
        monkeypatch.setenv("FLCE_MEMORY_BUDGET_MIB", repr(budget / 2**20))
        return flce.fused_linear_cross_entropy(x, w, y, backend="cutedsl")

    expected = loss_under(fused_workspace + 2**20)
    assert len(fused_on_cpu) == 1
    budget = fused_workspace * 2 // 3  # above one row of logits and its kernel's workspace (28 KiB)
    torch.testing.assert_close(loss_under(budget), expected, rtol=1e-2, atol=0)
    assert len(fused_on_cpu) == 1
    with pytest.raises(MemoryBudgetError, match="is below the least this call can run in"):
        loss_under(2**10)


def test_cpu_gradients_never_use_it(fused_on_cpu):
    x, w, _, y = _problem()
    loss = flce.fused_linear_cross_entropy(x.requires_grad_(), w, y, backend="cutedsl")
    loss.backward()
    assert len(fused_on_cpu) == 0 and x.grad is not None


def test_cpu_per_token_forward_uses_it_and_backward_recomputes(fused_on_cpu):
    """reduction="none" computes no gradient in its forward (the backward recomputes the
    chunks with the per-token upstream gradient), so that forward takes the fused route."""
    x, w, _, y = _problem()
    x_fused = x.clone().requires_grad_()
    loss = flce.fused_linear_cross_entropy(x_fused, w, y, backend="cutedsl", reduction="none")
    assert len(fused_on_cpu) == 1
    upstream = torch.linspace(0.5, 1.5, loss.numel())
    (loss * upstream).sum().backward()
    assert len(fused_on_cpu) == 1  # the backward ran the chunked driver
    x_ref = x.clone().requires_grad_()
    ref = flce.fused_linear_cross_entropy(x_ref, w, y, backend="torch", reduction="none")
    (ref * upstream).sum().backward()
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-2, atol=0)
    torch.testing.assert_close(x_fused.grad, x_ref.grad)


def test_cpu_autocast_and_odd_layouts(fused_on_cpu):
    x, w, b, y = _problem()
    # fp32 parameters under autocast: the compute dtype is bf16, the weight is cast (as the
    # driver casts it) and the fused path applies.
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        flce.fused_linear_cross_entropy(x.float(), w.float(), y, bias=b.float(), backend="cutedsl")
    assert len(fused_on_cpu) == 1
    # (B, T, H) input that is not contiguous: flattening copies it, the path still applies.
    x3 = torch.cat([x, x]).view(2, 45, 64).transpose(0, 1)
    with torch.no_grad():
        out = flce.fused_linear_cross_entropy(x3, w, y.repeat(2).view(2, 45).t(), backend="cutedsl", reduction="none")
    assert len(fused_on_cpu) == 2 and out.shape == (45, 2)
    # A 2-D input that is not row-major, and one that is but not 16-byte aligned: copied.
    with torch.no_grad():
        flce.fused_linear_cross_entropy(x.t().contiguous().t(), w, y, backend="cutedsl")
        shifted = torch.empty(x.numel() + 1, dtype=x.dtype)[1:].view_as(x).copy_(x)
        assert shifted.data_ptr() % 16
        flce.fused_linear_cross_entropy(shifted, w, y, backend="cutedsl")
    assert len(fused_on_cpu) == 4
    # int16 targets are widened for the kernel; ignore_index a real class id.
    with torch.no_grad():
        flce.fused_linear_cross_entropy(x, w, y.clamp(min=0).to(torch.int16), ignore_index=0, backend="cutedsl")
    assert len(fused_on_cpu) == 5


@pytest.mark.parametrize(
    "why",
    [
        "smoothing_with_weights",
        "fp32",
        "hidden_not_multiple_of_64",
        "weight_not_contiguous",
        "fp32_weight_not_contiguous_autocast",
        "not_hopper",
    ],
)
def test_cpu_falls_back_silently_and_correctly(fused_on_cpu, monkeypatch, why):
    x, w, _, y = _problem()
    kwargs = dict(reduction="sum", return_token_accuracy=True, label_smoothing=0.1)
    ce_weight = None
    autocast = contextlib.nullcontext()
    if why == "smoothing_with_weights":
        ce_weight = torch.rand(w.shape[0]) + 0.5
    elif why == "fp32":
        x, w = x.float(), w.float()
    elif why == "hidden_not_multiple_of_64":
        x, w = x[:, :40].contiguous(), w[:, :40].contiguous()
    elif why == "weight_not_contiguous":
        w = w.t().contiguous().t()
    elif why == "fp32_weight_not_contiguous_autocast":
        # Casting to bf16 keeps the transposed strides: the kernel could not read it.
        x, w = x.float(), w.float().t().contiguous().t()
        autocast = torch.autocast("cpu", dtype=BF16)
    elif why == "not_hopper":
        monkeypatch.setattr(cutedsl, "_capability", lambda device_type, index: (10, 0))
    with torch.no_grad(), autocast:
        out = flce.fused_linear_cross_entropy(x, w, y, ce_weight=ce_weight, backend="cutedsl", **kwargs)
    assert len(fused_on_cpu) == 0
    ref = fused_linear_cross_entropy_reference(
        x.double(), w.double(), y, None, ce_weight=ce_weight, reduction="sum", label_smoothing=0.1
    )
    torch.testing.assert_close(out.loss.double(), ref.loss, rtol=2e-2, atol=0)


def test_cpu_all_rows_ignored_and_no_rows(fused_on_cpu):
    x, w, _, y = _problem()
    with torch.no_grad():
        out = flce.fused_linear_cross_entropy(x, w, torch.full_like(y, -100), backend="cutedsl", **ALL_OPTIONS)
        assert out.loss.item() == 0.0 and out.z_loss.item() == 0.0 and out.token_accuracy.item() == 0.0
        assert bool((out.predicted_tokens == -1).all())
        empty = flce.fused_linear_cross_entropy(x[:0], w, y[:0], backend="cutedsl", reduction="none")
    assert empty.shape == (0,)


# ---------------------------------------------- the vocabulary blocks' first pass (CPU)
class _CountingKernels:
    """Split-row kernels that count the calls of their statistics and gradient passes."""

    def __init__(self, kernels, counts: dict) -> None:
        self._kernels, self._counts = kernels, counts

    def __getattr__(self, name):
        return getattr(self._kernels, name)

    def statistics(self, *args, **kwargs):
        self._counts["block_statistics"] += 1
        return self._kernels.statistics(*args, **kwargs)

    def gradient(self, *args, **kwargs):
        self._counts["gradient_pass"] += 1
        return self._kernels.gradient(*args, **kwargs)


@pytest.fixture
def first_passes(monkeypatch) -> dict:
    """Counts how the vocabulary blocks' passes ran: ``fused`` (one call of the fused
    statistics), ``block_statistics`` (the split-row statistics pass of each block), and
    in the second pass ``block_gradient`` (the block-gradient GEMM) and ``gradient_pass``
    (the split-row gradient pass over a block's logits)."""
    counts = {"fused": 0, "block_statistics": 0, "block_gradient": 0, "gradient_pass": 0}
    real_fused, real_blocks = vocab_blocks.fused_whole_row_statistics, flce_plan.run_vocab_blocks

    def fused_counted(*args, **kwargs):
        counts["fused"] += 1
        return real_fused(*args, **kwargs)

    def blocks_counted(*args, **kwargs):
        args = list(args)
        args[6] = _CountingKernels(args[6], counts)  # run_vocab_blocks' split-row kernels
        gemm = kwargs.get("fused_gradient")
        if gemm is not None:

            def gradient_counted(*a, **k):
                counts["block_gradient"] += 1
                return gemm(*a, **k)

            kwargs["fused_gradient"] = gradient_counted
        return real_blocks(*args, **kwargs)

    monkeypatch.setattr(vocab_blocks, "fused_whole_row_statistics", fused_counted)
    monkeypatch.setattr(flce_plan, "run_vocab_blocks", blocks_counted)
    return counts


BLOCK_CASES = [(BF16, feature) for feature in FUSED_FEATURES] + [(FP16, "plain"), (FP16, "all_unweighted")]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(("dtype", "feature"), BLOCK_CASES, ids=[f"{d}-{f}" for d, f in BLOCK_CASES])
def test_cpu_vocab_blocks_take_their_first_pass_from_it(fused_on_cpu, first_passes, dtype, reduction, feature):
    """Forward and every gradient through vocabulary blocks (V = 1031 in ragged blocks of
    300, token chunks of 40) whose row statistics come from the fused statistics in one
    call, judged against float64; no block runs the statistics pass."""
    case = Case(
        n_rows=93,
        hidden=64,
        vocab=1031,
        dtype=dtype,
        reduction=reduction,
        feature=feature,
        options=FUSED_FEATURES[feature],
        bias=feature.startswith("all"),
        chunk_size=40,
        vocab_chunk_size=300,
        seed=len(feature) + 7,
    )
    outcome = run_case(case, "cutedsl", CPU)
    assert outcome.passed, f"{case.name}: {outcome.failures} {outcome.errors}"
    assert first_passes["fused"] >= 1 and first_passes["block_statistics"] == 0
    # The second pass from the block-gradient GEMM: no logits GEMM and gradient pass.
    assert first_passes["block_gradient"] >= 1 and first_passes["gradient_pass"] == 0
    assert len(fused_on_cpu) == 0  # gradients: never the loss-only route


def test_cpu_vocab_blocks_without_the_block_gradient_gemm(fused_on_cpu, first_passes, monkeypatch):
    """A backend with the fused statistics but no block-gradient GEMM runs its second pass
    as a logits GEMM and a gradient pass per block, to the same float64 judgement."""
    spec = dataclasses.replace(flce_plan.resolve_backend("cutedsl", CPU), block_gradient=None)
    monkeypatch.setattr(flce_plan, "resolve_backend", lambda backend, device: spec)
    case = Case(
        n_rows=93,
        hidden=64,
        vocab=1031,
        dtype=BF16,
        feature="all_unweighted",
        options=FUSED_FEATURES["all_unweighted"],
        bias=True,
        chunk_size=40,
        vocab_chunk_size=300,
    )
    outcome = run_case(case, "cutedsl", CPU)
    assert outcome.passed, f"{case.name}: {outcome.failures} {outcome.errors}"
    assert first_passes["fused"] >= 1 and first_passes["block_gradient"] == 0 and first_passes["gradient_pass"] > 0


def test_cpu_vocab_blocks_first_pass_in_one_chunk_and_without_gradients(fused_on_cpu, first_passes):
    x, w, b, y = _problem()
    options = dict(bias=b, backend="cutedsl", vocab_chunk_size=64, **ALL_OPTIONS)
    # One row chunk: each dW block written by one GEMM.
    leaves = [t.clone().requires_grad_() for t in (x, w)]
    out = flce.fused_linear_cross_entropy(*leaves, y, **options)
    out.loss.backward()
    ref_leaves = [t.double().requires_grad_() for t in (x, w)]
    math_options = {name: value for name, value in ALL_OPTIONS.items() if not name.startswith("return_")}
    ref = fused_linear_cross_entropy_reference(*ref_leaves, y, b.double(), **math_options)
    ref.loss.backward()
    torch.testing.assert_close(out.loss.double(), ref.loss, rtol=2e-2, atol=1e-3)
    for got, want in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=5e-2, atol=5e-3)
    assert first_passes == {"fused": 1, "block_statistics": 0, "block_gradient": 4, "gradient_pass": 0}
    # Without gradients vocab_chunk_size still selects the blocks (the loss-only route
    # refuses it), whose one pass is then the fused statistics.
    with torch.no_grad():
        loss_only = flce.fused_linear_cross_entropy(x, w, y, **options)
    assert first_passes == {"fused": 2, "block_statistics": 0, "block_gradient": 4, "gradient_pass": 0}
    assert len(fused_on_cpu) == 0
    torch.testing.assert_close(loss_only.loss, out.loss.detach())


def test_cpu_vocab_blocks_queue_the_fused_gemm_first(fused_on_cpu, monkeypatch):
    """The fused first pass is the blocks' first launch: the targets' bookkeeping and the
    row outputs, a dozen small ops that left the GPU idle for 1.1-1.6 ms before it (traced
    on an H200 at N = 8192, V = 32000 and 128256), follow it."""
    x, w, b, y = _problem()
    real_blocks, real_fused = flce_plan.run_vocab_blocks, vocab_blocks.fused_whole_row_statistics
    with AtenOps() as ops:
        marks = {}

        def blocks_entry(*args, **kwargs):
            marks["entry"] = len(ops.names)
            return real_blocks(*args, **kwargs)

        def fused_entry(*args, **kwargs):
            marks["fused"] = len(ops.names)
            return real_fused(*args, **kwargs)

        monkeypatch.setattr(flce_plan, "run_vocab_blocks", blocks_entry)
        monkeypatch.setattr(vocab_blocks, "fused_whole_row_statistics", fused_entry)
        leaves = [t.clone().requires_grad_() for t in (x, w)]
        flce.fused_linear_cross_entropy(*leaves, y, bias=b, backend="cutedsl", vocab_chunk_size=64).backward()
    before = {op_name(name) for name in ops.names[marks["entry"] : marks["fused"]]}
    assert before <= NO_KERNEL_OPS, before


@pytest.mark.parametrize("why", ["smoothing_with_weights", "fp32", "hidden_not_multiple_of_64", "not_hopper"])
def test_cpu_vocab_blocks_fall_back_to_block_statistics(fused_on_cpu, first_passes, monkeypatch, why):
    options = SMOOTHING_WITH_WEIGHTS if why == "smoothing_with_weights" else FUSED_FEATURES["all_unweighted"]
    if why == "not_hopper":
        monkeypatch.setattr(cutedsl, "_capability", lambda device_type, index: (10, 0))
    case = Case(
        n_rows=45,
        hidden=40 if why == "hidden_not_multiple_of_64" else 64,
        vocab=211,
        dtype=FP32 if why == "fp32" else BF16,
        feature=why,
        options=options,
        chunk_size=16,
        vocab_chunk_size=64,
    )
    outcome = run_case(case, "cutedsl", CPU)
    assert outcome.passed, f"{case.name}: {outcome.failures} {outcome.errors}"
    assert first_passes["fused"] == 0 and first_passes["block_statistics"] > 0


def test_cpu_vocab_blocks_first_pass_under_autocast_and_odd_layouts(fused_on_cpu, first_passes):
    """fp32 parameters under bf16 autocast take the fused first pass on the weight's bf16
    copy; a weight the kernel's TMA cannot read in place (transposed) falls back to the
    block statistics; both give the float64 reference's loss and gradients."""
    x, w, b, y = _problem()
    math_options = dict(label_smoothing=0.1, lse_square_scale=1e-3, softcap=5.0)
    for weight, fused_calls in ((w.float(), 1), (w.float().t().contiguous().t(), 0)):
        first_passes.update(fused=0, block_statistics=0)
        leaves = [x.float().requires_grad_(), weight.clone().requires_grad_()]
        with torch.autocast("cpu", dtype=BF16):
            out = flce.fused_linear_cross_entropy(
                *leaves, y, bias=b.float(), backend="cutedsl", vocab_chunk_size=64, **math_options
            )
        out.backward()
        assert first_passes["fused"] == fused_calls and (first_passes["block_statistics"] > 0) == (not fused_calls)
        ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
        # The reference takes the operands as autocast hands them to the GEMM (bf16).
        ref = fused_linear_cross_entropy_reference(
            *(t.to(BF16).double() for t in ref_leaves), y, b.double(), **math_options
        )
        ref.loss.backward()
        torch.testing.assert_close(out.double(), ref.loss, rtol=2e-2, atol=1e-3)
        for got, want in zip(leaves, ref_leaves, strict=True):
            assert got.grad.dtype == torch.float32
            torch.testing.assert_close(got.grad.double(), want.grad, rtol=5e-2, atol=1e-2)


def test_cpu_the_chooser_counts_the_fused_first_pass(fused_on_cpu, first_passes, monkeypatch):
    """Under a budget that only vocabulary blocks fit, the scheme the call runs is the one
    the chooser predicted with the fused first pass (its workspace and time), and the
    bench's description of the call says so."""
    x, w, _, y = _problem(n=64, h=64, v=2048)
    spec = flce_plan.resolve_backend("cutedsl", CPU)
    options = LossOptions(backend="cutedsl", memory_budget=64 * 1024)
    request = GradRequest(input=True, weight=True)
    call = describe_call(
        x, w, None, request, options, BF16, spec, split_rows_of(spec), whole_row_statistics=spec.loss_only
    )
    assert call.whole_row_statistics_bytes == cutedsl.fused_forward_workspace_bytes(64, 2048, False, False)
    chosen = scheme_for_call(call, options, CPU)
    assert call.fused_block_gradient
    assert chosen.block is not None and chosen.fused_first_pass and chosen.fused_gradients
    assert "statistics from one fused GEMM, each block's gradient from its GEMM" in chosen.describe(64)
    # Without the block-gradient GEMM the same blocks cost a pass over their logits more.
    unfused = dataclasses.replace(call, fused_block_gradient=False)
    assert predicted_seconds(unfused, chosen.rows, chosen.block) > predicted_seconds(call, chosen.rows, chosen.block)
    leaves = [t.clone().requires_grad_() for t in (x, w)]
    flce.fused_linear_cross_entropy(*leaves, y, backend="cutedsl", memory_budget=64 * 1024).backward()
    assert first_passes["fused"] == 1 and first_passes["block_statistics"] == 0
    assert first_passes["block_gradient"] > 0 and first_passes["gradient_pass"] == 0


# ---------------------------------------------------------------------- GPU
HAS_DSL = importlib.util.find_spec("cutlass") is not None
HAS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(
    not (HAS_DSL and HAS_HOPPER), reason="needs nvidia-cutlass-dsl and a CUDA sm_90 (Hopper) GPU"
)
CUDA = torch.device("cuda")

# The kernel is compiled (a few seconds) once per dtype, V and (bias, softcap, logit sum)
# combination, so the grid is chosen: every feature at bf16, V = 32000 (Llama 2); fp16 and
# V = 151936 (Qwen) with no option and with all the unweighted ones (bias, softcap and the
# logit sum compiled in). N = 200: not a multiple of the 128-row tile; H = 128: two K tiles.
# Reductions only change the host-side reduce_rows, shared with the driver.
GPU_CASES = [(BF16, 32000, feature) for feature in FUSED_FEATURES] + [
    (dtype, vocab, feature)
    for dtype, vocab in ((FP16, 32000), (BF16, 151936), (FP16, 151936))
    for feature in ("plain", "all_unweighted")
]


@needs_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,vocab,feature", GPU_CASES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gpu_loss_only_matches_float64(monkeypatch, dtype, vocab, feature, reduction):
    calls = _count_fused_calls(monkeypatch)
    case = Case(
        n_rows=200,
        hidden=128,
        vocab=vocab,
        dtype=dtype,
        reduction=reduction,
        feature=feature,
        options=FUSED_FEATURES[feature],
        bias=feature.startswith("all"),
        grads=(),
        seed=vocab % 97,
    )
    outcome = run_case(case, "cutedsl", CUDA)
    assert outcome.passed, f"{case.name}: {outcome.failures} {outcome.errors}"
    assert len(calls) == 1


@needs_hopper
@pytest.mark.gpu
def test_gpu_no_grad_uses_it_and_agrees_with_the_driver(monkeypatch):
    calls = _count_fused_calls(monkeypatch)
    x, w, b, y = (t.cuda() for t in _problem(n=300, h=128, v=32000))
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    with torch.no_grad():
        fused = flce.fused_linear_cross_entropy(*leaves[:2], y, bias=leaves[2], backend="cutedsl", **ALL_OPTIONS)
    assert len(calls) == 1
    with torch.inference_mode():
        flce.fused_linear_cross_entropy(x, w, y, bias=b, backend="cutedsl", **ALL_OPTIONS)
    assert len(calls) == 2
    chunked = flce.fused_linear_cross_entropy(*leaves[:2], y, bias=leaves[2], backend="cutedsl", **ALL_OPTIONS)
    assert len(calls) == 2  # gradients: the chunked driver
    # The fused GEMM keeps fp32 logits where the driver rounds them to bf16: close, not equal.
    torch.testing.assert_close(fused.loss, chunked.loss.detach(), rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(fused.z_loss, chunked.z_loss, rtol=1e-2, atol=1e-5)


@needs_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gpu_smoothing_with_weights_falls_back(monkeypatch, reduction):
    calls = _count_fused_calls(monkeypatch)
    case = Case(
        n_rows=200,
        hidden=128,
        vocab=32000,
        dtype=BF16,
        reduction=reduction,
        feature="all",
        options=SMOOTHING_WITH_WEIGHTS,
        grads=(),
        seed=5,
    )
    outcome = run_case(case, "cutedsl", CUDA)
    assert outcome.passed, f"{case.name}: {outcome.failures} {outcome.errors}"
    assert len(calls) == 0


# The vocabulary blocks' first pass through the kernel: every feature set the fused
# statistics support at bf16, V = 32000 in ragged blocks of 12800, in one row chunk (dW
# blocks written directly) and in chunks of 96 rows (fp32 dW blocks), with all gradients.
GPU_BLOCK_CASES = [(feature, rows) for feature in ("plain", "all_unweighted", "all_weighted") for rows in (None, 96)]


@needs_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("feature,chunk_size", GPU_BLOCK_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gpu_vocab_blocks_take_their_first_pass_from_it(first_passes, feature, chunk_size, reduction):
    case = Case(
        n_rows=200,
        hidden=128,
        vocab=32000,
        dtype=BF16,
        reduction=reduction,
        feature=feature,
        options=FUSED_FEATURES[feature],
        bias=feature.startswith("all"),
        chunk_size=chunk_size,
        vocab_chunk_size=12800,
        seed=len(feature),
    )
    outcome = run_case(case, "cutedsl", CUDA)
    assert outcome.passed, f"{case.name}: {outcome.failures} {outcome.errors}"
    assert first_passes["fused"] >= 1 and first_passes["block_statistics"] == 0
    assert first_passes["block_gradient"] >= 1 and first_passes["gradient_pass"] == 0


@needs_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("n,vocab,with_logit_sum,bias", [(1000, 32000, False, False), (600, 151936, True, True)])
def test_gpu_the_workspace_formula_is_what_the_kernel_allocates(n, vocab, with_logit_sum, bias):
    """``fused_forward_workspace_bytes`` (the memory model's term, written without cutlass)
    against the allocations of the kernel's call, and its constants against the kernel's."""
    from flce.backends.cutedsl import fused_forward

    for config in (fused_forward.PINGPONG_CONFIG, fused_forward.COOPERATIVE_CONFIG):
        assert config.tile_n == cutedsl.FUSED_FORWARD_TILE_N
        assert cutedsl.FUSED_FORWARD_LAUNCH_ROWS_MULTIPLE % (config.tile_m * config.cluster_m) == 0
    x = torch.randn(n, 128, device=CUDA, dtype=BF16)
    w = torch.randn(vocab, 128, device=CUDA, dtype=BF16)
    b = torch.randn(vocab, device=CUDA, dtype=BF16) if bias else None
    y = torch.randint(0, vocab, (n,), device=CUDA)

    def call():
        return fused_forward.fused_forward_statistics(x, w, y, bias=b, with_logit_sum=with_logit_sum)

    call()  # compiled outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    formula = cutedsl.fused_forward_workspace_bytes(n, vocab, with_logit_sum, bias)
    # The caching allocator rounds each of the ~8 allocations up to 512 bytes.
    assert formula <= peak <= formula + 8 * 512, (peak, formula)
    del out


@needs_hopper
@pytest.mark.gpu
def test_gpu_vocab_blocks_peak_follows_the_model_at_the_reference_shape():
    """The fused first pass at N = 8192, H = 4096, V = 128256 in blocks of 8064 columns,
    one row chunk: the peak the memory model predicts for the scheme (the one the chooser
    ranks by) is what the call allocates, within 1%."""
    n, h, v, block = 8192, 4096, 128256, 8064
    x = torch.randn(n, h, device=CUDA, dtype=BF16, requires_grad=True)
    w = (torch.randn(v, h, device=CUDA, dtype=BF16) * 0.02).requires_grad_()
    y = torch.randint(0, v, (n,), device=CUDA)
    spec = get_backend("cutedsl")
    options = LossOptions(backend="cutedsl", vocab_chunk_size=block)
    call = describe_call(
        x,
        w,
        None,
        GradRequest(True, True),
        options,
        BF16,
        spec,
        split_rows_of(spec),
        whole_row_statistics=spec.loss_only,
    )
    predicted = scheme_for_call(call, options, CUDA)
    assert predicted.fused_first_pass and predicted.rows == n
    flce.fused_linear_cross_entropy(x, w, y, backend="cutedsl", vocab_chunk_size=block).backward()  # compiled
    x.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    flce.fused_linear_cross_entropy(x, w, y, backend="cutedsl", vocab_chunk_size=block).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert abs(peak / predicted.memory.peak - 1) < 0.01, (peak / 2**30, predicted.memory.peak / 2**30)
