"""Row math of the cross-entropy head: the formulas every CE kernel answers to.

Per-row math (``z`` a row of logits, ``y`` its target, ``c`` the softcap, ``w`` the
class weights, ``W = sum(w)`` (``V`` without weights), ``ls`` the label smoothing,
``eps = ls / V``, ``s`` the z-loss scale)::

    z'    = c * tanh(z / c)            (z' = z without softcap)
    lse   = logsumexp(z'),  p = softmax(z')
    ce    = (1 - ls) * w_y * (lse - z'_y) + eps * (W * lse - sum_i w_i z'_i)
    zl    = s * lse**2
    st    = p_y  (detached)  if use_token_scaling else 1
    loss_out = st * ce,  z_loss_out = st * zl

    dce_i = ((1 - ls) * w_y + eps * W) * p_i - eps * w_i - (1 - ls) * w_y * [i == y]
    dzl_i = 2 * s * lse * p_i
    grad_i = st * row_grad_scale * (ce_grad_scale * dce_i + z_grad_scale * dzl_i) * dz'_i/dz_i
    dz'_i/dz_i = 1 - (z'_i / c)**2      (1 without softcap)

Numerics: evaluate the gradient in the grouped form

    grad_i = ce_grad_scale * ((1 - ls) * w_y * (p_i - [i == y]) + eps * (W * p_i - w_i))
           + z_grad_scale * 2 * s * lse * p_i

(then ``* st * row_grad_scale * dz'_i/dz_i``), with ``p_i = exp((z'_i - m) - log(sum))``
from the row max ``m``. Each group cancels exactly where the true value is ~0 (a
confident row, ``p_y ~ 1``; ``V = 1``), where the expanded coefficient form
``a * p_i - b_i - c * [i == y]`` leaves rounding residue larger than the true gradient.

Rows whose target equals ``ignore_index`` get loss 0, z-loss 0, correct 0,
predicted -1 and an all-zero gradient row, whatever their logits hold (NaN and Inf
included: the row is selected away, never multiplied by 0). ``ignore_index`` may be a
real class id.

The functions below are these formulas in PyTorch fp32 ops on ``(M, V)`` chunks or
``(M,)`` row statistics: the torch backend's kernel is built from them, and the
drivers use them to turn statistics merged across vocabulary blocks or ranks into
whole-row results.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChunkScalars:
    """Scalars that are the same for every chunk of one call: the options' (Python
    numbers, which kernels may bake in) and the batch's (``scales``, on the device, which
    kernels read from memory so that no host sync is needed to know them).

    ``scales`` is ``(3,)`` fp32: ``ce_grad_scale``, ``z_grad_scale`` and ``weight_sum``,
    from ``scales_source``: the tensor, or a function giving it on first use (a call's
    batch statistics are launched after its first GEMM, ``flce.driver.statistics``).
    The first two fold the reduction into the gradient: for ``reduction="mean"`` they are
    ``1 / sum(w_y)`` (``1 / n_valid`` without weights) and ``1 / n_valid``; for ``"sum"``
    and ``"none"`` both are 1. They are 0 when their divisor is 0 (every row ignored, or
    class weights summing to 0 over the valid targets), so nothing divides by zero, and
    NaN when an input is bad (``flce.driver.validation``). ``weight_sum`` is the sum of
    ``ce_weight`` over the vocabulary (``V`` without weights).
    """

    ignore_index: int
    label_smoothing: float
    lse_square_scale: float
    softcap: float | None
    use_token_scaling: bool
    scales_source: torch.Tensor | Callable[[], torch.Tensor]  # -> (3,) fp32 on the device
    # The softcap's tanh may be the hardware's approximation: the logits are the loss's own
    # 16-bit GEMM output on a GPU (flce.backends.base.softcap_tanh_is_approximate).
    approximate_tanh: bool = False

    @classmethod
    def from_numbers(
        cls,
        *,
        weight_sum: float,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        lse_square_scale: float = 0.0,
        softcap: float | None = None,
        use_token_scaling: bool = False,
        ce_grad_scale: float = 1.0,
        z_grad_scale: float = 1.0,
        device: torch.device | str = "cpu",
    ) -> ChunkScalars:
        """Scalars from host numbers (kernel tests and benchmarks; a call computes its
        ``scales`` on the device, ``flce.driver.statistics.chunk_scalars``). The defaults
        are a call with no option and reduction ``"sum"``: ``weight_sum`` (V without class
        weights) is the one number every call has its own of."""
        scales = torch.tensor([ce_grad_scale, z_grad_scale, weight_sum], dtype=torch.float32, device=device)
        return cls(ignore_index, label_smoothing, lse_square_scale, softcap, use_token_scaling, scales)

    @property
    def scales(self) -> torch.Tensor:
        """(3,) fp32 on the device: ce_grad_scale, z_grad_scale, weight_sum."""
        source = self.scales_source
        return source if isinstance(source, torch.Tensor) else source()

    @property
    def ce_grad_scale(self) -> torch.Tensor:
        return self.scales[0]

    @property
    def z_grad_scale(self) -> torch.Tensor:
        return self.scales[1]

    @property
    def weight_sum(self) -> torch.Tensor:
        return self.scales[2]

    def smoothing_eps(self, vocab: int) -> float:
        """``eps = label_smoothing / V`` over the whole vocabulary ``V``."""
        return self.label_smoothing / vocab


def apply_softcap(z: torch.Tensor, softcap: float | None, need_derivative: bool):
    """In place on fp32 ``z`` (M, V): ``z' = c * tanh(z / c)``; returns ``(z', dz'/dz or None)``.

    The derivative ``1 - tanh^2`` is computed as ``4u / (1 + u)^2`` with
    ``u = exp(-2|z/c|)``: no cancellation where tanh saturates, where ``1 - t*t`` from a
    rounded ``t`` loses digits."""
    if softcap is None:
        return z, None
    z.div_(softcap)
    derivative = None
    if need_derivative:
        u = torch.exp(z.abs().mul_(-2.0))
        derivative = u.mul(4.0).div_((1.0 + u).square_())
        del u
    return torch.tanh_(z).mul_(softcap), derivative


def fp32_working_copy(logits: torch.Tensor) -> torch.Tensor:
    """An fp32 copy of ``logits`` that never aliases them (an fp32 ``.float()`` would),
    so a gradient may later be written over the logits."""
    z = logits.float()
    return z.clone() if z.data_ptr() == logits.data_ptr() else z


def gather_safe_target(target: torch.Tensor, valid: torch.Tensor, vocab: int) -> torch.Tensor:
    """``target`` as int64 with ignored rows, and out-of-range targets (whose call the batch
    statistics poison with NaN), mapped to class 0, so gathers stay in bounds."""
    in_range = valid & (target >= 0) & (target < vocab)
    return torch.where(in_range, target, torch.zeros_like(target)).long()


def loss_rows(
    log_s: torch.Tensor,  # (M,) log of the sum of exp(z' - m)
    shifted_target: torch.Tensor,  # (M,) z'_y - m
    shifted_smooth_sum: torch.Tensor | None,  # (M,) sum_i w_i (z'_i - m), with label smoothing
    lse: torch.Tensor,  # (M,) m + log_s
    w_y: torch.Tensor | None,  # (M,) class weight of the target; None without weights (all 1)
    scalars: ChunkScalars,
    eps: float,  # label_smoothing / V (the whole vocabulary)
    need_z: bool = True,  # whether the z-loss rows are wanted (None is returned otherwise)
):
    """-> (ce, zl, token_scale or None) per row, in terms of the shifted logits ``z' - m``
    (differences to the row max keep the precision that ``m + log s`` would round away).
    The formulas hold for any reference point ``m`` of a row as long as ``log_s = lse - m``.
    Factors of exactly 1 (no smoothing, no class weights) are not applied: the values are
    the same, and each product is an op (a kernel, and host time) per call."""
    ls = scalars.label_smoothing
    ce = log_s - shifted_target
    if w_y is not None:
        ce = ((1.0 - ls) * w_y if ls else w_y) * ce  # the product's association as ever: ((1 - ls) w_y) ce
    elif ls:
        ce = (1.0 - ls) * ce
    if shifted_smooth_sum is not None:
        # sum_i w_i (lse - z'_i) = W * log(s) - sum_i w_i (z'_i - m)
        ce = ce + eps * (scalars.weight_sum * log_s - shifted_smooth_sum)
    zl = scalars.lse_square_scale * lse * lse if need_z else None
    token_scale = torch.exp(shifted_target - log_s) if scalars.use_token_scaling else None  # p_y, detached
    if token_scale is not None:
        ce = ce * token_scale
        zl = None if zl is None else zl * token_scale
    return ce, zl, token_scale


def gradient_coefficients(
    w_y: torch.Tensor,  # (C,) fp32 class weight of the target
    lse: torch.Tensor,  # (C,) fp32
    row_scale: torch.Tensor,  # (C,) fp32 flce.rows.cross_entropy.row_scale
    scalars: ChunkScalars,
    eps: float,  # label_smoothing / V
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The grouped gradient's per-row coefficients (``flce.rows.cross_entropy``), folded
    once so that a kernel does one FMA chain per element: ``coef_y`` (the one-hot term),
    ``coef_eps`` (label smoothing; None without) and ``coef_z`` (the z-loss; None without)."""
    ce_scale = scalars.ce_grad_scale
    onehot_coef = row_scale * (ce_scale * (1.0 - scalars.label_smoothing)) * w_y
    smooth_coef = row_scale * (ce_scale * eps) if eps > 0 else None
    s = scalars.lse_square_scale
    z_coef = row_scale * (scalars.z_grad_scale * 2.0 * s) * lse if s > 0 else None
    return onehot_coef, smooth_coef, z_coef


