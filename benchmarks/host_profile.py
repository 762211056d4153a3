"""Where the host time of one small loss call goes: cProfile of the public calls.

At the host-overhead shape of ``flce bench --kernel ce`` (8 tokens) the GPU work is a
few microseconds, so a call's wall time is host time (argument checks, dispatch,
launches, the per-call device-to-host read). For each
backend this profiles 200 calls of ``flce.cross_entropy`` and of
``flce.fused_linear_cross_entropy`` (each with ``loss.backward()``, or loss-only under
``torch.no_grad()`` with ``--no-grad``) and writes the
functions with the most own time, per call, to ``OUT/host_profile.txt``.

    python3 benchmarks/host_profile.py OUT [--backends cutedsl,triton] [--shape N,V,H]

With ``--ops`` it also counts, per call, the aten ops and the kernel launches
(``torch.profiler``): the per-op and per-launch host costs are what remains once the
Python is lean. ``--timeline`` lists one call's host-side events in order, with their
start and duration: the gaps between them are the Python around the ops.
``--gpu-timeline`` profiles instead one synchronized call of the fused loss per backend
and of eager PyTorch, as ``flce bench`` times it, with the GPU activity it caused: where
the GPU waits for the host between kernels.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import sys
import time
from pathlib import Path

import torch

import flce
from flce.bench.host_overhead import OVERHEAD_SHAPE
from flce.bench.timing import synchronize

CALLS = 200


def import_relative_paths(text: str) -> str:
    """``text`` with each file path written from the ``sys.path`` entry it is imported from
    (``flce/driver.py:165``, ``torch/autograd/__init__.py:253``): shorter, and free of the
    machine's directories."""
    for entry in sorted({p for p in sys.path if os.path.isabs(p) and len(p) > 1}, key=len, reverse=True):
        text = text.replace(entry.rstrip(os.sep) + os.sep, "")
    return text


def op_counts(step, device: torch.device, calls: int = 10) -> str:
    """The host-side events of ``calls`` steps (aten ops, launches), per call, most frequent first."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            step()
        synchronize(device)
    rows = sorted(prof.key_averages(), key=lambda e: -e.count)
    lines = [f"\n  {'events per call':>16}  {'host us per call':>16}  name"]
    for event in rows[:40]:
        lines.append(f"  {event.count / calls:16.1f}  {event.cpu_time_total / calls:16.1f}  {event.key[:90]}")
    return "\n".join(lines) + "\n"


def timeline(step, device: torch.device, calls: int = 20) -> str:
    """The host-side events of one call (the last of ``calls``), in order: each one's
    start after the call's start, its duration and its name, in microseconds. Ops nested
    in another are indented; the gaps between them are Python time."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            with torch.profiler.record_function("## call ##"):
                step()
        synchronize(device)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    last = max((e for e in events if e.name == "## call ##"), key=lambda e: e.time_range.start)
    t0, t1 = last.time_range.start, last.time_range.end
    inside = sorted(
        (e for e in events if t0 <= e.time_range.start and e.time_range.end <= t1 and e is not last),
        key=lambda e: (e.time_range.start, -e.time_range.end),
    )
    lines = [f"\n  one call: {(t1 - t0):.1f} us; start, duration, name (nested ops indented)"]
    open_ends: list[float] = []
    for e in inside:
        while open_ends and e.time_range.start >= open_ends[-1]:
            open_ends.pop()
        lines.append(
            f"  {e.time_range.start - t0:8.1f} {e.time_range.end - e.time_range.start:8.1f}  "
            f"{'  ' * len(open_ends)}{e.name[:80]}"
        )
        open_ends.append(e.time_range.end)
    return "\n".join(lines) + "\n"


