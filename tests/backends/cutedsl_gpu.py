"""What the cutedsl kernel tests on the GPU share: skipping the module where the backend
cannot run, and the tolerance of ``err(cutedsl) <= K * err(torch, same dtype) + eps``."""

from __future__ import annotations

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
