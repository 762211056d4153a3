"""Fuzzing: the property generator of ``test_properties`` run for many more examples,
on the torch backend and on the Triton kernel through its interpreter (CPU)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from flce.dispatch import availability
from flce.testing import run_case
from tests.test_properties import cases

CPU = torch.device("cpu")


@settings(max_examples=700, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_fuzz_torch_backend(case):
    outcome = run_case(case, "torch", CPU)
    assert outcome.passed, f"{case}: {outcome.failures} {outcome.errors}"


@pytest.mark.skipif(not availability("triton", CPU)[0], reason=availability("triton", CPU)[1] or "triton usable")
# ~1 s a case through Triton's interpreter: 60 keep the CI suite within its time; the
# kernels' own tests cover the features one by one, and the GPU fuzz
# (tests/gpu/test_gpu_fuzz.py) runs the compiled kernels on many more cases.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_fuzz_triton_backend(case):
    outcome = run_case(case, "triton", CPU)
    assert outcome.passed, f"{case}: {outcome.failures} {outcome.errors}"
