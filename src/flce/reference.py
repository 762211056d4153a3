"""Dense float64 reference of every formula in the contract.

Written directly from the math (log-softmax, autograd for gradients), with no code
shared with the chunked driver or any kernel, so it can judge them. It materializes
the (N, V) logits: use it on small shapes only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class ReferenceResult:
    loss: torch.Tensor  # scalar, or (N,) for reduction="none"
    z_loss: torch.Tensor
    token_accuracy: torch.Tensor
    predicted_tokens: torch.Tensor  # (N,) int64, -1 on ignored rows


def cross_entropy_reference(
    logits: torch.Tensor,  # (N, V) float64 (anything else is upcast)
    target: torch.Tensor,  # (N,)
    *,
    ce_weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    lse_square_scale: float = 0.0,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    softcap: float | None = None,
    use_token_scaling: bool = False,
    math_dtype: torch.dtype = torch.float64,
) -> ReferenceResult:
    """Loss on given logits, differentiable through ``logits`` (autograd in ``math_dtype``).

    ``math_dtype=torch.float32`` on low-precision logits is what eager PyTorch code
    does (``cross_entropy(logits.float())``): tests use it to measure PyTorch's own
    error in a dtype, the yardstick of every tolerance.
    """
    z = logits.to(math_dtype)
    n, vocab = z.shape
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    target = target.long()  # compared in int64: a narrower dtype would wrap ignore_index
    valid = target != ignore_index
    y = torch.where(valid, target, torch.zeros_like(target))
    log_p = torch.log_softmax(z, dim=-1)  # log p_i = z'_i - lse
    lse = torch.logsumexp(z, dim=-1)
    w = (
        torch.ones(vocab, dtype=math_dtype, device=z.device)
        if ce_weight is None
        else ce_weight.to(z.device, math_dtype)
    )
    w_y = w[y]
    nll = -log_p.gather(1, y[:, None]).squeeze(1)
    ce = (1 - label_smoothing) * w_y * nll
    if label_smoothing > 0:  # (skipped at 0: a masked -inf logit would make 0 * inf NaN)
        smooth = -(log_p * w[None, :]).sum(dim=-1)  # sum_i w_i (lse - z'_i)
        ce = ce + (label_smoothing / vocab) * smooth
    zl = lse_square_scale * lse**2
    if use_token_scaling:
        token_scale = torch.exp(-nll).detach()
        ce = ce * token_scale
        zl = zl * token_scale
    zero = torch.zeros((), dtype=math_dtype, device=z.device)
    ce = torch.where(valid, ce, zero)
    zl = torch.where(valid, zl, zero)
    predicted = torch.where(valid, z.detach().argmax(dim=-1), torch.full_like(y, -1))
    correct = ((predicted == target) & valid).to(math_dtype)

    n_valid = valid.sum().to(math_dtype)
    if reduction == "none":
        return ReferenceResult(ce + zl, zl, correct, predicted)
    accuracy = correct.sum() / n_valid if n_valid > 0 else zero
    if reduction == "sum":
        return ReferenceResult(ce.sum() + zl.sum(), zl.sum(), accuracy, predicted)
    ce_denominator = (w_y * valid).sum() if ce_weight is not None else n_valid
    ce_mean = ce.sum() / ce_denominator if ce_denominator > 0 else ce.sum() * 0
    z_mean = zl.sum() / n_valid if n_valid > 0 else zl.sum() * 0
    return ReferenceResult(ce_mean + z_mean, z_mean, accuracy, predicted)


def fused_linear_cross_entropy_reference(
    input: torch.Tensor,  # (N, H)
    weight: torch.Tensor,  # (V, H)
    target: torch.Tensor,  # (N,)
    bias: torch.Tensor | None = None,  # (V,)
    logits_dtype: torch.dtype = torch.float64,
    **options,
) -> ReferenceResult:
    """``cross_entropy_reference(input @ weight.T + bias)``, differentiable through
    whichever of ``input``/``weight``/``bias`` require grad. The logits GEMM runs in
    ``logits_dtype`` (float64 for the reference; the inputs' own dtype to measure eager
    PyTorch's error, with ``math_dtype=torch.float32``)."""
    # F.linear, as an LM head computes it (the bias is added inside the GEMM, one rounding).
    logits = torch.nn.functional.linear(
        input.to(logits_dtype), weight.to(logits_dtype), None if bias is None else bias.to(logits_dtype)
    )
    return cross_entropy_reference(logits, target, **options)


# ---- RL and distillation heads ----

REDUCTIONS = ("mean", "sum", "none")


@dataclass
class LogprobsReference:
    logprobs: torch.Tensor  # (N,) log-softmax of the target class, 0 on ignored rows
    entropy: torch.Tensor  # (N,) -sum_i p_i log p_i, 0 on ignored rows


def logprobs_from_logits_reference(
    logits: torch.Tensor,  # (N, V)
    target: torch.Tensor,  # (N,)
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    math_dtype: torch.dtype = torch.float64,
) -> LogprobsReference:
    """Per-row logprob of the target and entropy of ``softmax(logits / temperature)``,
    differentiable through ``logits`` (autograd in ``math_dtype``; float32 on
    low-precision logits is what eager PyTorch code does)."""
    log_p = torch.log_softmax(logits.to(math_dtype) / temperature, dim=-1)  # (N, V)
    target = target.long()  # compared in int64: a narrower dtype would wrap ignore_index
    valid = target != ignore_index
    y = torch.where(valid, target, torch.zeros_like(target))
    logprobs = log_p.gather(1, y[:, None]).squeeze(1)
    # 0 log 0 = 0 for a masked (-inf) logit, in value and gradient (log p masked first)
    entropy = -(torch.exp(log_p) * torch.where(log_p > -math.inf, log_p, 0.0)).sum(dim=-1)
    zero = torch.zeros((), dtype=math_dtype, device=log_p.device)
    return LogprobsReference(torch.where(valid, logprobs, zero), torch.where(valid, entropy, zero))


def _linear(input, weight, bias, logits_dtype):
    # F.linear, as an LM head computes it (the bias is added inside the GEMM, one rounding).
    return torch.nn.functional.linear(
        input.to(logits_dtype), weight.to(logits_dtype), None if bias is None else bias.to(logits_dtype)
    )


def logprobs_reference(
    input: torch.Tensor,  # (N, H)
    weight: torch.Tensor,  # (V, H)
    target: torch.Tensor,  # (N,)
    bias: torch.Tensor | None = None,  # (V,)
    temperature: float = 1.0,
    ignore_index: int = -100,
    *,
    logits_dtype: torch.dtype = torch.float64,
    math_dtype: torch.dtype = torch.float64,
) -> LogprobsReference:
    """``logprobs_from_logits_reference(input @ weight.T + bias)``, differentiable through
    whichever of ``input``/``weight``/``bias`` require grad; the GEMM in ``logits_dtype``."""
    logits = _linear(input, weight, bias, logits_dtype)
    return logprobs_from_logits_reference(
        logits, target, temperature=temperature, ignore_index=ignore_index, math_dtype=math_dtype
    )


def distillation_from_logits_reference(
    student_logits: torch.Tensor,  # (N, V)
    teacher_logits: torch.Tensor,  # (N, V)
    target: torch.Tensor | None = None,  # (N,)
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    math_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Liger's generalized JSD between ``q = softmax(student / T)`` and
    ``p = softmax(teacher / T)`` (teacher detached): ``beta = 0`` is KL(p || q), ``beta = 1``
    KL(q || p), otherwise ``beta KL(p || M) + (1 - beta) KL(q || M)`` with
    ``M = beta p + (1 - beta) q``. ``"mean"`` divides by the rows not ignored (all rows
    without ``target``; 0 when there are none), ``"none"`` returns per-row values. A -inf
    logit (a masked part of the vocabulary) is a zero probability: its terms are 0, in
    value and gradient."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student and teacher logits must have the same shape, got {tuple(student_logits.shape)} "
            f"and {tuple(teacher_logits.shape)}"
        )
    log_q = torch.log_softmax(student_logits.to(math_dtype) / temperature, dim=-1)  # (N, V)
    log_p = torch.log_softmax(teacher_logits.detach().to(math_dtype) / temperature, dim=-1)

    zero = torch.zeros((), dtype=math_dtype, device=log_q.device)

    def kl(log_a, log_b):  # KL(a || b) per row
        # A column where a = 0 (a -inf logit, a masked part of the vocabulary) adds
        # 0 log 0 = 0, not 0 * (-inf - log b) = NaN: both logs are masked first, so that
        # the gradient through the unused branch of the product is 0, not NaN, too.
        present = log_a > -math.inf
        log_a, log_b = torch.where(present, log_a, zero), torch.where(present, log_b, zero)
        return (torch.exp(log_a) * (log_a - log_b)).sum(dim=-1)

    if beta == 0.0:
        rows = kl(log_p, log_q)
    elif beta == 1.0:
        rows = kl(log_q, log_p)
    else:
        # M = 0 where p = q = 0; logaddexp's gradient at (-inf, -inf) is NaN: masked first.
        either = (log_p > -math.inf) | (log_q > -math.inf)
        mixed = torch.logaddexp(
            torch.where(either, log_p, zero) + math.log(beta), torch.where(either, log_q, zero) + math.log(1.0 - beta)
        )
        log_m = torch.where(either, mixed, -math.inf)
        rows = beta * kl(log_p, log_m) + (1.0 - beta) * kl(log_q, log_m)
    if target is None:
        valid = torch.ones(rows.shape, dtype=torch.bool, device=rows.device)
    else:
        valid = target.to(rows.device).long() != ignore_index
    rows = torch.where(valid, rows, torch.zeros((), dtype=math_dtype, device=rows.device))
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    n_valid = valid.sum()
    return rows.sum() / n_valid if n_valid > 0 else rows.sum() * 0


def distillation_reference(
    student_input: torch.Tensor,  # (N, H_s)
    student_weight: torch.Tensor,  # (V, H_s)
    teacher_input: torch.Tensor,  # (N, H_t)
    teacher_weight: torch.Tensor,  # (V, H_t)
    target: torch.Tensor | None = None,  # (N,)
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    student_bias: torch.Tensor | None = None,  # (V,)
    teacher_bias: torch.Tensor | None = None,  # (V,)
    *,
    logits_dtype: torch.dtype = torch.float64,
    math_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``distillation_from_logits_reference`` of the two LM heads' logits; gradients reach
    the student's input, weight and bias only (the teacher's logits are detached)."""
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(
            f"student and teacher vocabularies must match, got {student_weight.shape[0]} and {teacher_weight.shape[0]}"
        )
    return distillation_from_logits_reference(
        _linear(student_input, student_weight, student_bias, logits_dtype),
        _linear(teacher_input, teacher_weight, teacher_bias, logits_dtype),
        target,
        beta=beta,
        temperature=temperature,
        ignore_index=ignore_index,
        reduction=reduction,
        math_dtype=math_dtype,
    )
