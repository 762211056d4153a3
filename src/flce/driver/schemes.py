"""Which scheme runs a fused-loss call: the fastest, by a cost model, whose workspace fits
the memory budget (``flce.driver.sizing``: the budget, the default rule, the peak
formulas).

The candidates, from fastest to smallest:

- one chunk: every row's logits at once, dW written by one GEMM (no fp32 accumulator);
- token chunks: the most rows per chunk that fit, dW summed in an fp32 accumulator;
- vocabulary blocks (``flce.driver.vocab_blocks``): the widest block that fits, for each
  of a range of rows per chunk; the logits are computed twice (8NVH instead of 6NVH);
- vocabulary blocks with their workspace inside dW (one row chunk): the widest block that
  fits; the last blocks, whose rows of dW held the workspace, run their gradient pass
  again once dX is final.

``chunk_size``/``vocab_chunk_size`` given explicitly win: the scheme they name runs, and
only what they leave open follows the budget. With no budget set,
``FLCE_CHUNK_BUDGET_MIB`` sizes token chunks as it always did. Under an explicit budget
that nothing fits, ``MemoryBudgetError`` names the least workspace the call can run in;
under the default budget the call runs in that least workspace instead.

Cost model (predicted seconds of the call's GPU work; the host's per-call overhead is
the same for every scheme and left out):

    GEMM FLOPs / GEMM_FLOPS_PER_SECOND
  + bytes of the CE passes over the logits / LOGITS_PASS_BYTES_PER_SECOND
  + fp32 accumulator traffic beyond writing each gradient once / ACCUMULATOR_BYTES_PER_SECOND
  + (chunks or blocks run, after the first) * SECONDS_PER_STEP

with, for ``k`` row chunks and ``B`` vocabulary blocks (dX and dW requested):

- GEMM FLOPs: 6NVH; vocabulary blocks 8NVH (the logits again in the gradient pass);
- logits passes: the CE kernel reads and writes the logits once (2NV bytes per byte of
  the compute dtype); vocabulary blocks read them in the statistics pass and read and
  write them in the gradient pass (3NV), or, where the backend's fused statistics GEMM
  takes the first pass (``CallShape.whole_row_statistics_bytes``), only in the gradient
  pass (2NV), that GEMM's FLOPs counted ``FUSED_STATISTICS_GEMM_SLOWDOWN`` times; where
  the backend's block-gradient GEMM also takes the second pass
  (``CallShape.fused_block_gradient``), in no pass at all, the second pass's logits GEMM
  counted as slow as the first;
- accumulator traffic: with one chunk, none (dW written by one GEMM); with ``k`` chunks
  the fp32 dW accumulator is written, read and written again ``k - 1`` times and cast at
  the end: ``8k*V*H`` bytes more than writing a bf16 dW once; vocabulary blocks add the
  fp32 dX accumulator's read and write per block, ``8B*N*H``;
- steps: ``k`` chunks; ``2*B*k`` block passes for vocabulary blocks (``B*k + 1`` with the
  fused first pass);
- with the workspace inside dW, the last blocks' ``V_t`` columns (``weight_grad_tail_start``)
  again: a logits GEMM (``2N*V_t*H``), a gradient pass (``2N*V_t`` bytes per byte of the
  compute dtype; none with the block-gradient GEMM) and one step per block.

The constants are H200 bf16 measurements (``benchmarks/results/``):

- ``GEMM_FLOPS_PER_SECOND``: the floor (three cuBLAS GEMMs, 6NVH) ran at 664-714 TFLOP/s
  over the six fwd+bwd shapes of ``fwd-bwd-h200/`` and ``memory-mode-h200/``;
- ``LOGITS_PASS_BYTES_PER_SECOND``: the CuTe DSL CE kernel alone moves 2832 GB/s counting
  one read and one write of bf16 logits (``ce-kernel-h200/``);
- ``FUSED_STATISTICS_GEMM_SLOWDOWN``: the CuTe DSL fused statistics GEMM ran at
  1.034-1.052x ``torch.mm`` of the same logits at V = 32000-128256
  (``fused-forward-gemm-h200/``);
- ``ACCUMULATOR_BYTES_PER_SECOND`` and ``SECONDS_PER_STEP``: fitted to ``chunk-size-h200/``
  at the reference shape, one chunk 39.41 ms, two 40.85 ms, four 42.41 ms: 1.44 and
  3.00 ms for 8.4 and 16.8 GB of accumulator traffic with one and three more chunks give
  6.37 TB/s (faster than a copy: the GEMM epilogue's traffic overlaps its math) and
  0.12 ms per chunk.

``docs/performance.md`` compares the predictions with the measured times. The model
ranks schemes; its absolute times are the H200's in bf16.

``scheme_frontier`` lists the schemes the chooser would run over a range of budgets, with
their predicted peak and time (for plots of the time/memory trade-off of a shape).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass

import torch

from flce.backends.base import BackendSpec, LossOnlyStatistics, SplitRowKernels
from flce.driver.chunks import GradRequest
from flce.driver.gemm import fp32_output_gemm_supported, weight_accumulator_dtype
from flce.driver.sizing import (
    BLOCK_ARGMAX_BYTES,
    BLOCK_SMOOTHING_BYTES,
    BLOCK_STATISTICS_BYTES,
    CHUNK_BUDGET_ENV_VAR,
    MEMORY_BUDGET_ENV_VAR,
    CallShape,
    Memory,
    MemoryBudgetError,
    budget_too_small,
    default_chunk_size,
    default_memory_budget,
    device_memory_bytes,
    env_memory_budget_bytes,
    largest_block,
    largest_block_rows,
    largest_token_rows,
    least_workspace_block,
    legacy_chunk_budget_bytes,
    token_chunk_memory,
    vocab_block_memory,
    weight_grad_tail_start,
)
from flce.options import LossOptions

GEMM_FLOPS_PER_SECOND = 690e12
LOGITS_PASS_BYTES_PER_SECOND = 2.83e12
ACCUMULATOR_BYTES_PER_SECOND = 6.37e12
SECONDS_PER_STEP = 0.12e-3
FUSED_STATISTICS_GEMM_SLOWDOWN = 1.05


@dataclass(frozen=True)
class Scheme:
    """One way to run a call, with its predicted memory and time."""

    rows: int  # rows per chunk
    block: int | None  # vocabulary columns per block; None: whole rows
    memory: Memory
    seconds: float
    fused_first_pass: bool = False  # vocabulary blocks: the statistics from one fused GEMM
    fused_gradients: bool = False  # vocabulary blocks: each block's gradient from its GEMM
    # Vocabulary blocks with their workspace inside dW: the first column of the last
    # blocks, whose rows of dW hold the fp32 dX accumulator and the block buffer and which
    # run their gradient pass again (flce.driver.vocab_blocks); None: not that variant.
    weight_grad_tail_start: int | None = None

    @property
    def workspace_in_weight_grad(self) -> bool:
        return self.weight_grad_tail_start is not None

    def name(self, n_rows: int) -> str:
        if self.block is not None:
            return "vocabulary blocks"
        return "one chunk" if self.rows >= n_rows else "token chunks"

    def describe(self, n_rows: int) -> str:
        if self.block is not None:
            text = f"vocabulary blocks of {self.block} columns, {self.rows} rows per chunk"
            if self.fused_first_pass:
                text += ", statistics from one fused GEMM"
            if self.fused_gradients:
                text += ", each block's gradient from its GEMM"
            if self.workspace_in_weight_grad:
                text += f", workspace inside dW (columns from {self.weight_grad_tail_start} computed again)"
            return text
        if self.rows >= n_rows:
            return f"one chunk of {n_rows} rows"
        return f"token chunks of {self.rows} rows"


# ------------------------------------------------------------------- predictions


def _weight_accumulator_traffic(call: CallShape, n_chunks: int, copied_out: bool) -> int:
    """Bytes of dW's accumulator traffic beyond writing dW once in the weight's dtype.
    ``copied_out``: the accumulator ends in a copy to dW (a cast, or a block of dW)."""
    if not call.grad_weight or (n_chunks == 1 and call.one_gemm_weight_grad):
        return 0
    elements = call.vocab * call.hidden
    acc, weight = call.accumulator_dtype.itemsize, call.weight_dtype.itemsize
    traffic = acc * elements * (1 + 2 * (n_chunks - 1))  # written, then read and written per chunk
    if copied_out:
        traffic += (acc + weight) * elements
    return traffic - weight * elements


def _block_logits_passes(call: CallShape) -> int:
    """Passes over a block's logits, in units of one read or write of them: the statistics
    pass reads them (not with the fused first pass, whose GEMM's epilogue holds it), the
    gradient pass reads and writes them (not with the fused block gradient, whose GEMM's
    epilogue writes the gradient instead of the logits)."""
    statistics = 0 if call.whole_row_statistics_bytes is not None else 1
    return statistics + (2 if call.any_gradient and not call.fused_block_gradient else 0)


def predicted_seconds(
    call: CallShape, rows: int, block: int | None = None, workspace_in_weight_grad: bool = False
) -> float:
    """The module docstring's cost model for ``rows`` rows per chunk (and ``block``
    vocabulary columns per block, or whole rows; ``workspace_in_weight_grad``: that
    variant of the blocks)."""
    n, v, h = call.n_rows, call.vocab, call.hidden
    n_chunks = max(1, math.ceil(n / max(rows, 1)))
    logits_elements = n * v
    gemm_flops = 2 * n * v * h * (1 + call.grad_input + call.grad_weight)
    if block is None:
        logits_bytes = logits_elements * call.compute_dtype.itemsize * (2 if call.any_gradient else 1)
        accumulator = _weight_accumulator_traffic(call, n_chunks, call.accumulator_dtype != call.weight_dtype)
        steps = n_chunks
    else:
        n_blocks = math.ceil(v / block)
        passes = 2 if call.any_gradient else 1
        gemm_flops += 2 * n * v * h * (passes - 1)  # the logits again in the gradient pass
        logits_bytes = logits_elements * call.compute_dtype.itemsize * _block_logits_passes(call)
        if call.whole_row_statistics_bytes is None:
            steps = n_blocks * n_chunks * passes
        else:  # the first pass is one fused GEMM: one step
            gemm_flops += 2 * n * v * h * (FUSED_STATISTICS_GEMM_SLOWDOWN - 1)
            steps = 1 + n_blocks * n_chunks * (passes - 1)
            if call.fused_block_gradient and passes == 2:  # the second pass's GEMMs are fused ones too
                gemm_flops += 2 * n * v * h * (FUSED_STATISTICS_GEMM_SLOWDOWN - 1)
        accumulator = _weight_accumulator_traffic(call, n_chunks, True) if call.any_gradient else 0
        if call.grad_input:  # dX in fp32: zeroed, read and written per block, cast at the end
            dx_elements = n * h
            accumulator += dx_elements * (4 + 8 * n_blocks)
            if call.input_dtype != torch.float32:
                accumulator += dx_elements * 4
        if workspace_in_weight_grad:  # the last blocks' gradient pass again
            tail = v - weight_grad_tail_start(call, rows, block)
            gemm_flops += 2 * n * tail * h
            if not call.fused_block_gradient:
                logits_bytes += 2 * n * tail * call.compute_dtype.itemsize
            steps += math.ceil(tail / block)
    return (
        gemm_flops / GEMM_FLOPS_PER_SECOND
        + logits_bytes / LOGITS_PASS_BYTES_PER_SECOND
        + accumulator / ACCUMULATOR_BYTES_PER_SECOND
        + (steps - 1) * SECONDS_PER_STEP
    )


def token_scheme(call: CallShape, rows: int) -> Scheme:
    rows = max(1, min(rows, max(call.n_rows, 1)))
    return Scheme(rows, None, token_chunk_memory(call, rows), predicted_seconds(call, rows))


def block_scheme(call: CallShape, rows: int, block: int, workspace_in_weight_grad: bool = False) -> Scheme:
    rows, block = max(1, min(rows, max(call.n_rows, 1))), max(1, min(block, call.vocab))
    return Scheme(
        rows,
        block,
        vocab_block_memory(call, rows, block, workspace_in_weight_grad),
        predicted_seconds(call, rows, block, workspace_in_weight_grad),
        fused_first_pass=call.whole_row_statistics_bytes is not None,
        fused_gradients=call.fused_block_gradient and call.any_gradient,
        weight_grad_tail_start=weight_grad_tail_start(call, rows, block) if workspace_in_weight_grad else None,
    )


def _block_row_counts(n_rows: int) -> list[int]:
    """Rows per chunk tried for vocabulary blocks: ``ceil(N / k)`` for 50% steps of the
    chunk count ``k`` (more chunks: a wider block fits, at an fp32 dW block's cost)."""
    counts = {1, max(n_rows, 1)}
    k = 1.0
    while k < n_rows:
        counts.add(round(k))
        k *= 1.5
    return sorted({math.ceil(max(n_rows, 1) / count) for count in counts}, reverse=True)


def _block_schemes(call: CallShape, budget: int) -> list[Scheme]:
    """For each row count tried, the widest block that fits; and the widest block of the
    variant with its workspace inside dW (one row chunk) where it applies."""
    schemes = []
    for rows in _block_row_counts(call.n_rows):
        block = largest_block(call, rows, budget)
        if block is not None:
            schemes.append(block_scheme(call, rows, block))
    if call.any_gradient and call.one_gemm_weight_grad:
        block = largest_block(call, call.n_rows, budget, workspace_in_weight_grad=True)
        if block is not None:
            schemes.append(block_scheme(call, call.n_rows, block, workspace_in_weight_grad=True))
    return schemes


def _block_lower_bound(call: CallShape) -> float:
    """No vocabulary-block scheme of ``call`` is predicted faster: its GEMMs and logits
    passes alone."""
    n, v, h = call.n_rows, call.vocab, call.hidden
    passes = 2 if call.any_gradient else 1
    gemm_flops = 2 * n * v * h * (call.grad_input + call.grad_weight + passes)
    logits_bytes = n * v * call.compute_dtype.itemsize * _block_logits_passes(call)
    return gemm_flops / GEMM_FLOPS_PER_SECOND + logits_bytes / LOGITS_PASS_BYTES_PER_SECOND


@functools.lru_cache(maxsize=512)
def smallest_scheme(call: CallShape) -> Scheme:
    """The scheme with the least workspace (the faster of equals): one row per token
    chunk, one chunk, or for each row count tried the block of the least workspace."""
    candidates = [token_scheme(call, 1), token_scheme(call, call.n_rows)]
    if call.block_extra_bytes_per_logit is not None:
        for rows in _block_row_counts(call.n_rows):
            candidates.append(block_scheme(call, rows, least_workspace_block(call, rows)))
        if call.any_gradient and call.one_gemm_weight_grad:
            block = least_workspace_block(call, call.n_rows, workspace_in_weight_grad=True)
            if weight_grad_tail_start(call, call.n_rows, block) is not None:
                candidates.append(block_scheme(call, call.n_rows, block, workspace_in_weight_grad=True))
    return min(candidates, key=lambda s: (s.memory.workspace, s.seconds))


@functools.lru_cache(maxsize=512)
def choose_scheme(call: CallShape, budget: int, source: str = "memory_budget") -> Scheme:
    """The fastest scheme whose workspace fits ``budget`` bytes; ``MemoryBudgetError``
    (naming ``source``, the option or variable that gave the budget) if none does."""
    candidates = []
    rows = largest_token_rows(call, budget)
    if rows is not None:
        candidates.append(token_scheme(call, rows))
    if call.block_extra_bytes_per_logit is not None and (
        not candidates or candidates[0].seconds > _block_lower_bound(call)
    ):
        candidates += _block_schemes(call, budget)
    if not candidates:
        least = smallest_scheme(call)
        raise budget_too_small(budget, least.memory.workspace, least.describe(call.n_rows), source)
    return min(candidates, key=lambda s: (s.seconds, s.memory.workspace))


def scheme_frontier(call: CallShape, points: int = 48, max_slowdown: float | None = 3.0) -> list[Scheme]:
    """What the chooser runs over budgets from the least workspace to one chunk's, ordered
    by workspace, each predicted faster than the one before: the time/memory trade-off of
    ``call``, with each point's predicted peak (``memory.peak``, gradients included) and
    time (``seconds``). Points predicted more than ``max_slowdown`` times slower than the
    fastest are left out (None keeps them all: the least workspace may run one row at a time)."""
    low = smallest_scheme(call).memory.workspace
    high = max(low, token_scheme(call, call.n_rows).memory.workspace)
    budgets = {low, high}
    if low > 0:
        budgets |= {round(low * (high / low) ** (i / max(points - 1, 1))) for i in range(points)}
    chosen = {}
    for budget in sorted(budgets):
        scheme = choose_scheme(call, max(budget, low))
        chosen.setdefault((scheme.rows, scheme.block, scheme.workspace_in_weight_grad), scheme)
    frontier = []
    for scheme in sorted(chosen.values(), key=lambda s: (s.memory.workspace, s.seconds)):
        if not frontier or scheme.seconds < frontier[-1].seconds:
            frontier.append(scheme)
    if max_slowdown is not None:
        fastest = min(s.seconds for s in frontier)
        frontier = [s for s in frontier if s.seconds <= max_slowdown * fastest]
    return frontier


# ---------------------------------------------------------------- one call


def describe_call(
    input: torch.Tensor,  # (N, H)
    weight: torch.Tensor,  # (V, H)
    bias: torch.Tensor | None,  # (V,)
    request: GradRequest,
    options: LossOptions,
    compute_dtype: torch.dtype,
    backend: BackendSpec,
    split_kernels: SplitRowKernels | None,
    *,
    whole_row_statistics: LossOnlyStatistics | None = None,
) -> CallShape:
    """The ``CallShape`` of a fused-loss call; ``whole_row_statistics``: the backend's fused
    statistics where the vocabulary blocks' first pass takes them (``flce.plan``)."""
    statistics = BLOCK_STATISTICS_BYTES
    statistics += BLOCK_SMOOTHING_BYTES if options.label_smoothing > 0 else 0
    statistics += BLOCK_ARGMAX_BYTES if options.return_token_accuracy or options.return_predicted_tokens else 0
    return CallShape(
        n_rows=input.shape[0],
        vocab=weight.shape[0],
        hidden=input.shape[1],
        input_dtype=input.dtype,
        weight_dtype=weight.dtype,
        compute_dtype=compute_dtype,
        accumulator_dtype=weight_accumulator_dtype(options.accum_dtype, weight.dtype),
        grad_input=request.input,
        grad_weight=request.weight,
        bias_dtype=bias.dtype if request.bias and bias is not None else None,
        chunk_extra_bytes_per_logit=backend.extra_bytes_per_logit,
        block_extra_bytes_per_logit=None if split_kernels is None else split_kernels.extra_bytes_per_logit,
        block_statistics_bytes=statistics,
        whole_row_statistics_bytes=None
        if whole_row_statistics is None
        else whole_row_statistics.workspace_bytes(
            input.shape[0], weight.shape[0], options.label_smoothing > 0, bias is not None
        ),
        fused_block_gradient=whole_row_statistics is not None and backend.block_gradient is not None,
        upcast_operands=not fp32_output_gemm_supported(input.device),
    )


def scheme_of_call(
    input: torch.Tensor,  # (N, H)
    weight: torch.Tensor,  # (V, H)
    bias: torch.Tensor | None,  # (V,)
    request: GradRequest,
    options: LossOptions,
    compute_dtype: torch.dtype,
    backend: BackendSpec,
    split_kernels: SplitRowKernels | None,
    *,
    whole_row_statistics: LossOnlyStatistics | None = None,
) -> Scheme:
    """``scheme_for_call(describe_call(...))``: the scheme the plan runs."""
    call = describe_call(
        input,
        weight,
        bias,
        request,
        options,
        compute_dtype,
        backend,
        split_kernels,
        whole_row_statistics=whole_row_statistics,
    )
    return scheme_for_call(call, options, input.device)


def loss_only_fits_budget(call: CallShape, options: LossOptions, device: torch.device) -> bool:
    """Whether a call without gradients may run on the backend's fused statistics alone
    (``flce.plan``'s loss-only route; ``call`` described with them): their workspace (one
    launch's tile statistics and the row outputs), the operands cast to the compute dtype
    with it, within the budget the chooser would size the call's chunks by."""
    budget, _ = _budget(call, options, device_memory_bytes(device))
    return call.fused_statistics_bytes() <= budget


def _budget(call: CallShape, options: LossOptions, device_memory: int | None) -> tuple[int, str | None]:
    """(workspace budget in bytes, the option or variable that set it; None: the default rule)."""
    if options.memory_budget is not None:
        return options.memory_budget, "memory_budget"
    from_env = env_memory_budget_bytes()
    if from_env is not None:
        return from_env, MEMORY_BUDGET_ENV_VAR
    return default_memory_budget(call, device_memory), None


def scheme_for_call(call: CallShape, options: LossOptions, device: torch.device) -> Scheme:
    """The scheme a call runs (module docstring): explicit ``chunk_size``/``vocab_chunk_size``
    first, then the budget of ``memory_budget``, ``FLCE_MEMORY_BUDGET_MIB``,
    ``FLCE_CHUNK_BUDGET_MIB`` (token chunks by their logits) or the default rule.

    Every fused call asks, and a training loop asks with the same shapes call after call:
    the answer is cached on what decides it: the device's memory and the budget variables'
    values included (a bad value raises, and is not cached)."""
    return _scheme_for_call(call, options, device_memory_bytes(device), budget_environment())


def budget_environment() -> tuple[str | None, str | None]:
    """The budget variables' values as set now: a key of every cached scheme decision."""
    return os.environ.get(MEMORY_BUDGET_ENV_VAR), os.environ.get(CHUNK_BUDGET_ENV_VAR)


@functools.lru_cache(maxsize=256)
def _scheme_for_call(call: CallShape, options: LossOptions, device_memory: int | None, environment: tuple) -> Scheme:
    del environment  # a key only: _budget and legacy_chunk_budget_bytes read the variables
    budget, source = _budget(call, options, device_memory)
    legacy = legacy_chunk_budget_bytes() if source is None else None
    rows = options.chunk_size
    if options.vocab_chunk_size is not None:
        block = min(options.vocab_chunk_size, max(call.vocab, 1))
        if rows is None and legacy is not None:
            extra = call.block_extra_bytes_per_logit or 0
            rows = default_chunk_size(call.n_rows, block, call.compute_dtype, extra, legacy)
        if rows is None:
            rows = largest_block_rows(call, block, budget) or 1
        return block_scheme(call, rows, block)
    if rows is None and legacy is not None:
        extra = call.chunk_extra_bytes_per_logit
        rows = default_chunk_size(call.n_rows, call.vocab, call.compute_dtype, extra, legacy)
    if rows is not None:
        return token_scheme(call, rows)
    try:
        return choose_scheme(call, budget, source or "the default memory budget")
    except MemoryBudgetError:
        if source is None:  # the default budget: run in the least workspace rather than fail
            return smallest_scheme(call)
        raise


@functools.lru_cache(maxsize=256)
def options_for_scheme(options: LossOptions, rows: int, block: int | None) -> LossOptions:
    """``options`` with the scheme's rows per chunk and block filled in, as the drivers read them."""
    return dataclasses.replace(options, chunk_size=rows, vocab_chunk_size=block)


def call_budget(call: CallShape, options: LossOptions, device: torch.device) -> tuple[int, str | None]:
    """The workspace budget ``scheme_for_call`` runs ``call`` under, and the option or
    variable that set it (None: the default rule): for tools that show the budget beside
    the scheme (``flce bench --frontier``)."""
    return _budget(call, options, device_memory_bytes(device))
