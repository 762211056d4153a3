"""The ``flce`` command: ``info``, ``check`` and ``bench``.

Errors a user can fix (a device that is not here, a backend that cannot run) are one
line on stderr and exit code 2, never a traceback: commands raise ``CommandError`` and
``main`` prints it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys
from collections.abc import Sequence

import torch

from flce.console import CommandError, default_device, progress_reporter, resolve_device
from flce.dispatch import BACKEND_NAMES, availability, resolve_backend


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
    except ImportError:
        print(title)
        print(" | ".join(columns))
        for row in rows:
            print(" | ".join(row))
        return
    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(escape(cell) for cell in row))
    Console().print(table)


def run_info(args: argparse.Namespace) -> int:
    import flce

    device = default_device()
    print(f"flce {flce.__version__}  python {platform.python_version()}  torch {torch.__version__}")
    for package in ("triton", "nvidia-cutlass-dsl", "liger-kernel", "cut-cross-entropy", "transformers"):
        print(f"  {package}: {_version(package)}")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        print(f"device: {torch.cuda.get_device_name(device)} (sm_{major}{minor}), CUDA {torch.version.cuda}")
    else:
        print("device: cpu (no CUDA device)")
    rows = []
    for name in BACKEND_NAMES:
        ok, why = availability(name, device)
        rows.append((name, "yes" if ok else "no", why or "-"))
    _print_table(f"backends on {device}", ("backend", "usable", "why not"), rows)
    print(f"auto dispatch picks: {resolve_backend(None, device).name}")
    return 0


def _checked_backends(requested: str | None, device: torch.device) -> list[str]:
    """The backends ``flce check`` runs: the requested one, which must be able to run here,
    else every usable one."""
    if requested is None:
        return [name for name in BACKEND_NAMES if availability(name, device)[0]]
    ok, why = availability(requested, device)
    if not ok:
        raise CommandError(f"backend {requested!r} cannot run on {device}: {why}")
    return [requested]


def run_check(args: argparse.Namespace) -> int:
    from flce.testing import check_cases, check_cases_vocabulary_blocks, run_case

    device = resolve_device(args.device)
    names = _checked_backends(args.backend, device)
    # Every backend has split-row kernels (BackendSpec.split_rows), so each is checked with
    # vocab_chunk_size as well.
    cases = check_cases(device) + check_cases_vocabulary_blocks()
    rows, failed = [], 0
    with progress_reporter(len(names) * len(cases)) as tick:
        for name in names:
            outcomes = []
            for case in cases:
                outcomes.append(run_case(case, name, device))
                tick(1, f"{name} case {len(outcomes)}/{len(cases)}")
            bad = [o for o in outcomes if not o.passed]
            failed += len(bad)
            worst = max(
                ((o.errors[key][0] / o.allowed[key], key) for o in outcomes for key in o.allowed), default=(0.0, "-")
            )
            rows.append((name, str(len(outcomes) - len(bad)), str(len(bad)), f"{worst[0]:.2f} ({worst[1]})"))
            for outcome in bad:
                print(f"FAIL {name} {outcome.case.name}: {'; '.join(outcome.failures)}")
    _print_table(
        f"flce check on {device} (float64 reference; pass: err <= 3 x eager torch err + eps)",
        ("backend", "passed", "failed", "worst err / tolerance"),
        rows,
    )
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    import flce

    parser = argparse.ArgumentParser(
        prog="flce",
        description="Fused linear + cross-entropy kernels: what runs here, a correctness check, a benchmark.",
        epilog="Start with `flce info`; `flce <command> --help` lists a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"flce {flce.__version__} (torch {torch.__version__})")
    sub = parser.add_subparsers(dest="command", metavar="{info,check,bench}")
    info = sub.add_parser(
        "info",
        help="versions, device, usable backends and why not",
        description="Versions, the device, and which backends can run here (and why not).",
    )
    info.set_defaults(func=run_info)
    check = sub.add_parser(
        "check",
        help="every usable backend against the float64 reference",
        description="Run every usable backend (or --backend) over a matrix of features, reductions and dtypes "
        "against the float64 reference; pass: err <= 3 x eager torch err + eps. Exit code 1 on a failure.",
    )
    check.add_argument("--backend", choices=BACKEND_NAMES, help="check only this backend")
    check.add_argument("--device", help="device (default: cuda if available, else cpu)")
    check.set_defaults(func=run_check)
    bench = sub.add_parser(
        "bench",
        help="benchmark against the peers and the cuBLAS floor",
        description="Time and peak memory of the LM-head loss: flce's backends against PyTorch, Liger-Kernel, "
        "Apple CCE and the cuBLAS GEMMs alone (the floor). Without a GPU: a small CPU case. "
        "benchmarks/README.md describes the measurements.",
    )
    from flce.bench.cli import add_bench_arguments, run_bench

    add_bench_arguments(bench)
    bench.set_defaults(func=run_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # plain `flce`: what it can do, not a usage error
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except CommandError as exc:
        print(f"flce {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
