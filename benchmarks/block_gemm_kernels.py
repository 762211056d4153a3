"""The kernels of one vocabulary block, alone, at a range of block widths: where the exact
low-memory mode's GEMM time goes (bf16, Hopper, the cutedsl backend's fused first pass).

    python3 benchmarks/block_gemm_kernels.py OUTDIR [--tokens 8192] [--hidden 4096]
        [--widths 7936,8016,8192,8448,16032,16896] [--rounds 7] [--reps 4]

For each width ``V_b`` (the block's columns) it times, interleaved (``flce.bench.timing``,
CUDA events, 100 ms of GEMMs before each sample, ``--reps`` launches per sample):

- ``logits``: cuBLAS's logits GEMM ``X W_b^T`` in bf16 (what the block's gradient replaces),
- ``stats``: the fused forward statistics GEMM over the block (the same main loop, with the
  epilogue that reduces each tile to row statistics and stores no logits),
- ``gradient``: the block-gradient GEMM (``fused_block_gradient``: the same main loop, with
  the epilogue that stores dL/dz),
- ``dx``: ``dX += G_b W_b`` into an fp32 accumulator (cuBLAS, beta = 1),
- ``dw``: ``dW_b = G_b^T X`` in bf16 (cuBLAS),
- ``block``: the three in the blocks' order (gradient, dX, dW), one block's second pass,
- ``dx_then_dw`` and ``dx_beside_dw``: dX then dW on one stream, and dW on a second stream
  beside dX (both read ``G_b`` and write disjoint outputs, so one's ramp and last wave may
  overlap the other's: what two streams would save per block),

and the tile waves of the fused kernels (64 x 256 tiles over the resident CTAs): the
share of the last wave that is idle separates tile quantization from the epilogue's cost.
Writes ``OUTDIR/block-gemm-kernels.json`` and prints a table (ms per launch, and each
kernel over cuBLAS's logits GEMM of the same width).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from flce.bench import report  # noqa: E402
from flce.bench.timing import Heater, Workload, interleaved_times  # noqa: E402

DEFAULT_WIDTHS = "7936,8016,8192,8448,16032,16896"
SINGLE_GEMMS = ("logits", "stats", "gradient", "dx", "dw")  # each one GEMM of 2 N V_b H flop


def tile_waves(tokens: int, width: int, ctas: int, tile_m: int = 64, tile_n: int = 256) -> tuple[int, float]:
    """Tiles of the fused kernels over the block (``tile_m x tile_n``: the launch shape of
    ``fused_forward.default_config`` on the GPU), and their waves over ``ctas`` CTAs."""
    tiles = math.ceil(tokens / tile_m) * math.ceil(width / tile_n)
    return tiles, tiles / ctas


def repeated(reps: int, launch) -> Workload:
    def run(_):
        for _ in range(reps):
            launch()

    return Workload(setup=lambda: None, run=run)


def time_width(x: torch.Tensor, width: int, rounds: int, reps: int, heater: Heater, gen: torch.Generator) -> dict:
    """The kernels of one block of ``width`` columns (module docstring), timed interleaved."""
    from flce.backends.cutedsl.fused_forward import default_config, fused_forward_statistics
    from flce.backends.cutedsl.fused_gradient import fused_block_gradient

    device = x.device
    n, h = x.shape
    w = (torch.randn(width, h, device=device, generator=gen) * 0.02).to(torch.bfloat16)
    target = torch.randint(0, width, (n,), device=device, generator=gen)
    # The rows' statistics of the block alone: every gradient value a probability.
    row_max = fused_forward_statistics(x, w, target)["lse"]
    inv_sum = torch.ones(n, device=device)
    onehot = torch.full((n,), 1.0 / n, device=device)
    weight_sum = torch.ones((), device=device)
    grad = torch.empty(n, width, device=device, dtype=torch.bfloat16)
    logits = torch.empty_like(grad)
    dx = torch.zeros(n, h, device=device, dtype=torch.float32)
    dw = torch.empty(width, h, device=device, dtype=torch.bfloat16)

    def gradient():
        fused_block_gradient(x, w, None, grad, target, row_max, inv_sum, onehot, None, None, weight_sum, None)

    gradient()
    torch.cuda.synchronize()
    if not torch.isfinite(grad).all():
        raise RuntimeError(f"block gradient not finite at width {width}")

    def input_grad():
        torch.addmm(dx, grad, w, out_dtype=torch.float32, out=dx)

    def weight_grad():
        torch.mm(grad.t(), x, out=dw)

    side = torch.cuda.Stream(device)

    def input_grad_beside_weight_grad():
        # Both read G_b and write disjoint outputs: one's ramp and last wave can overlap the other's.
        current = torch.cuda.current_stream(device)
        side.wait_stream(current)
        input_grad()
        with torch.cuda.stream(side):
            weight_grad()
        current.wait_stream(side)

    kernels = {
        "logits": lambda: torch.mm(x, w.t(), out=logits),
        "stats": lambda: fused_forward_statistics(x, w, target, check=False),
        "gradient": gradient,
        "dx": input_grad,
        "dw": weight_grad,
        # Sequences: what the blocks run per block, and dX beside dW on two streams.
        "block": lambda: (gradient(), input_grad(), weight_grad()),
        "dx_then_dw": lambda: (input_grad(), weight_grad()),
        "dx_beside_dw": input_grad_beside_weight_grad,
    }
    times = interleaved_times(
        {name: repeated(reps, launch) for name, launch in kernels.items()}, device, rounds, heater
    )
    ms = {name: statistics.median(t) / reps for name, t in times.items()}
    config = default_config(device.index if device.index is not None else torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    tiles, waves = tile_waves(n, width, sms, config.tile_m, config.tile_n)
    row = {
        "tokens": n,
        "hidden": h,
        "width": width,
        "tiles": tiles,
        "waves": waves,
        "last_wave_idle": math.ceil(waves) - waves,
        **{f"{name}_ms": value for name, value in ms.items()},
        **{f"{name}_x_logits": value / ms["logits"] for name, value in ms.items()},
        "tflops": {name: 2 * n * width * h / (ms[name] * 1e-3) / 1e12 for name in SINGLE_GEMMS},
        # What dW on a second stream beside dX saves per block.
        "beside_saving": 1 - ms["dx_beside_dw"] / ms["dx_then_dw"],
    }
    print(
        f"V_b {width:6d} tiles {tiles:5d} waves {waves:6.2f} | "
        + " ".join(f"{name} {value:6.3f}" for name, value in ms.items())
        + " | x logits: "
        + " ".join(f"{name} {row[f'{name}_x_logits']:.3f}" for name in ms if name != "logits"),
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--widths", default=DEFAULT_WIDTHS)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=4)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("block_gemm_kernels: needs a CUDA GPU (Hopper)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    n, h = args.tokens, args.hidden
    widths = [int(w) for w in args.widths.split(",")]
    gen = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(n, h, device=device, generator=gen) * 0.5).to(torch.bfloat16)
    heater = Heater(device, 100.0)
    rows = []
    for width in widths:
        rows.append(time_width(x, width, args.rounds, args.reps, heater, gen))
        torch.cuda.empty_cache()
    report.write_script_run(
        args.out,
        "block-gemm-kernels.json",
        device,
        {"rounds": args.rounds, "reps": args.reps, "heat_ms": 100.0, "dtype": "bf16"},
        rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
