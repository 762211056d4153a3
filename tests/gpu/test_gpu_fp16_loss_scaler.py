"""fp16 under a loss scaler with the GPU's kernels: every backend and scheme (CuTe DSL's,
Triton's compiled kernels, the CUDA-graphed small calls), judged as the CPU suite's
``tests/test_fp16_loss_scaler.py`` judges. Skipped without CUDA."""

import pytest
import torch

import flce
from tests.entry_points import ENTRIES, run_entry
from tests.gpu.common import CUDA, skip_unless_usable
from tests.test_fp16_loss_scaler import (
    SCALER,
    SCHEMES,
    assert_amp_as_accurate_as_eager,
    assert_as_accurate_as_eager,
    frozen_weight_problem,
)

if not torch.cuda.is_available():
    pytest.skip("GPU fp16 loss-scaler suite: needs a CUDA GPU", allow_module_level=True)

pytestmark = pytest.mark.gpu

GPU_BACKENDS = ["torch", "triton", "cutedsl"]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_mixed_precision_under_a_loss_scaler(backend, scheme):
    skip_unless_usable(backend)

    def call(x, w, b, target):
        options = dict(label_smoothing=0.1, backend=backend, **SCHEMES[scheme])
        return flce.fused_linear_cross_entropy(x, w, target, bias=b, **options)

    assert_amp_as_accurate_as_eager(call, device=CUDA, what=f"{backend} {scheme}: ")


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("entry", ["fused", "cross_entropy"])
def test_frozen_fp16_weight_under_a_loss_scaler(backend, entry):
    skip_unless_usable(backend)
    entry = ENTRIES[entry]
    problem = frozen_weight_problem(entry.kind, SCALER)
    outputs, grads = run_entry(entry, problem, backend, CUDA)
    assert_as_accurate_as_eager(entry, problem, outputs, grads, what=f"{backend}: ")
