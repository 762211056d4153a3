"""Does hiding the cross-entropy pass under the GEMMs pay? A probe for target 2 of the
performance issue (the default at or under the cuBLAS floor), before any of it goes into
the driver.

    python3 benchmarks/overlap_probe.py OUTDIR [--tokens 8192] [--hidden 4096]
        [--vocab 128256] [--blocks 2,4,8] [--backend cutedsl] [--rounds 7]
    python3 benchmarks/overlap_probe.py --check      # the pipeline's values, any device

The default scheme keeps the batch's logits and runs logits GEMM, CE pass, dX and dW GEMMs
one after the other; the CE pass (one read and one write of the logits, 3.4-3.9% of the
floor in the 2026-12-05 profiles) is memory-bound work the GEMMs never overlap. Split the
vocabulary into ``k`` column blocks of contiguous logits and the pass splits with it:

    main stream:  logits_0  logits_1 ... logits_k-1 |          dW_0  dW_1 ... dW_k-1  dX
    side stream:           stats_0  ... stats_k-2  stats_k-1 combine grad_0 grad_1 ... grad_k-1

each block's statistics (a read) run beside the next block's logits GEMM, and each
block's gradient (a read and a write, in place) beside the previous block's dW GEMM
(``dW_b = G_b^T X`` fills dW's rows of the block: one GEMM over all tokens, written once).
dX is one GEMM over the whole vocabulary at the end (no fp32 accumulator). What stays
exposed is the last block's statistics, the combine and the first block's gradient, about
``1/k`` of the pass, and whatever the GEMMs lose to running beside memory traffic, which
only a measurement tells. It times, interleaved (``flce.bench.timing``: CUDA events, 100 ms
of GEMMs before each sample), at one shape:

- ``floor``: cuBLAS's three GEMMs (logits, dX, dW);
- ``default``: ``flce.fused_linear_cross_entropy`` and its backward (the chooser's scheme);
- ``serial_k`` and ``overlap_k``: the pipeline above on one stream, and with the
  statistics and gradients on a second stream, for each ``k`` of ``--blocks``;

and reports each over the floor, with the pipeline's loss and gradients against the
default's. Mean reduction, no ignored rows, no other option: the question is the schedule.
Writes ``OUTDIR/overlap-probe.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import flce  # noqa: E402
from flce.bench import report  # noqa: E402
from flce.bench.timing import Heater, Workload, interleaved_times  # noqa: E402
from flce.dispatch import split_row_kernels  # noqa: E402
from flce.rows.cross_entropy import BlockStatistics, ChunkScalars, combine_blocks  # noqa: E402
from flce.testing import relative_error  # noqa: E402

BLOCK_ALIGNMENT = 256  # columns: cuBLAS runs unaligned leading dimensions on slow kernels


@dataclass(frozen=True)
class Blocks:
    """The vocabulary's ``k`` column blocks and each block's targets, made once per shape."""

    bounds: tuple[tuple[int, int], ...]  # [v0, v1) per block
    local_targets: tuple[torch.Tensor, ...]  # (N,) int64: the target's column in the block, else its width
    owned_by: torch.Tensor  # (k, N) bool: the block holds the row's target
    widths: torch.Tensor  # (k,) fp32: each block's width (its class-weight sum without weights)

    @classmethod
    def of(cls, target: torch.Tensor, vocab: int, k: int) -> Blocks:
        width = -(-vocab // k)
        width = -(-width // BLOCK_ALIGNMENT) * BLOCK_ALIGNMENT
        bounds = tuple((v0, min(v0 + width, vocab)) for v0 in range(0, vocab, width))
        owned = [(target >= v0) & (target < v1) for v0, v1 in bounds]
        local = tuple(torch.where(o, target - v0, v1 - v0) for o, (v0, v1) in zip(owned, bounds, strict=True))
        widths = torch.tensor([v1 - v0 for v0, v1 in bounds], dtype=torch.float32, device=target.device)
        return cls(bounds, local, torch.stack(owned), widths)


def pipeline(x, w, blocks: Blocks, kernels, scalars: ChunkScalars, side) -> tuple[torch.Tensor, ...]:
    """Loss (mean), dX and dW by the module docstring's schedule; ``side``: the stream of
    the memory-bound kernels (None: all on the current stream)."""
    n, device = x.shape[0], x.device
    main = torch.cuda.current_stream(device) if side is not None else None

    def on_side():
        return torch.cuda.stream(side) if side is not None else contextlib.nullcontext()

    def side_waits_main():
        if side is not None:
            side.wait_stream(main)

    def main_waits_side():
        if side is not None:
            main.wait_stream(side)

    k = len(blocks.bounds)
    f32 = dict(dtype=torch.float32, device=device)
    per_block = BlockStatistics(
        torch.empty(k, n, **f32), torch.empty(k, n, **f32), torch.zeros(k, n, **f32), None, None
    )
    # One (N, V) buffer, the blocks its column views (row stride V): dX is then one GEMM
    # over the whole vocabulary with no accumulator, as in the default scheme.
    logits = torch.empty(n, w.shape[0], dtype=x.dtype, device=device)
    views = [logits[:, v0:v1] for v0, v1 in blocks.bounds]
    for b, (v0, v1) in enumerate(blocks.bounds):
        torch.mm(x, w[v0:v1].t(), out=views[b])
        side_waits_main()
        with on_side():
            stats = kernels.statistics(
                views[b], blocks.local_targets[b], None, None, with_smoothing=False, with_argmax=False
            )
            per_block.row_max[b].copy_(stats.row_max)
            per_block.row_sum[b].copy_(stats.row_sum)
            per_block.target_shifted[b].copy_(stats.target_shifted)
    with on_side():
        whole = combine_blocks(per_block, blocks.owned_by, blocks.widths)
        lse = whole.row_max + torch.log(whole.row_sum)
        loss = (lse - (whole.row_max + whole.target_shifted)).mean()
        inv_sum = whole.row_sum.reciprocal()
        ones = torch.ones(n, **f32)
    dw = torch.empty_like(w)
    for b, (v0, v1) in enumerate(blocks.bounds):
        with on_side():
            kernels.gradient(
                views[b], blocks.local_targets[b], None, whole.row_max, inv_sum, ones, lse, ones, scalars, 0.0
            )
        main_waits_side()
        torch.mm(views[b].t(), x, out=dw[v0:v1])  # (V_b, H): dW's rows of the block, written once
    dx = logits @ w  # (N, H)
    return loss, dx, dw


def mean_scalars(n: int, vocab: int, device: torch.device) -> ChunkScalars:
    """The kernels' scalars of a mean over ``n`` rows with no option set."""
    return ChunkScalars.from_numbers(
        weight_sum=float(vocab), ce_grad_scale=1.0 / n, z_grad_scale=1.0 / n, device=device
    )


