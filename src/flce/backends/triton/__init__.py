"""The ``triton`` backend: a fused two-pass chunk CE kernel written in Triton, and the
logprobs and distillation heads' chunk kernels.

Importing this package never imports Triton: the kernel modules (``.ce``, ``.logprobs``,
``.distillation``) are loaded on the first call, so a missing or broken Triton shows up
in ``availability`` instead.
"""

from __future__ import annotations

import os
from functools import cache

import torch

from flce.backends.base import (
    BackendSpec,
    InPlaceSplitRowKernels,
    lazy_chunk_kernel,
    lazy_distillation_kernels,
    lazy_function,
    lazy_logprobs_kernels,
)

_INSTALL_HINT = "pip install 'flce[triton]'"


@cache
def _triton_import_error(interpreter: bool = False) -> str | None:
    """None when Triton (and, for ``interpreter``, the interpreter that runs its kernels on
    CPU tensors) imports, else why not; checked once, importing is not free. A missing
    dependency of an installed Triton (numpy, which the interpreter imports) is named as
    such: the fix is to install it, not Triton."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401

        if interpreter:
            import triton.runtime.interpreter  # noqa: F401
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing == "triton":
            return f"triton is not installed ({_INSTALL_HINT})"
        if missing:
            return f"triton is installed but {missing} is missing, which it imports (pip install {missing})"
        return f"triton failed to import: {exc}"
    except Exception as exc:  # a broken install must not break availability
        return f"triton failed to import: {type(exc).__name__}: {exc}"
    return _interpreter_version_error() if interpreter else None


# Triton's interpreter before 3.3 takes a ``tl.constexpr`` parameter for a tensor when its
# annotation is a string (as in modules with ``from __future__ import annotations``, like
# flce's kernels), and fails on the first ``tl.arange``; compiled kernels are not affected.
INTERPRETER_MIN_TRITON = (3, 3)


def _interpreter_version_error() -> str | None:
    """Why the installed Triton's interpreter cannot run flce's kernels, or None."""
    import triton

    try:
        version = tuple(int(part) for part in triton.__version__.split("+")[0].split(".")[:2])
    except ValueError:
        return None  # a development build: let it try
    if version < INTERPRETER_MIN_TRITON:
        need = ".".join(map(str, INTERPRETER_MIN_TRITON))
        return (
            f"Triton's interpreter (TRITON_INTERPRET=1) runs flce's kernels from triton {need}; "
            f"triton {triton.__version__} is installed (pip install 'triton>={need}')"
        )
    return None


def _interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def availability(device: torch.device) -> tuple[bool, str]:
    try:
        device = torch.device(device)
    except Exception as exc:
        return False, f"not a device: {device!r} ({exc})"
    if device.type not in ("cuda", "cpu"):
        return (
            False,
            f"the triton backend runs on CUDA devices (or on CPU through Triton's interpreter), not {device.type}",
        )
    error = _triton_import_error(interpreter=device.type == "cpu" and _interpreter_enabled())
    if error is not None:
        return False, error
    if device.type == "cpu":
        if not _interpreter_enabled():
            return False, (
                "triton kernels run on CPU tensors only through Triton's interpreter; "
                "set TRITON_INTERPRET=1 before importing triton (slow, meant for tests)"
            )
        return True, ""
    try:
        if not torch.cuda.is_available():
            return False, "CUDA is not available in this PyTorch build or on this machine"
    except Exception as exc:
        return False, f"CUDA query failed: {exc}"
    return True, ""


BACKEND = BackendSpec(
    name="triton",
    cross_entropy_chunk=lazy_chunk_kernel("flce.backends.triton.ce"),
    split_rows=lambda: InPlaceSplitRowKernels("triton", "flce.backends.triton.partial"),
    availability=availability,
    extra_bytes_per_logit=0,
    auto_priority=10,
    description="fused two-pass Triton CE kernel, in place (no fp32 workspace); CUDA GPUs",
    scale_unless_one=lazy_function("flce.backends.triton.scale", "scale_unless_one_"),
    scaled_copies=lazy_function("flce.backends.triton.scale", "scaled_copies"),
    batch_statistics=lazy_function("flce.backends.triton.statistics", "batch_statistics_values"),
    # In place, like the CE kernel: no fp32 workspace.
    logprobs=lazy_logprobs_kernels("flce.backends.triton.logprobs", extra_bytes_per_logit=0),
    distillation=lazy_distillation_kernels("flce.backends.triton.distillation", extra_bytes_per_logit=0),
)
