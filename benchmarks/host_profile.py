"""Where the host time of one small loss call goes: cProfile of the public calls.

At the host-overhead shape of ``flce bench --kernel ce`` (8 tokens) the GPU work is a
few microseconds, so a call's wall time is host time (argument checks, dispatch,
launches, the per-call device-to-host read). For each
backend this profiles 200 calls of ``flce.cross_entropy`` and of
``flce.fused_linear_cross_entropy`` (each with ``loss.backward()``) and writes the
functions with the most own time, per call, to ``OUT/host_profile.txt``.

    python3 benchmarks/host_profile.py OUT [--backends cutedsl,triton]
"""

from __future__ import annotations

import argparse
import cProfile
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--backends", default="cutedsl,triton")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=device).manual_seed(0)
    n, v, h = OVERHEAD_SHAPE.n, OVERHEAD_SHAPE.v, OVERHEAD_SHAPE.h  # as `flce bench --kernel ce` measures it
    x = torch.randn(n, h, generator=gen, device=device).bfloat16().requires_grad_()
    w = torch.randn(v, h, generator=gen, device=device).bfloat16().requires_grad_()
    logits = torch.randn(n, v, generator=gen, device=device).bfloat16().requires_grad_()
    target = torch.randint(0, v, (n,), generator=gen, device=device)
    report = io.StringIO()
    for backend in args.backends.split(","):
        calls = {
            "cross_entropy": lambda b=backend: flce.cross_entropy(logits, target, backend=b),
            "fused_linear_cross_entropy": lambda b=backend: flce.fused_linear_cross_entropy(x, w, target, backend=b),
        }
        for api, call in calls.items():

            def step(call=call):
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
            report.write(f"\n===== {api} backend={backend}: {wall_us:.1f} us per call (fwd+bwd, unprofiled)\n")
            stats = pstats.Stats(profiler, stream=report)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(25)
    text = import_relative_paths(report.getvalue())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_profile.txt").write_text(text)
    print(text[:20000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
