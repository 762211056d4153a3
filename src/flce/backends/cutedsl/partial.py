"""Split-row kernels in CuTe DSL: a row whose vocabulary is split into column blocks
(the shards of the vocab-parallel loss, or the blocks of ``vocab_chunk_size``).

Same contract as ``flce.backends.triton.partial``. Each launch sees the columns
``[v0, v0 + V_r)`` of every row. ``partial_statistics`` reads the block once and gives,
per row, the local max of ``z'`` and the statistics relative to it (sum of exp, the
target logit where the block owns the target, the class-weighted smoothing sum, the
first local argmax); the caller combines the blocks into the whole row's max ``M`` and
sum ``S``. ``partial_gradient`` then reads the block again and writes, in place, the
gradient with the whole row's softmax ``p_i = exp(z'_i - M) / S`` in the grouped form of
``flce.rows.cross_entropy``.

Both kernels are built from ``flce.backends.cutedsl.ce.RowStream``, the machinery of
the chunk CE kernel: one CTA per row, 64-bit row offsets, ``vec``-element vectors (as
wide as the row stride and the base address allow, ``flce.backends.cutedsl.layout``;
where V_r is not a multiple of them, the last vector is ragged), exponents
``(z' - m) log2(e)`` and ``z' = fma(c, tanh(z / c), +0)``. The statistics stream the row through the
``cp.async`` ring; the gradient is a single read-modify-write of each vector, straight
through registers (nothing is reused, so shared memory would buy nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, const_expr

from flce.backends.base import device_guard, gradient_destination, unit_stride_along_vocabulary
from flce.backends.cutedsl.common import (
    TORCH_TO_CUTE,
    KernelConfig,
    RowStream,
    SmemAllocator,
    arg_f32,
    arg_i32,
    arg_i64,
    cdiv,
    compile_cached,
    compile_launcher,
    cuda_stream,
    gmem_ptr,
    gradient_row_tensors,
    null_ptr,
    pow2_ceil,
    row_threads,
    softcap_tanh,
    softcapped,
)
from flce.backends.cutedsl.layout import row_vector_width

_NAME = "cutedsl split-row kernels"


@dataclass(frozen=True)
class StatisticsKey:
    """Everything ``PartialStatistics`` bakes in; the row count stays symbolic."""

    dtype: torch.dtype
    vocab: int  # V_r, the block's columns
    vec: int  # elements per vector (flce.backends.cutedsl.layout; the last may be ragged)
    target_int64: bool
    has_weight: bool  # class weights in the smoothing sum (only with has_smoothing)
    has_smoothing: bool
    has_softcap: bool
    approximate_tanh: bool  # the softcap's tanh: ChunkScalars.approximate_tanh
    write_argmax: bool


@dataclass(frozen=True)
class GradientKey:
    """Everything ``PartialGradient`` bakes in; the row count stays symbolic."""

    dtype: torch.dtype
    vocab: int  # V_r
    vec: int
    target_int64: bool
    has_weight: bool  # class weights in the smoothing term (only with has_smoothing)
    has_smoothing: bool
    has_softcap: bool
    approximate_tanh: bool  # the softcap's tanh: ChunkScalars.approximate_tanh
    has_z_grad: bool


@cache
def default_config(vocab: int, vec: int) -> KernelConfig:
    """One CTA per row, threads as in the chunk kernel, and a cp.async ring of up to 8
    stages (7 tiles in flight) for the statistics; nothing stays resident (one pass)."""
    num_vec = cdiv(vocab, vec)
    threads = row_threads(num_vec)
    stages = min(8, pow2_ceil(cdiv(num_vec, threads)))
    return KernelConfig(threads=threads, stages=stages, resident=0)


class PartialStatistics(RowStream):
    """Local statistics of each row of a block, one read of the block."""

    # The callers merge blocks by their max of z' (first block wins a tie), so within a
    # block the index is the first one at which z' itself reaches that max.
    argmax_of_softcapped = True

    def __init__(self, key: StatisticsKey, config: KernelConfig):
        assert config.cluster == 1, "one CTA per row"
        super().__init__(key, config, keep_resident=False, need_argmax=key.write_argmax)

    @cute.jit
    def __call__(
        self,
        p_logits: cute.Pointer,  # (M, V_r) logits dtype, row stride `row_stride`
        p_target: cute.Pointer,  # (M,) int64 or int32: local target in [0, V_r) where owned, else outside it
        p_weight: cute.Pointer,  # (V_r,) fp32 local class weights; read only if has_weight
        p_weight_sum: cute.Pointer,  # (1,) fp32: sum of the local class weights; read only if has_weight
        p_max: cute.Pointer,  # (M,) fp32 out: local max of z'
        p_sum: cute.Pointer,  # (M,) fp32 out: sum of exp(z' - local max)
        p_target_shifted: cute.Pointer,  # (M,) fp32 out: z'_y - local max where owned, else 0
        p_smooth: cute.Pointer,  # (M,) fp32 out: sum_i w_i (z'_i - local max); only if has_smoothing
        p_argmax: cute.Pointer,  # (M,) int64 out: first local argmax of z'; only if write_argmax
        num_rows: Int32,  # M
        row_stride: Int64,  # elements between rows of logits (a multiple of vec)
        softcap: Float32,  # c (unused without softcap)
        inv_softcap: Float32,  # 1 / c
        stream: cuda.CUstream,
    ):
        rows = cute.make_layout((num_rows,))
        self.kernel(
            p_logits,
            cute.make_tensor(p_target, rows),  # (M,)
            cute.make_tensor(p_weight, cute.make_layout((self.vec, self.num_vec), stride=(1, self.vec))),
            cute.make_tensor(p_weight_sum, cute.make_layout((1,))),  # (1,)
            cute.make_tensor(p_max, rows),  # (M,)
            cute.make_tensor(p_sum, rows),  # (M,)
            cute.make_tensor(p_target_shifted, rows),  # (M,)
            cute.make_tensor(p_smooth, rows),  # (M,)
            cute.make_tensor(p_argmax, rows),  # (M,)
            row_stride,
            softcap,
            inv_softcap,
        ).launch(grid=[num_rows, 1, 1], block=[self.threads, 1, 1], smem=self.smem_bytes(), stream=stream)

    @cute.kernel
    def kernel(
        self,
        p_logits: cute.Pointer,  # (M, V_r) base of the block
        mTarget: cute.Tensor,  # (M,)
        mWeight: cute.Tensor,  # (vec, ceil(V_r/vec)) fp32
        mWeightSum: cute.Tensor,  # (1,) fp32
        mMax: cute.Tensor,  # (M,)
        mSum: cute.Tensor,  # (M,)
        mTargetShifted: cute.Tensor,  # (M,)
        mSmooth: cute.Tensor,  # (M,)
        mArgmax: cute.Tensor,  # (M,)
        row_stride: Int64,
        softcap: Float32,
        inv_softcap: Float32,
    ):
        key = self.key
        VEC = self.vec
        NV = self.num_vec
        tid, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()

        gRow = self._row_vectors(p_logits, row, row_stride)  # (VEC, ceil(V_r/VEC))

        smem = SmemAllocator()
        sRed = smem.allocate_tensor(Float32, cute.make_layout((self.num_warps, 5)), byte_alignment=16)  # (warps, 5)
        sArg = smem.allocate_tensor(Int32, cute.make_layout((self.num_warps,)), byte_alignment=16)  # (warps,)
        sBuf, copy_atom = self._stream_smem(smem)

        # The local target: any value outside [0, V_r) means another block owns it.
        y_raw = Int64(mTarget[row])
        owned = Int32(0)
        y = Int32(0)  # column 0 stands in for an unowned target (read, never used)
        if y_raw >= Int64(0):
            if y_raw < Int64(self.vocab):
                owned = Int32(1)
                y = Int32(y_raw)
        z_y = Float32(gRow[y % VEC, y // VEC])

        m, d, sxs, best_v, best_i = self._pass1(gRow, sBuf, copy_atom, 0, NV, tid, mWeight, softcap, inv_softcap)
        m, d, sxs, best_v, best_i = self._reduce_cta(m, d, sxs, best_v, best_i, sRed, sArg, lane, warp)

        if const_expr(key.write_argmax):
            # A block holding a NaN reports a NaN max (its argmax is the first NaN's column):
            # the combination of the blocks ranks it above every number, as torch.argmax
            # does (flce.rows.cross_entropy.combine_blocks). Its sum is NaN already.
            if best_v != best_v:
                m = best_v
        if tid == 0:
            mMax[row] = m
            mSum[row] = d
            zp_y = z_y
            if const_expr(key.has_softcap):
                # The same operations as pass 1, so z'_y - m is exactly 0 at the max.
                zp_y = softcapped(softcap_tanh(z_y * inv_softcap, self.tanh_approx), softcap)
            mTargetShifted[row] = zp_y - m if owned != Int32(0) else Float32(0.0)
            if const_expr(key.has_smoothing):
                # sum_i w_i z'_i - m sum_i w_i, with one rounding for the product and the
                # difference; the caller adds back m times the same local weight sum.
                w_sum = Float32(self.vocab)
                if const_expr(key.has_weight):
                    w_sum = mWeightSum[0]
                mSmooth[row] = cute.math.fma(-m, w_sum, sxs)
            if const_expr(key.write_argmax):
                mArgmax[row] = Int64(best_i)


class PartialGradient(RowStream):
    """The gradient of each row of a block, in place, from the whole row's statistics."""

    def __init__(self, key: GradientKey, config: KernelConfig):
        assert config.cluster == 1, "one CTA per row"
        super().__init__(key, config, keep_resident=False, need_argmax=False)

    @cute.jit
    def __call__(
        self,
        p_logits: cute.Pointer,  # (M, V_r) logits dtype, overwritten with dL/dlogits
        p_target: cute.Pointer,  # (M,) int64 or int32: local target where owned, >= V_r if not, < 0 on ignored rows
        p_weight: cute.Pointer,  # (V_r,) fp32 local class weights; read only if has_weight
        p_row_max: cute.Pointer,  # (M,) fp32: the whole row's max of z'
        p_inv_sum: cute.Pointer,  # (M,) fp32: 1 / the whole row's sum of exp(z' - max)
        p_onehot_coef: cute.Pointer,  # (M,) fp32: row_scale * ce_grad_scale * (1 - ls) * w_y
        p_smooth_coef: cute.Pointer,  # (M,) fp32: row_scale * ce_grad_scale * eps; only if has_smoothing
        p_z_coef: cute.Pointer,  # (M,) fp32: row_scale * z_grad_scale * 2 s lse; only if has_z_grad
        p_weight_sum: cute.Pointer,  # (1,) fp32 W: sum of the class weights of the whole row (its V without)
        num_rows: Int32,  # M
        row_stride: Int64,  # elements between rows of logits (a multiple of vec)
        softcap: Float32,  # c (unused without softcap)
        inv_softcap: Float32,  # 1 / c
        stream: cuda.CUstream,
    ):
        rows = cute.make_layout((num_rows,))
        self.kernel(
            p_logits,
            cute.make_tensor(p_target, rows),  # (M,)
            cute.make_tensor(p_weight, cute.make_layout((self.vec, self.num_vec), stride=(1, self.vec))),
            *gradient_row_tensors(rows, p_row_max, p_inv_sum, p_onehot_coef, p_smooth_coef, p_z_coef, p_weight_sum),
            row_stride,
            softcap,
            inv_softcap,
        ).launch(grid=[num_rows, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        p_logits: cute.Pointer,  # (M, V_r) base of the block
        mTarget: cute.Tensor,  # (M,)
        mWeight: cute.Tensor,  # (vec, ceil(V_r/vec)) fp32
        mRowMax: cute.Tensor,  # (M,)
        mInvSum: cute.Tensor,  # (M,)
        mOnehotCoef: cute.Tensor,  # (M,)
        mSmoothCoef: cute.Tensor,  # (M,)
        mZCoef: cute.Tensor,  # (M,)
        mWeightSum: cute.Tensor,  # (1,) fp32
        row_stride: Int64,
        softcap: Float32,
        inv_softcap: Float32,
    ):
        key = self.key
        T = self.threads
        VEC = self.vec
        NV = self.num_vec
        NT = self.num_tiles
        tid, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()

        gRow = self._row_vectors(p_logits, row, row_stride)  # (VEC, ceil(V_r/VEC))

        y_raw = Int64(mTarget[row])
        if y_raw >= Int64(0):
            # An unowned target becomes column V_r, which no written lane of the row holds
            # (past a ragged last vector's columns, or past the last vector).
            y = Int32(self.vocab)
            if y_raw < Int64(self.vocab):
                y = Int32(y_raw)
            coef_eps = Float32(0.0)
            if const_expr(key.has_smoothing):
                coef_eps = mSmoothCoef[row]
            coef_z = Float32(0.0)  # fma(0, p, g) = g: no z-loss term
            if const_expr(key.has_z_grad):
                coef_z = mZCoef[row]
            coefs = (mRowMax[row], mInvSum[row], mOnehotCoef[row], coef_eps, coef_z, mWeightSum[0])
            vidx = tid
            for _ in cutlass.range(NT, unroll=1):
                if vidx < NV:
                    frag = cute.make_rmem_tensor((VEC,), self.dtype)
                    cute.autovec_copy(gRow[None, vidx], frag)
                    self._grad_step(frag, vidx, gRow, mWeight, y, coefs, softcap, inv_softcap)
                vidx = vidx + T
        else:
            # Ignored row: explicit zeros (no statistics of it are read; they may be anything).
            zeros = cute.make_rmem_tensor((VEC,), self.dtype)
            zeros.fill(0.0)
            vidx = tid
            for _ in cutlass.range(NT, unroll=1):
                if vidx < NV:
                    self._store_vector(zeros, gRow, vidx)
                vidx = vidx + T


# ---------------------------------------------------------------------- host wrappers
def _compile(kernel_cls, key, config: KernelConfig, args: tuple):
    """The compiled ``kernel_cls(key, config)`` (cached); ``args`` are placeholders of
    the launch arguments' types (pointers with their alignment, scalars, a stream)."""
    return compile_cached((kernel_cls, key, config), lambda: compile_launcher(kernel_cls(key, config), *args))


def _row_pointers(key: StatisticsKey | GradientKey, fp32_rows: int) -> tuple:
    """Placeholders of the launch arguments both kernels share: the logits (aligned to one
    vector), the targets, the 16-byte aligned class weights, then ``fp32_rows`` fp32 vectors
    (per row, or the class weights' sum)."""
    target_t = Int64 if key.target_int64 else Int32
    return (
        null_ptr(TORCH_TO_CUTE[key.dtype], key.vec * key.dtype.itemsize),
        null_ptr(target_t, target_t.width // 8),
        null_ptr(Float32, 16),
        *(null_ptr(Float32, 4) for _ in range(fp32_rows)),
    )


def compile_statistics(key: StatisticsKey):
    """The compiled ``PartialStatistics`` for ``key`` (cached)."""
    return _compile(
        PartialStatistics,
        key,
        default_config(key.vocab, key.vec),
        (
            *_row_pointers(key, fp32_rows=5),  # weight_sum, row_max, row_sum, target_shifted, smooth
            null_ptr(Int64, 8),  # argmax
            Int32(1),
            Int64(key.vocab),
            Float32(1.0),
            Float32(1.0),
            cuda.CUstream(0),
        ),
    )


def compile_gradient(key: GradientKey):
    """The compiled ``PartialGradient`` for ``key`` (cached)."""
    return _compile(
        PartialGradient,
        key,
        default_config(key.vocab, key.vec),
        (
            *_row_pointers(key, fp32_rows=6),  # row_max, inv_sum, onehot, smooth, z coefficients, weight_sum
            Int32(1),
            Int64(key.vocab),
            Float32(1.0),
            Float32(1.0),
            cuda.CUstream(0),
        ),
    )


def _check_logits(logits: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"{_NAME}: logits must be 2-D (M, V_r), got shape {tuple(logits.shape)}")
    if logits.dtype not in TORCH_TO_CUTE:
        raise TypeError(f"{_NAME}: logits must be fp16/bf16/fp32, got {logits.dtype}")
    if logits.device.type != "cuda":
        raise ValueError(f"{_NAME}: logits must be on a CUDA device, got {logits.device}")
    if logits.shape[1] == 0:
        raise ValueError(f"{_NAME}: the block has no columns (V_r = 0)")
    if not unit_stride_along_vocabulary(logits):
        raise ValueError(
            f"{_NAME}: logits must have unit stride along the vocabulary, got strides {tuple(logits.stride())}"
        )


def _target(local_target: torch.Tensor, num_rows: int) -> torch.Tensor:
    if local_target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{_NAME}: local_target must be int64 or int32, got {local_target.dtype}")
    if tuple(local_target.shape) != (num_rows,):
        raise ValueError(f"{_NAME}: local_target must have shape ({num_rows},), got {tuple(local_target.shape)}")
    return local_target if local_target.is_contiguous() else local_target.contiguous()


def _row_vector(name: str, t: torch.Tensor | None, num_rows: int) -> torch.Tensor | None:
    """A per-row fp32 input as a contiguous (M,) tensor (a strided view is copied)."""
    if t is None:
        return None
    if t.dtype != torch.float32:
        raise TypeError(f"{_NAME}: {name} must be float32, got {t.dtype}")
    if tuple(t.shape) != (num_rows,):
        raise ValueError(f"{_NAME}: {name} must have shape ({num_rows},), got {tuple(t.shape)}")
    return t if t.is_contiguous() else t.contiguous()


def _class_weights(ce_weight: torch.Tensor, vocab_local: int) -> torch.Tensor:
    """fp32, contiguous and 16-byte aligned (the kernels read it in vectors); a slice of
    the full weight vector usually is not aligned, and is copied (V_r values)."""
    if tuple(ce_weight.shape) != (vocab_local,):
        raise ValueError(f"{_NAME}: ce_weight must have shape ({vocab_local},), got {tuple(ce_weight.shape)}")
    if ce_weight.dtype != torch.float32 or not ce_weight.is_contiguous() or ce_weight.data_ptr() % 16:
        ce_weight = ce_weight.to(torch.float32).contiguous().clone()
    return ce_weight


def _softcap_args(softcap: float | None) -> tuple:
    return (arg_f32(1.0), arg_f32(1.0)) if softcap is None else (arg_f32(softcap), arg_f32(1.0 / softcap))


def partial_statistics(
    logits: torch.Tensor,  # (M, V_r) fp16/bf16/fp32, unit stride along V_r
    local_target: torch.Tensor,  # (M,) int64 (or int32), outside [0, V_r) where not owned
    ce_weight: torch.Tensor | None,  # (V_r,) fp32 local slice
    softcap: float | None,
    with_smoothing: bool,
    with_argmax: bool,
    approximate_tanh: bool = False,  # ChunkScalars.approximate_tanh
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """-> (local max, sum exp(z' - max), z'_y - max or 0, smoothing sum or None, argmax or None),
    all (M,): fp32, the argmax int64."""
    _check_logits(logits)
    num_rows, vocab_local = logits.shape
    target = _target(local_target, num_rows)
    device = logits.device

    def f32():
        return torch.empty(num_rows, dtype=torch.float32, device=device)

    row_max, row_sum, target_shifted = f32(), f32(), f32()
    smooth = f32() if with_smoothing else None
    argmax = torch.empty(num_rows, dtype=torch.int64, device=device) if with_argmax else None
    if num_rows == 0:
        return row_max, row_sum, target_shifted, smooth, argmax
    # The class weights enter only the smoothing sum.
    weight = _class_weights(ce_weight, vocab_local) if (with_smoothing and ce_weight is not None) else None
    weight_sum = weight.sum().reshape(1) if weight is not None else None  # (1,), stays on the device
    key = StatisticsKey(
        dtype=logits.dtype,
        vocab=vocab_local,
        vec=row_vector_width(logits),
        target_int64=target.dtype == torch.int64,
        has_weight=weight is not None,
        has_smoothing=bool(with_smoothing),
        has_softcap=softcap is not None,
        approximate_tanh=softcap is not None and approximate_tanh,  # one key without a softcap
        write_argmax=bool(with_argmax),
    )
    dtype = TORCH_TO_CUTE[key.dtype]
    align = key.vec * logits.element_size()
    target_t = Int64 if key.target_int64 else Int32
    fn = compile_statistics(key)
    with device_guard(device):
        fn(
            gmem_ptr(logits, dtype, align),
            gmem_ptr(target, target_t, target.element_size()),
            gmem_ptr(weight, Float32, 16),
            gmem_ptr(weight_sum, Float32, 4),
            gmem_ptr(row_max, Float32, 4),
            gmem_ptr(row_sum, Float32, 4),
            gmem_ptr(target_shifted, Float32, 4),
            gmem_ptr(smooth, Float32, 4),
            gmem_ptr(argmax, Int64, 8),
            arg_i32(num_rows),
            arg_i64(logits.stride(0)),
            *_softcap_args(softcap),
            cuda_stream(device),
        )
    return row_max, row_sum, target_shifted, smooth, argmax


def partial_gradient(
    logits: torch.Tensor,  # (M, V_r) overwritten with the gradient
    local_target: torch.Tensor,  # (M,) int64 (or int32): owned index, V_r if not owned, -1 on ignored rows
    ce_weight: torch.Tensor | None,  # (V_r,) fp32 local slice
    row_max: torch.Tensor,  # (M,) fp32 global max
    inv_sum: torch.Tensor,  # (M,) fp32
    onehot_coef: torch.Tensor,  # (M,) fp32
    smooth_coef: torch.Tensor | None,  # (M,) fp32, with label smoothing
    z_coef: torch.Tensor | None,  # (M,) fp32, with z-loss
    weight_sum: torch.Tensor,  # () fp32 on the device: read by the kernel, no host sync
    softcap: float | None,
    approximate_tanh: bool = False,  # ChunkScalars.approximate_tanh
) -> None:
    """Writes dL/dlogits over ``logits``: zeros on ignored rows (``local_target < 0``)."""
    _check_logits(logits)
    gradient_destination(logits, None, True)  # written in place: each row needs its own memory
    num_rows, vocab_local = logits.shape
    if num_rows == 0:
        return
    target = _target(local_target, num_rows)
    row_max = _row_vector("row_max", row_max, num_rows)
    inv_sum = _row_vector("inv_sum", inv_sum, num_rows)
    onehot_coef = _row_vector("onehot_coef", onehot_coef, num_rows)
    smooth_coef = _row_vector("smooth_coef", smooth_coef, num_rows)
    z_coef = _row_vector("z_coef", z_coef, num_rows)
    # The class weights enter only the smoothing term.
    weight = _class_weights(ce_weight, vocab_local) if (smooth_coef is not None and ce_weight is not None) else None
    key = GradientKey(
        dtype=logits.dtype,
        vocab=vocab_local,
        vec=row_vector_width(logits),
        target_int64=target.dtype == torch.int64,
        has_weight=weight is not None,
        has_smoothing=smooth_coef is not None,
        has_softcap=softcap is not None,
        approximate_tanh=softcap is not None and approximate_tanh,
        has_z_grad=z_coef is not None,
    )
    dtype = TORCH_TO_CUTE[key.dtype]
    align = key.vec * logits.element_size()
    target_t = Int64 if key.target_int64 else Int32
    fn = compile_gradient(key)
    weight_sum = weight_sum.to(device=logits.device, dtype=torch.float32).reshape(1)
    with device_guard(logits.device):
        fn(
            gmem_ptr(logits, dtype, align),
            gmem_ptr(target, target_t, target.element_size()),
            gmem_ptr(weight, Float32, 16),
            gmem_ptr(row_max, Float32, 4),
            gmem_ptr(inv_sum, Float32, 4),
            gmem_ptr(onehot_coef, Float32, 4),
            gmem_ptr(smooth_coef, Float32, 4),
            gmem_ptr(z_coef, Float32, 4),
            gmem_ptr(weight_sum, Float32, 4),
            arg_i32(num_rows),
            arg_i64(logits.stride(0)),
            *_softcap_args(softcap),
            cuda_stream(logits.device),
        )
