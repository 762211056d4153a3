"""The block-gradient Hopper kernel (the fused forward's GEMM with an epilogue that writes
dL/dz) against float64.

CPU part (needs nvidia-cutlass-dsl, no GPU): every feature key compiles for sm_90a.

GPU part (sm_90): the gradient of a block, given the whole rows' statistics, must satisfy
``err(ours) <= 3 * err(torch) + eps`` against the float64 formulas, where ``err(torch)``
is the error of what the blocks ran without this kernel: the block's logits from a
cuBLAS GEMM in the input dtype, then the split-row gradient over them. Every value of
the block must be written (the output starts as NaN) and nothing past its columns or
rows (a finite sentinel there stays), and ignored rows must be exactly 0 even where
their logits are not finite.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from flce.dispatch import get_backend, split_rows_of
from flce.rows.cross_entropy import ChunkScalars, gradient_coefficients
from flce.testing import relative_error
from tests.backends.cutedsl_gpu import HAS_DSL, block_gradient_reference, needs_dsl, needs_sm90

if HAS_DSL:
    from flce.backends.cutedsl import fused_forward as ff
    from flce.backends.cutedsl import fused_gradient as fg

K = 3.0
EPS = 1e-5
SENTINEL = 12345.0  # finite, far from any gradient: a write past the block shows
FLAGS = ("has_bias", "has_softcap", "has_smoothing", "has_z_grad")


# ---------------------------------------------------------------------- CPU
@needs_dsl
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("flags", [(), FLAGS, ("has_softcap",), ("has_smoothing", "has_z_grad")], ids=str)
def test_every_feature_key_compiles(dtype, flags):
    # V_b = 8016: a block of V = 128256 in 16 (not a multiple of the 256-column tile).
    key = fg.FusedGradientKey(dtype, 8016, 4096, True, *(flag in flags for flag in FLAGS))
    assert fg.compile_fused_gradient(key, ff.PINGPONG_CONFIG) is not None


@needs_dsl
def test_the_cooperative_launch_shape_compiles():
    # The shape default_config gives a GPU without HBM3e (an H100), with every feature.
    key = fg.FusedGradientKey(torch.bfloat16, 8016, 4096, True, *(True for _ in FLAGS))
    assert fg.compile_fused_gradient(key, ff.COOPERATIVE_CONFIG) is not None


# ---------------------------------------------------------------------- GPU
def _plain_scalars(vocab: int, device: torch.device) -> ChunkScalars:
    """No feature, reduction "sum": the gradient is softmax minus one-hot."""
    return ChunkScalars.from_numbers(weight_sum=float(vocab), device=device)


CASES = [
    # (rows, V_b, H): a ragged last row tile (200, 45), V_b not a multiple of the 256-column
    # tile (1031, 8016) or narrower than one (300), the smallest H the kernel takes (64).
    (200, 8016, 256),
    (45, 300, 64),
    (333, 1031, 128),
]


@needs_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("flags", [(), FLAGS, ("has_softcap",), ("has_smoothing", "has_z_grad")], ids=str)
@pytest.mark.parametrize("shape", CASES, ids=str)
def test_gpu_block_gradient_matches_float64(dtype, flags, shape):
    check_block_gradient(dtype, flags, shape)


@needs_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("config", ["PINGPONG_CONFIG", "COOPERATIVE_CONFIG"])
@pytest.mark.parametrize("shape", CASES[:2], ids=str)
def test_gpu_block_gradient_of_each_launch_shape(config, shape):
    """Both shipped launch shapes, whichever this GPU's default is (``default_config``)."""
    check_block_gradient(torch.bfloat16, FLAGS, shape, getattr(ff, config))


