"""Chunk CE kernel in plain PyTorch (fp32 math): runs on any device, and is the
readable twin of the fused kernels (the formulas of ``flce.rows.cross_entropy``).

Written for few passes over the ``(M, V)`` chunk, since each is a kernel launch and a
read and write of ``4 M V`` bytes on a GPU (where this backend runs too, and where at
small shapes its time is these passes and their launches). Without features:

1. ``log p = log_softmax(z)`` in fp32, straight from the 16-bit logits (one fused kernel,
   ``(z - max) - log(sum)``, the precise form); the row outputs come from it
   (``ce = -log p_y``: the rows' reference point is their lse, ``flce.rows.cross_entropy.loss_rows``);
2. ``p = exp(log p)`` in place;
3. ``p * a`` with one multiplier per row (``a = coef_y + coef_z``: every column but the
   target's), written in the gradient's dtype by the product itself;
4. the target's column in the grouped form (``coef_y (p_y - 1) + coef_z p_y``, formed per
   row, so that it cancels exactly on a confident row), and the rows whose scale is 0
   (ignored ones) set to exactly 0, whatever their logits hold.

Label smoothing adds its group ``coef_eps (W p_i - w_i)`` (formed before it is scaled),
softcap its ``tanh`` before step 1 and its derivative's product after step 3.
"""

from __future__ import annotations

import torch

from flce.backends.base import gradient_destination
from flce.rows.cross_entropy import (
    ChunkScalars,
    apply_softcap,
    fp32_working_copy,
    gather_safe_target,
    loss_rows,
    row_scale,
    store_rows,
)

# fp32 temporaries this kernel holds per logit beyond the chunk itself, at most three
# (M, V) fp32 tensors at once: with softcap z', its derivative and log p (z' is freed once
# log p exists), then p, the derivative and the smoothing group.
EXTRA_BYTES_PER_LOGIT = 12


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
    eps = scalars.smoothing_eps(vocab)
    needs_lse = scalars.lse_square_scale > 0 or z_loss_out is not None

    valid = target != scalars.ignore_index  # (M,)
    safe_target = gather_safe_target(target, valid, vocab)[:, None]  # (M, 1) gather-safe

    softcap_derivative = None
    if scalars.softcap is not None:
        z = fp32_working_copy(logits)  # (M, V) fp32; never aliases logits (the gradient is written there)
        z, softcap_derivative = apply_softcap(z, scalars.softcap, compute_grad)  # z' = c tanh(z / c)
    else:
        z = logits  # z' = z: log_softmax reads the 16-bit logits and computes in fp32
    # The argmax of z' (first index on ties), as the contract defines the predicted token.
    argmax = z.argmax(dim=-1) if (correct_out is not None or predicted_out is not None) else None
    log_p = torch.log_softmax(z, dim=-1, dtype=torch.float32)  # (M, V) fp32, a new tensor
    log_p_y = log_p.gather(1, safe_target).squeeze(1)  # (M,) z'_y - lse
    lse = z.gather(1, safe_target).squeeze(1).float() - log_p_y if needs_lse else None  # (M,) z'_y - log p_y
    del z
    # sum_i w_i log p_i = sum_i w_i (z'_i - lse): with smoothing
    smooth_sum = None if eps == 0 else (log_p @ ce_weight if ce_weight is not None else log_p.sum(dim=-1))
    w_y = ce_weight[safe_target.squeeze(1)] if ce_weight is not None else None
    # Every row's reference point is its lse: log_s = lse - lse = 0 and z'_y - lse = log p_y.
    ce, zl, token_scale = loss_rows(0.0, log_p_y, smooth_sum, lse, w_y, scalars, eps, need_z=z_loss_out is not None)
    store_rows(valid, target, ce, zl, argmax, loss_out, z_loss_out, correct_out, predicted_out)
    if not compute_grad:
        return

    p = log_p.exp_()  # (M, V) softmax, over log p's memory
    del log_p
    scale = row_scale(valid, token_scale, row_grad_scale)  # (M,) 0 on ignored rows
    coef_y = scale * scalars.ce_grad_scale  # (M,) the (p_i - [i == y]) group's factor
    if scalars.label_smoothing:
        coef_y = coef_y * (1.0 - scalars.label_smoothing)
    if w_y is not None:
        coef_y = coef_y * w_y
    multiplier = coef_y  # (M,) of p_i at every column but the target's
    p_y = torch.exp(log_p_y)  # (M,)
    target_grad = coef_y * (p_y - 1.0)  # (M,) the grouped form at the target's column
    if scalars.lse_square_scale > 0:
        coef_z = scale * scalars.z_grad_scale * (2.0 * scalars.lse_square_scale) * lse  # (M,) of p_i
        multiplier = multiplier + coef_z
        target_grad = target_grad + coef_z * p_y
    smoothing = None
    if eps > 0:
        # + coef_eps (W p_i - w_i), each group formed before it is scaled
        coef_eps = (scale * (scalars.ce_grad_scale * eps))[:, None]  # (M, 1)
        w = ce_weight[None, :] if ce_weight is not None else 1.0
        smoothing = torch.mul(p, scalars.weight_sum).sub_(w).mul_(coef_eps)  # (M, V)
        target_grad = target_grad + (scalars.weight_sum * p_y - (w_y if w_y is not None else 1.0)) * coef_eps[:, 0]
    if softcap_derivative is not None:
        target_grad = target_grad * softcap_derivative.gather(1, safe_target).squeeze(1)
    if smoothing is None and softcap_derivative is None:
        grad = torch.mul(p, multiplier[:, None], out=grad_destination)  # written in the gradient's dtype
    else:
        grad = p.mul_(multiplier[:, None])
        if smoothing is not None:
            grad.add_(smoothing)
            del smoothing
        if softcap_derivative is not None:
            grad.mul_(softcap_derivative)
        grad = grad_destination.copy_(grad)
    grad.scatter_(1, safe_target, target_grad[:, None].to(grad.dtype))
    # Rows whose scale is 0 (ignored ones) are exactly 0, even where p is NaN (an ignored
    # row's non-finite logits): selected, not multiplied by 0.
    grad.masked_fill_((scale == 0)[:, None], 0.0)
