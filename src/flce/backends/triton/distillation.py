"""Chunk kernel of the distillation head in Triton: one program per row pair.

Pass 1 streams the student's and the teacher's row once, with an online softmax of each
(running max and sum, fp32; for ``beta > 0`` also the student's argmax, the anchor).
Pass 2 reads both again and sums the row's loss and, for ``beta > 0``, ``K - a``; for
``beta = 0`` it also writes the gradient ``q - p`` over the student's row. Pass 3
(``beta > 0``, with the gradient) reads both once more and writes
``w q_i ((r_i - a) - (K - a))`` over the student's row: K needs the whole row first. The teacher's row is only read.
Ignored rows skip the passes (zeros are written). Formulas and numerics:
``flce.rows.distillation``; ``flce.backends.torch.distillation`` is the readable twin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Shared with the CE kernel: see its docstring (the interpreter's bf16 cast truncates).
from flce.backends.triton.common import LN_2, LOG2_E, aligned_extent, fp32_to_bf16_rtne
from flce.backends.triton.heuristics import CEKernelConfig, ce_kernel_config
from flce.backends.triton.logprobs import launch_per_row, row_softmax_statistics, scaled_logits
from flce.rows import distillation as rows

# In-place kernel: no fp32 workspace beyond the chunks themselves.
EXTRA_BYTES_PER_LOGIT = 0


@triton.jit
def _ratios_to_mixture(log_p, log_q, beta, one_minus_beta):
    """``(log p - log M, log q - log M)`` without forming M: see flce.rows.distillation."""
    c = tl.maximum(log_p, log_q)
    shifted_p = log_p - c  # one of the two is exactly 0
    shifted_q = log_q - c
    mixture = tl.log2(beta * tl.exp2(shifted_p * LOG2_E) + one_minus_beta * tl.exp2(shifted_q * LOG2_E)) * LN_2
    return shifted_p - mixture, shifted_q - mixture


@triton.jit
def _divergence_block(
    student_row_ptr,
    teacher_row_ptr,
    offs,
    mask,
    teacher_sum,
    student_sum,
    inv_temperature,
    m_q,
    log_s_q,
    m_p,
    log_s_p,
    teacher_at_anchor,
    anchor,
    beta,
    one_minus_beta,
    grad_coef,
    centre,
    DIVERGENCE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    WRITE_GRADIENT: tl.constexpr,
    BF16_ROUND_BY_BITS: tl.constexpr,
):
    """``_divergence_pass`` over the columns ``offs`` (where ``mask``): its sums after them."""
    z_q = tl.fma(tl.load(student_row_ptr + offs, mask=mask, other=0.0).to(tl.float32), inv_temperature, 0.0)
    z_p = tl.fma(tl.load(teacher_row_ptr + offs, mask=mask, other=0.0).to(tl.float32), inv_temperature, 0.0)
    z_q = tl.where(mask, z_q, m_q)
    z_p = tl.where(mask, z_p, m_p)
    log_q = (z_q - m_q) - log_s_q
    q = tl.where(mask, tl.exp2(log_q * LOG2_E), 0.0)
    # Each product p * x, q * x is 0 where the probability is (masked lanes; a -inf logit,
    # whose log is -inf: 0 log 0 = 0, not 0 * inf = NaN); a NaN probability stays NaN.
    if DIVERGENCE == 0:
        log_p = (z_p - m_p) - log_s_p
        p = tl.where(mask, tl.exp2(log_p * LOG2_E), 0.0)
        g = q - p
        if ACCUMULATE:
            teacher_sum += tl.sum(tl.where(p == 0.0, 0.0, p * (log_p - log_q)), axis=0)
    else:
        if DIVERGENCE == 1:
            ratio = (z_q - m_q) - (z_p - teacher_at_anchor)  # r - a, straight from the logits
        else:
            log_p = (z_p - m_p) - log_s_p
            ratio_p, ratio_q = _ratios_to_mixture(log_p, log_q, beta, one_minus_beta)
            ratio = ratio_q - anchor  # r - a, exactly 0 at the anchor
            if ACCUMULATE:
                p = tl.where(mask, tl.exp2(log_p * LOG2_E), 0.0)
                teacher_sum += tl.sum(tl.where(p == 0.0, 0.0, p * ratio_p), axis=0)
        if ACCUMULATE:
            student_sum += tl.sum(tl.where(q == 0.0, 0.0, q * ratio), axis=0)
        g = tl.where(q == 0.0, 0.0, q * (ratio - centre))
    if WRITE_GRADIENT:
        g = grad_coef * g
        if BF16_ROUND_BY_BITS:
            g = fp32_to_bf16_rtne(g)
        tl.store(student_row_ptr + offs, g.to(student_row_ptr.dtype.element_ty), mask=mask)
    return teacher_sum, student_sum


@triton.jit
def _divergence_pass(
    student_row_ptr,  # one row (V,) of the student's logits; the gradient goes here (WRITE_GRADIENT)
    teacher_row_ptr,  # one row (V,) of the teacher's logits
    V,
    inv_temperature,
    m_q,  # the student's row max of z, and log of its sum of exp(z - m_q)
    log_s_q,
    m_p,  # the teacher's
    log_s_p,
    teacher_at_anchor,  # z_teacher at the student's argmax (beta > 0)
    anchor,  # a = r at the student's argmax (beta > 0)
    beta,
    one_minus_beta,
    grad_coef,  # row scale / temperature, times w for beta > 0 (WRITE_GRADIENT)
    centre,  # K - a, from the accumulating pass (WRITE_GRADIENT, beta > 0)
    DIVERGENCE: tl.constexpr,  # flce.rows.distillation: FORWARD_KL 0, REVERSE_KL 1, MIXTURE 2
    ACCUMULATE: tl.constexpr,  # sum the loss terms and K - a
    WRITE_GRADIENT: tl.constexpr,
    BF16_ROUND_BY_BITS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One read of both rows: ``(sum p (log p - log M), sum q (r - a))`` (ACCUMULATE),
    and the gradient over the student's row (WRITE_GRADIENT): ``q - p`` for the forward
    KL, ``w q ((r - a) - (K - a))`` otherwise. Masked lanes read a row's own max (their
    exponentials stay <= 1), are left out of the sums and never stored. The loop runs to a
    multiple of 16 columns and takes the rest in one more (``common.aligned_extent``)."""
    offs0 = tl.arange(0, BLOCK_V)
    teacher_sum = 0.0
    student_sum = 0.0
    aligned = aligned_extent(V)
    for part in tl.static_range(2):  # the aligned columns, then the last < 16 (own bound each)
        end = aligned if part == 0 else V
        for start in range(0 if part == 0 else aligned, end, BLOCK_V):
            offs = start + offs0
            teacher_sum, student_sum = _divergence_block(
                student_row_ptr, teacher_row_ptr, offs, offs < end, teacher_sum, student_sum, inv_temperature, m_q,
                log_s_q, m_p, log_s_p, teacher_at_anchor, anchor, beta, one_minus_beta, grad_coef, centre, DIVERGENCE,
                ACCUMULATE, WRITE_GRADIENT, BF16_ROUND_BY_BITS,
            )  # fmt: skip
    return teacher_sum, student_sum


