"""The vocabulary-block scheme (``vocab_chunk_size=``): token chunks x vocabulary blocks.

Pass 1 runs the logits GEMM block by block and merges each block's row statistics
(max, sum of exp, target logit, smoothing sum, argmax) into the whole row's
(``flce.rows.cross_entropy.BlockStatistics``), or, where the backend's fused statistics
GEMM applies (``fused_statistics``: its ``loss_only`` slot, ``flce.driver.fused``), takes
the whole rows' statistics from that one GEMM: no logits written or read, one launch
instead of a GEMM and a statistics pass per block. Pass 2, only for gradients, recomputes
each block's logits, writes their gradient in place (the backend's split-row kernels)
and finishes that block of dW in one fp32 accumulator of ``V_b x H`` before moving on
(or, when one chunk holds every row, writes it into dW directly: one GEMM accumulates in
fp32 inside); dX is accumulated in fp32 over the blocks and cast once the block buffer
is freed. Exact fp32 accumulation of both with peak extra memory
``N*H*4 + dW + max(C*V_b*(itemsize + extra) + V_b*H*4, dX)`` (no ``V_b*H*4`` term with one
row chunk) instead of a ``V x H`` fp32 buffer, for one more logits GEMM (8NVH FLOPs
instead of 6NVH).

With one row chunk, the workspace can live inside dW (``weight_grad_tail_start``, chosen
by the memory budget): until the last block's dX is summed, the rows of dW that the last
blocks (columns from ``weight_grad_tail_start`` on) will hold are free, and they hold the
fp32 dX accumulator and the block buffer. Those blocks add their dX then, and their dW
once dX is cast, from a second gradient pass with a buffer of its own. Peak extra memory
``dW + dX + C*V_b*(itemsize + extra)``: the returned gradients and one block, for the
last blocks' logits GEMM and gradient pass again (``flce.driver.sizing``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from flce.backends.base import BlockGradientGemm, LossOnlyStatistics, SplitRowKernels
from flce.driver.chunks import (
    Gradients,
    GradRequest,
    allocate_rows,
    in_compute_dtype,
    logits_buffer,
    logits_tile,
    row_range,
)
from flce.driver.fused import fused_whole_row_statistics, rows_from_whole_row_statistics
from flce.driver.gemm import (
    accumulate_column_sums,
    accumulate_product,
    full_precision_reductions,
    logits_product,
    weight_accumulator_dtype,
    weight_grad_in_one_gemm,
)
from flce.driver.sizing import WEIGHT_GRAD_SCRATCH_ALIGNMENT, default_chunk_size, logits_row_stride
from flce.options import LossOptions
from flce.rows.cross_entropy import (
    BlockStatistics,
    ChunkScalars,
    RowOutputs,
    combine_blocks,
    gather_safe_target,
    gradient_coefficients,
    row_scale,
    rows_from_statistics,
)


def _block_sums(ce_weight: torch.Tensor | None, vocab: int, block: int, device: torch.device) -> torch.Tensor:
    """(B,) fp32: each block's class-weight sum (its width without weights), made on the
    device (filling a device tensor from host numbers one by one would sync)."""
    if ce_weight is None:
        starts = torch.arange(0, vocab, block, device=device, dtype=torch.float32)
        return (vocab - starts).clamp(max=block)
    padded = torch.zeros(-(-vocab // block) * block, dtype=torch.float32, device=device)
    padded[:vocab] = ce_weight
    return padded.view(-1, block).sum(dim=1)


@dataclass(frozen=True)
class _BlockTargets:
    """Each block's targets, for both passes, from one block index per row: the target's
    column in the block where the block holds it, the block's width where another block
    does, -1 on ignored rows (the split-row kernels read any column outside the block as
    absent). Two ops per block and pass: every op costs host time, and with small blocks
    the host, not the GPU, set the pace."""

    valid: torch.Tensor  # (N,) bool: target != ignore_index
    safe_target: torch.Tensor  # (N,) int64, in [0, V) (``gather_safe_target``)
    owned_by: torch.Tensor  # (B, N) bool: the block holding each row's target
    owned_rows: tuple[torch.Tensor, ...]  # owned_by's B rows
    absent: dict[int, torch.Tensor]  # block width -> (N,) int64: the width, -1 on ignored rows

    @classmethod
    def of(cls, target: torch.Tensor, ignore_index: int, vocab: int, block: int) -> _BlockTargets:
        valid = target != ignore_index
        safe_target = gather_safe_target(target, valid, vocab)
        n_blocks = -(-vocab // block)
        block_of = torch.where(valid, torch.div(safe_target, block, rounding_mode="floor"), -1)  # (N,)
        owned_by = block_of[None, :] == torch.arange(n_blocks, device=target.device)[:, None]  # (B, N)
        widths = {block, vocab - (n_blocks - 1) * block}
        absent = {width: torch.where(valid, width, -1) for width in widths}
        return cls(valid, safe_target, owned_by, owned_by.unbind(0), absent)

    def of_block(self, index: int, v0: int, v1: int) -> torch.Tensor:  # (N,) int64
        return torch.where(self.owned_rows[index], self.safe_target - v0, self.absent[v1 - v0])


def _per_block_statistics(
    n_blocks: int, n_rows: int, smoothing: bool, with_argmax: bool, device: torch.device
) -> BlockStatistics:
    """Pass 1's statistics of every block, ``(B, N)`` each, to be written block by block
    (the shifted target stays 0 in the blocks that do not hold it)."""
    f32 = dict(dtype=torch.float32, device=device)
    return BlockStatistics(
        row_max=torch.empty(n_blocks, n_rows, **f32),
        row_sum=torch.empty(n_blocks, n_rows, **f32),
        target_shifted=torch.zeros(n_blocks, n_rows, **f32),
        smooth_shifted=torch.empty(n_blocks, n_rows, **f32) if smoothing else None,
        argmax=torch.empty(n_blocks, n_rows, dtype=torch.int64, device=device) if with_argmax else None,
    )


def _block_views(per_block: BlockStatistics, n_blocks: int) -> list[BlockStatistics]:
    """The ``(B, N)`` per-block statistics as B ``BlockStatistics`` of ``(N,)`` row views
    (one op per field for all the blocks)."""
    fields = [
        [None] * n_blocks if t is None else t.unbind(0)
        for t in (
            per_block.row_max,
            per_block.row_sum,
            per_block.target_shifted,
            per_block.smooth_shifted,
            per_block.argmax,
        )
    ]
    return [BlockStatistics(*views) for views in zip(*fields, strict=True)]


def _weight_grad_scratch(
    dw: torch.Tensor,  # (V, H) bf16/fp16, contiguous: the returned dW, not yet written
    tail_start: int,  # the first row of dW that the scratch may use
    dx_shape: tuple[int, int],  # (N, H) of the fp32 dX accumulator
    buffer_elements: int,  # the block buffer's, in dW's dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of dW's rows from ``tail_start`` on as the fp32 dX accumulator ``(N, H)`` and
    the block buffer ``(buffer_elements,)``, each starting ``WEIGHT_GRAD_SCRATCH_ALIGNMENT``
    bytes aligned (the layout ``flce.driver.sizing.weight_grad_tail_start`` sized)."""
    itemsize = dw.element_size()
    flat = dw.view(-1)
    align = WEIGHT_GRAD_SCRATCH_ALIGNMENT // itemsize  # elements

    def aligned(offset: int) -> int:
        base = flat.storage_offset()  # the allocation's own alignment counts
        return -(-(base + offset) // align) * align - base

    offset = aligned(tail_start * dw.shape[1])
    dx_elements = dx_shape[0] * dx_shape[1] * 4 // itemsize
    dx_accumulator = flat[offset : offset + dx_elements].view(torch.float32).view(dx_shape)
    offset = aligned(offset + dx_elements)
    if offset + buffer_elements > flat.numel():
        raise RuntimeError("flce: the vocabulary blocks' workspace does not fit in dW's last blocks (sizing bug)")
    return dx_accumulator, flat[offset : offset + buffer_elements]


def _store_rows(into: BlockStatistics, r0: int, r1: int, stats: BlockStatistics, column_offset: int) -> None:
    """Writes one block's statistics of rows ``[r0, r1)`` into its ``(N,)`` views ``into``,
    the argmax as a global column."""
    row_range(into.row_max, r0, r1).copy_(stats.row_max)
    row_range(into.row_sum, r0, r1).copy_(stats.row_sum)
    row_range(into.target_shifted, r0, r1).copy_(stats.target_shifted)
    if into.smooth_shifted is not None:
        row_range(into.smooth_shifted, r0, r1).copy_(stats.smooth_shifted)
    if into.argmax is not None:
        torch.add(stats.argmax, column_offset, out=row_range(into.argmax, r0, r1))


def run_vocab_blocks(
    input: torch.Tensor,  # (N, H)
    weight: torch.Tensor,  # (V, H)
    target: torch.Tensor,  # (N,)
    bias: torch.Tensor | None,  # (V,)
    ce_weight: torch.Tensor | None,  # (V,) fp32
    options: LossOptions,
    kernels: SplitRowKernels,
    compute_dtype: torch.dtype,
    scalars: ChunkScalars,
    request: GradRequest,
    row_grad_scale: torch.Tensor | None = None,  # (N,) fp32
    *,
    fused_statistics: LossOnlyStatistics | None = None,  # pass 1 from it (applicable: flce.plan)
    fused_gradient: BlockGradientGemm | None = None,  # pass 2 from it (with fused_statistics only)
    weight_grad_tail_start: int | None = None,  # the workspace inside dW (flce.driver.schemes.Scheme)
) -> tuple[RowOutputs, Gradients]:
    """The driver over token chunks x vocabulary blocks of ``options.vocab_chunk_size``
    (module docstring); ``weight_grad_tail_start``: the first column of the blocks whose
    rows of dW hold the workspace (one row chunk, dW written by one GEMM per block)."""
    n_rows, hidden = input.shape
    vocab = weight.shape[0]
    device = input.device
    block = max(1, min(options.vocab_chunk_size, vocab))
    chunk = options.chunk_size or default_chunk_size(n_rows, block, compute_dtype, kernels.extra_bytes_per_logit)
    chunk = max(1, min(chunk, max(n_rows, 1)))
    w = in_compute_dtype(weight, compute_dtype)
    b = in_compute_dtype(bias, compute_dtype)
    smoothing = scalars.label_smoothing > 0
    # The first GEMM goes first: every op queued before it is host time the GPU waits
    # through, and the targets' bookkeeping and the row outputs are a dozen small ops
    # (traced on an H200: 1.1-1.6 ms of idle GPU before the fused GEMM at N = 8192,
    # V = 32000 and 128256). They follow the fused statistics GEMM here, and the first
    # block's logits GEMM in the pass of one GEMM per block (``targets``, on first use).
    statistics = None
    if fused_statistics is not None:
        statistics = fused_whole_row_statistics(
            fused_statistics, input, w, target, b, scalars.softcap, smoothing, compute_dtype
        )

    @cache
    def targets() -> _BlockTargets:
        return _BlockTargets.of(target, scalars.ignore_index, vocab, block)

    # The block logits as one full (C, V_b) tile with aligned rows (``logits_buffer``): every
    # logits tile but the last row chunk's and the last block's, which are views of its first
    # rows and columns (no view op per tile otherwise). With the fused first pass it waits
    # for pass 2 (a lower peak in pass 1).
    full_tile = None
    if fused_statistics is None and n_rows:
        full_tile = logits_buffer(chunk, block, compute_dtype, device, b)

    # Each block's slices of the weights, as views made once for both passes (one op per
    # tensor): the block's rows of W (dX), its columns of W^T (the logits GEMM), of the bias
    # and of the class weights.
    w_parts, w_t_parts = w.split(block), w.t().split(block, dim=1)
    b_parts = [None] * len(w_parts) if b is None else b.split(block)
    ce_parts = [None] * len(w_parts) if ce_weight is None else ce_weight.split(block)

    def blocks():
        for index, v0 in enumerate(range(0, vocab, block)):
            yield v0, min(v0 + block, vocab), ce_parts[index], w_parts[index], w_t_parts[index], b_parts[index]

    def tile_of(tile_rows: int, tile_cols: int) -> torch.Tensor:  # (C, V_b)
        # The last row chunk's and the last block's tiles keep the full tile's aligned row
        # stride: a ragged last block of an odd vocabulary would otherwise be a GEMM
        # operand with an unaligned leading dimension. A biased product's last block of an
        # aligned width takes the first elements of a contiguous full tile instead, rows of
        # its own width: its bias is then added in the GEMM's epilogue (``logits_row_stride``).
        if (tile_rows, tile_cols) == (chunk, block):
            return full_tile
        if (
            tile_cols < block
            and full_tile.is_contiguous()
            and logits_row_stride(tile_cols, compute_dtype, b) == tile_cols
        ):
            return full_tile.view(-1)[: tile_rows * tile_cols].view(tile_rows, tile_cols)
        return full_tile[:tile_rows, :tile_cols]

    def logits_of(r0: int, r1: int, x: torch.Tensor, w_t_block: torch.Tensor, b_block: torch.Tensor | None):
        return logits_product(tile_of(r1 - r0, w_t_block.shape[1]), x, w_t_block, b_block)

    def chunks():
        for r0 in range(0, n_rows, chunk):
            r1 = min(r0 + chunk, n_rows)
            yield r0, r1, in_compute_dtype(row_range(input, r0, r1), compute_dtype)

    f32 = dict(dtype=torch.float32, device=device)
    n_blocks = len(w_parts)
    if statistics is not None:
        # Pass 1: the whole rows' statistics from one fused GEMM (queued above), each row's
        # reference point its lse (row max = lse, sum of exp = 1). The block buffer waits
        # for pass 2.
        rows = allocate_rows(n_rows, options, device)
        token_scale = rows_from_whole_row_statistics(
            rows, statistics, target, targets().valid, ce_weight, scalars, vocab
        )
        lse = row_max = statistics["lse"]
        inv_sum = torch.ones_like(lse)
    else:
        # Pass 1: each block's row statistics, kept per block ((B, N): a few floats per row
        # and block), then combined over the blocks the way the vocab-parallel loss combines
        # them over ranks (``combine_blocks``). Their buffers, like the targets, are made
        # once the first GEMM is queued (on first use).
        @cache
        def outputs() -> tuple[RowOutputs, BlockStatistics, list[BlockStatistics]]:
            rows = allocate_rows(n_rows, options, device)
            per_block = _per_block_statistics(n_blocks, n_rows, smoothing, rows.needs_argmax, device)
            return rows, per_block, _block_views(per_block, n_blocks)

        for index, (v0, v1, ce_block, _, w_t_block, b_block) in enumerate(blocks()):
            target_of_block = None
            for r0, r1, x in chunks():
                logits = logits_of(r0, r1, x, w_t_block, b_block)
                rows, per_block, into_blocks = outputs()
                if target_of_block is None:  # once per block, after its first GEMM
                    target_of_block = targets().of_block(index, v0, v1)
                stats = kernels.statistics(
                    logits,
                    row_range(target_of_block, r0, r1),
                    ce_block,
                    scalars.softcap,
                    with_smoothing=smoothing,
                    with_argmax=per_block.argmax is not None,
                    approximate_tanh=scalars.approximate_tanh,
                )
                _store_rows(into_blocks[index], r0, r1, stats, column_offset=v0)
        # No reference to pass 1's buffer outlives it: with the workspace inside dW, pass 2
        # frees it before using dW's tail (a view kept here held 134 MiB more at the
        # reference shape).
        logits = None
        rows, per_block, _ = outputs()
        block_weight_sums = _block_sums(ce_weight, vocab, block, device)  # (B,)
        whole = combine_blocks(per_block, targets().owned_by, block_weight_sums)

        row_max, log_s = whole.row_max, torch.log(whole.row_sum)
        token_scale = rows_from_statistics(
            rows,
            target,
            targets().valid,
            row_max,
            log_s,
            whole.target_shifted,
            whole.smooth_shifted,
            whole.argmax,
            ce_weight,
            scalars,
            vocab,
        )
        lse = row_max + log_s
        inv_sum = 1.0 / whole.row_sum
    if not request.any:
        return rows, Gradients(None, None, None)

    # Pass 2: the gradient, block by block; each block of dW is final when its loop ends
    # (with the workspace inside dW, the last blocks' dW waits for their second pass).
    valid, safe_target = targets().valid, targets().safe_target
    scale = row_scale(valid, token_scale, row_grad_scale)
    w_y = ce_weight[safe_target] if ce_weight is not None else torch.ones_like(lse)
    eps = scalars.smoothing_eps(vocab)
    # The block-gradient GEMM takes the grouped gradient's per-row coefficients: the same
    # for every block, so folded once here (the split-row kernels fold them per call).
    coefficients = gradient_coefficients(w_y, lse, scale, scalars, eps) if fused_gradient is not None else ()
    dw = torch.empty(vocab, hidden, dtype=weight.dtype, device=device) if request.weight else None
    db = torch.zeros(vocab, **f32) if request.bias else None
    acc_dtype = weight_accumulator_dtype(options.accum_dtype, weight.dtype)
    # One row chunk per block: each dW block is written directly, which saves the
    # V_b x H fp32 accumulator, this mode's largest buffer after dW itself.
    dw_direct = request.weight and weight_grad_in_one_gemm(n_rows, chunk, weight.dtype, compute_dtype, acc_dtype)
    dw_parts = dw.split(block) if dw is not None else None
    tail_start = vocab if weight_grad_tail_start is None else weight_grad_tail_start
    if tail_start < vocab:
        if not (dw_direct and request.input and input.dtype != torch.float32):
            raise ValueError(
                "weight_grad_tail_start needs dW written by one GEMM per block (one row chunk, a bf16/fp16 "
                "weight) and dX of a bf16/fp16 input (flce.driver.sizing.weight_grad_tail_start)"
            )
        full_tile = None  # pass 1's, if any: freed before its place in dW is used
        buffer_elements = chunk * logits_row_stride(block, compute_dtype, b)
        dx_acc, scratch = _weight_grad_scratch(dw, tail_start, (n_rows, hidden), buffer_elements)
        full_tile = logits_tile(scratch, chunk, block, b)
        dx_acc.zero_()
    else:
        if full_tile is None and n_rows:
            full_tile = logits_buffer(chunk, block, compute_dtype, device, b)
        dx_acc = torch.zeros(n_rows, hidden, **f32) if request.input else None

    def block_gradient(target_of_block: torch.Tensor, r0: int, r1: int, x, ce_block, w_block, w_t_block, b_block):
        """The gradient of the block's logits of rows ``[r0, r1)``: from the fused GEMM,
        or the logits overwritten with it."""
        target_rows = row_range(target_of_block, r0, r1)
        statistics = [row_range(t, r0, r1) for t in (row_max, inv_sum)]
        if fused_gradient is not None:
            grad = tile_of(r1 - r0, w_block.shape[0])
            coefs = [row_range(c, r0, r1) for c in coefficients]
            fused_gradient(
                x, w_block, b_block, grad, target_rows, *statistics, *coefs, scalars.weight_sum, scalars.softcap
            )
            return grad
        grad = logits_of(r0, r1, x, w_t_block, b_block)
        row_factors = [row_range(t, r0, r1) for t in (w_y, lse, scale)]
        kernels.gradient(grad, target_rows, ce_block, *statistics, *row_factors, scalars, eps)
        return grad

    for index, (v0, v1, ce_block, w_block, w_t_block, b_block) in enumerate(blocks()):
        in_tail = v0 >= tail_start
        grad_target_of_block = targets().of_block(index, v0, v1)
        if dw_direct:
            dw_block = None if in_tail else dw_parts[index]  # (V_b, H) contiguous rows of dW
        elif request.weight:
            dw_block = torch.empty(v1 - v0, hidden, dtype=acc_dtype, device=device)
        else:
            dw_block = None
        for r0, r1, x in chunks():
            grad = block_gradient(grad_target_of_block, r0, r1, x, ce_block, w_block, w_t_block, b_block)
            if dx_acc is not None:
                accumulate_product(row_range(dx_acc, r0, r1), grad, w_block, first=False, vocabulary="reduction")
            if dw_direct and dw_block is not None:
                with full_precision_reductions():
                    accumulate_product(dw_block, grad.t(), x, True, vocabulary="rows")
            elif dw_block is not None:
                accumulate_product(dw_block, grad.t(), x, first=r0 == 0, vocabulary="rows")
            if db is not None:
                accumulate_column_sums(db[v0:v1], grad, first=r0 == 0)
        if dw_block is not None and not dw_direct:
            if n_rows == 0:
                dw_block.zero_()
            dw[v0:v1] = dw_block
            del dw_block
    # The block buffer is freed before dX's cast, so that the two never coexist.
    full_tile = grad = None
    dx = None if dx_acc is None else (dx_acc if input.dtype == torch.float32 else dx_acc.to(input.dtype))
    dx_acc = None
    if tail_start < vocab:
        # The last blocks' rows of dW are free again: their gradient once more, then dW.
        full_tile = logits_buffer(chunk, block, compute_dtype, device, b) if n_rows else None
        for index, (v0, v1, ce_block, w_block, w_t_block, b_block) in enumerate(blocks()):
            if v0 < tail_start:
                continue
            grad_target_of_block = targets().of_block(index, v0, v1)
            for r0, r1, x in chunks():
                grad = block_gradient(grad_target_of_block, r0, r1, x, ce_block, w_block, w_t_block, b_block)
                with full_precision_reductions():
                    accumulate_product(dw_parts[index], grad.t(), x, True, vocabulary="rows")
        full_tile = grad = None
    return rows, Gradients(dx, dw, None if db is None else db.to(bias.dtype))
