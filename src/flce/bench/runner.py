"""The sweep: for each shape, every method warmed up, measured for memory, then
timed round-robin (each round runs each method once, the order rotated); on CUDA,
then the host side of its calls (syncs, host time with the GPU kept busy, the time per
call of calls queued back to back).

A method that cannot run a case, or fails while running it (an error, out of
memory), becomes a skipped result with the reason; the sweep goes on.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from flce.bench.cases import BenchCase, BenchLossSettings, Inputs, Shape, make_inputs
from flce.bench.graph import NotCapturable, first_line
from flce.bench.methods import Method
from flce.bench.timing import (
    GpuBusy,
    Heater,
    TimingStats,
    Workload,
    back_to_back_ms,
    call_once,
    count_host_syncs,
    free_memory,
    host_time_once,
    peak_extra_bytes,
    rotated,
    time_once,
    wall_time_once,
)

# Host-timed calls per method; their median is the host time reported.
HOST_CALLS = 5
# Batches of calls queued back to back per method (``back_to_back_ms``); their median is
# the loop time reported. A batch holds enough calls to last LOOP_BATCH_MS on an idle GPU
# (the events' resolution and one call's jitter then weigh little), at most LOOP_MAX_CALLS.
LOOP_BATCHES = 3
LOOP_BATCH_MS = 20.0
LOOP_MAX_CALLS = 50
# Steps of the host measurement per method: one call counting syncs, one wall-clock
# estimate, the host-timed calls and the back-to-back batches.
HOST_STEPS = 2 + HOST_CALLS + LOOP_BATCHES
# The back-to-back time includes each call's setup, which in the bwd mode runs the forward.
LOOP_MODES = ("fwd", "full")
# The spin queued on the GPU before each host-timed call: this many times the call's whole
# wall time on an idle GPU (more than the host time of a call that does not synchronize),
# and at least MIN_BUSY_MS.
BUSY_FACTOR = 2.0
MIN_BUSY_MS = 20.0
HOST_CUDA_ONLY = "host syncs and host time per call are measured on CUDA devices only"


@dataclass(frozen=True)
class SweepSettings:
    """What every sweep shares (the fused loss's and the CE kernel's): the loss options,
    the inputs' seed and ignored fraction, and how ``measure_runs`` measures."""

    loss: BenchLossSettings
    rounds: int
    warmup: int
    device: torch.device
    seed: int = 0
    ignore_fraction: float = 0.0
    heat_ms: float = 0.0

    def record(self) -> dict[str, Any]:
        """The settings every result file records, under the same keys."""
        return {
            "features": list(self.loss.enabled()),
            "reduction": self.loss.reduction,
            "ignore_fraction": self.ignore_fraction,
            "rounds": self.rounds,
            "warmup": self.warmup,
            "seed": self.seed,
            "device": str(self.device),
            "timer": "cuda events" if self.device.type == "cuda" else "time.perf_counter",
            "heat_ms": self.heat_ms,
        }

    def steps_per_case(self, n_methods: int) -> int:
        """Calls per case (a shape): one probe, the warm-up, one memory run and the rounds."""
        return n_methods * (2 + self.warmup + self.rounds)


@dataclass(frozen=True, kw_only=True)
class BenchConfig(SweepSettings):
    """Everything a sweep of the fused loss needs, resolved from the command line."""

    mode: str
    dtype: torch.dtype
    shapes: tuple[Shape, ...]
    graph: bool = False

    def case(self, shape: Shape) -> BenchCase:
        return BenchCase(
            shape=shape, dtype=self.dtype, mode=self.mode, loss=self.loss, device=self.device, graph=self.graph
        )

    @property
    def measures_host(self) -> bool:
        """Whether the host side of the calls is measured (CUDA only: ``HOST_CUDA_ONLY``)."""
        return self.device.type == "cuda"

    @property
    def host_not_measured(self) -> str:
        """Why the rows have no host side when ``measures_host`` is False."""
        return HOST_CUDA_ONLY

    def steps_per_case(self, n_methods: int) -> int:
        """The sweep's calls per case, then the host measurement's."""
        return super().steps_per_case(n_methods) + (n_methods * HOST_STEPS if self.measures_host else 0)


@dataclass(frozen=True)
class Result:
    """One method at one shape: measured, or skipped with the reason."""

    method: str
    label: str
    shape: Shape
    chunk_size: int | None = None
    is_floor: bool = False
    reason: str | None = None
    timing: TimingStats | None = None
    peak_extra_bytes: int | None = None
    tflops: float | None = None
    ratio_to_floor: float | None = None
    loss: float | None = None
    notes: tuple[str, ...] = ()
    # What the method ran, in words (``Method.describe``: flce's scheme), or None.
    scheme_text: str | None = None
    # The host side of a call: synchronizing CUDA operations in one call, the time until a
    # call returns to Python with the GPU busy, or why they were not measured.
    host_syncs: int | None = None
    host_timing: TimingStats | None = None
    host_reason: str | None = None
    # Milliseconds per call of calls queued back to back (``back_to_back_ms``), per batch.
    loop_timing: TimingStats | None = None

    @property
    def ok(self) -> bool:
        return self.reason is None and self.timing is not None


