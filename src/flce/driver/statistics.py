"""Batch statistics of one call, on the device: the count of valid rows and the
class-weight sums that set the mean's scale, the input checks that need the data
(``flce.driver.validation``), and the kernel scalars derived from them. Nothing here
reads a value on the host unless validation is synchronous."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache, partial

import torch

from flce.backends.base import STATISTICS_LAYOUT
from flce.dispatch import device_helper
from flce.driver import validation
from flce.options import LossOptions, bad_class_weights_message
from flce.rows.cross_entropy import ChunkScalars

_SLOT = {name: index for index, name in enumerate(STATISTICS_LAYOUT)}
_COUNTS = slice(_SLOT["bad_targets"], _SLOT["bad_weights"] + 1)


class BatchStatistics:
    """Per-call statistics: views of one fp32 buffer on the call's device (``STATISTICS_LAYOUT``).

    With asynchronous validation they are computed on first use (``compute``): the drivers
    first need them for the first CE kernel, after the first logits GEMM is launched, so
    the GPU starts on the GEMM while the host launches the statistics and copies their
    counts for the checks. ``CrossEntropyPlan.reduce`` makes sure every call computes them."""

    __slots__ = ("_values", "_compute", "_scales")

    def __init__(self, values: torch.Tensor | None = None, compute: Callable[[], torch.Tensor] | None = None) -> None:
        if (values is None) == (compute is None):
            raise ValueError("BatchStatistics takes the values or a function computing them")
        self._values = values
        self._compute = compute
        self._scales: dict[str, torch.Tensor] = {}

    @property
    def values(self) -> torch.Tensor:
        """(13,) fp32, computed here on first use."""
        if self._values is None:
            self._values = self._compute()
            self._compute = None
        return self._values

    def ensure_computed(self) -> None:
        """Computes them now if nothing has asked yet: every call's checks run."""
        if self._values is None:
            self.values  # noqa: B018 (the property computes them)

    @property
    def counts(self) -> torch.Tensor:
        """(2,) fp32: out-of-range targets, bad class weights."""
        return self.values[_COUNTS]

    def __getattr__(self, name: str) -> torch.Tensor:
        if name in _SLOT:
            return self.values[_SLOT[name]]
        raise AttributeError(name)

    def scales(self, reduction: str) -> torch.Tensor:
        """(3,) ``ChunkScalars.scales`` for ``reduction``: a view (made once), no new kernel."""
        view = self._scales.get(reduction)
        if view is None:
            start = _SLOT["mean_ce_scale"] if reduction == "mean" else _SLOT["sum_ce_scale"]
            view = self._scales[reduction] = self.values[start : start + 3]
        return view


@dataclass(frozen=True)
class _Reductions:
    """The reductions over the batch both ways of deriving the statistics share (0-dim
    tensors; ``ce_denominator`` and ``weight_sum`` None without class weights)."""

    n_valid: torch.Tensor  # fp32
    bad_targets: torch.Tensor  # int64: valid rows whose target is outside [0, V)
    ce_denominator: torch.Tensor | None  # fp32: sum of w_y over the valid in-range rows
    weight_sum: torch.Tensor | None  # fp32: sum of ce_weight
    bad_weights: torch.Tensor | None  # int64: negative or non-finite class weights

    @staticmethod
    def of(target: torch.Tensor, ce_weight: torch.Tensor | None, vocab: int, ignore_index: int) -> _Reductions:
        valid = target != ignore_index
        out_of_range = valid & ((target < 0) | (target >= vocab))
        n_valid, bad_targets = valid.sum(dtype=torch.float32), out_of_range.sum()
        if ce_weight is None:
            return _Reductions(n_valid, bad_targets, None, None, None)
        w = ce_weight.float()
        in_range = valid & ~out_of_range
        safe_target = torch.where(in_range, target, torch.zeros_like(target)).long()
        ce_denominator = torch.where(in_range, w[safe_target], 0.0).sum()
        return _Reductions(n_valid, bad_targets, ce_denominator, w.sum(), ((w < 0) | ~torch.isfinite(w)).sum())


