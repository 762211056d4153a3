"""Row math of the logprobs head: per row, the log-probability of the target class and
the entropy of the distribution, and their gradient under any upstream gradients (a
GRPO/PPO loss uses ``exp(logprob - old_logprob)`` and an entropy bonus).

Per row, in fp32 whatever the logits dtype (``z = logits / temperature``, ``y`` the
target, ``m = max_i z_i``, ``d_i = m - z_i >= 0``, ``e_i = exp(-d_i)``)::

    s       = sum_i e_i                          lse = m + log s
    u       = sum_i e_i d_i          (>= 0)      p_i = e_i / s
    logprob = z_y - lse              = -(d_y + log s)
    entropy = lse - sum_i p_i z_i    = log s + u / s

    dL/dz_i    = g_lp ([i == y] - p_i) - g_H p_i (log p_i + H),   log p_i = z_i - lse
    dL/dlogits = dL/dz / temperature

with ``g_lp``, ``g_H`` the upstream gradients of the row's logprob and entropy. Rows
whose target equals ``ignore_index`` (which may be a real class id) get logprob 0,
entropy 0, lse 0 and an all-zero gradient row.

Numerics:
- ``logprob = -(d_y + log s)`` and ``entropy = log s + u / s`` add terms that are all
  >= 0: nothing cancels. ``lse - sum_i p_i z_i`` would subtract two numbers of the size
  of the logits to get an entropy that is ~0 on a confident row.
- The gradient keeps ``[i == y] - p_i`` as one group, which is exactly 0 where the true
  value is (``V = 1``) and cancels to the rounding of ``p_y`` where ``p_y ~ 1``.
- The backward pass gets ``lse`` from the forward pass instead of re-reading the row for
  its max and sum (one read of the row, as FlashAttention does). ``p_i = exp(z_i - lse)``
  then carries the rounding of ``lse``, the same relative error for every ``i`` of a row:
  half an ulp of ``lse``, up to ~2e-6 in fp32 for logits of ~50, and where ``p_y ~ 1`` all
  of it lands on ``1 - p_y``. So lse may be float64 (8 bytes a row): the kernels split it
  into ``hi = fp32(lse)`` and ``lo = fp32(lse - hi)`` and take ``log p_i = (z_i - hi) - lo``.
  ``z_i - hi`` is exact where ``z_i`` is within a factor 2 of ``hi`` (Sterbenz), as the
  columns with large ``p_i`` are once ``|lse|`` is large, and is otherwise rounded at the
  size of ``log p_i``: eager PyTorch's log-softmax precision. A float32 lse is accepted
  too (``lo = 0``); its error is invisible where the gradient is stored in bf16/fp16
  (whose rounding, 2^-9 or 2^-12, is far larger).
- Column blocks of one row (an online softmax over tiles; vocabulary shards) combine
  exactly, ``k`` over the blocks and ``m = max_k m_k``::

      s = sum_k s_k exp(m_k - m)
      u = sum_k exp(m_k - m) (u_k + (m - m_k) s_k)        (d_i = (m_k - z_i) + (m - m_k))

Kernel contract (every backend's ``logprobs_forward_chunk`` / ``logprobs_backward_chunk``
implements ``LogprobsForwardKernel`` / ``LogprobsBackwardKernel``; row vectors may have
any stride).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from flce.rows.cross_entropy import finite_reference


class LogprobsForwardKernel(Protocol):
    """Per row: logprob, entropy (when ``entropy_out`` is given) and lse.

    logits        (M, V) fp16/bf16/fp32, unit stride along V; only read.
    target        (M,) int32/int64; values in [0, V) or ``ignore_index``.
    logprob_out   (M,) fp32, written.
    entropy_out   (M,) fp32 or None.
    lse_out       (M,) float64 (or float32: see the numerics above), written (0 on
                  ignored rows): what the backward pass needs.
    predicted_out (M,) int64 or None: the first index of the max of z, -1 on ignored rows
                  (as the cross-entropy's predicted tokens; z, not the raw logits: what
                  a positive temperature leaves tied, it ties).
    """

    def __call__(
        self,
        logits: torch.Tensor,
        target: torch.Tensor,
        *,
        inv_temperature: float,
        ignore_index: int,
        logprob_out: torch.Tensor,
        entropy_out: torch.Tensor | None,
        lse_out: torch.Tensor,
        predicted_out: torch.Tensor | None = None,
    ) -> None: ...


class LogprobsBackwardKernel(Protocol):
    """dL/dlogits of ``sum_rows(g_lp * logprob + g_H * entropy)``, in the logits dtype.

    logits         (M, V) fp16/bf16/fp32, unit stride along V; overwritten with the
                   gradient unless ``grad_out`` is given (then only read).
    target         (M,) int32/int64.
    lse            (M,) float64 or float32, from the forward pass.
    entropy        (M,) fp32 from the forward pass; needed when ``grad_entropy`` is given.
    grad_logprob   (M,) fp32 or None (None: no gradient flows into the logprobs).
    grad_entropy   (M,) fp32 or None.
    grad_out       (M, V) logits dtype, unit stride along V, or None.
    """

    def __call__(
        self,
        logits: torch.Tensor,
        target: torch.Tensor,
        lse: torch.Tensor,
        entropy: torch.Tensor | None,
        grad_logprob: torch.Tensor | None,
        grad_entropy: torch.Tensor | None,
        *,
        inv_temperature: float,
        ignore_index: int,
        grad_out: torch.Tensor | None = None,
    ) -> None: ...


def check_logits(logits: torch.Tensor, name: str = "logits") -> None:
    if logits.dim() != 2:
        raise ValueError(f"{name} must be 2-D (M, V), got shape {tuple(logits.shape)}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {logits.dtype}")
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        raise ValueError(f"{name} must have unit stride along the vocabulary, got strides {tuple(logits.stride())}")


INDEX_DTYPES = (torch.int32, torch.int64)
LSE_DTYPES = (torch.float64, torch.float32)


def check_row_vector(vector: torch.Tensor | None, name: str, logits: torch.Tensor, dtypes: tuple) -> None:
    """``vector`` (when given) is (M,) on the logits' device, of one of ``dtypes``."""
    if vector is None:
        return
    num_rows = logits.shape[0]
    if vector.shape != (num_rows,):
        raise ValueError(f"{name} must have shape ({num_rows},), got {tuple(vector.shape)}")
    if vector.device != logits.device:
        raise ValueError(f"{name} must be on {logits.device}, got {vector.device}")
    if vector.dtype not in dtypes:
        expected = " or ".join(str(dtype).removeprefix("torch.") for dtype in dtypes)
        raise ValueError(f"{name} must be {expected}, got {vector.dtype}")


