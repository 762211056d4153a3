"""What the GPU test files share."""

from __future__ import annotations

import pytest
import torch

from flce.dispatch import availability

CUDA = torch.device("cuda")


def skip_unless_usable(backend: str) -> None:
    """Skips the calling test where ``backend`` cannot run on this machine's GPU, saying why."""
    ok, why = availability(backend, CUDA)
    if not ok:
        pytest.skip(f"{backend}: {why}")
