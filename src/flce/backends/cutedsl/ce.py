"""Chunk CE kernel in CuTe DSL (nvidia-cutlass-dsl), written for Hopper (sm_90) and newer.

One CTA, or a thread-block cluster of 2-8 CTAs each owning a contiguous slice, handles
one row of logits. Pass 1 streams the row through a multi-stage ``cp.async``
shared-memory pipeline (128-bit copies where alignment allows) and keeps, per thread,
an fp32 online softmax (running max ``m = max(z')`` and normaliser
``d = sum 2^((z' - m) log2(e))``), the label-smoothing sum and the argmax. A CTA
reduction (then, in a cluster, an exchange through distributed shared memory) gives
the row's statistics, from which every thread derives the row scalars of
``flce.backends.base`` (loss, z-loss, token scale and the gradient coefficients).
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
gradient ``p_y - 1`` with it. The kernel is bound by memory traffic, not by that
instruction. The gradient uses the grouped form of ``flce.backends.base``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import dsl_user_op

try:
    from cutlass.memory import SmemAllocator
except ImportError:  # older nvidia-cutlass-dsl
    from cutlass.utils import SmemAllocator

from flce.backends.base import (
    ChunkScalars,
    check_logits_layout,
    check_row_outputs,
    gradient_destination,
    kernel_class_weights,
    kernel_row_vector,
    kernel_target,
)

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
# Initial running max: finite (also times log2(e)), so that exp2((m_a - m_b) log2 e)
# between two untouched states is exp2(0) * 0 = 0 rather than NaN, and far below any
# real logit.
NEG_BIG = -1.0e38
SMEM_LIMIT = 227 * 1024  # dynamic shared memory per CTA on sm_90
CTA_SMEM_BUDGET = 113 * 1024  # two CTAs per SM (228 KiB per SM, 1 KiB reserved per CTA)
ROW_SMEM_BYTES = 72 * 1024  # a row (slice) held whole in shared memory (3 CTAs per SM)
CLUSTER_SLICE_BYTES = 32 * 1024  # target slice of a row split over a cluster

_TORCH_TO_CUTE = {
    torch.float32: cutlass.Float32,
    torch.float16: cutlass.Float16,
    torch.bfloat16: cutlass.BFloat16,
}


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape: ``threads`` per CTA, ``stages`` of the cp.async ring (a power of
    two), ``resident`` tiles (per CTA) kept in shared memory for pass 2, and
    ``cluster`` CTAs (a thread-block cluster) sharing one row, each owning a contiguous
    slice of it and exchanging row statistics through distributed shared memory."""

    threads: int
    stages: int
    resident: int
    cluster: int = 1