def check_inv_temperature(inv_temperature: float) -> None:
    if not (math.isfinite(inv_temperature) and inv_temperature > 0):
        raise ValueError(f"inv_temperature must be finite and > 0, got {inv_temperature}")


def check_forward_arguments(
    logits, target, inv_temperature, logprob_out, entropy_out, lse_out, predicted_out=None
) -> None:
    check_logits(logits)
    check_row_vector(target, "target", logits, INDEX_DTYPES)
    check_inv_temperature(inv_temperature)
    check_row_vector(logprob_out, "logprob_out", logits, (torch.float32,))
    check_row_vector(entropy_out, "entropy_out", logits, (torch.float32,))
    check_row_vector(lse_out, "lse_out", logits, LSE_DTYPES)
    check_row_vector(predicted_out, "predicted_out", logits, (torch.int64,))


def check_backward_arguments(logits, target, lse, entropy, grad_logprob, grad_entropy, inv_temperature) -> None:
    check_logits(logits)
    check_row_vector(target, "target", logits, INDEX_DTYPES)
    check_inv_temperature(inv_temperature)
    check_row_vector(lse, "lse", logits, LSE_DTYPES)
    check_row_vector(entropy, "entropy", logits, (torch.float32,))
    check_row_vector(grad_logprob, "grad_logprob", logits, (torch.float32,))
    check_row_vector(grad_entropy, "grad_entropy", logits, (torch.float32,))
    if grad_entropy is not None and entropy is None:
        raise ValueError("entropy (the forward pass's entropy_out) is needed when grad_entropy is given, got None")


@dataclass(frozen=True)
class SoftmaxStatistics:
    """Per-row statistics of a block of columns of ``z`` (the whole row, a tile, a shard)."""

    row_max: torch.Tensor  # (M,) m = max_i z_i over the block
    row_sum: torch.Tensor  # (M,) s = sum_i exp(z_i - m)
    spread: torch.Tensor | None  # (M,) u = sum_i exp(z_i - m) (m - z_i) >= 0; None when not asked for


