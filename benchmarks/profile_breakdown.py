"""Where the time of one forward+backward goes: GPU kernel time per kernel, per method.

Runs each method of ``flce bench`` once to warm up, then three times under
``torch.profiler`` (CUDA activity only) and groups the kernels into GEMMs, the CE
kernel, fp32 dW accumulation/casts and the rest. The sum of kernel times is what the
GPU was busy with; the gap to the CUDA-event time of the same call is launch overhead
and idle time. The traced calls also tell where that idle time lies: the kernels' span
(first start to last end) against the CUDA-event time of the same traced call leaves the
time outside it (the host's work before the first kernel, and after the last), and the
span against the union of the kernels the GPU's idle gaps inside it. Writes
``OUT/profile.json`` and prints a table.

    python3 benchmarks/profile_breakdown.py OUT [--n 8192 --v 128256 --h 4096] [--mode fwd]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from flce.bench.cases import BenchCase, BenchLossSettings, Shape, make_inputs
from flce.bench.registry import all_methods
from flce.bench.timing import Heater, call_once, time_once

METHODS = ("floor:gemm", "flce:cutedsl", "flce:triton", "liger:cute-sm90", "liger:triton")
REPEATS = 3
HEAT_MS = 100.0  # as flce bench: GEMM work right before each call (see Heater)


def kernel_group(name: str) -> str:
    """A coarse class of a CUDA kernel by its (mangled) name."""
    lowered = name.lower()
    # CE names first: CuTe DSL kernels carry "cutlass" in their names whatever they do.
    if any(
        key in lowered for key in ("crossentropyclustervec", "chunkcrossentropy", "_ce_chunk", "cross_entropy_kernel")
    ):
        return "ce kernel"
    if "fusedforward" in lowered:
        return "fused forward gemm"
    if any(key in lowered for key in ("gemm", "sm90_xmma", "cutlass", "wgmma", "nvjet", "matmul")):
        return "gemm"
    if "copy" in lowered or "cast" in lowered or "convert" in lowered:
        return "copy/cast"
    if "reduce" in lowered or "sum" in lowered:
        return "reduction"
    if "fill" in lowered or "memset" in lowered:
        return "fill"
    return "other"


def timeline(intervals: list[tuple[float, float]], call_ms: float) -> dict:
    """Where one traced call's time went: ``intervals`` are its kernels' (start, end) in
    microseconds, ``call_ms`` the CUDA-event time around the call."""
    if not intervals:
        return {"call_ms": call_ms}
    intervals.sort()
    busy_us, gaps_us = 0.0, []
    run_start, run_end = intervals[0]
    for begin, finish in intervals[1:]:
        if begin > run_end:
            busy_us += run_end - run_start
            gaps_us.append(begin - run_end)
            run_start, run_end = begin, finish
        else:
            run_end = max(run_end, finish)
    busy_us += run_end - run_start
    span_ms = (run_end - intervals[0][0]) / 1000.0
    return {
        "call_ms": call_ms,
        "kernel_span_ms": span_ms,
        "outside_span_ms": call_ms - span_ms,  # before the first kernel and after the last
        "idle_inside_span_ms": span_ms - busy_us / 1000.0,
        "largest_gaps_ms": [gap / 1000.0 for gap in sorted(gaps_us, reverse=True)[:5]],
    }


def profile_method(method, case: BenchCase, inputs) -> dict:
    workload = method.workload(case, inputs)
    call_once(workload)  # compile / autotune outside the measurement
    heater = Heater(case.device, HEAT_MS)
    event_ms = [time_once(workload, case.device, before=heater) for _ in range(REPEATS)]
    per_kernel: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    timelines = []
    for _ in range(REPEATS):
        heater()  # the same power state as the timed calls, outside the trace
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # CUDA activity only: tracing the host's operations would slow the host work
        # whose latency the timeline measures.
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start.record()
            call_once(workload)
            end.record()
            torch.cuda.synchronize()
        intervals = []
        for event in prof.events():
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            per_kernel[event.name] += event.device_time / 1000.0 / REPEATS  # us -> ms per call
            counts[event.name] += 1
            intervals.append((event.time_range.start, event.time_range.end))
        timelines.append(timeline(intervals, start.elapsed_time(end)))
    groups: dict[str, float] = defaultdict(float)
    for name, ms in per_kernel.items():
        groups[kernel_group(name)] += ms
    top = sorted(per_kernel.items(), key=lambda item: -item[1])[:12]
    return {
        "event_ms_median": statistics.median(event_ms),
        "kernel_ms_total": sum(per_kernel.values()),
        "traced_calls": timelines,
        "groups_ms": dict(sorted(groups.items(), key=lambda item: -item[1])),
        "top_kernels": [
            {"name": name[:160], "ms_per_call": ms, "launches_per_call": counts[name] / REPEATS} for name, ms in top
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--v", type=int, default=128256)
    parser.add_argument("--h", type=int, default=4096)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--mode", choices=("full", "fwd"), default="full", help="fwd+bwd, or the forward without grad")
    args = parser.parse_args()
    device = torch.device("cuda")
    case = BenchCase(Shape(args.n, args.v, args.h), torch.bfloat16, args.mode, BenchLossSettings(), device)
    inputs = make_inputs(case)
    by_name = {m.name: m for m in all_methods()}
    report = {
        "shape": case.shape.label(),
        "dtype": "bf16",
        "mode": args.mode,
        "gpu": torch.cuda.get_device_name(),
        "methods": {},
    }
    for name in args.methods.split(","):
        method = by_name[name]
        reason = method.check(case)
        if reason:
            report["methods"][name] = {"skipped": reason}
            continue
        try:
            report["methods"][name] = profile_method(method, case, inputs)
        except Exception as exc:  # one failing method must not hide the others
            report["methods"][name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.json").write_text(json.dumps(report, indent=1))
    print(f"{report['shape']} bf16 {'fwd+bwd' if args.mode == 'full' else 'forward'} on {report['gpu']}; ms per call")
    for name, row in report["methods"].items():
        if "groups_ms" not in row:
            print(f"{name:18s} {row}")
            continue
        groups = "  ".join(f"{group} {ms:6.2f}" for group, ms in row["groups_ms"].items())
        print(f"{name:18s} events {row['event_ms_median']:6.2f}  kernels {row['kernel_ms_total']:6.2f}  | {groups}")
        traced = [t for t in row["traced_calls"] if "kernel_span_ms" in t]
        if traced:
            outside = statistics.median(t["outside_span_ms"] for t in traced)
            inside = statistics.median(t["idle_inside_span_ms"] for t in traced)
            print(f"    traced calls: {outside:.3f} ms outside the kernels' span, {inside:.3f} ms idle inside it")
        for kernel in row["top_kernels"][:6]:
            print(f"    {kernel['ms_per_call']:7.3f} ms  x{kernel['launches_per_call']:.0f}  {kernel['name'][:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
