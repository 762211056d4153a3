"""``flce bench``: time and measure the memory of the LM-head loss, flce's
backends against PyTorch, Liger-Kernel, Apple CCE and the GEMMs alone.

``flce.cli`` builds the ``bench`` sub-command with ``add_bench_arguments`` and
runs it with ``run_bench``. With no arguments on a machine without a GPU it runs
a small fp32 case in seconds, so the quickstart works anywhere.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from flce.bench import report
from flce.bench.methods import DTYPES, FEATURES, MODES, LossOptions, Method, Shape, all_methods, select_methods
from flce.bench.runner import BenchConfig, Result, run_sweep

# (tokens, vocab, hidden) lists of each named sweep; explicit --tokens/--vocab/--hidden override.
SWEEPS: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {
    "vocab": ((8192,), (32000, 128256, 151936, 262144), (4096,)),
    "tokens": ((4096, 8192, 16384), (128256,), (4096,)),
}
# The reference shape of DESIGN.md on a GPU; off the GPU a case that runs in seconds.
GPU_DEFAULT = ((8192,), (128256,), (4096,))
CPU_DEFAULT = ((512,), (4096,), (256,))
CPU_DEFAULT_METHODS = ("flce:torch", "torch:eager")
# Rounds and warm-up calls: (GPU, CPU).
DEFAULT_ROUNDS = (10, 5)
DEFAULT_WARMUP = (3, 1)
# Longer than the ~37 ms that back-to-back GEMMs took to settle at the H200's power limit.
DEFAULT_HEAT_MS = 100.0


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _name_list(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _chunk_list(text: str) -> tuple[int | None, ...]:
    """Chunk sizes; ``auto`` stands for the library's own choice."""
    out: list[int | None] = []
    for item in _name_list(text):
        out.append(None if item.lower() in ("auto", "default") else _int_list(item)[0])
    return tuple(out)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``flce bench`` options to ``parser``."""
    g = parser.add_argument_group("what to run")
    g.add_argument(
        "--mode",
        choices=MODES,
        default="full",
        help="fwd (no grad), bwd (loss.backward() only; methods that compute gradients "
        "during the forward show little there) or full (default)",
    )
    g.add_argument(
        "--sweep",
        choices=sorted(SWEEPS),
        help="vocab: V in 32000..262144 at N=8192, H=4096; tokens: N in 4096..16384 at V=128256",
    )
    g.add_argument("--tokens", type=_int_list, help="comma list of N (overrides the sweep's)")
    g.add_argument("--vocab", type=_int_list, help="comma list of V (overrides the sweep's)")
    g.add_argument("--hidden", type=_int_list, help="comma list of H (overrides the sweep's)")
    g.add_argument("--dtype", choices=sorted(DTYPES), help="input dtype (default bf16 on a GPU, fp32 on the CPU)")
    g.add_argument("--features", type=_name_list, default=(), help=f"comma list among {','.join(FEATURES)}")
    g.add_argument("--reduction", choices=("mean", "sum"), default="mean")
    g.add_argument("--ignore-fraction", type=float, default=0.0, help="fraction of targets set to ignore_index")
    g.add_argument(
        "--methods",
        type=_name_list,
        help="comma list of methods or families (flce, torch, liger, cce); default all (on the CPU: flce:torch,torch:eager); the floor always runs",
    )
    g.add_argument(
        "--chunk-size", type=_chunk_list, help="comma list of chunk sizes for the flce backends ('auto' = default)"
    )
    g.add_argument("--device", help="torch device (default cuda when available, else cpu)")
    t = parser.add_argument_group("how to measure")
    t.add_argument("--rounds", type=int, help="interleaved timed rounds (default 10 on a GPU, 5 on the CPU)")
    t.add_argument("--warmup", type=int, help="untimed warm-up rounds (default 3 on a GPU, 1 on the CPU)")
    t.add_argument(
        "--heat-ms",
        type=float,
        help="ms of bf16 GEMMs run before each timed call, so every method starts at the "
        "steady power draw whatever ran before it (default 100 on a GPU; 0 turns it off)",
    )
    t.add_argument("--seed", type=int, default=0)
    p = parser.add_argument_group("tensor parallelism")
    p.add_argument(
        "--tp",
        type=int,
        metavar="WORLD",
        help="benchmark the vocab-parallel loss over WORLD processes, one per GPU (NCCL; gloo with "
        "--device cpu), against the single-device loss; skipped with a reason when fewer GPUs exist",
    )
    o = parser.add_argument_group("output")
    o.add_argument("--out", type=Path, help="directory for the JSON, CSV and PNG files")
    o.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    o.add_argument("--list-methods", action="store_true", help="list the method names and exit")


def _device(args: argparse.Namespace) -> torch.device:
    if args.device:
        return torch.device(args.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_shapes(args: argparse.Namespace, device: torch.device) -> tuple[Shape, ...]:
    """Tokens × vocab × hidden from the sweep (or the device's default), then the explicit lists."""
    tokens, vocab, hidden = (
        SWEEPS[args.sweep] if args.sweep else (GPU_DEFAULT if device.type == "cuda" else CPU_DEFAULT)
    )
    tokens = args.tokens or tokens
    vocab = args.vocab or vocab
    hidden = args.hidden or hidden
    return tuple(Shape(n, v, h) for h in hidden for n in tokens for v in vocab)


def resolve_config(args: argparse.Namespace) -> BenchConfig:
    """The frozen run configuration; ValueError on inconsistent options."""
    device = _device(args)
    on_gpu = device.type == "cuda"
    dtype_name = args.dtype or ("bf16" if on_gpu else "fp32")
    rounds = args.rounds if args.rounds is not None else DEFAULT_ROUNDS[not on_gpu]
    warmup = args.warmup if args.warmup is not None else DEFAULT_WARMUP[not on_gpu]
    if rounds < 1 or warmup < 0:
        raise ValueError("--rounds must be >= 1 and --warmup >= 0")
    if not 0.0 <= args.ignore_fraction < 1.0:
        raise ValueError("--ignore-fraction must be in [0, 1)")
    return BenchConfig(
        mode=args.mode,
        dtype=DTYPES[dtype_name],
        shapes=resolve_shapes(args, device),
        loss=LossOptions.from_features(args.features, reduction=args.reduction),
        rounds=rounds,
        warmup=warmup,
        device=device,
        seed=args.seed,
        ignore_fraction=args.ignore_fraction,
        heat_ms=(args.heat_ms if args.heat_ms is not None else DEFAULT_HEAT_MS) if on_gpu else 0.0,
    )


def resolve_methods(args: argparse.Namespace, device: torch.device) -> list[Method]:
    """The selected methods, with one flce variant per requested chunk size."""
    chunks = args.chunk_size or (None,)
    wanted = args.methods
    if wanted is None and device.type != "cuda":
        wanted = CPU_DEFAULT_METHODS
    return select_methods(all_methods(chunks), wanted)


def command_line() -> str:
    """The command as typed (program name without its directory)."""
    prog = Path(sys.argv[0]).name if sys.argv else "flce"
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:  # started with ``python -m``
        prog = f"python -m {spec.name.removesuffix('.__main__')}"
    return " ".join([prog, *(shlex.quote(a) for a in sys.argv[1:])])


def config_dict(config: BenchConfig, args: argparse.Namespace, methods: Sequence[Method]) -> dict[str, Any]:
    dtype_name = next(k for k, v in DTYPES.items() if v == config.dtype)
    return {
        "mode": config.mode,
        "dtype": dtype_name,
        "shapes": [{"n": s.n, "v": s.v, "h": s.h} for s in config.shapes],
        "features": list(config.loss.enabled()),
        "loss_options": {
            "reduction": config.loss.reduction,
            "ignore_index": config.loss.ignore_index,
            "label_smoothing": config.loss.label_smoothing,
            "lse_square_scale": config.loss.lse_square_scale,
            "softcap": config.loss.softcap,
            "ce_weight": config.loss.use_weights,
        },
        "reduction": config.loss.reduction,
        "ignore_fraction": config.ignore_fraction,
        "rounds": config.rounds,
        "warmup": config.warmup,
        "seed": config.seed,
        "device": str(config.device),
        "timer": "cuda events" if config.device.type == "cuda" else "time.perf_counter",
        "heat_ms": config.heat_ms,
        "sweep": args.sweep,
        "chunk_sizes": list(args.chunk_size) if args.chunk_size else None,
        "methods": [m.name for m in methods],
    }


@contextmanager
def progress_reporter(total: int, enabled: bool = True) -> Iterator[Callable[[int, str], None]]:
    """A rich progress bar over ``total`` calls, or a line per shape without rich."""
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        seen: set[str] = set()

        def plain(n: int, what: str) -> None:
            shape = what.split(" probe")[0].split(" warm")[0].split(" round")[0].split(" memory")[0]
            if enabled and shape not in seen:
                seen.add(shape)
                print(f"benchmarking {shape} ...", flush=True)

        yield plain
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=True, disable=not enabled) as bar:
        task = bar.add_task("bench", total=total)

        def tick(n: int, what: str) -> None:
            bar.update(task, advance=n, description=what[:60])

        yield tick