def check(backend: str, device: torch.device, dtype: torch.dtype) -> int:
    """The pipeline's loss and gradients against float64 at small shapes, on one stream
    and (on a GPU) with the second stream; exit status 1 if any is off."""
    gen = torch.Generator(device=device).manual_seed(0)
    failures = 0
    for n, h, vocab, k in [(16, 8, 40, 1), (16, 8, 1000, 2), (33, 16, 1300, 3), (64, 32, 2100, 4)]:
        x = torch.randn(n, h, generator=gen, device=device).to(dtype)
        w = torch.randn(vocab, h, generator=gen, device=device).to(dtype)
        target = torch.randint(0, vocab, (n,), generator=gen, device=device)
        x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
        truth = torch.nn.functional.cross_entropy(x64 @ w64.t(), target)
        truth.backward()
        blocks = Blocks.of(target, vocab, k)
        kernels = split_row_kernels(backend, device)
        sides = [None, torch.cuda.Stream(device)] if device.type == "cuda" else [None]
        for side in sides:
            loss, dx, dw = pipeline(x, w, blocks, kernels, mean_scalars(n, vocab, device), side)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            errors = [relative_error(a, b) for a, b in ((loss, truth), (dx, x64.grad), (dw, w64.grad))]
            ok = all(e < (1e-5 if dtype == torch.float32 else 2e-2) for e in errors)
            failures += not ok
            where = "two streams" if side is not None else "one stream"
            print(
                f"check N={n} H={h} V={vocab} k={len(blocks.bounds)} {where}: loss/dX/dW rel. error "
                + " ".join(f"{e:.1e}" for e in errors)
                + ("" if ok else "  FAILED")
            )
    return 1 if failures else 0


