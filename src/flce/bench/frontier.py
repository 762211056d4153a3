"""``flce bench --frontier``: the time/memory trade-off of the fused loss, per shape.

flce's driver picks the scheme of a call (one chunk, token chunks, vocabulary blocks) from a
memory budget, predicting each scheme's peak and time (``flce.driver.schemes``). For each
shape this runs the fused fwd+bwd under a ladder of budgets, each one method of the ordinary
runner (``flce:<backend>@<budget>``), timed interleaved with the peers and the floor:

- the budgets at which the chooser's scheme changes (``scheme_frontier``: the least
  workspace up to one chunk's, each point predicted faster than the one before), at most
  ``points`` of them, spread along the predicted curve (``spread_along``);
- the default: the call without ``memory_budget`` (the default rule, or
  ``FLCE_MEMORY_BUDGET_MIB`` when set); a ladder point that would run the default's scheme
  is left to it.

Each flce row records its budget, the scheme chosen, and the predicted peak and time beside
the measured ones (``FRONTIER_FIELDS``); a plot per shape draws the measured frontier, the
predicted points, the peers as labelled markers and the default. The predictions are the
cost model's, whose constants are H200 bf16 measurements, on every device.

Off the GPU (tiny shapes) the times are host work and CPU kernels, not GPU numbers, and peak
memory is not tracked: the table leaves those columns empty with the reason, and the plot
puts flce's points at their predicted peak and says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flce.bench import report
from flce.bench.cases import BenchCase, Shape, dtype_name
from flce.bench.methods import Method, floor_method, select_methods
from flce.bench.peers.flce_backends import (
    flce_budget_method,
    flce_call_shape,
    flce_loss_options,
    flce_methods,
)
from flce.bench.registry import all_methods
from flce.bench.runner import BenchConfig, Result
from flce.dispatch import BACKEND_NAMES, availability, resolve_backend
from flce.driver.schemes import (
    GEMM_FLOPS_PER_SECOND,
    Scheme,
    call_budget,
    choose_scheme,
    scheme_for_call,
    scheme_frontier,
)
from flce.driver.sizing import CHUNK_BUDGET_ENV_VAR, CallShape, legacy_chunk_budget_bytes

MIB = 2**20
# Budgets of the ladder per backend and shape (besides the default): enough to draw the
# curve, few enough that the reference shape and V = 32000 run in about two minutes.
DEFAULT_POINTS = 6
# The peers drawn beside flce's frontier: those of the performance targets on a GPU; off it
# the one that runs everywhere.
DEFAULT_PEERS = {"cuda": ("liger:triton", "liger:cute-sm90", "cce"), "cpu": ("torch:eager",)}
# Ladder points predicted more than this many times slower than the fastest are left out on
# a GPU, as ``scheme_frontier`` does. Off it every point is kept: at the tiny CPU shapes the
# model's fixed cost per chunk dwarfs the GEMMs, and only one chunk would be left.
GPU_MAX_SLOWDOWN = 3.0
# Off the GPU without --tokens/--vocab/--hidden/--sweep: smaller than the plain bench's CPU
# case, since the ladder's cheapest budget runs one row per chunk (about half a minute here).
CPU_DEFAULT_SHAPE = Shape(n=64, v=1000, h=64)
DEFAULT_RULE = "the default rule"
HOST_NOT_MEASURED = "host syncs and host time are not measured by --frontier (flce bench without it measures them)"
# What each flce row adds to the bench's row (and CSV columns); None on the other rows.
FRONTIER_FIELDS = (
    "backend",
    "default_budget",
    "budget_bytes",
    "budget_source",
    "scheme",
    "scheme_text",
    "rows_per_chunk",
    "vocab_block",
    "weight_grad_tail_start",
    "predicted_workspace_bytes",
    "predicted_peak_bytes",
    "predicted_peak_gib",
    "predicted_ms",
    "predicted_ratio_to_floor",
)
CSV_FIELDS = (*report.CSV_FIELDS, *(f for f in FRONTIER_FIELDS if f not in report.CSV_FIELDS))
# Options of ``flce bench`` that mean nothing for the frontier, and why.
REFUSED = (
    ("--kernel", lambda a: a.kernel is not None, "the frontier is of the fused loss"),
    ("--tp", lambda a: a.tp is not None, "the frontier is of the single-device loss"),
    ("--loss", lambda a: a.loss != "ce", "the memory budget picks the cross-entropy's scheme"),
    ("--mode", lambda a: a.mode != "full", "the frontier is of fwd+bwd, where the schemes differ"),
    ("--chunk-size", lambda a: a.chunk_size is not None, "the budget sizes the chunks"),
    ("--graph", lambda a: a.graph, "the ladder is timed as plain calls"),
    ("--overhead-calls", lambda a: a.overhead_calls is not None, "it applies to --kernel ce"),
)


@dataclass(frozen=True, kw_only=True)
class FrontierConfig(BenchConfig):
    """``flce bench``'s configuration, with the backends whose ladder runs, the ladder's
    size and the peers. The host side of a call is left to the plain bench."""

    backends: tuple[str, ...]
    peers: tuple[Method, ...]
    points: int = DEFAULT_POINTS
    max_slowdown: float | None = GPU_MAX_SLOWDOWN

    @property
    def measures_host(self) -> bool:
        return False

    @property
    def host_not_measured(self) -> str:
        return HOST_NOT_MEASURED


@dataclass(frozen=True)
class BudgetPoint:
    """One rung of a backend's ladder at one shape: the budget, who set it, and the scheme
    the chooser runs under it with its predicted memory and time."""

    backend: str
    budget: int  # bytes of workspace
    source: str  # "memory_budget" (a rung of the ladder), the default rule or the variable that set it
    is_default: bool  # the call without memory_budget
    scheme: Scheme
    call: CallShape

    @property
    def method(self) -> Method:
        if self.is_default:
            return next(m for m in flce_methods() if m.name == f"flce:{self.backend}")
        return flce_budget_method(self.backend, self.budget, budget_text(self.budget))

    def predicted_floor_seconds(self) -> float:
        """The model's time of the floor: the three GEMMs (6NVH) at its GEMM rate."""
        return Shape(self.call.n_rows, self.call.vocab, self.call.hidden).flops("full") / GEMM_FLOPS_PER_SECOND

    def record(self) -> dict[str, Any]:
        """The ``FRONTIER_FIELDS`` of this point's row."""
        memory, n = self.scheme.memory, self.call.n_rows
        return {
            "backend": self.backend,
            "default_budget": self.is_default,
            "budget_bytes": self.budget,
            "budget_source": self.source,
            "scheme": self.scheme.name(n),
            "scheme_text": self.scheme.describe(n),
            "rows_per_chunk": self.scheme.rows,
            "vocab_block": self.scheme.block,
            "weight_grad_tail_start": self.scheme.weight_grad_tail_start,
            "predicted_workspace_bytes": memory.workspace,
            "predicted_peak_bytes": memory.peak,
            "predicted_peak_gib": memory.peak / report.GIB,
            "predicted_ms": self.scheme.seconds * 1e3,
            "predicted_ratio_to_floor": self.scheme.seconds / self.predicted_floor_seconds(),
        }


