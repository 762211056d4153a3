"""Host latency of a loss call, this tree against another, in one process.

The host work before a call's first GEMM delays the GPU in every synchronized call (and
in a training step whose GPU queue has run dry); a host this noisy (its repeats of the same
code differ by up to 30%) hides changes of a few percent between runs. So both trees run
in the same process, their rounds interleaved: the other tree's ``flce`` package is copied
into a temporary directory as ``flce_base`` (its imports and custom-op namespace renamed)
and imported beside this one.

Measured per method and round:

- the small shape (N = 1024, H = 1024, V = 32000), fwd+bwd, 50 calls back to back: the
  CUDA-event time per call ("loop ms", as ``flce bench``) and the host time per call,
  eager PyTorch beside;
- N = 8192, H = 4096, V = 32000, forward only and fwd+bwd, synchronized calls: the
  CUDA-event time of the call, the host time from the call's entry to its first GEMM's
  launch (``torch.mm``/``torch.addmm``, or the fused forward GEMM of the CuTe DSL
  backend), and the host time of the call; the bare GEMMs (the floor) beside.

Writes ``OUT/host-latency-ab.json`` (every sample, the medians, and per pair of trees the
median of the round-by-round ratios) and prints the medians.

    python3 benchmarks/host_latency_ab.py OUT --base-src OTHER_CHECKOUT/src [--rounds 12]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

BASE_PACKAGE = "flce_base"
SMALL_SHAPE = (1024, 1024, 32000)  # N, H, V
LARGE_SHAPE = (8192, 4096, 32000)
BACK_TO_BACK_CALLS = 50
SYNCHRONIZED_CALLS = 3  # per method and round


def renamed_source(text: str, package: str = BASE_PACKAGE) -> str:
    """A module of ``flce`` as a module of ``package``: its imports, the dotted module
    names in its strings (lazy imports) and its custom-op namespace renamed."""
    text = re.sub(r"\bflce\.", f"{package}.", text)
    text = re.sub(r"\bfrom flce import\b", f"from {package} import", text)
    text = re.sub(r"(?m)^import flce$", f"import {package}", text)
    text = text.replace('"flce"', f'"{package}"')
    return text.replace('f"flce::', f'f"{package}::')


def copy_as_package(source_root: Path, destination: Path, package: str = BASE_PACKAGE) -> Path:
    """``source_root/flce`` copied to ``destination/package`` with every module renamed."""
    target = destination / package
    shutil.copytree(source_root / "flce", target, ignore=shutil.ignore_patterns("__pycache__"))
    for module in target.rglob("*.py"):
        module.write_text(renamed_source(module.read_text(), package))
    return target


def _median(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def paired_ratios(samples: dict, new: str, base: str) -> dict:
    """Median of the sample-by-sample ratios new / base, per metric (samples of the same
    round and position: interleaved, so a slow stretch of the host hits both)."""
    out = {}
    for metric, values in samples[new].items():
        pairs = [a / b for a, b in zip(values, samples[base][metric], strict=True) if a and b]
        out[metric] = statistics.median(pairs) if pairs else None
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--base-src", type=Path, required=True, help="the other tree's src/ (holding flce/)")
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        copy_as_package(args.base_src, Path(scratch))
        sys.path.insert(0, scratch)
        samples = measure(args.rounds)
    summary = {key: {metric: _median(v) for metric, v in metrics.items()} for key, metrics in samples.items()}
    ratios = {
        key.replace("new:", ""): paired_ratios(samples, key, key.replace("new:", "base:"))
        for key in samples
        if "new:" in key
    }
    result = {"rounds": args.rounds, "summary": summary, "ratios_new_to_base": ratios, "samples": samples}
    (args.out / "host-latency-ab.json").write_text(json.dumps(result, indent=1))
    for key, metrics in summary.items():
        print(f"{key:44s} " + "  ".join(f"{m} {v:.4f}" for m, v in metrics.items() if v is not None))


def measure(rounds: int) -> dict:
    import torch
    import torch.nn.functional as F

    import flce

    libraries = {"new": flce, "base": importlib.import_module(BASE_PACKAGE)}
    first_gemm: list[int] = []

    def marking(fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            if not first_gemm:
                first_gemm.append(time.perf_counter_ns())
            return fn(*args, **kwargs)

        return wrapper

    _mark_fused_gemm(libraries, marking)

    def tensors(shape, grad: bool):
        n, h, v = shape
        torch.manual_seed(0)
        x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16).requires_grad_(grad)
        w = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_(grad)
        return x, w, torch.randint(0, v, (n,), device="cuda")

    def make_call(method: str, x, w, t, mode: str) -> Callable[[], None]:
        if method == "eager":

            def eager():
                F.cross_entropy(F.linear(x, w).float(), t).backward()
                x.grad = w.grad = None

            return eager
        if method == "floor":
            xd, wd = x.detach(), w.detach()
            if mode == "fwd":
                return lambda: torch.mm(xd, wd.t())

            def floor():
                logits = torch.mm(xd, wd.t())
                torch.mm(logits, wd), torch.mm(logits.t(), xd)

            return floor
        tree, backend = method.split(":")
        loss_of = libraries[tree].fused_linear_cross_entropy
        if mode == "fwd":

            def forward():
                with torch.no_grad():
                    loss_of(x, w, t, backend=backend)

            return forward

        def forward_backward():
            loss_of(x, w, t, backend=backend).backward()
            x.grad = w.grad = None

        return forward_backward

    samples: dict = {}

    def record(key: str, **values) -> None:
        for metric, value in values.items():
            samples.setdefault(key, {}).setdefault(metric, []).append(value)

    def event_pair():
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    # The small shape, back to back.
    x, w, t = tensors(SMALL_SHAPE, grad=True)
    methods = ["eager", "new:triton", "base:triton", "new:cutedsl", "base:cutedsl", "new:torch", "base:torch"]
    calls = {m: make_call(m, x, w, t, "fwd+bwd") for m in methods}
    for m in methods:
        for _ in range(20):
            calls[m]()
    for r in range(rounds):
        for m in methods if r % 2 == 0 else methods[::-1]:
            start, end = event_pair()
            torch.cuda.synchronize()
            start.record()
            h0 = time.perf_counter_ns()
            for _ in range(BACK_TO_BACK_CALLS):
                calls[m]()
            h1 = time.perf_counter_ns()
            end.record()
            end.synchronize()
            record(
                f"small fwd+bwd {m}",
                loop_ms=start.elapsed_time(end) / BACK_TO_BACK_CALLS,
                host_ms=(h1 - h0) / 1e6 / BACK_TO_BACK_CALLS,
            )
    del x, w, t, calls

    # The larger shape, synchronized, with the first GEMM's launch marked.
    mm, addmm = torch.mm, torch.addmm
    torch.mm, torch.addmm = marking(mm), marking(addmm)
    try:
        for mode in ("fwd", "fwd+bwd"):
            x, w, t = tensors(LARGE_SHAPE, grad=mode == "fwd+bwd")
            methods = ["floor", "new:cutedsl", "base:cutedsl", "new:triton", "base:triton"]
            calls = {m: make_call(m, x, w, t, mode) for m in methods}
            for m in methods:
                for _ in range(3):
                    calls[m]()
            for r in range(rounds):
                for m in methods if r % 2 == 0 else methods[::-1]:
                    for _ in range(SYNCHRONIZED_CALLS):
                        start, end = event_pair()
                        torch.cuda.synchronize()
                        first_gemm.clear()
                        start.record()
                        h0 = time.perf_counter_ns()
                        calls[m]()
                        h1 = time.perf_counter_ns()
                        end.record()
                        end.synchronize()
                        record(
                            "{}x{}x{} {} {}".format(*LARGE_SHAPE, mode, m),
                            call_ms=start.elapsed_time(end),
                            first_gemm_us=(first_gemm[0] - h0) / 1e3 if first_gemm else None,
                            host_ms=(h1 - h0) / 1e6,
                        )
            del x, w, t, calls
            torch.cuda.empty_cache()
    finally:
        torch.mm, torch.addmm = mm, addmm
    return samples


def _mark_fused_gemm(libraries: dict, marking: Callable) -> None:
    """Marks the CuTe DSL fused forward GEMM's launch in each tree: through its cached
    launch where the tree has one (``fused_forward_launch``), else its compiled kernel."""
    for library in libraries.values():
        module = importlib.import_module(f"{library.__name__}.backends.cutedsl.fused_forward")
        if hasattr(module, "fused_forward_launch"):
            launch_of = module.fused_forward_launch

            def marked_launch(*args, _launch_of=launch_of, **kwargs):
                launch = _launch_of(*args, **kwargs)
                return dataclasses.replace(launch, fused=marking(launch.fused))

            module.fused_forward_launch = marked_launch
        else:
            compile_fused_forward = module.compile_fused_forward

            def marked_compile(*args, _compile=compile_fused_forward, **kwargs):
                return marking(_compile(*args, **kwargs))

            module.compile_fused_forward = marked_compile


if __name__ == "__main__":
    main()