@triton.jit
def _distillation_kernel(
    student_ptr,  # (M, V) fp16/bf16/fp32, unit stride along V; the gradient goes here
    student_row_stride,
    teacher_ptr,  # (M, V) fp16/bf16/fp32, unit stride along V; only read
    teacher_row_stride,
    target_ptr,  # (M,) int32/int64 (HAS_TARGET)
    target_stride,
    loss_ptr,  # (M,) fp32 out
    loss_stride,
    row_grad_scale_ptr,  # (M,) fp32 (HAS_ROW_GRAD_SCALE)
    row_grad_scale_stride,
    V,
    ignore_index,
    inv_temperature,
    beta,
    one_minus_beta,
    student_weight,  # w of the gradient: 1 - beta, or 1 for the reverse KL
    DIVERGENCE: tl.constexpr,  # flce.rows.distillation: FORWARD_KL 0, REVERSE_KL 1, MIXTURE 2
    HAS_TARGET: tl.constexpr,
    HAS_ROW_GRAD_SCALE: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    BF16_ROUND_BY_BITS: tl.constexpr,  # interpreter only: see fp32_to_bf16_rtne
    BLOCK_V: tl.constexpr,
):
    offs0 = tl.arange(0, BLOCK_V)
    row = tl.program_id(0).to(tl.int64)
    student_row_ptr = student_ptr + row * student_row_stride  # 64-bit: M * V may exceed 2^31
    teacher_row_ptr = teacher_ptr + row * teacher_row_stride
    valid = True
    if HAS_TARGET:
        valid = tl.load(target_ptr + row * target_stride).to(tl.int64) != ignore_index
    loss = 0.0
    if valid:
        # ---- pass 1: softmax statistics of both rows; the student's argmax j* (beta > 0) ----
        m_q, s_q, _, anchor_column = row_softmax_statistics(
            student_row_ptr, V, inv_temperature, False, DIVERGENCE != 0, BLOCK_V
        )
        m_p, s_p, _, _ = row_softmax_statistics(teacher_row_ptr, V, inv_temperature, False, False, BLOCK_V)
        log_s_q = tl.log2(s_q) * LN_2
        log_s_p = tl.log2(s_p) * LN_2
        teacher_at_anchor = 0.0
        anchor = 0.0
        if DIVERGENCE != 0:
            teacher_at_anchor = scaled_logits(tl.load(teacher_row_ptr + anchor_column).to(tl.float32), inv_temperature)
            log_q_at_anchor = (m_q - m_q) - log_s_q  # z_student_{j*} = m_q
            log_p_at_anchor = (teacher_at_anchor - m_p) - log_s_p
            if DIVERGENCE == 1:
                anchor = log_q_at_anchor - log_p_at_anchor  # a = r_{j*}
            else:
                _, anchor = _ratios_to_mixture(log_p_at_anchor, log_q_at_anchor, beta, one_minus_beta)

        grad_coef = inv_temperature  # dL/dlogits = dL/dz / temperature
        if HAS_ROW_GRAD_SCALE:
            grad_coef = grad_coef * tl.load(row_grad_scale_ptr + row * row_grad_scale_stride)
        if DIVERGENCE != 0:
            grad_coef = grad_coef * student_weight

        # ---- pass 2: the loss and K - a; the forward KL writes its gradient here ----
        teacher_sum, centre = _divergence_pass(
            student_row_ptr,
            teacher_row_ptr,
            V,
            inv_temperature,
            m_q,
            log_s_q,
            m_p,
            log_s_p,
            teacher_at_anchor,
            anchor,
            beta,
            one_minus_beta,
            grad_coef,
            0.0,
            DIVERGENCE,
            True,
            COMPUTE_GRAD and DIVERGENCE == 0,
            BF16_ROUND_BY_BITS,
            BLOCK_V,
        )
        if DIVERGENCE == 0:
            loss = teacher_sum
        elif DIVERGENCE == 1:
            loss = anchor + centre
        else:
            loss = beta * teacher_sum + one_minus_beta * (anchor + centre)

        # ---- pass 3 (beta > 0): w q_i ((r_i - a) - (K - a)) over the student's row ----
        if COMPUTE_GRAD and DIVERGENCE != 0:
            _divergence_pass(
                student_row_ptr,
                teacher_row_ptr,
                V,
                inv_temperature,
                m_q,
                log_s_q,
                m_p,
                log_s_p,
                teacher_at_anchor,
                anchor,
                beta,
                one_minus_beta,
                grad_coef,
                centre,
                DIVERGENCE,
                False,
                True,
                BF16_ROUND_BY_BITS,
                BLOCK_V,
            )
    else:
        if COMPUTE_GRAD:
            zeros = tl.zeros([BLOCK_V], dtype=student_ptr.dtype.element_ty)
            for start in range(0, V, BLOCK_V):
                offs = start + offs0
                tl.store(student_row_ptr + offs, zeros, mask=offs < V)
    tl.store(loss_ptr + row * loss_stride, loss)


