"""Batch statistics of one call: target validation, the count of valid rows and the
class-weight sums that set the mean's scale, and the kernel scalars derived from them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flce.options import LossOptions
from flce.rows.cross_entropy import ChunkScalars


@dataclass(frozen=True)
class BatchStatistics:
    """Per-call counts read back from the device in one transfer."""

    n_valid: int  # rows whose target is not ignore_index
    ce_denominator: float  # mean reduction's divisor of the CE part: sum of w_y, or n_valid
    weight_sum: float  # sum of ce_weight over the vocabulary (V without weights)

    @property
    def accuracy_scale(self) -> float:
        """The mean's factor of the token accuracy: ``1 / n_valid`` (0 when every row is ignored)."""
        return 1.0 / self.n_valid if self.n_valid else 0.0


def batch_statistics(
    target: torch.Tensor, ce_weight: torch.Tensor | None, vocab: int, ignore_index: int
) -> BatchStatistics:
    """Validates the target range (and class weights) and counts the valid rows with a
    single device-to-host read, the only host sync of a call. Raises ``ValueError``
    naming the first offending value before any kernel reads out of bounds."""
    valid = target != ignore_index
    out_of_range = valid & ((target < 0) | (target >= vocab))
    parts = [valid.sum(), out_of_range.sum()]
    if ce_weight is not None:
        w = ce_weight.float()
        safe_target = torch.where(valid & ~out_of_range, target, torch.zeros_like(target)).long()
        parts += [(w[safe_target] * valid).sum(), w.sum(), ((w < 0) | ~torch.isfinite(w)).sum()]
    values = torch.stack([p.double() for p in parts]).tolist()  # the one host sync
    n_valid, n_bad = int(values[0]), int(values[1])
    if n_bad:
        bad = target[out_of_range][:3].tolist()
        raise ValueError(
            f"target values must be in [0, {vocab}) or equal ignore_index={ignore_index}; "
            f"found {n_bad} out of range (e.g. {bad})"
        )
    if ce_weight is None:
        return BatchStatistics(n_valid, float(n_valid), float(vocab))
    if values[4]:
        raise ValueError("ce_weight must be finite and non-negative; it has negative, NaN or Inf entries")
    return BatchStatistics(n_valid, values[2], values[3])


def chunk_scalars(options: LossOptions, stats: BatchStatistics) -> ChunkScalars:
    """Kernel scalars; the mean reduction is folded into the gradient scales."""
    if options.reduction == "mean":
        ce_scale = 1.0 / stats.ce_denominator if stats.ce_denominator > 0 else 0.0
        z_scale = 1.0 / stats.n_valid if stats.n_valid > 0 else 0.0
    else:
        ce_scale = z_scale = 1.0
    return ChunkScalars(
        ignore_index=options.ignore_index,
        label_smoothing=float(options.label_smoothing),
        lse_square_scale=float(options.lse_square_scale),
        softcap=None if options.softcap is None else float(options.softcap),
        use_token_scaling=options.use_token_scaling,
        ce_grad_scale=ce_scale,
        z_grad_scale=z_scale,
        weight_sum=stats.weight_sum,
    )
