"""The ``flce`` command: ``info``, ``check`` and ``bench``."""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys
from collections.abc import Sequence

import torch

from flce.dispatch import BACKEND_NAMES, availability, resolve_backend


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


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


def run_check(args: argparse.Namespace) -> int:
    from flce.testing import check_cases, check_cases_vocabulary_blocks, run_case

    device = torch.device(args.device) if args.device else default_device()
    names = [n for n in BACKEND_NAMES if availability(n, device)[0]] if not args.backend else [args.backend]
    rows, failed = [], 0
    for name in names:
        cases = check_cases(device)
        if name in SPLIT_ROW_BACKENDS:
            cases += check_cases_vocabulary_blocks()
        outcomes = [run_case(case, name, device) for case in cases]
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


# Backends with split-row kernels (flce.split_rows), checked with vocab_chunk_size too.
SPLIT_ROW_BACKENDS = ("torch", "triton", "cutedsl")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flce", description="Fused linear + cross-entropy kernels")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, device, usable backends and why not")
    info.set_defaults(func=run_info)
    check = sub.add_parser("check", help="every usable backend against the float64 reference")
    check.add_argument("--backend", choices=BACKEND_NAMES, help="check only this backend")
    check.add_argument("--device", help="device (default: cuda if available, else cpu)")
    check.set_defaults(func=run_check)
    bench = sub.add_parser("bench", help="benchmark against the peers and the cuBLAS floor")
    from flce.bench.cli import add_bench_arguments, run_bench

    add_bench_arguments(bench)
    bench.set_defaults(func=run_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
