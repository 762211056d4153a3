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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from flce.bench import ce_kernel, frontier, heads, host_overhead, report, runner
from flce.bench.cases import (
    DTYPES,
    FEATURES,
    LABEL_SMOOTHING,
    LSE_SQUARE_SCALE,
    MODES,
    SOFTCAP,
    BenchLossSettings,
    Shape,
    dtype_name,
)
from flce.bench.graph import GRAPH_WARMUP_CALLS
from flce.bench.methods import GRAPH_MODES, Method, select_methods
from flce.bench.registry import all_methods
from flce.bench.runner import BenchConfig, Result, run_shape, run_sweep
from flce.console import CommandError, progress_reporter, resolve_device

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

# --kernel ce: the shape on a GPU, in both dtypes; off the GPU one that runs in seconds.
KERNELS = ("ce",)
KERNEL_GPU_SHAPES = ((8192,), (128256,))
KERNEL_CPU_SHAPES = ((64,), (1000,))
KERNEL_GPU_DTYPES = ("bf16", "fp32")
KERNEL_CPU_DTYPES = ("fp32",)
# A call is a few ms of pure memory traffic, so more rounds cost little and steady the median.
DEFAULT_KERNEL_ROUNDS = (20, 5)
DEFAULT_OVERHEAD_CALLS = host_overhead.DEFAULT_CALLS


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return tuple(dict.fromkeys(values))  # a repeated value would run (and be reported) twice


def _name_list(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))


def _method_list(text: str) -> tuple[str, ...]:
    """``--methods``: at least one name (an empty list would time the floor alone)."""
    names = _name_list(text)
    if not names:
        raise argparse.ArgumentTypeError(f"expected a comma list of method names, got {text!r}")
    return names


