"""Row math of the distillation head: Liger's generalized Jensen-Shannon divergence
between a teacher's and a student's next-token distributions, with its gradient with
respect to the student's logits only (the teacher is a constant).

Per row, in fp32 whatever the logits dtype (``z = logits / temperature`` for both
models, ``p = softmax(z_teacher)``, ``q = softmax(z_student)``,
``M = beta p + (1 - beta) q``)::

    beta = 0:       loss = KL(p || q) = sum_i p_i (log p_i - log q_i)         (forward KL)
    beta = 1:       loss = KL(q || p) = sum_i q_i (log q_i - log p_i)         (reverse KL)
    0 < beta < 1:   loss = beta KL(p || M) + (1 - beta) KL(q || M)

    beta = 0:       dL/dz_student_i = q_i - p_i
    beta > 0:       dL/dz_student_i = w q_i (r_i - K),   r_i = log q_i - log M_i,
                    K = sum_j q_j r_j = KL(q || M),     w = 1 - beta
                    (at beta = 1: M = p and w = 1)
    dL/dstudent_logits = dL/dz_student / temperature

The two KLs are Liger's special cases at the ends (its ``jsd`` kernel branches on
``beta == 0`` and ``beta == 1``): the mixture formula itself goes to 0 there, since M
becomes p or q. As in Liger, the temperature divides the logits and nothing rescales the
loss (no ``temperature**2``). Rows whose target equals ``ignore_index`` get loss 0 and a
zero gradient row; without targets no row is ignored. The reduction (Liger: the mean over
the rows not ignored, all rows without targets) is the caller's: the kernels take a
per-row gradient scale.

Derivation: with ``g_i = dL/d(log q_i)`` holding ``log q`` as free coordinates, the
log-softmax gives ``dL/dz_i = g_i - q_i sum_j g_j``. For ``beta = 0``, ``g_i = -p_i``
(``sum = -1``); for the mixture ``g_i = (1 - beta) q_i r_i`` (the terms through M cancel:
``beta p_i + (1 - beta) q_i = M_i``); for ``beta = 1``, ``g_i = q_i (r_i + 1)``, whose
constant part the centring removes.

Numerics:
- ``log p_i = (z_i - m) - log s`` per row, as PyTorch's log-softmax forms it.
- A -inf logit (a masked part of the vocabulary, e.g. a -inf bias) has probability 0, and
  every term it weighs is ``0 log 0 = 0``: each product ``p_i * x_i`` or ``q_i * x_i``
  (loss, ``K``, gradient) is taken as 0 where the probability is, never ``0 * inf = NaN``
  (``log p_i`` is -inf there, and ``log M_i`` too where both models mask the column), as
  the cross-entropy and the logprobs do. The divergence then stays finite; it is infinite
  (+inf, or NaN) only where it is in exact arithmetic: a column one model masks and the
  other does not, weighed by the other (KL(p || q) with ``q_i = 0 < p_i``, KL(q || p) with
  ``p_i = 0 < q_i``; the mixture never is, ``M_i > 0`` wherever ``p_i`` or ``q_i`` is).
- Mixture: ``r`` without forming M or log M: with ``c_i = max(log p_i, log q_i)`` and
  ``L_i = log(beta exp(log p_i - c_i) + (1 - beta) exp(log q_i - c_i))``,
  ``log p_i - log M_i = (log p_i - c_i) - L_i`` and ``log q_i - log M_i = (log q_i - c_i) - L_i``
  (one of the two differences to ``c_i`` is exactly 0). M itself underflows where both
  probabilities are tiny, and ``log M_i`` near ``log p_i`` would be subtracted from a
  value of its own size.
- ``beta > 0``: where ``q_j ~ 1``, ``K ~ r_j`` and ``r_j - K`` would cancel two numbers of
  the size of ``r_j`` (up to ~40 for the reverse KL: a confident student against a teacher
  that disagrees). Both are taken relative to the anchor ``a = r_{j*}`` at the student's
  argmax ``j*``, so that the largest gradient element, ``-w q_{j*} (K - a)``, is accurate
  to its own size::

      K - a = sum_i q_i (r_i - a)     (the j* term is exactly 0, the others carry small q)
      KL(q || M) = a + (K - a),        dL/dz_student_i = w q_i ((r_i - a) - (K - a))

  For the reverse KL, ``r_i - a = (z_student_i - m_student) - (z_teacher_i - z_teacher_{j*})``
  straight from the logits (``z_student_{j*} = m_student``); for the mixture, ``r_i - a``
  is the difference of the two ratios.
- ``K`` needs the whole row before any gradient element: a kernel reads both rows once
  for the softmax statistics (and the student's argmax), once more for the loss and
  ``K``, and (for ``beta > 0``, with the gradient) once more to write it; ``beta = 0``
  writes ``q - p`` in the loss pass.
- Column blocks of one row combine as the softmax statistics of
  ``flce.rows.logprobs.merge_statistics`` (each model's max and sum; the argmax of the
  block with the larger max); with those, the loss and ``K`` are sums over the columns,
  so blocks add them.

Kernel contract: every backend's ``distillation_chunk`` implements ``DistillationKernel``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from flce.rows.logprobs import INDEX_DTYPES, check_inv_temperature, check_logits, check_row_vector

# The kernels' DIVERGENCE flag: which formula a beta selects.
FORWARD_KL = 0
REVERSE_KL = 1
MIXTURE = 2


class DistillationKernel(Protocol):
    """Per-row loss, and (``compute_grad``) dL/dstudent_logits * row_grad_scale.

    student_logits   (M, V) fp16/bf16/fp32, unit stride along V; overwritten with the
                     gradient (same dtype) when ``compute_grad``, else only read.
    teacher_logits   (M, V) any of the same dtypes, unit stride along V; only read.
    target           (M,) int32/int64 or None (None: no row is ignored).
    loss_out         (M,) fp32, written (0 on ignored rows).
    row_grad_scale   (M,) fp32 or None (1): the reduction's 1/count times the upstream gradient.
    """

    def __call__(
        self,
        student_logits: torch.Tensor,
        teacher_logits: torch.Tensor,
        target: torch.Tensor | None,
        *,
        beta: float,
        inv_temperature: float,
        ignore_index: int,
        loss_out: torch.Tensor,
        row_grad_scale: torch.Tensor | None,
        compute_grad: bool,
    ) -> None: ...


@dataclass(frozen=True)
class Divergence:
    """What ``beta`` selects: the formula (``kind``) and the weights of the two KL terms."""

    beta: float
    kind: int  # FORWARD_KL, REVERSE_KL or MIXTURE
    teacher_weight: float  # weight of KL(p || M)
    student_weight: float  # weight of KL(q || M): the w of the gradient


def divergence(beta: float) -> Divergence:
    if not (math.isfinite(beta) and 0.0 <= beta <= 1.0):
        raise ValueError(f"beta must be in [0, 1] (0: forward KL, 1: reverse KL), got {beta}")
    if beta == 0.0:
        return Divergence(0.0, FORWARD_KL, 1.0, 0.0)
    if beta == 1.0:
        return Divergence(1.0, REVERSE_KL, 0.0, 1.0)
    return Divergence(float(beta), MIXTURE, float(beta), 1.0 - float(beta))


def check_arguments(student_logits, teacher_logits, target, beta, inv_temperature, loss_out, row_grad_scale) -> None:
    check_logits(student_logits, "student_logits")
    check_logits(teacher_logits, "teacher_logits")
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(
            "teacher_logits must have the student's shape (M, V): the vocabularies must match, got "
            f"{tuple(teacher_logits.shape)} for the teacher and {tuple(student_logits.shape)} for the student"
        )
    if teacher_logits.device != student_logits.device:
        raise ValueError(f"teacher_logits must be on {student_logits.device}, got {teacher_logits.device}")
    check_row_vector(target, "target", student_logits, INDEX_DTYPES)
    divergence(beta)
    check_inv_temperature(inv_temperature)
    check_row_vector(loss_out, "loss_out", student_logits, (torch.float32,))
    check_row_vector(row_grad_scale, "row_grad_scale", student_logits, (torch.float32,))


def weighted(probability: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``probability * values`` (M, V) in ``probability``'s storage (consumed), 0 where the
    probability is 0 (a -inf logit, whose value may be infinite or NaN: 0 log 0 = 0). A NaN
    probability (NaN logits) stays NaN: the test is ``== 0``, not ``> 0``."""
    vanishing = probability == 0  # (M, V) bool
    return probability.mul_(values).masked_fill_(vanishing, 0.0)