def _title(config: BenchConfig, env: dict[str, Any]) -> str:
    dtype_name = next(k for k, v in DTYPES.items() if v == config.dtype)
    where = env.get("gpu") or str(config.device)
    features = ",".join(config.loss.enabled()) or "no features"
    return f"flce bench: {report.MODE_TEXT[config.mode]}, {dtype_name}, {features} on {where}"


def write_outputs(out: Path, stem: str, payload: dict[str, Any], plots: bool, title: str) -> list[Path]:
    """JSON, CSV and (optionally) PNG files under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = [
        report.write_json(out / f"{stem}.json", payload),
        report.write_csv(out / f"{stem}.csv", payload["results"]),
    ]
    if plots:
        plot_dir = out / f"{stem}-plots"
        plot_dir.mkdir(exist_ok=True)
        written.extend(report.plot_results(payload["results"], plot_dir, title))
    return written


def run_tensor_parallel(args: argparse.Namespace) -> int:
    """``flce bench --tp WORLD``: ``flce.bench.tensor_parallel`` under torchrun, one
    process per GPU; its JSON (parity, per-rank time and memory) goes to ``--out``."""
    import subprocess

    world = args.tp
    device = _device(args)
    if world < 1:
        print("flce bench: error: --tp must be >= 1", file=sys.stderr)
        return 2
    if device.type == "cuda" and torch.cuda.device_count() < world:
        print(f"flce bench --tp {world}: skipped: {torch.cuda.device_count()} CUDA device(s) here, {world} needed")
        return 0
    out_dir = args.out or Path(".")
    out_dir.mkdir(parents=True, exist_ok=True)
    out_file = out_dir / f"bench-tp{world}-{args.dtype or ('bf16' if device.type == 'cuda' else 'fp32')}.json"
    child = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
        "-m", "flce.bench.tensor_parallel", "--out", str(out_file), "--device", device.type,
    ]
    for flag, values in (("--tokens", args.tokens), ("--vocab", args.vocab), ("--hidden", args.hidden)):
        if values:
            child += [flag, str(values[0])]
    if args.dtype:
        child += ["--dtype", args.dtype]
    if args.rounds:
        child += ["--iters", str(args.rounds)]
    if args.warmup is not None:
        child += ["--warmup", str(args.warmup)]
    print("running:", " ".join(child))
    return subprocess.run(child, check=False).returncode


def run_bench(args: argparse.Namespace) -> int:
    """Run ``flce bench``; returns the exit code (0 when some method was measured)."""
    if args.tp is not None:
        return run_tensor_parallel(args)
    try:
        config = resolve_config(args)
        methods = resolve_methods(args, config.device)
    except ValueError as exc:
        print(f"flce bench: error: {exc}", file=sys.stderr)
        return 2
    if args.list_methods:
        for m in all_methods(args.chunk_size or (None,)):
            print(f"{m.name:28s} {m.label}")
        return 0
    env = report.environment(config.device)
    title = _title(config, env)
    total = len(config.shapes) * config.steps_per_shape(len(methods))
    env["gpu_state_before"] = report.gpu_state(config.device)
    with progress_reporter(total) as tick:
        results: list[Result] = run_sweep(config, methods, tick)
    env["gpu_state_after"] = report.gpu_state(config.device)
    payload = {
        "schema": report.SCHEMA,
        "command": command_line(),
        "argv": list(sys.argv),
        "date_utc": report.utc_now(),
        "environment": env,
        "config": config_dict(config, args, methods),
        "results": [report.result_row(r) for r in results],
    }
    report.print_table(payload["results"], title)
    if args.out is not None:
        stem = f"bench-{args.mode}-{payload['config']['dtype']}" + (f"-{args.sweep}" if args.sweep else "")
        for path in write_outputs(args.out, stem, payload, not args.no_plots, title):
            print(f"wrote {path}")
    measured = [r for r in results if r.ok and not r.is_floor]
    return 0 if measured else 1


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flce bench", description=__doc__.splitlines()[0])
    add_bench_arguments(parser)
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(_main())