def _out_dir(text: str) -> Path:
    """``--out``: a directory, made if missing; an existing file is refused before the run,
    not after it when the results are written."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a directory")
    return path


def _chunk_list(text: str) -> tuple[int | None, ...]:
    """Chunk sizes; ``auto`` stands for the library's own choice."""
    out: list[int | None] = []
    for item in _name_list(text):
        out.append(None if item.lower() in ("auto", "default") else _int_list(item)[0])
    return tuple(dict.fromkeys(out))


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``flce bench`` options to ``parser``."""
    g = parser.add_argument_group("what to run")
    g.add_argument(
        "--loss",
        choices=("ce", *heads.HEAD_LOSSES),
        default="ce",
        help="ce: the fused cross-entropy (default); logprobs: flce.fused_linear_logprobs with the entropy "
        "(N=8192, H=4096, V=128256 and 151936 by default on a GPU; floor: the CE's 3 GEMMs); distill: "
        "flce.fused_linear_distillation against a teacher (floor: 2 logits GEMMs + dX + dW), with Liger's "
        "fused linear JSD",
    )
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
    g.add_argument(
        "--features",
        type=_name_list,
        default=(),
        help=f"comma list among {','.join(FEATURES)}: label smoothing {LABEL_SMOOTHING}, z-loss {LSE_SQUARE_SCALE}, "
        f"softcap {SOFTCAP}, class weights, an LM-head bias (the floor's GEMMs leave it out), and flce's "
        "use_token_scaling, return_token_accuracy, return_predicted_tokens (per-token outputs without "
        "grad; the backward runs on the loss alone); a method that lacks one is skipped with the reason",
    )
    g.add_argument("--reduction", choices=("mean", "sum"), default="mean")
    g.add_argument(
        "--ignore-fraction", type=float, help="fraction of targets set to ignore_index (default 0; with --tp 0.05)"
    )
    g.add_argument(
        "--methods",
        type=_method_list,
        help=(
            "comma list of methods or families (flce, torch, liger, cce); default all "
            "(on the CPU: flce:torch,torch:eager); the floor always runs"
        ),
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
    t.add_argument(
        "--graph",
        action="store_true",
        help="capture each method's call (fwd+bwd; the forward with --mode fwd) once in a CUDA graph, "
        "on the shared inputs, and time its replays; a method that cannot be captured is skipped with "
        "the error's first line (CUDA only: skipped, with the reason, elsewhere)",
    )
    p = parser.add_argument_group("tensor parallelism")
    p.add_argument(
        "--tp",
        type=int,
        metavar="WORLD",
        help="benchmark the vocab-parallel loss over WORLD processes, one per GPU (NCCL; gloo with "
        "--device cpu), against the single-device loss; skipped with a reason when fewer GPUs exist",
    )
    k = parser.add_argument_group(
        "the cross-entropy kernel alone (--kernel ce)",
        "Times the loss + gradient of given (N, V) logits (--tokens, --vocab; default N=8192, V=128256, "
        "bf16 and fp32 on a GPU, a tiny fp32 case on the CPU): flce's chunk kernels called directly and "
        "flce.cross_entropy, Liger's CuTe and Triton CE (primitive and autograd), F.cross_entropy, and "
        "a copy of the logits as the HBM yardstick. GB/s counts one read of the logits and one write of "
        "the gradient (2*N*V*itemsize) for every method; % of copy compares with the copy. Then the host "
        "overhead: microseconds per call of the public flce calls at N=8, V=1024, H=64, fwd and fwd+bwd, "
        "against eager PyTorch. Accepts --dtype, --features (but bias: the logits are given), --reduction, "
        "--ignore-fraction, "
        "--methods (--list-methods lists them), --rounds (default 20 on a GPU), --warmup, --heat-ms (default 0), "
        "--seed, --device and --out (bench-kernel-ce.json).",
    )
    k.add_argument("--kernel", choices=KERNELS, help="benchmark this kernel alone instead of the fused loss")
    k.add_argument(
        "--overhead-calls",
        type=int,
        help=f"calls per timed batch of the host-overhead measurement (default {DEFAULT_OVERHEAD_CALLS[0]} on a "
        f"GPU, {DEFAULT_OVERHEAD_CALLS[1]} on the CPU; 0 skips it)",
    )
    frontier.add_frontier_arguments(parser)
    o = parser.add_argument_group("output")
    o.add_argument("--out", type=_out_dir, help="directory for the JSON, CSV and PNG files")
    o.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    o.add_argument("--list-methods", action="store_true", help="list the method names and exit")


def resolve_shapes(args: argparse.Namespace, device: torch.device) -> tuple[Shape, ...]:
    """Tokens × vocab × hidden from the sweep (or the device's default), then the explicit lists."""
    tokens, vocab, hidden = (
        SWEEPS[args.sweep] if args.sweep else (GPU_DEFAULT if device.type == "cuda" else CPU_DEFAULT)
    )
    tokens = args.tokens or tokens
    vocab = args.vocab or vocab
    hidden = args.hidden or hidden
    return tuple(Shape(n, v, h) for h in hidden for n in tokens for v in vocab)


def _ignore_fraction(args: argparse.Namespace, default: float = 0.0) -> float:
    """``--ignore-fraction``, checked; ``default`` when not given."""
    fraction = default if args.ignore_fraction is None else args.ignore_fraction
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"--ignore-fraction must be in [0, 1), got {fraction}")
    return fraction


def _rounds_and_warmup(args: argparse.Namespace, default_rounds: int, default_warmup: int) -> tuple[int, int]:
    """``--rounds`` and ``--warmup`` (or the mode's defaults), checked with
    ``--ignore-fraction`` and ``--heat-ms``: the settings every kind of run shares."""
    _ignore_fraction(args)
    rounds = args.rounds if args.rounds is not None else default_rounds
    warmup = args.warmup if args.warmup is not None else default_warmup
    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    if warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {warmup}")
    # Checked on every device: a negative heat would silently turn the heat-up off on a GPU.
    if args.heat_ms is not None and not args.heat_ms >= 0.0:
        raise ValueError(f"--heat-ms must be >= 0 (0 turns the heat-up off), got {args.heat_ms}")
    return rounds, warmup