def workloads(x, w, target, ks: list[int], backend: str) -> dict[str, Workload]:
    """The methods of the module docstring at one shape, each a ``Workload``."""
    device = x.device
    n, vocab = x.shape[0], w.shape[0]
    dx_out, dw_out, logits = torch.empty_like(x), torch.empty_like(w), None

    def floor(_):
        nonlocal logits
        logits = torch.mm(x, w.t())
        torch.mm(logits, w, out=dx_out)
        torch.mm(logits.t(), x, out=dw_out)
        logits = None

    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()

    def default(_):
        loss = flce.fused_linear_cross_entropy(xg, wg, target, backend=backend)
        torch.autograd.grad(loss, (xg, wg))

    methods = {"floor": Workload(setup=lambda: None, run=floor), "default": Workload(lambda: None, default)}
    kernels = split_row_kernels(backend, device)
    scalars = mean_scalars(n, vocab, device)
    side = torch.cuda.Stream(device)
    for k in ks:
        blocks = Blocks.of(target, vocab, k)
        for name, stream in ((f"serial_{k}", None), (f"overlap_{k}", side)):
            methods[name] = Workload(
                setup=lambda: None,
                run=lambda _, blocks=blocks, stream=stream: pipeline(x, w, blocks, kernels, scalars, stream),
            )
    return methods


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, nargs="?")
    parser.add_argument("--check", action="store_true", help="check the pipeline's values and exit")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--blocks", default="2,4,8")
    parser.add_argument("--backend", default=None, help="split-row kernels and the default's backend (auto)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.check:
        failures = check(args.backend or "torch", device, torch.float32)
        if device.type == "cuda":
            failures |= check(args.backend or "torch", device, torch.bfloat16)
            if args.backend is None:
                failures |= check("cutedsl", device, torch.bfloat16)
        return failures
    if args.out is None or device.type != "cuda":
        print("overlap_probe: timing needs OUTDIR and a CUDA GPU (--check runs anywhere)", file=sys.stderr)
        return 2
    n, h, vocab = args.tokens, args.hidden, args.vocab
    ks = [int(k) for k in args.blocks.split(",")]
    gen = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(n, h, device=device, generator=gen) * 0.5).to(torch.bfloat16)
    w = (torch.randn(vocab, h, device=device, generator=gen) * 0.02).to(torch.bfloat16)
    target = torch.randint(0, vocab, (n,), device=device, generator=gen)

    # The pipeline's values against the default's at this shape, before any timing.
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    loss = flce.fused_linear_cross_entropy(xg, wg, target, backend=args.backend)
    expected = (loss, *torch.autograd.grad(loss, (xg, wg)))
    side = torch.cuda.Stream(device)
    agreement = {}
    for k in ks:
        got = pipeline(
            x,
            w,
            Blocks.of(target, vocab, k),
            split_row_kernels(args.backend, device),
            mean_scalars(n, vocab, device),
            side,
        )
        torch.cuda.synchronize(device)
        agreement[k] = [relative_error(a, b.double()) for a, b in zip(got, expected, strict=True)]
        print(f"k={k}: loss/dX/dW against the default: " + " ".join(f"{e:.1e}" for e in agreement[k]), flush=True)
    expected = got = None

    times = interleaved_times(workloads(x, w, target, ks, args.backend), device, args.rounds, Heater(device, 100.0))
    ms = {name: statistics.median(t) for name, t in times.items()}
    rows = [
        {
            "method": name,
            "tokens": n,
            "hidden": h,
            "vocab": vocab,
            "median_ms": value,
            "x_floor": value / ms["floor"],
            "times_ms": times[name],
            **({"agreement_loss_dx_dw": agreement[int(name.split("_")[1])]} if "_" in name else {}),
        }
        for name, value in ms.items()
    ]
    for row in rows:
        print(f"{row['method']:>10}: {row['median_ms']:8.3f} ms  {row['x_floor']:.3f}x floor", flush=True)
    report.write_script_run(
        args.out,
        "overlap-probe.json",
        device,
        {"rounds": args.rounds, "heat_ms": 100.0, "dtype": "bf16", "backend": args.backend, "blocks": ks},
        rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
