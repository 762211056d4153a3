"""The fused forward Hopper kernel (GEMM + per-tile softmax statistics) against float64.

CPU part (needs nvidia-cutlass-dsl, no GPU): every shipped launch shape compiles for
sm_90a, the accumulator view the epilogue reduces over has the structure it assumes
(each row of a tile held by one quad, the same columns for every row of a thread), and
argument validation raises clear errors.

GPU part (sm_90): ``lse``, ``target_logit`` and ``logit_sum`` must satisfy
``err(ours) <= 3 * err(torch) + eps`` where ``err(torch)`` is the error of the same
quantity computed from ``F.linear`` logits in the input dtype (what an eager model
does); ``predicted`` must be the float64 argmax, up to near-ties that fp32 accumulation
may legitimately flip.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.backends.cutedsl_gpu import HAS_DSL, needs_dsl, needs_sm90

if HAS_DSL:
    import cutlass
    import cutlass.cute as cute

    from flce.backends import cutedsl
    from flce.backends.cutedsl import common as cutedsl_common
    from flce.backends.cutedsl import fused_forward as ff

K = 3.0
EPS = 1e-4
IGNORE = -100

# Launch shapes shipped or tried by benchmarks/fused_forward_check.py.
CONFIGS = [
    dict(),  # the field defaults: 128 x 256, 4 stages, no cluster
    dict(cluster_m=2),  # W tile multicast to the two CTAs of a cluster
    dict(tile_n=128),  # 1002 tiles at V=128256: more statistics, smaller epilogue
    dict(tile_n=256, cluster_n=2),  # X multicast; T=125 at V=32000 leaves CTAs past V
    dict(cluster_m=2, persistent=False),  # one cluster per tile instead of a resident grid
    dict(tile_m=64, cluster_m=4, pingpong=True),  # two MMA warpgroups on alternate tiles
    dict(tile_m=64, cluster_m=2, pingpong=True),  # PINGPONG_CONFIG (COOPERATIVE_CONFIG: cluster_m=2)
]


# ---------------------------------------------------------------------- CPU
@needs_dsl
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
@pytest.mark.parametrize(
    "features",
    [
        dict(),
        dict(has_bias=True, has_softcap=True, with_logit_sum=True, target_int64=False),
    ],
    ids=["plain", "all"],
)
def test_compiles_for_sm90a(config, features, monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    d = dict(
        dtype=torch.bfloat16,
        vocab=32000,
        hidden=4096,
        target_int64=True,
        has_bias=False,
        has_softcap=False,
        with_logit_sum=False,
    )
    d.update(features)
    fn = ff.compile_fused_forward(ff.FusedForwardKey(**d), ff.FusedForwardConfig(**config))
    assert fn is not None


@needs_dsl
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab,hidden", [(151936, 5120), (128256, 2048)])
def test_compiles_other_shapes(dtype, vocab, hidden, monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    key = ff.FusedForwardKey(
        dtype=dtype,
        vocab=vocab,
        hidden=hidden,
        target_int64=True,
        has_bias=True,
        has_softcap=False,
        with_logit_sum=True,
    )
    assert ff.compile_fused_forward(key, ff.PINGPONG_CONFIG) is not None


def _check_acc_view(tv, view_layout, bm: int, bn: int) -> None:
    """Plain Python over static layouts: (thread, value) -> tile coordinate."""
    rows_of = {}
    for tid in range(2 * bm):
        cols0 = None
        for r in range(cute.size(view_layout, mode=[0])):
            ms = set()
            cols = []
            for c in range(cute.size(view_layout, mode=[1])):
                idx = tv((tid, view_layout((r, c))))
                m, n = idx % bm, idx // bm
                ms.add(m)
                cols.append(n)
                rows_of.setdefault(m, {})[n] = tid
            assert len(ms) == 1, "a mode-0 index must be one row"
            cols0 = cols if cols0 is None else cols0
            assert cols == cols0, "every row of a thread must have the same columns"
    assert len(rows_of) == bm and all(len(c) == bn for c in rows_of.values()), "the tile must be covered once"
    for cols in rows_of.values():
        owners = set(cols.values())
        assert len(owners) == 4 and len({t // 4 for t in owners}) == 1, "a row must live in one quad"


if HAS_DSL:

    @cute.jit
    def _trace_acc_view(p: cute.Pointer, bm: cutlass.Constexpr, bn: cutlass.Constexpr):
        mX = cute.make_tensor(p, cute.make_layout((256, 64), stride=(64, 1)))
        major = ff.utils.LayoutEnum.from_tensor(mX).sm90_mma_major_mode()
        tiled_mma = ff.sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, major, major, cutlass.Float32, (bm // 64, 1, 1), tiler_mn=(64, bn)
        )
        part = tiled_mma.get_slice(0).partition_C(cute.make_identity_tensor((bm, bn)))
        frag = cute.make_rmem_tensor(part.shape, cutlass.Float32)
        _check_acc_view(tiled_mma.tv_layout_C_tiled, ff.acc_mn_view(frag).layout, bm, bn)


@needs_dsl
@pytest.mark.parametrize("bm,bn", [(128, 256), (128, 128), (64, 256), (128, 192)])
def test_accumulator_row_view(bm, bn, monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    _trace_acc_view(cutedsl_common.null_ptr(cutlass.BFloat16, 16), bm, bn)


@needs_dsl
def test_validation_errors():
    x = torch.zeros(4, 100, dtype=torch.bfloat16)
    w = torch.zeros(10, 100, dtype=torch.bfloat16)
    y = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="hidden size H=100"):
        ff.fused_forward_statistics(x, w, y)
    with pytest.raises(TypeError, match="input must be bfloat16 or float16"):
        ff.fused_forward_statistics(x.float(), w.float(), y)
    with pytest.raises(TypeError, match="weight must have the dtype"):
        ff.fused_forward_statistics(torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(10, 64), y)
    with pytest.raises(ValueError, match="weight has hidden size"):
        ff.fused_forward_statistics(torch.zeros(4, 64, dtype=torch.bfloat16), w, y)
    with pytest.raises(ValueError, match="must be a multiple"):
        ff.FusedForwardKernel(
            ff.FusedForwardKey(torch.bfloat16, 10, 100, True, False, False, False), ff.PINGPONG_CONFIG
        )
    with pytest.raises(ValueError, match="tile_n"):
        ff.FusedForwardConfig(tile_n=96).validate()
    with pytest.raises(ValueError, match="cluster"):
        ff.FusedForwardConfig(cluster_m=4, cluster_n=2).validate()
    with pytest.raises(ValueError, match="pingpong.*tile_m must be 64"):
        ff.FusedForwardConfig(pingpong=True).validate()


@needs_dsl
@pytest.mark.parametrize("with_logit_sum", [False, True])
def test_combine_kernel_compiles_for_sm90a(with_logit_sum, monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    assert ff.compile_combine(501, with_logit_sum) is not None


@needs_dsl
def test_shipped_launch_shapes_are_the_measured_best():
    # Ping-pong warpgroups on 64-row tiles, or both on one 128-row tile, in persistent 2x1
    # clusters: the fastest heated launch shapes on an H200 and on an H100 (module docstring).
    assert ff.PINGPONG_CONFIG == ff.FusedForwardConfig(tile_m=64, cluster_m=2, pingpong=True)
    assert ff.COOPERATIVE_CONFIG == ff.FusedForwardConfig(tile_m=128, cluster_m=2, pingpong=False)
    assert ff.PINGPONG_CONFIG.persistent and ff.COOPERATIVE_CONFIG.persistent


@needs_dsl
@pytest.mark.parametrize(
    "gib,pingpong",
    [(139.8, True), (143.0, True), (79.1, False), (93.0, False), (95.0, False), (23.5, False)],
    ids=["H200", "GH200-144GB", "H100-80GB", "H100-NVL", "H20/GH200-96GB", "small"],
)
def test_launch_shape_follows_the_memory_kind(gib, pingpong):
    """Ping-pong only where the memory is HBM3e-sized (H200's, GH200 144GB's), where it was
    measured faster; every other GPU gets the cooperative tiles, which ran 24-26% faster than
    ping-pong on an H100 80GB."""
    want = ff.PINGPONG_CONFIG if pingpong else ff.COOPERATIVE_CONFIG
    assert ff.launch_shape_for_memory(int(gib * 2**30)) == want


@needs_dsl
@pytest.mark.parametrize("config", ["PINGPONG_CONFIG", "COOPERATIVE_CONFIG"])
def test_rows_per_launch_budget(config):
    cfg = getattr(ff, config)
    # N=8192, V=128256: 501 tiles x 12 bytes a row; the default budget holds all rows.
    rows = ff.rows_per_launch(8192, 128256, False, cfg, ff.DEFAULT_WORKSPACE_BYTES)
    assert rows == 8192 and rows * 501 * 12 <= ff.DEFAULT_WORKSPACE_BYTES < 64 * 2**20
    # 16 MiB -> 2560 rows: 10 blocks of 256 rows (whole clusters of either shape).
    rows = ff.rows_per_launch(8192, 128256, False, cfg, 16 * 2**20)
    assert rows == 2560 and rows % (cfg.tile_m * cfg.cluster_m) == 0
    assert ff.rows_per_launch(100, 128256, True, cfg, 1) == 100
    # The memory model's formula (no cutlass) takes the same rows.
    assert rows == cutedsl.fused_forward_rows_per_launch(8192, 128256, False, workspace_bytes=16 * 2**20)


@needs_dsl
def test_combine_matches_dense():
    """The host combination of per-tile statistics, on CPU tensors built from dense logits."""
    gen = torch.Generator().manual_seed(0)
    rows, vocab, bn = 37, 1000, 128
    z = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 4
    z[:, 517] = z[:, 3] = z.max() + 1  # a cross-tile tie: the first column must win
    tiles = z.split(bn, dim=1)
    tmax = torch.stack([t.amax(1) for t in tiles]).float()
    tse = torch.stack([(t - t.amax(1, keepdim=True)).exp().sum(1) for t in tiles]).float()
    targ = torch.stack([t.argmax(1) + i * bn for i, t in enumerate(tiles)]).int()
    tsum = torch.stack([t.sum(1) for t in tiles]).float()
    lse = torch.empty(rows)
    pred = torch.empty(rows, dtype=torch.int64)
    zsum = torch.empty(rows)
    ff.combine_tile_statistics(tmax, tse, targ, tsum, lse_out=lse, predicted_out=pred, logit_sum_out=zsum)
    torch.testing.assert_close(lse.double(), torch.logsumexp(z, 1), rtol=0, atol=1e-5)
    assert torch.equal(pred, torch.full((rows,), 3))
    torch.testing.assert_close(zsum.double(), z.sum(1), rtol=1e-5, atol=1e-3)


def nan_tile_statistics(rows: int, tiles: int, bn: int, seed: int):
    """Dense fp64 logits ``(rows, tiles * bn)`` with NaN and +-inf in some rows (several
    NaNs in one tile, NaNs in several tiles, a NaN beside a larger +inf, a row of NaN only)
    and their per-tile statistics as the fused GEMM's epilogue reports them: a tile holding
    a NaN has a NaN max and its first NaN column as its argmax (torch's amax and argmax)."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, tiles * bn, generator=gen, dtype=torch.float64) * 4
    z[0, 0] = z.max() + 10  # the row's largest number, before its first NaN
    z[0, [bn + 5, bn + 2, 3 * bn]] = math.nan  # the first NaN: in the second tile
    z[1, [3 * bn - 1, 2 * bn + 7]] = math.nan  # two NaNs of one tile, the later one read first
    z[2, 1] = math.inf
    z[2, 2 * bn] = math.nan  # a NaN beats +inf
    z[3, [4, bn + 4]] = math.inf  # +inf ties, no NaN: the first column
    z[4] = math.nan
    z[5, tiles * bn - 1] = math.nan  # the last column
    z[6::3, 2 * bn + 1] = math.nan
    parts = z.split(bn, dim=1)
    tmax = torch.stack([t.amax(1) for t in parts]).float()
    tse = torch.stack([(t - t.amax(1, keepdim=True)).exp().sum(1) for t in parts]).float()
    targ = torch.stack([t.argmax(1) + i * bn for i, t in enumerate(parts)]).int()
    return z, tmax, tse, targ


@needs_dsl
def test_combine_ranks_a_nan_tile_above_every_number():
    """torch.argmax's order across tiles: the first NaN column where a row holds one, else
    the first maximum; the lse of a row with a NaN is NaN, of a finite row unchanged."""
    rows, tiles, bn = 24, 5, 128
    z, tmax, tse, targ = nan_tile_statistics(rows, tiles, bn, seed=4)
    lse = torch.empty(rows)
    pred = torch.empty(rows, dtype=torch.int64)
    ff.combine_tile_statistics(tmax, tse, targ, None, lse_out=lse, predicted_out=pred, logit_sum_out=None)
    assert pred.tolist() == z.argmax(1).tolist()
    assert pred[:6].tolist() == [bn + 2, 2 * bn + 7, 2 * bn, 4, 0, tiles * bn - 1]
    has_nan, finite = z.isnan().any(1), z.isfinite().all(1)
    assert bool(lse[has_nan].isnan().all()) and int(finite.sum()) >= rows // 2
    torch.testing.assert_close(lse[finite].double(), torch.logsumexp(z[finite], 1), rtol=0, atol=1e-5)


# ---------------------------------------------------------------------- GPU
def make_problem(n, vocab, hidden, dtype, seed, bias=False):
    """Logits of O(3) with one +8 peak per row (a peaked softmax); a tenth of the targets
    are ignore_index, a third are the peak class."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, hidden, generator=gen)
    x = torch.randn(n, hidden, generator=gen) * (3.0 / math.sqrt(hidden))
    peak = torch.randint(0, vocab, (n,), generator=gen)
    wp = w[peak]
    x += 8.0 * wp / (wp * wp).sum(1, keepdim=True)
    y = torch.randint(0, vocab, (n,), generator=gen)
    y[::3] = peak[::3]
    y[torch.rand(n, generator=gen) < 0.1] = IGNORE
    b = torch.randn(vocab, generator=gen) * 0.5 if bias else None
    dev = torch.device("cuda")
    return (x.to(dtype).to(dev), w.to(dtype).to(dev), y.to(dev), None if b is None else b.to(dtype).to(dev))


def reference(x, w, y, b, softcap, dtype=torch.float64):
    """Row statistics from dense logits computed in ``dtype`` (float64: the reference; the
    input dtype: what torch itself achieves)."""
    if dtype == torch.float64:
        z = x.double() @ w.double().t()
        if b is not None:
            z = z + b.double()
    else:
        z = F.linear(x, w, b).float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    valid = (y >= 0) & (y < w.shape[0])
    zt = torch.where(valid, z.gather(1, y.clamp(0, w.shape[0] - 1)[:, None])[:, 0], torch.zeros_like(z[:, 0]))
    return dict(lse=torch.logsumexp(z, 1), target_logit=zt, logit_sum=z.sum(1), z=z)


def check_against_reference(out, x, w, y, b, softcap, with_logit_sum=True):
    ref = reference(x, w, y, b, softcap)
    base = reference(x, w, y, b, softcap, dtype=x.dtype)
    names = ["lse", "target_logit"] + (["logit_sum"] if with_logit_sum else [])
    for name in names:
        ours = (out[name].double() - ref[name]).abs().max().item()
        torch_err = (base[name].double() - ref[name]).abs().max().item()
        scale = 1.0 if name != "logit_sum" else ref[name].abs().max().item() + 1.0
        assert ours <= K * torch_err + EPS * scale, f"{name}: ours {ours:.3g} vs torch {torch_err:.3g}"
    z = ref["z"]
    pred = out["predicted"]
    assert pred.dtype == torch.int64
    zmax = z.max(1).values
    z_at_pred = z.gather(1, pred.clamp(0, z.shape[1] - 1)[:, None])[:, 0]
    assert bool(((pred >= 0) & (pred < z.shape[1])).all()), "predicted out of range"
    assert bool((z_at_pred >= zmax - 1e-3 * (1 + zmax.abs())).all()), "predicted is not a maximum"
    assert (pred == z.argmax(1)).double().mean().item() >= 0.99
    ignored = (y < 0) | (y >= w.shape[0])
    assert bool((out["target_logit"][ignored] == 0).all()), "ignored rows must keep target_logit 0"


@needs_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [32000, 151936])  # neither a multiple of 256: last tile partial
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("softcap", [None, 15.0])
def test_matches_float64(dtype, vocab, bias, softcap):
    # N=1000: not a multiple of 128, the last row block is partial.
    x, w, y, b = make_problem(1000, vocab, 2048, dtype, seed=vocab + bias, bias=bias)
    out = ff.fused_forward_statistics(x, w, y, bias=b, softcap=softcap, with_logit_sum=True)
    check_against_reference(out, x, w, y, b, softcap)


@needs_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [4096, 5120])
def test_llama_vocab_small_n(hidden):
    # V=128256 (Llama 3), a small odd N, the hidden sizes that matter.
    x, w, y, b = make_problem(257, 128256, hidden, torch.bfloat16, seed=hidden)
    out = ff.fused_forward_statistics(x, w, y)
    assert "logit_sum" not in out
    check_against_reference(out, x, w, y, b, None, with_logit_sum=False)


@needs_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_launch_shapes(config):
    x, w, y, b = make_problem(1000, 32000, 2048, torch.bfloat16, seed=7, bias=True)
    out = ff.fused_forward_statistics(
        x, w, y, bias=b, softcap=30.0, with_logit_sum=True, config=ff.FusedForwardConfig(**config)
    )
    check_against_reference(out, x, w, y, b, 30.0)


@needs_sm90
@pytest.mark.gpu
def test_several_launches_and_int32_target():
    # A budget of a few row blocks forces several launches over slices of the rows.
    x, w, y, b = make_problem(1000, 32000, 2048, torch.bfloat16, seed=11)
    budget = 3 * 128 * 125 * 16
    out = ff.fused_forward_statistics(x, w, y.int(), with_logit_sum=True, workspace_bytes=budget)
    check_against_reference(out, x, w, y, b, None)


@needs_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
@pytest.mark.parametrize("launches", ["one", "several"])
def test_every_row_written_over_poisoned_memory(config, launches, monkeypatch):
    """The outputs and the tile statistics are allocated uninitialised: the kernels must
    write every row, ``target_logit`` included (0 from the first tile where the target is
    outside [0, V): ignore_index, a negative id, an id past V), whatever the memory held.
    Every allocation of the call is poisoned here (NaN / all-ones bits)."""
    x, w, y, b = make_problem(1000, 32000, 2048, torch.bfloat16, seed=13)
    y[1::7] = 32000 + 5
    y[2::11] = -1
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-1 if t.is_signed() else 255)

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    budget = 3 * 128 * 125 * 16 if launches == "several" else ff.DEFAULT_WORKSPACE_BYTES
    out = ff.fused_forward_statistics(
        x, w, y, with_logit_sum=True, config=ff.FusedForwardConfig(**config), workspace_bytes=budget
    )
    monkeypatch.undo()
    check_against_reference(out, x, w, y, b, None)


@needs_sm90
@pytest.mark.gpu
def test_empty_and_tiny():
    x, w, y, b = make_problem(1, 1000, 64, torch.bfloat16, seed=3)
    out = ff.fused_forward_statistics(x, w, y, with_logit_sum=True)
    check_against_reference(out, x, w, y, b, None)
    out = ff.fused_forward_statistics(x[:0], w, y[:0])
    assert out["lse"].shape == (0,)


def run_combine_kernel(tmax, tse, targ, tsum, with_logit_sum: bool) -> list[torch.Tensor]:
    """``CombineTileStatisticsKernel`` on (T, rows) CPU statistics (``tsum`` may be None
    without the logit sum) -> [lse, predicted, logit sum] on the GPU."""
    tiles, rows = tmax.shape
    dev = torch.device("cuda")
    out = [
        torch.empty(rows, device=dev),
        torch.empty(rows, dtype=torch.int64, device=dev),
        torch.empty(rows, device=dev),
    ]
    fn = ff.compile_combine(tiles, with_logit_sum)
    args = [None if t is None else t.to(dev) for t in (tmax, tse, targ, tsum)]
    fn(
        cutedsl_common.gmem_ptr(args[0], cutlass.Float32, 4),
        cutedsl_common.gmem_ptr(args[1], cutlass.Float32, 4),
        cutedsl_common.gmem_ptr(args[2], cutlass.Int32, 4),
        cutedsl_common.gmem_ptr(args[3], cutlass.Float32, 4),
        cutedsl_common.gmem_ptr(out[0], cutlass.Float32, 4),
        cutedsl_common.gmem_ptr(out[1], cutlass.Int64, 8),
        cutedsl_common.gmem_ptr(out[2], cutlass.Float32, 4),
        cutedsl_common.arg_i32(rows),
        cutedsl_common.cuda_stream(dev),
    )
    return out


@needs_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("with_logit_sum", [False, True])
def test_combine_kernel_matches_torch_twin(with_logit_sum):
    # Per-tile statistics with cross-tile ties and a wide range of maxima; the kernel must
    # agree with combine_tile_statistics (argmax exactly, lse to fp32 rounding).
    gen = torch.Generator().manual_seed(1)
    tiles, rows = 501, 3000
    tmax = (torch.randn(tiles, rows, generator=gen) * 20).float()
    tmax[7, ::5] = tmax[300, ::5] = tmax.amax(0)[::5] + 1  # tie: tile 7 must win
    tse = torch.rand(tiles, rows, generator=gen) * 255 + 1
    targ = (torch.arange(tiles)[:, None] * 256 + torch.randint(0, 256, (tiles, rows), generator=gen)).int()
    tsum = torch.randn(tiles, rows, generator=gen) * 100
    lse, pred, zsum = torch.empty(rows), torch.empty(rows, dtype=torch.int64), torch.empty(rows)
    ff.combine_tile_statistics(
        tmax.clone(), tse, targ, tsum, lse_out=lse, predicted_out=pred, logit_sum_out=zsum if with_logit_sum else None
    )
    out = run_combine_kernel(tmax, tse, targ, tsum, with_logit_sum)
    assert torch.equal(out[1].cpu(), pred) and bool((pred[::5] == targ[7, ::5]).all())
    torch.testing.assert_close(out[0].cpu(), lse, rtol=0, atol=1e-5)
    if with_logit_sum:
        # The kernel rounds its 4 per-lane fp64 partial sums to fp32 before adding them:
        # within a few unit roundoffs of the sum of magnitudes of each row.
        bound = 4 * 2.0**-24 * tsum.double().abs().sum(0)
        assert bool(((out[2].cpu().double() - tsum.double().sum(0)).abs() <= bound).all())


@needs_sm90
@pytest.mark.gpu
def test_combine_kernel_ranks_a_nan_tile_like_the_torch_twin():
    """Tiles with NaN maxima on every one of the 4 lanes that share a row: the kernel's
    column is the torch twin's (torch.argmax's: the first NaN column), its lse NaN where
    the row holds a NaN."""
    rows, tiles, bn = 40, 37, 256
    z, tmax, tse, targ = nan_tile_statistics(rows, tiles, bn, seed=6)
    lse, pred = torch.empty(rows), torch.empty(rows, dtype=torch.int64)
    ff.combine_tile_statistics(tmax.clone(), tse, targ, None, lse_out=lse, predicted_out=pred, logit_sum_out=None)
    out = run_combine_kernel(tmax, tse, targ, None, False)
    assert pred.tolist() == z.argmax(1).tolist()
    assert out[1].cpu().tolist() == pred.tolist()
    assert out[0].cpu().isnan().tolist() == lse.isnan().tolist()
    finite = ~lse.isnan()
    torch.testing.assert_close(out[0].cpu()[finite], lse[finite], rtol=0, atol=1e-5)


@needs_sm90
@pytest.mark.gpu
def test_persistent_grid_matches_one_cluster_per_tile():
    # Each tile's statistics come from the same instructions whichever CTA runs it, so the
    # persistent grid (several tiles per cluster here: 500 cluster tiles) must agree
    # bit for bit with one cluster per tile.
    x, w, y, b = make_problem(1000, 32000, 2048, torch.bfloat16, seed=5, bias=True)
    kw = dict(bias=b, softcap=30.0, with_logit_sum=True)
    persistent = ff.fused_forward_statistics(x, w, y, config=ff.FusedForwardConfig(cluster_m=2), **kw)
    one_shot = ff.fused_forward_statistics(x, w, y, config=ff.FusedForwardConfig(cluster_m=2, persistent=False), **kw)
    assert ff.clusters_to_launch(ff.FusedForwardConfig(cluster_m=2), x.device) < 500
    for name, value in persistent.items():
        torch.testing.assert_close(value, one_shot[name], rtol=0, atol=0, msg=name)
