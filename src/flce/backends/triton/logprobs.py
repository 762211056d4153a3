"""Chunk kernels of the logprobs head in Triton: one program per row.

Forward: one streaming pass over the row with an online softmax in fp32 (running max
``m``, sum ``s`` of ``exp(z - m)`` and, for the entropy, the spread
``u = sum exp(z - m) (m - z)``); the target logit is loaded directly. Backward: one read
of the row and one write of the gradient (over the logits, or into ``grad_out``), with
``p_i = exp(z_i - lse)`` from the forward pass's lse (a float64 one split into two fp32
parts). Ignored rows skip the passes (zeros are written). Formulas and numerics:
``flce.rows.logprobs``; ``flce.backends.torch.logprobs`` is the readable twin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flce.backends.base import gradient_destination

# Shared with the CE kernel: see its docstring (the interpreter's bf16 cast truncates).
from flce.backends.triton.common import LN_2, LOG2_E, aligned_extent, first_argmax_step, fp32_to_bf16_rtne
from flce.backends.triton.heuristics import CEKernelConfig, ce_kernel_config
from flce.backends.triton.launch import launch
from flce.rows import logprobs as rows

# In-place kernels: no fp32 workspace beyond the chunk itself.
EXTRA_BYTES_PER_LOGIT = 0


# Under Triton's interpreter (CPU, tests) every call of one jit function from another
# costs milliseconds, so the helpers here are called once per row, and the per-tile
# work is written inline in each loop.


@triton.jit
def scaled_logits(x, inv_temperature):
    """``z = x * inv_temperature`` rounded on its own (``fma`` with +0), as the loops below
    also form it: a plain product may be contracted into a different FMA at each use
    (``m - z``, ``z - lse``), so that the max, the target logit and the exponents would
    see differently rounded copies of one z."""
    return tl.fma(x, inv_temperature, 0.0)


@triton.jit
def _softmax_statistics_block(
    row_ptr, offs, mask, m, s, u, argmax, inv_temperature, WITH_SPREAD: tl.constexpr, WITH_ARGMAX: tl.constexpr
):
    """``row_softmax_statistics``' state after the columns ``offs`` (where ``mask``)."""
    z = tl.fma(tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32), inv_temperature, 0.0)
    z = tl.where(mask, z, -float("inf"))
    tile_max = tl.max(z, axis=0)
    if WITH_ARGMAX:
        argmax, tile_max = first_argmax_step(z, offs, tile_max, m, argmax)
    m_new = tl.maximum(m, tile_max)
    if WITH_ARGMAX:
        # NaN from the first NaN on (tl.maximum may drop one): first_argmax_step reads it
        m_new = tl.where((m != m) | (tile_max != tile_max), float("nan"), m_new)
    # Relative to 0 while every logit so far is -inf (a masked prefix): m - m_new is NaN then.
    reference = tl.where(m_new == -float("inf"), 0.0, m_new)
    rescale = tl.exp2((m - reference) * LOG2_E)  # 0 on the first tile (m = -inf)
    e = tl.exp2((z - reference) * LOG2_E)  # (BLOCK_V,) 0 on masked lanes and -inf logits
    if WITH_SPREAD:
        # (BLOCK_V,) >= 0; 0 where e is (a -inf logit: 0 * inf would be NaN)
        d = tl.where(e > 0.0, m_new - z, 0.0)
        # the running u re-based on m_new: each d grows by m_new - m (s = 0 while m = -inf)
        u = rescale * (u + tl.where(s > 0.0, m_new - m, 0.0) * s) + tl.sum(e * d, axis=0)
    s = s * rescale + tl.sum(e, axis=0)
    return m_new, s, u, argmax


