"""Chunk CE kernel in plain PyTorch (fp32 math): runs on any device, and is the
readable twin of the fused kernels (same formulas as ``flce.backends.base``)."""

from __future__ import annotations

import torch

from flce.backends.base import ChunkScalars, gradient_destination

# fp32 temporaries this kernel holds per logit beyond the chunk itself, at most three
# (M, V) fp32 tensors at once: the softcap derivative, p, and the gradient before it is
# cast back (z' is freed once p exists).
EXTRA_BYTES_PER_LOGIT = 12


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


def loss_rows(
    log_s: torch.Tensor,  # (M,) log of the sum of exp(z' - m)
    shifted_target: torch.Tensor,  # (M,) z'_y - m
    shifted_smooth_sum: torch.Tensor | None,  # (M,) sum_i w_i (z'_i - m), with label smoothing
    lse: torch.Tensor,  # (M,) m + log_s
    w_y: torch.Tensor,  # (M,) class weight of the target (1 without weights)
    scalars: ChunkScalars,
    eps: float,  # label_smoothing / V (the whole vocabulary)
):
    """-> (ce, zl, token_scale or None) per row, in terms of the shifted logits ``z' - m``
    (differences to the row max keep the precision that ``m + log s`` would round away)."""
    ls = scalars.label_smoothing
    ce = (1.0 - ls) * w_y * (log_s - shifted_target)
    if shifted_smooth_sum is not None:
        # sum_i w_i (lse - z'_i) = W * log(s) - sum_i w_i (z'_i - m)
        ce = ce + eps * (scalars.weight_sum * log_s - shifted_smooth_sum)
    zl = scalars.lse_square_scale * lse * lse
    token_scale = torch.exp(shifted_target - log_s) if scalars.use_token_scaling else None  # p_y, detached
    if token_scale is not None:
        ce = ce * token_scale
        zl = zl * token_scale
    return ce, zl, token_scale


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
    row_scale: torch.Tensor,  # (M,) token scale x upstream gradient (anything on dropped rows)
    rows_kept: torch.Tensor,  # (M,) bool: False on ignored rows, whose gradient is exactly 0
) -> torch.Tensor:
    """dL/dz in the grouped form of ``flce.backends.base``: each group cancels exactly
    where the true gradient is ~0 (p_y ~ 1, V = 1), which an expanded form would not.
    Dropped rows are selected to 0, not multiplied by it: their logits (hence ``p``) may
    be NaN or Inf, and ``0 * NaN`` is NaN."""
    grad = p.clone()
    grad.scatter_add_(1, onehot_index[:, None], -onehot_mask[:, None])  # p_i - [i == y]
    grad.mul_((scalars.ce_grad_scale * (1.0 - scalars.label_smoothing) * w_y)[:, None])
    if scalars.lse_square_scale > 0:
        grad.addcmul_(p, (scalars.z_grad_scale * 2.0 * scalars.lse_square_scale * lse)[:, None])
    if eps > 0:
        # + eps * (W p_i - w_i), the group formed before scaling (p is not needed after).
        p.mul_(scalars.weight_sum).sub_(ce_weight[None, :] if ce_weight is not None else 1.0)
        grad.add_(p, alpha=scalars.ce_grad_scale * eps)
    if softcap_derivative is not None:
        grad.mul_(softcap_derivative)
    grad.mul_(row_scale[:, None])
    return grad.masked_fill_(~rows_kept[:, None], 0.0)


def cross_entropy_chunk(
    logits: torch.Tensor,  # (M, V) fp16/bf16/fp32; overwritten with the gradient if compute_grad and no grad_out
    target: torch.Tensor,  # (M,) int
    ce_weight: torch.Tensor | None,  # (V,) fp32
    scalars: ChunkScalars,
    *,
    loss_out: torch.Tensor,  # (M,) fp32
    z_loss_out: torch.Tensor | None,  # (M,) fp32
    correct_out: torch.Tensor | None,  # (M,) fp32
    predicted_out: torch.Tensor | None,  # (M,) int64
    row_grad_scale: torch.Tensor | None,  # (M,) fp32
    compute_grad: bool,
    grad_out: torch.Tensor | None = None,  # (M, V): the gradient goes here instead of over the logits
) -> None:
    num_rows, vocab = logits.shape
    if num_rows == 0:
        return
    grad_destination = gradient_destination(logits, grad_out, compute_grad)
    eps = scalars.label_smoothing / vocab

    valid = target != scalars.ignore_index  # (M,)
    safe_target = torch.where(valid, target, torch.zeros_like(target)).long()  # (M,) gather-safe

    z = logits.float()  # (M, V) fp32 copy; never aliases logits (the gradient is written there)
    if z.data_ptr() == logits.data_ptr():
        z = z.clone()
    z, softcap_derivative = apply_softcap(z, scalars.softcap, compute_grad)

    row_max = z.max(dim=-1).values  # (M,)
    z.sub_(row_max[:, None])  # (M, V) shifted logits z' - m
    argmax = z.argmax(dim=-1) if (correct_out is not None or predicted_out is not None) else None  # first index
    shifted_target = z.gather(1, safe_target[:, None]).squeeze(1)  # (M,)
    shifted_smooth_sum = None
    if eps > 0:
        shifted_smooth_sum = z @ ce_weight if ce_weight is not None else z.sum(dim=-1)  # (M,)
    p = torch.exp(z)  # (M, V) unnormalised, in [0, 1]
    del z
    s_sum = p.sum(dim=-1)  # (M,)
    log_s = torch.log(s_sum)
    lse = row_max + log_s
    w_y = ce_weight[safe_target] if ce_weight is not None else torch.ones_like(lse)
    ce, zl, token_scale = loss_rows(log_s, shifted_target, shifted_smooth_sum, lse, w_y, scalars, eps)

    zero = torch.zeros_like(lse)
    loss_out.copy_(torch.where(valid, ce, zero))
    if z_loss_out is not None:
        z_loss_out.copy_(torch.where(valid, zl, zero))
    if correct_out is not None:
        correct_out.copy_(((argmax == target) & valid).float())
    if predicted_out is not None:
        predicted_out.copy_(torch.where(valid, argmax, torch.full_like(argmax, -1)))
    if not compute_grad:
        return

    row_scale = torch.ones_like(lse) if token_scale is None else token_scale
    if row_grad_scale is not None:
        row_scale = row_scale * row_grad_scale.float()
    p.div_(s_sum[:, None])  # (M, V) softmax
    grad_destination.copy_(
        gradient_from_softmax(
            p,
            safe_target,
            torch.ones_like(lse),
            w_y,
            lse,
            ce_weight,
            scalars,
            eps,
            softcap_derivative,
            row_scale,
            valid,
        )
    )
