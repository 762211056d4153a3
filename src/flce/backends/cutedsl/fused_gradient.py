"""A vocabulary block's gradient from one GEMM (Hopper, CuTe DSL): the fused forward GEMM's
main loop (``fused_forward.FusedForwardKernel``: TMA ring, WGMMA warpgroups, persistent
clusters, the launch shape of ``fused_forward.default_config``) with an epilogue that turns
each logits tile into its gradient and writes that, instead of reducing it to statistics.

The vocabulary-block scheme's second pass (``flce.driver.vocab_blocks``) needs, per block
``[v0, v1)`` of the vocabulary, ``G = dL/dz`` over the block's columns for the dX and dW
GEMMs. Without this kernel it runs a logits GEMM that writes the block's logits in the
compute dtype, then a gradient pass that reads them and writes G over them: one more read
and write of every logit (the pass took 1.07 ms of a 52.6 ms call at N = 8192,
V = 128256 in 16 blocks on an H200) and a launch per block. Here the epilogue computes G
from the fp32 accumulator, in registers, given the whole rows' statistics from the first
pass, and stores it: the logits never reach memory. They are not rounded to the compute
dtype first either, as the first pass's statistics (the fused forward GEMM's, also from
the fp32 accumulator) were not.

Per value of a tile (row ``n``, column ``i`` of the block), as the split-row gradient
kernel (``partial.PartialGradient``, the grouped form of ``flce.rows.cross_entropy``)::

    z' = c tanh(z / c)    (z = the accumulator + bias; z' = z without softcap)
    e  = exp(z' - m_n),  p = e / d_n
    G  = p (coef_y + coef_z)                                   (i != y_n)
    G  = coef_z p + coef_y (p - 1)                             (i == y_n: p - 1 first)
    G += coef_eps (W p - 1)                                    (label smoothing)
    G *= 1 - tanh^2(z / c)                                     (softcap)

and exactly 0 on ignored rows (``y_n < 0``), whatever the logits hold. ``y_n`` is the
target's column in the block, ``V_b`` (no column) where another block holds it. Label
smoothing with class weights (``W p_i - w_i``) is not taken: the fused first pass refuses
it, and this kernel serves only the calls whose first pass it was.

Stores go straight from the accumulator's registers: each thread holds pairs of adjacent
columns of two rows, each pair one 32-bit store (the output's rows start 4-byte aligned:
an even row stride, as the driver's block buffer has). Rows ``>= N`` and columns ``>= V_b``
are never written. Stored one value at a time, the kernel took as long as cuBLAS's logits
GEMM and the gradient pass together (13.03 against 11.98 + 1.07 ms at N = 8192,
V = 128256 in 16 blocks on an H200).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, const_expr

from flce.backends.base import device_guard
from flce.backends.cutedsl.common import (
    LOG2_E,
    arg_f32,
    arg_i32,
    arg_i64,
    compile_cached,
    compile_launcher,
    cuda_stream,
    gmem_ptr,
    gradient_row_tensors,
    null_ptr,
    softcap_tanh,
    softcapped,
)
from flce.backends.cutedsl.fused_forward import (
    WGMMA_DTYPES,
    FusedForwardConfig,
    FusedForwardKernel,
    acc_mn_view,
    clusters_to_launch,
    default_config,
)


@dataclass(frozen=True)
class FusedGradientKey:
    """Everything a compiled kernel bakes in; the row count and the output's row stride
    stay symbolic."""

    dtype: torch.dtype  # of input, weight, bias and the gradient: torch.bfloat16 or torch.float16
    vocab: int  # V_b: the block's columns (the weight's rows)
    hidden: int  # H, a multiple of 64
    target_int64: bool
    has_bias: bool
    has_softcap: bool
    has_smoothing: bool
    has_z_grad: bool


class FusedGradientKernel(FusedForwardKernel):
    """``FusedForwardKernel``'s GEMM with the gradient epilogue (module docstring)."""

    @cute.jit
    def __call__(
        self,
        p_x: cute.Pointer,  # (N, H) fp16/bf16 row-major, 16-byte aligned
        p_w: cute.Pointer,  # (V_b, H) same dtype row-major, 16-byte aligned
        p_target: cute.Pointer,  # (N,) int64/int32: column in the block, >= V_b where absent, < 0 ignored
        p_bias: cute.Pointer,  # (V_b,) same dtype; read only if has_bias
        p_row_max: cute.Pointer,  # (N,) fp32: the reference point m of the whole row
        p_inv_sum: cute.Pointer,  # (N,) fp32: 1 / sum_i exp(z'_i - m) over the whole row
        p_onehot_coef: cute.Pointer,  # (N,) fp32: coef_y
        p_smooth_coef: cute.Pointer,  # (N,) fp32: coef_eps; read only if has_smoothing
        p_z_coef: cute.Pointer,  # (N,) fp32: coef_z; read only if has_z_grad
        p_weight_sum: cute.Pointer,  # (1,) fp32: W; read only if has_smoothing
        p_out: cute.Pointer,  # (N, V_b) same dtype as x, row stride out_stride, 4-byte aligned
        out_stride: Int64,  # elements between rows of out, even
        num_rows: Int32,  # N
        softcap: Float32,  # c (unused without softcap)
        inv_softcap: Float32,  # 1 / c
        max_clusters: Int32,
        stream: cuda.CUstream,
    ):
        rows = cute.make_layout((num_rows,))
        epilogue_tensors = (
            cute.make_tensor(p_target, rows),  # (N,)
            cute.make_tensor(p_bias, cute.make_layout((self.key.vocab,))),  # (V_b,)
            *gradient_row_tensors(rows, p_row_max, p_inv_sum, p_onehot_coef, p_smooth_coef, p_z_coef, p_weight_sum),
            cute.make_tensor(p_out, cute.make_layout((num_rows, self.key.vocab), stride=(out_stride, 1))),  # (N, V_b)
            p_out,  # the same, for the paired stores
            out_stride,
        )
        self._launch(p_x, p_w, epilogue_tensors, num_rows, softcap, inv_softcap, max_clusters, stream)

    @cute.jit
    def _epilogue(
        self,
        acc: cute.Tensor,  # ((2,2,BN/8), MMA_M, MMA_N) fp32 logits of this thread
        tCcC: cute.Tensor,  # same shape: (m, n) tile coordinates of each value
        pid_m: Int32,
        pid_n: Int32,
        epilogue_tensors: tuple,  # __call__'s
        num_rows: Int32,
        softcap: Float32,
        inv_softcap: Float32,
    ):
        mTarget, mBias, mRowMax, mInvSum, mOnehot, mSmooth, mZ, mWeightSum, mOut, p_out, out_stride = epilogue_tensors
        key = self.key
        V = key.vocab
        accs = acc_mn_view(acc)  # (rows of this thread, columns of this thread)
        crds = acc_mn_view(tCcC)
        R = cute.size(accs, mode=[0])
        C = cute.size(accs, mode=[1])
        m0 = pid_m * self.bm
        n0 = pid_n * self.bn
        # A cluster wider than the last tiles adds CTAs past the block: they write nothing.
        tile_ok = pid_n < self.num_tiles_n
        weight_sum = Float32(0.0)
        if const_expr(key.has_smoothing):
            weight_sum = mWeightSum[0]
        if const_expr(key.has_bias):
            self._add_bias(accs, crds, n0, mBias)

        for r in cutlass.range_constexpr(R):
            row = m0 + crds[r, 0][0]
            row_ok = row < num_rows and tile_ok
            # The row's values (none read past the last row): an ignored row until read.
            y_raw = Int64(-1)
            m_log2 = Float32(0.0)
            inv_d = Float32(0.0)
            coef_y = Float32(0.0)
            coef_eps = Float32(0.0)
            coef_z = Float32(0.0)
            if row_ok:
                y_raw = Int64(mTarget[row])
                m_log2 = mRowMax[row] * Float32(LOG2_E)
                inv_d = mInvSum[row]
                coef_y = mOnehot[row]
                if const_expr(key.has_smoothing):
                    coef_eps = mSmooth[row]
                if const_expr(key.has_z_grad):
                    coef_z = mZ[row]
            ignored = y_raw < Int64(0)
            y = Int32(V)  # no column of the block
            if y_raw >= Int64(0) and y_raw < Int64(V):
                y = Int32(y_raw)
            # Every column but the target's: e (coef_y + coef_z) / d, one multiplier per row.
            multiplier = inv_d * (coef_y + coef_z)
            # The row's offset in the output, even (the row stride is): each pair of adjacent
            # columns a thread holds is one 32-bit store.
            row_offset = cute.assume(Int64(row) * out_stride, divby=2)
            pair = cute.make_rmem_tensor((2,), self.dtype)
            for c in cutlass.range_constexpr(C):
                col = n0 + crds[0, c][1]
                z = accs[r, c]
                t = Float32(0.0)
                if const_expr(key.has_softcap):
                    t = softcap_tanh(z * inv_softcap, self.tanh_approx)
                    z = softcapped(t, softcap)
                e = cute.math.exp2(cute.math.fma(z, Float32(LOG2_E), -m_log2), fastmath=True)
                g = e * multiplier
                p = e * inv_d
                # The target's column keeps the grouped form: p - 1 before it is scaled.
                g = Float32(cutlass.select_(col == y, cute.math.fma(coef_z, p, coef_y * (p - Float32(1.0))), g))
                if const_expr(key.has_smoothing):
                    g = cute.math.fma(coef_eps, cute.math.fma(weight_sum, p, Float32(-1.0)), g)
                if const_expr(key.has_softcap):
                    g = g * (Float32(1.0) - t * t)
                # Selected, not scaled by a zero coefficient: an ignored row's logits may be NaN.
                g = Float32(cutlass.select_(ignored, Float32(0.0), g))
                pair[c % 2] = g.to(self.dtype)
                if const_expr(c % 2 == 1):  # columns col - 1 and col: (even, odd)
                    if row_ok:
                        if col < V:
                            offset = cute.assume(row_offset + Int64(col - 1), divby=2)
                            cute.autovec_copy(pair, cute.make_tensor(p_out + offset, cute.make_layout((2,))))
                        elif const_expr(V % 2 == 1):
                            if col == V:  # the last column of an odd V_b: its pair's first half
                                mOut[row, col - 1] = pair[0]


