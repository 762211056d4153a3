"""Lazy imports of optional libraries, and the checks every adapter shares.

A library that is missing, or fails while importing, becomes a reason string for the
results table; nothing here raises.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from functools import cache
from types import ModuleType
from typing import Any

# Distribution (pip) names of the optional packages, for skip reasons.
DISTRIBUTIONS = {"liger_kernel": "liger-kernel", "cut_cross_entropy": "cut-cross-entropy"}


def _installed(top: str) -> bool:
    """Whether a top-level package can be imported at all (a None entry in
    ``sys.modules`` marks one as deliberately absent)."""
    if top in sys.modules:
        return sys.modules[top] is not None
    return importlib.util.find_spec(top) is not None


@cache
def optional_import(module: str) -> tuple[ModuleType | None, str]:
    """``(module, "")`` or ``(None, why it does not import)``; cached (tests clear the cache
    with ``optional_import.cache_clear()`` after faking a module)."""
    top = module.split(".")[0]
    if not _installed(top):
        return None, f"{DISTRIBUTIONS.get(top, top)} is not installed"
    try:
        return importlib.import_module(module), ""
    except Exception as exc:  # noqa: BLE001 - any import failure is a skip reason
        return None, f"{module} does not import ({type(exc).__name__}: {exc})"


def needs_cuda(case: Any) -> str | None:
    """Why a CUDA-only method cannot run ``case`` (anything with a ``device``), or None."""
    return None if case.device.type == "cuda" else "needs a CUDA device"


def unsupported_features(case: Any, supported: Sequence[str], who: str) -> str | None:
    """Why ``who`` cannot run the features ``case.loss`` turns on, or None."""
    missing = [f for f in case.loss.enabled() if f not in supported]
    if missing:
        return f"{who} does not support {', '.join(missing)}"
    return None


def first_reason(*reasons: Callable[[], str | None]) -> str | None:
    """The first non-None reason, evaluating lazily in order (a later check may need
    what an earlier one proved: the import before the signature)."""
    for reason in reasons:
        why = reason()
        if why:
            return why
    return None
