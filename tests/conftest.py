"""Suite-wide set-up. Without a GPU, Triton kernels run through Triton's interpreter
on CPU tensors, so CI checks their math; the variable must be set before triton is
imported anywhere."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from flce import plan  # noqa: E402
from flce.driver import validation  # noqa: E402

# Property tests judge the code, not the machine's load: a GPU machine compiling kernels in
# several pytest processes once drew a test's first inputs in 2.6 s and failed it on the
# "too slow" health check, and CI's two cores can be as busy. No deadline, no timing check;
# a test's own @settings still override the rest.
settings.register_profile("flce", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("flce")


@pytest.fixture(autouse=True)
def _no_pending_validation_errors():
    """A bad input reported asynchronously (CUDA) belongs to the test that made it: never
    raised into the next test's first flce call."""
    yield
    validation.discard_pending()


@pytest.fixture(autouse=True)
def _routes_decided_afresh():
    """Each test decides its own calls' routes (``flce.plan.Plan.route`` keeps them per
    layout): tests patch what decides them (the scheme chooser, the default budget)."""
    plan._ROUTES.clear()
