"""Vocabulary-block width against time: the exact low-memory mode (``vocab_chunk_size``)
at a range of block widths, with the cuBLAS GEMMs of one block alone, interleaved with the
three-GEMM floor (bf16, fwd+bwd, one row chunk).

    python3 benchmarks/block_width_sweep.py OUTDIR [--shapes 8192x151936,8192x128256]
        [--widths 9088,8960,...] [--hidden 4096] [--backend cutedsl] [--rounds 5]

For each shape and width ``w`` (default: multiples of 128 from the widest block the
budget of ``benchmarks/budget_vs_liger.py`` ran down to two thirds of it, and the 16
blocks of ``flce bench``'s low-memory method): flce's call with ``vocab_chunk_size=w``,
its predicted time (``flce.driver.schemes.predicted_seconds``), and ``gemm:w``, the three
cuBLAS GEMMs of one full block (the block's logits ``X W_b^T``, ``G_b W_b`` and
``G_b^T X``) times the number of blocks, to separate the GEMMs' efficiency at that width
from the rest of the call. CUDA events, 100 ms of GEMMs before each call, medians.
Writes ``OUTDIR/block-width-sweep.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import flce  # noqa: E402
from flce.bench import report  # noqa: E402
from flce.bench.cases import BenchCase, BenchLossSettings, Shape, make_inputs  # noqa: E402
from flce.bench.methods import as_loss, floor_workload, loss_workload  # noqa: E402
from flce.bench.peers.flce_backends import flce_call_shape, flce_loss_kwargs  # noqa: E402
from flce.bench.timing import Heater, Workload, interleaved_times  # noqa: E402
from flce.driver.schemes import predicted_seconds  # noqa: E402

# The widths the budget at 1.1x Liger Triton's peak picked on 2026-12-01
# (benchmarks/results/memory-budget-h200/budget-vs-liger.json).
BUDGET_WIDTHS = {128256: 7040, 151936: 9088, 262144: 13824, 32000: 6400}
DEFAULT_SHAPES = "8192x151936,8192x128256"


def default_widths(vocab: int) -> list[int]:
    widest = BUDGET_WIDTHS.get(vocab, 128 * (vocab // 16 // 128))
    widths = list(range(widest, int(widest * 2 / 3), -256))
    return sorted({*widths, widest - 128, -(-vocab // 16)}, reverse=True)


def flce_workload(case: BenchCase, inputs, backend: str, width: int) -> Workload:
    """flce's fwd+bwd with ``vocab_chunk_size=width``, as ``flce bench`` times a method."""
    kwargs = {**flce_loss_kwargs(case.loss, backend), "vocab_chunk_size": width}
    return loss_workload(
        lambda: as_loss(flce.fused_linear_cross_entropy(inputs.x, inputs.w, inputs.target, **kwargs)), inputs, "full"
    )


def block_gemms_workload(x: torch.Tensor, w: torch.Tensor, width: int) -> Workload:
    """The three cuBLAS GEMMs of each full block of ``width`` columns (the last, partial
    block as wide as the others: an upper bound on that block's share)."""
    n_blocks = math.ceil(w.shape[0] / width)
    weight = w[:width]
    logits = torch.empty(x.shape[0], width, device=x.device, dtype=x.dtype)
    dx = torch.empty_like(x)
    dw = torch.empty_like(weight)

    def run(_):
        for _ in range(n_blocks):
            torch.mm(x, weight.t(), out=logits)
            torch.mm(logits, weight, out=dx)
            torch.mm(logits.t(), x, out=dw)

    return Workload(setup=lambda: None, run=run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="NxV[,NxV...]")
    parser.add_argument("--widths", default="", help="block widths (default: per shape, see above)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--backend", default="cutedsl")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cuda", help="cuda (timed), or cpu (a dry run of the script)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("block_width_sweep: needs a CUDA GPU", file=sys.stderr)
        return 2
    settings = BenchLossSettings()
    heater = Heater(device, 100.0) if device.type == "cuda" else None
    rows = []
    for item in args.shapes.split(","):
        n, v = (int(p) for p in item.lower().split("x"))
        shape = Shape(n, v, args.hidden)
        case = BenchCase(shape=shape, dtype=torch.bfloat16, mode="full", loss=settings, device=device)
        inputs = make_inputs(case, seed=0, ignore_fraction=0.0)
        widths = [int(w) for w in args.widths.split(",")] if args.widths else default_widths(v)
        call = flce_call_shape(case, args.backend)
        workloads = {"floor": floor_workload(case, inputs)}
        for width in widths:
            workloads[f"flce:{width}"] = flce_workload(case, inputs, args.backend, width)
            workloads[f"gemm:{width}"] = block_gemms_workload(inputs.x.detach(), inputs.w.detach(), width)
        times = interleaved_times(workloads, device, args.rounds, heater)
        floor_ms = statistics.median(times["floor"])
        print(f"{shape.label()}: floor {floor_ms:.2f} ms")
        print(f"{'width':>6} {'blocks':>6} {'flce ms':>8} {'x floor':>7} {'pred x':>7} {'gemms ms':>8} {'x floor':>7}")
        for width in widths:
            flce_ms = statistics.median(times[f"flce:{width}"])
            gemm_ms = statistics.median(times[f"gemm:{width}"])
            predicted_ms = predicted_seconds(call, n, width) * 1e3
            row = {
                "shape": shape.label(),
                "n": n,
                "vocab": v,
                "hidden": args.hidden,
                "width": width,
                "blocks": math.ceil(v / width),
                "flce_ms": flce_ms,
                "flce_times_ms": times[f"flce:{width}"],
                "flce_x_floor": flce_ms / floor_ms,
                "predicted_ms": predicted_ms,
                "predicted_x_floor": predicted_ms / floor_ms,
                "block_gemms_ms": gemm_ms,
                "block_gemms_x_floor": gemm_ms / floor_ms,
                "floor_ms": floor_ms,
            }
            rows.append(row)
            print(
                f"{width:6d} {row['blocks']:6d} {flce_ms:8.2f} {row['flce_x_floor']:7.3f} "
                f"{row['predicted_x_floor']:7.3f} {gemm_ms:8.2f} {row['block_gemms_x_floor']:7.3f}",
                flush=True,
            )
        del inputs, workloads
        torch.cuda.empty_cache()
    report.write_script_run(
        args.out,
        "block-width-sweep.json",
        device,
        {"backend": args.backend, "rounds": args.rounds, "heat_ms": 100.0, "dtype": "bf16", "mode": "full"},
        rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
