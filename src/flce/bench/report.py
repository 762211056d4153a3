"""Outputs of a sweep: the terminal table, JSON, CSV, PNG plots and the README
Markdown section. Everything after the run works on plain rows (dicts), so the
Markdown renderer reads a saved JSON file the same way it reads a fresh run.
"""

from __future__ import annotations

import contextlib
import csv
import datetime as _dt
import json
import platform
import re
import shlex
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from flce.bench.runner import Result

GIB = 1024**3
SCHEMA = "flce-bench/1"
# Distribution names whose versions the JSON records (the ones that change the numbers).
PACKAGES = ("flce", "torch", "triton", "nvidia-cutlass-dsl", "liger-kernel", "cut-cross-entropy")
CSV_FIELDS = (
    "n",
    "v",
    "h",
    "method",
    "label",
    "chunk_size",
    "scheme_text",
    "status",
    "median_ms",
    "min_ms",
    "max_ms",
    "host_ms",
    "host_syncs",
    "host_reason",
    "loop_ms",
    "peak_extra_bytes",
    "peak_extra_gib",
    "tflops",
    "ratio_to_floor",
    "loss",
    "reason",
    "notes",
)
MODE_TEXT = {
    "full": "fwd+bwd",
    "fwd": "forward only (no grad)",
    "bwd": "backward only (gradients computed during the forward are not in it)",
}


# ----------------------------------------------------------------------------- environment


def package_version(name: str) -> str | None:
    """Installed version of a distribution, or None if it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict[str, Any]:
    """GPU, Python and package versions of this run."""
    env: dict[str, Any] = {
        "device": str(device),
        "gpu": None,
        "compute_capability": None,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {name: package_version(name) for name in PACKAGES},
    }
    if env["versions"]["flce"] is None:
        with contextlib.suppress(Exception):  # a version lookup never fails the run
            import flce

            env["versions"]["flce"] = getattr(flce, "__version__", None)
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    return env


def gpu_state(device: torch.device) -> dict[str, Any]:
    """SM clock (MHz), power (W) and temperature (°C) now, where NVML answers;
    recorded before and after a sweep, since they move GEMM speed by several percent."""
    state: dict[str, Any] = {}
    if device.type != "cuda":
        return state
    with contextlib.suppress(Exception):
        state["sm_clock_mhz"] = torch.cuda.clock_rate(device)
    with contextlib.suppress(Exception):
        state["power_w"] = torch.cuda.power_draw(device) / 1000.0
    with contextlib.suppress(Exception):
        state["temperature_c"] = torch.cuda.temperature(device)
    return state


def utc_now() -> str:
    """The current time as an ISO-8601 UTC string, to the second."""
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def run_record(command: str, environment: dict, config: dict, results: list[dict], schema: str = SCHEMA) -> dict:
    """The JSON of one ``flce bench`` run (every mode writes it; ``--kernel ce`` under its own
    schema): the command as typed, ``sys.argv``, the date, the environment, the run's
    settings and its result rows."""
    return {
        "schema": schema,
        "command": command,
        "argv": list(sys.argv),
        "date_utc": utc_now(),
        "environment": environment,
        "config": config,
        "results": results,
    }


def write_script_run(out_dir: Path, file_name: str, device: torch.device, config: dict, results: list[dict]) -> Path:
    """A script of ``benchmarks/``'s run record (``run_record``, the command as typed:
    ``python3 benchmarks/<script> <arguments>``), written to ``out_dir/file_name``."""
    command = " ".join(["python3", f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    out_dir.mkdir(parents=True, exist_ok=True)
    return write_json(out_dir / file_name, run_record(command, environment(device), config, results))


# ----------------------------------------------------------------------------- rows


def result_row(r: Result) -> dict[str, Any]:
    """One result as a JSON-ready dict (the CSV drops ``times_ms``)."""
    t = r.timing
    return {
        "method": r.method,
        "label": r.label,
        "n": r.shape.n,
        "v": r.shape.v,
        "h": r.shape.h,
        "chunk_size": r.chunk_size,
        "floor": r.is_floor,
        "status": "ok" if r.ok else "skipped",
        "reason": r.reason,
        "median_ms": t.median_ms if t else None,
        "min_ms": t.min_ms if t else None,
        "max_ms": t.max_ms if t else None,
        "times_ms": list(t.times_ms) if t else None,
        "host_ms": r.host_timing.median_ms if r.host_timing else None,
        "host_times_ms": list(r.host_timing.times_ms) if r.host_timing else None,
        "host_syncs": r.host_syncs,
        "host_reason": r.host_reason,
        "loop_ms": r.loop_timing.median_ms if r.loop_timing else None,
        "loop_times_ms": list(r.loop_timing.times_ms) if r.loop_timing else None,
        "peak_extra_bytes": r.peak_extra_bytes,
        "peak_extra_gib": None if r.peak_extra_bytes is None else r.peak_extra_bytes / GIB,
        "tflops": r.tflops,
        "ratio_to_floor": r.ratio_to_floor,
        "loss": r.loss,
        "scheme_text": r.scheme_text,
        "notes": list(r.notes),
    }


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def write_csv(path: Path, rows: Sequence[dict[str, Any]], fields: Sequence[str] = CSV_FIELDS) -> Path:
    """The rows' ``fields`` as CSV (notes joined with `` | ``)."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "notes": " | ".join(row.get("notes") or [])})
    return path