@dataclass(frozen=True)
class KernelKey:
    """Everything a compiled kernel bakes in; the row count stays symbolic."""

    dtype: torch.dtype
    vocab: int
    vec: int  # elements per thread per copy (alignment-limited, divides vocab)
    target_int64: bool
    has_weight: bool
    has_smoothing: bool
    has_softcap: bool
    token_scaling: bool
    write_z_loss: bool
    write_correct: bool
    write_predicted: bool
    has_row_scale: bool
    compute_grad: bool


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def row_threads(num_vec: int) -> int:
    """Threads per CTA for a row of ``num_vec`` vectors: 256 (8 warps) once the row has
    >= 256 vectors; a short row gets one thread per vector (at least a warp)."""
    return 256 if num_vec >= 256 else max(32, _pow2_ceil(num_vec))


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
    num_vec = key.vocab // key.vec
    threads = row_threads(num_vec)
    esize = torch.empty((), dtype=key.dtype).element_size()
    tile_bytes = threads * key.vec * esize
    async_copy = key.vec * esize >= 4
    cluster = 1
    if key.compute_grad and async_copy and key.vocab * esize > ROW_SMEM_BYTES:
        while cluster < 8 and key.vocab * esize > cluster * CLUSTER_SLICE_BYTES:
            cluster *= 2
    num_tiles = _cdiv(_cdiv(num_vec, cluster), threads)
    stages = min(8, _pow2_ceil(num_tiles))
    resident = 0
    if key.compute_grad and async_copy:
        if num_tiles * tile_bytes <= ROW_SMEM_BYTES:
            resident = num_tiles  # the whole slice: no ring at all
            stages = 16
        else:
            resident = max(0, min(num_tiles, (CTA_SMEM_BUDGET - 1024) // tile_bytes - stages))
    return KernelConfig(threads=threads, stages=stages, resident=resident, cluster=cluster)


@dsl_user_op
def _store_to_peer(smem_ptr: cute.Pointer, value, peer, *, loc=None, ip=None) -> None:
    """Store a 32-bit ``value`` at ``smem_ptr`` in the shared memory of cluster CTA ``peer``
    (``mapa`` + ``st.shared::cluster``)."""
    remote = nvvm.mapa(
        llvm.PointerType.get(cute.AddressSpace.dsmem),
        smem_ptr.to_llvm_ptr(loc=loc, ip=ip),
        Int32(peer).ir_value(loc=loc, ip=ip),
        loc=loc,
        ip=ip,
    )
    llvm.store(value.ir_value(loc=loc, ip=ip), remote, loc=loc, ip=ip)


@cute.jit
def _argmax_combine(best_v: Float32, best_i: Int32, v_o: Float32, i_o: Int32):
    """(value, column) argmax merge: larger value wins, the smaller column wins a tie."""
    if v_o > best_v:
        best_i = i_o
    if v_o == best_v:
        if i_o < best_i:
            best_i = i_o
    return cute.arch.fmax(best_v, v_o), best_i


@cute.jit
def _softcapped(t: Float32, softcap: Float32) -> Float32:
    """``softcap * t`` rounded on its own, as ``fma(softcap, t, +0)``: a plain product
    may be contracted into a different FMA at each use (``z' - m``, ``m - z'_y``, the
    smoothing sum), so the max, the target logit and the exponents would see differently
    rounded copies of one z' (a one-class row's loss would be a rounding residue, not 0)."""
    return cute.math.fma(softcap, t, Float32(0.0))


@cute.jit
def _combine_softmax(m: Float32, d: Float32, m_o: Float32, d_o: Float32):
    """Merges two online-softmax states (max, sum of exp2((z' - max) log2 e))."""
    m_new = cute.arch.fmax(m, m_o)
    d_new = d * cute.math.exp2((m - m_new) * LOG2_E, fastmath=True) + d_o * cute.math.exp2(
        (m_o - m_new) * LOG2_E, fastmath=True
    )
    return m_new, d_new


class RowStream:
    """What every row kernel of this backend shares: the launch geometry of one row (or
    row slice) of ``vocab`` logits read as ``vec``-element vectors, the per-thread
    ``cp.async`` ring, pass 1 (online softmax, smoothing sum, argmax), the CTA reduction
    and the gradient step. Used by ``ChunkCrossEntropy`` and by the split-row kernels of
    ``flce.backends.cutedsl.partial``.

    ``key`` is any frozen key with the fields ``dtype``, ``vocab``, ``vec``,
    ``has_weight``, ``has_smoothing`` and ``has_softcap``. ``keep_resident``: the
    gradient follows in the same kernel, so tiles may stay in shared memory for it.
    """

    # The argmax is taken on the raw logits: softcap is strictly increasing, so it is the
    # same column, without the ties that a saturated fp32 tanh could create. The split-row
    # kernels take it on z' instead (their callers merge blocks by the max of z').
    argmax_of_softcapped = False

    def __init__(self, key, config: KernelConfig, *, keep_resident: bool, need_argmax: bool):
        assert config.stages & (config.stages - 1) == 0, "stages must be a power of two"
        self.key = key
        self.dtype = _TORCH_TO_CUTE[key.dtype]
        self.esize = torch.empty((), dtype=key.dtype).element_size()
        self.vocab = key.vocab
        self.vec = key.vec
        self.num_vec = key.vocab // key.vec
        self.cluster = config.cluster
        assert self.cluster in (1, 2, 4, 8), "cluster must be 1, 2, 4 or 8"
        self.num_vec_cta = _cdiv(self.num_vec, self.cluster)  # vectors of the row slice of one CTA
        self.threads = config.threads
        self.num_warps = config.threads // 32
        self.num_tiles = _cdiv(self.num_vec_cta, config.threads)
        # cp.async copies 4, 8 or 16 bytes; narrower vectors (16-bit logits with an odd
        # vocabulary) are loaded straight into registers instead.
        self.use_async = key.vec * self.esize >= 4
        self.stages = config.stages
        self.prefetch = config.stages - 1  # tiles in flight ahead of the one consumed
        resident = min(config.resident, self.num_tiles) if (self.use_async and keep_resident) else 0
        # Stay inside the 227 KiB a CTA may have on sm_90 (minus the reduction scratch).
        tile_bytes = config.threads * key.vec * self.esize
        self.resident = max(0, min(resident, (SMEM_LIMIT - 1024) // tile_bytes - config.stages))
        ring = 0 if self.resident >= self.num_tiles else self.stages
        self.num_slots = self.resident + ring if self.use_async else 0
        self.need_argmax = need_argmax

    @cute.jit
    def _row_vectors(self, p_base: cute.Pointer, row, row_stride: Int64) -> cute.Tensor:
        """Row ``row`` of a row-major matrix at ``p_base`` as ``(vec, V/vec)``: element
        ``[None, v]`` is its ``v``-th vector (64-bit offset; aligned to ``vec``)."""
        row_offset = cute.assume(Int64(row) * row_stride, divby=self.vec)
        return cute.make_tensor(p_base + row_offset, cute.make_layout((self.vec, self.num_vec), stride=(1, self.vec)))

    def smem_bytes(self) -> int:
        buf = self.num_slots * self.threads * self.vec * self.esize
        return buf + 6 * (self.num_warps + self.cluster) * 4 + 128

    def _stream_smem(self, smem):
        """The cp.async ring of ``smem`` and its copy atom; ``(None, None)`` when the
        vectors are too narrow for cp.async (they are then loaded straight into registers)."""
        sBuf = None
        copy_atom = None
        if const_expr(self.use_async):
            # (vec, threads, slots): thread t only ever touches [None, t, *], so the ring
            # needs no CTA barriers, only each thread's own cp.async groups.
            VEC, T = self.vec, self.threads
            sBuf = smem.allocate_tensor(
                self.dtype,
                cute.make_layout((VEC, T, self.num_slots), stride=(1, VEC, VEC * T)),
                byte_alignment=16,
            )
            copy_bits = self.vec * self.esize * 8
            cache_mode = cpasync.LoadCacheMode.GLOBAL if copy_bits == 128 else cpasync.LoadCacheMode.ALWAYS
            copy_atom = cute.make_copy_atom(
                cpasync.CopyG2SOp(cache_mode=cache_mode), self.dtype, num_bits_per_copy=copy_bits
            )
        return sBuf, copy_atom

    @cute.jit
    def _pass1(
        self,
        gRow: cute.Tensor,  # (vec, V/vec) the row in global memory
        sBuf,  # (vec, threads, slots) the cp.async ring, or None
        copy_atom,
        v0,  # this CTA's slice of the row: vectors [v0, v_end)
        v_end,
        tid: Int32,
        mWeight: cute.Tensor,  # (vec, V/vec) fp32
        softcap: Float32,
        inv_softcap: Float32,
    ):
        """Streams the slice once; per thread ``(m, d, smoothing sum, argmax value, argmax
        column)``. Tile ``k`` of the slice is vectors ``v0 + k * threads + [0, threads)``;
        the first ``resident`` tiles stay in their shared-memory slots afterwards."""
        T = self.threads
        VEC = self.vec
        NT = self.num_tiles
        P = self.prefetch
        m = Float32(NEG_BIG)
        d = Float32(0.0)
        sxs = Float32(0.0)
        best_v = Float32(-Float32.inf)
        best_i = Int32(self.num_vec * VEC)
        if const_expr(self.use_async):
            for k in cutlass.range_constexpr(P):
                if const_expr(k < NT):
                    self._issue(copy_atom, gRow, sBuf, v0 + k * T + tid, v_end, self._slot_static(k), tid)
                cute.arch.cp_async_commit_group()
            rd_slot = Int32(0)
            wr_slot = Int32(self._slot_static(P))
            vidx = v0 + tid
            for _ in cutlass.range(NT, unroll=1):
                self._issue(copy_atom, gRow, sBuf, vidx + P * T, v_end, wr_slot, tid)
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(P)
                if vidx < v_end:
                    frag = cute.make_rmem_tensor((VEC,), self.dtype)
                    cute.autovec_copy(sBuf[None, tid, rd_slot], frag)
                    m, d, sxs, best_v, best_i = self._softmax_step(
                        frag, vidx, m, d, sxs, best_v, best_i, mWeight, softcap, inv_softcap
                    )
                rd_slot = self._advance(rd_slot)
                wr_slot = self._advance(wr_slot)
                vidx = vidx + T
            cute.arch.cp_async_wait_group(0)
        else:
            vidx = v0 + tid
            for _ in cutlass.range(NT, unroll=1):
                if vidx < v_end:
                    frag = cute.make_rmem_tensor((VEC,), self.dtype)
                    cute.autovec_copy(gRow[None, vidx], frag)
                    m, d, sxs, best_v, best_i = self._softmax_step(
                        frag, vidx, m, d, sxs, best_v, best_i, mWeight, softcap, inv_softcap
                    )
                vidx = vidx + T
        return m, d, sxs, best_v, best_i

    @cute.jit
    def _reduce_cta(
        self,
        m: Float32,
        d: Float32,
        sxs: Float32,
        best_v: Float32,
        best_i: Int32,
        sRed: cute.Tensor,  # (warps, 5) fp32 shared scratch
        sArg: cute.Tensor,  # (warps,) int32 shared scratch
        lane: Int32,
        warp: Int32,
    ):
        """Warp shuffles, then one exchange through shared memory: every thread ends with
        the statistics of the whole CTA, combined in the same order (bit-identical)."""
        key = self.key
        for i in cutlass.range_constexpr(5):
            off = 1 << i
            m_o = cute.arch.shuffle_sync_bfly(m, offset=off)
            d_o = cute.arch.shuffle_sync_bfly(d, offset=off)
            m, d = _combine_softmax(m, d, m_o, d_o)
            if const_expr(key.has_smoothing):
                sxs = sxs + cute.arch.shuffle_sync_bfly(sxs, offset=off)
            if const_expr(self.need_argmax):
                v_o = cute.arch.shuffle_sync_bfly(best_v, offset=off)
                i_o = cute.arch.shuffle_sync_bfly(best_i, offset=off)
                best_v, best_i = _argmax_combine(best_v, best_i, v_o, i_o)
        if lane == 0:
            sRed[warp, 0] = m
            sRed[warp, 1] = d
            sRed[warp, 2] = sxs
            sRed[warp, 3] = best_v
            sArg[warp] = best_i
        cute.arch.barrier()
        m = sRed[0, 0]
        d = sRed[0, 1]
        sxs = sRed[0, 2]
        best_v = sRed[0, 3]
        best_i = sArg[0]
        for w in cutlass.range_constexpr(1, self.num_warps):
            m, d = _combine_softmax(m, d, sRed[w, 0], sRed[w, 1])
            if const_expr(key.has_smoothing):
                sxs = sxs + sRed[w, 2]
            if const_expr(self.need_argmax):
                v_o = sRed[w, 3]
                i_o = sArg[w]
                best_v, best_i = _argmax_combine(best_v, best_i, v_o, i_o)
        return m, d, sxs, best_v, best_i

    # ------------------------------------------------------------------ helpers
    def _slot_static(self, tile: int) -> int:
        """Shared-memory slot of pass-1 tile ``tile`` (trace-time ints)."""
        if tile < self.resident:
            return tile
        return self.resident + ((tile - self.resident) & (self.stages - 1))

    @cute.jit
    def _advance(self, slot: Int32) -> Int32:
        """Next pass-1 slot: resident slots in order, then the power-of-two ring
        (``& (stages - 1)``, no modulo)."""
        nxt = slot + 1
        if const_expr(self.resident == 0):
            nxt = nxt & (self.stages - 1)
        else:
            nxt = nxt if nxt < self.resident else self.resident + ((nxt - self.resident) & (self.stages - 1))
        return nxt

    @cute.jit
    def _issue(self, copy_atom, gRow: cute.Tensor, sBuf: cute.Tensor, vidx: Int32, v_end, slot: Int32, tid: Int32):
        """cp.async of vector ``vidx`` of the row into this thread's ``slot`` (if below ``v_end``)."""
        if vidx < v_end:
            cute.copy(copy_atom, gRow[None, vidx], sBuf[None, tid, slot])

    @cute.jit
    def _argmax_step(self, x: cute.Tensor, vidx: Int32, best_v: Float32, best_i: Int32):
        """Merges vector ``vidx`` (``x``: (vec,) fp32 registers) into the running argmax;
        a strictly larger value replaces it, so the first column of a tie wins."""
        VEC = self.vec
        vmax = x[0]
        for j in cutlass.range_constexpr(1, VEC):
            vmax = cute.arch.fmax(vmax, x[j])
        if vmax > best_v:
            j_first = Int32(VEC - 1)
            for j in cutlass.range_constexpr(VEC - 2, -1, -1):
                if x[j] == vmax:
                    j_first = Int32(j)
            best_v = vmax
            best_i = vidx * VEC + j_first
        return best_v, best_i

    @cute.jit
    def _softmax_step(
        self,
        frag: cute.Tensor,  # (vec,) logits dtype, registers
        vidx: Int32,
        m: Float32,
        d: Float32,
        sxs: Float32,
        best_v: Float32,
        best_i: Int32,
        mWeight: cute.Tensor,  # (vec, V/vec) fp32
        softcap: Float32,
        inv_softcap: Float32,
    ):
        key = self.key
        VEC = self.vec
        x = cute.make_rmem_tensor((VEC,), Float32)
        x.store(frag.load().to(Float32))
        if const_expr(self.need_argmax and not self.argmax_of_softcapped):
            best_v, best_i = self._argmax_step(x, vidx, best_v, best_i)
        if const_expr(key.has_softcap):
            for j in cutlass.range_constexpr(VEC):
                x[j] = _softcapped(cute.math.tanh(x[j] * inv_softcap), softcap)
        if const_expr(self.need_argmax and self.argmax_of_softcapped):
            best_v, best_i = self._argmax_step(x, vidx, best_v, best_i)
        if const_expr(key.has_smoothing):
            if const_expr(key.has_weight):
                w = cute.make_rmem_tensor((VEC,), Float32)
                cute.autovec_copy(mWeight[None, vidx], w)
                for j in cutlass.range_constexpr(VEC):
                    sxs = cute.math.fma(w[j], x[j], sxs)
            else:
                for j in cutlass.range_constexpr(VEC):
                    sxs = sxs + x[j]
        vmax = x[0]
        for j in cutlass.range_constexpr(1, VEC):
            vmax = cute.arch.fmax(vmax, x[j])
        m_new = cute.arch.fmax(m, vmax)
        acc = Float32(0.0)
        for j in cutlass.range_constexpr(VEC):
            acc = acc + cute.math.exp2((x[j] - m_new) * LOG2_E, fastmath=True)
        d = cute.math.fma(d, cute.math.exp2((m - m_new) * LOG2_E, fastmath=True), acc)
        return m_new, d, sxs, best_v, best_i

    @cute.jit
    def _grad_step(
        self,
        frag: cute.Tensor,  # (vec,) logits dtype, registers
        vidx: Int32,
        gOut: cute.Tensor,  # (vec, V/vec) where this row's gradient goes in global memory
        mWeight: cute.Tensor,  # (vec, V/vec) fp32
        y: Int32,
        coefs: tuple,  # (m, 1/d, coef_y, coef_eps, coef_z, W) of the row, fp32
        softcap: Float32,
        inv_softcap: Float32,
        row_ignored=None,  # Boolean: the row's gradient is exactly 0 (None: a row that is not ignored)
    ):
        key = self.key
        VEC = self.vec
        m, inv_d, coef_y, coef_eps, coef_z, weight_sum = coefs
        x = cute.make_rmem_tensor((VEC,), Float32)
        x.store(frag.load().to(Float32))
        t = cute.make_rmem_tensor((VEC,), Float32)
        if const_expr(key.has_softcap):
            for j in cutlass.range_constexpr(VEC):
                t[j] = cute.math.tanh(x[j] * inv_softcap)
                x[j] = _softcapped(t[j], softcap)
        p = cute.make_rmem_tensor((VEC,), Float32)
        for j in cutlass.range_constexpr(VEC):
            p[j] = cute.math.exp2((x[j] - m) * LOG2_E, fastmath=True) * inv_d
        # Each group of the grouped form is formed before it is scaled, so that it cancels
        # exactly where the true value is ~0 (p_y ~ 1 on a confident row, V = 1).
        g = cute.make_rmem_tensor((VEC,), Float32)
        for j in cutlass.range_constexpr(VEC):
            g[j] = p[j]
        y_off = y - vidx * VEC
        if y_off >= 0:
            if y_off < VEC:
                for j in cutlass.range_constexpr(VEC):
                    if y_off == j:
                        g[j] = p[j] - Float32(1.0)
        for j in cutlass.range_constexpr(VEC):
            g[j] = cute.math.fma(coef_z, p[j], coef_y * g[j])
        if const_expr(key.has_smoothing):
            if const_expr(key.has_weight):
                w = cute.make_rmem_tensor((VEC,), Float32)
                cute.autovec_copy(mWeight[None, vidx], w)
                for j in cutlass.range_constexpr(VEC):
                    g[j] = cute.math.fma(coef_eps, cute.math.fma(weight_sum, p[j], -w[j]), g[j])
            else:
                for j in cutlass.range_constexpr(VEC):
                    g[j] = cute.math.fma(coef_eps, cute.math.fma(weight_sum, p[j], Float32(-1.0)), g[j])
        if const_expr(key.has_softcap):
            for j in cutlass.range_constexpr(VEC):
                g[j] = g[j] * (Float32(1.0) - t[j] * t[j])
        if const_expr(row_ignored is not None):
            # Selected, not scaled by the row's zero coefficients: an ignored row's logits
            # may be NaN or Inf, and 0 * NaN is NaN (flce.backends.base).
            if row_ignored:
                for j in cutlass.range_constexpr(VEC):
                    g[j] = Float32(0.0)
        out = cute.make_rmem_tensor((VEC,), self.dtype)
        out.store(g.load().to(self.dtype))
        cute.autovec_copy(out, gOut[None, vidx])


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
        num_rows: Int32,  # M
        row_stride: Int64,  # elements between rows of logits (a multiple of vec)
        grad_row_stride: Int64,  # elements between rows of the gradient (a multiple of vec)
        ignore_index: Int64,
        label_smoothing: Float32,  # ls
        eps: Float32,  # ls / V
        z_scale: Float32,  # lse_square_scale
        softcap: Float32,  # c (unused without softcap)
        inv_softcap: Float32,  # 1 / c
        ce_grad_scale: Float32,
        z_grad_scale: Float32,
        weight_sum: Float32,  # W
        stream: cuda.CUstream,
    ):
        rows = cute.make_layout((num_rows,))
        mTarget = cute.make_tensor(p_target, rows)  # (M,)
        mLoss = cute.make_tensor(p_loss, rows)  # (M,)
        mZLoss = cute.make_tensor(p_z_loss, rows)  # (M,)
        mCorrect = cute.make_tensor(p_correct, rows)  # (M,)
        mPred = cute.make_tensor(p_predicted, rows)  # (M,)
        mRowScale = cute.make_tensor(p_row_scale, rows)  # (M,)
        mWeight = cute.make_tensor(
            p_weight, cute.make_layout((self.vec, self.num_vec), stride=(1, self.vec))
        )  # (vec, V/vec)
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
            row_stride,
            grad_row_stride,
            ignore_index,
            label_smoothing,
            eps,
            z_scale,
            softcap,
            inv_softcap,
            ce_grad_scale,
            z_grad_scale,
            weight_sum,
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
        mWeight: cute.Tensor,  # (vec, V/vec) fp32
        mLoss: cute.Tensor,  # (M,)
        mZLoss: cute.Tensor,  # (M,)
        mCorrect: cute.Tensor,  # (M,)
        mPred: cute.Tensor,  # (M,)
        mRowScale: cute.Tensor,  # (M,)
        row_stride: Int64,
        grad_row_stride: Int64,
        ignore_index: Int64,
        label_smoothing: Float32,
        eps: Float32,
        z_scale: Float32,
        softcap: Float32,
        inv_softcap: Float32,
        ce_grad_scale: Float32,
        z_grad_scale: Float32,
        weight_sum: Float32,
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

        # Row target; ignored rows use class 0 for every gather (their results are zeroed).
        y_raw = Int64(mTarget[row])
        valid = y_raw != ignore_index
        ignored = y_raw == ignore_index
        y = Int32(0)
        if valid:
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
                _store_to_peer(sClu.iterator + rank, m, peer)  # sClu[rank, 0] of the peer
                _store_to_peer(sClu.iterator + (rank + CN), d, peer)  # [rank, 1]
                _store_to_peer(sClu.iterator + (rank + 2 * CN), sxs, peer)  # [rank, 2]
                _store_to_peer(sClu.iterator + (rank + 3 * CN), best_v, peer)  # [rank, 3]
                _store_to_peer(sCluArg.iterator + rank, best_i, peer)  # [rank]
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            m = sClu[0, 0]
            d = sClu[0, 1]
            sxs = sClu[0, 2]
            best_v = sClu[0, 3]
            best_i = sCluArg[0]
            for c in cutlass.range_constexpr(1, CN):
                m, d = _combine_softmax(m, d, sClu[c, 0], sClu[c, 1])
                if const_expr(key.has_smoothing):
                    sxs = sxs + sClu[c, 2]
                if const_expr(self.need_argmax):
                    best_v, best_i = _argmax_combine(best_v, best_i, sClu[c, 3], sCluArg[c])

        # ---------------- row scalars (same formulas as flce.backends.base)
        log_d = cute.math.log2(d) * LN_2
        lse = m + log_d
        zp_y = z_y
        if const_expr(key.has_softcap):
            zp_y = _softcapped(cute.math.tanh(z_y * inv_softcap), softcap)
        one_m_ls = Float32(1.0) - label_smoothing
        ce = one_m_ls * w_y * ((m - zp_y) + log_d)  # m - z'_y first: exact near the max
        if const_expr(key.has_smoothing):
            ce = ce + eps * (cute.math.fma(weight_sum, lse, Float32(0.0)) - sxs)  # see _softcapped
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
_COMPILED: dict = {}  # (KernelKey, KernelConfig) -> compiled kernel
_COMPILED_DEFAULT: dict = {}  # KernelKey -> compiled kernel with default_config(key)
_STREAMS: dict = {}
_NULL_PTRS: dict = {}


def _null_ptr(dtype, align: int) -> cute.Pointer:
    """A cached placeholder for an absent optional tensor (never dereferenced); its
    type (element, alignment) matches what the kernel was compiled with."""
    p = _NULL_PTRS.get((dtype, align))
    if p is None:
        p = cute.runtime.make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=align)
        _NULL_PTRS[(dtype, align)] = p
    return p


def _stream(device: torch.device) -> cuda.CUstream:
    raw = torch.cuda.current_stream(device).cuda_stream
    s = _STREAMS.get(raw)
    if s is None:
        s = cuda.CUstream(raw)
        _STREAMS[raw] = s
    return s


def _vector_width(logits: torch.Tensor) -> int:
    """Largest power-of-two vector (<= 16 bytes) dividing V, the row stride and the
    base address, so every vector is aligned and no vector straddles the row end."""
    esize = logits.element_size()
    vec = 16 // esize
    vocab = logits.shape[1]
    stride = logits.stride(0) if logits.shape[0] > 1 else vocab
    addr = logits.data_ptr() // esize
    while vec > 1 and (vocab % vec or stride % vec or addr % vec):
        vec //= 2
    return vec


def compile_kernel(key: KernelKey, config: KernelConfig | None = None):
    """The compiled kernel for ``key`` (cached); ``config`` overrides the heuristics."""
    if config is None:
        fn = _COMPILED_DEFAULT.get(key)
        if fn is not None:
            return fn
        fn = compile_kernel(key, default_config(key))
        _COMPILED_DEFAULT[key] = fn
        return fn
    cache_key = (key, config)
    fn = _COMPILED.get(cache_key)
    if fn is not None:
        return fn
    kernel = ChunkCrossEntropy(key, config)
    dtype = _TORCH_TO_CUTE[key.dtype]
    esize = kernel.esize
    target_t = Int64 if key.target_int64 else Int32
    fn = cute.compile(
        kernel,
        _null_ptr(dtype, key.vec * esize),
        _null_ptr(dtype, key.vec * esize),
        _null_ptr(target_t, target_t.width // 8),
        _null_ptr(Float32, 16),
        _null_ptr(Float32, 4),
        _null_ptr(Float32, 4),
        _null_ptr(Float32, 4),
        _null_ptr(Int64, 8),
        _null_ptr(Float32, 4),
        Int32(1),
        Int64(key.vocab),
        Int64(key.vocab),
        Int64(-100),
        Float32(0.0),
        Float32(0.0),
        Float32(0.0),
        Float32(1.0),
        Float32(1.0),
        Float32(1.0),
        Float32(1.0),
        Float32(1.0),
        cuda.CUstream(0),
    )
    _COMPILED[cache_key] = fn
    return fn


def _ptr(tensor: torch.Tensor | None, dtype, align: int) -> cute.Pointer:
    if tensor is None:
        return _null_ptr(dtype, align)
    return cute.runtime.make_ptr(dtype, tensor.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)


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
    if logits.dtype not in _TORCH_TO_CUTE:
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
        vec=_vector_width(logits) if grad is logits else min(_vector_width(logits), _vector_width(grad)),
        target_int64=target.dtype == torch.int64,
        has_weight=weight is not None,
        has_smoothing=ls > 0.0,
        has_softcap=c is not None,
        token_scaling=bool(scalars.use_token_scaling),
        write_z_loss=z_loss_out is not None,
        write_correct=correct_out is not None,
        write_predicted=predicted_out is not None,
        has_row_scale=row_grad_scale is not None,
        compute_grad=bool(compute_grad),
    )
    fn = compile_kernel(key, config)
    if logits.device.index is not None and logits.device.index != torch.cuda.current_device():
        with torch.cuda.device(logits.device):
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
        return
    _launch(
        fn, key, logits, grad, target, weight, scalars, loss_out, z_loss_out, correct_out, predicted_out, row_grad_scale
    )


def _launch(
    fn, key, logits, grad, target, weight, scalars, loss_out, z_loss_out, correct_out, predicted_out, row_grad_scale
):
    num_rows, vocab = logits.shape
    ls = float(scalars.label_smoothing)
    c = scalars.softcap
    esize = logits.element_size()
    fn(
        _ptr(logits, _TORCH_TO_CUTE[logits.dtype], key.vec * esize),
        _ptr(grad, _TORCH_TO_CUTE[logits.dtype], key.vec * esize),
        _ptr(target, Int64 if key.target_int64 else Int32, target.element_size()),
        _ptr(weight, Float32, 16),
        _ptr(loss_out, Float32, 4),
        _ptr(z_loss_out, Float32, 4),
        _ptr(correct_out, Float32, 4),
        _ptr(predicted_out, Int64, 8),
        _ptr(row_grad_scale, Float32, 4),
        Int32(num_rows),
        Int64(logits.stride(0)),
        Int64(grad.stride(0)),
        Int64(scalars.ignore_index),
        Float32(ls),
        Float32(ls / vocab),
        Float32(scalars.lse_square_scale),
        Float32(c if c is not None else 1.0),
        Float32(1.0 / c if c is not None else 1.0),
        Float32(scalars.ce_grad_scale),
        Float32(scalars.z_grad_scale),
        Float32(scalars.weight_sum),
        _stream(logits.device),
    )