def row_scale(
    valid: torch.Tensor,  # (M,) bool
    token_scale: torch.Tensor | None,  # (M,) fp32 p_y with use_token_scaling
    row_grad_scale: torch.Tensor | None,  # (M,) fp32 per-row upstream gradient
) -> torch.Tensor:
    """The per-row factor of the gradient: ``st * row_grad_scale`` on valid rows, 0 on
    ignored ones (a select, so a non-finite factor of an ignored row never leaks)."""
    scale = torch.ones_like(valid, dtype=torch.float32)
    if token_scale is not None:
        scale = scale * token_scale
    if row_grad_scale is not None:
        scale = scale * row_grad_scale.float()
    return torch.where(valid, scale, torch.zeros((), dtype=torch.float32, device=scale.device))


def gradient_from_softmax(
    p: torch.Tensor,  # (M, V) softmax (over the whole vocabulary); consumed
    onehot_index: torch.Tensor,  # (M,) column of the target, any value where onehot_mask is 0
    onehot_mask: torch.Tensor,  # (M,) fp32: 1 where the target column is in p, else 0
    w_y: torch.Tensor,  # (M,)
    lse: torch.Tensor,  # (M,)
    ce_weight: torch.Tensor | None,  # (V,) class weights of p's columns
    scalars: ChunkScalars,
    eps: float,
    softcap_derivative: torch.Tensor | None,  # (M, V)
    scale: torch.Tensor,  # (M,) row_scale(): token scale x upstream gradient, 0 on ignored rows
) -> torch.Tensor:
    """dL/dz in the grouped form above: each group cancels exactly where the true
    gradient is ~0 (p_y ~ 1, V = 1), which an expanded form would not. Rows whose
    ``scale`` is 0 come out exactly 0, even where ``p`` is NaN (an ignored row's
    non-finite logits)."""
    grad = p.clone()
    grad.scatter_add_(1, onehot_index[:, None], -onehot_mask[:, None])  # p_i - [i == y]
    grad.mul_((scalars.ce_grad_scale * (1.0 - scalars.label_smoothing) * w_y)[:, None])
    if scalars.lse_square_scale > 0:
        grad.addcmul_(p, (scalars.z_grad_scale * 2.0 * scalars.lse_square_scale * lse)[:, None])
    if eps > 0:
        # + eps * (W p_i - w_i), the group formed before scaling (p is not needed after).
        p.mul_(scalars.weight_sum).sub_(ce_weight[None, :] if ce_weight is not None else 1.0)
        grad.add_(p.mul_(scalars.ce_grad_scale * eps))
    if softcap_derivative is not None:
        grad.mul_(softcap_derivative)
    grad.mul_(scale[:, None])
    return grad.masked_fill_((scale == 0)[:, None], 0.0)