# ----------------------------------------------------------------------------- formatting


def fmt(value: float | None, spec: str, missing: str = "n/a") -> str:
    return missing if value is None else format(value, spec)


def shape_text(row: dict[str, Any], sep: str = " × ") -> str:
    return sep.join(str(row[a]) for a in ("n", "v", "h"))


def spread_text(row: dict[str, Any]) -> str:
    if row["min_ms"] is None:
        return ""
    return f"{row['min_ms']:.3g}–{row['max_ms']:.3g}"


# The terminal table's columns after the shape: header, the row's value, its format. A
# column that no measured row has a value for is left out, with ``LEFT_OUT`` saying why.
TABLE_COLUMNS: tuple[tuple[str, Callable[[dict[str, Any]], Any], str], ...] = (
    ("method", lambda row: row["method"], "s"),
    ("median ms", lambda row: row["median_ms"], ".3f"),
    ("min–max ms", spread_text, "s"),
    ("host ms", lambda row: row.get("host_ms"), ".3f"),
    ("syncs", lambda row: row.get("host_syncs"), "d"),
    ("loop ms", lambda row: row.get("loop_ms"), ".3f"),
    ("peak extra GiB", lambda row: row["peak_extra_gib"], ".3f"),
    ("TFLOP/s", lambda row: row["tflops"], ".1f"),
    ("× floor", lambda row: row["ratio_to_floor"], ".3f"),
)
LEFT_OUT = {
    "host ms": "host ms (until a call returns to Python, the GPU kept busy) and syncs (synchronizing "
    "CUDA operations per call) are measured on CUDA devices only",
    "loop ms": "loop ms (per call, calls queued back to back as a training loop runs them) is measured "
    "on CUDA devices, in the fwd and full modes",
    "peak extra GiB": "peak extra memory is tracked on CUDA devices only",
    "TFLOP/s": "TFLOP/s and × floor are left out off the GPU: there the GEMMs alone are no floor "
    "for the loss (small CPU runs time host work and PyTorch's CPU kernels)",
}


def footnotes(
    rows: Sequence[dict[str, Any]],
    place: Callable[[dict[str, Any]], str] | None = None,
    everywhere: str = "all shapes",
) -> list[str]:
    """Skip reasons and warnings, one line per method and message, with the places
    (shapes, by default) they apply to (``everywhere`` when every place of the run)."""
    place = place or (lambda row: shape_text(row, "×"))
    all_places = {place(r) for r in rows}
    where: dict[tuple[str, str], list[str]] = defaultdict(list)
    for row in rows:
        at = place(row)
        if row["status"] != "ok":
            where[(row["method"], f"skipped: {row['reason']}")].append(at)
        for note in row.get("notes") or []:
            where[(row["method"], f"note: {note}")].append(at)
    lines = []
    for (method, message), places in where.items():
        at = everywhere if len(all_places) > 1 and set(places) == all_places else ", ".join(places)
        lines.append(f"{method} @ {at}: {message}")
    return lines