@dataclass(frozen=True)
class ShapePlan:
    """What runs at one shape: the methods in table order, and the budget point of each flce one."""

    shape: Shape
    methods: tuple[Method, ...]
    points: dict[str, BudgetPoint]  # method name -> its point


# ------------------------------------------------------------------ the ladder


def budget_text(budget: int) -> str:
    """A budget as the method names spell it: MiB to four significant digits."""
    return f"{budget / MIB:.4g}MiB"


def call_shape(case: BenchCase, backend: str) -> CallShape:
    """The ``CallShape`` the driver sees for ``case`` on ``backend`` (fwd+bwd: the
    frontier's mode)."""
    return flce_call_shape(case, backend)


def _scaled(values: Sequence[float]) -> list[float]:
    low, high = min(values), max(values)
    return [(v - low) / (high - low) if high > low else 0.0 for v in values]


def spread_along(schemes: Sequence[Scheme], count: int) -> list[Scheme]:
    """At most ``count`` of ``schemes`` (a frontier, ordered by workspace): both ends, and
    those nearest to even steps along the curve of log workspace against log time, each
    axis scaled to its range, so that neither a run of near-equal block widths nor a long
    flat stretch takes all the points."""
    if len(schemes) <= count:
        return list(schemes)
    xs = _scaled([math.log(max(s.memory.workspace, 1)) for s in schemes])
    ys = _scaled([math.log(s.seconds) for s in schemes])
    along = [0.0]
    for i in range(1, len(schemes)):
        along.append(along[-1] + math.hypot(xs[i] - xs[i - 1], ys[i] - ys[i - 1]))
    steps = [along[-1] * k / (count - 1) for k in range(count)]
    picked = {min(range(len(schemes)), key=lambda j, step=step: abs(along[j] - step)) for step in steps}
    return [schemes[j] for j in sorted(picked)]


