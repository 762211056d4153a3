"""Sizing: the memory budget of a call, and the peak memory each scheme's chunking implies.

The memory budget bounds a fused-loss call's **workspace**: the peak memory the call
allocates beyond its inputs, minus the gradients it returns (dX, dW, db: the same for
every scheme). A call therefore peaks at most at ``budget + its gradients``. The budget is
``memory_budget=`` (bytes), else ``FLCE_MEMORY_BUDGET_MIB``, else the default rule
(``default_memory_budget``):

    max(512 MiB, V'*H*4 when dW of a bf16/fp16 weight is accumulated in fp32),
    at most 1/16 of the device's memory (CUDA),
  + what every scheme of the call holds whatever its chunking (``fixed_workspace_bytes``:
    the weight cast to the compute dtype under autocast, db's fp32 sum beyond db)

Exact dW in 6NVH FLOPs needs either the whole batch's logits or an fp32 ``V x H``
accumulator (4 bytes per LM-head weight). Several token chunks need that accumulator,
so under this default one chunk runs exactly when the batch's logits are no larger than
the accumulator it makes unnecessary (N <= 2H in bf16). ``V'`` is V rounded up to a
multiple of 64 (``logits_row_stride``), the row length of flce's logits buffers: counted
with V, the accumulator of an odd vocabulary fell a few hundred KiB short of the batch's
padded logits at N = 2H, and V = 50257 ran three token chunks and a dW cast instead of
one chunk (16.85 ms against 15.33 ms at V = 50304, fwd+bwd on the H200,
benchmarks/results/odd-vocabulary-h200). The workspace never grows with N beyond it,
and a call that needs no accumulator gets the 512 MiB of chunk logits it has
always had. The fixed part is added because no choice of scheme can save it: counted
against the first term it tipped calls off the scheme the rule means for them, a
trainable bias's 2V bytes took the reference shape (N = 2H) from one chunk to two
vocabulary blocks (measured 1.41x the GEMM floor instead of 1.08x), and the 1 GiB bf16
copy of an fp32 weight under autocast (V = 128256, H = 4096) left no scheme inside
512 MiB, so the call ran one row per chunk. ``flce.driver.schemes`` picks the scheme
that fits the budget.
``FLCE_CHUNK_BUDGET_MIB`` (no memory budget set) sizes token chunks by their logits alone,
as it did before the budget existed: ``C = budget // (V * (itemsize + extra))``, balanced.

Peak extra memory of the token-chunk scheme (``token_chunk_memory``) with a bf16/fp16
weight and fp32 dW accumulation:

    N*V*(itemsize + extra) + V*H*itemsize     one chunk: logits + kernel workspace + dW
  or
    max(C*V*(itemsize + extra) + V*H*4,       several: chunk logits + kernel workspace
                                              + the fp32 dW accumulator
        V*H*(4 + itemsize))                   at the end: the accumulator and its cast
  + N*H*itemsize(input) + V*4 (db)            both: dX, and db in fp32

(``extra`` is an upper bound for the torch backend, whose temporaries are not all alive
at once; ``peak_extra_bytes`` is this formula; the logits' rows are
``logits_row_stride(V)`` elements apart, V rounded up to a multiple of 64, which the
``itemsize`` terms count). With an fp32 weight, or ``accum_dtype``
equal to the weight's dtype, the accumulator is the returned dW:
``C*V*(itemsize + extra) + V*H*itemsize + N*H*itemsize``. Under autocast a weight of
another dtype is cast once for the call (``V*H*itemsize(compute)`` more).

The vocabulary-block scheme (``vocab_block_memory``, ``flce.driver.vocab_blocks``) with
``C`` rows per chunk and ``B = ceil(V / V_b)`` blocks peaks at

    N*H*4 + dW + max(C*V_b*(itemsize + extra) + V_b*H*4 [C < N], dX)
  + B*N*(13 [+4 smoothing] [+8 argmax])       the per-block row statistics

(dX accumulated in fp32 over the blocks, cast at the end, after the block buffer is
freed; with one row chunk each dW block is written by one GEMM, without the ``V_b x H``
fp32 block). With one row chunk the scheme can also hold its workspace inside dW
(``workspace_in_weight_grad``: the fp32 dX accumulator and the block buffer live in the
rows of dW that the last blocks fill, and those blocks are computed again once dX is
final), which peaks at

    dW + dX + C*V_b*(itemsize + extra)        (the last blocks' second pass)

for the extra logits GEMM and gradient pass of those last blocks
(``weight_grad_tail_start``). Vectors of N or V values (row outputs, targets) are left out
of every formula.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch

from flce.driver.gemm import vocabulary_main_extent, weight_grad_in_one_gemm

MIB = 2**20
DEFAULT_CHUNK_BUDGET_BYTES = 512 * MIB
CHUNK_BUDGET_ENV_VAR = "FLCE_CHUNK_BUDGET_MIB"
MEMORY_BUDGET_ENV_VAR = "FLCE_MEMORY_BUDGET_MIB"
# The default budget never exceeds this fraction of the device's memory: a loss that
# takes more than a sixteenth of the GPU as scratch would surprise; on an 80 GB GPU that
# is 5 GiB, above every default at the shapes flce is measured on (4 GiB at V = 262144).
DEFAULT_BUDGET_DEVICE_FRACTION = 1 / 16
# (B, N) per-block statistics of the vocabulary-block scheme, bytes per row and block:
# max, sum and target logit (fp32), the target-ownership flag (bool); and transiently,
# while the blocks are combined, about eight fp32 temporaries of that shape.
BLOCK_STATISTICS_BYTES = 3 * 4 + 1
BLOCK_SMOOTHING_BYTES = 4
BLOCK_ARGMAX_BYTES = 8
BLOCK_COMBINE_BYTES = 8 * 4
# Vocabulary blocks the chooser picks are a multiple of this many columns (unless one block
# holds the whole vocabulary): a block's logits are a (C, block) matrix whose row stride is
# the block width, and cuBLAS runs unaligned leading dimensions (e.g. 5577 columns) on slow
# kernels: measured on the H200 at N=8192, H=4096, bf16, 5577-column blocks took 8.7x the
# three-GEMM floor where 42752-column ones took 1.43x (benchmarks/results/memory-budget-h200).
# 128 is also the GEMM tile width.
BLOCK_ALIGNMENT = 128
# The logits buffers flce allocates have rows a multiple of this many elements apart
# (``logits_row_stride``), so that the logits, an operand of all three GEMMs, never have an
# unaligned leading dimension. Measured on the H200 (N = 8192, H = 4096, bf16, fwd+bwd,
# benchmarks/results/odd-vocabulary-h200): at V = 50257 the aligned rows took flce from
# 88.3 to 83.4 ms (cutedsl). The rest of that cliff was the GEMMs' odd extents, which
# flce.driver.gemm splits at an aligned column.
LOGITS_ROW_ALIGNMENT = 64
# The pieces of the workspace held inside dW (the fp32 dX accumulator, the block buffer)
# start at this byte alignment: GEMM operands and TMA descriptors need 16 bytes, and a
# cache line's alignment costs nothing here.
WEIGHT_GRAD_SCRATCH_ALIGNMENT = 256


def logits_row_stride(vocab: int, dtype: torch.dtype | None = None, bias: torch.Tensor | None = None) -> int:
    """Elements between rows of a logits buffer of ``vocab`` columns: ``vocab`` rounded up
    to a multiple of ``LOGITS_ROW_ALIGNMENT`` (an aligned leading dimension for the GEMMs
    that write and read it).

    ``bias``: the bias of the product the buffer of ``dtype`` holds. In that dtype it is added
    in the GEMM (``flce.driver.gemm.logits_product``; an fp32 buffer of 16-bit operands gets
    it added apart), and the rows are then ``vocab`` apart wherever that is a multiple of 16
    bytes (no column split, ``vocabulary_main_extent``), still a leading dimension cuBLAS's
    fast kernels take:
    cuBLAS adds a bias before its one rounding only in the epilogue of a GEMM writing a
    contiguous output, and into padded rows flce writes it through row slabs and a copy
    (``flce.driver.gemm._biased_logits``). Measured on an H100 (N = 8192, H = 4096, bf16,
    fwd+bwd, a bias; benchmarks/results/fp16-loss-scaler-h100/padded-bias.csv): the slabs
    took V = 50400 to 1.217x the three-GEMM floor (cutedsl) against 1.061x at V = 50432."""
    if bias is not None and bias.dtype == dtype and vocabulary_main_extent(vocab, dtype) == vocab:
        return vocab
    return -(-vocab // LOGITS_ROW_ALIGNMENT) * LOGITS_ROW_ALIGNMENT


def _positive_mib(env_var: str) -> int | None:
    """``env_var`` as bytes (a positive number of MiB), or None when unset or empty."""
    value = os.environ.get(env_var)
    if not value:
        return None
    try:
        mib = float(value)
    except ValueError:
        raise ValueError(f"{env_var} must be a positive number of MiB, got {value!r}") from None
    if not (mib > 0 and math.isfinite(mib)):
        raise ValueError(f"{env_var} must be a positive number of MiB, got {value!r}")
    return max(1, int(mib * 2**20))


def chunk_budget_bytes() -> int:
    """The transient-logits budget: ``FLCE_CHUNK_BUDGET_MIB`` if set, else 512 MiB."""
    from_env = _positive_mib(CHUNK_BUDGET_ENV_VAR)
    return DEFAULT_CHUNK_BUDGET_BYTES if from_env is None else from_env


def legacy_chunk_budget_bytes() -> int | None:
    """``FLCE_CHUNK_BUDGET_MIB`` in bytes when set, else None."""
    return _positive_mib(CHUNK_BUDGET_ENV_VAR)


def env_memory_budget_bytes() -> int | None:
    """``FLCE_MEMORY_BUDGET_MIB`` in bytes when set, else None."""
    return _positive_mib(MEMORY_BUDGET_ENV_VAR)


class MemoryBudgetError(ValueError):
    """A memory budget below the least workspace any scheme of the call needs."""


def budget_too_small(budget: int, need: int, least: str, source: str) -> MemoryBudgetError:
    """The error of a ``budget`` (bytes, from ``source``: the option or the variable) below
    the ``need`` bytes of the call's least workspace (``least``: that scheme, described),
    naming the setting that is enough."""
    if source == MEMORY_BUDGET_ENV_VAR:  # MiB, rounded up so that the value given is enough
        thousandths = math.ceil(need * 1000 / MIB + 1e-6)
        # Every decimal written out: six significant digits (``:g``) cut the thousandths of
        # a value of 1000 MiB or more, and the value asked for fell short of the workspace.
        minimum = f"{thousandths / 1000:.3f}".rstrip("0").rstrip(".") + " (MiB)"
    else:
        minimum = f"{need} (bytes)"
    return MemoryBudgetError(
        f"{source}: a workspace of {budget} bytes ({budget / MIB:.3f} MiB) is below the least this call can run "
        f"in, {need} bytes ({need / MIB:.3f} MiB: {least}); set {source} to at least {minimum}"
    )


@functools.cache
def _cuda_memory_bytes(index: int) -> int:
    return torch.cuda.get_device_properties(index).total_memory


def device_memory_bytes(device: torch.device) -> int | None:
    """The device's total memory (a cached host query, no device sync), None off CUDA. A
    device without an index is the current one, resolved before the cache (GPUs of one
    machine can differ)."""
    if device.type != "cuda":
        return None
    return _cuda_memory_bytes(device.index if device.index is not None else torch.cuda.current_device())


def default_memory_budget(call: CallShape, device_memory: int | None) -> int:
    """The module docstring's default workspace budget of ``call``: the logits or the fp32
    dW accumulator the scheme trades (capped by the device's memory), plus the workspace
    that no scheme can save (``CallShape.fixed_workspace_bytes``)."""
    budget = DEFAULT_CHUNK_BUDGET_BYTES
    if call.fp32_accumulator_of_low_precision_weight:
        # The accumulator counted in rows of the logits' length, so that N <= 2H keeps the
        # batch's (padded) logits inside it at every V.
        budget = max(budget, logits_row_stride(call.vocab) * call.hidden * 4)
    if device_memory is not None:
        budget = min(budget, int(device_memory * DEFAULT_BUDGET_DEVICE_FRACTION))
    return budget + call.fixed_workspace_bytes()


# ----------------------------------------------------------------- the call


@dataclass(frozen=True)
class CallShape:
    """What sizing and the scheme chooser know of a fused-loss call: its sizes, dtypes,
    the gradients it computes and the kernels' workspace."""

    n_rows: int
    vocab: int
    hidden: int
    input_dtype: torch.dtype = torch.bfloat16
    weight_dtype: torch.dtype = torch.bfloat16
    compute_dtype: torch.dtype = torch.bfloat16
    accumulator_dtype: torch.dtype = torch.float32  # dW's (flce.driver.gemm.weight_accumulator_dtype)
    grad_input: bool = True
    grad_weight: bool = True
    bias_dtype: torch.dtype | None = None  # the bias's dtype when db is computed, else None
    chunk_extra_bytes_per_logit: int = 0  # the chunk CE kernel's workspace
    block_extra_bytes_per_logit: int | None = 0  # the split-row kernels'; None: the backend has none
    block_statistics_bytes: int = BLOCK_STATISTICS_BYTES  # per row and vocabulary block
    # The vocabulary blocks' first pass from the backend's fused statistics GEMM (its
    # ``loss_only`` slot applies: ``flce.driver.fused``), which allocates this many bytes;
    # None: a logits GEMM and a statistics pass per block.
    whole_row_statistics_bytes: int | None = None
    # The vocabulary blocks' second pass from the backend's ``block_gradient`` GEMM (with the
    # fused first pass): each block's gradient written by its GEMM, no pass over its logits.
    fused_block_gradient: bool = False
    # fp32 accumulation copies bf16/fp16 GEMM operands to fp32 where no GEMM writes fp32
    # from them (the CPU: flce.driver.gemm.accumulate_product)
    upcast_operands: bool = False
    # Other heads' weights cast to their compute dtype for the call, held as this head's cast
    # is (a distillation teacher's: flce.driver.chunks.run_token_chunks's constant heads)
    constant_weight_cast_bytes: int = 0

    @property
    def any_gradient(self) -> bool:
        return self.grad_input or self.grad_weight or self.bias_dtype is not None

    @property
    def one_gemm_weight_grad(self) -> bool:
        """Whether one chunk of every row writes dW with one GEMM (no accumulator)."""
        return self.grad_weight and weight_grad_in_one_gemm(
            self.n_rows, self.n_rows, self.weight_dtype, self.compute_dtype, self.accumulator_dtype
        )

    @property
    def fp32_accumulator_of_low_precision_weight(self) -> bool:
        return (
            self.grad_weight and self.accumulator_dtype == torch.float32 and self.weight_dtype != self.accumulator_dtype
        )

    def gradient_bytes(self) -> int:
        """The returned gradients: dX, dW and db in their parameters' dtypes."""
        n, v, h = self.n_rows, self.vocab, self.hidden
        dx = n * h * self.input_dtype.itemsize if self.grad_input else 0
        dw = v * h * self.weight_dtype.itemsize if self.grad_weight else 0
        db = v * self.bias_dtype.itemsize if self.bias_dtype is not None else 0
        return dx + dw + db

    def weight_cast_bytes(self) -> int:
        """The weights cast to their compute dtype for the call (autocast; another head's:
        ``constant_weight_cast_bytes``), else 0."""
        own = 0 if self.weight_dtype == self.compute_dtype else self.vocab * self.hidden * self.compute_dtype.itemsize
        return own + self.constant_weight_cast_bytes

    def fused_statistics_bytes(self) -> int:
        """The fused statistics GEMM's pass over the whole rows (``whole_row_statistics_bytes``:
        its workspace and row outputs), with the operands cast to the compute dtype for it
        (autocast): the loss-only route's workspace, and the vocabulary blocks' first pass
        beside their per-block flags."""
        cast_input = (
            self.n_rows * self.hidden * self.compute_dtype.itemsize if self.input_dtype != self.compute_dtype else 0
        )
        return (self.whole_row_statistics_bytes or 0) + self.weight_cast_bytes() + cast_input

    def fixed_workspace_bytes(self) -> int:
        """The workspace every scheme of the call holds, whatever its chunking: the weight
        cast to the compute dtype (autocast) and db's fp32 sum beyond the returned db."""
        db_sum = self.vocab * max(4 - self.bias_dtype.itemsize, 0) if self.bias_dtype is not None else 0
        return self.weight_cast_bytes() + db_sum

    def upcast_bytes(self, rows: int, columns: int, weight_grad_accumulated: bool, input_grad_accumulated: bool) -> int:
        """The fp32 operand copies of the accumulating GEMMs of a ``rows x columns`` block
        (``upcast_operands``): dW's (the block's gradient and the input rows), dX's (the
        gradient and the weight's block); only one GEMM's are alive at a time."""
        if not self.upcast_operands or self.compute_dtype == torch.float32:
            return 0
        weight_grad = rows * (columns + self.hidden) * 4 if weight_grad_accumulated else 0
        input_grad = (rows + self.hidden) * columns * 4 if input_grad_accumulated else 0
        return max(weight_grad, input_grad)

    def row_temporary_bytes(self, rows: int) -> int:
        """Per chunk: the input rows cast to the compute dtype, and dX's rows in it before
        they are written in the input's dtype (autocast)."""
        if self.input_dtype == self.compute_dtype:
            return 0
        return rows * self.hidden * self.compute_dtype.itemsize * (2 if self.grad_input else 1)


@dataclass(frozen=True)
class Memory:
    """A scheme's predicted peak extra memory, and its workspace (the peak minus the
    returned gradients: what the memory budget bounds)."""

    peak: int
    workspace: int


def token_chunk_memory(call: CallShape, rows: int) -> Memory:
    """Peak of ``flce.driver.chunks.run_chunks`` with ``rows`` rows per chunk."""
    n, v, h = call.n_rows, call.vocab, call.hidden
    rows = max(1, min(rows, n))
    c = call.compute_dtype.itemsize
    resident = call.weight_cast_bytes() + (n * h * call.input_dtype.itemsize if call.grad_input else 0)
    resident += v * 4 if call.bias_dtype is not None else 0  # db accumulated in fp32
    final_cast = upcasts = 0
    if call.grad_weight:
        direct = call.one_gemm_weight_grad and rows >= n
        resident += v * h * (call.weight_dtype.itemsize if direct else call.accumulator_dtype.itemsize)
        if not direct and call.accumulator_dtype != call.weight_dtype:
            final_cast = v * h * call.weight_dtype.itemsize
        if not direct and call.accumulator_dtype == torch.float32:
            upcasts = call.upcast_bytes(rows, v, True, False)
    # The chunk's logits, and at different moments the kernel's workspace or the GEMMs' copies.
    transient = max(rows * v * call.chunk_extra_bytes_per_logit, upcasts) + call.row_temporary_bytes(rows)
    loop = resident + rows * logits_row_stride(v) * c + transient
    peak = max(loop, resident + final_cast)
    return Memory(peak, peak - call.gradient_bytes())


def _aligned_up(nbytes: int) -> int:
    return -(-nbytes // WEIGHT_GRAD_SCRATCH_ALIGNMENT) * WEIGHT_GRAD_SCRATCH_ALIGNMENT


def weight_grad_tail_start(call: CallShape, rows: int, block: int) -> int | None:
    """The variant with its workspace inside dW (``workspace_in_weight_grad``): the first
    column of the last vocabulary blocks, whose rows of dW hold the fp32 dX accumulator and
    the block buffer until dX is final (those blocks' dW comes from a second gradient pass
    after it). None where the variant does not apply: several row chunks, dW not written by
    one GEMM, no fp32 dX accumulator to hold (dX not requested, or fp32 itself: the variant
    would only add the second pass), or a workspace larger than dW."""
    n, v = call.n_rows, call.vocab
    if not (call.one_gemm_weight_grad and rows >= n and call.grad_input and call.input_dtype != torch.float32):
        return None
    block = max(1, min(block, v))
    dx_accumulator, buffer = n * call.hidden * 4, rows * logits_row_stride(block) * call.compute_dtype.itemsize
    # Each piece aligned, from an aligned start inside the tail's first row.
    needed = _aligned_up(dx_accumulator) + _aligned_up(buffer) + WEIGHT_GRAD_SCRATCH_ALIGNMENT
    row_bytes = call.hidden * call.weight_dtype.itemsize
    tail_rows = -(-needed // row_bytes)
    if tail_rows > v:
        return None
    return (v - tail_rows) // block * block


def vocab_block_memory(call: CallShape, rows: int, block: int, workspace_in_weight_grad: bool = False) -> Memory:
    """Peak of ``flce.driver.vocab_blocks.run_vocab_blocks`` with ``rows`` rows per chunk
    and vocabulary blocks of ``block`` columns; ``workspace_in_weight_grad``: its variant
    with the workspace inside dW (``weight_grad_tail_start`` must apply)."""
    if call.block_extra_bytes_per_logit is None:
        raise ValueError("the backend has no split-row kernels: the vocabulary-block scheme cannot run")
    n, v, h = call.n_rows, call.vocab, call.hidden
    rows, block = max(1, min(rows, n)), max(1, min(block, v))
    c = call.compute_dtype.itemsize
    n_blocks = -(-v // block)
    buffer = rows * logits_row_stride(block) * c  # alive from its first GEMM until dX is cast
    kernel = rows * block * call.block_extra_bytes_per_logit
    if call.whole_row_statistics_bytes is None:
        statistics = n_blocks * n * call.block_statistics_bytes
        resident = call.weight_cast_bytes() + statistics + buffer
        pass_one = resident + max(kernel + call.row_temporary_bytes(rows), n_blocks * n * BLOCK_COMBINE_BYTES)
    else:
        # The fused GEMM's workspace and outputs (the input cast to the compute dtype with
        # it under autocast); of the per-block statistics only the target-ownership flags.
        statistics = n_blocks * n
        pass_one = statistics + call.fused_statistics_bytes()
        resident = call.weight_cast_bytes() + statistics + buffer
    if not call.any_gradient:
        return Memory(pass_one, pass_one)
    dx_cast = n * h * call.input_dtype.itemsize if call.grad_input and call.input_dtype != torch.float32 else 0
    if workspace_in_weight_grad:
        if weight_grad_tail_start(call, rows, block) is None:
            raise ValueError("the vocabulary blocks cannot hold their workspace inside dW for this call and block")
        # Pass 2 in dW's tail (the accumulator, the buffer); then dX, and the last blocks'
        # second gradient pass with a buffer of their own.
        resident = call.weight_cast_bytes() + statistics + v * h * call.weight_dtype.itemsize
        resident += v * 4 if call.bias_dtype is not None else 0
        upcasts = call.upcast_bytes(rows, block, False, call.grad_input)
        temporaries = call.row_temporary_bytes(rows)
        pass_two = resident + max(kernel, upcasts) + temporaries
        tail_pass = resident + dx_cast + buffer + kernel + temporaries
        peak = max(pass_one, pass_two, tail_pass)
        return Memory(peak, peak - call.gradient_bytes())
    resident += n * h * 4 if call.grad_input else 0  # dX accumulated in fp32
    resident += v * h * call.weight_dtype.itemsize if call.grad_weight else 0  # dW, filled block by block
    resident += v * 4 if call.bias_dtype is not None else 0
    weight_block = 0
    weight_grad_accumulated = call.grad_weight and not (call.one_gemm_weight_grad and rows >= n)
    if weight_grad_accumulated:
        weight_block = block * h * call.accumulator_dtype.itemsize
    accumulated_in_fp32 = weight_grad_accumulated and call.accumulator_dtype == torch.float32
    upcasts = call.upcast_bytes(rows, block, accumulated_in_fp32, call.grad_input)
    transient = max(kernel, upcasts) + call.row_temporary_bytes(rows)
    # The block buffer is freed before dX's cast: the two never coexist.
    peak = max(pass_one, resident + weight_block + transient, resident - buffer + dx_cast)
    return Memory(peak, peak - call.gradient_bytes())


# ------------------------------------------------------- rows and blocks that fit


def _balanced(n_rows: int, rows: int) -> int:
    """With ``ceil(N / rows)`` chunks needed, make them all ``ceil(N / k)`` rows, so the
    last one is not a tiny, inefficient GEMM (never more than ``rows``)."""
    num_chunks = math.ceil(n_rows / rows)
    return math.ceil(n_rows / num_chunks)


def _largest_rows(n_rows: int, workspace_of_rows, budget: int) -> int | None:
    """The most rows per chunk (balanced) whose workspace fits ``budget``, or None when
    not even one row does. One chunk of every row may need less than a little fewer rows
    (dW written by one GEMM, no accumulator), so it is tried first; below N rows the
    workspace grows with the rows, and the largest that fits is found by bisection."""
    if n_rows <= 0:
        return 1
    if workspace_of_rows(n_rows) <= budget:
        return n_rows
    low, high = 0, n_rows - 1
    while low < high:
        mid = (low + high + 1) // 2
        if workspace_of_rows(mid) <= budget:
            low = mid
        else:
            high = mid - 1
    return _balanced(n_rows, low) if low >= 1 else None


def largest_token_rows(call: CallShape, budget: int) -> int | None:
    """The most rows per token chunk whose workspace fits ``budget``, or None."""
    return _largest_rows(call.n_rows, lambda rows: token_chunk_memory(call, rows).workspace, budget)


def largest_block_rows(call: CallShape, block: int, budget: int) -> int | None:
    """The most rows per chunk whose workspace with ``block``-column blocks fits ``budget``, or None."""
    return _largest_rows(call.n_rows, lambda rows: vocab_block_memory(call, rows, block).workspace, budget)


def block_workspace(call: CallShape, rows: int, block: int, workspace_in_weight_grad: bool = False) -> float:
    """``vocab_block_memory(...).workspace``, infinite where the variant with the workspace
    inside dW does not apply (``weight_grad_tail_start``)."""
    if workspace_in_weight_grad and weight_grad_tail_start(call, rows, block) is None:
        return math.inf
    return vocab_block_memory(call, rows, block, workspace_in_weight_grad).workspace


def _blocks_workspace(call: CallShape, rows: int, workspace_in_weight_grad: bool):
    """Workspace as a function of the number of (balanced) vocabulary blocks."""
    return lambda n_blocks: block_workspace(call, rows, -(-call.vocab // n_blocks), workspace_in_weight_grad)


@functools.lru_cache(maxsize=4096)
def _least_workspace_blocks(call: CallShape, rows: int, workspace_in_weight_grad: bool = False) -> int:
    """The block count with (near) the least workspace for ``rows`` rows per chunk. The
    blocks' buffers shrink with more blocks while the (B, N) statistics grow, so the
    workspace falls to one minimum and rises again: a scan over powers of two, then
    finer steps around the best."""
    vocab, workspace = call.vocab, _blocks_workspace(call, rows, workspace_in_weight_grad)
    coarse = sorted({min(vocab, 2**i) for i in range(vocab.bit_length() + 1)})
    best = min(coarse, key=workspace)
    fine = {max(1, min(vocab, round(best * 1.1**i))) for i in range(-8, 9)}
    best = min(sorted(fine), key=workspace)
    return min(range(max(1, best - 2), min(vocab, best + 2) + 1), key=workspace)


def aligned_block(block: int, vocab: int) -> int:
    """``block`` rounded down to a multiple of ``BLOCK_ALIGNMENT`` columns (the whole
    vocabulary, and blocks narrower than one alignment, stay as they are)."""
    if block >= vocab or block <= BLOCK_ALIGNMENT:
        return min(block, vocab)
    return block - block % BLOCK_ALIGNMENT


def least_workspace_block(call: CallShape, rows: int, workspace_in_weight_grad: bool = False) -> int:
    """The block width (columns, aligned) of (near) the least workspace for ``rows`` rows per
    chunk: of the aligned widths on either side of the balanced optimum, the lesser. With
    the workspace inside dW, never narrower than one alignment (the narrow blocks' GEMMs
    are slow, and the workspace saved is a block buffer's)."""
    balanced = -(-call.vocab // _least_workspace_blocks(call, rows, workspace_in_weight_grad))
    below = aligned_block(balanced, call.vocab)
    if workspace_in_weight_grad:
        below = max(below, min(BLOCK_ALIGNMENT, call.vocab))
    above = aligned_block(below + BLOCK_ALIGNMENT, call.vocab) if below >= BLOCK_ALIGNMENT else below

    def workspace(block: int) -> float:
        return block_workspace(call, rows, block, workspace_in_weight_grad)

    block = min((below, above), key=lambda block: (workspace(block), -block))
    # Over the aligned widths the workspace falls to one minimum and rises again, but the
    # balanced optimum can lie more than one alignment from it (with the workspace inside
    # dW at N = 8192, V = 151936, H = 4096 it gave 896 columns where 1024 need less, and a
    # budget of 1024's workspace was refused): step to a lesser neighbour while there is one.
    while block >= BLOCK_ALIGNMENT and block < call.vocab:
        neighbours = [
            width
            for width in (block - BLOCK_ALIGNMENT, aligned_block(block + BLOCK_ALIGNMENT, call.vocab))
            if width >= BLOCK_ALIGNMENT and workspace(width) < workspace(block)
        ]
        if not neighbours:
            break
        block = min(neighbours, key=workspace)
    return block


def largest_block(call: CallShape, rows: int, budget: int, workspace_in_weight_grad: bool = False) -> int | None:
    """The widest vocabulary block (a multiple of ``BLOCK_ALIGNMENT`` columns, or the whole
    vocabulary) whose workspace with ``rows`` rows per chunk fits ``budget``, or None;
    ``workspace_in_weight_grad``: of that variant, where it applies."""
    vocab = call.vocab
    workspace = _blocks_workspace(call, rows, workspace_in_weight_grad)
    least = least_workspace_block(call, rows, workspace_in_weight_grad)
    if block_workspace(call, rows, least, workspace_in_weight_grad) > budget:
        return None

    # Wider than the least-workspace block, the workspace grows with the width (the
    # buffers grow faster than the per-block statistics shrink; the variant inside dW
    # stops applying once its workspace outgrows dW): the widest aligned width that fits,
    # by bisection over multiples of the alignment.
    def fits(units: int) -> bool:
        return block_workspace(call, rows, min(units * BLOCK_ALIGNMENT, vocab), workspace_in_weight_grad) <= budget

    if least < BLOCK_ALIGNMENT and (vocab <= BLOCK_ALIGNMENT or not fits(1)):
        # Blocks narrower than one alignment (a small vocabulary, or per-block statistics
        # so cheap that the least workspace takes many narrow blocks, as with the fused
        # first pass, and a budget that no aligned width fits): balanced blocks
        # (``ceil(V / B)`` columns for the fewest blocks ``B`` that fit), by bisection.
        low, high = 1, _least_workspace_blocks(call, rows, workspace_in_weight_grad)
        while low < high:
            mid = (low + high) // 2
            if workspace(mid) <= budget:
                high = mid
            else:
                low = mid + 1
        return -(-vocab // low)

    low, high = max(1, least // BLOCK_ALIGNMENT), -(-vocab // BLOCK_ALIGNMENT)
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return min(low * BLOCK_ALIGNMENT, vocab)


# ------------------------------------------------------------ chunk sizing


def default_chunk_size(
    n_rows: int,
    vocab: int,
    logits_dtype: torch.dtype,
    extra_bytes_per_logit: int = 0,
    budget_bytes: int | None = None,
) -> int:
    """Rows per chunk so that a chunk's logits (plus the kernel's workspace) fit the budget
    (``FLCE_CHUNK_BUDGET_MIB`` or 512 MiB unless given): the scheme of ``flce.cross_entropy``
    on given logits and of the vocab-parallel loss."""
    if n_rows <= 0:
        return 1
    budget = chunk_budget_bytes() if budget_bytes is None else budget_bytes
    bytes_per_row = vocab * (logits_dtype.itemsize + extra_bytes_per_logit)
    rows = max(1, min(n_rows, budget // max(bytes_per_row, 1)))
    return _balanced(n_rows, rows)


def whole_row_chunk_size(
    n_rows: int,
    vocab: int,
    hidden: int,
    compute_dtype: torch.dtype,
    weight_dtype: torch.dtype,
    extra_bytes_per_logit: int,
    fp32_weight_accumulator: bool,
    upcast_operands: bool = False,  # CallShape.upcast_operands
    input_dtype: torch.dtype | None = None,  # None: compute_dtype (no rows cast per chunk)
    constant_weight_cast_bytes: int = 0,  # CallShape.constant_weight_cast_bytes
) -> int:
    """``run_token_chunks``'s rows per chunk when no scheme was chosen for it (the
    distillation head): the most that fit ``FLCE_MEMORY_BUDGET_MIB`` when set
    (``MemoryBudgetError`` when not even one row does), else ``FLCE_CHUNK_BUDGET_MIB``'s
    logits budget when set, else the token chunks of the default budget: the precedence
    of ``flce.driver.schemes``."""
    call = CallShape(
        n_rows,
        vocab,
        hidden,
        input_dtype=input_dtype or compute_dtype,
        weight_dtype=weight_dtype,
        compute_dtype=compute_dtype,
        accumulator_dtype=torch.float32 if fp32_weight_accumulator else weight_dtype,
        grad_input=False,
        chunk_extra_bytes_per_logit=extra_bytes_per_logit,
        upcast_operands=upcast_operands,
        constant_weight_cast_bytes=constant_weight_cast_bytes,
    )
    from_env = env_memory_budget_bytes()
    if from_env is not None:
        rows = largest_token_rows(call, from_env)
        if rows is None:
            least = min((1, n_rows), key=lambda rows: token_chunk_memory(call, rows).workspace)
            need = token_chunk_memory(call, least).workspace
            described = f"one chunk of {n_rows} rows" if least >= n_rows else "token chunks of 1 rows"
            raise budget_too_small(from_env, need, described, MEMORY_BUDGET_ENV_VAR)
        return rows
    legacy = legacy_chunk_budget_bytes()
    if legacy is not None:
        return default_chunk_size(n_rows, vocab, compute_dtype, extra_bytes_per_logit, legacy)
    return largest_token_rows(call, default_memory_budget(call, None)) or 1


def peak_extra_bytes(
    n_rows: int,
    vocab: int,
    hidden: int,
    itemsize: int,
    extra_bytes_per_logit: int,
    chunk: int,
) -> int:
    """The module docstring's peak extra memory of a forward+backward call with a
    bf16/fp16 weight (``itemsize`` bytes) and fp32 dW accumulation, for ``chunk`` rows
    per chunk (a promise that the GPU tests hold the driver to)."""
    logits = chunk * (logits_row_stride(vocab) * itemsize + vocab * extra_bytes_per_logit)
    if chunk >= n_rows:
        body = logits + vocab * hidden * itemsize
    else:
        body = max(logits + vocab * hidden * 4, vocab * hidden * (4 + itemsize))
    return body + n_rows * hidden * itemsize + vocab * 4
