"""Chunk CE kernel in CuTe DSL (nvidia-cutlass-dsl), written for Hopper (sm_90) and newer.

One CTA, or a thread-block cluster of 2-8 CTAs each owning a contiguous slice, handles
one row of logits. Pass 1 streams the row through a multi-stage ``cp.async``
shared-memory pipeline (128-bit copies where alignment allows) and keeps, per thread,
an fp32 online softmax (running max ``m = max(z')`` and normaliser
``d = sum 2^((z' - m) log2(e))``), the label-smoothing sum and the argmax (in
``torch.argmax``'s order: a NaN above every number, the first column among equals). A CTA
reduction (then, in a cluster, an exchange through distributed shared memory) gives
the row's statistics, from which every thread derives the row scalars of
``flce.rows.cross_entropy`` (loss, z-loss, token scale and the gradient coefficients).
Pass 2, when ``compute_grad``, writes the gradient over the logits.

Bytes: the first ``resident`` tiles of a slice stay in shared memory after pass 1, so
pass 2 re-reads only the rest from global memory, newest tile first, while the L2
cache still holds it. With the default launch shapes, slices fit whole and the logits
are read from global memory exactly once (one read, one write per logit).

Every exp2 argument is ``(z' - m) * log2(e)``: the difference to the row max first, so
it is exactly 0 at the max and exact (Sterbenz) for the logits near it, the ones that
carry the probability. Folding log2(e) into one FMA, ``z' * log2(e) - m * log2(e)``,
saves an instruction but leaves the rounding of ``m * log2(e)`` (about ``|m| * 2^-24``)
in every exponent: ``p_y`` of a confident row then misses 1 by many ulps, and the
gradient ``p_y - 1`` with it, which one instruction per logit does not pay for. The
gradient uses the grouped form of ``flce.rows.cross_entropy``; without label smoothing or
softcap only the target's column needs it, and every other column is its ``exp2`` times
one multiplier per row, ``(coef_y + coef_z) / d``. That matters inside a fused call: right
after a GEMM the GPU sits at its power limit with its SM clock lowered, and there the
kernel is bound by its instructions rather than by memory traffic (one multiply per logit
instead of three: 1.69-1.70 against 1.82-1.87 ms at N = 8192, V = 128256 in bf16,
benchmarks/results/ce-kernel-h200).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, const_expr

from flce.backends.base import (
    ChunkScalars,
    check_logits_layout,
    check_row_outputs,
    device_guard,
    gradient_destination,
    kernel_class_weights,
    kernel_row_vector,
    kernel_target,
)
from flce.backends.cutedsl.common import (
    CLUSTER_SLICE_BYTES,
    CTA_SMEM_BUDGET,
    LN_2,
    LOG2_E,
    ROW_SMEM_BYTES,
    TORCH_TO_CUTE,
    KernelConfig,
    RowStream,
    SmemAllocator,
    arg_f32,
    arg_i32,
    arg_i64,
    argmax_combine,
    cdiv,
    combine_softmax,
    compile_cached,
    compile_launcher,
    cuda_stream,
    gmem_ptr,
    null_ptr,
    pow2_ceil,
    row_threads,
    softcap_tanh,
    softcapped,
    store_to_peer,
)
from flce.backends.cutedsl.layout import row_vector_width


@dataclass(frozen=True)
class KernelKey:
    """Everything a compiled kernel bakes in; the row count stays symbolic."""

    dtype: torch.dtype
    vocab: int
    vec: int  # elements per thread per copy (flce.backends.cutedsl.layout; the last may be ragged)
    target_int64: bool
    has_weight: bool
    has_smoothing: bool
    has_softcap: bool
    approximate_tanh: bool  # the softcap's tanh: ChunkScalars.approximate_tanh
    token_scaling: bool
    write_z_loss: bool
    write_correct: bool
    write_predicted: bool
    has_row_scale: bool
    compute_grad: bool


@cache
def default_config(key: KernelKey) -> KernelConfig:
    """Launch heuristics, from H200 timings at N=8192, V=128256 (benchmarks/cutedsl_ce_launch.py --sweep).

    - 256 threads (8 warps) once a row has >= 256 vectors; short rows get one thread per
      vector (at least a warp).
    - With the gradient, a row that fits in ``ROW_SMEM_BYTES`` stays whole in one CTA's
      shared memory; a longer row is split over a cluster of up to 8 CTAs, with slices
      of about ``CLUSTER_SLICE_BYTES``, each held whole in shared memory between the two
      passes: the logits are then read from global memory exactly once (bf16: 1.11 ms
      with 8 x 32 KiB slices, 1.15 ms with 4 x 64 KiB, 1.37 ms for one CTA per row with
      76 KiB resident and the rest re-read; fp32: 2.21 ms with 8 x 64 KiB, 3.01 ms).
    - The cp.async prefetch distance is ``stages - 1`` tiles. A slice held whole needs no
      ring, so up to 16 stages cost no shared memory; otherwise 8 stages (7 tiles, 28 KiB,
      in flight) and the rest of ``CTA_SMEM_BUDGET`` (two CTAs per SM) resident.
    """
    num_vec = cdiv(key.vocab, key.vec)
    threads = row_threads(num_vec)
    esize = torch.empty((), dtype=key.dtype).element_size()
    tile_bytes = threads * key.vec * esize
    async_copy = key.vec * esize >= 4
    cluster = 1
    if key.compute_grad and async_copy and key.vocab * esize > ROW_SMEM_BYTES:
        while cluster < 8 and key.vocab * esize > cluster * CLUSTER_SLICE_BYTES:
            cluster *= 2
    num_tiles = cdiv(cdiv(num_vec, cluster), threads)
    stages = min(8, pow2_ceil(num_tiles))
    resident = 0
    if key.compute_grad and async_copy:
        if num_tiles * tile_bytes <= ROW_SMEM_BYTES:
            resident = num_tiles  # the whole slice: no ring at all
            stages = 16
        else:
            resident = max(0, min(num_tiles, (CTA_SMEM_BUDGET - 1024) // tile_bytes - stages))
    return KernelConfig(threads=threads, stages=stages, resident=resident, cluster=cluster)


class ChunkCrossEntropy(RowStream):
    """The kernel for one ``KernelKey`` and ``KernelConfig``; rows are dynamic."""

    def __init__(self, key: KernelKey, config: KernelConfig):
        super().__init__(
            key, config, keep_resident=key.compute_grad, need_argmax=key.write_correct or key.write_predicted
        )

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        p_logits: cute.Pointer,  # (M, V) logits dtype, row stride `row_stride`
        p_grad: cute.Pointer,  # (M, V) logits dtype, row stride `grad_row_stride`: the gradient (may be p_logits)
        p_target: cute.Pointer,  # (M,) int64 or int32
        p_weight: cute.Pointer,  # (V,) fp32; read only if has_weight
        p_loss: cute.Pointer,  # (M,) fp32
        p_z_loss: cute.Pointer,  # (M,) fp32; written only if write_z_loss
        p_correct: cute.Pointer,  # (M,) fp32; written only if write_correct
        p_predicted: cute.Pointer,  # (M,) int64; written only if write_predicted
        p_row_scale: cute.Pointer,  # (M,) fp32; read only if has_row_scale
        p_scales: cute.Pointer,  # (3,) fp32: ce_grad_scale, z_grad_scale, weight_sum (no host sync to know them)
        num_rows: Int32,  # M
        row_stride: Int64,  # elements between rows of logits (a multiple of vec)
        grad_row_stride: Int64,  # elements between rows of the gradient (a multiple of vec)
        ignore_index: Int64,
        label_smoothing: Float32,  # ls
        eps: Float32,  # ls / V
        z_scale: Float32,  # lse_square_scale
        softcap: Float32,  # c (unused without softcap)
        inv_softcap: Float32,  # 1 / c
        stream: cuda.CUstream,
    ):
        rows = cute.make_layout((num_rows,))
        mTarget = cute.make_tensor(p_target, rows)  # (M,)
        mLoss = cute.make_tensor(p_loss, rows)  # (M,)
        mZLoss = cute.make_tensor(p_z_loss, rows)  # (M,)
        mCorrect = cute.make_tensor(p_correct, rows)  # (M,)
        mPred = cute.make_tensor(p_predicted, rows)  # (M,)
        mRowScale = cute.make_tensor(p_row_scale, rows)  # (M,)
        mScales = cute.make_tensor(p_scales, cute.make_layout((3,)))  # (3,)
        mWeight = cute.make_tensor(
            p_weight, cute.make_layout((self.vec, self.num_vec), stride=(1, self.vec))
        )  # (vec, ceil(V/vec))
        self.kernel(
            p_logits,
            p_grad,
            mTarget,
            mWeight,
            mLoss,
            mZLoss,
            mCorrect,
            mPred,
            mRowScale,
            mScales,
            row_stride,
            grad_row_stride,
            ignore_index,
            label_smoothing,
            eps,
            z_scale,
            softcap,
            inv_softcap,
        ).launch(
            grid=[num_rows * self.cluster, 1, 1],
            block=[self.threads, 1, 1],
            cluster=[self.cluster, 1, 1] if const_expr(self.cluster > 1) else None,
            smem=self.smem_bytes(),
            stream=stream,
        )

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        p_logits: cute.Pointer,  # (M, V) base of the chunk
        p_grad: cute.Pointer,  # (M, V) base of the gradient (p_logits when in place)
        mTarget: cute.Tensor,  # (M,)
        mWeight: cute.Tensor,  # (vec, ceil(V/vec)) fp32
        mLoss: cute.Tensor,  # (M,)
        mZLoss: cute.Tensor,  # (M,)
        mCorrect: cute.Tensor,  # (M,)
        mPred: cute.Tensor,  # (M,)
        mRowScale: cute.Tensor,  # (M,)
        mScales: cute.Tensor,  # (3,) fp32: ce_grad_scale, z_grad_scale, weight_sum
        row_stride: Int64,
        grad_row_stride: Int64,
        ignore_index: Int64,
        label_smoothing: Float32,
        eps: Float32,
        z_scale: Float32,
        softcap: Float32,
        inv_softcap: Float32,
    ):
        key = self.key
        T = self.threads
        VEC = self.vec
        NV = self.num_vec
        NT = self.num_tiles
        P = self.prefetch
        R = self.resident
        CN = self.cluster
        tid, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        # This CTA's slice of the row: vectors [v0, v_end).
        row = bidx
        rank = Int32(0)
        v0 = 0
        v_end = NV
        if const_expr(CN > 1):
            row = bidx // CN
            rank = bidx % CN
            v0 = rank * self.num_vec_cta
            v_end = v0 + self.num_vec_cta
            if v_end > NV:
                v_end = Int32(NV)

        gRow = self._row_vectors(p_logits, row, row_stride)  # (VEC, NV)
        # Where this row's gradient goes: the same row when in place.
        gGrad = self._row_vectors(p_grad, row, grad_row_stride)  # (VEC, NV)

        smem = SmemAllocator()
        sRed = smem.allocate_tensor(Float32, cute.make_layout((self.num_warps, 5)), byte_alignment=16)  # (warps, 5)
        sArg = smem.allocate_tensor(Int32, cute.make_layout((self.num_warps,)), byte_alignment=16)  # (warps,)
        sClu = smem.allocate_tensor(Float32, cute.make_layout((CN, 5)), byte_alignment=16)  # (cluster, 5)
        sCluArg = smem.allocate_tensor(Int32, cute.make_layout((CN,)), byte_alignment=16)  # (cluster,)
        sBuf, copy_atom = self._stream_smem(smem)

        ce_grad_scale = mScales[0]
        z_grad_scale = mScales[1]
        weight_sum = mScales[2]  # W
        # Row target; ignored rows use class 0 for every gather (their results are zeroed).
        # An out-of-range target (the batch statistics made this call's scales NaN) reads
        # class 0 too, never outside the row.
        y_raw = Int64(mTarget[row])
        valid = y_raw != ignore_index
        ignored = y_raw == ignore_index
        y = Int32(0)
        if valid:
            if y_raw >= Int64(0):
                if y_raw < Int64(key.vocab):
                    y = Int32(y_raw)
        # The target logit, read before any thread of this CTA overwrites the row.
        z_y = Float32(gRow[y % VEC, y // VEC])
        w_y = Float32(1.0)
        if const_expr(key.has_weight):
            w_y = Float32(mWeight[y % VEC, y // VEC])

        if const_expr(CN > 1):
            # First half of a split cluster barrier: its wait (before the first remote
            # shared-memory store) guarantees that every CTA of the cluster is running.
            cute.arch.cluster_arrive_relaxed()

        # ---------------- pass 1: online softmax, smoothing sum, argmax
        m, d, sxs, best_v, best_i = self._pass1(gRow, sBuf, copy_atom, v0, v_end, tid, mWeight, softcap, inv_softcap)

        # ---------------- CTA reduction (every thread ends with the row's statistics)
        m, d, sxs, best_v, best_i = self._reduce_cta(m, d, sxs, best_v, best_i, sRed, sArg, lane, warp)
        if const_expr(CN > 1):
            # Thread p sends this CTA's statistics to slot [rank] of cluster peer p; after
            # the cluster barrier every CTA combines the CN slots in rank order, so all CTAs
            # of the row end with bit-identical statistics.
            cute.arch.cluster_wait()
            if tid < CN:
                peer = tid
                store_to_peer(sClu.iterator + rank, m, peer)  # sClu[rank, 0] of the peer
                store_to_peer(sClu.iterator + (rank + CN), d, peer)  # [rank, 1]
                store_to_peer(sClu.iterator + (rank + 2 * CN), sxs, peer)  # [rank, 2]
                store_to_peer(sClu.iterator + (rank + 3 * CN), best_v, peer)  # [rank, 3]
                store_to_peer(sCluArg.iterator + rank, best_i, peer)  # [rank]
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            m = sClu[0, 0]
            d = sClu[0, 1]
            sxs = sClu[0, 2]
            best_v = sClu[0, 3]
            best_i = sCluArg[0]
            for c in cutlass.range_constexpr(1, CN):
                m, d = combine_softmax(m, d, sClu[c, 0], sClu[c, 1])
                if const_expr(key.has_smoothing):
                    sxs = sxs + sClu[c, 2]
                if const_expr(self.need_argmax):
                    best_v, best_i = argmax_combine(best_v, best_i, sClu[c, 3], sCluArg[c])

        # ---------------- row scalars (same formulas as flce.rows.cross_entropy)
        log_d = cute.math.log2(d) * LN_2
        lse = m + log_d
        zp_y = z_y
        if const_expr(key.has_softcap):
            zp_y = softcapped(softcap_tanh(z_y * inv_softcap, self.tanh_approx), softcap)
        one_m_ls = Float32(1.0) - label_smoothing
        ce = one_m_ls * w_y * ((m - zp_y) + log_d)  # m - z'_y first: exact near the max
        if const_expr(key.has_smoothing):
            ce = ce + eps * (cute.math.fma(weight_sum, lse, Float32(0.0)) - sxs)  # see softcapped
        zl = z_scale * lse * lse
        st = Float32(1.0)
        if const_expr(key.token_scaling):
            st = cute.math.exp2((zp_y - m) * LOG2_E, fastmath=True) / d
        if tid == 0:
            if rank == 0:
                mLoss[row] = st * ce if valid else Float32(0.0)
                if const_expr(key.write_z_loss):
                    mZLoss[row] = st * zl if valid else Float32(0.0)
                if const_expr(key.write_correct):
                    hit = Float32(0.0)
                    if valid:
                        if best_i == y:
                            hit = Float32(1.0)
                    mCorrect[row] = hit
                if const_expr(key.write_predicted):
                    mPred[row] = Int64(best_i) if valid else Int64(-1)

        # ---------------- pass 2: gradient, in place
        if const_expr(key.compute_grad):
            row_scale = st if valid else Float32(0.0)
            if const_expr(key.has_row_scale):
                row_scale = row_scale * mRowScale[row]
            # grad_i = coef_y (p_i - [i == y]) + coef_eps (W p_i - w_i) + coef_z p_i
            inv_d = Float32(1.0) / d
            coef_y = row_scale * ce_grad_scale * one_m_ls * w_y
            coef_eps = row_scale * ce_grad_scale * eps
            coef_z = row_scale * z_grad_scale * Float32(2.0) * z_scale * lse
            coefs = (m, inv_d, coef_y, coef_eps, coef_z, weight_sum)
            if const_expr(self.use_async):
                NS = NT - R  # tiles re-read from global memory, newest first
                if const_expr(NS > 0):
                    for k in cutlass.range_constexpr(P):
                        if const_expr(k < NS):
                            self._issue(copy_atom, gRow, sBuf, v0 + (NT - 1 - k) * T + tid, v_end, R + k, tid)
                        cute.arch.cp_async_commit_group()
                    rd_slot = Int32(R)
                    wr_slot = Int32(R + P)
                    vidx = v0 + (NT - 1) * T + tid
                    for i in cutlass.range(NS, unroll=1):
                        if i + P < NS:
                            self._issue(copy_atom, gRow, sBuf, vidx - P * T, v_end, wr_slot, tid)
                        cute.arch.cp_async_commit_group()
                        cute.arch.cp_async_wait_group(P)
                        if vidx < v_end:
                            frag = cute.make_rmem_tensor((VEC,), self.dtype)
                            cute.autovec_copy(sBuf[None, tid, rd_slot], frag)
                            self._grad_step(frag, vidx, gGrad, mWeight, y, coefs, softcap, inv_softcap, ignored)
                        rd_slot = R + ((rd_slot - R + 1) & (self.stages - 1))
                        wr_slot = R + ((wr_slot - R + 1) & (self.stages - 1))
                        vidx = vidx - T
                    cute.arch.cp_async_wait_group(0)
                if const_expr(R > 0):
                    vidx = v0 + tid
                    for t in cutlass.range(R, unroll=1):
                        if vidx < v_end:
                            frag = cute.make_rmem_tensor((VEC,), self.dtype)
                            cute.autovec_copy(sBuf[None, tid, t], frag)
                            self._grad_step(frag, vidx, gGrad, mWeight, y, coefs, softcap, inv_softcap, ignored)
                        vidx = vidx + T
            else:
                vidx = v0 + tid
                for _ in cutlass.range(NT, unroll=1):
                    if vidx < v_end:
                        frag = cute.make_rmem_tensor((VEC,), self.dtype)
                        cute.autovec_copy(gRow[None, vidx], frag)
                        self._grad_step(frag, vidx, gGrad, mWeight, y, coefs, softcap, inv_softcap, ignored)
                    vidx = vidx + T


# ---------------------------------------------------------------------- host wrapper
def compile_kernel(key: KernelKey, config: KernelConfig | None = None):
    """The compiled kernel for ``key`` (cached); ``config`` overrides the heuristics."""
    config = default_config(key) if config is None else config
    return compile_cached((ChunkCrossEntropy, key, config), lambda: _build(key, config))


def _build(key: KernelKey, config: KernelConfig):
    kernel = ChunkCrossEntropy(key, config)
    dtype = TORCH_TO_CUTE[key.dtype]
    esize = kernel.esize
    target_t = Int64 if key.target_int64 else Int32
    return compile_launcher(
        kernel,
        null_ptr(dtype, key.vec * esize),
        null_ptr(dtype, key.vec * esize),
        null_ptr(target_t, target_t.width // 8),
        null_ptr(Float32, 16),
        null_ptr(Float32, 4),
        null_ptr(Float32, 4),
        null_ptr(Float32, 4),
        null_ptr(Int64, 8),
        null_ptr(Float32, 4),
        null_ptr(Float32, 4),
        Int32(1),
        Int64(key.vocab),
        Int64(key.vocab),
        Int64(-100),
        Float32(0.0),
        Float32(0.0),
        Float32(0.0),
        Float32(1.0),
        Float32(1.0),
        cuda.CUstream(0),
    )


def cross_entropy_chunk(
    logits: torch.Tensor,  # (M, V) fp16/bf16/fp32; overwritten with the gradient (compute_grad, no grad_out)
    target: torch.Tensor,  # (M,) integer, any strides (copied to contiguous int64/int32)
    ce_weight: torch.Tensor | None,  # (V,) float, any strides (copied to contiguous, aligned fp32)
    scalars: ChunkScalars,
    *,
    loss_out: torch.Tensor,  # (M,) fp32 contiguous
    z_loss_out: torch.Tensor | None,  # (M,) fp32 contiguous
    correct_out: torch.Tensor | None,  # (M,) fp32 contiguous
    predicted_out: torch.Tensor | None,  # (M,) int64 contiguous
    row_grad_scale: torch.Tensor | None,  # (M,) fp32, any strides (copied to contiguous)
    compute_grad: bool,
    grad_out: torch.Tensor | None = None,  # (M, V) logits dtype: the gradient goes here, logits are only read
    config: KernelConfig | None = None,
) -> None:
    num_rows, vocab = logits.shape
    if num_rows == 0:
        return
    if logits.dtype not in TORCH_TO_CUTE:
        raise TypeError(f"cutedsl CE supports fp16/bf16/fp32 logits, got {logits.dtype}")
    check_logits_layout(logits)
    grad = gradient_destination(logits, grad_out, compute_grad)
    check_row_outputs(
        num_rows, loss_out=loss_out, z_loss_out=z_loss_out, correct_out=correct_out, predicted_out=predicted_out
    )
    # The kernel reads these at ptr + row (ptr + class): strided or expanded ones are copied.
    target = kernel_target(target)
    row_grad_scale = kernel_row_vector("row_grad_scale", row_grad_scale, num_rows)
    ls = float(scalars.label_smoothing)
    c = scalars.softcap
    weight = kernel_class_weights(ce_weight)
    if weight is not None and weight.data_ptr() % 16:
        weight = weight.clone()  # read in 16-byte vectors: a fresh allocation is aligned
    key = KernelKey(
        dtype=logits.dtype,
        vocab=vocab,
        vec=row_vector_width(logits) if grad is logits else min(row_vector_width(logits), row_vector_width(grad)),
        target_int64=target.dtype == torch.int64,
        has_weight=weight is not None,
        has_smoothing=ls > 0.0,
        has_softcap=c is not None,
        approximate_tanh=scalars.approximate_tanh,
        token_scaling=bool(scalars.use_token_scaling),
        write_z_loss=z_loss_out is not None,
        write_correct=correct_out is not None,
        write_predicted=predicted_out is not None,
        has_row_scale=row_grad_scale is not None,
        compute_grad=bool(compute_grad),
    )
    fn = compile_kernel(key, config)
    with device_guard(logits.device):
        _launch(
            fn,
            key,
            logits,
            grad,
            target,
            weight,
            scalars,
            loss_out,
            z_loss_out,
            correct_out,
            predicted_out,
            row_grad_scale,
        )


def _launch(
    fn, key, logits, grad, target, weight, scalars, loss_out, z_loss_out, correct_out, predicted_out, row_grad_scale
):
    num_rows, vocab = logits.shape
    ls = float(scalars.label_smoothing)
    c = scalars.softcap
    esize = logits.element_size()
    fn(
        gmem_ptr(logits, TORCH_TO_CUTE[logits.dtype], key.vec * esize),
        gmem_ptr(grad, TORCH_TO_CUTE[logits.dtype], key.vec * esize),
        gmem_ptr(target, Int64 if key.target_int64 else Int32, target.element_size()),
        gmem_ptr(weight, Float32, 16),
        gmem_ptr(loss_out, Float32, 4),
        gmem_ptr(z_loss_out, Float32, 4),
        gmem_ptr(correct_out, Float32, 4),
        gmem_ptr(predicted_out, Int64, 8),
        gmem_ptr(row_grad_scale, Float32, 4),
        gmem_ptr(scalars.scales, Float32, 4),
        arg_i32(num_rows),
        arg_i64(logits.stride(0)),
        arg_i64(grad.stride(0)),
        arg_i64(scalars.ignore_index),
        arg_f32(ls),
        arg_f32(ls / vocab),
        arg_f32(scalars.lse_square_scale),
        arg_f32(c if c is not None else 1.0),
        arg_f32(1.0 / c if c is not None else 1.0),
        cuda_stream(logits.device),
    )
