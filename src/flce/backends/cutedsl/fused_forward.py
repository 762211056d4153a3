"""Fused forward LM-head statistics for Hopper (sm_90a) in CuTe DSL: a WGMMA + TMA GEMM
whose epilogue reduces each logits tile to a few numbers per row instead of storing it.

The logits ``Z = X @ W^T`` (X: (N, H), W: (V, H), both K-major, fp16/bf16, fp32
accumulation) are computed tile by tile, ``BM x BN`` per CTA, exactly as a plain Hopper
GEMM: a multi-stage TMA ring (optionally multicast across a thread-block cluster) feeds
WGMMAs issued by ``BM / 64`` warpgroups. The CTAs are warp-specialised and persistent:
one thread of an extra warpgroup issues every TMA copy, and each cluster loops over its
share of the tiles, so the ring is refilled with the next tile while the MMA warpgroups
run this tile's epilogue (``FusedForwardConfig.persistent`` turns the loop into one
cluster per tile). The epilogue never writes Z. For every row ``n`` of the tile and the
tile's vocabulary slice ``t`` (columns ``[t * BN, (t + 1) * BN)``) it writes

- ``tile_max[t, n]``: the max of ``z'`` over the tile's valid columns, with ``z`` the
  logit plus the optional bias and ``z' = c * tanh(z / c)`` under the optional softcap
  (the hardware's approximate tanh: ``flce.backends.base.softcap_tanh_is_approximate``),
- ``tile_sumexp[t, n]``: ``sum exp(z' - tile_max)``, each term one FMA and one exp2,
- ``tile_argmax[t, n]``: the first (smallest) global column achieving the tile max, or
  the tile's first NaN column, whose max is then NaN (``torch.argmax``'s order),
- ``tile_sum[t, n]`` (``with_logit_sum`` only): ``sum z'``, the label-smoothing term,

and the CTA holding column ``target[n]`` writes ``target_logit[n] = z'``; a CTA of the first
tile writes 0 there for a target outside [0, V) (ignore_index). One writer per row, so no
race, and every row written: the output takes no zero fill before the launch. Columns
``>= V`` of the last tile (V = 32000, 151936, 128256 are not multiples of BN) are
excluded; rows ``>= N`` are read as zeros by TMA and never written.

Reduction: in a WGMMA accumulator fragment a row's columns are spread over the 4 lanes of
a quad, BN / 4 values per lane. Partitioning an identity tensor like the accumulator
gives each value its (m, n) coordinate; a row is reduced in registers, then across the
quad with two butterfly shuffles. No shared memory and no barrier are needed.

Argmax: within a tile it is taken on ``z`` before the softcap (strictly increasing, so the
same column) so that fp32 ``tanh`` saturation cannot create ties the exact math does not
have. Across tiles the first tile achieving the global max of ``tile_max`` wins; as the
tile's argmax columns increase with the tile index, that is the smallest ``tile_argmax``
among the tiles achieving the max. A NaN ranks above every number, as in ``torch.argmax``:
``fmax`` drops it, so each value is also tested (``z != z``, one compare), a tile holding
a NaN reports its first NaN column and a NaN max, and the first such tile wins.

The statistics are stored tile-major, ``(T, rows)``, so that the lanes of a warp (rows
``r .. r+7``) write neighbouring words. ``CombineTileStatisticsKernel`` then reduces them,
four lanes per row: ``lse = M + log(sum_t s_t exp(m_t - M))`` with ``M = max_t m_t``.
Their size is ``T * rows * 12`` bytes (16 with the logit sum); launches cover at most as
many rows as fit in ``workspace_bytes``, in whole cluster row blocks (48 MiB by default:
N = 8192 at V = 128256 in one launch), which bounds the peak extra memory by that budget
plus the O(N) outputs.

Launch shape (``default_config``, per GPU): persistent clusters of two CTAs along M that
share each W tile through TMA multicast, with one of two tilings, each the fastest measured
on one GPU (bf16, H = 4096, N = 8192; CUDA events, each call after 100 ms of GEMMs,
interleaved with ``torch.mm`` of the same logits):

- ping-pong (``PINGPONG_CONFIG``): two MMA warpgroups on alternate 64 x 256 tiles, one's
  epilogue (an exp per logit) under the other's main loop. On an H200, 0.976x ``torch.mm``
  at V = 32000, 1.010x at 128256, 1.025x at 151936 and 0.998x at 262144, against 1.038x,
  1.043x, 1.046x and 1.033x for the cooperative tiles (median of 12 rounds, 2026-12-02;
  with W multicast to 4 CTAs ping-pong took 1.057x at V = 32000,
  ``benchmarks/results/fused-forward-gemm-h200/``).
- cooperative (``COOPERATIVE_CONFIG``): both MMA warpgroups on one 128 x 256 tile, the
  epilogue stalling the tensor cores, but each W tile read once per 256 rows instead of
  128: half the operand traffic per flop. On an H100 80GB HBM3, 1.037x ``torch.mm`` at
  V = 32000 and 1.031x at 128256, where ping-pong took 1.286x and 1.299x (median of 6
  rounds, 2026-12-05, ``benchmarks/results/fused-forward-gemm-h100/``): that GPU's
  memory (3.35 TB/s against the H200's 4.8) does not feed ping-pong's traffic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache, lru_cache, partial

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass import Float32, Int32, Int64, const_expr

from flce.backends.base import device_guard, softcap_tanh_is_approximate
from flce.backends.cutedsl import (
    FUSED_FORWARD_LAUNCH_ROWS_MULTIPLE,
    FUSED_FORWARD_WORKSPACE_BYTES,
    fused_forward_rows_per_launch,
)
from flce.backends.cutedsl.common import (
    LOG2_E,
    NEG_BIG,
    SMEM_LIMIT,
    arg_f32,
    arg_i32,
    argmax_combine,
    cdiv,
    compile_cached,
    compile_launcher,
    cuda_stream,
    gmem_address,
    gmem_ptr,
    null_ptr,
    softcap_tanh,
)

INT32_MAX = 2**31 - 1
MBAR_BYTES = 1024  # pipeline mbarriers and alignment slack
BLOCK_K = 64  # four k=16 WGMMA steps per stage: one 128-byte swizzle atom of bf16/fp16
# The per-tile statistics of N = 8192 rows at V = 128256 (501 tiles x 12 bytes a row) fit,
# so the reference shape runs in one launch while staying under 64 MiB of extra memory.
# Declared with the backend (the memory model reads it there, without cutlass).
DEFAULT_WORKSPACE_BYTES = FUSED_FORWARD_WORKSPACE_BYTES
# Registers per thread after the warp-specialised split (setmaxnreg): the loader warpgroup
# needs few; the MMA warpgroups hold a 64 x BN fp32 accumulator (128 registers at BN = 256)
# plus the epilogue's temporaries. 128 * 40 + 256 * 232 fits the 64 K registers of an SM.
LOADER_REGISTERS = 40
MMA_REGISTERS = 232
# Named barriers 1 and 2 order the ping-pong warpgroups' main loops (0 is __syncthreads).
PINGPONG_BARRIER = 1

# WGMMA operand types: the kernel takes bf16/fp16 only.
WGMMA_DTYPES = {torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16}


@dataclass(frozen=True)
class FusedForwardKey:
    """Everything a compiled kernel bakes in; the row count stays symbolic."""

    dtype: torch.dtype  # of input and weight: torch.bfloat16 or torch.float16
    vocab: int  # V
    hidden: int  # H, a multiple of BLOCK_K
    target_int64: bool
    has_bias: bool
    has_softcap: bool
    with_logit_sum: bool


@dataclass(frozen=True)
class FusedForwardConfig:
    """Launch shape: a ``tile_m x tile_n`` CTA tile (``tile_m / 64`` MMA warpgroups, each
    owning 64 rows, or with ``pingpong`` two, each on its own tile; plus one warpgroup
    whose first warp issues the TMA copies), ``stages``
    of the TMA ring (0: as many as fit in shared memory), a ``cluster_m x cluster_n``
    thread-block cluster (CTAs of one cluster column share the W tile through multicast,
    CTAs of one cluster row share the X tile) and whether CTAs are persistent. The field
    defaults are the plain 1 x 1 cluster shape; ``default_config`` picks the shipped one per GPU."""

    tile_m: int = 128
    tile_n: int = 256
    stages: int = 0
    cluster_m: int = 1
    cluster_n: int = 1
    # Persistent: as many clusters as fit on the GPU at once, each looping over its tiles,
    # so the TMA warp loads the next tile while the MMA warpgroups run this one's epilogue.
    # False launches one cluster per tile (same kernel, the loop runs once).
    persistent: bool = True
    # Ping-pong: two MMA warpgroups take alternate tiles, each a whole 64-row tile, so one
    # runs its epilogue while the other multiplies (needs tile_m = 64). Otherwise the
    # tile_m / 64 warpgroups share every tile and the epilogue stalls the tensor cores.
    pingpong: bool = False

    def validate(self) -> None:
        if self.tile_m not in (64, 128):
            raise ValueError(f"tile_m must be 64 or 128, got {self.tile_m}")
        if self.tile_n not in (64, 128, 192, 256):
            raise ValueError(f"tile_n must be 64, 128, 192 or 256, got {self.tile_n}")
        for name, c in (("cluster_m", self.cluster_m), ("cluster_n", self.cluster_n)):
            if c not in (1, 2, 4):
                raise ValueError(f"{name} must be 1, 2 or 4, got {c}")
        if self.cluster_m * self.cluster_n > 4:
            raise ValueError("a cluster holds at most 4 CTAs here (cluster_m * cluster_n <= 4)")
        if self.stages < 0 or self.stages == 1:
            raise ValueError(f"stages must be 0 (auto) or >= 2, got {self.stages}")
        if self.pingpong and self.tile_m != 64:
            raise ValueError(f"pingpong gives each warpgroup a whole tile: tile_m must be 64, got {self.tile_m}")


# The two launch shapes of the module docstring. Ping-pong: two MMA warpgroups on alternate
# 64 x 256 tiles, so one's epilogue (an exp per logit) runs under the other's main loop
# instead of stalling the tensor cores; each W tile multicast to the two CTAs of an M
# cluster, which halves the reads of W, the larger operand of the tile; persistent CTAs load
# a tile's operands under the last one's epilogue.
PINGPONG_CONFIG = FusedForwardConfig(tile_m=64, cluster_m=2, pingpong=True)
# Cooperative: both MMA warpgroups on one 128 x 256 tile in the same clusters: the epilogue
# stalls the tensor cores, but each W tile serves 256 rows, half ping-pong's reads per flop.
COOPERATIVE_CONFIG = FusedForwardConfig(cluster_m=2)
# Hopper GPUs with HBM3e (H200 141 GB, GH200 144 GB; 4.8-4.9 TB/s) have more memory than
# this, those with HBM3 (H100 80 and 94 GB, H800, H20 and GH200 96 GB; at most 4 TB/s) less.
HBM3E_MIN_MEMORY_BYTES = 120 * 2**30


def launch_shape_for_memory(total_memory_bytes: int) -> FusedForwardConfig:
    """Ping-pong on a GPU with HBM3e's bandwidth, cooperative otherwise (module docstring).

    Ping-pong won by 2.0-6.4% on an H200 and lost by 24-26% on an H100 80GB, whose GEMMs are
    as fast but whose memory is 30% slower: the cooperative shape costs little where
    ping-pong wins and saves a quarter where it loses, so a GPU not known to have the
    bandwidth gets it. The memory's size tells the two kinds of Hopper parts apart
    (``HBM3E_MIN_MEMORY_BYTES``)."""
    return PINGPONG_CONFIG if total_memory_bytes >= HBM3E_MIN_MEMORY_BYTES else COOPERATIVE_CONFIG


@cache
def default_config(device_index: int) -> FusedForwardConfig:
    """The launch shape of the fused kernels (this one and ``fused_gradient``'s) on a CUDA device."""
    return launch_shape_for_memory(torch.cuda.get_device_properties(device_index).total_memory)


def _stage_bytes(config: FusedForwardConfig, esize: int) -> int:
    return (config.tile_m + config.tile_n) * BLOCK_K * esize


def _num_stages(config: FusedForwardConfig, esize: int) -> int:
    """``config.stages``, or as many stages as fit (4 for 128 x 256 tiles, 7 for 128 x 128),
    capped at 8: beyond that the ring hides no more latency."""
    fit = (SMEM_LIMIT - MBAR_BYTES) // _stage_bytes(config, esize)
    if config.stages:
        if config.stages > fit:
            raise ValueError(f"stages={config.stages} does not fit in shared memory (at most {fit} for this tile)")
        return config.stages
    return min(8, fit)


def acc_mn_view(t: cute.Tensor) -> cute.Tensor:
    """View a WGMMA accumulator partition, ``((2, 2, BN/8), MMA_M, MMA_N)`` (column pair,
    row half, column block), as ``((2, MMA_M), (2, BN/8, MMA_N))``: mode 0 walks the rows a
    thread holds, mode 1 the columns it holds of each of them. Works as well for the
    coordinate (identity) tensor partitioned the same way."""
    shape = t.layout.shape
    compact = cute.make_layout(shape)  # indexes the fragment in its natural order
    st = compact.stride
    mn = cute.make_layout(
        ((shape[0][1], shape[1]), (shape[0][0], shape[0][2], shape[2])),
        stride=((st[0][1], st[1]), (st[0][0], st[0][2], st[2])),
    )
    return cute.make_tensor(t.iterator, cute.composition(t.layout, mn))


class FusedForwardKernel:
    """The kernel for one ``FusedForwardKey`` and ``FusedForwardConfig``; rows are dynamic."""

    def __init__(self, key: FusedForwardKey, config: FusedForwardConfig):
        config.validate()
        if key.hidden % BLOCK_K:
            raise ValueError(f"hidden must be a multiple of {BLOCK_K}, got {key.hidden}")
        self.key = key
        self.config = config
        self.dtype = WGMMA_DTYPES[key.dtype]
        self.esize = torch.empty((), dtype=key.dtype).element_size()
        self.tanh_approx = softcap_tanh_is_approximate(key.dtype, torch.device("cuda"))  # always: 16-bit
        self.bm, self.bn = config.tile_m, config.tile_n
        self.tile_shape_mnk = (self.bm, self.bn, BLOCK_K)
        self.num_tiles_n = cdiv(key.vocab, self.bn)  # T
        self.cluster_shape_mn = (config.cluster_m, config.cluster_n)
        # Warpgroups multiplying one tile together (64 rows each), and in all: ping-pong has
        # two, each on its own tile.
        self.tile_warp_groups = self.bm // 64
        self.mma_warp_groups = 2 if config.pingpong else self.tile_warp_groups
        # Warpgroup 0 loads (its first warp issues every TMA copy), the others multiply.
        self.threads = 128 * (1 + self.mma_warp_groups)
        self.stages = _num_stages(config, self.esize)
        # X is shared by the CTAs of a cluster row (same rows, other vocab tiles), W by those
        # of a cluster column.
        self.num_mcast_a = config.cluster_n
        self.num_mcast_b = config.cluster_m
        self.buffer_align_bytes = 1024

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        p_x: cute.Pointer,  # (N, H) fp16/bf16 row-major, 16-byte aligned
        p_w: cute.Pointer,  # (V, H) same dtype row-major, 16-byte aligned
        p_target: cute.Pointer,  # (N,) int64 or int32
        p_bias: cute.Pointer,  # (V,) fp32; read only if has_bias
        p_max: cute.Pointer,  # (T, N) fp32
        p_sumexp: cute.Pointer,  # (T, N) fp32
        p_argmax: cute.Pointer,  # (T, N) int32
        p_sum: cute.Pointer,  # (T, N) fp32; written only if with_logit_sum
        p_target_logit: cute.Pointer,  # (N,) fp32
        num_rows: Int32,  # N
        softcap: Float32,  # c (unused without softcap)
        inv_softcap: Float32,  # 1 / c
        max_clusters: Int32,  # clusters launched at most (persistent: those resident at once)
        stream: cuda.CUstream,
    ):
        key = self.key
        T = self.num_tiles_n
        rows = cute.make_layout((num_rows,))
        stats = cute.make_layout((T, num_rows), stride=(num_rows, 1))
        epilogue_tensors = (
            cute.make_tensor(p_target, rows),  # (N,)
            cute.make_tensor(p_bias, cute.make_layout((key.vocab,))),  # (V,)
            cute.make_tensor(p_max, stats),  # (T, N)
            cute.make_tensor(p_sumexp, stats),  # (T, N)
            cute.make_tensor(p_argmax, stats),  # (T, N)
            cute.make_tensor(p_sum, stats),  # (T, N)
            cute.make_tensor(p_target_logit, rows),  # (N,)
        )
        self._launch(p_x, p_w, epilogue_tensors, num_rows, softcap, inv_softcap, max_clusters, stream)

    @cute.jit
    def _launch(
        self,
        p_x: cute.Pointer,  # (N, H) row-major, 16-byte aligned
        p_w: cute.Pointer,  # (V, H) row-major, 16-byte aligned
        epilogue_tensors: tuple,  # what ``_epilogue`` reads and writes, as global tensors
        num_rows: Int32,
        softcap: Float32,
        inv_softcap: Float32,
        max_clusters: Int32,
        stream: cuda.CUstream,
    ):
        """The GEMM's TMA views, shared-memory layout and persistent grid; the tile loop
        hands each tile's accumulator to ``_epilogue`` with ``epilogue_tensors``."""
        H = self.key.hidden
        V = self.key.vocab
        T = self.num_tiles_n
        mX = cute.make_tensor(p_x, cute.make_layout((num_rows, H), stride=(H, 1)))  # (N, H)
        mW = cute.make_tensor(p_w, cute.make_layout((V, H), stride=(H, 1)))  # (V, H)

        a_layout = utils.LayoutEnum.from_tensor(mX)
        b_layout = utils.LayoutEnum.from_tensor(mW)
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            a_layout.sm90_mma_major_mode(),
            b_layout.sm90_mma_major_mode(),
            Float32,
            (self.tile_warp_groups, 1, 1),
            tiler_mn=(64, self.bn),
        )
        a_smem_layout_staged = sm90_utils.make_smem_layout_a(a_layout, self.tile_shape_mnk, self.dtype, self.stages)
        b_smem_layout_staged = sm90_utils.make_smem_layout_b(b_layout, self.tile_shape_mnk, self.dtype, self.stages)
        tma_atom_a, tma_tensor_a = self._make_tma(mX, a_smem_layout_staged, (self.bm, BLOCK_K), self.num_mcast_a)
        tma_atom_b, tma_tensor_b = self._make_tma(mW, b_smem_layout_staged, (self.bn, BLOCK_K), self.num_mcast_b)
        cta_layout_mnk = cute.make_layout((*self.cluster_shape_mn, 1))

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(a_smem_layout_staged)], self.buffer_align_bytes
            ]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(b_smem_layout_staged)], self.buffer_align_bytes
            ]

        self.shared_storage = SharedStorage

        # The output is tiled in cluster tiles (cm x cn CTA tiles); a 1-D grid of clusters
        # walks them, cluster c taking tiles c, c + launched, c + 2 * launched, ...
        cm, cn = self.cluster_shape_mn
        cluster_rows = (num_rows + self.bm * cm - 1) // (self.bm * cm)
        cluster_cols = cdiv(T, cn)
        launched = cutlass.min(cluster_rows * cluster_cols, max_clusters)
        self.kernel(
            tma_atom_a,
            tma_tensor_a,
            tma_atom_b,
            tma_tensor_b,
            epilogue_tensors,
            tiled_mma,
            cta_layout_mnk,
            a_smem_layout_staged,
            b_smem_layout_staged,
            num_rows,
            cluster_rows,
            softcap,
            inv_softcap,
        ).launch(
            grid=[launched * cm, cn, 1],
            block=[self.threads, 1, 1],
            cluster=[cm, cn, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    @staticmethod
    def _make_tma(tensor: cute.Tensor, smem_layout_staged, smem_tile, mcast: int):
        op = (
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
            if mcast == 1
            else (cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp())
        )
        smem_layout = cute.slice_(smem_layout_staged, (None, None, 0))
        return cute.nvgpu.cpasync.make_tiled_tma_atom(op, tensor, smem_layout, smem_tile, num_multicast=mcast)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,  # (N, H) TMA view of X
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,  # (V, H) TMA view of W
        epilogue_tensors: tuple,  # ``_epilogue``'s global tensors
        tiled_mma: cute.TiledMma,
        cta_layout_mnk: cute.Layout,
        a_smem_layout_staged: cute.ComposedLayout,
        b_smem_layout_staged: cute.ComposedLayout,
        num_rows: Int32,
        cluster_rows: Int32,  # ceil(N / (BM * cluster_m))
        softcap: Float32,
        inv_softcap: Float32,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_b)

        # ---------------- this CTA's place in its cluster and its share of the tiles
        cta_rank_in_cluster = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord_mnk = cta_layout_mnk.get_flat_coord(cta_rank_in_cluster)
        bidx_in_cluster = cute.arch.block_in_cluster_idx()
        a_mcast_mask = 0
        b_mcast_mask = 0
        if const_expr(self.num_mcast_a > 1):
            a_mcast_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord_mnk, mode=1)
        if const_expr(self.num_mcast_b > 1):
            b_mcast_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord_mnk, mode=0)
        cluster_id, _, _ = cute.arch.cluster_idx()
        clusters_launched, _, _ = cute.arch.cluster_dim()
        cluster_cols = Int32(cdiv(self.num_tiles_n, self.cluster_shape_mn[1]))
        cluster_tiles = cluster_rows * cluster_cols
        # Tiles of this cluster: cluster_id, cluster_id + launched, ... (every CTA of a
        # cluster runs the same count, as multicast needs).
        my_tiles = (cluster_tiles - cluster_id + clusters_launched - 1) // clusters_launched

        # ---------------- shared memory and the TMA pipeline
        a_smem_layout = cute.slice_(a_smem_layout_staged, (None, None, 0))
        b_smem_layout = cute.slice_(b_smem_layout_staged, (None, None, 0))
        tma_copy_bytes = cute.size_in_bytes(self.dtype, a_smem_layout) + cute.size_in_bytes(self.dtype, b_smem_layout)
        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        producer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        # Every MMA warp of the tile releases a stage to each CTA that multicasts into it.
        mcast_size = self.num_mcast_a + self.num_mcast_b - 1
        consumer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, mcast_size * self.tile_warp_groups * 4)
        mainloop_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=self.stages,
            producer_group=producer_group,
            consumer_group=consumer_group,
            tx_count=tma_copy_bytes,
            cta_layout_vmnk=cute.make_layout((1, *cta_layout_mnk.shape)),
            defer_sync=True,
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=self.cluster_shape_mn, is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_layout_staged.outer, swizzle=a_smem_layout_staged.inner)  # (BM, BK, stages)
        sB = storage.sB.get_tensor(b_smem_layout_staged.outer, swizzle=b_smem_layout_staged.inner)  # (BN, BK, stages)
        gA = cute.local_tile(
            mA, self.tile_shape_mnk, (None, None, None), proj=(1, None, 1)
        )  # (BM, BK, m_tiles, k_tiles)
        gB = cute.local_tile(
            mB, self.tile_shape_mnk, (None, None, None), proj=(None, 1, 1)
        )  # (BN, BK, n_tiles, k_tiles)
        a_cta_layout = cute.make_layout(cute.slice_(cta_layout_mnk, (0, None, 0)).shape)
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_atom_a, cluster_coord_mnk[1], a_cta_layout, cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
        )  # (TMA, stages), (TMA, m_tiles, k_tiles)
        b_cta_layout = cute.make_layout(cute.slice_(cta_layout_mnk, (None, 0, 0)).shape)
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_atom_b, cluster_coord_mnk[0], b_cta_layout, cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
        )  # (TMA, stages), (TMA, n_tiles, k_tiles)
        k_tile_cnt = cute.size(gA, mode=[3])

        pipeline.pipeline_init_wait(cluster_shape_mn=self.cluster_shape_mn)

        warp_group_idx = cute.arch.make_warp_uniform(tidx // 128)
        if warp_group_idx == 0:
            # ---------------- loader: one thread streams the k-tiles of every tile of this CTA
            cute.arch.setmaxregister_decrease(LOADER_REGISTERS)
            if warp_idx == 0:
                producer_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                for i in cutlass.range(my_tiles, unroll=1):
                    pid_m, pid_n = self._tile_coords(
                        cluster_id + i * clusters_launched, cluster_rows, cluster_cols, bidx_in_cluster
                    )
                    tAgA_tile = tAgA[(None, pid_m, None)]  # (TMA, k_tiles)
                    tBgB_tile = tBgB[(None, pid_n, None)]  # (TMA, k_tiles)
                    for k in cutlass.range(k_tile_cnt, unroll=1):
                        mainloop_pipeline.producer_acquire(producer_state)
                        bar = mainloop_pipeline.producer_get_barrier(producer_state)
                        cute.copy(
                            tma_atom_a,
                            tAgA_tile[(None, k)],
                            tAsA[(None, producer_state.index)],
                            tma_bar_ptr=bar,
                            mcast_mask=a_mcast_mask,
                        )
                        cute.copy(
                            tma_atom_b,
                            tBgB_tile[(None, k)],
                            tBsB[(None, producer_state.index)],
                            tma_bar_ptr=bar,
                            mcast_mask=b_mcast_mask,
                        )
                        mainloop_pipeline.producer_commit(producer_state)
                        producer_state.advance()
                # Keep this CTA (and its barriers) alive until every consumer of the cluster
                # released the last stages: peers arrive on them remotely.
                mainloop_pipeline.producer_tail(producer_state)
        else:
            # ---------------- MMA warpgroups: mainloop, then the epilogue, per tile
            cute.arch.setmaxregister_increase(MMA_REGISTERS)
            mma_wg = warp_group_idx - 1
            # Ping-pong: each warpgroup multiplies whole tiles on its own; otherwise they
            # share a tile, 64 rows each.
            tile_tidx = tidx % 128 if const_expr(self.config.pingpong) else tidx - 128
            # WGMMA reads its operands through shared-memory descriptors, identical for the
            # 128 threads of a warpgroup: partition A/B with the warpgroup's first thread.
            thr_mma_wg = tiled_mma.get_slice(tile_tidx // 128 * 128)
            tCrA = tiled_mma.make_fragment_A(thr_mma_wg.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma_wg.partition_B(sB))
            # Per-thread accumulator and the (m, n) coordinate of each of its values.
            thr_mma = tiled_mma.get_slice(tile_tidx)
            tCcC = thr_mma.partition_C(cute.make_identity_tensor((self.bm, self.bn)))  # ((2,2,BN/8), MMA_M, MMA_N)
            acc = cute.make_rmem_tensor(tCcC.shape, Float32)
            num_k_blocks = cute.size(tCrA, mode=[2])
            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            first_tile = 0
            tile_step = 1
            if const_expr(self.config.pingpong):
                # Warpgroup g takes tiles g, g + 2, ...: the ring holds the tiles' k-tiles in
                # order, so it steps over the other warpgroup's (which releases them).
                first_tile = mma_wg
                tile_step = 2
                for _ in cutlass.range(k_tile_cnt * mma_wg, unroll=1):
                    read_state.advance()
                    release_state.advance()

            for i in cutlass.range(first_tile, my_tiles, tile_step, unroll=1):
                pid_m, pid_n = self._tile_coords(
                    cluster_id + i * clusters_launched, cluster_rows, cluster_cols, bidx_in_cluster
                )
                if const_expr(self.config.pingpong):
                    # Start waiting on this tile's stages only once the other warpgroup has
                    # waited on all of the previous tile's: a stage's full barrier is then at
                    # most one phase behind, and its parity cannot alias an older fill.
                    if i > 0:
                        cute.arch.barrier(barrier_id=PINGPONG_BARRIER + mma_wg, number_of_threads=256)
                # First k tile: overwrite the accumulator, keep one WGMMA batch in flight.
                peek = mainloop_pipeline.consumer_try_wait(read_state)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
                mainloop_pipeline.consumer_wait(read_state, peek)
                cute.nvgpu.warpgroup.fence()
                for kb in cutlass.range(num_k_blocks, unroll_full=True):
                    coord = (None, None, kb, read_state.index)
                    cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
                    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                cute.nvgpu.warpgroup.commit_group()
                read_state.advance()

                for _ in cutlass.range(1, k_tile_cnt, 1, unroll=1):
                    peek = mainloop_pipeline.consumer_try_wait(read_state)
                    mainloop_pipeline.consumer_wait(read_state, peek)
                    cute.nvgpu.warpgroup.fence()
                    for kb in cutlass.range(num_k_blocks, unroll_full=True):
                        coord = (None, None, kb, read_state.index)
                        cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
                    cute.nvgpu.warpgroup.commit_group()
                    # The previous k tile's WGMMAs are done once at most one batch is
                    # pending: its stage can be refilled.
                    cute.nvgpu.warpgroup.wait_group(1)
                    mainloop_pipeline.consumer_release(release_state)
                    read_state.advance()
                    release_state.advance()

                if const_expr(self.config.pingpong):
                    if i + 1 < my_tiles:  # the other warpgroup's next tile may start
                        cute.arch.barrier_arrive(barrier_id=PINGPONG_BARRIER + 1 - mma_wg, number_of_threads=256)
                cute.nvgpu.warpgroup.wait_group(0)
                mainloop_pipeline.consumer_release(release_state)
                release_state.advance()

                # ---------------- epilogue: per-row statistics of this tile, from registers,
                # while the loader fills the ring with the next tile's k-tiles.
                self._epilogue(acc, tCcC, pid_m, pid_n, epilogue_tensors, num_rows, softcap, inv_softcap)
                if const_expr(self.config.pingpong):
                    for _ in cutlass.range(k_tile_cnt, unroll=1):  # the other warpgroup's next tile
                        read_state.advance()
                        release_state.advance()

    @cute.jit
    def _tile_coords(self, cluster_tile: Int32, cluster_rows: Int32, cluster_cols: Int32, bidx_in_cluster):
        """(pid_m, pid_n) of this CTA in cluster tile ``cluster_tile``. Cluster tiles are
        visited in groups of GROUP_M cluster rows, M fastest inside a group: the clusters
        resident at one time then share a few W tiles and a few X row blocks, which stay
        in L2."""
        GROUP_M = 8
        full_m = cluster_rows // GROUP_M * GROUP_M
        cid_m = Int32(0)
        cid_n = Int32(0)
        if cluster_tile < full_m * cluster_cols:
            group = cluster_tile // (GROUP_M * cluster_cols)
            within = cluster_tile - group * (GROUP_M * cluster_cols)
            cid_m = group * GROUP_M + within % GROUP_M
            cid_n = within // GROUP_M
        else:
            tail_m = cluster_rows - full_m
            rest = cluster_tile - full_m * cluster_cols
            cid_m = full_m + rest % tail_m
            cid_n = rest // tail_m
        cm, cn = self.cluster_shape_mn
        return cid_m * cm + bidx_in_cluster[0], cid_n * cn + bidx_in_cluster[1]

    @cute.jit
    def _epilogue(
        self,
        acc: cute.Tensor,  # ((2,2,BN/8), MMA_M, MMA_N) fp32 logits of this thread
        tCcC: cute.Tensor,  # same shape: (m, n) tile coordinates of each value
        pid_m: Int32,
        pid_n: Int32,
        epilogue_tensors: tuple,  # target (N,), bias (V,) fp32, max, sumexp, argmax, sum (T, N), target logit (N,)
        num_rows: Int32,
        softcap: Float32,
        inv_softcap: Float32,
    ):
        mTarget, mBias, mMax, mSumExp, mArg, mSum, mTgtLogit = epilogue_tensors
        key = self.key
        V = key.vocab
        BN = self.bn
        # Only the last vocabulary tile can hold columns >= V.
        partial_last = V % BN != 0
        is_last = pid_n == self.num_tiles_n - 1
        # A cluster wider than the last tiles (T not a multiple of cluster_n) adds CTAs
        # past the vocabulary: they run the mainloop with their peers but write nothing.
        tile_ok = pid_n < self.num_tiles_n
        accs = acc_mn_view(acc)  # (rows of this thread, columns of this thread)
        crds = acc_mn_view(tCcC)
        R = cute.size(accs, mode=[0])
        C = cute.size(accs, mode=[1])
        m0 = pid_m * self.bm
        n0 = pid_n * BN
        lane = cute.arch.lane_idx()
        neg_inf = Float32(-Float32.inf)

        if const_expr(key.has_bias):
            self._add_bias(accs, crds, n0, mBias)
        if const_expr(partial_last):
            if is_last:
                self._mask_columns(accs, crds, n0, neg_inf)

        for r in cutlass.range_constexpr(R):
            row = m0 + crds[r, 0][0]
            row_ok = row < num_rows
            # Max of z (before the softcap), over the thread, then over the quad; and whether
            # the thread holds a NaN, which fmax drops (one compare per value).
            vmax = accs[r, 0]
            has_nan = accs[r, 0] != accs[r, 0]
            for c in cutlass.range_constexpr(1, C):
                vmax = cute.arch.fmax(vmax, accs[r, c])
                has_nan = has_nan | (accs[r, c] != accs[r, c])
            vmax = cute.arch.fmax(vmax, cute.arch.shuffle_sync_bfly(vmax, offset=1))
            vmax = cute.arch.fmax(vmax, cute.arch.shuffle_sync_bfly(vmax, offset=2))
            # First column achieving it.
            best = Int32(INT32_MAX)
            for c in cutlass.range_constexpr(C):
                col = n0 + crds[0, c][1]
                best = cutlass.min(best, Int32(cutlass.select_(accs[r, c] == vmax, col, Int32(INT32_MAX))))
            best = cutlass.min(best, cute.arch.shuffle_sync_bfly(best, offset=1))
            best = cutlass.min(best, cute.arch.shuffle_sync_bfly(best, offset=2))
            # torch.argmax ranks a NaN above every number: a tile holding one gives its first
            # NaN column. Only a thread holding a NaN looks for its columns; every lane takes
            # part in the quad's shuffles.
            nan_col = Int32(INT32_MAX)
            if has_nan:
                for c in cutlass.range_constexpr(C):
                    nan_col = cutlass.min(
                        nan_col,
                        Int32(cutlass.select_(accs[r, c] != accs[r, c], n0 + crds[0, c][1], Int32(INT32_MAX))),
                    )
            nan_col = cutlass.min(nan_col, cute.arch.shuffle_sync_bfly(nan_col, offset=1))
            nan_col = cutlass.min(nan_col, cute.arch.shuffle_sync_bfly(nan_col, offset=2))
            tile_has_nan = nan_col != Int32(INT32_MAX)
            best = Int32(cutlass.select_(tile_has_nan, nan_col, best))

            m = vmax
            if const_expr(key.has_softcap):
                m = softcap * softcap_tanh(vmax * inv_softcap, self.tanh_approx)
                for c in cutlass.range_constexpr(C):
                    accs[r, c] = softcap * softcap_tanh(accs[r, c] * inv_softcap, self.tanh_approx)
                if const_expr(partial_last):
                    if is_last:
                        self._mask_row(accs, crds, r, n0, neg_inf)

            # The target logit (z'), from the one lane that holds its column.
            tgt_local = Int32(-1)
            tgt_outside = cutlass.Boolean(False)  # outside [0, V): ignore_index, no column holds it
            if row_ok:
                tgt = Int64(mTarget[row])
                if tgt >= Int64(n0):
                    if tgt < Int64(cutlass.min(n0 + BN, V)):
                        tgt_local = Int32(tgt - Int64(n0))
                tgt_outside = (tgt < Int64(0)) | (tgt >= Int64(V))
            z_tgt = Float32(0.0)
            found = cutlass.Boolean(False)
            for c in cutlass.range_constexpr(C):
                hit = crds[0, c][1] == tgt_local
                z_tgt = Float32(cutlass.select_(hit, accs[r, c], z_tgt))
                found = found | hit
            if found:
                mTgtLogit[row] = z_tgt
            # Every row's target logit is written exactly once, so the output needs no zero
            # fill before the launch (host time that delays the GEMM): a target outside
            # [0, V) gets its 0 from the first vocabulary tile.
            if tgt_outside:
                if pid_n == 0:
                    if lane % 4 == 0:
                        mTgtLogit[row] = Float32(0.0)

            # sum exp(z' - m): exp2 of one FMA per value. A row whose tile is all -inf (a
            # masked part of the vocabulary) takes NEG_BIG as its max: its sum is then 0 and
            # the combine scales it by 0, where -inf - -inf would have been NaN.
            m = cute.arch.fmax(m, Float32(NEG_BIG))
            neg_mL = -(m * LOG2_E)
            se = Float32(0.0)
            for c in cutlass.range_constexpr(C):
                se = se + cute.math.exp2(cute.math.fma(accs[r, c], Float32(LOG2_E), neg_mL), fastmath=True)
            se = se + cute.arch.shuffle_sync_bfly(se, offset=1)
            se = se + cute.arch.shuffle_sync_bfly(se, offset=2)

            zsum = Float32(0.0)
            if const_expr(key.with_logit_sum):
                zsum = self._row_sum(accs, crds, r, n0, is_last)
                zsum = zsum + cute.arch.shuffle_sync_bfly(zsum, offset=1)
                zsum = zsum + cute.arch.shuffle_sync_bfly(zsum, offset=2)

            # A tile holding a NaN reports a NaN max (fmax dropped it), which the combination
            # ranks above every number; its sum of exp is NaN already.
            m = Float32(cutlass.select_(tile_has_nan, Float32(math.nan), m))
            if row_ok and tile_ok:
                if lane % 4 == 0:
                    mMax[pid_n, row] = m
                    mSumExp[pid_n, row] = se
                    mArg[pid_n, row] = best
                    if const_expr(key.with_logit_sum):
                        mSum[pid_n, row] = zsum

    @cute.jit
    def _add_bias(self, accs: cute.Tensor, crds: cute.Tensor, n0: Int32, mBias: cute.Tensor):
        """Adds the bias (``mBias``: (V,), any float dtype) to every value of the tile's
        valid columns, each column's bias read once per thread."""
        for c in cutlass.range_constexpr(cute.size(accs, mode=[1])):
            col = n0 + crds[0, c][1]
            b = Float32(0.0)
            if col < self.key.vocab:
                b = Float32(mBias[col])
            for r in cutlass.range_constexpr(cute.size(accs, mode=[0])):
                accs[r, c] = accs[r, c] + b

    @cute.jit
    def _mask_columns(self, accs: cute.Tensor, crds: cute.Tensor, n0: Int32, fill: Float32):
        """Set every value of a column >= V to ``fill`` (-inf: no effect on max, argmax, sumexp)."""
        for c in cutlass.range_constexpr(cute.size(accs, mode=[1])):
            if n0 + crds[0, c][1] >= self.key.vocab:
                for r in cutlass.range_constexpr(cute.size(accs, mode=[0])):
                    accs[r, c] = fill

    @cute.jit
    def _mask_row(self, accs: cute.Tensor, crds: cute.Tensor, r: cutlass.Constexpr, n0: Int32, fill: Float32):
        """``_mask_columns`` for one row (after the softcap turned its -inf into -c)."""
        for c in cutlass.range_constexpr(cute.size(accs, mode=[1])):
            if n0 + crds[0, c][1] >= self.key.vocab:
                accs[r, c] = fill

    @cute.jit
    def _row_sum(self, accs: cute.Tensor, crds: cute.Tensor, r: cutlass.Constexpr, n0: Int32, is_last):
        """This thread's sum of z' over the valid columns of row ``r``."""
        C = cute.size(accs, mode=[1])
        s = Float32(0.0)
        if const_expr(self.key.vocab % self.bn != 0):
            if is_last:
                for c in cutlass.range_constexpr(C):
                    valid = n0 + crds[0, c][1] < self.key.vocab
                    s = s + Float32(cutlass.select_(valid, accs[r, c], Float32(0.0)))
            else:
                for c in cutlass.range_constexpr(C):
                    s = s + accs[r, c]
        else:
            for c in cutlass.range_constexpr(C):
                s = s + accs[r, c]
        return s


# ---------------------------------------------------------------------- host wrapper
def compile_fused_forward(key: FusedForwardKey, config: FusedForwardConfig):
    """The compiled kernel for ``key`` and ``config`` (cached); the row count is a runtime
    argument, so one compilation serves every N. Compiles for the current device, or for
    ``CUTE_DSL_ARCH`` (e.g. ``sm_90a``) where there is none."""
    return compile_cached((FusedForwardKernel, key, config), lambda: _build_fused_forward(key, config))


def _build_fused_forward(key: FusedForwardKey, config: FusedForwardConfig):
    if key.dtype not in WGMMA_DTYPES:
        raise TypeError(f"fused forward supports bfloat16/float16, got {key.dtype}")
    kernel = FusedForwardKernel(key, config)
    dtype = WGMMA_DTYPES[key.dtype]
    target_t = Int64 if key.target_int64 else Int32
    return compile_launcher(
        kernel,
        null_ptr(dtype, 16),
        null_ptr(dtype, 16),
        null_ptr(target_t, target_t.width // 8),
        null_ptr(Float32, 4),
        null_ptr(Float32, 4),
        null_ptr(Float32, 4),
        null_ptr(Int32, 4),
        null_ptr(Float32, 4),
        null_ptr(Float32, 4),
        Int32(1),
        Float32(1.0),
        Float32(1.0),
        Int32(1),
        cuda.CUstream(0),
    )


@cache
def resident_clusters(device_index: int, cluster_size: int) -> int:
    """How many clusters of ``cluster_size`` CTAs (one per SM: the TMA ring fills shared
    memory) the GPU holds at once: a persistent launch of more would leave a tail of
    clusters that start after the first wave. Asked of the driver (not SMs / size), as
    the SMs of a GPC need not split evenly into clusters."""
    with torch.cuda.device(device_index):
        return max(1, utils.HardwareInfo(device_index).get_max_active_clusters(cluster_size))


def clusters_to_launch(config: FusedForwardConfig, device: torch.device) -> int:
    """The ``max_clusters`` argument of a launch: the resident clusters when persistent,
    otherwise no limit (one cluster per tile)."""
    if not config.persistent:
        return INT32_MAX
    return resident_clusters(
        device.index if device.index is not None else torch.cuda.current_device(), config.cluster_m * config.cluster_n
    )


def _validate(input, weight, target, bias, softcap) -> None:
    if not isinstance(input, torch.Tensor) or input.dim() != 2:
        raise ValueError("input must be a 2-D tensor (N, H)")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError("weight must be a 2-D tensor (V, H)")
    if input.dtype not in WGMMA_DTYPES:
        raise TypeError(f"input must be bfloat16 or float16, got {input.dtype}")
    if weight.dtype != input.dtype:
        raise TypeError(f"weight must have the dtype of input ({input.dtype}), got {weight.dtype}")
    n, h = input.shape
    v, hw = weight.shape
    if hw != h:
        raise ValueError(f"weight has hidden size {hw}, input has {h}")
    if h == 0 or h % BLOCK_K:
        raise ValueError(f"input hidden size H={h} must be a positive multiple of {BLOCK_K}")
    if v == 0:
        raise ValueError("weight must have at least one row (V >= 1)")
    if input.device.type != "cuda":
        raise ValueError(f"input must be on a CUDA device, got {input.device}")
    if weight.device != input.device:
        raise ValueError(f"weight must be on {input.device}, got {weight.device}")
    for name, t in (("input", input), ("weight", weight)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (row-major)")
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned for TMA")
    if not isinstance(target, torch.Tensor) or target.dim() != 1 or target.shape[0] != n:
        raise ValueError(f"target must be a 1-D tensor of {n} class indices")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target must be int64 or int32, got {target.dtype}")
    if target.device != input.device:
        raise ValueError(f"target must be on {input.device}, got {target.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dim() != 1 or bias.shape[0] != v:
            raise ValueError(f"bias must be a 1-D tensor of {v} values")
        if not bias.dtype.is_floating_point:
            raise TypeError(f"bias must be a floating-point tensor, got {bias.dtype}")
        if bias.device != input.device:
            raise ValueError(f"bias must be on {input.device}, got {bias.device}")
    if softcap is not None:
        c = float(softcap)
        if not math.isfinite(c) or c <= 0.0:
            raise ValueError(f"softcap must be a positive finite number or None, got {softcap}")


def rows_per_launch(
    num_rows: int, vocab: int, with_logit_sum: bool, config: FusedForwardConfig, workspace_bytes: int
) -> int:
    """Rows covered by one launch at ``config`` (``fused_forward_rows_per_launch``, which the
    memory model reads without cutlass)."""
    return fused_forward_rows_per_launch(
        num_rows,
        vocab,
        with_logit_sum,
        tile_n=config.tile_n,
        # Whole cluster row blocks of this shape, in the memory model's multiple (one of
        # both shipped shapes' blocks).
        rows_multiple=math.lcm(config.tile_m * config.cluster_m, FUSED_FORWARD_LAUNCH_ROWS_MULTIPLE),
        workspace_bytes=workspace_bytes,
    )


@dataclass(frozen=True)
class FusedForwardLaunch:
    """What every call of one signature launches: the compiled kernels, the tiles, the
    rows per launch and the workspace of their per-tile statistics (one allocation)."""

    fused: object  # the compiled GEMM (compile_fused_forward)
    combine: object  # the compiled combining kernel (compile_combine)
    num_tiles: int  # T: vocabulary tiles of the GEMM
    rows_per_launch: int
    max_clusters: int  # clusters_to_launch
    key: FusedForwardKey

    @property
    def tile_statistics_bytes(self) -> int:
        """Bytes of each of the (T, rows) fp32/int32 statistics of one launch."""
        return 4 * self.num_tiles * self.rows_per_launch

    @property
    def workspace_bytes(self) -> int:
        """max, sum of exp, argmax (and the logit sum), one after the other."""
        return (4 if self.key.with_logit_sum else 3) * self.tile_statistics_bytes


@lru_cache(maxsize=256)  # a training loop's few signatures: their decisions are host time per call
def fused_forward_launch(
    key: FusedForwardKey, config: FusedForwardConfig, num_rows: int, workspace_bytes: int, device_index: int
) -> FusedForwardLaunch:
    """The launch of ``key`` at ``config`` for ``num_rows`` rows (> 0) on a CUDA device."""
    config.validate()
    if key.vocab > INT32_MAX // 2:
        raise ValueError(f"weight has {key.vocab} rows; the kernel indexes columns with int32")
    num_tiles = cdiv(key.vocab, config.tile_n)
    return FusedForwardLaunch(
        fused=compile_fused_forward(key, config),
        combine=compile_combine(num_tiles, key.with_logit_sum),
        num_tiles=num_tiles,
        rows_per_launch=rows_per_launch(num_rows, key.vocab, key.with_logit_sum, config, workspace_bytes),
        max_clusters=clusters_to_launch(config, torch.device("cuda", device_index)),
        key=key,
    )


def fused_forward_statistics(
    input: torch.Tensor,  # (N, H) bf16/fp16, contiguous
    weight: torch.Tensor,  # (V, H) same dtype, contiguous
    target: torch.Tensor,  # (N,) int64/int32; values outside [0, V) (ignore_index) have target logit 0
    bias: torch.Tensor | None = None,  # (V,) any float dtype
    softcap: float | None = None,
    with_logit_sum: bool = False,
    *,
    config: FusedForwardConfig | None = None,
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
    check: bool = True,
) -> dict:
    """Per-row statistics of the logits ``z' = softcap(input @ weight^T + bias)`` without
    materialising them. Returns a dict of tensors on the input's device:

    - ``lse`` (N,) fp32: logsumexp of z',
    - ``target_logit`` (N,) fp32: z'[n, target[n]]; 0 where target[n] is outside [0, V),
    - ``predicted`` (N,) int64: argmax of z' (first index wins ties),
    - ``logit_sum`` (N,) fp32, only with ``with_logit_sum``: sum of z' over the vocabulary.

    ``config`` defaults to the device's ``default_config`` (the fastest measured there, see
    the module docstring). Runs on
    the current CUDA stream, with no host synchronisation. ``check=False`` skips the
    argument checks, for callers whose operands already passed them (the backend's
    ``loss_only`` slot, ``prechecked_fused_forward_statistics``: the driver's operands
    passed the API boundary's checks and ``fused_forward_applicable``).

    The host work before the GEMM's launch delays it (a synchronized call waits for it):
    the launch's decisions are cached per signature (``fused_forward_launch``), the
    per-tile statistics take one allocation, the target logits no zero fill (the kernel
    writes every row), the arguments one check per call, and the outputs that only the
    combining kernel writes are allocated once the GEMM is queued.
    """
    if check:
        _validate(input, weight, target, bias, softcap)
    num_rows, hidden = input.shape
    vocab = weight.shape[0]
    dev = input.device
    # The GEMM's epilogue writes each row's target logit (0 outside [0, V)): no fill needed.
    target_logit = torch.empty(num_rows, dtype=torch.float32, device=dev)
    if num_rows == 0:
        if config is not None:
            config.validate()
        return _combined_outputs(target_logit, with_logit_sum)
    device_index = dev.index if dev.index is not None else torch.cuda.current_device()
    config = default_config(device_index) if config is None else config
    key = FusedForwardKey(
        dtype=input.dtype,
        vocab=vocab,
        hidden=hidden,
        target_int64=target.dtype == torch.int64,
        has_bias=bias is not None,
        has_softcap=softcap is not None,
        with_logit_sum=bool(with_logit_sum),
    )
    launch = fused_forward_launch(key, config, num_rows, workspace_bytes, device_index)
    bias32 = None if bias is None else bias.to(torch.float32).contiguous()
    target = target.contiguous()
    # One workspace for every launch (stream order makes reusing it safe): the (T, rows)
    # tile max, sum of exp and argmax (and logit sum), each launch's at its base.
    workspace = torch.empty(launch.workspace_bytes, dtype=torch.uint8, device=dev)
    step = launch.tile_statistics_bytes
    base = workspace.data_ptr()
    ws_max = gmem_address(base, Float32, 4)
    ws_sumexp = gmem_address(base + step, Float32, 4)
    ws_arg = gmem_address(base + 2 * step, Int32, 4)
    ws_sum = gmem_address(base + 3 * step, Float32, 4) if with_logit_sum else gmem_ptr(None, Float32, 4)
    c = float(softcap) if softcap is not None else 1.0
    chunk = launch.rows_per_launch
    out = None
    with device_guard(dev):
        stream = cuda_stream(dev)
        for r0 in range(0, num_rows, chunk):
            rows = min(chunk, num_rows - r0)
            rows_of = partial(_rows_from, r0)
            # Each launch's (T, rows) tile statistics start at the workspace's base.
            launch.fused(
                gmem_ptr(rows_of(input), WGMMA_DTYPES[input.dtype], 16),
                gmem_ptr(weight, WGMMA_DTYPES[input.dtype], 16),
                gmem_ptr(rows_of(target), Int64 if key.target_int64 else Int32, target.element_size()),
                gmem_ptr(bias32, Float32, 4),
                ws_max,
                ws_sumexp,
                ws_arg,
                ws_sum,
                gmem_ptr(rows_of(target_logit), Float32, 4),
                arg_i32(rows),
                arg_f32(c),
                arg_f32(1.0 / c),
                arg_i32(launch.max_clusters),
                stream,
            )
            if out is None:  # once the first GEMM is queued: only the combining kernel writes these
                out = _combined_outputs(target_logit, with_logit_sum)
            launch.combine(
                ws_max,
                ws_sumexp,
                ws_arg,
                ws_sum,
                gmem_ptr(rows_of(out["lse"]), Float32, 4),
                gmem_ptr(rows_of(out["predicted"]), Int64, 8),
                gmem_ptr(rows_of(out.get("logit_sum")), Float32, 4),
                arg_i32(rows),
                stream,
            )
    return out


# The backend's ``loss_only`` slot: the driver (``flce.driver.fused``) hands over operands
# that the API boundary and ``fused_forward_applicable`` checked.
prechecked_fused_forward_statistics = partial(fused_forward_statistics, check=False)


def _combined_outputs(target_logit: torch.Tensor, with_logit_sum: bool) -> dict:
    """``fused_forward_statistics``' outputs around ``target_logit``: the rows' lse,
    predicted (and logit sum), uninitialised until the combining kernel writes them."""
    num_rows, dev = target_logit.shape[0], target_logit.device
    out = {
        "lse": torch.empty(num_rows, dtype=torch.float32, device=dev),
        "target_logit": target_logit,
        "predicted": torch.empty(num_rows, dtype=torch.int64, device=dev),
    }
    if with_logit_sum:
        out["logit_sum"] = torch.empty(num_rows, dtype=torch.float32, device=dev)
    return out


def _rows_from(r0: int, t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` from row ``r0`` on: the kernels take a base pointer and a row count, so the
    first launch (the only one, mostly) passes the tensors as they are, with no view op."""
    return t if t is None or r0 == 0 else t[r0:]


def combine_tile_statistics(
    tile_max: torch.Tensor,  # (T, rows) fp32; overwritten
    tile_sumexp: torch.Tensor,  # (T, rows) fp32
    tile_argmax: torch.Tensor,  # (T, rows) int32
    tile_sum: torch.Tensor | None,  # (T, rows) fp32 or None
    *,
    lse_out: torch.Tensor,  # (rows,) fp32
    predicted_out: torch.Tensor,  # (rows,) int64
    logit_sum_out: torch.Tensor | None,  # (rows,) fp32
) -> None:
    """Row statistics from per-tile ones: ``M = max_t m_t``, ``lse = M + log(sum_t s_t
    exp(m_t - M))``; the argmax is the smallest column among the tiles achieving ``M``
    (tile columns increase with ``t``, so that is the first tile's), or among the tiles
    whose max is NaN where one is (``M`` is then NaN, and so is the lse). ``tile_max`` is used
    as scratch for the rescaled sums. The torch twin of ``CombineTileStatisticsKernel``,
    which the GPU path runs; tests check this one against dense logits, the kernel
    against this one."""
    row_max = tile_max.amax(dim=0)  # (rows,) NaN where a tile's max is
    # A tile holding a NaN has a NaN max, which amax propagates and == never matches: a NaN
    # ranks above every number, as in torch.argmax, and the first such tile's column wins.
    at_max = (tile_max == row_max) | tile_max.isnan()
    predicted_out.copy_(torch.where(at_max, tile_argmax, INT32_MAX).amin(dim=0))
    del at_max
    scaled = tile_max.sub_(row_max).exp_().mul_(tile_sumexp)
    torch.add(row_max, scaled.sum(dim=0).log_(), out=lse_out)
    if logit_sum_out is not None:
        logit_sum_out.copy_(tile_sum.sum(dim=0, dtype=torch.float64))


# ---------------------------------------------------------------------- combining the tiles
class CombineTileStatisticsKernel:
    """Row statistics from the per-tile ones in one kernel.

    A warp takes 8 rows and splits each row's tiles over 4 lanes (lane = 8 * slice + row):
    the (T, rows) layout puts the rows of a tile next to each other, so the 8 lanes of one
    slice read 32 contiguous bytes of a tile, and 4 lanes per row give the loads enough
    parallelism (one thread per row was latency-bound: 0.20 ms at N = 8192, V = 128256).
    Two passes over the tiles: the max (and the first tile achieving it), then
    ``sum_t s_t exp(m_t - M)`` with the final max, each term rounded once as in
    ``combine_tile_statistics``; the 4 slices of a row are merged with butterfly shuffles."""

    ROWS_PER_WARP = 8
    SLICES = 4  # lanes per row; ROWS_PER_WARP * SLICES = 32
    WARPS = 4

    def __init__(self, num_tiles: int, with_logit_sum: bool):
        self.num_tiles = num_tiles
        self.with_logit_sum = with_logit_sum

    @cute.jit
    def __call__(
        self,
        p_max: cute.Pointer,  # (T, rows) fp32
        p_sumexp: cute.Pointer,  # (T, rows) fp32
        p_argmax: cute.Pointer,  # (T, rows) int32
        p_sum: cute.Pointer,  # (T, rows) fp32; read only if with_logit_sum
        p_lse: cute.Pointer,  # (rows,) fp32
        p_predicted: cute.Pointer,  # (rows,) int64
        p_logit_sum: cute.Pointer,  # (rows,) fp32; written only if with_logit_sum
        num_rows: Int32,
        stream: cuda.CUstream,
    ):
        stats = cute.make_layout((self.num_tiles, num_rows), stride=(num_rows, 1))
        rows = cute.make_layout((num_rows,))
        rows_per_block = self.ROWS_PER_WARP * self.WARPS
        self.kernel(
            cute.make_tensor(p_max, stats),
            cute.make_tensor(p_sumexp, stats),
            cute.make_tensor(p_argmax, stats),
            cute.make_tensor(p_sum, stats),
            cute.make_tensor(p_lse, rows),
            cute.make_tensor(p_predicted, rows),
            cute.make_tensor(p_logit_sum, rows),
            num_rows,
        ).launch(
            grid=[(num_rows + rows_per_block - 1) // rows_per_block, 1, 1], block=[32 * self.WARPS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mMax: cute.Tensor,
        mSumExp: cute.Tensor,
        mArg: cute.Tensor,
        mSum: cute.Tensor,
        mLse: cute.Tensor,
        mPred: cute.Tensor,
        mLogitSum: cute.Tensor,
        num_rows: Int32,
    ):
        bidx, _, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        lane = tidx % 32
        row = (bidx * self.WARPS + tidx // 32) * self.ROWS_PER_WARP + lane % self.ROWS_PER_WARP
        first_tile = lane // self.ROWS_PER_WARP
        SHUFFLE_ROUNDS = self.SLICES.bit_length() - 1  # log2(SLICES) butterflies merge a row's lanes
        row_ok = row < num_rows

        row_max = Float32(-Float32.inf)
        best = Int32(INT32_MAX)
        if row_ok:
            for t in cutlass.range(first_tile, self.num_tiles, self.SLICES, unroll=4):
                m = Float32(mMax[t, row])
                # Strictly larger: among equal maxima the first tile (smallest column) wins.
                # A NaN max (a tile holding a NaN) ranks above every number; the first stays.
                # The first tile is taken whatever its max: a row of only -inf logits names
                # its first column, as torch.argmax does, not the sentinel.
                if m > row_max or best == Int32(INT32_MAX) or (m != m and row_max == row_max):
                    row_max = m
                    best = Int32(mArg[t, row])
        # Lanes 8 and 16 apart hold the same row; every lane takes part in the shuffles.
        for i in cutlass.range_constexpr(SHUFFLE_ROUNDS):
            other_max = cute.arch.shuffle_sync_bfly(row_max, offset=self.ROWS_PER_WARP << i)
            other_best = cute.arch.shuffle_sync_bfly(best, offset=self.ROWS_PER_WARP << i)
            row_max, best = argmax_combine(row_max, best, other_max, other_best)

        neg_max_log2 = -(row_max * LOG2_E)
        total = Float32(0.0)
        logit_sum = cutlass.Float64(0.0)
        if row_ok:
            for t in cutlass.range(first_tile, self.num_tiles, self.SLICES, unroll=4):
                total = total + Float32(mSumExp[t, row]) * cute.math.exp2(
                    cute.math.fma(Float32(mMax[t, row]), Float32(LOG2_E), neg_max_log2), fastmath=True
                )
                if const_expr(self.with_logit_sum):
                    logit_sum = logit_sum + cutlass.Float64(mSum[t, row])
        partial_sum = Float32(logit_sum)
        for i in cutlass.range_constexpr(SHUFFLE_ROUNDS):
            total = total + cute.arch.shuffle_sync_bfly(total, offset=self.ROWS_PER_WARP << i)
            if const_expr(self.with_logit_sum):
                partial_sum = partial_sum + cute.arch.shuffle_sync_bfly(partial_sum, offset=self.ROWS_PER_WARP << i)
        if row_ok and first_tile == 0:
            mLse[row] = row_max + cute.math.log(total, fastmath=False)
            mPred[row] = Int64(best)
            if const_expr(self.with_logit_sum):
                mLogitSum[row] = partial_sum


def compile_combine(num_tiles: int, with_logit_sum: bool):
    """The compiled combining kernel for ``num_tiles`` tiles (cached; rows are dynamic)."""
    return compile_cached(
        (CombineTileStatisticsKernel, num_tiles, with_logit_sum), lambda: _build_combine(num_tiles, with_logit_sum)
    )


def _build_combine(num_tiles: int, with_logit_sum: bool):
    return compile_launcher(
        CombineTileStatisticsKernel(num_tiles, with_logit_sum),
        null_ptr(Float32, 4),
        null_ptr(Float32, 4),
        null_ptr(Int32, 4),
        null_ptr(Float32, 4),
        null_ptr(Float32, 4),
        null_ptr(Int64, 8),
        null_ptr(Float32, 4),
        Int32(1),
        cuda.CUstream(0),
    )