def grouped_cells(
    rows: Sequence[dict[str, Any]],
    group: Callable[[dict[str, Any]], Sequence[str]],
    cells: Callable[[dict[str, Any]], Sequence[str]],
) -> list[list[str]]:
    """Table cells of the measured rows: the ``group`` cells (the shape, say), written on
    a group's first row and left blank below it (``print_grid`` starts a section there),
    then the row's own ``cells``."""
    out = []
    last = None
    for row in rows:
        if row["status"] != "ok":
            continue
        key = list(group(row))
        out.append([*(key if key != last else [""] * len(key)), *cells(row)])
        last = key
    return out


def print_table(rows: Sequence[dict[str, Any]], title: str) -> None:
    """The measured results as a table (rich when installed), then skips and notes. Columns
    without a value in any measured row (memory, TFLOP/s and × floor on the CPU) are left
    out, with a note that says why, rather than shown as meaningless numbers."""
    measured = [row for row in rows if row["status"] == "ok"]
    columns = [c for c in TABLE_COLUMNS if not measured or any(c[1](row) is not None for row in measured)]
    left_out = [LEFT_OUT[c[0]] for c in TABLE_COLUMNS if c not in columns and c[0] in LEFT_OUT]

    def cells(row: dict[str, Any]) -> list[str]:
        return [format(value(row), spec) if value(row) is not None else "n/a" for _, value, spec in columns]

    cells_by_row = grouped_cells(rows, lambda row: [shape_text(row, "×")], cells)
    header = ("N × V × H", *(name for name, _, _ in columns))
    print_grid(title, header, cells_by_row, [*footnotes(rows), *left_out], left_columns=2)


def print_grid(
    title: str,
    header: Sequence[str],
    cells: Sequence[Sequence[str]],
    notes: Sequence[str] = (),
    left_columns: int = 1,
) -> None:
    """Rows of text cells under ``header`` (rich when installed, plain columns without),
    then ``notes`` line by line. A row whose first cell is not empty starts a new section
    (callers leave it empty when it repeats the row above); the first ``left_columns``
    columns are left-aligned, the numbers after them right-aligned."""
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        _print_plain_grid(title, header, cells)
        for line in notes:
            print(line)
        return
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    table = Table(title=title)
    for i, name in enumerate(header):
        table.add_column(name, no_wrap=True, justify="left" if i < left_columns else "right")
    for i, row in enumerate(cells):
        if i and row[0]:
            table.add_section()
        table.add_row(*(Text(c) for c in row))
    console.print(table)
    for line in notes:
        console.print(line, highlight=False, markup=False)


def _print_plain_grid(title: str, header: Sequence[str], cells: Sequence[Sequence[str]]) -> None:
    lines = [tuple(header)] + [tuple(row) for row in cells]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    print(title)
    for line in lines:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=False)))


# ----------------------------------------------------------------------------- plots

AXES = {"v": "vocabulary V", "n": "tokens N", "h": "hidden H"}


def _series_groups(rows: Sequence[dict[str, Any]], axis: str) -> dict[tuple, list[dict[str, Any]]]:
    """Rows grouped by the two axes other than ``axis``; only groups where ``axis`` varies."""
    others = [a for a in AXES if a != axis]
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[tuple(row[a] for a in others)].append(row)
    return {key: g for key, g in groups.items() if len({r[axis] for r in g}) > 1}


def _plot_lines(ax: Any, rows: Sequence[dict[str, Any]], axis: str, metric: str, scale: float) -> bool:
    """One line per method of ``metric`` against ``axis``; the floor dashed. False if nothing to draw."""
    drawn = False
    by_method: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if row["status"] == "ok" and row[metric] is not None:
            by_method[row["method"]].append(row)
    for method, series in by_method.items():
        series.sort(key=lambda r: r[axis])
        xs = [r[axis] for r in series]
        ys = [r[metric] / scale for r in series]
        is_floor = series[0]["floor"]
        ax.plot(xs, ys, "k--" if is_floor else "-o", label=method, markersize=3)
        drawn = True
    if drawn:
        ax.set_xticks(sorted({r[axis] for r in rows}))
        ax.tick_params(axis="x", labelrotation=30)
    return drawn


