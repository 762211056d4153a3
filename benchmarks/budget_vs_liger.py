"""flce's exact fused loss at Liger Triton's memory: per shape, the memory budget that
keeps flce's peak within ``--memory-factor`` (default 1.1) times the peak Liger's Triton
FLCE reaches on the same inputs, timed interleaved with Liger and the cuBLAS three-GEMM
floor (bf16, fwd+bwd).

    python3 benchmarks/budget_vs_liger.py OUTDIR [--shapes 8192x128256,8192x32000]
        [--hidden 4096] [--backend cutedsl] [--memory-factor 1.1] [--rounds 5] [--warmup 1]
        [--also 'flce:cutedsl[vblocks=16]']

For each shape: Liger's peak extra memory is measured first (``peak_extra_bytes`` of its
workload); flce's budget is ``factor * that peak`` minus the gradients flce returns (the
budget bounds the workspace beyond them: ``flce.driver.sizing``); then the floor, flce
under that budget, flce's default, the ``--also`` methods and Liger run interleaved by ``flce bench``'s runner
(CUDA events, a heater before each call, medians). Writes ``OUTDIR/budget_vs_liger.json``
(``flce bench``'s record, plus each shape's budget) and prints a table: time over the
floor, time over Liger's, peak GiB and peak over Liger's, with the chosen scheme and its
predicted time and peak.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from flce.bench import report  # noqa: E402
from flce.bench.cases import BenchLossSettings, Shape, make_inputs  # noqa: E402
from flce.bench.frontier import BudgetPoint  # noqa: E402
from flce.bench.methods import floor_method, select_methods  # noqa: E402
from flce.bench.peers.flce_backends import flce_call_shape  # noqa: E402
from flce.bench.registry import all_methods  # noqa: E402
from flce.bench.runner import BenchConfig, run_shape  # noqa: E402
from flce.bench.timing import free_memory, peak_extra_bytes  # noqa: E402
from flce.driver.schemes import choose_scheme  # noqa: E402

LIGER = "liger:triton"
GIB = 2**30
MIB = 2**20
DEFAULT_SHAPES = "8192x128256,4096x128256,16384x128256,8192x32000,8192x151936,8192x262144"


def parse_shapes(text: str, hidden: int) -> list[Shape]:
    shapes = []
    for item in text.split(","):
        n, v = (int(part) for part in item.lower().split("x"))
        shapes.append(Shape(n, v, hidden))
    return shapes


def liger_peak(config: BenchConfig, shape: Shape) -> int:
    """Liger Triton's peak extra bytes on the inputs the runner builds for ``shape``."""
    case = config.case(shape)
    (liger,) = [m for m in select_methods(all_methods(), [LIGER]) if not m.is_floor]
    inputs = make_inputs(case, seed=config.seed, ignore_fraction=config.ignore_fraction)
    workload = liger.workload(case, inputs)
    workload.run(workload.setup())  # compiles
    workload.teardown()
    peak = peak_extra_bytes(workload, config.device)
    del workload, inputs
    free_memory(config.device)
    return peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="NxV[,NxV...] (default: the six of the issue)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--backend", default="cutedsl")
    parser.add_argument("--memory-factor", type=float, default=1.1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--also",
        type=lambda text: [name for name in text.split(",") if name],
        default=["flce:cutedsl[vblocks=16]"],
        help="more methods to run beside them (default: flce:cutedsl[vblocks=16], the 16 blocks of the issue's table)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("budget_vs_liger: needs a CUDA GPU (Liger's Triton kernels and peak memory)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    config = BenchConfig(
        loss=BenchLossSettings(),
        rounds=args.rounds,
        warmup=args.warmup,
        device=device,
        heat_ms=100.0,
        mode="full",
        dtype=torch.bfloat16,
        shapes=tuple(parse_shapes(args.shapes, args.hidden)),
    )
    default_name = f"flce:{args.backend}"
    rows, budgets = [], {}
    for shape in config.shapes:
        case = config.case(shape)
        call = flce_call_shape(case, args.backend)
        limit = int(args.memory_factor * liger_peak(config, shape))
        budget = max(limit - call.gradient_bytes(), 0)
        # The frontier's rung at this budget: its method, and its scheme's predictions.
        point = BudgetPoint(args.backend, budget, "memory_budget", False, choose_scheme(call, budget), call)
        budgets[shape.label()] = {"liger_peak_limit_bytes": limit, **point.record()}
        budget_method = point.method
        wanted = [default_name, *args.also, LIGER]
        peers = [m for m in select_methods(all_methods(), wanted) if not m.is_floor]
        methods = [floor_method(), budget_method, *peers]
        results = run_shape(config, shape, methods, lambda n, what: None)
        rows.extend(report.result_row(r) for r in results)
        by_name = {r.method: r for r in results}
        liger, ours = by_name.get(LIGER), by_name.get(budget_method.name)
        for r in results:
            if not r.ok:
                print(f"{shape.label()} {r.method}: skipped: {r.reason}")
                continue
            versus = ""
            if liger is not None and liger.ok and r is ours:
                versus = (
                    f"  {r.timing.median_ms / liger.timing.median_ms:.3f}x Liger's time,"
                    f" {r.peak_extra_bytes / liger.peak_extra_bytes:.3f}x its peak"
                )
            print(
                f"{shape.label()} {r.method:28s} {r.ratio_to_floor:6.3f}x floor"
                f" {r.peak_extra_bytes / GIB:6.3f} GiB{versus}"
            )
        print(f"{shape.label()} budget {budget / MIB:.1f} MiB: {point.scheme.describe(shape.n)}", flush=True)
    report.write_script_run(
        args.out,
        "budget_vs_liger.json",
        device,
        {**config.record(), "memory_factor": args.memory_factor, "backend": args.backend, "budgets": budgets},
        rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