def synchronized_call_timeline(step, device: torch.device, before=None, calls: int = 3) -> str:
    """One call as ``flce bench`` times it (the device idle when it starts, ``before`` run
    first outside the timed part: dropping the gradients), profiled with the GPU's
    activity: the call's host span, then every GPU kernel and copy it caused, with its start
    after the call's start and its duration, in microseconds. A kernel that starts long
    after its launch waited on the host; GPU work ending long after the host returned is a
    tail the host did not cause. The last of ``calls`` calls is shown."""
    for _ in range(5):
        if before is not None:
            before()
        step()
    synchronize(device)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        for _ in range(calls):
            if before is not None:
                before()
            synchronize(device)
            with torch.profiler.record_function("## call ##"):
                step()
            synchronize(device)
    events = prof.events()
    last = max((e for e in events if e.name == "## call ##"), key=lambda e: e.time_range.start)
    t0, t1 = last.time_range.start, last.time_range.end
    on_gpu = sorted(
        (
            e
            for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.start >= t0 and e.name != last.name
        ),
        key=lambda e: e.time_range.start,
    )
    busy = sum(e.time_range.end - e.time_range.start for e in on_gpu)
    gpu_end = max((e.time_range.end for e in on_gpu), default=t0) - t0
    lines = [
        f"\n  host span {t1 - t0:.1f} us, GPU done at {gpu_end:.1f} us, GPU busy {busy:.1f} us;"
        " start, duration, GPU activity:"
    ]
    for e in on_gpu:
        lines.append(f"  {e.time_range.start - t0:8.1f} {e.time_range.end - e.time_range.start:8.1f}  {e.name[:90]}")
    return "\n".join(lines) + "\n"


def gpu_timelines(x, w, target, backends, no_grad: bool) -> str:
    """``synchronized_call_timeline`` of the fused loss on each backend and of eager PyTorch
    (``F.linear``, fp32 upcast, ``F.cross_entropy``), with the gradients dropped before each
    call as the bench's setup does."""

    def drop_grads():
        x.grad = w.grad = None

    calls = {f"flce:{b}": lambda b=b: flce.fused_linear_cross_entropy(x, w, target, backend=b) for b in backends}
    calls["torch:eager"] = lambda: torch.nn.functional.cross_entropy(torch.nn.functional.linear(x, w).float(), target)
    text = []
    for name, call in calls.items():

        def step(call=call):
            if no_grad:
                with torch.no_grad():
                    return call()
            call().backward()

        text.append(f"\n===== {name} N={x.shape[0]} V={w.shape[0]} H={x.shape[1]}, one synchronized call")
        text.append(synchronized_call_timeline(step, x.device, drop_grads))
    return "\n".join(text)


def per_call_us(fn, device: torch.device, calls: int = 300) -> float:
    """Median over 5 batches of the wall microseconds per call of ``fn``, GPU drained at batch ends."""
    for _ in range(20):
        fn()
    synchronize(device)
    batches = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize(device)
        batches.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(batches)[2]


