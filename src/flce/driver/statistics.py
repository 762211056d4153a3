"""Batch statistics of one call, on the device: the count of valid rows and the
class-weight sums that set the mean's scale, the input checks that need the data
(``flce.driver.validation``), and the kernel scalars derived from them. Nothing here
reads a value on the host unless validation is synchronous."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flce.driver import validation
from flce.options import LossOptions
from flce.rows.cross_entropy import ChunkScalars


@dataclass(frozen=True)
class BatchStatistics:
    """Per-call statistics, 0-dim fp32 tensors on the call's device."""

    n_valid: torch.Tensor  # rows whose target is not ignore_index
    ce_denominator: torch.Tensor  # mean reduction's divisor of the CE part: sum of w_y, or n_valid
    weight_sum: torch.Tensor  # sum of ce_weight over the vocabulary (V without weights)
    poison: torch.Tensor  # 1, or NaN when an input is bad (the call's outputs become NaN)

    @property
    def accuracy_scale(self) -> torch.Tensor:
        """The mean's factor of the token accuracy: ``1 / n_valid`` (0 when every row is ignored)."""
        return _inverse_or_zero(self.n_valid)


def _inverse_or_zero(value: torch.Tensor) -> torch.Tensor:
    """1 / value, and 0 where value is 0 (an all-ignored batch divides nothing)."""
    return torch.where(value > 0, 1.0 / value.clamp(min=torch.finfo(torch.float32).tiny), 0.0)


def _describe(vocab: int, ignore_index: int, has_ce_weight: bool):
    def describe(counts: list[int]) -> str | None:
        bad_targets, bad_weights = counts[0], counts[1] if has_ce_weight else 0
        if bad_targets:
            return (
                f"target values must be in [0, {vocab}) or equal ignore_index={ignore_index}; "
                f"found {bad_targets} out of range"
            )
        if bad_weights:
            return "ce_weight must be finite and non-negative; it has negative, NaN or Inf entries"
        return None

    return describe


def batch_statistics(
    target: torch.Tensor, ce_weight: torch.Tensor | None, vocab: int, ignore_index: int
) -> BatchStatistics:
    """The call's statistics, computed on the device without a host sync. Out-of-range
    targets and negative or non-finite class weights poison the call (NaN loss and
    gradients) and raise ``ValueError`` as ``flce.driver.validation`` describes; with
    synchronous validation the error names the first offending values, before any kernel."""
    f32 = torch.float32
    valid = target != ignore_index
    out_of_range = valid & ((target < 0) | (target >= vocab))
    n_valid = valid.sum(dtype=f32)
    problems = [out_of_range.sum()]
    if ce_weight is None:
        ce_denominator = n_valid
        weight_sum = torch.full((), float(vocab), dtype=f32, device=target.device)
    else:
        w = ce_weight.float()
        safe_target = torch.where(valid & ~out_of_range, target, torch.zeros_like(target)).long()
        ce_denominator = torch.where(valid, w[safe_target], 0.0).sum()
        weight_sum = w.sum()
        problems.append(((w < 0) | ~torch.isfinite(w)).sum())
    counts = torch.stack(problems)  # (1 or 2,) int64
    describe = _describe(vocab, ignore_index, ce_weight is not None)
    if validation.validates_synchronously(target.device):
        message = describe(counts.tolist())  # the host read of synchronous validation
        if message is not None:
            if counts[0]:
                message += f" (e.g. {target[out_of_range][:3].tolist()})"
            raise ValueError(message)
    else:
        validation.defer(counts, describe)
    poison = torch.where(counts.sum() > 0, float("nan"), 1.0).to(f32)
    return BatchStatistics(n_valid, ce_denominator, weight_sum, poison)


def chunk_scalars(options: LossOptions, stats: BatchStatistics) -> ChunkScalars:
    """Kernel scalars; the mean reduction is folded into the gradient scales (on the
    device: the kernels read them from memory), and a bad input's NaN into both."""
    if options.reduction == "mean":
        ce_scale = _inverse_or_zero(stats.ce_denominator)
        z_scale = _inverse_or_zero(stats.n_valid)
    else:
        ce_scale = z_scale = torch.ones((), dtype=torch.float32, device=stats.n_valid.device)
    return ChunkScalars(
        ignore_index=options.ignore_index,
        label_smoothing=float(options.label_smoothing),
        lse_square_scale=float(options.lse_square_scale),
        softcap=None if options.softcap is None else float(options.softcap),
        use_token_scaling=options.use_token_scaling,
        scales=torch.stack([ce_scale * stats.poison, z_scale * stats.poison, stats.weight_sum]),
    )