# ----------------------------------------------------------------- row outputs


@dataclass
class RowOutputs:
    """Per-row results of one call, before reduction."""

    loss: torch.Tensor  # (N,) fp32, CE part
    z_loss: torch.Tensor | None  # (N,) fp32
    correct: torch.Tensor | None  # (N,) fp32
    predicted: torch.Tensor | None  # (N,) int64

    @staticmethod
    def allocate(n_rows: int, device: torch.device, *, z_loss: bool, correct: bool, predicted: bool) -> RowOutputs:
        def rows(dtype):
            return torch.empty(n_rows, dtype=dtype, device=device)

        return RowOutputs(
            loss=rows(torch.float32),
            z_loss=rows(torch.float32) if z_loss else None,
            correct=rows(torch.float32) if correct else None,
            predicted=rows(torch.int64) if predicted else None,
        )

    @property
    def needs_argmax(self) -> bool:
        return self.correct is not None or self.predicted is not None

    def store(
        self,
        valid: torch.Tensor,  # (N,) bool: target != ignore_index
        target: torch.Tensor,  # (N,)
        ce: torch.Tensor,  # (N,) fp32 st * ce
        z_loss: torch.Tensor,  # (N,) fp32 st * zl
        argmax: torch.Tensor | None,  # (N,) int64 argmax of z' (first index); None if unused
    ) -> None:
        """Writes whole-row results with the contract's values on ignored rows: loss,
        z-loss and correct 0, predicted -1."""
        store_rows(valid, target, ce, z_loss, argmax, self.loss, self.z_loss, self.correct, self.predicted)

    def chunk_kwargs(self, start: int, end: int) -> dict:
        """The ``*_out`` keyword arguments of a chunk kernel for rows ``[start, end)`` (the
        outputs themselves when that is every row: no view ops for a call of one chunk)."""
        whole = start == 0 and end == self.loss.shape[0]

        def part(t):
            return t if t is None or whole else t[start:end]

        return dict(
            loss_out=part(self.loss),
            z_loss_out=part(self.z_loss),
            correct_out=part(self.correct),
            predicted_out=part(self.predicted),
        )


