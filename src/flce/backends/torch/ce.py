"""Chunk CE kernel in plain PyTorch (fp32 math): runs on any device, and is the
readable twin of the fused kernels (the formulas of ``flce.rows.cross_entropy``)."""

from __future__ import annotations

import torch

from flce.backends.base import gradient_destination
from flce.rows.cross_entropy import (
    ChunkScalars,
    apply_softcap,
    fp32_working_copy,
    gather_safe_target,
    gradient_from_softmax,
    loss_rows,
    row_scale,
    store_rows,
)

# fp32 temporaries this kernel holds per logit beyond the chunk itself, at most three
# (M, V) fp32 tensors at once: the softcap derivative, p, and the gradient before it is
# cast back (z' is freed once p exists).
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

    valid = target != scalars.ignore_index  # (M,)
    safe_target = gather_safe_target(target, valid, vocab)  # (M,) gather-safe

    z = fp32_working_copy(logits)  # (M, V) fp32; never aliases logits (the gradient is written there)
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
    ce, zl, token_scale = loss_rows(
        log_s, shifted_target, shifted_smooth_sum, lse, w_y, scalars, eps, need_z=z_loss_out is not None
    )
    store_rows(valid, target, ce, zl, argmax, loss_out, z_loss_out, correct_out, predicted_out)
    if not compute_grad:
        return

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
            row_scale(valid, token_scale, row_grad_scale),
        )
    )
