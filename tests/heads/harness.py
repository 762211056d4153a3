"""What the kernel tests of the RL and distillation heads share: inputs whose rows are
of every kind that stresses the math, and the judge.

Each output is judged against float64 by its relative error in norm, against the error
that eager PyTorch makes on the same inputs in the same dtype (the reference formulas
run in fp32 on the logits as given, as eager code does with ``logits.float()``)::

    err(ours) <= 3 * err(eager torch) + floor

The floor is a rounding floor of the output's dtype: four fp32 ulps for fp32 values
(both compute in fp32), and flce.testing's two ulps for gradients stored in bf16/fp16.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import pytest
import torch

from flce.testing import EPS, TOLERANCE_FACTOR, relative_error

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP32_FLOOR = 4 * torch.finfo(torch.float32).eps


def _triton_runs_here() -> bool:
    """Triton and numpy (its interpreter's) installed, and a CUDA device or the
    interpreter on CPU (tests/conftest.py sets it)."""
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("numpy") is None:
        return False
    return HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1"


requires_triton = pytest.mark.skipif(
    not _triton_runs_here(), reason="needs triton (and numpy), and CUDA or TRITON_INTERPRET=1"
)
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
# Every kernel test runs on both backends: the PyTorch twin and the Triton kernels.
BACKENDS = ["torch", pytest.param("triton", marks=requires_triton)]


def kernels(head: str, backend: str):
    """The module with ``head``'s chunk kernels (``logprobs``, ``distillation``) of
    ``backend``, imported here so that collecting the tests never needs Triton."""
    return importlib.import_module(f"flce.backends.{backend}.{head}")


def floor(dtype: torch.dtype) -> float:
    return FP32_FLOOR if dtype == torch.float32 else EPS[dtype]


def assert_close_to_reference(name: str, ours, truth, eager, dtype: torch.dtype) -> None:
    err_ours, err_eager = relative_error(ours, truth), relative_error(eager, truth)
    allowed = TOLERANCE_FACTOR * err_eager + floor(dtype)
    assert err_ours <= allowed, (
        f"{name}: err {err_ours:.3g} > {TOLERANCE_FACTOR:g} x eager torch {err_eager:.3g} + floor {floor(dtype):.3g}"
    )


def fresh(shape, dtype=torch.float32, fill=float("nan")) -> torch.Tensor:
    """An output buffer that fails every check if a kernel forgets to write a row."""
    return torch.full(shape, fill, dtype=dtype, device=DEVICE)


# Row kinds, one per row in turn: the softmax is confident (a logit far above the rest),
# peaked (logits of scale 4), moderate (scale 1) or flat (scale 0.01).
ROW_SCALES = (4.0, 1.0, 0.01, 4.0)
CONFIDENT_GAP = 20.0


def make_logits(num_rows: int, vocab: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """(num_rows, vocab) logits of the row kinds above in turn, never all zero; every
    fifth row confident (p of its max ~ 1 - V e^-20)."""
    logits = torch.randn(num_rows, vocab, generator=generator)
    logits *= torch.tensor([ROW_SCALES[i % len(ROW_SCALES)] for i in range(num_rows)])[:, None]
    confident = torch.arange(num_rows) % 5 == 0
    columns = torch.randint(0, vocab, (num_rows,), generator=generator)
    logits[confident, columns[confident]] += CONFIDENT_GAP
    return logits.to(dtype=dtype, device=DEVICE)


def make_teacher(student: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Teacher logits for ``student`` (M, V): in turn an independent row, a row close to
    the student's (the distributions nearly agree: the divergence is ~0 and cancels),
    and the student's row itself (divergence exactly 0)."""
    num_rows, vocab = student.shape
    independent = make_logits(num_rows, vocab, torch.float32, generator).cpu()
    near = student.float().cpu() + 0.05 * torch.randn(num_rows, vocab, generator=generator)
    kind = torch.arange(num_rows)[:, None] % 3
    teacher = torch.where(kind == 0, independent, torch.where(kind == 1, near, student.float().cpu()))
    return teacher.to(dtype=student.dtype, device=DEVICE)


def make_targets(logits: torch.Tensor, generator: torch.Generator, ignore_index: int = -100) -> torch.Tensor:
    """The argmax on every other row (the confident case), a random class elsewhere, and
    two ignored rows (when there are at least four)."""
    num_rows, vocab = logits.shape
    target = torch.randint(0, vocab, (num_rows,), generator=generator)
    target[::2] = logits.float().argmax(dim=-1).cpu()[::2]
    if num_rows >= 4:
        target[1] = ignore_index
        target[num_rows - 2] = ignore_index
    return target.to(DEVICE)