def compile_fused_gradient(key: FusedGradientKey, config: FusedForwardConfig):
    """The compiled kernel for ``key`` and ``config`` (cached; rows are dynamic)."""
    return compile_cached((FusedGradientKernel, key, config), lambda: _build(key, config))


def _build(key: FusedGradientKey, config: FusedForwardConfig):
    dtype = WGMMA_DTYPES[key.dtype]
    target_t = Int64 if key.target_int64 else Int32
    return compile_launcher(
        FusedGradientKernel(key, config),
        null_ptr(dtype, 16),
        null_ptr(dtype, 16),
        null_ptr(target_t, target_t.width // 8),
        null_ptr(dtype, 2),
        null_ptr(Float32, 4),
        null_ptr(Float32, 4),
        null_ptr(Float32, 4),
        null_ptr(Float32, 4),
        null_ptr(Float32, 4),
        null_ptr(Float32, 4),
        null_ptr(dtype, 4),
        Int64(2),
        Int32(1),
        Float32(1.0),
        Float32(1.0),
        Int32(1),
        cuda.CUstream(0),
    )


@lru_cache(maxsize=256)  # a training loop's few signatures: their decisions are host time per call
def _launch_of(key: FusedGradientKey, config: FusedForwardConfig, device_index: int) -> tuple[object, int]:
    config.validate()
    return compile_fused_gradient(key, config), clusters_to_launch(config, torch.device("cuda", device_index))


def fused_block_gradient(
    input: torch.Tensor,  # (C, H) bf16/fp16
    weight: torch.Tensor,  # (V_b, H) same dtype, contiguous, 16-byte aligned (rows of a TMA-ready weight)
    bias: torch.Tensor | None,  # (V_b,) same dtype
    out: torch.Tensor,  # (C, V_b) same dtype, unit stride along V_b: written with the gradient
    grad_target: torch.Tensor,  # (C,) int: column in the block, V_b where absent, -1 on ignored rows
    row_max: torch.Tensor,  # (C,) fp32
    inv_sum: torch.Tensor,  # (C,) fp32
    onehot_coef: torch.Tensor,  # (C,) fp32
    smooth_coef: torch.Tensor | None,  # (C,) fp32, with label smoothing
    z_coef: torch.Tensor | None,  # (C,) fp32, with the z-loss
    weight_sum: torch.Tensor,  # () fp32 on the device
    softcap: float | None,
    *,
    config: FusedForwardConfig | None = None,
) -> None:
    """Writes dL/dz of ``z' = softcap(input @ weight^T + bias)`` into ``out`` (module
    docstring): the backend's ``block_gradient`` slot (``flce.backends.base.BlockGradientGemm``;
    the softcap's tanh the hardware's approximation, as in the fused first pass), for operands
    the driver prepared (``flce.driver.vocab_blocks``; the fused
    forward's applicability held for the whole weight): no argument checks but what the
    kernel cannot do without (a row-major 16-byte aligned ``input``; it is copied
    otherwise, as the fused forward's is)."""
    num_rows, hidden = input.shape
    if num_rows == 0:
        return
    if out.stride(-1) != 1 or (num_rows > 1 and out.stride(0) % 2) or out.data_ptr() % 4:
        raise ValueError(
            "fused_block_gradient: out must have unit stride along the block, an even row stride and a "
            f"4-byte aligned start (the driver's block buffer has), got strides {tuple(out.stride())}"
        )
    if not input.is_contiguous() or input.data_ptr() % 16:
        input = input.clone(memory_format=torch.contiguous_format)  # TMA needs it; small next to the block
    key = FusedGradientKey(
        dtype=input.dtype,
        vocab=weight.shape[0],
        hidden=hidden,
        target_int64=grad_target.dtype == torch.int64,
        has_bias=bias is not None,
        has_softcap=softcap is not None,
        has_smoothing=smooth_coef is not None,
        has_z_grad=z_coef is not None,
    )
    dev = input.device
    device_index = dev.index if dev.index is not None else torch.cuda.current_device()
    config = default_config(device_index) if config is None else config
    launch, max_clusters = _launch_of(key, config, device_index)
    dtype = WGMMA_DTYPES[input.dtype]
    c = float(softcap) if softcap is not None else 1.0
    target_t = Int64 if key.target_int64 else Int32
    with device_guard(dev):
        launch(
            gmem_ptr(input, dtype, 16),
            gmem_ptr(weight, dtype, 16),
            gmem_ptr(grad_target.contiguous(), target_t, grad_target.element_size()),
            gmem_ptr(bias, dtype, 2),
            gmem_ptr(row_max.contiguous(), Float32, 4),
            gmem_ptr(inv_sum.contiguous(), Float32, 4),
            gmem_ptr(onehot_coef.contiguous(), Float32, 4),
            gmem_ptr(None if smooth_coef is None else smooth_coef.contiguous(), Float32, 4),
            gmem_ptr(None if z_coef is None else z_coef.contiguous(), Float32, 4),
            gmem_ptr(weight_sum.reshape(1), Float32, 4),
            gmem_ptr(out, dtype, 4),
            arg_i64(out.stride(0)),
            arg_i32(num_rows),
            arg_f32(c),
            arg_f32(1.0 / c),
            arg_i32(max_clusters),
            cuda_stream(dev),
        )