def _default_source(source: str | None) -> str:
    if source is not None:
        return source
    return CHUNK_BUDGET_ENV_VAR if legacy_chunk_budget_bytes() is not None else DEFAULT_RULE


def budget_points(
    case: BenchCase, backend: str, points: int, max_slowdown: float | None = GPU_MAX_SLOWDOWN
) -> list[BudgetPoint]:
    """The default first, then the ladder's rungs by budget (module docstring)."""
    call = call_shape(case, backend)
    options = flce_loss_options(case, backend)
    budget, source = call_budget(call, options, case.device)
    default = scheme_for_call(call, options, case.device)
    ladder = [BudgetPoint(backend, budget, _default_source(source), True, default, call)]
    for scheme in spread_along(scheme_frontier(call, max_slowdown=max_slowdown), points):
        if (scheme.rows, scheme.block) == (default.rows, default.block):
            continue  # the default call runs it
        rung = scheme.memory.workspace
        ladder.append(BudgetPoint(backend, rung, "memory_budget", False, choose_scheme(call, rung), call))
    return ladder


def plan_shape(config: FrontierConfig, shape: Shape) -> ShapePlan:
    """The floor, each backend's default and ladder (just the default where the backend
    cannot run here: the runner skips it with the reason), then the peers."""
    case = config.case(shape)
    methods: list[Method] = [floor_method()]
    points: dict[str, BudgetPoint] = {}
    for backend in config.backends:
        usable, _ = availability(backend, config.device)
        if not usable:
            methods.append(next(m for m in flce_methods() if m.name == f"flce:{backend}"))
            continue
        for point in budget_points(case, backend, config.points, config.max_slowdown):
            method = point.method
            if method.name in points:
                continue  # two rungs within 0.01% of each other: the first stands for both
            methods.append(method)
            points[method.name] = point
    methods.extend(config.peers)
    return ShapePlan(shape, tuple(methods), points)


# ------------------------------------------------------------------ the command line


def add_frontier_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "the time/memory frontier (--frontier)",
        "For each shape, flce's fused fwd+bwd under a ladder of memory budgets (those at which the "
        "scheme chosen changes, and the default), interleaved with the peers and the floor: time over "
        "the floor and peak memory, predicted and measured, per budget; a plot per shape with --out. "
        f"Off the GPU the default shape is N={CPU_DEFAULT_SHAPE.n}, V={CPU_DEFAULT_SHAPE.v}, "
        f"H={CPU_DEFAULT_SHAPE.h}. --methods picks the backends whose ladder runs (flce:<backend>; default "
        f"the one auto dispatch picks) and the peers (default {', '.join(DEFAULT_PEERS['cuda'])} on a GPU, "
        f"{', '.join(DEFAULT_PEERS['cpu'])} on the CPU). --list-methods lists each shape's ladder with "
        "its predictions and runs nothing.",
    )
    g.add_argument("--frontier", action="store_true", help="run the time/memory frontier of the memory budget")
    g.add_argument(
        "--frontier-points",
        type=int,
        default=DEFAULT_POINTS,
        help=f"budgets of the ladder per backend and shape besides the default (default {DEFAULT_POINTS}, at least 2)",
    )
    g.add_argument(
        "--frontier-max-slowdown",
        type=float,
        help=f"leave out budgets predicted more than this many times slower than the fastest (default "
        f"{GPU_MAX_SLOWDOWN:g} on a GPU; every budget on the CPU, and with 0)",
    )