def time_parts(x, w, logits, target, backends) -> str:
    """Unprofiled microseconds per call of a loss call's building blocks, beside eager PyTorch."""
    from flce.dispatch import resolve_backend
    from flce.driver import validation
    from flce.driver.statistics import batch_statistics, chunk_scalars
    from flce.options import LossOptions, validate_fused_inputs
    from flce.plan import make_plan

    device, v = x.device, w.shape[0]
    options = LossOptions()
    xd, wd = x.detach(), w.detach()
    parts = {}

    def eager_step():
        loss = torch.nn.functional.cross_entropy(torch.nn.functional.linear(x, w).float(), target)
        loss.backward()

    parts["eager linear+CE fwd+bwd"] = eager_step
    parts["eager linear+CE fwd"] = lambda: torch.nn.functional.cross_entropy(
        torch.nn.functional.linear(xd, wd).float(), target
    )
    parts["torch.mm (logits GEMM)"] = lambda: torch.mm(xd, wd.t())
    parts["torch.empty x5"] = lambda: [torch.empty(8, device=device) for _ in range(5)]
    parts["validate_fused_inputs"] = lambda: validate_fused_inputs(xd, wd, target, None, None, options)
    parts["batch_statistics"] = lambda: batch_statistics(target, None, v, -100)
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    parts["validation.defer"] = lambda: (validation.defer(counts, lambda c: None), validation.raise_pending())

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.shape = a.shape
            return a.sum()

        @staticmethod
        def backward(ctx, g):
            return g.expand(ctx.shape), None

    parts["autograd.Function apply+backward"] = lambda: Identity.apply(x, w).backward()
    for backend in backends:
        plan = make_plan(LossOptions(backend=backend), device, target, None, v, torch.bfloat16)
        spec = resolve_backend(backend, device)
        scalars = chunk_scalars(options, plan.stats)
        loss_rows = torch.empty(target.shape[0], device=device)
        chunk = logits.detach().clone()
        parts[f"{backend}: make_plan"] = lambda b=backend: make_plan(
            LossOptions(backend=b), device, target, None, v, torch.bfloat16
        )
        parts[f"{backend}: CE chunk kernel"] = lambda s=spec, c=chunk, sc=scalars, r=loss_rows: s.cross_entropy_chunk(
            c,
            target,
            None,
            sc,
            loss_out=r,
            z_loss_out=None,
            correct_out=None,
            predicted_out=None,
            row_grad_scale=None,
            compute_grad=True,
        )
        parts[f"{backend}: fused fwd+bwd"] = lambda b=backend: flce.fused_linear_cross_entropy(
            x, w, target, backend=b
        ).backward()

        def forward_only(b=backend):
            with torch.no_grad():
                flce.fused_linear_cross_entropy(xd, wd, target, backend=b)

        parts[f"{backend}: fused fwd (no grad)"] = forward_only
        del spec
    lines = ["\n===== building blocks, unprofiled (us per call, median of 5 batches)"]
    for name, fn in parts.items():
        try:
            lines.append(f"  {per_call_us(fn, device):9.1f}  {name}")
        except Exception as error:  # noqa: BLE001 (a part that does not apply is reported, not fatal)
            lines.append(f"  {'n/a':>9}  {name}: {type(error).__name__}: {error}"[:200])
    return "\n".join(lines) + "\n"


WRAPPED = (
    "flce.functional.fused_linear_cross_entropy",
    "flce.options.cached_options",
    "flce.functional.fused_linear_cross_entropy_with_options",
    "flce.options.validate_fused_inputs",
    "flce.plan.make_plan",
    "flce.driver.statistics.batch_statistics",
    "flce.driver.validation.defer",
    "flce.plan.run_loss",
    "flce.plan.forward",
    "flce.plan.graphed_forward",
    "flce.driver.graphs.graph_applies",
    "flce.plan.launched_forward",
    "flce.plan.backward",
    "flce.driver.schemes.scheme_of_call",
    "flce.driver.chunks.run_token_chunks",
    "flce.driver.chunks.allocate_rows",
    "flce.rows.cross_entropy.reduce_rows",
    "flce.output.package_result",
    "flce.driver.scaling.scale_gradients_",
    "torch.autograd.backward",
)


