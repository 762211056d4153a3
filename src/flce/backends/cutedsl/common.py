"""What the CuTe DSL kernels of this backend share: launch geometry and the row-streaming
machinery (``RowStream``: the per-thread ``cp.async`` ring, pass 1's online softmax,
the CTA reduction, the gradient step), device helpers, the host-side pointer and stream
helpers, and the one compile cache (``compile_cached``).

Used by the chunk CE kernel (``ce``), the split-row kernels (``partial``) and the fused
forward GEMM (``fused_forward``). The numerics of pass 1 and of the gradient step are
described in ``ce``'s module docstring.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import dsl_user_op

from flce.backends.cutedsl import command_line_for_dsl

try:
    from cutlass.memory import SmemAllocator as _SmemAllocator
except ImportError:  # older nvidia-cutlass-dsl
    from cutlass.utils import SmemAllocator as _SmemAllocator

SmemAllocator = _SmemAllocator  # where this nvidia-cutlass-dsl keeps it

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

TORCH_TO_CUTE = {
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


def pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def row_threads(num_vec: int) -> int:
    """Threads per CTA for a row of ``num_vec`` vectors: 256 (8 warps) once the row has
    >= 256 vectors; a short row gets one thread per vector (at least a warp)."""
    return 256 if num_vec >= 256 else max(32, pow2_ceil(num_vec))


@dsl_user_op
def store_to_peer(smem_ptr: cute.Pointer, value, peer, *, loc=None, ip=None) -> None:
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
def argmax_combine(best_v: Float32, best_i: Int32, v_o: Float32, i_o: Int32):
    """(value, column) argmax merge in ``torch.argmax``'s order: a NaN ranks above every
    number, the larger number wins, and the smaller column wins between equal numbers or
    two NaNs. The merged value is NaN once either is (``fmax`` would drop it), so that
    every later merge sees it: a thread's, a warp's, a CTA's or a cluster's."""
    if v_o == best_v:
        if i_o < best_i:
            best_i = i_o
    if v_o > best_v:  # false wherever a NaN is: a NaN so far stays
        best_v = v_o
        best_i = i_o
    if v_o != v_o:
        if best_v == best_v:  # a number so far: the NaN replaces it
            best_i = i_o
        if i_o < best_i:
            best_i = i_o
        best_v = v_o
    return best_v, best_i


def softcap_tanh(x: Float32, approximate: bool) -> Float32:
    """tanh of ``z / c`` for the softcap: the hardware's ``tanh.approx.f32`` where
    ``flce.backends.base.softcap_tanh_is_approximate`` says so (16-bit logits), else the
    accurate libdevice ``tanh``. ``approximate`` is a Python bool, decided at compile time."""
    return cute.math.tanh(x, approx=True) if approximate else cute.math.tanh(x)


@cute.jit
def softcapped(t: Float32, softcap: Float32) -> Float32:
    """``softcap * t`` rounded on its own, as ``fma(softcap, t, +0)``: a plain product
    may be contracted into a different FMA at each use (``z' - m``, ``m - z'_y``, the
    smoothing sum), so the max, the target logit and the exponents would see differently
    rounded copies of one z' (a one-class row's loss would be a rounding residue, not 0)."""
    return cute.math.fma(softcap, t, Float32(0.0))


@cute.jit
def combine_softmax(m: Float32, d: Float32, m_o: Float32, d_o: Float32):
    """Merges two online-softmax states (max, sum of exp2((z' - max) log2 e))."""
    m_new = cute.arch.fmax(m, m_o)
    d_new = d * cute.math.exp2((m - m_new) * LOG2_E, fastmath=True) + d_o * cute.math.exp2(
        (m_o - m_new) * LOG2_E, fastmath=True
    )
    return m_new, d_new


def gradient_row_tensors(
    rows: cute.Layout,  # (M,)
    p_row_max: cute.Pointer,  # (M,) fp32: the whole row's reference point m
    p_inv_sum: cute.Pointer,  # (M,) fp32: 1 / sum_i exp(z'_i - m) over the whole row
    p_onehot_coef: cute.Pointer,  # (M,) fp32: coef_y
    p_smooth_coef: cute.Pointer,  # (M,) fp32: coef_eps
    p_z_coef: cute.Pointer,  # (M,) fp32: coef_z
    p_weight_sum: cute.Pointer,  # (1,) fp32: W
) -> tuple:
    """The split-row gradient's inputs per row as tensors, in that order (the contract of
    ``flce.rows.cross_entropy.gradient_coefficients``), for the ``@cute.jit`` launchers of
    the kernels that take them (the in-place block gradient, the block-gradient GEMM)."""
    per_row = (p_row_max, p_inv_sum, p_onehot_coef, p_smooth_coef, p_z_coef)
    return (*[cute.make_tensor(p, rows) for p in per_row], cute.make_tensor(p_weight_sum, cute.make_layout((1,))))


class RowStream:
    """What every row kernel of this backend shares: the launch geometry of one row (or
    row slice) of ``vocab`` logits read as ``vec``-element vectors, the per-thread
    ``cp.async`` ring, pass 1 (online softmax, smoothing sum, argmax), the CTA reduction
    and the gradient step. Used by ``ChunkCrossEntropy`` and by the split-row kernels of
    ``flce.backends.cutedsl.partial``.

    ``key`` is any frozen key with the fields ``dtype``, ``vocab``, ``vec``,
    ``has_weight``, ``has_smoothing``, ``has_softcap`` and ``approximate_tanh``.
    ``keep_resident``: the gradient follows in the same kernel, so tiles may stay in shared
    memory for it.
    """

    # The argmax is taken on the raw logits: softcap is strictly increasing, so it is the
    # same column, without the ties that a saturated fp32 tanh could create. The split-row
    # kernels take it on z' instead (their callers merge blocks by the max of z').
    argmax_of_softcapped = False

    def __init__(self, key, config: KernelConfig, *, keep_resident: bool, need_argmax: bool):
        assert config.stages & (config.stages - 1) == 0, "stages must be a power of two"
        self.key = key
        self.dtype = TORCH_TO_CUTE[key.dtype]
        self.esize = torch.empty((), dtype=key.dtype).element_size()
        self.tanh_approx = key.approximate_tanh  # decided by the plan (ChunkScalars.approximate_tanh)
        self.vocab = key.vocab
        self.vec = key.vec
        self.num_vec = cdiv(key.vocab, key.vec)
        # The last vector of a row holds ``tail`` columns: ``vec`` unless V is not a multiple
        # of it (a ragged row end, flce.backends.cutedsl.layout). It is then read whole, but
        # only its first ``tail`` elements are used and written.
        self.tail = key.vocab - (self.num_vec - 1) * key.vec
        self.ragged = self.tail != key.vec
        self.cluster = config.cluster
        assert self.cluster in (1, 2, 4, 8), "cluster must be 1, 2, 4 or 8"
        self.num_vec_cta = cdiv(self.num_vec, self.cluster)  # vectors of the row slice of one CTA
        self.threads = config.threads
        self.num_warps = config.threads // 32
        self.num_tiles = cdiv(self.num_vec_cta, config.threads)
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
        """Row ``row`` of a row-major matrix at ``p_base`` as ``(vec, ceil(V/vec))``: element
        ``[None, v]`` is its ``v``-th vector (64-bit offset; aligned to ``vec``), the last one
        ragged where ``vec`` does not divide V."""
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
        gRow: cute.Tensor,  # (vec, ceil(V/vec)) the row in global memory
        sBuf,  # (vec, threads, slots) the cp.async ring, or None
        copy_atom,
        v0,  # this CTA's slice of the row: vectors [v0, v_end)
        v_end,
        tid: Int32,
        mWeight: cute.Tensor,  # (vec, ceil(V/vec)) fp32
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
        best_i = Int32(self.vocab)  # past every column: the first vector replaces it (_argmax_step)
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
            m, d = combine_softmax(m, d, m_o, d_o)
            if const_expr(key.has_smoothing):
                sxs = sxs + cute.arch.shuffle_sync_bfly(sxs, offset=off)
            if const_expr(self.need_argmax):
                v_o = cute.arch.shuffle_sync_bfly(best_v, offset=off)
                i_o = cute.arch.shuffle_sync_bfly(best_i, offset=off)
                best_v, best_i = argmax_combine(best_v, best_i, v_o, i_o)
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
            m, d = combine_softmax(m, d, sRed[w, 0], sRed[w, 1])
            if const_expr(key.has_smoothing):
                sxs = sxs + sRed[w, 2]
            if const_expr(self.need_argmax):
                v_o = sRed[w, 3]
                i_o = sArg[w]
                best_v, best_i = argmax_combine(best_v, best_i, v_o, i_o)
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
    def _argmax_step(self, x: cute.Tensor, vidx: Int32, best_v: Float32, best_i: Int32, lanes: int):
        """Merges the first ``lanes`` elements of vector ``vidx`` (``x``: (vec,) fp32
        registers) into the running argmax in ``torch.argmax``'s order; a strictly larger
        value replaces it, so the first column of a tie wins. A NaN ranks above every
        number: ``fmax`` drops it, so each element is also tested (``x != x``, one compare)
        and only a vector holding a NaN looks for its first one. The running value is NaN
        from then on, and a thread's vectors come in increasing columns, so that NaN's
        column stays (``argmax_combine`` merges the threads')."""
        VEC = self.vec
        vmax = x[0]
        has_nan = x[0] != x[0]
        for j in cutlass.range_constexpr(1, lanes):
            vmax = cute.arch.fmax(vmax, x[j])
            has_nan = has_nan | (x[j] != x[j])
        # The first vector of a thread is taken whatever its (non-NaN) max, so that a row
        # of only -inf logits names its first column, as torch.argmax does, not the sentinel.
        if vmax > best_v or (best_i == Int32(self.vocab) and vmax == vmax):
            j_first = Int32(lanes - 1)
            for j in cutlass.range_constexpr(lanes - 2, -1, -1):
                if x[j] == vmax:
                    j_first = Int32(j)
            best_v = vmax
            best_i = vidx * VEC + j_first
        if has_nan:
            if best_v == best_v:  # this thread's first NaN
                j_nan = Int32(lanes - 1)
                for j in cutlass.range_constexpr(lanes - 2, -1, -1):
                    if x[j] != x[j]:
                        j_nan = Int32(j)
                best_v = Float32(math.nan)
                best_i = vidx * VEC + j_nan
        return best_v, best_i

    @cute.jit
    def _load_weights(self, mWeight: cute.Tensor, vidx: Int32) -> cute.Tensor:
        """Vector ``vidx`` of the (V,) fp32 class weights as (vec,) registers; the ragged
        last vector reads only its columns (the weights end at V) and leaves 0 past them."""
        w = cute.make_rmem_tensor((self.vec,), Float32)
        if const_expr(self.ragged):
            if vidx == self.num_vec - 1:  # the ragged last vector
                w.fill(0.0)
                for j in cutlass.range_constexpr(self.tail):
                    w[j] = mWeight[j, vidx]
            else:
                cute.autovec_copy(mWeight[None, vidx], w)
        else:
            cute.autovec_copy(mWeight[None, vidx], w)
        return w

    @cute.jit
    def _store_vector(self, values: cute.Tensor, gOut: cute.Tensor, vidx: Int32):
        """Writes ``values`` ((vec,) registers, the output dtype) to vector ``vidx`` of the
        row ``gOut``; of the ragged last vector only its columns (the memory past V is
        not the row's)."""
        if const_expr(self.ragged):
            if vidx == self.num_vec - 1:  # the ragged last vector
                for j in cutlass.range_constexpr(self.tail):
                    gOut[j, vidx] = values[j]
            else:
                cute.autovec_copy(values, gOut[None, vidx])
        else:
            cute.autovec_copy(values, gOut[None, vidx])

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
        mWeight: cute.Tensor,  # (vec, ceil(V/vec)) fp32
        softcap: Float32,
        inv_softcap: Float32,
    ):
        """Pass 1's step over vector ``vidx``: all its lanes, or the ragged last vector's
        ``tail`` (the rest are memory past V, never looked at)."""
        step = (frag, vidx, m, d, sxs, best_v, best_i, mWeight, softcap, inv_softcap)
        if const_expr(self.ragged):
            if vidx == self.num_vec - 1:  # the ragged last vector
                m, d, sxs, best_v, best_i = self._softmax_lanes(*step, self.tail)
            else:
                m, d, sxs, best_v, best_i = self._softmax_lanes(*step, self.vec)
        else:
            m, d, sxs, best_v, best_i = self._softmax_lanes(*step, self.vec)
        return m, d, sxs, best_v, best_i

    @cute.jit
    def _softmax_lanes(
        self,
        frag: cute.Tensor,  # (vec,) logits dtype, registers
        vidx: Int32,
        m: Float32,
        d: Float32,
        sxs: Float32,
        best_v: Float32,
        best_i: Int32,
        mWeight: cute.Tensor,  # (vec, ceil(V/vec)) fp32
        softcap: Float32,
        inv_softcap: Float32,
        lanes: int,  # the vector's first ``lanes`` elements are columns of the row
    ):
        key = self.key
        VEC = self.vec
        x = cute.make_rmem_tensor((VEC,), Float32)
        x.store(frag.load().to(Float32))
        if const_expr(self.need_argmax and not self.argmax_of_softcapped):
            best_v, best_i = self._argmax_step(x, vidx, best_v, best_i, lanes)
        if const_expr(key.has_softcap):
            for j in cutlass.range_constexpr(lanes):
                x[j] = softcapped(softcap_tanh(x[j] * inv_softcap, self.tanh_approx), softcap)
        if const_expr(self.need_argmax and self.argmax_of_softcapped):
            best_v, best_i = self._argmax_step(x, vidx, best_v, best_i, lanes)
        if const_expr(key.has_smoothing):
            if const_expr(key.has_weight):
                w = self._load_weights(mWeight, vidx)
                for j in cutlass.range_constexpr(lanes):
                    sxs = cute.math.fma(w[j], x[j], sxs)
            else:
                for j in cutlass.range_constexpr(lanes):
                    sxs = sxs + x[j]
        vmax = x[0]
        for j in cutlass.range_constexpr(1, lanes):
            vmax = cute.arch.fmax(vmax, x[j])
        m_new = cute.arch.fmax(m, vmax)
        acc = Float32(0.0)
        for j in cutlass.range_constexpr(lanes):
            acc = acc + cute.math.exp2((x[j] - m_new) * LOG2_E, fastmath=True)
        d = cute.math.fma(d, cute.math.exp2((m - m_new) * LOG2_E, fastmath=True), acc)
        return m_new, d, sxs, best_v, best_i

    @cute.jit
    def _grad_step(
        self,
        frag: cute.Tensor,  # (vec,) logits dtype, registers
        vidx: Int32,
        gOut: cute.Tensor,  # (vec, ceil(V/vec)) where this row's gradient goes in global memory
        mWeight: cute.Tensor,  # (vec, ceil(V/vec)) fp32
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
                t[j] = softcap_tanh(x[j] * inv_softcap, self.tanh_approx)
                x[j] = softcapped(t[j], softcap)
        g = cute.make_rmem_tensor((VEC,), Float32)
        y_off = y - vidx * VEC
        # Every column but the target's has coef_y p_i + coef_z p_i = e_i (coef_y + coef_z) / d
        # with e_i = exp(z'_i - m): one multiplier per row instead of three operations per
        # logit. After a GEMM (the GPU at its power limit, its SM clock lowered) this pass
        # is bound by instructions, not by memory traffic.
        e = cute.make_rmem_tensor((VEC,), Float32)
        multiplier = inv_d * (coef_y + coef_z)
        for j in cutlass.range_constexpr(VEC):
            e[j] = cute.math.exp2((x[j] - m) * LOG2_E, fastmath=True)
            g[j] = e[j] * multiplier
        # The target's column keeps the grouped form: p_y - 1 formed before it is scaled,
        # so that it cancels exactly on a confident row (p_y ~ 1, V = 1).
        if y_off >= 0:
            if y_off < VEC:
                for j in cutlass.range_constexpr(VEC):
                    if y_off == j:
                        g[j] = cute.math.fma(coef_z, e[j] * inv_d, coef_y * (e[j] * inv_d - Float32(1.0)))
        if const_expr(key.has_smoothing):
            # coef_eps (W p_i - w_i), its inner difference formed before it is scaled.
            if const_expr(key.has_weight):
                w = self._load_weights(mWeight, vidx)
                for j in cutlass.range_constexpr(VEC):
                    g[j] = cute.math.fma(coef_eps, cute.math.fma(weight_sum, e[j] * inv_d, -w[j]), g[j])
            else:
                for j in cutlass.range_constexpr(VEC):
                    g[j] = cute.math.fma(coef_eps, cute.math.fma(weight_sum, e[j] * inv_d, Float32(-1.0)), g[j])
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
        self._store_vector(out, gOut, vidx)


# ---------------------------------------------------------------- compiling and launching
#
# A kernel is compiled once per cache key (everything it bakes in) from placeholder
# arguments: pointers with their element type and alignment, scalars, a stream. How a
# launch then passes its arguments depends on the entry point the DSL compiled:
#
# - TVM FFI (``apache-tvm-ffi``, which nvidia-cutlass-dsl ships with): a C entry point that
#   takes plain Python values (a pointer as its address, 0 for an absent tensor; ints;
#   floats; the stream's handle) and decodes them in compiled code. The launch costs a few
#   microseconds of host time.
# - otherwise the DSL's own entry point, which converts ``cute.Pointer``/``Int32``/... objects
#   in Python on every launch (a whole cutedsl CE chunk call took 89 us of host time that
#   way on the H200's machine, 21 us through TVM FFI: benchmarks/results/host-overhead-h200).
#
# ``FLCE_CUTEDSL_TVM_FFI=0`` forces the second (to compare, or where TVM FFI misbehaves).
# The launch-argument helpers below (``gmem_ptr``, ``arg_i32``, ``arg_i64``, ``arg_f32``,
# ``cuda_stream``) produce what the compiled entry point takes, so call sites are the same
# either way; compile-time placeholders are always DSL objects (``null_ptr``, ``Int32(1)``).

TVM_FFI_ENV_VAR = "FLCE_CUTEDSL_TVM_FFI"


def _tvm_ffi_calls() -> bool:
    if (os.environ.get(TVM_FFI_ENV_VAR) or "1").strip() == "0":
        return False
    return importlib.util.find_spec("tvm_ffi") is not None


TVM_FFI_CALLS = _tvm_ffi_calls()  # decided once per process: compiled kernels and launches must agree

_COMPILED: dict = {}  # (kind, key, config) -> launcher
_KEEP_ALIVE: list = []  # the compiled functions whose raw TVM FFI entry points are cached


def compile_cached(cache_key: Hashable, build: Callable[[], object]):
    """The launcher of the kernel for ``cache_key`` (everything the kernel bakes in: a
    frozen key and launch config; the row count stays symbolic), built by ``build()`` on
    first use; ``build`` compiles with ``compile_launcher``."""
    fn = _COMPILED.get(cache_key)
    if fn is None:
        fn = _COMPILED[cache_key] = build()
    return fn


def compile_launcher(kernel, *placeholders):
    """``cute.compile(kernel, *placeholders)``, through TVM FFI where it is available, and
    the cheapest callable that launches it: with TVM FFI the raw ``tvm_ffi.Function``
    (positional plain values; the DSL's Python wrapper around it would re-check every
    argument), else the DSL's compiled function. The DSL sees none of the process's
    command line but its own option (``command_line_for_dsl``)."""
    if not TVM_FFI_CALLS:
        with command_line_for_dsl():
            return cute.compile(kernel, *placeholders)
    import tvm_ffi

    with command_line_for_dsl():
        compiled = cute.compile(kernel, *placeholders, options="--enable-tvm-ffi")
    raw = compiled.__tvm_ffi_object__() if hasattr(compiled, "__tvm_ffi_object__") else None
    if raw is None and isinstance(compiled, tvm_ffi.Function):
        raw = tvm_ffi.Function.__call__.__get__(compiled)  # the C call, not the subclass's Python one
    if raw is None:
        return compiled
    _KEEP_ALIVE.append(compiled)  # the raw entry point lives in the compiled module
    return raw


_NULL_PTRS: dict = {}


def null_ptr(dtype, align: int) -> cute.Pointer:
    """A cached compile-time placeholder of a pointer argument (element type, alignment),
    also the DSL entry point's absent optional tensor (never dereferenced)."""
    p = _NULL_PTRS.get((dtype, align))
    if p is None:
        p = cute.runtime.make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=align)
        _NULL_PTRS[(dtype, align)] = p
    return p


# The current stream's raw handle by device index (what Triton's launcher asks too): a
# Stream object from ``torch.cuda.current_stream(device)`` costs microseconds of host time
# per launch. PyTorch's CUDA builds have the raw getter; others fall back to the object.
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream_handle(device: torch.device) -> int:
    """The handle of ``device``'s current CUDA stream."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _current_raw_stream is not None:
        return _current_raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


if TVM_FFI_CALLS:

    def gmem_ptr(tensor: torch.Tensor | None, dtype, align: int) -> int:
        """A launch's pointer argument: the tensor's address (0 for an absent tensor). The
        caller guarantees the ``align`` the kernel was compiled with."""
        return 0 if tensor is None else tensor.data_ptr()

    def gmem_address(address: int, dtype, align: int) -> int:
        """A launch's pointer argument from an address (inside a tensor the caller keeps
        alive, with the ``align`` the kernel was compiled with)."""
        return address

    def cuda_stream(device: torch.device) -> int:
        """A launch's stream argument: the current stream's handle."""
        return current_stream_handle(device)

    arg_i32 = arg_i64 = int  # a launch's Int32 / Int64 argument
    arg_f32 = float  # a launch's Float32 argument

else:
    _STREAMS: dict = {}

    def gmem_ptr(tensor: torch.Tensor | None, dtype, align: int) -> cute.Pointer:
        """A launch's pointer argument (``null_ptr`` for an absent tensor)."""
        if tensor is None:
            return null_ptr(dtype, align)
        return cute.runtime.make_ptr(dtype, tensor.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)

    def gmem_address(address: int, dtype, align: int) -> cute.Pointer:
        """A launch's pointer argument from an address (inside a tensor the caller keeps alive)."""
        return cute.runtime.make_ptr(dtype, address, cute.AddressSpace.gmem, assumed_align=align)

    def cuda_stream(device: torch.device) -> cuda.CUstream:
        """A launch's stream argument: the current stream (its wrapper cached per handle)."""
        raw = current_stream_handle(device)
        s = _STREAMS.get(raw)
        if s is None:
            s = _STREAMS[raw] = cuda.CUstream(raw)
        return s

    arg_i32, arg_i64, arg_f32 = Int32, Int64, Float32