def store_rows(
    valid: torch.Tensor,  # (M,) bool
    target: torch.Tensor,  # (M,)
    ce: torch.Tensor,  # (M,) fp32
    zl: torch.Tensor,  # (M,) fp32
    argmax: torch.Tensor | None,  # (M,) int64
    loss_out: torch.Tensor,  # (M,) fp32
    z_loss_out: torch.Tensor | None,
    correct_out: torch.Tensor | None,
    predicted_out: torch.Tensor | None,
) -> None:
    """The ``*_out`` rows of a chunk kernel, with the ignored-row values of the contract
    (Python scalars in the selects: no op to make a constant tensor)."""
    loss_out.copy_(torch.where(valid, ce, 0.0))
    if z_loss_out is not None:
        z_loss_out.copy_(torch.where(valid, zl, 0.0))
    if correct_out is not None:
        correct_out.copy_(((argmax == target) & valid).float())
    if predicted_out is not None:
        predicted_out.copy_(torch.where(valid, argmax, -1))


@dataclass
class Reduced:
    """The reduced outputs of a call, in the order of the autograd outputs."""

    loss: torch.Tensor
    z_loss: torch.Tensor | None
    token_accuracy: torch.Tensor | None
    predicted_tokens: torch.Tensor | None

    def as_tuple(self) -> tuple:
        return self.loss, self.z_loss, self.token_accuracy, self.predicted_tokens

    def non_differentiable(self) -> list[torch.Tensor]:
        """The outputs without a gradient (only the loss has one)."""
        return [t for t in (self.z_loss, self.token_accuracy, self.predicted_tokens) if t is not None]