@dataclass
class Running:
    """A method being measured at the current shape (mutable bookkeeping); ``method``
    is anything with a ``name`` (a ``Method``, or a CE-kernel benchmark method)."""

    method: Any
    workload: Workload
    times_ms: list[float] = field(default_factory=list)
    peak: int | None = None
    loss: float | None = None
    notes: list[str] = field(default_factory=list)
    failure: str | None = None
    host_syncs: int | None = None
    host_times_ms: list[float] = field(default_factory=list)
    host_reason: str | None = None
    loop_times_ms: list[float] = field(default_factory=list)


Progress = Callable[[int, str], None]


def skip_reason(exc: BaseException) -> str:
    """A one-line skip reason for an exception raised by a method."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return "out of memory"
    if isinstance(exc, NotCapturable):
        return str(exc)
    kind = "unsupported" if isinstance(exc, (NotImplementedError, ValueError, TypeError)) else "error"
    return f"{kind}: {first_line(exc)}"[:300]


def _scalar(value: Any) -> float | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach().float().item())
    return None


# Warnings worth keeping with a result (a peer falling back to another path, say);
# deprecation and compiler-hint subclasses are noise for a benchmark.
NOTED_WARNINGS = (UserWarning, RuntimeWarning)


def _probe(run: Running) -> None:
    """The first call: catches errors and warnings (kept as notes) and the loss value; a
    loss that is NaN or infinite is noted, so that a time of a wrong result never reads as
    a plain one (the tables print the loss only in the JSON and CSV)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.loss = _scalar(call_once(run.workload))
    if run.loss is not None and not math.isfinite(run.loss):
        run.notes.append(f"the loss is {run.loss}: this method's result is wrong at this case")
    for w in caught:
        if w.category not in NOTED_WARNINGS:
            continue
        note = f"{w.category.__name__}: {str(w.message).splitlines()[0]}"[:300]
        if note not in run.notes:
            run.notes.append(note)


def _guarded(run: Running, step: Callable[[], None], device: torch.device) -> None:
    """Run one step of a method unless it already failed; a failure is recorded."""
    if run.failure is not None:
        return
    try:
        step()
    except Exception as exc:  # noqa: BLE001 - any failure of a peer is a skip, never a crash
        run.failure = skip_reason(exc)
        free_memory(device)


def measure_runs(
    config: SweepSettings,
    label: str,
    runs: list[Running],
    progress: Progress,
) -> None:
    """Probe, warm up, measure memory, then time ``runs`` round-robin; failures are
    recorded in each run, and ``label`` names the case in the progress messages."""
    device = config.device
    for run in runs:
        _guarded(run, lambda run=run: _probe(run), device)
        progress(1, f"{label} probe {run.method.name}")
    for i in range(config.warmup):
        for run in rotated(runs, i):
            _guarded(run, lambda run=run: call_once(run.workload), device)
            progress(1, f"{label} warm-up")
    for run in runs:

        def measure(run: Running = run) -> None:
            run.peak = peak_extra_bytes(run.workload, device)

        _guarded(run, measure, device)
        progress(1, f"{label} memory")
    heater = Heater(device, config.heat_ms) if config.heat_ms > 0 and device.type == "cuda" else None
    for r in range(config.rounds):
        for run in rotated(runs, r):

            def timed(run: Running = run) -> None:
                run.times_ms.append(time_once(run.workload, device, heater))

            _guarded(run, timed, device)
            progress(1, f"{label} round {r + 1}/{config.rounds}")


def loop_calls(wall_ms: float) -> int:
    """Calls per back-to-back batch for a method whose call takes ``wall_ms`` on an idle GPU."""
    return max(1, min(LOOP_MAX_CALLS, math.ceil(LOOP_BATCH_MS / max(wall_ms, 1e-3))))


def measure_host(config: BenchConfig, label: str, runs: Sequence[Running], progress: Progress) -> None:
    """The host side of each run's calls, on CUDA (``config.measures_host``): the syncs of
    one call, then the host time of ``HOST_CALLS`` calls, each queued behind a spin on
    the GPU so that only a sync makes the host wait, then (``fwd`` and ``full`` modes) the
    time per call of ``LOOP_BATCHES`` batches of calls queued back to back. A failure here
    leaves the method's timing alone and becomes its ``host_reason``."""
    if not config.measures_host:
        return
    device = config.device
    busy = GpuBusy(device)
    for run in runs:
        if run.failure is None:
            try:
                run.host_syncs = count_host_syncs(run.workload, device)
                wall_ms = wall_time_once(run.workload, device)
                busy_ms = max(MIN_BUSY_MS, BUSY_FACTOR * wall_ms)
                waits = 0
                for _ in range(HOST_CALLS):
                    elapsed, waited = host_time_once(run.workload, device, busy, busy_ms)
                    run.host_times_ms.append(elapsed)
                    waits += waited
                if waits:
                    run.notes.append(
                        f"the GPU had run out of queued work before the call returned in {waits} of {HOST_CALLS} "
                        f"host-timed calls ({busy_ms:.0f} ms of spin queued before each): the call waits for the GPU"
                    )
                if config.mode in LOOP_MODES:
                    calls = loop_calls(wall_ms)
                    run.loop_times_ms.extend(back_to_back_ms(run.workload, device, calls) for _ in range(LOOP_BATCHES))
            except Exception as exc:  # noqa: BLE001 - the timing stands without the host side
                run.host_syncs = None
                run.host_times_ms.clear()
                run.loop_times_ms.clear()
                run.host_reason = skip_reason(exc)
                run.notes.append(f"host syncs and host time not measured: {run.host_reason}")
                free_memory(device)
        progress(HOST_STEPS, f"{label} host {run.method.name}")