def _statistics_buffer(
    target: torch.Tensor, ce_weight: torch.Tensor | None, vocab: int, ignore_index: int
) -> torch.Tensor:
    """``STATISTICS_LAYOUT`` with PyTorch ops (where no backend registers the one-launch kernel)."""
    f32 = torch.float32
    r = _Reductions.of(target, ce_weight, vocab, ignore_index)
    n_valid = r.n_valid
    if ce_weight is None:
        ce_denominator = n_valid
        weight_sum = torch.full((), float(vocab), dtype=f32, device=target.device)
        counts = torch.stack([r.bad_targets, torch.zeros((), dtype=torch.int64, device=target.device)])
    else:
        ce_denominator, weight_sum = r.ce_denominator, r.weight_sum
        counts = torch.stack([r.bad_targets, r.bad_weights])
    poison = torch.where(counts.sum() > 0, float("nan"), 1.0).to(f32)
    inv_valid, inv_denominator = _inverse_or_zero(n_valid), _inverse_or_zero(ce_denominator)
    scalars = torch.stack(
        [
            n_valid,
            ce_denominator,
            weight_sum,
            poison,
            inv_valid,
            inv_denominator * poison,
            inv_valid * poison,
            weight_sum,
            poison,
            poison,
            weight_sum,
        ]
    )
    return torch.cat([scalars, counts.to(f32)])


def _inverse_or_zero(value: torch.Tensor) -> torch.Tensor:
    """1 / value, and 0 where value is 0 (an all-ignored batch divides nothing)."""
    return torch.where(value > 0, 1.0 / value.clamp(min=_FP32_TINY), 0.0)


_FP32_TINY = torch.finfo(torch.float32).tiny


def _host_inverse_or_zero(value: float) -> float:
    """``_inverse_or_zero`` of an fp32 value, in Python: the quotient is rounded to double,
    then to fp32 when stored, which gives fp32's own correctly rounded quotient (double
    rounding is innocuous for a division when 53 >= 2 * 24 + 2)."""
    return 1.0 / max(value, _FP32_TINY) if value > 0 else 0.0


def _host_statistics(
    target: torch.Tensor, ce_weight: torch.Tensor | None, vocab: int, ignore_index: int
) -> tuple[torch.Tensor, list[float]]:
    """``_statistics_buffer``'s values bit for bit, and as Python floats, where reading a
    value costs no device sync (the CPU, whose checks read the counts anyway): the
    reductions are the same (``_Reductions``), the dozen scalars derived from them are
    computed in Python and stored with one op instead of a score of tiny ones."""
    r = _Reductions.of(target, ce_weight, vocab, ignore_index)
    n_valid, bad_targets = r.n_valid.item(), int(r.bad_targets)
    if ce_weight is None:
        ce_denominator, weight_sum, bad_weights = n_valid, float(vocab), 0
    else:
        ce_denominator, weight_sum, bad_weights = r.ce_denominator.item(), r.weight_sum.item(), int(r.bad_weights)
    poison = math.nan if bad_targets + bad_weights > 0 else 1.0
    inv_valid, inv_denominator = _host_inverse_or_zero(n_valid), _host_inverse_or_zero(ce_denominator)
    # The products are exact (by 1) or NaN, as in fp32.
    values = [n_valid, ce_denominator, weight_sum, poison, inv_valid]
    values += [inv_denominator * poison, inv_valid * poison, weight_sum, poison, poison, weight_sum]
    values += [float(bad_targets), float(bad_weights)]  # exact here, beyond 2**24 too
    return torch.tensor(values, dtype=torch.float32, device=target.device), values