def resolve_config(args: argparse.Namespace, device: torch.device) -> BenchConfig:
    """The frozen run configuration; ValueError on inconsistent options."""
    on_gpu = device.type == "cuda"
    chosen_dtype = args.dtype or ("bf16" if on_gpu else "fp32")
    rounds, warmup = _rounds_and_warmup(args, DEFAULT_ROUNDS[not on_gpu], DEFAULT_WARMUP[not on_gpu])
    if args.graph and args.mode not in GRAPH_MODES:
        raise ValueError(f"--graph captures --mode {' or '.join(GRAPH_MODES)}, not --mode {args.mode}")
    return BenchConfig(
        graph=args.graph,
        mode=args.mode,
        dtype=DTYPES[chosen_dtype],
        shapes=resolve_shapes(args, device),
        loss=BenchLossSettings.from_features(args.features, reduction=args.reduction),
        rounds=rounds,
        warmup=warmup,
        device=device,
        seed=args.seed,
        ignore_fraction=_ignore_fraction(args),
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


# How the results JSON describes the graph capture and the host measurement.
GRAPH_CAPTURE_TEXT = f"after {GRAPH_WARMUP_CALLS} warm-up calls on a side stream; memory measured over the capture"
HOST_MEASUREMENT_TEXT = {
    "syncs": 'synchronizing CUDA operations of one call after the warm-up (torch.cuda.set_sync_debug_mode("warn"))',
    "time": f"time.perf_counter until the call returns, median of {runner.HOST_CALLS} calls, each queued behind "
    f"a GPU spin of max({runner.MIN_BUSY_MS:g} ms, {runner.BUSY_FACTOR:g} x the call's wall time)",
    "loop": f"CUDA events around calls queued back to back (setup, run, teardown; no sync between them), "
    f"per call, median of {runner.LOOP_BATCHES} batches of enough calls for {runner.LOOP_BATCH_MS:g} ms "
    f"(at most {runner.LOOP_MAX_CALLS}); fwd and full modes",
}


def config_dict(config: BenchConfig, args: argparse.Namespace, methods: Sequence[Method]) -> dict[str, Any]:
    return {
        "mode": config.mode,
        "dtype": dtype_name(config.dtype),
        "shapes": [{"n": s.n, "v": s.v, "h": s.h} for s in config.shapes],
        "loss_options": config.loss.record(),
        **config.record(),
        "sweep": args.sweep,
        "chunk_sizes": list(args.chunk_size) if args.chunk_size else None,
        "methods": [m.name for m in methods],
        "graph": config.graph,
        "graph_capture": GRAPH_CAPTURE_TEXT if config.graph else None,
        "host": HOST_MEASUREMENT_TEXT if config.measures_host else runner.HOST_CUDA_ONLY,
    }


def _title(config: BenchConfig, env: dict[str, Any]) -> str:
    where = env.get("gpu") or str(config.device)
    features = ",".join(config.loss.enabled()) or "no features"
    graph = ", replayed from a CUDA graph" if config.graph else ""
    return f"flce bench: {report.MODE_TEXT[config.mode]}{graph}, {dtype_name(config.dtype)}, {features} on {where}"


def _graph_skipped(config: BenchConfig) -> bool:
    """Whether ``--graph`` asks for CUDA graphs off CUDA, said as a skip, not an error (exit
    code 0), so that a script can ask for it on any machine."""
    if config.graph and config.device.type != "cuda":
        print(f"flce bench --graph: skipped: CUDA graphs need a CUDA device (this run's device is {config.device})")
        return True
    return False


def write_outputs(out: Path, stem: str, payload: dict[str, Any], plots: bool, title: str) -> list[Path]:
    """JSON, CSV and (optionally) PNG files under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = [
        report.write_json(out / f"{stem}.json", payload),
        report.write_csv(out / f"{stem}.csv", payload["results"]),
    ]
    if plots:  # the folder is made only when some swept axis gives a plot
        written.extend(report.plot_results(payload["results"], out / f"{stem}-plots", title))
    return written


def run_tensor_parallel(args: argparse.Namespace, device: torch.device) -> int:
    """``flce bench --tp WORLD``: ``flce.bench.tensor_parallel`` under torchrun, one
    process per GPU; its JSON (parity, per-rank time and memory) goes to ``--out``, and
    without it to a temporary directory (the processes print its summary)."""
    import subprocess
    import tempfile

    world = args.tp
    if world < 1:
        return _usage_error(ValueError("--tp must be >= 1"))
    try:
        forwarded = _tensor_parallel_options(args, device)
    except ValueError as exc:
        return _usage_error(exc)
    if device.type == "cuda" and torch.cuda.device_count() < world:
        print(f"flce bench --tp {world}: skipped: {torch.cuda.device_count()} CUDA device(s) here, {world} needed")
        return 0
    with tempfile.TemporaryDirectory(prefix="flce-bench-tp-") as scratch:
        out_dir = args.out or Path(scratch)
        out_dir.mkdir(parents=True, exist_ok=True)
        out_file = out_dir / f"bench-tp{world}-{args.dtype or ('bf16' if device.type == 'cuda' else 'fp32')}.json"
        child = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={world}",
            "-m",
            "flce.bench.tensor_parallel",
            "--out",
            str(out_file),
            "--device",
            device.type,
        ]
        child += forwarded
        print("running:", " ".join(child))
        code = subprocess.run(child, check=False).returncode
    _saved_or_how(args.out, [out_file] if args.out is not None and out_file.exists() else [])
    return code


# The --features that flce.bench.tensor_parallel takes, as its flags.
TENSOR_PARALLEL_FEATURES = {
    "label_smoothing": ("--label-smoothing", LABEL_SMOOTHING),
    "z_loss": ("--lse-square-scale", LSE_SQUARE_SCALE),
    "softcap": ("--softcap", SOFTCAP),
}


def _tensor_parallel_options(args: argparse.Namespace, device: torch.device) -> list[str]:
    """The options of ``flce.bench.tensor_parallel`` that ``--tp`` forwards; ValueError on
    one it would drop (the run would measure another case than asked, saying nothing). On
    the CPU the shapes not given are the small CPU case's (``CPU_DEFAULT``), as every CPU run."""
    refused = [
        flag
        for flag, given in (
            ("--tokens (one value)", args.tokens is not None and len(args.tokens) > 1),
            ("--vocab (one value)", args.vocab is not None and len(args.vocab) > 1),
            ("--hidden (one value)", args.hidden is not None and len(args.hidden) > 1),
            ("--chunk-size (one value)", args.chunk_size is not None and len(args.chunk_size) > 1),
            ("--sweep", args.sweep is not None),
            ("--methods", args.methods is not None),
            ("--mode (always fwd+bwd)", args.mode != "full"),
            ("--reduction (always mean)", args.reduction != "mean"),
            ("--loss (the cross-entropy only)", args.loss != "ce"),
            ("--heat-ms", args.heat_ms is not None),
            ("--list-methods", args.list_methods),
        )
        if given
    ]
    other_features = [f for f in args.features if f not in TENSOR_PARALLEL_FEATURES]
    if other_features:
        refused.append(f"--features {','.join(other_features)} (only {','.join(TENSOR_PARALLEL_FEATURES)})")
    if refused:
        raise ValueError(f"--tp does not take {'; '.join(refused)}")
    BenchLossSettings.from_features(args.features)  # unknown names: the usual error
    rounds, warmup = _rounds_and_warmup(args, 1, 0)  # checks only: the processes keep their own defaults
    options: list[str] = []
    shapes = (("--tokens", args.tokens), ("--vocab", args.vocab), ("--hidden", args.hidden))
    for (flag, values), cpu_values in zip(shapes, CPU_DEFAULT, strict=True):
        if values:
            options += [flag, str(values[0])]
        elif device.type == "cpu":
            options += [flag, str(cpu_values[0])]
    if args.dtype:
        options += ["--dtype", args.dtype]
    if args.rounds is not None:
        options += ["--iters", str(rounds)]
    if args.warmup is not None:
        options += ["--warmup", str(warmup)]
    if args.ignore_fraction is not None:
        options += ["--ignore-fraction", str(_ignore_fraction(args))]
    if args.chunk_size is not None and args.chunk_size[0] is not None:
        options += ["--chunk-size", str(args.chunk_size[0])]
    options += ["--seed", str(args.seed)]
    for feature in args.features:
        flag, value = TENSOR_PARALLEL_FEATURES[feature]
        options += [flag, str(value)]
    return options


def _usage_error(exc: Exception) -> int:
    """One line on stderr and exit code 2, as ``flce.cli.main`` reports a ``CommandError``."""
    print(f"flce bench: error: {exc}", file=sys.stderr)
    return 2


def _saved_or_how(out: Path | None, written: Sequence[Path]) -> None:
    """What was written, or how to keep the results (a run without ``--out`` writes nothing)."""
    if out is None:
        print("results not saved: add --out DIR to write them as JSON and CSV (and plots of swept shapes)")
    for path in written:
        print(f"wrote {path}")


def run_bench(args: argparse.Namespace) -> int:
    """Run ``flce bench``; returns the exit code (0 when some method was measured)."""
    try:
        device = resolve_device(args.device)
    except CommandError as exc:
        return _usage_error(exc)
    if args.frontier:
        return run_frontier_bench(args, device)
    if args.kernel is not None:
        return run_kernel_bench(args, device)
    if args.overhead_calls is not None:
        return _usage_error(ValueError("--overhead-calls applies to --kernel ce only"))
    if args.tp is not None:
        if args.graph:
            return _usage_error(ValueError("--graph applies to the single-device fused loss, not --tp"))
        return run_tensor_parallel(args, device)
    if args.loss != "ce":
        return run_head_bench(args, device)
    try:
        config = resolve_config(args, device)
        methods = resolve_methods(args, config.device)
    except ValueError as exc:
        return _usage_error(exc)
    if args.list_methods:
        for m in all_methods(args.chunk_size or (None,)):
            print(f"{m.name:28s} {m.label}")
        return 0
    if _graph_skipped(config):
        return 0
    env = report.environment(config.device)
    title = _title(config, env)
    total = len(config.shapes) * config.steps_per_case(len(methods))
    env["gpu_state_before"] = report.gpu_state(config.device)
    with progress_reporter(total) as tick:
        results: list[Result] = run_sweep(config, methods, tick)
    env["gpu_state_after"] = report.gpu_state(config.device)
    payload = report.run_record(
        command_line(), env, config_dict(config, args, methods), [report.result_row(r) for r in results]
    )
    report.print_table(payload["results"], title)
    written = []
    if args.out is not None:
        stem = (
            f"bench-{args.mode}-{payload['config']['dtype']}"
            + (f"-{args.sweep}" if args.sweep else "")
            + ("-graph" if config.graph else "")
        )
        written = write_outputs(args.out, stem, payload, not args.no_plots, title)
    _saved_or_how(args.out, written)
    measured = [r for r in results if r.ok and not r.is_floor]
    return 0 if measured else 1


# ----------------------------------------------------------------------------- --frontier


def run_frontier_bench(args: argparse.Namespace, device: torch.device) -> int:
    """``flce bench --frontier`` (``flce.bench.frontier``): per shape, flce under a ladder of
    memory budgets with the peers and the floor, by the same runner as the plain bench."""
    try:
        config = frontier.resolve_frontier_config(args, resolve_config(args, device))
        plans = [frontier.plan_shape(config, shape) for shape in config.shapes]
    except ValueError as exc:
        return _usage_error(exc)
    env = report.environment(config.device)
    where = env.get("gpu") or str(config.device)
    title = f"flce bench --frontier: {report.MODE_TEXT[config.mode]}, {dtype_name(config.dtype)} on {where}"
    if args.list_methods:
        frontier.print_ladder(plans, f"{title}: the ladder of memory budgets and its predictions")
        return 0
    env["gpu_state_before"] = report.gpu_state(config.device)
    results: list[Result] = []
    with progress_reporter(sum(config.steps_per_case(len(plan.methods)) for plan in plans)) as tick:
        for plan in plans:
            results.extend(run_shape(config, plan.shape, plan.methods, tick))
    env["gpu_state_after"] = report.gpu_state(config.device)
    payload = report.run_record(
        command_line(), env, frontier.config_record(config, plans), frontier.frontier_rows(results, plans)
    )
    frontier.print_frontier(payload["results"], title)
    written = []
    if args.out is not None:
        stem = f"bench-frontier-{payload['config']['dtype']}" + (f"-{args.sweep}" if args.sweep else "")
        args.out.mkdir(parents=True, exist_ok=True)
        written = [
            report.write_json(args.out / f"{stem}.json", payload),
            report.write_csv(args.out / f"{stem}.csv", payload["results"], frontier.CSV_FIELDS),
        ]
        if not args.no_plots:
            written.extend(frontier.plot_frontier(payload["results"], args.out / f"{stem}-plots", title))
    _saved_or_how(args.out, written)
    return 0 if any(r.ok and not r.is_floor for r in results) else 1


# ----------------------------------------------------------------------------- --loss logprobs|distill


def run_head_bench(args: argparse.Namespace, device: torch.device) -> int:
    """``flce bench --loss logprobs|distill`` (``flce.bench.heads``): the same sweep, table
    and files as the cross-entropy's, with the head's methods and floor."""
    try:
        config, methods = heads.resolve_head_run(args, resolve_config(args, device))
    except ValueError as exc:
        return _usage_error(exc)
    if args.list_methods:
        for m in heads.head_methods(args.loss):
            print(f"{m.name:28s} {m.label}")
        return 0
    if _graph_skipped(config):
        return 0
    env = report.environment(config.device)
    env["gpu_state_before"] = report.gpu_state(config.device)
    with progress_reporter(len(config.shapes) * config.steps_per_case(len(methods))) as tick:
        results = run_sweep(config, methods, tick)
    env["gpu_state_after"] = report.gpu_state(config.device)
    payload = heads.head_payload(args, config, methods, results, env, command_line())
    graph = ", replayed from a CUDA graph" if config.graph else ""
    title = f"flce bench --loss {args.loss}: {report.MODE_TEXT[config.mode]}{graph}, {dtype_name(config.dtype)} on " + (
        env.get("gpu") or str(config.device)
    )
    report.print_table(payload["results"], title)
    written = []
    if args.out is not None:
        stem = f"bench-{args.loss}-{args.mode}-{payload['config']['dtype']}" + ("-graph" if config.graph else "")
        written = write_outputs(args.out, stem, payload, not args.no_plots, title)
    _saved_or_how(args.out, written)
    return 0 if any(r.ok and not r.is_floor for r in results) else 1


# ----------------------------------------------------------------------------- --kernel ce


def _kernel_conflicts(args: argparse.Namespace) -> list[str]:
    """Options of the fused-loss benchmark that mean nothing for a kernel on given logits."""
    conflicts = [
        flag
        for flag, given in (
            ("--sweep", args.sweep is not None),
            ("--hidden", args.hidden is not None),
            ("--chunk-size", args.chunk_size is not None),
            ("--tp", args.tp is not None),
            ("--graph", args.graph),
            ("--no-plots", args.no_plots),
            ("--loss (the kernel is the cross-entropy's)", args.loss != "ce"),
            ("--features bias (the logits are given: there is no LM head)", "bias" in args.features),
        )
        if given
    ]
    if args.mode != "full":
        conflicts.append("--mode (the kernel always computes the loss and the gradient)")
    return conflicts


def resolve_kernel_config(args: argparse.Namespace, device: torch.device) -> ce_kernel.KernelBenchConfig:
    """The frozen configuration of ``--kernel ce``; ValueError on inconsistent options."""
    conflicts = _kernel_conflicts(args)
    if conflicts:
        raise ValueError(f"--kernel {args.kernel} does not take {', '.join(conflicts)}")
    on_gpu = device.type == "cuda"
    tokens, vocab = KERNEL_GPU_SHAPES if on_gpu else KERNEL_CPU_SHAPES
    dtype_names = (args.dtype,) if args.dtype else (KERNEL_GPU_DTYPES if on_gpu else KERNEL_CPU_DTYPES)
    rounds, warmup = _rounds_and_warmup(args, DEFAULT_KERNEL_ROUNDS[not on_gpu], DEFAULT_WARMUP[not on_gpu])
    if args.overhead_calls is not None and args.overhead_calls < 0:
        raise ValueError("--overhead-calls must be >= 0 (0 skips the host-overhead measurement)")
    return ce_kernel.KernelBenchConfig(
        shapes=tuple((n, v) for n in (args.tokens or tokens) for v in (args.vocab or vocab)),
        dtypes=tuple(DTYPES[name] for name in dtype_names),
        loss=BenchLossSettings.from_features(args.features, reduction=args.reduction),
        rounds=rounds,
        warmup=warmup,
        device=device,
        seed=args.seed,
        ignore_fraction=_ignore_fraction(args),
        # Off by default: the GEMM heat-up steadies matrix throughput, not memory bandwidth.
        heat_ms=(args.heat_ms or 0.0) if on_gpu else 0.0,
    )


def _overhead_config(
    args: argparse.Namespace, config: ce_kernel.KernelBenchConfig, methods: Sequence[ce_kernel.KernelMethod]
) -> host_overhead.OverheadConfig | None:
    """Host overhead in the run's first dtype, for the flce backends among the selected methods."""
    on_gpu = config.device.type == "cuda"
    calls = DEFAULT_OVERHEAD_CALLS[not on_gpu] if args.overhead_calls is None else args.overhead_calls
    if calls == 0:
        return None
    names = {m.name for m in methods}
    backends = tuple(b for b in ce_kernel.flce_kernel_backends() if {f"flce:{b}", f"flce:{b}:kernel"} & names)
    return host_overhead.OverheadConfig(
        dtype=config.dtypes[0], device=config.device, backends=backends, calls=calls, seed=config.seed
    )


def kernel_config_dict(
    config: ce_kernel.KernelBenchConfig,
    methods: Sequence[ce_kernel.KernelMethod],
    overhead: host_overhead.OverheadConfig | None,
) -> dict[str, Any]:
    return {
        "kernel": "ce",
        "shapes": [{"n": n, "v": v} for n, v in config.shapes],
        "dtypes": [dtype_name(d) for d in config.dtypes],
        **config.record(),
        "traffic": "2 * N * V * itemsize bytes (one read of the logits, one write of the gradient)",
        "between_calls": "logits restored from a pristine copy"
        + (", L2 overwritten" if config.device.type == "cuda" else "")
        + " (untimed)",
        "methods": [m.name for m in methods],
        "host_overhead": None
        if overhead is None
        else {
            "shape": {"n": overhead.shape.n, "v": overhead.shape.v, "h": overhead.shape.h},
            "dtype": dtype_name(overhead.dtype),
            "backends": list(overhead.backends),
            "calls_per_batch": overhead.calls,
            "batches": overhead.batches,
            "warmup_calls": min(overhead.warmup, overhead.calls),
            "timer": "time.perf_counter around each batch, device synchronized at its ends",
        },
    }


def run_kernel_bench(args: argparse.Namespace, device: torch.device) -> int:
    """``flce bench --kernel ce``: the CE kernel's bandwidth, then the host overhead per call."""
    try:
        config = resolve_kernel_config(args, device)
        methods = select_methods(ce_kernel.all_kernel_methods(), args.methods)
    except ValueError as exc:
        return _usage_error(exc)
    if args.list_methods:
        for m in ce_kernel.all_kernel_methods():
            print(f"{m.name:28s} {m.label}")
        return 0
    overhead = _overhead_config(args, config, methods)
    env = report.environment(config.device)
    env["gpu_state_before"] = report.gpu_state(config.device)
    total = len(config.cases()) * config.steps_per_case(len(methods))
    with progress_reporter(total) as tick:
        results = ce_kernel.run_kernel_sweep(config, methods, tick)
    overhead_rows = []
    if overhead is not None:
        print("measuring the host overhead per call ...", flush=True)
        overhead_rows = host_overhead.overhead_rows(host_overhead.measure_host_overhead(overhead), overhead)
    env["gpu_state_after"] = report.gpu_state(config.device)
    payload = report.run_record(
        command_line(),
        env,
        kernel_config_dict(config, methods, overhead),
        ce_kernel.result_rows(results),
        schema=ce_kernel.SCHEMA,
    )
    payload["host_overhead"] = overhead_rows
    where = env.get("gpu") or str(config.device)
    features = ",".join(config.loss.enabled()) or "no features"
    report.print_grid(
        f"flce bench --kernel ce: loss + gradient of given logits, {features}, on {where} "
        "(GB/s of 2·N·V·itemsize bytes)",
        ce_kernel.KERNEL_TABLE_HEADER,
        ce_kernel.table_cells(payload["results"]),
        report.footnotes(payload["results"], ce_kernel.case_text),
        left_columns=2,
    )
    if overhead is not None:
        shape = overhead.shape
        report.print_grid(
            f"host overhead per call at N={shape.n} V={shape.v} H={shape.h} {dtype_name(overhead.dtype)} "
            f"(median of {overhead.batches} batches of {overhead.calls} calls)",
            host_overhead.OVERHEAD_TABLE_HEADER,
            host_overhead.overhead_cells(overhead_rows),
            host_overhead.overhead_notes(overhead_rows),
            left_columns=3,
        )
    written = []
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        written.append(report.write_json(args.out / "bench-kernel-ce.json", payload))
    _saved_or_how(args.out, written)
    measured = [r for r in results if r.ok and not r.is_floor]
    return 0 if measured else 1


def bench_parser() -> argparse.ArgumentParser:
    """The parser of ``flce bench`` on its own (``python -m flce.bench.cli``, tests)."""
    parser = argparse.ArgumentParser(prog="flce bench", description=__doc__.splitlines()[0])
    add_bench_arguments(parser)
    return parser


def _main(argv: Sequence[str] | None = None) -> int:
    return run_bench(bench_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(_main())