def log_softmax_rows(z: torch.Tensor) -> torch.Tensor:
    """``(z_i - m) - log s`` (M, V) fp32, a new tensor."""
    shifted = z - z.amax(dim=-1, keepdim=True)
    return shifted.sub_(torch.exp(shifted).sum(dim=-1, keepdim=True).log_())


def log_ratios_to_mixture(log_p: torch.Tensor, log_q: torch.Tensor, beta: float):
    """``(log p - log M, log q - log M)`` (M, V) each, in the form above (0 < beta < 1)."""
    c = torch.maximum(log_p, log_q)
    shifted_p = log_p - c  # (M, V) <= 0, one of the two is exactly 0
    shifted_q = log_q - c
    del c
    mixture = torch.exp(shifted_p).mul_(beta).add_(torch.exp(shifted_q), alpha=1.0 - beta).log_()  # L
    return shifted_p.sub_(mixture), shifted_q.sub_(mixture)


@dataclass(frozen=True)
class RowDivergence:
    loss: torch.Tensor  # (M,)
    log_q: torch.Tensor  # (M, V) the student's log-softmax
    log_p: torch.Tensor  # (M, V) the teacher's log-softmax
    ratio: torch.Tensor | None  # (M, V) r - a; None for the forward KL
    centre: torch.Tensor | None  # (M,) K - a


