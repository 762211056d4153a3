"""The CPU fuzzing generator (``tests/test_properties.py``) run against the GPU backends."""

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from flce.testing import run_case
from tests.gpu.common import CUDA, skip_unless_usable
from tests.test_properties import cases

if not torch.cuda.is_available():
    pytest.skip("GPU fuzzing: needs a CUDA GPU", allow_module_level=True)

pytestmark = pytest.mark.gpu
EXAMPLES = int(os.environ.get("FLCE_GPU_FUZZ_EXAMPLES", "300"))


@pytest.mark.parametrize("backend", ["triton", "cutedsl"])
def test_fuzz_gpu_backend(backend):
    skip_unless_usable(backend)

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=cases())  # vocab_chunk_size too: every backend has split-row kernels
    def check(case):
        outcome = run_case(case, backend, CUDA)
        assert outcome.passed, f"{case}: {outcome.failures} {outcome.errors}"

    check()