def frontier_conflicts(args: argparse.Namespace) -> list[str]:
    """The options given with ``--frontier`` that it does not take, each with why."""
    return [f"{flag} ({why})" for flag, given, why in REFUSED if given(args)]


def _selection(wanted: Sequence[str] | None, device: torch.device) -> tuple[tuple[str, ...], tuple[Method, ...]]:
    """(backends whose ladder runs, peers) of ``--methods``: ``flce:<backend>`` names a
    ladder, the family ``flce`` the auto backend's, anything else a peer (the floor always
    runs)."""
    ladders = {f"flce:{b}": b for b in BACKEND_NAMES}
    if wanted is None:
        backends: tuple[str, ...] = ()
        peer_names: Sequence[str] = DEFAULT_PEERS["cuda" if device.type == "cuda" else "cpu"]
    else:
        backends = tuple(dict.fromkeys(ladders[w] for w in wanted if w in ladders))
        peer_names = [w for w in wanted if w not in ladders and w != "flce"]
    if not backends:
        backends = (resolve_backend(None, device).name,)
    peers = tuple(m for m in select_methods(all_methods(), peer_names) if not m.is_floor)
    return backends, peers


def resolve_frontier_config(args: argparse.Namespace, base: BenchConfig) -> FrontierConfig:
    """``base`` (``flce bench``'s configuration) with the frontier's settings; ValueError on
    options the frontier does not take."""
    refused = frontier_conflicts(args)
    if refused:
        raise ValueError(f"--frontier does not take {'; '.join(refused)}")
    if args.frontier_points < 2:
        raise ValueError(f"--frontier-points must be >= 2 (both ends of the ladder), got {args.frontier_points}")
    slowdown = args.frontier_max_slowdown
    if slowdown is None:
        slowdown = GPU_MAX_SLOWDOWN if base.device.type == "cuda" else 0.0
    if slowdown != 0.0 and not slowdown >= 1.0:
        raise ValueError(f"--frontier-max-slowdown must be >= 1 (or 0: keep every budget), got {slowdown}")
    backends, peers = _selection(args.methods, base.device)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    shapes_given = any(value is not None for value in (args.sweep, args.tokens, args.vocab, args.hidden))
    if base.device.type != "cuda" and not shapes_given:
        fields["shapes"] = (CPU_DEFAULT_SHAPE,)
    return FrontierConfig(
        **fields,
        backends=backends,
        peers=peers,
        points=args.frontier_points,
        max_slowdown=slowdown or None,
    )


def config_record(config: FrontierConfig, plans: Sequence[ShapePlan]) -> dict[str, Any]:
    """The ``config`` of the results JSON."""
    return {
        "frontier": True,
        "mode": config.mode,
        "dtype": dtype_name(config.dtype),
        "shapes": [{"n": s.n, "v": s.v, "h": s.h} for s in config.shapes],
        "loss_options": config.loss.record(),
        **config.record(),
        "backends": list(config.backends),
        "points": config.points,
        "max_slowdown": config.max_slowdown,
        "methods": {f"{p.shape.n}x{p.shape.v}x{p.shape.h}": [m.name for m in p.methods] for p in plans},
        "ladder": "the budgets at which the scheme chosen changes (flce.driver.schemes.scheme_frontier), spread "
        "along the predicted curve, and the default (no memory_budget given)",
        "predicted": "flce.driver.schemes' cost model: its constants are H200 bf16 measurements, on every device",
        "host": HOST_NOT_MEASURED,
    }


# ------------------------------------------------------------------ rows and table


def frontier_rows(results: Sequence[Result], plans: Sequence[ShapePlan]) -> list[dict[str, Any]]:
    """The bench's rows with ``FRONTIER_FIELDS`` (None on the floor and the peers)."""
    points = {(p.shape, name): point for p in plans for name, point in p.points.items()}
    rows = []
    for result in results:
        point = points.get((result.shape, result.method))
        extra = point.record() if point is not None else dict.fromkeys(FRONTIER_FIELDS)
        rows.append({**report.result_row(result), **extra})
    return rows


TABLE_HEADER = (
    "N × V × H",
    "method",
    "scheme",
    "pred. peak GiB",
    "peak GiB",
    "pred. × floor",
    "× floor",
    "median ms",
)