# Devices on which the GEMMs alone are a floor for the loss's time, so that TFLOP/s and the
# ratio to the floor mean something. On the CPU the small default case times host work and
# PyTorch's CPU kernels: the loss was seen faster than its own GEMMs (a ratio below 1).
FLOOR_DEVICES = ("cuda",)


def described(method: Any, case: BenchCase) -> str | None:
    """``method.describe(case)``: what it runs, in words; None where it has no description
    or cannot give one (it is a report's detail, never a reason to fail a run)."""
    describe = getattr(method, "describe", None)
    if describe is None:
        return None
    try:
        return describe(case)
    except Exception as exc:  # noqa: BLE001 - a method that cannot run the case is skipped with its own reason
        return f"unknown ({first_line(exc)})"


def _finish(config: BenchConfig, shape: Shape, runs: Sequence[Running]) -> list[Result]:
    """Results of one shape, with TFLOP/s and the time ratio to the floor where the floor
    is one (``FLOOR_DEVICES``)."""
    has_floor = config.device.type in FLOOR_DEVICES
    case = config.case(shape)
    results = []
    for run in runs:
        m = run.method
        base = {"method": m.name, "label": m.label, "shape": shape, "chunk_size": m.chunk_size, "is_floor": m.is_floor}
        base["scheme_text"] = described(m, case) if run.failure is None else None
        if run.failure is not None or not run.times_ms:
            results.append(Result(**base, reason=run.failure or "no timing", notes=tuple(run.notes)))
            continue
        timing = TimingStats.from_times(run.times_ms)
        results.append(
            Result(
                **base,
                timing=timing,
                peak_extra_bytes=run.peak,
                tflops=shape.flops(config.mode) / (timing.median_ms * 1e-3) / 1e12 if has_floor else None,
                loss=run.loss,
                notes=tuple(run.notes),
                host_syncs=run.host_syncs,
                host_timing=TimingStats.from_times(run.host_times_ms) if run.host_times_ms else None,
                host_reason=run.host_reason if config.measures_host else config.host_not_measured,
                loop_timing=TimingStats.from_times(run.loop_times_ms) if run.loop_times_ms else None,
            )
        )
    floor = next((r for r in results if r.is_floor and r.ok), None)
    if floor is None or not has_floor:
        return results
    return [replace(r, ratio_to_floor=r.timing.median_ms / floor.timing.median_ms) if r.ok else r for r in results]


def unusable_methods(methods: Sequence[Any], case: Any) -> dict[str, str]:
    """Name -> why, for the methods whose ``check`` says they cannot run ``case``."""
    skipped: dict[str, str] = {}
    for m in methods:
        try:
            why = m.check(case)
        except Exception as exc:  # noqa: BLE001 - a broken check is a skip reason too
            why = skip_reason(exc)
        if why:
            skipped[m.name] = why
    return skipped


def run_shape(
    config: BenchConfig,
    shape: Shape,
    methods: Sequence[Method],
    progress: Progress,
) -> list[Result]:
    """All methods at one shape; inputs are built once and shared, then freed."""
    case = config.case(shape)
    skipped = unusable_methods(methods, case)
    inputs: Inputs | None = make_inputs(case, seed=config.seed, ignore_fraction=config.ignore_fraction)
    runs: list[Running] = []
    for m in methods:
        if m.name in skipped:
            continue
        try:
            runs.append(Running(method=m, workload=m.workload(case, inputs)))
        except Exception as exc:  # noqa: BLE001
            skipped[m.name] = skip_reason(exc)
    progress(config.steps_per_case(len(methods) - len(runs)), f"{shape.label()} skipped")
    measure_runs(config, shape.label(), runs, progress)
    measure_host(config, shape.label(), runs, progress)
    measured = {r.method: r for r in _finish(config, shape, runs)}
    del runs, inputs
    free_memory(config.device)
    return [
        measured.get(m.name) or Result(m.name, m.label, shape, m.chunk_size, m.is_floor, reason=skipped[m.name])
        for m in methods
    ]


def run_sweep(
    config: BenchConfig,
    methods: Sequence[Method],
    progress: Progress | None = None,
) -> list[Result]:
    """Every shape of ``config`` in turn; results in shape order, then method order."""
    tick = progress or (lambda n, what: None)
    results: list[Result] = []
    for shape in config.shapes:
        results.extend(run_shape(config, shape, methods, tick))
    return results