def reduce_rows(
    rows: RowOutputs,
    reduction: str,
    add_z_loss: bool,  # lse_square_scale > 0: the z-loss enters the loss
    return_z_loss: bool,
    scalars: ChunkScalars,
    accuracy_scale: torch.Tensor | None,  # () 1 / n_valid for mean/sum (0 when every row is ignored); with correct rows
) -> Reduced:
    """Applies the reduction; the mean uses the same scales as the gradient."""
    z_rows = rows.z_loss
    adds_z = add_z_loss and z_rows is not None
    if reduction == "none":
        # The scales are 1 here, or NaN for a call with bad inputs: the product poisons the rows.
        loss = rows.loss * scalars.ce_grad_scale
        if adds_z:
            loss = loss + z_rows * scalars.z_grad_scale
        z_loss = z_rows * scalars.z_grad_scale if return_z_loss else None
        return Reduced(loss, z_loss, rows.correct, rows.predicted)
    ce_total = rows.loss.sum()
    z_total = z_rows.sum() if z_rows is not None else None
    loss = ce_total * scalars.ce_grad_scale
    if adds_z:
        loss = loss + z_total * scalars.z_grad_scale
    z_loss = z_total * scalars.z_grad_scale if return_z_loss else None
    accuracy = None if rows.correct is None else rows.correct.sum() * accuracy_scale
    return Reduced(loss, z_loss, accuracy, rows.predicted)


# ------------------------------------------------------ whole-row statistics


def rows_from_statistics(
    rows: RowOutputs,
    target: torch.Tensor,  # (N,)
    valid: torch.Tensor,  # (N,) bool
    row_max: torch.Tensor,  # (N,) fp32 any reference point m of each row (its max, or its lse)
    log_s: torch.Tensor | None,  # (N,) log sum_i exp(z'_i - m); None: 0 (m is the lse)
    shifted_target: torch.Tensor,  # (N,) z'_y - m (any value on ignored rows)
    shifted_smooth_sum: torch.Tensor | None,  # (N,) sum_i w_i (z'_i - m), with label smoothing
    argmax: torch.Tensor | None,  # (N,) int64 first argmax of z'
    ce_weight: torch.Tensor | None,  # (V,) fp32
    scalars: ChunkScalars,
    vocab: int,
) -> torch.Tensor | None:
    """Stores the per-row outputs computed from whole-row statistics (merged over
    vocabulary blocks or ranks, or reduced by a fused GEMM epilogue); returns the token
    scale (``p_y``, with ``use_token_scaling``) that the gradient needs."""
    lse = row_max if log_s is None else row_max + log_s
    log_s = torch.zeros_like(lse) if log_s is None else log_s
    w_y = ce_weight[gather_safe_target(target, valid, vocab)] if ce_weight is not None else None
    ce, zl, token_scale = loss_rows(
        log_s,
        shifted_target,
        shifted_smooth_sum,
        lse,
        w_y,
        scalars,
        scalars.smoothing_eps(vocab),
        need_z=rows.z_loss is not None,
    )
    rows.store(valid, target, ce, zl, argmax)
    return token_scale