def _gib_text(gib: float | None, missing: str = "n/a") -> str:
    """GiB to three decimals, or three significant digits below 0.01 (the tiny CPU shapes)."""
    return report.fmt(gib, ".3f" if gib is None or gib >= 0.01 else ".3g", missing)


def scheme_cell(record: dict[str, Any]) -> str:
    """A row's scheme in a few words (the JSON's ``scheme_text`` says it in full)."""
    if record["scheme"] is None:
        return ""
    rows, block, n_rows = record["rows_per_chunk"], record["vocab_block"], record["n"]
    chunks = f"{rows}-row chunks" if rows < n_rows else ""
    if block is not None:
        inside = ", inside dW" if record.get("weight_grad_tail_start") is not None else ""
        return f"{block}-column blocks" + (f", {chunks}" if chunks else "") + inside
    return chunks or "one chunk"


def table_cells(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    def cells(row: dict[str, Any]) -> list[str]:
        return [
            row["method"] + (" (default)" if row["default_budget"] else ""),
            scheme_cell(row),
            _gib_text(row["predicted_peak_gib"], ""),
            _gib_text(row["peak_extra_gib"]),
            report.fmt(row["predicted_ratio_to_floor"], ".3f", ""),
            report.fmt(row["ratio_to_floor"], ".3f"),
            report.fmt(row["median_ms"], ".3f"),
        ]

    return report.grouped_cells(rows, lambda row: [report.shape_text(row, "×")], cells)


def table_notes(rows: Sequence[dict[str, Any]]) -> list[str]:
    notes = report.footnotes(rows)
    measured = [r for r in rows if r["status"] == "ok"]
    if measured and all(r["peak_extra_bytes"] is None for r in measured):
        notes.append(report.LEFT_OUT["peak extra GiB"])
    if measured and all(r["ratio_to_floor"] is None for r in measured):
        notes.append(report.LEFT_OUT["TFLOP/s"])
    notes.append("pred.: flce.driver.schemes' cost model (H200 bf16 constants), peak extra memory gradients included")
    return notes


def print_frontier(rows: Sequence[dict[str, Any]], title: str) -> None:
    report.print_grid(title, TABLE_HEADER, table_cells(rows), table_notes(rows), left_columns=3)


def print_ladder(plans: Sequence[ShapePlan], title: str) -> None:
    """Each shape's methods with their budgets and predictions (``--list-methods``)."""
    cells = []
    for plan in plans:
        first = True
        for method in plan.methods:
            point = plan.points.get(method.name)
            shape = f"{plan.shape.n}×{plan.shape.v}×{plan.shape.h}" if first else ""
            first = False
            if point is None:
                cells.append([shape, method.name, method.label, "", "", ""])
                continue
            record = point.record()
            cells.append(
                [
                    shape,
                    method.name + (" (default)" if point.is_default else ""),
                    scheme_cell({**record, "n": plan.shape.n}),
                    f"{budget_text(point.budget)} ({point.source})",
                    _gib_text(record["predicted_peak_gib"]),
                    f"{record['predicted_ratio_to_floor']:.3f}",
                ]
            )
    header = ("N × V × H", "method", "scheme", "budget", "pred. peak GiB", "pred. × floor")
    report.print_grid(title, header, cells, left_columns=3)


# ------------------------------------------------------------------ plots


def _time_over_floor(row: dict[str, Any], floor: dict[str, Any] | None) -> float | None:
    """The row's time over the floor's: the runner's ratio on a GPU, else the medians'."""
    if row["status"] != "ok":
        return None
    if row["ratio_to_floor"] is not None:
        return row["ratio_to_floor"]
    if floor is None or floor["status"] != "ok":
        return None
    return row["median_ms"] / floor["median_ms"]


PEER_MARKERS = ("s", "D", "^", "v", "P", "X", "h", "<", ">")


def _memory_unit(rows: Sequence[dict[str, Any]]) -> tuple[str, int]:
    """GiB, or MiB where every peak of the plot is below one GiB (the tiny CPU shapes)."""
    peaks = [r[k] for r in rows for k in ("peak_extra_bytes", "predicted_peak_bytes") if r.get(k) is not None]
    return ("GiB", report.GIB) if peaks and max(peaks) >= report.GIB else ("MiB", MIB)


def _plot_shape(ax: Any, rows: Sequence[dict[str, Any]], unit: int) -> bool:
    """One shape's frontier on ``ax``, memory in ``unit`` bytes; whether flce's peaks were
    measured (else predicted)."""
    floor = next((r for r in rows if r["floor"]), None)
    measured_peaks = all(r["peak_extra_bytes"] is not None for r in rows if r["status"] == "ok")
    by_backend: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if row["backend"] is not None:
            by_backend[row["backend"]].append(row)
    for backend, points in by_backend.items():
        points.sort(key=lambda r: r["predicted_workspace_bytes"])
        ran = [r for r in points if _time_over_floor(r, floor) is not None]
        xs = [(r["peak_extra_bytes"] if measured_peaks else r["predicted_peak_bytes"]) / unit for r in ran]
        ys = [_time_over_floor(r, floor) for r in ran]
        (line,) = ax.plot(xs, ys, "-o", markersize=4, label=f"flce {backend}: measured")
        color = line.get_color()
        ax.plot(
            [r["predicted_peak_bytes"] / unit for r in points],
            [r["predicted_ratio_to_floor"] for r in points],
            "x:",
            color=color,
            alpha=0.6,
            label=f"flce {backend}: predicted",
        )
        for x, y, row in zip(xs, ys, ran, strict=True):
            text = "default" if row["default_budget"] else row["method"].split("@", 1)[1]
            ax.annotate(text, (x, y), fontsize=6, textcoords="offset points", xytext=(4, 3))
            if row["default_budget"]:
                ax.plot([x], [y], "*", color=color, markersize=14, markerfacecolor="none")
    peers = [r for r in rows if r["backend"] is None and r["status"] == "ok"]
    for marker, row in zip(PEER_MARKERS * 2, peers, strict=False):
        y = _time_over_floor(row, floor)
        if y is None:
            continue
        if row["peak_extra_bytes"] is None:  # no measured peak off CUDA: the peer's time alone
            ax.axhline(y, linestyle="--", linewidth=0.8, color="gray")
            ax.annotate(
                row["method"],
                (0, y),
                xycoords=("axes fraction", "data"),
                fontsize=7,
                xytext=(3, 2),
                textcoords="offset points",
            )
            continue
        x = row["peak_extra_bytes"] / unit
        ax.plot([x], [y], "ks" if row["floor"] else marker, markersize=7, label=row["method"])
        ax.annotate(row["method"], (x, y), fontsize=7, textcoords="offset points", xytext=(4, -9))
    return measured_peaks


def plot_frontier(rows: Sequence[dict[str, Any]], out_dir: Path, title: str) -> list[Path]:
    """One PNG per shape (``frontier_n<N>_v<V>_h<H>.png``): time over the floor against peak
    extra memory. Empty without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots written")
        return []
    shapes: dict[tuple[int, int, int], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        shapes[(row["n"], row["v"], row["h"])].append(row)
    written = []
    for (n, v, h), group in shapes.items():
        if not any(r["backend"] is not None for r in group):
            continue
        fig, ax = plt.subplots(figsize=(8, 5))
        unit_name, unit = _memory_unit(group)
        measured_peaks = _plot_shape(ax, group, unit)
        ratios = [r["predicted_ratio_to_floor"] for r in group if r["predicted_ratio_to_floor"] is not None]
        if ratios and max(ratios) / min(ratios) > 5:
            ax.set_yscale("log")
        ax.set_xlabel(
            f"peak extra memory ({unit_name}, gradients included)"
            if measured_peaks
            else f"peak extra memory ({unit_name}): flce's predicted (memory is tracked on CUDA only)"
        )
        ax.set_ylabel("time / the floor's time (three GEMMs)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        where = "" if measured_peaks else "\nCPU run: times of host work and CPU kernels, not GPU numbers"
        ax.set_title(f"{title}\nN={n} V={v} H={h}: time/memory frontier of the memory budget{where}", fontsize=8)
        fig.tight_layout()
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"frontier_n{n}_v{v}_h{h}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
