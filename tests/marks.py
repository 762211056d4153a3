"""Skip marks the suite shares: what a test needs of the machine it runs on."""

import pytest
import torch

from flce.dispatch import availability

CPU = torch.device("cpu")

# Triton runs CPU tensors only through its interpreter, which conftest turns on where there
# is no GPU; on a CUDA machine the same tests run Triton's kernels on the GPU elsewhere.
triton_on_cpu = pytest.mark.skipif(
    not availability("triton", CPU)[0],
    reason="Triton runs CPU tensors only through its interpreter (TRITON_INTERPRET=1 before triton is imported)",
)
