"""Chunk CE kernel in plain PyTorch (fp32 math): runs on any device, and is the
readable twin of the fused kernels (same formulas as ``flce.backends.base``)."""

from __future__ import annotations

from typing import Optional

import torch

from flce.backends.base import ChunkScalars

# fp32 temporaries this kernel holds per logit beyond the chunk itself: z' (and the
# softcap tanh), p, and the gradient before it is cast back: three fp32 (M, V) tensors.
EXTRA_BYTES_PER_LOGIT = 12


def cross_entropy_chunk(
    logits: torch.Tensor,  # (M, V) fp16/bf16/fp32; overwritten with the gradient if compute_grad
    target: torch.Tensor,  # (M,) int
    ce_weight: Optional[torch.Tensor],  # (V,) fp32
    scalars: ChunkScalars,
    *,
    loss_out: torch.Tensor,  # (M,) fp32
    z_loss_out: Optional[torch.Tensor],  # (M,) fp32
    correct_out: Optional[torch.Tensor],  # (M,) fp32
    predicted_out: Optional[torch.Tensor],  # (M,) int64
    row_grad_scale: Optional[torch.Tensor],  # (M,) fp32
    compute_grad: bool,
) -> None:
    num_rows, vocab = logits.shape
    if num_rows == 0:
        return
    ls = scalars.label_smoothing
    eps = ls / vocab
    s = scalars.lse_square_scale
    c = scalars.softcap

    valid = target != scalars.ignore_index  # (M,)
    safe_target = torch.where(valid, target, torch.zeros_like(target)).long()  # (M,) gather-safe

    z = logits.float()  # (M, V) fp32 copy; never aliases logits (the gradient is written there)
    if z.data_ptr() == logits.data_ptr():
        z = z.clone()
    if c is not None:
        z = torch.tanh(z.div_(c)).mul_(c)  # z' = c * tanh(z / c)

    lse = torch.logsumexp(z, dim=-1)  # (M,)
    z_target = z.gather(1, safe_target[:, None]).squeeze(1)  # (M,)
    if ce_weight is not None:
        w_y = ce_weight[safe_target]  # (M,)
        smooth_sum = z @ ce_weight if ls > 0 else None  # (M,) sum_i w_i z'_i
    else:
        w_y = torch.ones_like(lse)
        smooth_sum = z.sum(dim=-1) if ls > 0 else None
    ce = (1.0 - ls) * w_y * (lse - z_target)
    if smooth_sum is not None:
        ce = ce + eps * (scalars.weight_sum * lse - smooth_sum)
    zl = s * lse * lse

    zero = torch.zeros_like(lse)
    token_scale = torch.exp(z_target - lse) if scalars.use_token_scaling else None  # p_y, detached
    if token_scale is not None:
        ce = ce * token_scale
        zl = zl * token_scale
    loss_out.copy_(torch.where(valid, ce, zero))
    if z_loss_out is not None:
        z_loss_out.copy_(torch.where(valid, zl, zero))
    if correct_out is not None or predicted_out is not None:
        argmax = z.argmax(dim=-1)  # first index among ties
        if correct_out is not None:
            correct_out.copy_(((argmax == target) & valid).float())
        if predicted_out is not None:
            predicted_out.copy_(torch.where(valid, argmax, torch.full_like(argmax, -1)))

    if not compute_grad:
        return

    # Per-row coefficients. The CE part is kept apart from the z-loss part until the
    # one-hot is subtracted: for a confident row p_y ~ 1 and the CE gradient cancels
    # to ~0, which folding the z term into the p coefficient first would swamp.
    ce_coef = scalars.ce_grad_scale * ((1.0 - ls) * w_y + eps * scalars.weight_sum)  # (M,)
    onehot_coef = scalars.ce_grad_scale * (1.0 - ls) * w_y  # (M,)
    z_coef = scalars.z_grad_scale * 2.0 * s * lse if s > 0 else None  # (M,)
    row_scale = valid.float()
    if token_scale is not None:
        row_scale = row_scale * token_scale
    if row_grad_scale is not None:
        row_scale = row_scale * row_grad_scale.float()

    softcap_derivative = None
    if c is not None:
        softcap_derivative = 1.0 - (z / c) ** 2  # (M, V) from z' before z is reused for p
    p = torch.exp(z.sub_(lse[:, None]))  # (M, V) softmax, in z's storage
    grad = p * ce_coef[:, None]
    if eps > 0:
        if ce_weight is not None:
            grad.sub_((scalars.ce_grad_scale * eps) * ce_weight[None, :])
        else:
            grad.sub_(scalars.ce_grad_scale * eps)
    grad.scatter_add_(1, safe_target[:, None], -onehot_coef[:, None])
    if z_coef is not None:
        grad.addcmul_(p, z_coef[:, None])
    if softcap_derivative is not None:
        grad.mul_(softcap_derivative)
    grad.mul_(row_scale[:, None])
    logits.copy_(grad)