@lru_cache(maxsize=64)  # a few (vocab, ignore_index, name) triples per process: one closure each
def _describe(vocab: int, ignore_index: int, class_weight_name: str):
    def describe(values: list[float]) -> str | None:
        """The statistics' values (``STATISTICS_LAYOUT``) -> the error message, or None."""
        bad_targets, bad_weights = int(values[_SLOT["bad_targets"]]), values[_SLOT["bad_weights"]]
        if bad_targets:
            return (
                f"target values must be in [0, {vocab}) or equal ignore_index={ignore_index}; "
                f"found {bad_targets} out of range"
            )
        if bad_weights:
            return bad_class_weights_message(class_weight_name)
        return None

    return describe


def batch_statistics(
    target: torch.Tensor,
    ce_weight: torch.Tensor | None,
    vocab: int,
    ignore_index: int,
    class_weight_name: str = "ce_weight",  # the caller's argument, named by the error of bad weights
) -> BatchStatistics:
    """The call's statistics, computed on the device without a host sync (one launch where
    a backend registers the ``batch_statistics`` kernel for the device). Out-of-range
    targets and negative or non-finite class weights poison the call (NaN loss and
    gradients) and raise ``ValueError`` as ``flce.driver.validation`` describes; with
    synchronous validation the error names the first offending values, before any kernel.
    With asynchronous validation (the default on CUDA) they are launched on first use
    (``BatchStatistics``), after the call's first GEMM."""
    synchronous = validation.validates_synchronously(target.device)
    if not synchronous:
        return BatchStatistics(
            compute=partial(_deferred_statistics, target, ce_weight, vocab, ignore_index, class_weight_name)
        )
    host_values = None
    if target.device.type == "cpu":
        # Reading on the host is free here (and Triton runs on CPU only as its interpreter).
        values, host_values = _host_statistics(target, ce_weight, vocab, ignore_index)
    else:
        values = _device_statistics(target, ce_weight, vocab, ignore_index)
    # The host read of synchronous validation (done already on the CPU).
    host_values = values.tolist() if host_values is None else host_values
    message = _describe(vocab, ignore_index, class_weight_name)(host_values)
    if message is not None:
        if host_values[_SLOT["bad_targets"]]:
            valid = target != ignore_index
            out_of_range = valid & ((target < 0) | (target >= vocab))
            message += f" (e.g. {target[out_of_range][:3].tolist()})"
        raise ValueError(message)
    return BatchStatistics(values)


def _deferred_statistics(
    target: torch.Tensor, ce_weight: torch.Tensor | None, vocab: int, ignore_index: int, class_weight_name: str
) -> torch.Tensor:
    """The statistics of asynchronous validation, on the device, and their checks' counts
    on their way to the host (``flce.driver.validation.defer``)."""
    values = _device_statistics(target, ce_weight, vocab, ignore_index)
    validation.defer(values, _describe(vocab, ignore_index, class_weight_name))
    return values


def _device_statistics(
    target: torch.Tensor, ce_weight: torch.Tensor | None, vocab: int, ignore_index: int
) -> torch.Tensor:
    """``STATISTICS_LAYOUT`` on the target's device: one launch where a backend registers
    the kernel for it (``device_helper``), else PyTorch ops."""
    kernel = device_helper("batch_statistics", target.device)
    return (kernel or _statistics_buffer)(target, ce_weight, vocab, ignore_index)


def chunk_scalars(options: LossOptions, stats: BatchStatistics, *, approximate_tanh: bool = False) -> ChunkScalars:
    """Kernel scalars; the mean reduction is folded into the gradient scales (on the
    device: the kernels read them from memory), and a bad input's NaN into both.
    ``approximate_tanh``: the logits are the loss's own 16-bit GEMM output on a GPU, where
    ``flce.backends.base.softcap_tanh_is_approximate`` allows the approximate tanh."""
    return ChunkScalars(
        ignore_index=options.ignore_index,
        label_smoothing=float(options.label_smoothing),
        lse_square_scale=float(options.lse_square_scale),
        softcap=None if options.softcap is None else float(options.softcap),
        use_token_scaling=options.use_token_scaling,
        scales_source=partial(stats.scales, options.reduction),
        approximate_tanh=approximate_tanh and options.softcap is not None,
    )
