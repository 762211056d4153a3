"""Chunk CE kernel in Triton: one program per row, two passes over the vocabulary.

Pass 1 streams the row once with an online softmax in fp32 (running max ``m`` and
sum of ``exp2((z' - m) * log2 e)``), plus the smoothing sum and the
argmax only when they are asked for; the target logit is loaded directly. Pass 2
(only for the gradient) re-reads the row, recomputes ``p_i`` and overwrites it with
the gradient in the logits dtype. Ignored rows skip both passes (zeros are written).
Same contract as ``flce.backends.base``, formulas of ``flce.rows.cross_entropy``; ``flce.backends.torch.ce`` is
the readable twin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flce.backends.base import (
    ChunkScalars,
    check_logits_layout,
    check_row_outputs,
    gradient_destination,
    kernel_class_weights,
    kernel_row_vector,
    kernel_target,
)
from flce.backends.triton.common import LOG2_E, row_statistics, softcap_tanh, softcapped, write_gradient_row
from flce.backends.triton.heuristics import CEKernelConfig, ce_kernel_config
from flce.backends.triton.launch import launch

# In-place kernel: no fp32 workspace beyond the chunk itself.
EXTRA_BYTES_PER_LOGIT = 0


@triton.jit
def _ce_chunk_kernel(
    logits_ptr,  # (M, V) fp16/bf16/fp32, unit stride along V
    logits_row_stride,  # elements between rows (>= V)
    grad_ptr,  # (M, V) same dtype, unit stride along V: the gradient (logits_ptr when in place)
    grad_row_stride,
    target_ptr,  # (M,) int32/int64, contiguous
    weight_ptr,  # (V,) fp32 class weights, contiguous (read only if HAS_WEIGHT)
    loss_ptr,  # (M,) fp32 out: st * ce
    z_loss_ptr,  # (M,) fp32 out: st * zl (written only if HAS_Z_LOSS)
    correct_ptr,  # (M,) fp32 out (written only if WRITE_CORRECT)
    predicted_ptr,  # (M,) int64 out (written only if WRITE_PREDICTED)
    row_grad_scale_ptr,  # (M,) fp32 (read only if HAS_ROW_GRAD_SCALE)
    V,  # vocabulary size
    ignore_index,
    one_minus_ls,  # 1 - label_smoothing
    eps,  # label_smoothing / V
    scales_ptr,  # (3,) fp32: ce_grad_scale, z_grad_scale, weight_sum (read from memory: no host sync)
    lse_square_scale,
    softcap,  # c (read only if HAS_SOFTCAP)
    inv_softcap,  # 1 / c
    HAS_WEIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    TANH_APPROX: tl.constexpr,  # softcap_tanh_is_approximate
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_Z_GRAD: tl.constexpr,  # lse_square_scale > 0
    USE_TOKEN_SCALING: tl.constexpr,
    HAS_ROW_GRAD_SCALE: tl.constexpr,
    WRITE_ARGMAX: tl.constexpr,
    WRITE_CORRECT: tl.constexpr,
    WRITE_PREDICTED: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    BF16_ROUND_BY_BITS: tl.constexpr,  # interpreter only: see fp32_to_bf16_rtne
    BLOCK_V: tl.constexpr,
):
    offs0 = tl.arange(0, BLOCK_V)
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride  # 64-bit: M * V may exceed 2^31
    grad_row_ptr = grad_ptr + row * grad_row_stride

    y = tl.load(target_ptr + row).to(tl.int64)
    valid = y != ignore_index
    weight_sum = tl.load(scales_ptr + 2)  # W: sum of the class weights (V without weights)

    if valid:
        # Out-of-range targets are the caller's error (the driver checks them); the mask
        # only keeps a bad one from reading outside the row.
        y_in_range = (y >= 0) & (y < V)
        z_y = tl.load(row_ptr + y, mask=y_in_range, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            z_y = softcapped(softcap_tanh(z_y * inv_softcap, TANH_APPROX), softcap)
        if HAS_WEIGHT:
            w_y = tl.load(weight_ptr + y, mask=y_in_range, other=0.0)
        else:
            w_y = 1.0

        # ---- pass 1: online softmax (max m in z' units, sum of exp2((z' - m) log2 e)) ----
        m, s, smooth_sum, _, best_idx = row_statistics(
            row_ptr,
            weight_ptr,
            V,
            softcap,
            inv_softcap,
            HAS_WEIGHT,
            HAS_SOFTCAP,
            TANH_APPROX,
            HAS_SMOOTHING,
            False,
            WRITE_ARGMAX,
            BLOCK_V,
        )

        # Differences to the row max are taken before scaling by log2(e): z' - m is exact
        # for the terms that matter, where exp2(z' * log2e - m * log2e) would add the
        # rounding of two products of large values to every exponent (fp32 losses then
        # drift several times further from float64 than PyTorch's).
        log_s = tl.log2(s) * 0.6931471805599453
        lse = m + log_s
        ce = one_minus_ls * w_y * ((m - z_y) + log_s)
        if HAS_SMOOTHING:
            # W * lse rounded on its own (fma with +0): contracted with the subtraction, it
            # would not cancel against the equally rounded sum on a one-class row.
            ce += eps * (tl.fma(weight_sum, lse, 0.0) - smooth_sum)
        zl = lse_square_scale * lse * lse
        if USE_TOKEN_SCALING:
            token_scale = tl.exp2((z_y - m) * LOG2_E) / s  # p_y, detached
            ce = ce * token_scale
            zl = zl * token_scale
        tl.store(loss_ptr + row, ce)
        if HAS_Z_LOSS:
            tl.store(z_loss_ptr + row, zl)
        if WRITE_CORRECT:
            tl.store(correct_ptr + row, (best_idx == y).to(tl.float32))
        if WRITE_PREDICTED:
            tl.store(predicted_ptr + row, best_idx.to(tl.int64))

        # ---- pass 2: gradient, written over the logits ----
        if COMPUTE_GRAD:
            row_scale = 1.0
            if USE_TOKEN_SCALING:
                row_scale = token_scale
            if HAS_ROW_GRAD_SCALE:
                row_scale = row_scale * tl.load(row_grad_scale_ptr + row)
            inv_s = 1.0 / s  # p_i = e_i / s
            ce_grad_scale = tl.load(scales_ptr)
            z_grad_scale = tl.load(scales_ptr + 1)
            onehot_coef = row_scale * ce_grad_scale * one_minus_ls * w_y
            smooth_coef = row_scale * ce_grad_scale * eps
            z_coef = row_scale * z_grad_scale * 2.0 * lse_square_scale * lse
            write_gradient_row(
                row_ptr,
                grad_row_ptr,
                weight_ptr,
                V,
                y,
                m,
                inv_s,
                onehot_coef,
                smooth_coef,
                z_coef,
                weight_sum,
                softcap,
                inv_softcap,
                HAS_WEIGHT,
                HAS_SOFTCAP,
                TANH_APPROX,
                HAS_SMOOTHING,
                HAS_Z_GRAD,
                BF16_ROUND_BY_BITS,
                BLOCK_V,
            )
    else:
        tl.store(loss_ptr + row, 0.0)
        if HAS_Z_LOSS:
            tl.store(z_loss_ptr + row, 0.0)
        if WRITE_CORRECT:
            tl.store(correct_ptr + row, 0.0)
        if WRITE_PREDICTED:
            tl.store(predicted_ptr + row, -1)
        if COMPUTE_GRAD:
            zeros = tl.zeros([BLOCK_V], dtype=grad_ptr.dtype.element_ty)
            for start in range(0, V, BLOCK_V):
                offs = start + offs0
                tl.store(grad_row_ptr + offs, zeros, mask=offs < V)


def cross_entropy_chunk(
    logits: torch.Tensor,  # (M, V) fp16/bf16/fp32, unit stride along V; the gradient's place unless grad_out
    target: torch.Tensor,  # (M,) integer, any strides (copied to contiguous int32/int64)
    ce_weight: torch.Tensor | None,  # (V,) float, any strides (copied to contiguous fp32)
    scalars: ChunkScalars,
    *,
    loss_out: torch.Tensor,  # (M,) fp32
    z_loss_out: torch.Tensor | None,  # (M,) fp32
    correct_out: torch.Tensor | None,  # (M,) fp32
    predicted_out: torch.Tensor | None,  # (M,) int64
    row_grad_scale: torch.Tensor | None,  # (M,) fp32
    compute_grad: bool,
    grad_out: torch.Tensor | None = None,  # (M, V) logits dtype: the gradient goes here, logits are only read
    config: CEKernelConfig | None = None,
) -> None:
    """The chunk CE kernel of ``flce.backends.base.ChunkCEKernel`` (one launch).

    ``config`` overrides the launch heuristic (``heuristics.ce_kernel_config``); tests
    use it to force several blocks per row.
    """
    num_rows, vocab = logits.shape
    if num_rows == 0:
        return
    check_logits_layout(logits)
    grad = gradient_destination(logits, grad_out, compute_grad)
    check_row_outputs(
        num_rows, loss_out=loss_out, z_loss_out=z_loss_out, correct_out=correct_out, predicted_out=predicted_out
    )
    # The kernel reads these at ptr + row (ptr + class): strided or expanded ones are copied.
    target = kernel_target(target)
    ce_weight = kernel_class_weights(ce_weight)
    row_grad_scale = kernel_row_vector("row_grad_scale", row_grad_scale, num_rows)
    if config is None:
        config = ce_kernel_config(vocab, logits.dtype, logits.device.type)
    ls = float(scalars.label_smoothing)
    softcap = scalars.softcap
    dummy = loss_out  # stands in for absent optional tensors; never dereferenced
    args = (
        logits,
        logits.stride(0),
        grad,
        grad.stride(0),
        target,
        ce_weight if ce_weight is not None else dummy,
        loss_out,
        z_loss_out if z_loss_out is not None else dummy,
        correct_out if correct_out is not None else dummy,
        predicted_out if predicted_out is not None else dummy,
        row_grad_scale if row_grad_scale is not None else dummy,
        vocab,
        int(scalars.ignore_index),
        1.0 - ls,
        ls / vocab,
        scalars.scales,
        float(scalars.lse_square_scale),
        float(softcap) if softcap is not None else 1.0,
        1.0 / float(softcap) if softcap is not None else 1.0,
    )
    flags = dict(
        HAS_WEIGHT=ce_weight is not None,
        HAS_SOFTCAP=softcap is not None,
        TANH_APPROX=scalars.approximate_tanh,
        HAS_SMOOTHING=ls > 0.0,
        HAS_Z_LOSS=z_loss_out is not None,
        HAS_Z_GRAD=float(scalars.lse_square_scale) > 0.0,
        USE_TOKEN_SCALING=bool(scalars.use_token_scaling),
        HAS_ROW_GRAD_SCALE=row_grad_scale is not None,
        WRITE_ARGMAX=correct_out is not None or predicted_out is not None,
        WRITE_CORRECT=correct_out is not None,
        WRITE_PREDICTED=predicted_out is not None,
        COMPUTE_GRAD=bool(compute_grad),
        BF16_ROUND_BY_BITS=logits.dtype == torch.bfloat16 and logits.device.type == "cpu",
        BLOCK_V=config.block_v,
    )
    launch(_ce_chunk_kernel, (num_rows,), args, flags, num_warps=config.num_warps, device=logits.device)
