"""Timing and memory measurement for one benchmark workload.

A ``Workload`` splits one call into an untimed ``setup`` (zeroing gradients, or
running the forward in ``bwd`` mode) and a timed ``run``. On CUDA the run is
timed with events and its peak memory read from the caching allocator; on the
CPU the host clock is used and memory is not reported.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

SetupFn = Callable[[], Any]
RunFn = Callable[[Any], Any]


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Workload:
    """One call of a method: ``run(setup())`` then ``teardown()``; only ``run`` is timed.

    ``teardown`` releases what the call left behind (gradients), so that every
    call starts from the same memory state.
    """

    setup: SetupFn
    run: RunFn
    teardown: Callable[[], None] = _nothing


@dataclass(frozen=True)
class TimingStats:
    """Median and spread of a list of per-call times, in milliseconds."""

    median_ms: float
    min_ms: float
    max_ms: float
    times_ms: tuple[float, ...]

    @classmethod
    def from_times(cls, times_ms: Sequence[float]) -> TimingStats:
        if not times_ms:
            raise ValueError("no timings recorded")
        return cls(
            median_ms=statistics.median(times_ms),
            min_ms=min(times_ms),
            max_ms=max(times_ms),
            times_ms=tuple(times_ms),
        )


def synchronize(device: torch.device) -> None:
    """Wait for all queued work on ``device`` (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Heater:
    """Keeps the GPU at its steady power draw before each timed call.

    A GPU under its power limit runs a short burst of matrix work faster after
    a light stretch than in the middle of heavy work: interleaved with memory-
    bound methods, the GEMM floor was seen 15% faster on an H200 (811 against
    700 TFLOP/s). Running ``heat_ms`` of bf16 matrix products right before each
    timed call puts every method, whatever ran before it, in the state a
    training step keeps the GPU in.
    """

    SIZE = 4096  # one product of this size takes ~0.2 ms on an H100/H200

    def __init__(self, device: torch.device, heat_ms: float) -> None:
        self.device = device
        gen = torch.Generator(device=device).manual_seed(2)
        self.a = torch.randn(self.SIZE, self.SIZE, generator=gen, device=device, dtype=torch.bfloat16)
        self.b = torch.randn(self.SIZE, self.SIZE, generator=gen, device=device, dtype=torch.bfloat16)
        self.out = torch.empty_like(self.a)
        self.reps = max(1, math.ceil(heat_ms / max(self._time_one_ms(), 1e-3)))

    def _time_one_ms(self) -> float:
        for _ in range(3):
            torch.mm(self.a, self.b, out=self.out)
        return time_once(Workload(setup=_nothing, run=lambda _: torch.mm(self.a, self.b, out=self.out)), self.device)

    def __call__(self) -> None:
        for _ in range(self.reps):
            torch.mm(self.a, self.b, out=self.out)


def time_once(workload: Workload, device: torch.device, before: Callable[[], None] | None = None) -> float:
    """Milliseconds of one ``run``, after an untimed ``setup`` (and ``before``, e.g. a heater).

    The device has finished all earlier work when the timed region starts, so
    consecutive calls (and the methods interleaved between them) never overlap.
    """
    state = workload.setup()
    if before is not None:
        before()
    synchronize(device)
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        out = workload.run(state)
        end.record()
        end.synchronize()
        elapsed = start.elapsed_time(end)
    else:
        t0 = time.perf_counter()
        out = workload.run(state)
        elapsed = (time.perf_counter() - t0) * 1e3
    del out, state
    workload.teardown()
    return float(elapsed)


def call_once(workload: Workload) -> Any:
    """One untimed call; returns what ``run`` returned (the detached loss, if any)."""
    out = workload.run(workload.setup())
    workload.teardown()
    return out


def peak_extra_bytes(workload: Workload, device: torch.device) -> int | None:
    """Peak memory one call allocates beyond what was allocated before it.

    Measured over ``setup`` and ``run`` together, so the forward that ``bwd``
    mode runs in ``setup`` and the gradients the call produces both count.
    None off CUDA, where PyTorch does not track allocations.
    """
    if device.type != "cuda":
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    state = workload.setup()
    out = workload.run(state)
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del out, state
    workload.teardown()
    return int(peak - before)


def rotated(items: Sequence[Any], shift: int) -> list[Any]:
    """``items`` rotated left by ``shift`` (the round-robin order of one round)."""
    if not items:
        return []
    k = shift % len(items)
    return list(items[k:]) + list(items[:k])


def free_memory(device: torch.device) -> None:
    """Return cached blocks to the driver (between shapes, never inside timing)."""
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