def finite_reference(row_max: torch.Tensor) -> torch.Tensor:
    """``row_max`` with -inf (a row whose columns are all -inf, a masked part of the
    vocabulary) replaced by 0: the point to shift by, where -inf - -inf would be NaN. One
    op (a hot path); NaN and +inf stay as they are."""
    return torch.nan_to_num(row_max, nan=math.nan, posinf=math.inf, neginf=0.0)


@dataclass
class BlockStatistics:
    """Per-row statistics of one column block of the logits, relative to the block's max of z'
    (to 0, ``finite_reference``, on a row whose block is all -inf, a masked
    part of the vocabulary: its sum is then 0 and its shifted values -inf, which vanish when
    ``rebased`` to a finite max instead of turning the row into NaN)."""

    row_max: torch.Tensor  # (C,) max of z' over the block
    row_sum: torch.Tensor  # (C,) sum of exp(z' - row_max)
    target_shifted: torch.Tensor  # (C,) z'_y - row_max where the block holds y (else anything)
    smooth_shifted: torch.Tensor | None  # (C,) sum_i w_i (z'_i - row_max), with label smoothing
    argmax: torch.Tensor | None  # (C,) first argmax within the block (a global column once combined)

    def rebased(
        self,
        new_max: torch.Tensor,  # (C,) a reference point >= row_max (the running or global max)
        owned: torch.Tensor,  # (C,) bool: the block holds the row's target
        block_weight_sum: torch.Tensor | float,  # sum of the block's class weights (its width without);
        # (B, 1) for (B, C) per-block statistics
    ) -> list[torch.Tensor]:
        """The block's additive parts relative to ``new_max``: ``[sum_i exp(z'_i - new_max),
        z'_y - new_max where owned else 0, (sum_i w_i (z'_i - new_max))]``. Summing them over
        the blocks of a row (in sequence, or by an all-reduce across ranks) gives the whole
        row's statistics relative to ``new_max``; differences to a row max keep the precision
        that ``max + log(sum)`` would round away."""
        shift = self.row_max - new_max  # (C,) <= 0
        zero = torch.zeros((), dtype=torch.float32, device=shift.device)
        parts = [self.row_sum * torch.exp(shift), torch.where(owned, self.target_shifted + shift, zero)]
        if self.smooth_shifted is not None:
            parts.append(self.smooth_shifted + shift * block_weight_sum)
        return parts


def combine_blocks(
    per_block: BlockStatistics,  # (B, N) statistics of B column blocks, argmax as global columns
    owned_by: torch.Tensor,  # (B, N) bool: block b holds row n's target
    block_weight_sums: torch.Tensor,  # (B,) sum of each block's class weights (its width without)
) -> BlockStatistics:
    """The whole rows' statistics from their blocks', relative to the rows' max: the
    blocks' parts rebased to the global max and summed (what the vocab-parallel loss
    does with one MAX and one SUM all-reduce across ranks). The argmax is the first
    block's achieving the global max, so the first index wins ties, and a NaN wins over
    any number, as in ``torch.argmax`` (a block holding a NaN has a NaN max, which
    ``amax`` propagates and ``==`` never matches)."""
    row_max = per_block.row_max.amax(dim=0)  # (N,)
    parts = per_block.rebased(row_max, owned_by, block_weight_sums[:, None])
    argmax = None
    if per_block.argmax is not None:
        at_max = (per_block.row_max == row_max) | per_block.row_max.isnan()
        first = at_max.to(torch.int8).argmax(dim=0)  # first block at the max (or with a NaN)
        argmax = per_block.argmax.gather(0, first[None]).squeeze(0)
    return BlockStatistics(
        row_max=row_max,
        row_sum=parts[0].sum(dim=0),
        target_shifted=parts[1].sum(dim=0),
        smooth_shifted=parts[2].sum(dim=0) if len(parts) > 2 else None,
        argmax=argmax,
    )