def row_divergence(z_student: torch.Tensor, z_teacher: torch.Tensor, div: Divergence) -> RowDivergence:
    """Loss per row, and what the gradient needs, from both models' ``z`` (M, V) fp32,
    which are consumed (a caller that passes temporaries holds at most seven (M, V) fp32
    tensors at once)."""
    log_q = log_softmax_rows(z_student)
    log_p = log_softmax_rows(z_teacher)
    if div.kind == FORWARD_KL:
        del z_student, z_teacher
        return RowDivergence(weighted(torch.exp(log_p), log_p - log_q).sum(dim=-1), log_q, log_p, None, None)
    student_max, anchor_column = z_student.max(dim=-1, keepdim=True)  # (M, 1) m_student and j*
    if div.kind == REVERSE_KL:
        teacher_at_anchor = z_teacher.gather(1, anchor_column)  # (M, 1) z_teacher_{j*}
        ratio = z_student.sub_(student_max).sub_(z_teacher.sub_(teacher_at_anchor))  # r - a, in z_student
        del z_teacher
        anchor = log_q.gather(1, anchor_column) - log_p.gather(1, anchor_column)  # (M, 1) a = r_{j*}
        teacher_kl = 0.0
    else:
        del z_student, z_teacher
        teacher_ratio, ratio = log_ratios_to_mixture(log_p, log_q, div.beta)
        teacher_kl = weighted(torch.exp(log_p), teacher_ratio).sum(dim=-1)  # KL(p || M)
        del teacher_ratio
        anchor = ratio.gather(1, anchor_column)  # (M, 1) a = r_{j*}
        ratio.sub_(anchor)  # r - a, exactly 0 at j*
    centre = weighted(torch.exp(log_q), ratio).sum(dim=-1)  # K - a
    student_kl = anchor.squeeze(1) + centre  # KL(q || M)
    return RowDivergence(div.teacher_weight * teacher_kl + div.student_weight * student_kl, log_q, log_p, ratio, centre)


def student_gradient(rows: RowDivergence, div: Divergence) -> torch.Tensor:
    """dL/dz_student (M, V) fp32, before the temperature and row scales."""
    q = torch.exp(rows.log_q)
    if div.kind == FORWARD_KL:
        return q.sub_(torch.exp(rows.log_p))
    return weighted(q, rows.ratio - rows.centre[:, None]).mul_(div.student_weight)
