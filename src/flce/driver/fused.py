"""The fused-statistics scheme for calls without gradients: one GEMM whose epilogue
reduces each logits tile to per-row statistics (a backend's ``loss_only`` slot, the
CuTe DSL Hopper kernel today), from which the loss rows follow; no logits buffer."""

from __future__ import annotations

import torch

from flce.backends.base import LossOnlyStatistics
from flce.driver.chunks import allocate_rows
from flce.options import LossOptions
from flce.rows.cross_entropy import ChunkScalars, RowOutputs, rows_from_statistics


def loss_only_refusal(options: LossOptions, has_ce_weight: bool) -> str | None:
    """Why the options need the chunked driver instead of whole-row statistics, or None."""
    # vocab_chunk_size asks for the vocabulary-block scheme explicitly; it is honoured.
    if options.vocab_chunk_size is not None:
        return "vocab_chunk_size selects the vocabulary-block driver"
    # Label smoothing with class weights needs sum_i w_i z'_i; the statistics hold sum_i z'_i.
    if options.label_smoothing > 0 and has_ce_weight:
        return "label smoothing with class weights needs a weighted logit sum"
    return None


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
    """Per-row outputs from the hook's whole-row statistics of ``z'``: ``lse``,
    ``target_logit = z'_y`` (any value on ignored rows), ``predicted`` (argmax, first
    index) and, with label smoothing, ``logit_sum = sum_i z'_i``. The reference point of
    ``flce.rows.cross_entropy.rows_from_statistics`` is ``m = lse``: ``log_s = 0``, the
    shifted target ``z'_y - lse`` and the shifted smoothing sum ``logit_sum - V * lse``.
    The operands go in the compute dtype, as the chunked driver's GEMM takes them (the
    bias rounded to it, as its ``addmm`` rounds it)."""
    x = input.to(compute_dtype)
    if not x.is_contiguous() or x.data_ptr() % 16:
        # TMA needs a row-major, 16-byte aligned X; a copy of it is small next to the logits.
        x = x.clone(memory_format=torch.contiguous_format)
    y = target if target.dtype in (torch.int64, torch.int32) else target.long()
    statistics = hook.statistics(
        x,
        weight.to(compute_dtype),
        y,
        bias=None if bias is None else bias.to(compute_dtype),
        softcap=options.softcap,
        with_logit_sum=options.label_smoothing > 0,
    )
    lse = statistics["lse"]
    rows = allocate_rows(lse.shape[0], options, lse.device)
    shifted_smooth = None
    if options.label_smoothing > 0:
        shifted_smooth = statistics["logit_sum"] - scalars.weight_sum * lse
    rows_from_statistics(
        rows,
        target,
        target != scalars.ignore_index,
        lse,
        None,  # log_s = 0: the reference point is the lse itself
        statistics["target_logit"] - lse,
        shifted_smooth,
        statistics["predicted"],
        ce_weight,
        scalars,
        weight.shape[0],
    )
    return rows
