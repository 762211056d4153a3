"""Timing and memory measurement for one benchmark workload.

A ``Workload`` splits one call into an untimed ``setup`` (zeroing gradients, or
running the forward in ``bwd`` mode) and a timed ``run``. On CUDA the run is
timed with events and its peak memory read from the caching allocator; on the
CPU the host clock is used and memory is not reported.

On CUDA the host side of a call is measured too: the synchronizing CUDA operations
one ``run`` makes (``count_host_syncs``), and the time until it returns to Python
while the GPU is still busy with earlier work (``host_time_once``), which is what lets
a training loop queue the next kernels while the GPU computes, and the time per call of
calls queued back to back (``back_to_back_ms``), which is what a loop of small calls sees.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
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
    # The peak extra memory when it is known from how the workload was built: a call
    # replayed from a CUDA graph allocates nothing, its memory was taken at capture.
    known_peak_bytes: int | None = None


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


def interleaved_times(
    workloads: dict[Any, Workload], device: torch.device, rounds: int, before: Callable[[], None] | None = None
) -> dict[Any, list[float]]:
    """Milliseconds of ``rounds`` calls of each workload, round by round in an order that
    rotates each round (``time_once``, ``before`` each call: a ``Heater``), after one
    untimed warm-up round: for scripts that time a few workloads against each other."""
    names = list(workloads)
    times: dict[Any, list[float]] = {name: [] for name in names}
    for r in range(rounds + 1):
        for name in rotated(names, r):
            elapsed = time_once(workloads[name], device, before)
            if r:
                times[name].append(elapsed)
    return times


def back_to_back_ms(workload: Workload, device: torch.device, calls: int) -> float:
    """Milliseconds per call of ``calls`` calls queued back to back, as a training loop runs
    them: each call's setup, run and teardown with no synchronization in between, the
    device timed at the two ends (CUDA events; the host clock off CUDA). Each call then
    costs the larger of its host time and its GPU time, the GPU's work overlapping the
    host's next call, where ``time_once`` also pays for a host starting cold after each
    wait. The setup is inside the timing: for methods whose setup does no work (the
    ``fwd`` and ``full`` modes)."""
    synchronize(device)
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
    else:
        t0 = time.perf_counter()
    for _ in range(calls):
        out = workload.run(workload.setup())
        del out
        workload.teardown()
    if device.type == "cuda":
        end.record()
        end.synchronize()
        elapsed = start.elapsed_time(end)
    else:
        elapsed = (time.perf_counter() - t0) * 1e3
    return float(elapsed) / calls


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
    if workload.known_peak_bytes is not None:
        return workload.known_peak_bytes
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


# ----------------------------------------------------------------------------- the host side of a call

# What PyTorch's sync debug mode warns with, once per synchronizing CUDA operation.
SYNC_WARNING = "called a synchronizing CUDA operation"


def count_host_syncs(workload: Workload, device: torch.device) -> int:
    """Synchronizing CUDA operations of one ``run`` (a call's timed part), as PyTorch's
    sync debug mode sees them: ``torch.cuda.set_sync_debug_mode("warn")`` warns once per
    operation that waits for a stream (``.item()``, a copy to the host, a data-dependent
    shape such as ``nonzero``), and autograd replays the warnings of the backward's device
    threads on this one. PyTorch calls the mode partial (not every synchronizing call
    warns), and a library that synchronizes through its own CUDA calls is not seen.
    CUDA only."""
    state = workload.setup()
    synchronize(device)
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every operation, not once per source line
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = workload.run(state)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    synchronize(device)
    del out, state
    workload.teardown()
    return sum(SYNC_WARNING in str(w.message) for w in caught)


class GpuBusy:
    """Keeps the GPU busy for a given time with a spin kernel (``torch.cuda._sleep``,
    which PyTorch's own stream tests use), so that the work a call enqueues waits behind
    it and the host never waits for the GPU unless the call synchronizes.

    The spin counts SM clock cycles, whose rate is measured once here; a clock that
    moves later changes the spin's length, and ``host_time_once`` says when the spin
    ended before the call returned.
    """

    CALIBRATION_CYCLES = 20_000_000  # ~10 ms at 2 GHz: long against the timer's resolution

    def __init__(self, device: torch.device) -> None:
        self.device = device
        torch.cuda._sleep(1000)  # loads the kernel
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(self.CALIBRATION_CYCLES)
        end.record()
        end.synchronize()
        self.cycles_per_ms = self.CALIBRATION_CYCLES / max(start.elapsed_time(end), 1e-3)

    def __call__(self, ms: float) -> torch.cuda.Event:
        """Queue ``ms`` of spinning; the returned event completes when it ends."""
        torch.cuda._sleep(max(1, int(ms * self.cycles_per_ms)))
        done = torch.cuda.Event()
        done.record()
        return done


def wall_time_once(workload: Workload, device: torch.device) -> float:
    """Milliseconds of one ``run`` until the device has finished it (host clock): an upper
    bound of the host time of a call that does not synchronize."""
    state = workload.setup()
    synchronize(device)
    t0 = time.perf_counter()
    out = workload.run(state)
    synchronize(device)
    elapsed = (time.perf_counter() - t0) * 1e3
    del out, state
    workload.teardown()
    return elapsed


def host_time_once(workload: Workload, device: torch.device, busy: GpuBusy, busy_ms: float) -> tuple[float, bool]:
    """Milliseconds until one ``run`` returns to Python with ``busy_ms`` of spinning queued
    before it on the GPU, and whether the spin had ended by then: the call waited for the
    GPU (a host sync; its time then holds the spin too), or outlasted the spin."""
    state = workload.setup()
    synchronize(device)
    spun = busy(busy_ms)
    t0 = time.perf_counter()
    out = workload.run(state)
    elapsed = (time.perf_counter() - t0) * 1e3
    waited = spun.query()
    synchronize(device)
    del out, state
    workload.teardown()
    return float(elapsed), bool(waited)