def plot_results(rows: Sequence[dict[str, Any]], out_dir: Path, title: str) -> list[Path]:
    """PNGs of time and peak extra memory against each swept axis, plus the
    chunk-size trade-off when chunk sizes were swept. Empty without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots written")
        return []
    written: list[Path] = []
    for axis, axis_label in AXES.items():
        groups = _series_groups(rows, axis)
        for key, group in groups.items():
            others = [a for a in AXES if a != axis]
            fixed = ", ".join(f"{a.upper()}={k}" for a, k in zip(others, key, strict=False))
            has_memory = any(r["peak_extra_bytes"] is not None for r in group if r["status"] == "ok")
            panels = 2 if has_memory else 1
            fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.5), squeeze=False)
            _plot_lines(axes[0][0], group, axis, "median_ms", 1.0)
            axes[0][0].set_ylabel("median time (ms)")
            if has_memory:
                _plot_lines(axes[0][1], group, axis, "peak_extra_bytes", GIB)
                axes[0][1].set_ylabel("peak extra memory (GiB)")
            for ax in axes[0]:
                ax.set_xlabel(axis_label)
                ax.grid(True, alpha=0.3)
            axes[0][-1].legend(fontsize=7)
            fig.suptitle(f"{title} ({fixed})", fontsize=9)
            fig.tight_layout()
            suffix = "" if len(groups) == 1 else "_" + "_".join(f"{a}{k}" for a, k in zip(others, key, strict=False))
            path = out_dir / f"vs_{axis}{suffix}.png"
            out_dir.mkdir(parents=True, exist_ok=True)
            fig.savefig(path, dpi=120)
            plt.close(fig)
            written.append(path)
    written.extend(_plot_chunk_tradeoff(rows, out_dir, title, plt))
    return written


def _plot_chunk_tradeoff(rows: Sequence[dict[str, Any]], out_dir: Path, title: str, plt: Any) -> list[Path]:
    """Time against peak memory (or chunk size off the GPU) for each flce backend and shape."""
    curves: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if row["status"] == "ok" and row["chunk_size"] is not None:
            base = row["method"].split("[", 1)[0]
            curves[(base, row["n"], row["v"], row["h"])].append(row)
    curves = {k: c for k, c in curves.items() if len(c) > 1}
    if not curves:
        return []
    defaults = {
        (r["method"], r["n"], r["v"], r["h"]): r
        for r in rows
        if r["status"] == "ok" and r["chunk_size"] is None and r["method"].startswith("flce:")
    }
    use_memory = all(r["peak_extra_bytes"] is not None for c in curves.values() for r in c)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (base, n, v, h), curve in curves.items():
        curve.sort(key=lambda r: r["chunk_size"])
        xs = [r["peak_extra_gib"] if use_memory else r["chunk_size"] for r in curve]
        ys = [r["median_ms"] for r in curve]
        ax.plot(xs, ys, "-o", markersize=3, label=f"{base} N={n} V={v} H={h}")
        for x, y, r in zip(xs, ys, curve, strict=False):
            ax.annotate(str(r["chunk_size"]), (x, y), fontsize=6, textcoords="offset points", xytext=(3, 3))
        auto = defaults.get((base, n, v, h))
        if auto is not None and use_memory:  # the library's own choice, as a star on the same axes
            ax.plot([auto["peak_extra_gib"]], [auto["median_ms"]], "*", color=ax.lines[-1].get_color(), markersize=9)
            ax.annotate(
                "auto",
                (auto["peak_extra_gib"], auto["median_ms"]),
                fontsize=6,
                xytext=(3, -9),
                textcoords="offset points",
            )
    ax.set_xlabel("peak extra memory (GiB)" if use_memory else "chunk size (rows)")
    ax.set_ylabel("median time (ms)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"chunk size trade-off: {title}", fontsize=9)
    fig.tight_layout()
    path = out_dir / "chunk_tradeoff.png"
    out_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


# ----------------------------------------------------------------------------- Markdown

PERF_START = "<!-- perf:start -->"
PERF_END = "<!-- perf:end -->"


def versions_text(env: dict[str, Any]) -> str:
    parts = []
    for name, version in (env.get("versions") or {}).items():
        if version is None:
            continue
        extra = f" (CUDA {env['cuda']})" if name == "torch" and env.get("cuda") else ""
        parts.append(f"{name} {version}{extra}")
    return ", ".join(parts)


def config_text(config: dict[str, Any]) -> str:
    features = ", ".join(config.get("features") or []) or "none"
    return (
        f"{MODE_TEXT.get(config['mode'], config['mode'])}, {config['dtype']}, "
        f"reduction {config['reduction']}, features: {features}; "
        f"median of {config['rounds']} interleaved rounds after {config['warmup']} warm-up"
        + (f", {config['heat_ms']:g} ms of GEMMs before each timed call" if config.get("heat_ms") else "")
        + (", each call replayed from a CUDA graph captured once" if config.get("graph") else "")
    )


def portable_command(command: str) -> str:
    """``command`` with the value of ``--out`` replaced by ``OUTDIR``: where a run wrote its
    files is no part of how to repeat it, and one machine's paths do not belong in docs."""
    words = shlex.split(command)
    for i, word in enumerate(words):
        if word == "--out" and i + 1 < len(words):
            words[i + 1] = "OUTDIR"
        elif word.startswith("--out="):
            words[i] = "--out=OUTDIR"
    return shlex.join(words)


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(payload: dict[str, Any]) -> str:
    """A Markdown section for one results JSON: a header with GPU, versions, date
    and command, then one row per shape and method; skipped methods point to a
    numbered list of reasons under the table."""
    env = payload["environment"]
    device = env.get("gpu") or f"CPU ({env.get('platform', '')})"
    lines = [
        f"**{device}** · {versions_text(env)} · {payload['date_utc']}",
        "",
        f"{config_text(payload['config'])}.  ",
        f"Command: `{portable_command(payload['command'])}`",
        "",
    ]
    # The host columns where the run measured them (CUDA, and results files that have them).
    host = any(row.get("host_ms") is not None for row in payload["results"] if row["status"] == "ok")
    loop = any(row.get("loop_ms") is not None for row in payload["results"] if row["status"] == "ok")
    header = ["N × V × H", "method", "median ms (min–max)", *(["host ms", "syncs"] if host else [])]
    header += [*(["loop ms"] if loop else []), "peak extra GiB"]
    header.append("× floor")
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|---|---|" + "---:|" * (len(header) - 2))
    reasons: dict[str, int] = {}
    last = None
    for row in payload["results"]:
        shape = shape_text(row)
        first = shape if shape != last else ""
        last = shape
        if row["status"] != "ok":
            number = reasons.setdefault(row["reason"] or "no reason given", len(reasons) + 1)
            lines.append(f"| {first} | {row['method']} | skipped ({number}) |" + " |" * (len(header) - 3))
            continue
        cells = [first, row["method"], f"{row['median_ms']:.2f} ({spread_text(row)})"]
        if host:
            cells += [fmt(row.get("host_ms"), ".2f"), fmt(row.get("host_syncs"), "d")]
        if loop:
            cells.append(fmt(row.get("loop_ms"), ".2f"))
        cells += [fmt(row["peak_extra_gib"], ".2f"), fmt(row["ratio_to_floor"], ".3f")]
        lines.append("| " + " | ".join(cells) + " |")
    if reasons:
        lines.append("")
        lines.extend(f"({number}) {_md_escape(reason)}  " for reason, number in reasons.items())
    return "\n".join(lines) + "\n"


def render_sections(payloads: Iterable[dict[str, Any]]) -> str:
    """Several results files, one section each, under one heading."""
    body = "\n".join(render_markdown(p) for p in payloads)
    intro = (
        "Peak extra memory is what one call allocates beyond its inputs (gradients included); "
        "× floor is the time over the cuBLAS GEMMs alone (6NVH fwd+bwd, 2NVH forward, 4NVH backward); "
        "host ms is the time until a call returns to Python with the GPU kept busy, syncs the "
        "synchronizing CUDA operations of one call, and loop ms the time per call of calls queued back "
        "to back, as a training loop runs them (CUDA runs).\n"
    )
    return f"## Performance\n\n{intro}\n{body}"


def replace_block(text: str, block: str) -> str:
    """``text`` with the part between the perf markers replaced by ``block``."""
    pattern = re.compile(re.escape(PERF_START) + r".*?" + re.escape(PERF_END), re.DOTALL)
    if not pattern.search(text):
        raise ValueError(f"no {PERF_START} ... {PERF_END} block found")
    return pattern.sub(lambda _: f"{PERF_START}\n{block.rstrip()}\n{PERF_END}", text, count=1)