@triton.jit
def row_softmax_statistics(
    row_ptr,  # one row of logits (V,)
    V,
    inv_temperature,
    WITH_SPREAD: tl.constexpr,
    WITH_ARGMAX: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One streaming pass over a row of ``z = logits * inv_temperature`` (fp32):
    ``(m, s, u, argmax)`` with the running max ``m``, ``s = sum exp(z - m)``, the spread
    ``u = sum exp(z - m) (m - z)`` (WITH_SPREAD; else 0) and the first index of the max
    (WITH_ARGMAX; else 0). Tiles combine as in ``flce.rows.logprobs``. The loop runs to a
    multiple of 16 columns and takes the rest in one more (``common.aligned_extent``)."""
    offs0 = tl.arange(0, BLOCK_V)
    m = -float("inf")
    s = 0.0
    u = 0.0
    argmax = 0
    aligned = aligned_extent(V)
    for part in tl.static_range(2):  # the aligned columns, then the last < 16 (own bound each)
        end = aligned if part == 0 else V
        for start in range(0 if part == 0 else aligned, end, BLOCK_V):
            offs = start + offs0
            m, s, u, argmax = _softmax_statistics_block(
                row_ptr, offs, offs < end, m, s, u, argmax, inv_temperature, WITH_SPREAD, WITH_ARGMAX
            )
    return m, s, u, argmax


@triton.jit
def _logprobs_forward_kernel(
    logits_ptr,  # (M, V) fp16/bf16/fp32, unit stride along V
    logits_row_stride,
    target_ptr,  # (M,) int32/int64
    target_stride,
    logprob_ptr,  # (M,) fp32 out
    logprob_stride,
    entropy_ptr,  # (M,) fp32 out (WRITE_ENTROPY)
    entropy_stride,
    lse_ptr,  # (M,) float64 or float32 out
    lse_stride,
    predicted_ptr,  # (M,) int64 out (WRITE_PREDICTED): first argmax of z, -1 on ignored rows
    predicted_stride,
    V,
    ignore_index,
    inv_temperature,
    WRITE_ENTROPY: tl.constexpr,
    WRITE_PREDICTED: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride  # 64-bit: M * V may exceed 2^31
    y = tl.load(target_ptr + row * target_stride).to(tl.int64)
    if y != ignore_index:
        # Out-of-range targets are the caller's error (the driver checks them); the mask
        # only keeps a bad one from reading outside the row.
        z_y = scaled_logits(tl.load(row_ptr + y, mask=(y >= 0) & (y < V), other=0.0).to(tl.float32), inv_temperature)
        m, s, u, argmax = row_softmax_statistics(row_ptr, V, inv_temperature, WRITE_ENTROPY, WRITE_PREDICTED, BLOCK_V)
        log_s = tl.log2(s) * LN_2  # >= 0
        tl.store(logprob_ptr + row * logprob_stride, -((m - z_y) + log_s))  # -(d_y + log s), terms >= 0
        # m + log s in float64, rounded once to lse's dtype (see flce.rows.logprobs)
        lse = m.to(tl.float64) + log_s.to(tl.float64)
        tl.store(lse_ptr + row * lse_stride, lse.to(lse_ptr.dtype.element_ty))
        if WRITE_ENTROPY:
            tl.store(entropy_ptr + row * entropy_stride, log_s + u / s)  # both terms >= 0
        if WRITE_PREDICTED:
            tl.store(predicted_ptr + row * predicted_stride, argmax.to(tl.int64))
    else:
        tl.store(logprob_ptr + row * logprob_stride, 0.0)
        tl.store(lse_ptr + row * lse_stride, 0.0)  # cast to lse's dtype by the store
        if WRITE_ENTROPY:
            tl.store(entropy_ptr + row * entropy_stride, 0.0)
        if WRITE_PREDICTED:
            tl.store(predicted_ptr + row * predicted_stride, -1)


@triton.jit
def _logprobs_gradient_block(
    row_ptr,
    grad_row_ptr,
    offs,
    mask,
    y,
    lse_hi,
    lse_lo,
    inv_temperature,
    coef_logprob,
    coef_entropy,
    entropy,
    HAS_GRAD_LOGPROB: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    BF16_ROUND_BY_BITS: tl.constexpr,
):
    """The logprobs' and entropy's gradient over the columns ``offs`` (where ``mask``)."""
    z = tl.fma(tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32), inv_temperature, 0.0)
    log_p = tl.where(mask, (z - lse_hi) - lse_lo, 0.0)  # masked lanes: p = 1, finite, never stored
    p = tl.exp2(log_p * LOG2_E)
    g = tl.zeros_like(p)
    if HAS_GRAD_LOGPROB:
        g = coef_logprob * (tl.where(offs == y, 1.0, 0.0) - p)  # one group: exact where p_y ~ 1
    if HAS_GRAD_ENTROPY:
        g -= coef_entropy * tl.where(p > 0.0, p * (log_p + entropy), 0.0)  # 0 * -inf: NaN
    if BF16_ROUND_BY_BITS:
        g = fp32_to_bf16_rtne(g)
    tl.store(grad_row_ptr + offs, g.to(grad_row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _logprobs_backward_kernel(
    logits_ptr,  # (M, V) fp16/bf16/fp32, unit stride along V
    logits_row_stride,
    grad_ptr,  # (M, V) same dtype, unit stride along V (logits_ptr when in place)
    grad_row_stride,
    target_ptr,  # (M,) int32/int64
    target_stride,
    lse_ptr,  # (M,) float64 or float32
    lse_stride,
    entropy_ptr,  # (M,) fp32 (HAS_GRAD_ENTROPY)
    entropy_stride,
    grad_logprob_ptr,  # (M,) fp32 (HAS_GRAD_LOGPROB)
    grad_logprob_stride,
    grad_entropy_ptr,  # (M,) fp32 (HAS_GRAD_ENTROPY)
    grad_entropy_stride,
    V,
    ignore_index,
    inv_temperature,
    HAS_GRAD_LOGPROB: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    BF16_ROUND_BY_BITS: tl.constexpr,  # interpreter only: see fp32_to_bf16_rtne
    BLOCK_V: tl.constexpr,
):
    offs0 = tl.arange(0, BLOCK_V)
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    grad_row_ptr = grad_ptr + row * grad_row_stride
    y = tl.load(target_ptr + row * target_stride).to(tl.int64)
    if y != ignore_index:
        # lse = hi + lo in fp32 (lo = 0 for a float32 lse): see flce.rows.logprobs
        lse = tl.load(lse_ptr + row * lse_stride).to(tl.float64)
        lse_hi = lse.to(tl.float32)
        lse_lo = (lse - lse_hi.to(tl.float64)).to(tl.float32)
        # dL/dlogits = dL/dz / temperature, folded into the row's coefficients
        coef_logprob = 0.0
        if HAS_GRAD_LOGPROB:
            coef_logprob = tl.load(grad_logprob_ptr + row * grad_logprob_stride) * inv_temperature
        coef_entropy = 0.0
        entropy = 0.0
        if HAS_GRAD_ENTROPY:
            coef_entropy = tl.load(grad_entropy_ptr + row * grad_entropy_stride) * inv_temperature
            entropy = tl.load(entropy_ptr + row * entropy_stride)
        aligned = aligned_extent(V)
        for part in tl.static_range(2):  # the aligned columns, then the last < 16 (own bound each)
            end = aligned if part == 0 else V
            for start in range(0 if part == 0 else aligned, end, BLOCK_V):
                offs = start + offs0
                _logprobs_gradient_block(
                    row_ptr, grad_row_ptr, offs, offs < end, y, lse_hi, lse_lo, inv_temperature, coef_logprob,
                    coef_entropy, entropy, HAS_GRAD_LOGPROB, HAS_GRAD_ENTROPY, BF16_ROUND_BY_BITS,
                )  # fmt: skip
    else:
        zeros = tl.zeros([BLOCK_V], dtype=grad_ptr.dtype.element_ty)
        for start in range(0, V, BLOCK_V):
            offs = start + offs0
            tl.store(grad_row_ptr + offs, zeros, mask=offs < V)


def launch_per_row(kernel, logits: torch.Tensor, config: CEKernelConfig, args, flags) -> None:
    """One program per row of ``logits`` (M, V), on the logits' device."""
    launch(kernel, (logits.shape[0],), args, flags, num_warps=config.num_warps, device=logits.device)


def logprobs_forward_chunk(
    logits: torch.Tensor,  # (M, V) fp16/bf16/fp32, unit stride along V; only read
    target: torch.Tensor,  # (M,) int32/int64, any stride
    *,
    inv_temperature: float,
    ignore_index: int,
    logprob_out: torch.Tensor,  # (M,) fp32, any stride
    entropy_out: torch.Tensor | None,  # (M,) fp32, any stride
    lse_out: torch.Tensor,  # (M,) float64 (or float32), any stride
    predicted_out: torch.Tensor | None = None,  # (M,) int64, any stride
    config: CEKernelConfig | None = None,
) -> None:
    """``flce.rows.logprobs.LogprobsForwardKernel`` (one launch). ``config`` overrides
    the launch heuristic (the CE kernel's: same streaming loop); tests use it to force
    several tiles per row."""
    rows.check_forward_arguments(logits, target, inv_temperature, logprob_out, entropy_out, lse_out, predicted_out)
    num_rows, vocab = logits.shape
    if num_rows == 0:
        return
    config = config or ce_kernel_config(vocab, logits.dtype, logits.device.type)
    entropy = entropy_out if entropy_out is not None else logprob_out  # stand-in, never written
    predicted = predicted_out if predicted_out is not None else target  # stand-in, never written
    args = (
        logits,
        logits.stride(0),
        target,
        target.stride(0),
        logprob_out,
        logprob_out.stride(0),
        entropy,
        entropy.stride(0),
        lse_out,
        lse_out.stride(0),
        predicted,
        predicted.stride(0),
        vocab,
        int(ignore_index),
        float(inv_temperature),
    )
    flags = dict(
        WRITE_ENTROPY=entropy_out is not None, WRITE_PREDICTED=predicted_out is not None, BLOCK_V=config.block_v
    )
    launch_per_row(_logprobs_forward_kernel, logits, config, args, flags)


def logprobs_backward_chunk(
    logits: torch.Tensor,  # (M, V) fp16/bf16/fp32, unit stride along V; the gradient's place unless grad_out
    target: torch.Tensor,  # (M,) int32/int64, any stride
    lse: torch.Tensor,  # (M,) float64 or float32, any stride
    entropy: torch.Tensor | None,  # (M,) fp32, any stride
    grad_logprob: torch.Tensor | None,  # (M,) fp32, any stride
    grad_entropy: torch.Tensor | None,  # (M,) fp32, any stride
    *,
    inv_temperature: float,
    ignore_index: int,
    grad_out: torch.Tensor | None = None,  # (M, V) logits dtype, unit stride along V
    config: CEKernelConfig | None = None,
) -> None:
    """``flce.rows.logprobs.LogprobsBackwardKernel`` (one launch)."""
    rows.check_backward_arguments(logits, target, lse, entropy, grad_logprob, grad_entropy, inv_temperature)
    num_rows, vocab = logits.shape
    if num_rows == 0:
        return
    grad = gradient_destination(logits, grad_out, True)
    config = config or ce_kernel_config(vocab, logits.dtype, logits.device.type)

    def row_vector(vector):  # absent ones stand in as lse, never read
        vector = lse if vector is None else vector
        return vector, vector.stride(0)

    args = (
        logits,
        logits.stride(0),
        grad,
        grad.stride(0),
        target,
        target.stride(0),
        lse,
        lse.stride(0),
        *row_vector(entropy),
        *row_vector(grad_logprob),
        *row_vector(grad_entropy),
        vocab,
        int(ignore_index),
        float(inv_temperature),
    )
    flags = dict(
        HAS_GRAD_LOGPROB=grad_logprob is not None,
        HAS_GRAD_ENTROPY=grad_entropy is not None,
        BF16_ROUND_BY_BITS=logits.dtype == torch.bfloat16 and logits.device.type == "cpu",
        BLOCK_V=config.block_v,
    )
    launch_per_row(_logprobs_backward_kernel, logits, config, args, flags)
