"""Chunk CE kernel in Triton: one program per row, two passes over the vocabulary.

Pass 1 streams the row once with an online softmax in fp32 (running max ``m`` and
sum of ``exp2((z' - m) * log2 e)``), plus the smoothing sum and the
argmax only when they are asked for; the target logit is loaded directly. Pass 2
(only for the gradient) re-reads the row, recomputes ``p_i`` and overwrites it with
the gradient in the logits dtype. Ignored rows skip both passes (zeros are written).
Same contract and formulas as ``flce.backends.base``; ``flce.backends.torch.ce`` is
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
from flce.backends.triton.heuristics import CEKernelConfig, ce_kernel_config

# In-place kernel: no fp32 workspace beyond the chunk itself.
EXTRA_BYTES_PER_LOGIT = 0


@triton.jit
def _tanh(x):
    """fp32 tanh (see ``_tanh_and_derivative``; the unused derivative is compiled away)."""
    t, _ = _tanh_and_derivative(x)
    return t


@triton.jit
def _tanh_and_derivative(x):
    """(tanh(x), 1 - tanh(x)^2) in fp32, to about 1.5 ulp, without ``libdevice`` (which
    Triton's interpreter lacks).

    tanh: for |x| >= 0.625, (1 - t) / (1 + t) with t = exp(-2|x|) (no cancellation there,
    since tanh >= 0.55); below, x + x^3 * P(x^2) with P a degree-5 polynomial fitted to
    (tanh(x) - x) / x^3 on [0, 0.625] by relative-error weighted least squares.
    Derivative: 4t / (1 + t)^2 where tanh saturates, since 1 - r*r from a rounded r
    cancels there (relative error ~1e-4 at |x| = 4.7); below 0.625, 1 - r*r (r < 0.56)."""
    ax = tl.abs(x)
    t = tl.exp2(ax * (-2.0 * 1.4426950408889634))
    one_plus_t = 1.0 + t
    big = tl.fdiv(1.0 - t, one_plus_t)
    x2 = x * x
    poly = -0.008184662088751793 + x2 * 0.0021489840000867844
    poly = 0.021703999489545822 + x2 * poly
    poly = -0.05394745245575905 + x2 * poly
    poly = 0.13333211839199066 + x2 * poly
    poly = -0.3333333134651184 + x2 * poly
    small = ax + ax * x2 * poly
    is_small = ax < 0.625
    r = tl.where(is_small, small, big)
    derivative = tl.where(is_small, 1.0 - small * small, tl.fdiv(4.0 * t, one_plus_t * one_plus_t))
    return tl.where(x < 0.0, -r, r), derivative


@triton.jit
def _softcapped(t, softcap):
    """``softcap * t`` rounded on its own, as ``fma(softcap, t, +0)``: a plain product
    may be contracted by the compiler into a different FMA at each use (``z' - m``,
    ``m - z'_y``, the smoothing sum), so that the max, the target logit and the exponents
    would see differently rounded copies of one z' (on a one-class row the loss then
    comes out as a rounding residue instead of exactly 0)."""
    return tl.fma(softcap, t, 0.0)


@triton.jit
def _fp32_to_bf16_rtne(x):
    """Round-to-nearest-even fp32 -> bf16 on the bits (finite inputs). Used only under
    Triton's interpreter, whose fp32 -> bf16 cast truncates; compiled kernels use the
    hardware conversion, which already rounds to nearest even."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + (((bits >> 16) & 1) + 0x7FFF).to(tl.uint32)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _row_statistics(
    row_ptr,  # one row of logits (V,)
    weight_ptr,  # (V,) fp32 class weights of the row's columns (HAS_WEIGHT)
    V,
    softcap,
    inv_softcap,
    HAS_WEIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    SUM_WEIGHTS: tl.constexpr,  # also sum the class weights (a shard's share of W)
    WRITE_ARGMAX: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One streaming pass over a row: ``(m, s, smooth_sum, weight_sum, best_idx)`` with
    ``m = max z'``, ``s = sum exp2((z' - m) log2 e)``, ``smooth_sum = sum w_i z'_i``
    (HAS_SMOOTHING), ``weight_sum = sum w_i`` (SUM_WEIGHTS) and the first index of the max
    (WRITE_ARGMAX); the quantities not asked for stay 0."""
    L2E: tl.constexpr = 1.4426950408889634
    offs0 = tl.arange(0, BLOCK_V)
    m = -float("inf")
    s = 0.0
    smooth_sum = 0.0
    weight_sum = 0.0
    best_idx = 0
    for start in range(0, V, BLOCK_V):
        offs = start + offs0
        mask = offs < V
        z = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            z = _softcapped(_tanh(z * inv_softcap), softcap)
        if HAS_SMOOTHING:
            if HAS_WEIGHT:  # masked lanes: z' = 0 and w = 0
                w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
                smooth_sum += tl.sum(w * z, axis=0)
                if SUM_WEIGHTS:
                    weight_sum += tl.sum(w, axis=0)
            else:
                smooth_sum += tl.sum(z, axis=0)
        z = tl.where(mask, z, -float("inf"))
        block_max = tl.max(z, axis=0)
        if WRITE_ARGMAX:
            block_idx = tl.min(tl.where(z == block_max, offs, 2147483647), axis=0)
            # strict >: an earlier block keeps a tie (first index wins)
            best_idx = tl.where(block_max > m, block_idx, best_idx)
        m_new = tl.maximum(m, block_max)
        s = s * tl.exp2((m - m_new) * L2E) + tl.sum(tl.exp2((z - m_new) * L2E), axis=0)
        m = m_new
    return m, s, smooth_sum, weight_sum, best_idx


@triton.jit
def _write_gradient_row(
    row_ptr,  # one row of logits (V,), read
    out_row_ptr,  # where dL/dlogits of the row goes (V,); row_ptr itself when in place
    weight_ptr,  # (V,) fp32 class weights of the row's columns (HAS_WEIGHT)
    V,
    y,  # the target's column; outside [0, V) when the row holds none
    m,  # the row max of z' (of the whole row, where the row is split)
    inv_s,  # 1 / sum exp(z' - m): p_i = exp(z'_i - m) * inv_s
    onehot_coef,  # row_scale * ce_grad_scale * (1 - ls) * w_y
    smooth_coef,  # row_scale * ce_grad_scale * eps
    z_coef,  # row_scale * z_grad_scale * 2 s lse
    weight_sum,  # W: sum of the class weights (V without weights)
    softcap,
    inv_softcap,
    HAS_WEIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_GRAD: tl.constexpr,
    BF16_ROUND_BY_BITS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """The grouped form of flce.backends.base, each group exact where the true value is
    ~0 (p_y ~ 1, V = 1):
    grad_i = (onehot_coef (p_i - [i == y]) + smooth_coef (W p_i - w_i) + z_coef p_i) dz'_i/dz_i."""
    L2E: tl.constexpr = 1.4426950408889634
    offs0 = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        offs = start + offs0
        mask = offs < V
        z = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            t, softcap_derivative = _tanh_and_derivative(z * inv_softcap)
            z = _softcapped(t, softcap)
        p = tl.exp2((z - m) * L2E) * inv_s
        g = onehot_coef * (p - tl.where(offs == y, 1.0, 0.0))
        if HAS_SMOOTHING:
            if HAS_WEIGHT:
                w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
                g += smooth_coef * (weight_sum * p - w)
            else:
                g += smooth_coef * (weight_sum * p - 1.0)
        if HAS_Z_GRAD:
            g += z_coef * p
        if HAS_SOFTCAP:
            g = g * softcap_derivative
        if BF16_ROUND_BY_BITS:
            g = _fp32_to_bf16_rtne(g)
        tl.store(out_row_ptr + offs, g.to(out_row_ptr.dtype.element_ty), mask=mask)


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
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_Z_GRAD: tl.constexpr,  # lse_square_scale > 0
    USE_TOKEN_SCALING: tl.constexpr,
    HAS_ROW_GRAD_SCALE: tl.constexpr,
    WRITE_ARGMAX: tl.constexpr,
    WRITE_CORRECT: tl.constexpr,
    WRITE_PREDICTED: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    BF16_ROUND_BY_BITS: tl.constexpr,  # interpreter only: see _fp32_to_bf16_rtne
    BLOCK_V: tl.constexpr,
):
    L2E: tl.constexpr = 1.4426950408889634
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
            z_y = _softcapped(_tanh(z_y * inv_softcap), softcap)
        if HAS_WEIGHT:
            w_y = tl.load(weight_ptr + y, mask=y_in_range, other=0.0)
        else:
            w_y = 1.0

        # ---- pass 1: online softmax (max m in z' units, sum of exp2((z' - m) log2 e)) ----
        m, s, smooth_sum, _, best_idx = _row_statistics(
            row_ptr,
            weight_ptr,
            V,
            softcap,
            inv_softcap,
            HAS_WEIGHT,
            HAS_SOFTCAP,
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
            token_scale = tl.exp2((z_y - m) * L2E) / s  # p_y, detached
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
            _write_gradient_row(
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
    if logits.device.type == "cuda":
        with torch.cuda.device(logits.device):
            _ce_chunk_kernel[(num_rows,)](*args, **flags, num_warps=config.num_warps)
    else:
        _ce_chunk_kernel[(num_rows,)](*args, **flags, num_warps=config.num_warps)
