"""The ``cutedsl`` backend: chunk CE as a CuTe DSL kernel (nvidia-cutlass-dsl), sm_90+.

Importing this package never imports ``cutlass``: the kernel module is loaded on the
first call, so a missing optional dependency only shows up in ``availability``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch

from flce.backends.base import BackendSpec, lazy_chunk_kernel

MIN_CAPABILITY = (9, 0)
INSTALL_HINT = "pip install 'flce[cutedsl]'"



@lru_cache(maxsize=None)
def _dsl_installed() -> tuple[bool, str]:
    """Whether nvidia-cutlass-dsl is installed (package metadata only, no import)."""
    try:
        from importlib import metadata

        version = metadata.version("nvidia-cutlass-dsl")
    except Exception:  # PackageNotFoundError, or broken metadata
        return False, f"nvidia-cutlass-dsl is not installed ({INSTALL_HINT})"
    try:
        import importlib.util

        if importlib.util.find_spec("cutlass") is None:
            return False, f"nvidia-cutlass-dsl {version} is installed but 'cutlass' is not importable ({INSTALL_HINT})"
    except Exception as exc:  # a broken installation must not break dispatch
        return False, f"nvidia-cutlass-dsl {version} looks broken: {exc}"
    return True, ""


@lru_cache(maxsize=None)
def _device_ok(device_type: str, index: Optional[int]) -> tuple[bool, str]:
    if device_type != "cuda":
        return False, f"needs a CUDA device, got {device_type}"
    try:
        if not torch.cuda.is_available():
            return False, "CUDA is not available"
        major, minor = torch.cuda.get_device_capability(index)
    except Exception as exc:
        return False, f"cannot query the CUDA device: {exc}"
    if (major, minor) < MIN_CAPABILITY:
        return False, f"needs compute capability >= 9.0 (Hopper), device has {major}.{minor}"
    return True, ""


def availability(device: torch.device) -> tuple[bool, str]:
    """``(True, "")`` on a CUDA device of compute capability >= 9.0 with nvidia-cutlass-dsl
    installed, else ``(False, reason)``. Cheap (cached), never raises."""
    try:
        device = torch.device(device)
        ok, why = _dsl_installed()
        if not ok:
            return ok, why
        return _device_ok(device.type, device.index)
    except Exception as exc:
        return False, f"cutedsl availability check failed: {exc}"


BACKEND = BackendSpec(
    name="cutedsl",
    cross_entropy_chunk=lazy_chunk_kernel("flce.backends.cutedsl.ce"),
    availability=availability,
    extra_bytes_per_logit=0,
    auto_priority=20,
    description="CuTe DSL chunk CE kernel (sm_90+): one pass of online softmax, gradient in place",
)