def check_block_gradient(dtype, flags, shape, config=None):
    """One block's gradient at ``config`` (the device's default: None) against float64."""
    n, v_b, h = shape
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(n + v_b)
    x = torch.randn(n, h, device=dev, generator=gen).to(dtype)
    w = (torch.randn(v_b + 8, h, device=dev, generator=gen) * 0.3).to(dtype)[8:]  # a block: rows of W
    b = (torch.randn(v_b, device=dev, generator=gen)).to(dtype) if "has_bias" in flags else None
    softcap = 4.0 if "has_softcap" in flags else None
    y = torch.randint(-1, v_b + 1, (n,), device=dev, generator=gen)  # -1 ignored, V_b another block's
    x[y < 0] = float("inf")  # an ignored row's logits are not finite: its gradient is still 0
    scalars = ChunkScalars.from_numbers(
        ignore_index=-100,
        label_smoothing=0.1 if "has_smoothing" in flags else 0.0,
        lse_square_scale=1e-3 if "has_z_grad" in flags else 0.0,
        softcap=softcap,
        use_token_scaling=False,
        ce_grad_scale=1.0 / n,
        z_grad_scale=1.0 / n,
        weight_sum=float(4 * v_b),  # the whole vocabulary's (V): the block is one of four
        device=dev,
    )
    eps = scalars.label_smoothing / (4 * v_b)
    # The whole rows' statistics as the fused first pass gives them: lse as the reference point.
    z64 = x.double() @ w.double().t() + (b.double() if b is not None else 0.0)
    zp64 = softcap * torch.tanh(z64 / softcap) if softcap is not None else z64
    lse64 = torch.logsumexp(zp64, dim=1) + 1.0  # a row's other blocks hold mass too
    lse = torch.where(y >= 0, lse64, 0.0).float()
    inv_sum = torch.ones(n, device=dev)
    w_y = torch.rand(n, device=dev, generator=gen) + 0.5
    row_scale = torch.where(y >= 0, torch.rand(n, device=dev, generator=gen) + 0.5, 0.0)

    stride = v_b + 62 + v_b % 2  # a padded row stride, even (the kernel's demand): the padding must stay untouched
    buffer = torch.full((n + 3, stride), SENTINEL, device=dev, dtype=dtype)
    out = buffer[:n, :v_b]
    out.fill_(float("nan"))
    coefs = gradient_coefficients(w_y, lse, row_scale, scalars, eps)
    fg.fused_block_gradient(x, w, b, out, y, lse, inv_sum, *coefs, scalars.weight_sum, softcap, config=config)

    want = block_gradient_reference(
        torch.where((y >= 0)[:, None], z64, 0.0),
        y,
        lse.double(),
        inv_sum.double(),
        *(None if c is None else c.double() for c in coefs),
        scalars.weight_sum.double(),
        softcap,
    )
    assert bool(torch.isfinite(out).all()), "a value of the block was not written"
    assert bool((out[y < 0] == 0).all()), "ignored rows must be exactly 0"
    assert bool((buffer[:n, v_b:] == SENTINEL).all()) and bool((buffer[n:] == SENTINEL).all()), "written past the block"

    # What the blocks ran without the kernel: cuBLAS logits in the input dtype, then the
    # split-row gradient over them.
    logits = torch.addmm(b, x, w.t()) if b is not None else x @ w.t()
    logits[y < 0] = 0.0  # the cuBLAS path's ignored rows, finite here: they are selected away
    split_rows_of(get_backend("torch")).gradient(logits, y, None, lse, inv_sum, w_y, lse, row_scale, scalars, eps)
    valid = y >= 0
    ours, theirs = relative_error(out[valid], want[valid]), relative_error(logits[valid], want[valid])
    assert ours <= K * theirs + EPS, (ours, theirs)


@needs_sm90
@pytest.mark.gpu
def test_gpu_block_gradient_rows_of_every_launch_shape():
    """Row counts around the cluster's 128-row tiles and the persistent grid's wave."""
    dev = torch.device("cuda")
    for n, v_b in itertools.product((1, 63, 64, 129, 4096 + 17), (256, 257)):
        x = torch.randn(n, 64, device=dev, dtype=torch.bfloat16)
        w = torch.randn(v_b, 64, device=dev, dtype=torch.bfloat16)
        y = torch.randint(0, v_b, (n,), device=dev)
        scalars = _plain_scalars(v_b, dev)
        z = x.float() @ w.float().t()
        lse = torch.logsumexp(z, dim=1)
        out = torch.full((n, v_b + v_b % 2), float("nan"), device=dev, dtype=torch.bfloat16)[:, :v_b]
        ones = torch.ones(n, device=dev)
        fg.fused_block_gradient(x, w, None, out, y, lse, ones, ones, None, None, scalars.weight_sum, None)
        want = torch.softmax(z, dim=1)
        want[torch.arange(n, device=dev), y] -= 1.0
        assert bool(torch.isfinite(out).all()), (n, v_b)
        torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-3, msg=f"N={n} V_b={v_b}")


@needs_sm90
@pytest.mark.gpu
def test_gpu_block_gradient_refuses_an_odd_row_stride():
    dev = torch.device("cuda")
    x = torch.randn(4, 64, device=dev, dtype=torch.bfloat16)
    w = torch.randn(33, 64, device=dev, dtype=torch.bfloat16)
    out = torch.empty(4, 33, device=dev, dtype=torch.bfloat16)  # row stride 33
    ones = torch.ones(4, device=dev)
    scalars = _plain_scalars(33, dev)
    with pytest.raises(ValueError, match="even row stride"):
        fg.fused_block_gradient(
            x,
            w,
            None,
            out,
            torch.zeros(4, dtype=torch.long, device=dev),
            ones,
            ones,
            ones,
            None,
            None,
            scalars.weight_sum,
            None,
        )
