"""Triton kernels for a row split over several shards of the vocabulary (vocab-parallel).

Each rank holds the columns ``[v0, v0 + V_r)`` of every row. ``partial_statistics`` reads
a chunk once and gives, per row, the local max of ``z'`` and the statistics relative to it
(sum of exp, the target logit when this shard owns the target, the class-weighted sum for
label smoothing, the first local argmax); the caller combines them across ranks into the
global row max ``M`` and sum ``S``. ``partial_gradient`` then reads the chunk again and
writes the gradient in place, with the global softmax ``p_i = exp(z'_i - M) / S`` and the
grouped form of ``flce.rows.cross_entropy``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flce.backends.base import (
    check_logits_layout,
    gradient_destination,
    kernel_class_weights,
    kernel_row_vector,
    kernel_target,
)
from flce.backends.triton.common import row_statistics, softcap_tanh, softcapped, write_gradient_row
from flce.backends.triton.heuristics import ce_kernel_config
from flce.backends.triton.launch import launch


@triton.jit
def _partial_statistics_kernel(
    logits_ptr,  # (M, V_r) fp16/bf16/fp32, unit stride along V_r
    logits_row_stride,
    target_ptr,  # (M,) int64: local target in [0, V_r) if owned, else outside it
    weight_ptr,  # (V_r,) fp32 local class weights (HAS_WEIGHT)
    max_out,  # (M,) fp32: local max of z'
    sum_out,  # (M,) fp32: sum of exp(z' - local max)
    target_out,  # (M,) fp32: z'_y - local max where owned, else 0
    smooth_out,  # (M,) fp32: sum_i w_i (z'_i - local max) (HAS_SMOOTHING)
    argmax_out,  # (M,) int64: first local argmax (WRITE_ARGMAX)
    V,
    softcap,
    inv_softcap,
    HAS_WEIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    TANH_APPROX: tl.constexpr,  # softcap_tanh_is_approximate
    HAS_SMOOTHING: tl.constexpr,
    WRITE_ARGMAX: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride  # 64-bit: M * V_r may exceed 2^31
    y = tl.load(target_ptr + row)
    owned = (y >= 0) & (y < V)
    z_y = tl.load(row_ptr + y, mask=owned, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        z_y = softcapped(softcap_tanh(z_y * inv_softcap, TANH_APPROX), softcap)

    # smooth_sum = sum_i w_i z'_i is made relative to m below, with this shard's sum of w.
    m, s, smooth_sum, weight_sum, best_idx = row_statistics(
        row_ptr,
        weight_ptr,
        V,
        softcap,
        inv_softcap,
        HAS_WEIGHT,
        HAS_SOFTCAP,
        TANH_APPROX,
        HAS_SMOOTHING,
        True,
        WRITE_ARGMAX,
        BLOCK_V,
    )

    # Shifted values relative to m, or to 0 where the chunk's logits are all -inf
    # (flce.rows.cross_entropy.BlockStatistics: they vanish when rebased to a finite max).
    reference = tl.where(m == -float("inf"), 0.0, m)
    tl.store(max_out + row, m)
    tl.store(sum_out + row, s)
    tl.store(target_out + row, tl.where(owned, z_y - reference, 0.0))
    if HAS_SMOOTHING:
        if not HAS_WEIGHT:
            weight_sum = V * 1.0
        tl.store(smooth_out + row, smooth_sum - reference * weight_sum)
    if WRITE_ARGMAX:
        tl.store(argmax_out + row, best_idx.to(tl.int64))


@triton.jit
def _partial_gradient_kernel(
    logits_ptr,  # (M, V_r) fp16/bf16/fp32; overwritten with dL/dlogits
    logits_row_stride,
    target_ptr,  # (M,) int64: local target if owned, V_r if not, -1 on ignored rows
    weight_ptr,  # (V_r,) fp32 local class weights (HAS_WEIGHT)
    row_max_ptr,  # (M,) fp32: global max of z'
    inv_sum_ptr,  # (M,) fp32: 1 / global sum of exp(z' - max)
    onehot_coef_ptr,  # (M,) fp32: row_scale * ce_grad_scale * (1 - ls) * w_y
    smooth_coef_ptr,  # (M,) fp32: row_scale * ce_grad_scale * eps (HAS_SMOOTHING)
    z_coef_ptr,  # (M,) fp32: row_scale * z_grad_scale * 2 s lse (HAS_Z_GRAD)
    V,
    weight_sum_ptr,  # () fp32: sum of the global class weights (global V without weights)
    softcap,
    inv_softcap,
    HAS_WEIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    TANH_APPROX: tl.constexpr,  # softcap_tanh_is_approximate
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_GRAD: tl.constexpr,
    BF16_ROUND_BY_BITS: tl.constexpr,  # interpreter only (see flce.backends.triton.ce)
    BLOCK_V: tl.constexpr,
):
    offs0 = tl.arange(0, BLOCK_V)
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    y = tl.load(target_ptr + row)
    if y >= 0:
        weight_sum = tl.load(weight_sum_ptr)
        m = tl.load(row_max_ptr + row)
        inv_s = tl.load(inv_sum_ptr + row)
        onehot_coef = tl.load(onehot_coef_ptr + row)
        smooth_coef = 0.0
        if HAS_SMOOTHING:
            smooth_coef = tl.load(smooth_coef_ptr + row)
        z_coef = 0.0
        if HAS_Z_GRAD:
            z_coef = tl.load(z_coef_ptr + row)
        write_gradient_row(
            row_ptr,
            row_ptr,
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
        zeros = tl.zeros([BLOCK_V], dtype=logits_ptr.dtype.element_ty)
        for start in range(0, V, BLOCK_V):
            offs = start + offs0
            tl.store(row_ptr + offs, zeros, mask=offs < V)


def _launch(kernel, logits: torch.Tensor, args: tuple, flags: dict) -> None:
    num_rows, vocab_local = logits.shape
    if num_rows == 0:
        return
    check_logits_layout(logits)
    config = ce_kernel_config(vocab_local, logits.dtype, logits.device.type)
    flags = {**flags, "BLOCK_V": config.block_v}
    launch(kernel, (num_rows,), args, flags, num_warps=config.num_warps, device=logits.device)


def partial_statistics(
    logits: torch.Tensor,  # (M, V_r)
    local_target: torch.Tensor,  # (M,) int64, outside [0, V_r) where not owned
    ce_weight: torch.Tensor | None,  # (V_r,) fp32 local slice
    softcap: float | None,
    with_smoothing: bool,
    with_argmax: bool,
    approximate_tanh: bool = False,  # ChunkScalars.approximate_tanh
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """-> (local max, sum exp(z' - max), z'_y - max or 0, smoothing sum or None, argmax or None)."""
    rows = logits.shape[0]

    def f32():
        return torch.empty(rows, dtype=torch.float32, device=logits.device)

    row_max, row_sum, target_shifted = f32(), f32(), f32()
    smooth = f32() if with_smoothing else None
    argmax = torch.empty(rows, dtype=torch.int64, device=logits.device) if with_argmax else None
    dummy = row_max
    # Read at ptr + row (ptr + class): strided or expanded vectors are copied (tiny).
    local_target = kernel_target(local_target)
    ce_weight = kernel_class_weights(ce_weight)
    args = (
        logits,
        logits.stride(0),
        local_target,
        dummy if ce_weight is None else ce_weight,
        row_max,
        row_sum,
        target_shifted,
        dummy if smooth is None else smooth,
        argmax if with_argmax else dummy,
        logits.shape[1],
        1.0 if softcap is None else float(softcap),
        1.0 if softcap is None else 1.0 / float(softcap),
    )
    flags = dict(
        HAS_WEIGHT=ce_weight is not None,
        HAS_SOFTCAP=softcap is not None,
        TANH_APPROX=approximate_tanh,
        HAS_SMOOTHING=with_smoothing,
        WRITE_ARGMAX=with_argmax,
    )
    _launch(_partial_statistics_kernel, logits, args, flags)
    return row_max, row_sum, target_shifted, smooth, argmax


def partial_gradient(
    logits: torch.Tensor,  # (M, V_r) overwritten with the gradient
    local_target: torch.Tensor,  # (M,) int64: owned index, V_r if not owned, -1 on ignored rows
    ce_weight: torch.Tensor | None,  # (V_r,) fp32 local slice
    row_max: torch.Tensor,  # (M,) fp32 global max
    inv_sum: torch.Tensor,  # (M,) fp32
    onehot_coef: torch.Tensor,  # (M,) fp32
    smooth_coef: torch.Tensor | None,  # (M,) fp32, with label smoothing
    z_coef: torch.Tensor | None,  # (M,) fp32, with z-loss
    weight_sum: torch.Tensor,  # () fp32 on the device
    softcap: float | None,
    approximate_tanh: bool = False,  # ChunkScalars.approximate_tanh
) -> None:
    gradient_destination(logits, None, True)  # written in place: each row needs its own memory
    # Read at ptr + row (ptr + class): strided or expanded vectors are copied (tiny).
    rows = logits.shape[0]
    local_target = kernel_target(local_target)
    ce_weight = kernel_class_weights(ce_weight)
    row_max, inv_sum, onehot_coef, smooth_coef, z_coef = (
        kernel_row_vector(name, vector, rows)
        for name, vector in (
            ("row_max", row_max),
            ("inv_sum", inv_sum),
            ("onehot_coef", onehot_coef),
            ("smooth_coef", smooth_coef),
            ("z_coef", z_coef),
        )
    )
    dummy = row_max
    args = (
        logits,
        logits.stride(0),
        local_target,
        dummy if ce_weight is None else ce_weight,
        row_max,
        inv_sum,
        onehot_coef,
        dummy if smooth_coef is None else smooth_coef,
        dummy if z_coef is None else z_coef,
        logits.shape[1],
        weight_sum,
        1.0 if softcap is None else float(softcap),
        1.0 if softcap is None else 1.0 / float(softcap),
    )
    flags = dict(
        HAS_WEIGHT=ce_weight is not None,
        HAS_SOFTCAP=softcap is not None,
        TANH_APPROX=approximate_tanh,
        HAS_SMOOTHING=smooth_coef is not None,
        HAS_Z_GRAD=z_coef is not None,
        BF16_ROUND_BY_BITS=logits.dtype == torch.bfloat16 and logits.device.type == "cpu",
    )
    _launch(_partial_gradient_kernel, logits, args, flags)
