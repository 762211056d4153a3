"""Whole-row statistics from one GEMM whose epilogue reduces each logits tile to per-row
statistics (a backend's ``loss_only`` slot, the CuTe DSL Hopper kernel today), from which
the loss rows follow; no logits buffer. Calls without gradients run on them alone
(``run_fused_statistics``); the vocabulary-block scheme takes its first pass from them
(``flce.driver.vocab_blocks``)."""

from __future__ import annotations

import torch

from flce.backends.base import LossOnlyStatistics
from flce.driver.chunks import allocate_rows
from flce.options import LossOptions
from flce.rows.cross_entropy import ChunkScalars, RowOutputs, rows_from_statistics


def whole_row_statistics_refusal(options: LossOptions, has_ce_weight: bool) -> str | None:
    """Why the fused statistics cannot give these options' loss rows, or None."""
    # Label smoothing with class weights needs sum_i w_i z'_i; the statistics hold sum_i z'_i.
    if options.label_smoothing > 0 and has_ce_weight:
        return "label smoothing with class weights needs a weighted logit sum"
    return None


def loss_only_refusal(options: LossOptions, has_ce_weight: bool) -> str | None:
    """Why a call without gradients needs the chunked driver instead of whole-row statistics, or None."""
    # vocab_chunk_size asks for the vocabulary-block scheme explicitly; it is honoured
    # (its first pass may still take the fused statistics).
    if options.vocab_chunk_size is not None:
        return "vocab_chunk_size selects the vocabulary-block driver"
    return whole_row_statistics_refusal(options, has_ce_weight)


def fused_whole_row_statistics(
    hook: LossOnlyStatistics,
    input: torch.Tensor,  # (N, H) any float dtype
    weight: torch.Tensor,  # (V, H) compute dtype, TMA-ready (the hook's ``applicable``)
    target: torch.Tensor,  # (N,)
    bias: torch.Tensor | None,  # (V,) compute dtype
    softcap: float | None,
    with_logit_sum: bool,
    compute_dtype: torch.dtype,
) -> dict:
    """The hook's statistics of ``z' = softcap(x W^T + b)`` with the operands as the
    chunked driver's GEMM takes them (``LossOnlyStatistics``): (N,) ``lse``,
    ``target_logit`` (0 where the target is outside [0, V)), ``predicted`` and, with
    ``with_logit_sum``, ``logit_sum``."""
    x = input.to(compute_dtype)
    if not x.is_contiguous() or x.data_ptr() % 16:
        # TMA needs a row-major, 16-byte aligned X; a copy of it is small next to the logits.
        x = x.clone(memory_format=torch.contiguous_format)
    y = target if target.dtype in (torch.int64, torch.int32) else target.long()
    return hook.statistics(x, weight, y, bias=bias, softcap=softcap, with_logit_sum=with_logit_sum)


def rows_from_whole_row_statistics(
    rows: RowOutputs,
    statistics: dict,  # fused_whole_row_statistics'
    target: torch.Tensor,  # (N,)
    valid: torch.Tensor,  # (N,) bool: target != ignore_index
    ce_weight: torch.Tensor | None,  # (V,) fp32
    scalars: ChunkScalars,
    vocab: int,
) -> torch.Tensor | None:
    """Stores the per-row outputs; returns the token scale (``use_token_scaling``). The
    reference point of ``flce.rows.cross_entropy.rows_from_statistics`` is ``m = lse``:
    ``log_s = 0``, the shifted target ``z'_y - lse`` and the shifted smoothing sum
    ``logit_sum - W * lse`` (W: the class-weight sum, V without weights)."""
    lse = statistics["lse"]
    shifted_smooth = None
    if "logit_sum" in statistics:
        shifted_smooth = statistics["logit_sum"] - scalars.weight_sum * lse
    return rows_from_statistics(
        rows,
        target,
        valid,
        lse,
        None,  # log_s = 0: the reference point is the lse itself
        statistics["target_logit"] - lse,
        shifted_smooth,
        statistics["predicted"],
        ce_weight,
        scalars,
        vocab,
    )


def run_fused_statistics(
    hook: LossOnlyStatistics,
    input: torch.Tensor,  # (N, H)
    weight: torch.Tensor,  # (V, H)
    target: torch.Tensor,  # (N,)
    bias: torch.Tensor | None,  # (V,)
    ce_weight: torch.Tensor | None,  # (V,) fp32
    options: LossOptions,
    compute_dtype: torch.dtype,
    scalars: ChunkScalars,
) -> RowOutputs:
    """Per-row outputs of a call without gradients from the whole-row statistics. The
    operands go in the compute dtype, as the chunked driver's GEMM takes them (the bias
    rounded to it, as its ``addmm`` rounds it)."""
    statistics = fused_whole_row_statistics(
        hook,
        input,
        weight.to(compute_dtype),
        target,
        None if bias is None else bias.to(compute_dtype),
        options.softcap,
        options.label_smoothing > 0,
        compute_dtype,
    )
    rows = allocate_rows(input.shape[0], options, input.device)
    valid = target != scalars.ignore_index
    rows_from_whole_row_statistics(rows, statistics, target, valid, ce_weight, scalars, weight.shape[0])
    return rows
