"""The backend registry and its one selection rule: argument > ``FLCE_BACKEND`` > auto
(one spelling rule for both, ``backend_name``: case-insensitive).

Each backend lives in ``flce.backends.<name>`` and exposes ``BACKEND`` (a
``flce.backends.base.BackendSpec``: its chunk kernels, split-row kernels and optional
fused hooks, and the optional kernels of the other loss heads). Importing a backend
package never fails for a missing optional dependency: its ``availability`` says why it
cannot run instead. Every scheme (token chunks, vocabulary blocks, vocab parallelism,
fused statistics) and every loss head takes its kernels from the backend this module
resolves.

A loss head whose kernels fill an optional slot (``flce.backends.base.HEAD_SLOTS``)
resolves with ``needs=<slot>``: auto dispatch then picks the best usable backend that
has the slot (by the same ``auto_priority``), and an explicit request for a backend
without it raises ``BackendUnavailableError`` naming the slot and the backends that
have it.
"""

from __future__ import annotations

import importlib
import os
from functools import cache

import torch

from flce.backends.base import HEAD_SLOTS, BackendSpec, SplitRowKernels

BACKEND_NAMES = ("torch", "triton", "cutedsl")
ENV_VAR = "FLCE_BACKEND"
AUTO = "auto"  # the choice that asks for auto dispatch


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run on this device or installation."""


@cache
def get_backend(name: str) -> BackendSpec:
    """The registered spec of backend ``name`` (validated against ``BACKEND_NAMES``)."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES} or None, got {name!r}")
    return importlib.import_module(f"flce.backends.{name}").BACKEND


def availability(name: str, device: torch.device) -> tuple[bool, str]:
    """``(usable, reason)`` of backend ``name`` on ``device``."""
    return _availability(get_backend(name), device)


def backend_name(value, source: str = "backend") -> str | None:
    """The one spelling rule for a backend choice, shared by the ``backend=`` argument
    and ``FLCE_BACKEND``: a registered name or ``"auto"``, any case, surrounding spaces
    ignored; ``None`` (and an empty ``FLCE_BACKEND``) means not chosen. Returns the
    lower-case name, ``"auto"`` or None; anything else raises naming ``source``."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{source} must be a str or None, got {value!r}")
    if torch.compiler.is_compiling():
        # Traced (LossOptions(backend=...) in a compiled function): Dynamo traces through a
        # cached function anyway and warns that it does; the function itself, then.
        return _spelled_name.__wrapped__(value, source)
    return _spelled_name(value, source)


@cache  # every call asks, with the spelling of its code or environment (an error is not kept)
def _spelled_name(value: str, source: str) -> str:
    name = value.strip().lower()
    if name not in BACKEND_NAMES and name != AUTO:
        raise ValueError(f"{source} must be one of {BACKEND_NAMES}, {AUTO!r} or None (any case), got {value!r}")
    return name


def requested_backend(backend: str | None) -> str | None:
    """The explicit request: the argument, else ``FLCE_BACKEND``, else None (auto).
    An argument of ``"auto"`` asks for auto dispatch whatever ``FLCE_BACKEND`` says."""
    name = backend_name(backend)
    if name is None:
        name = backend_name(os.environ.get(ENV_VAR) or None, ENV_VAR)
    return None if name == AUTO else name


def resolve_backend(backend: str | None, device: torch.device, needs: str | None = None) -> BackendSpec:
    """The backend to run: an explicit request must be usable (else a clear error);
    auto picks the usable backend with the highest ``auto_priority`` (torch always is).
    ``needs``: the optional slot a loss head runs on (one of ``HEAD_SLOTS``), which the
    backend must fill; None for the cross-entropy, which every backend has."""
    if needs is not None and needs not in HEAD_SLOTS:
        raise ValueError(f"needs must be one of {HEAD_SLOTS} or None, got {needs!r}")
    name = requested_backend(backend)
    if name is not None:
        spec = get_backend(name)
        ok, why = _availability(spec, device)
        if not ok:
            raise BackendUnavailableError(f"backend {name!r} cannot run on {device}: {why}")
        if needs is not None and getattr(spec, needs) is None:
            having = [n for n in BACKEND_NAMES if getattr(get_backend(n), needs) is not None]
            raise BackendUnavailableError(
                f"backend {name!r} (from backend= or {ENV_VAR}) has no {needs} kernels; pass backend= one "
                f"of {having}, or 'auto' for the best one usable on {device}"
            )
        return spec
    return _auto_backend(device.type, device.index, needs)


def _availability(spec: BackendSpec, device: torch.device) -> tuple[bool, str]:
    """``spec.availability(device)``, the one place every choice of a backend asks it:
    cached for CUDA devices, where it does not change while the process runs and asking
    (``torch.cuda.is_available()`` among others) took tens of microseconds of host time per
    call on an H200 host; on the CPU it follows ``TRITON_INTERPRET``, so it is asked anew."""
    if device.type == "cuda":
        return _cuda_availability(spec, device.index)
    return spec.availability(device)


@cache
def _cuda_availability(spec: BackendSpec, index: int | None) -> tuple[bool, str]:
    return spec.availability(torch.device("cuda", index) if index is not None else torch.device("cuda"))


@cache
def _auto_backend(device_type: str, device_index: int | None, needs: str | None = None) -> BackendSpec:
    if device_type != "cuda":
        # Off the GPU the torch backend is the default: Triton there is only its
        # interpreter (for tests), far slower than PyTorch's CPU kernels.
        return get_backend("torch")
    device = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    usable = [
        spec
        for spec in map(get_backend, BACKEND_NAMES)
        if (needs is None or getattr(spec, needs) is not None) and _availability(spec, device)[0]
    ]
    return max(usable, key=lambda spec: spec.auto_priority)


def split_rows_of(spec: BackendSpec) -> SplitRowKernels:
    """``spec``'s split-row kernels (vocabulary blocks, vocab parallelism)."""
    if spec.split_rows is None:
        raise BackendUnavailableError(f"backend {spec.name!r} has no split-row kernels")
    return _built_split_rows(spec)


@cache  # built once per spec (they hold no state): the plan asks every call
def _built_split_rows(spec: BackendSpec) -> SplitRowKernels:
    return spec.split_rows()


def split_row_kernels(backend: str | None, device: torch.device) -> SplitRowKernels:
    """The split-row kernels of the backend ``resolve_backend`` picks."""
    return split_rows_of(resolve_backend(backend, device))


def device_helper(slot: str, device: torch.device):
    """The first registered backend's optional ``slot`` (``scale_unless_one``,
    ``scaled_copies``, ``batch_statistics``) usable on ``device``, or None: these helpers serve every
    backend's calls on the device. The helper found is cached for CUDA devices, as the
    availability it follows (``_availability``)."""
    if device.type == "cuda":
        return _cuda_device_helper(slot, device.index)
    return _device_helper(slot, device)


@cache
def _cuda_device_helper(slot: str, index: int | None):
    return _device_helper(slot, torch.device("cuda", index) if index is not None else torch.device("cuda"))


def _device_helper(slot: str, device: torch.device):
    for name in BACKEND_NAMES:
        spec = get_backend(name)
        helper = getattr(spec, slot)
        if helper is not None and _availability(spec, device)[0]:
            return helper
    return None