def time_steps(x, w, target, backends, calls: int = 300) -> str:
    """Inclusive wall microseconds per call of the driver's main steps (``WRAPPED``), from
    timers wrapped around them (about a microsecond each), without a profiler's overhead."""
    import importlib

    totals: dict[str, float] = {}
    originals = []
    for path in WRAPPED:
        module_name, name = path.rsplit(".", 1)
        original = getattr(importlib.import_module(module_name), name)

        def timed(*a, _f=original, _p=path, **k):
            start = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                totals[_p] = totals.get(_p, 0.0) + time.perf_counter() - start

        # Every module that imported the function by name calls the timed one.
        for module in [m for n, m in sys.modules.items() if n.startswith(("flce", "torch.autograd")) and m]:
            for attr, value in list(vars(module).items()):
                if value is original:
                    setattr(module, attr, timed)
                    originals.append((module, attr, original))
    lines = []
    try:
        for backend in backends:
            for label, grad in (("fwd+bwd", True), ("fwd (no grad)", False)):

                def step(b=backend, g=grad):
                    with torch.set_grad_enabled(g):
                        out = flce.fused_linear_cross_entropy(x, w, target, backend=b)
                    if g:
                        out.backward()

                wall = per_call_us(step, x.device, calls)
                gc.disable()
                try:
                    wall_no_gc = per_call_us(step, x.device, calls)
                finally:
                    gc.enable()
                totals.clear()
                for _ in range(calls):
                    step()
                synchronize(x.device)
                lines.append(
                    f"\n===== {backend} {label}: {wall:.1f} us per call ({wall_no_gc:.1f} without the garbage"
                    " collector); inclusive us per call:"
                )
                for path in WRAPPED:
                    if path in totals:
                        lines.append(f"  {totals[path] / calls * 1e6:9.1f}  {path}")
    finally:
        for module, attr, original in originals:
            setattr(module, attr, original)
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--backends", default="cutedsl,triton")
    parser.add_argument("--shape", default=None, help="N,V,H (default: the host-overhead shape)")
    parser.add_argument("--ops", action="store_true", help="count aten ops and kernel launches per call")
    parser.add_argument("--timeline", action="store_true", help="the host-side events of one call, in order")
    parser.add_argument("--parts", action="store_true", help="time the building blocks of a call, unprofiled")
    parser.add_argument("--wrap", action="store_true", help="inclusive unprofiled time of the driver's main steps")
    parser.add_argument("--no-grad", action="store_true", help="profile loss-only calls (no backward) instead")
    parser.add_argument(
        "--gpu-timeline",
        action="store_true",
        help="one synchronized call per backend and eager's, with the GPU activity it caused (no cProfile)",
    )
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=device).manual_seed(0)
    n, v, h = OVERHEAD_SHAPE.n, OVERHEAD_SHAPE.v, OVERHEAD_SHAPE.h  # as `flce bench --kernel ce` measures it
    if args.shape:
        n, v, h = (int(part) for part in args.shape.split(","))
    x = torch.randn(n, h, generator=gen, device=device).bfloat16().requires_grad_()
    w = torch.randn(v, h, generator=gen, device=device).bfloat16().requires_grad_()
    logits = torch.randn(n, v, generator=gen, device=device).bfloat16().requires_grad_()
    target = torch.randint(0, v, (n,), generator=gen, device=device)
    report = io.StringIO()
    if args.parts:
        report.write(time_parts(x, w, logits, target, args.backends.split(",")))
    if args.wrap:
        report.write(time_steps(x, w, target, args.backends.split(",")))
    if args.gpu_timeline:
        report.write(gpu_timelines(x, w, target, args.backends.split(","), args.no_grad))
    for backend in [] if args.gpu_timeline else args.backends.split(","):
        calls = {
            "cross_entropy": lambda b=backend: flce.cross_entropy(logits, target, backend=b),
            "fused_linear_cross_entropy": lambda b=backend: flce.fused_linear_cross_entropy(x, w, target, backend=b),
        }
        for api, call in calls.items():

            def step(call=call):
                if args.no_grad:
                    with torch.no_grad():
                        return call()
                out = call()
                (out if isinstance(out, torch.Tensor) else out.loss).backward()

            for _ in range(20):
                step()
            synchronize(device)
            start = time.perf_counter()
            for _ in range(CALLS):
                step()
            synchronize(device)
            wall_us = (time.perf_counter() - start) / CALLS * 1e6
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(CALLS):
                step()
            synchronize(device)
            profiler.disable()
            passes = "fwd" if args.no_grad else "fwd+bwd"
            report.write(
                f"\n===== {api} backend={backend} N={n} V={v} H={h}: {wall_us:.1f} us per call ({passes}, unprofiled)\n"
            )
            stats = pstats.Stats(profiler, stream=report)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(25)
            if args.ops:
                report.write(op_counts(step, device))
            if args.timeline:
                report.write(timeline(step, device))
    text = import_relative_paths(report.getvalue())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_profile.txt").write_text(text)
    print(text[:20000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
