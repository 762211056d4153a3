"""Suite-wide set-up. Without a GPU, Triton kernels run through Triton's interpreter
on CPU tensors, so CI checks their math; the variable must be set before triton is
imported anywhere."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402

from flce.driver import validation  # noqa: E402


@pytest.fixture(autouse=True)
def _no_pending_validation_errors():
    """A bad input reported asynchronously (CUDA) belongs to the test that made it: never
    raised into the next test's first flce call."""
    yield
    validation.discard_pending()