def block_statistics(z: torch.Tensor, with_spread: bool) -> SoftmaxStatistics:
    """Statistics of ``z`` (M, V_b) fp32 (at least one column); ``z`` is consumed."""
    row_max = z.amax(dim=-1)  # (M,)
    # Relative to 0 on a row whose block is all -inf (a masked part of the vocabulary):
    # -inf - -inf would be NaN; its sum is then 0 and it vanishes when merged.
    reference = finite_reference(row_max)
    d = z.neg_().add_(reference[:, None])  # (M, V_b) d_i = m - z_i >= 0, in z's storage
    e = torch.neg(d).exp_()  # (M, V_b) e_i in [0, 1]; 0 for a -inf logit
    row_sum = e.sum(dim=-1)
    # e_i d_i with 0 where e_i is 0: a -inf logit contributes 0, not 0 * inf = NaN
    spread = torch.where(e > 0, e * d, 0.0).sum(dim=-1) if with_spread else None
    return SoftmaxStatistics(row_max, row_sum, spread)


def merge_statistics(a: SoftmaxStatistics, b: SoftmaxStatistics) -> SoftmaxStatistics:
    """The statistics of two column blocks of the same rows, together (exact up to
    rounding; both blocks non-empty)."""
    row_max = torch.maximum(a.row_max, b.row_max)
    # Relative to 0 while both blocks are all -inf (block_statistics); a block of -inf
    # logits has a sum of 0 and scales to 0 (its max - a finite max is -inf).
    reference, a_ref, b_ref = (finite_reference(m) for m in (row_max, a.row_max, b.row_max))
    scale_a = torch.where(a.row_sum > 0, torch.exp(a_ref - reference), 0.0)  # (M,) in [0, 1]
    scale_b = torch.where(b.row_sum > 0, torch.exp(b_ref - reference), 0.0)
    row_sum = a.row_sum * scale_a + b.row_sum * scale_b
    spread = None
    if a.spread is not None and b.spread is not None:
        spread = scale_a * (a.spread + (reference - a_ref) * a.row_sum) + scale_b * (
            b.spread + (reference - b_ref) * b.row_sum
        )
    return SoftmaxStatistics(row_max, row_sum, spread)


@dataclass(frozen=True)
class RowValues:
    logprob: torch.Tensor  # (M,) z_y - lse
    entropy: torch.Tensor | None  # (M,) H
    lse: torch.Tensor  # (M,) float64: m + log s without rounding the sum


def row_values(stats: SoftmaxStatistics, target_logit: torch.Tensor) -> RowValues:
    """logprob, entropy and lse from the whole row's statistics and ``z_y`` (M,)."""
    log_sum = torch.log(stats.row_sum)  # (M,) >= 0
    logprob = torch.neg((stats.row_max - target_logit) + log_sum)  # -(d_y + log s)
    entropy = None if stats.spread is None else log_sum + stats.spread / stats.row_sum
    return RowValues(logprob, entropy, stats.row_max.double() + log_sum.double())


def logits_gradient(
    z: torch.Tensor,  # (M, V) fp32; consumed
    target: torch.Tensor,  # (M,) int64 in [0, V) (any such value on ignored rows)
    lse: torch.Tensor,  # (M,) float64 or float32
    entropy: torch.Tensor | None,  # (M,), needed with coef_entropy
    coef_logprob: torch.Tensor | None,  # (M,) g_lp / temperature
    coef_entropy: torch.Tensor | None,  # (M,) g_H / temperature
) -> torch.Tensor:
    """dL/dlogits (M, V) fp32: ``coef_lp ([i == y] - p_i) - coef_H p_i (log p_i + H)``;
    the caller zeroes the ignored rows (their lse is 0: exp(z - lse) may overflow)."""
    lse_hi = lse.float()
    lse_lo = (lse.double() - lse_hi.double()).float()  # 0 for a float32 lse
    log_p = z.sub_(lse_hi[:, None]).sub_(lse_lo[:, None])  # (M, V) (z_i - hi) - lo
    p = torch.exp(log_p)
    if coef_logprob is not None:
        grad = torch.neg(p)
        grad.scatter_add_(1, target[:, None], torch.ones_like(grad[:, :1]))  # [i == y] - p_i
        grad.mul_(coef_logprob[:, None])
    else:
        grad = torch.zeros_like(p)
    if coef_entropy is not None:
        # p_i (log p_i + H) in p's storage: no (M, V) temporary beyond z, p and the gradient
        # (the chunk's workspace per logit, EXTRA_BYTES_PER_LOGIT of the backends). A -inf
        # logit's log p is clamped to the least finite float first, so that its p = 0 gives
        # 0, not 0 * -inf = NaN; a NaN still propagates.
        log_p.clamp_(min=torch.finfo(torch.float32).min).add_(entropy[:, None])
        grad.sub_(p.mul_(log_p).mul_(coef_entropy[:, None]))
    return grad
