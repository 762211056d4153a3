#!/usr/bin/env python3
"""Render the README performance section from ``flce bench`` results.

    python benchmarks/make_readme_perf.py RESULTS.json [MORE.json ...]            # print Markdown
    python benchmarks/make_readme_perf.py RESULTS.json --write README.md          # replace the block

With ``--write`` the text between ``<!-- perf:start -->`` and ``<!-- perf:end -->``
in the given file is replaced (the markers stay); the file must contain them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

try:
    from flce.bench import report
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from flce.bench import report


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="JSON files written by `flce bench --out`")
    parser.add_argument("--write", type=Path, metavar="README", help="replace the perf block of this file")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    payloads = []
    for path in args.results:
        payload = json.loads(path.read_text())
        if payload.get("schema") != report.SCHEMA:
            print(f"{path}: not a {report.SCHEMA} results file", file=sys.stderr)
            return 2
        payloads.append(payload)
    markdown = report.render_sections(payloads)
    if args.write is None:
        print(markdown, end="")
        return 0
    try:
        updated = report.replace_block(args.write.read_text(), markdown)
    except ValueError as exc:
        print(f"{args.write}: {exc}", file=sys.stderr)
        return 1
    args.write.write_text(updated)
    print(f"updated {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
