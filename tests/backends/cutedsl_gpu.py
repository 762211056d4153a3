"""What the cutedsl kernel tests on the GPU share: skipping the module where the backend
cannot run, and the tolerance of ``err(cutedsl) <= K * err(torch, same dtype) + eps``; for
the Hopper GEMM kernels' tests (fused forward, block gradient), their marks, and the
architecture they compile for without a GPU (a CPU part of those tests compiles them)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from flce.backends.cutedsl import availability

DEVICE = torch.device("cuda")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
K = 3.0
# Floors: fp32 outputs get a few fp32 ulps; the gradient, stored in the logits dtype, a
# small fraction of that dtype's unit roundoff.
EPS_FP32 = 2e-6
EPS_GRAD = {torch.float32: 2e-6, torch.bfloat16: 1e-4, torch.float16: 2e-5}


def skip_module_without_cutedsl(what: str) -> None:
    """Skips the calling test module (before it imports cutlass) unless a CUDA GPU is
    present and the cutedsl backend is usable on it; ``what`` names the tests."""
    if not torch.cuda.is_available():
        pytest.skip(f"{what} need a CUDA GPU", allow_module_level=True)
    ok, why = availability(DEVICE)
    if not ok:
        pytest.skip(f"cutedsl backend unavailable: {why}", allow_module_level=True)


HAS_DSL = importlib.util.find_spec("cutlass") is not None
HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
if HAS_DSL and not torch.cuda.is_available():
    # Without a device the DSL compiles for the architecture named here.
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

needs_dsl = pytest.mark.skipif(not HAS_DSL, reason="nvidia-cutlass-dsl is not installed")
needs_sm90 = pytest.mark.skipif(not (HAS_DSL and HAS_SM90), reason="needs nvidia-cutlass-dsl and a CUDA sm_90 GPU")


def block_gradient_reference(z, y, row_max, inv_sum, coef_y, coef_eps, coef_z, weight_sum, softcap):
    """A vocabulary block's gradient from the whole rows' statistics and the folded per-row
    coefficients (``flce.backends.cutedsl.fused_gradient``'s formulas; ``coef_eps`` and
    ``coef_z`` None without label smoothing / z-loss), in ``z``'s dtype: ``z`` (C, V_b) the
    block's logits before the softcap, ``y`` the target's column in the block (V_b where
    absent, < 0 on ignored rows)."""
    t = torch.tanh(z / softcap) if softcap is not None else None
    zp = softcap * t if softcap is not None else z
    p = torch.exp(zp - row_max[:, None]) * inv_sum[:, None]
    coef_z = torch.zeros_like(coef_y) if coef_z is None else coef_z
    g = p * (coef_y + coef_z)[:, None]
    owned = (y >= 0) & (y < z.shape[1])
    rows = owned.nonzero().squeeze(1)
    p_y = p[rows, y[rows]]
    g[rows, y[rows]] = coef_z[rows] * p_y + coef_y[rows] * (p_y - 1.0)
    if coef_eps is not None:
        g += coef_eps[:, None] * (weight_sum * p - 1.0)
    if softcap is not None:
        g *= 1.0 - t * t
    g[y < 0] = 0.0
    return g
