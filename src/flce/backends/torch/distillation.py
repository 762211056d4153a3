"""Chunk kernel of the distillation head in plain PyTorch (fp32 math): runs on any
device, and is the readable twin of the fused kernels (formulas in
``flce.rows.distillation``)."""

from __future__ import annotations

import torch

from flce.rows import distillation as rows

# fp32 temporaries per student logit beyond the two chunks: up to seven (M, V) tensors at
# once (flce.rows.distillation.row_divergence, with its z passed as temporaries).
EXTRA_BYTES_PER_LOGIT = 28


def distillation_chunk(
    student_logits: torch.Tensor,  # (M, V) fp16/bf16/fp32; overwritten with the gradient if compute_grad
    teacher_logits: torch.Tensor,  # (M, V); only read
    target: torch.Tensor | None,  # (M,) int, or None: no row ignored
    *,
    beta: float,
    inv_temperature: float,
    ignore_index: int,
    loss_out: torch.Tensor,  # (M,) fp32
    row_grad_scale: torch.Tensor | None,  # (M,) fp32
    compute_grad: bool,
) -> None:
    rows.check_arguments(student_logits, teacher_logits, target, beta, inv_temperature, loss_out, row_grad_scale)
    if student_logits.shape[0] == 0:
        return
    div = rows.divergence(beta)
    divergence = rows.row_divergence(
        student_logits.to(torch.float32, copy=True).mul_(inv_temperature),  # (M, V) z, never aliasing the logits
        teacher_logits.to(torch.float32, copy=True).mul_(inv_temperature),
        div,
    )
    valid = None if target is None else target != ignore_index  # (M,)
    loss = divergence.loss if valid is None else torch.where(valid, divergence.loss, torch.zeros_like(divergence.loss))
    loss_out.copy_(loss)
    if not compute_grad:
        return
    grad = rows.student_gradient(divergence, div).mul_(inv_temperature)  # (M, V)
    if row_grad_scale is not None:
        grad.mul_(row_grad_scale[:, None])
    if valid is not None:
        grad.masked_fill_(~valid[:, None], 0.0)
    student_logits.copy_(grad)