def distillation_chunk(
    student_logits: torch.Tensor,  # (M, V) fp16/bf16/fp32, unit stride along V; the gradient's place
    teacher_logits: torch.Tensor,  # (M, V) fp16/bf16/fp32, unit stride along V; only read
    target: torch.Tensor | None,  # (M,) int32/int64, any stride; None: no row ignored
    *,
    beta: float,
    inv_temperature: float,
    ignore_index: int,
    loss_out: torch.Tensor,  # (M,) fp32, any stride
    row_grad_scale: torch.Tensor | None,  # (M,) fp32, any stride
    compute_grad: bool,
    config: CEKernelConfig | None = None,
) -> None:
    """``flce.rows.distillation.DistillationKernel`` (one launch). ``config`` overrides the
    launch heuristic (the CE kernel's, not tuned for two rows at once); tests use it to
    force several tiles per row."""
    rows.check_arguments(student_logits, teacher_logits, target, beta, inv_temperature, loss_out, row_grad_scale)
    num_rows, vocab = student_logits.shape
    if num_rows == 0:
        return
    div = rows.divergence(beta)
    config = config or ce_kernel_config(vocab, student_logits.dtype, student_logits.device.type)
    target_arg = target if target is not None else loss_out  # stand-ins, never read
    scale_arg = row_grad_scale if row_grad_scale is not None else loss_out
    args = (
        student_logits,
        student_logits.stride(0),
        teacher_logits,
        teacher_logits.stride(0),
        target_arg,
        target_arg.stride(0),
        loss_out,
        loss_out.stride(0),
        scale_arg,
        scale_arg.stride(0),
        vocab,
        int(ignore_index),
        float(inv_temperature),
        div.beta,
        1.0 - div.beta,
        div.student_weight,
    )
    flags = dict(
        DIVERGENCE=div.kind,
        HAS_TARGET=target is not None,
        HAS_ROW_GRAD_SCALE=row_grad_scale is not None,
        COMPUTE_GRAD=bool(compute_grad),
        BF16_ROUND_BY_BITS=student_logits.dtype == torch.bfloat16 and student_logits.device.type == "cpu",
        BLOCK_V=config.block_v,
    )
    launch_per_row(_distillation_kernel, student_logits, config, args, flags)
