"""``flce bench --frontier`` on the CPU with tiny shapes: the options, the ladder of memory
budgets derived from the scheme chooser, the JSON/CSV rows of each budget (predicted and
measured), the plot, and the losses of every budget against float64."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from flce.bench import frontier
from flce.bench.cases import BenchCase, BenchLossSettings, Shape, make_inputs
from flce.bench.cli import bench_parser, run_bench
from flce.dispatch import get_backend, split_rows_of
from flce.driver.chunks import GradRequest
from flce.driver.schemes import choose_scheme, scheme_for_call, scheme_frontier, scheme_of_call
from flce.driver.sizing import MEMORY_BUDGET_ENV_VAR, Memory
from flce.options import LossOptions
from flce.reference import fused_linear_cross_entropy_reference
from flce.testing import EPS, TOLERANCE_FACTOR

CPU = torch.device("cpu")
# bf16 at this shape: the ladder holds vocabulary blocks and token chunks (off the GPU no
# budget is left out for its predicted slowdown), and its cheapest budget runs in 0.1 s.
SHAPE = Shape(n=16, v=300, h=32)
TINY = ["--device", "cpu", "--dtype", "bf16", "--tokens", "16", "--vocab", "300", "--hidden", "32"]
RUN = [*TINY, "--rounds", "1", "--warmup", "0", "--frontier-points", "3"]


def _case(dtype: torch.dtype = torch.bfloat16, shape: Shape = SHAPE) -> BenchCase:
    return BenchCase(shape, dtype, "full", BenchLossSettings(), CPU)


def _scheme_key(scheme) -> tuple[int, int | None]:
    return scheme.rows, scheme.block


# ------------------------------------------------------------------ options


def test_frontier_options_parse() -> None:
    args = bench_parser().parse_args(["--frontier", "--frontier-points", "4", "--frontier-max-slowdown", "2.5"])
    assert args.frontier and args.frontier_points == 4 and args.frontier_max_slowdown == 2.5
    defaults = bench_parser().parse_args([])
    assert not defaults.frontier and defaults.frontier_points == frontier.DEFAULT_POINTS
    assert defaults.frontier_max_slowdown is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--chunk-size", "8"], "--chunk-size (the budget sizes the chunks)"),
        (["--mode", "fwd"], "--mode (the frontier is of fwd+bwd"),
        (["--graph"], "--graph"),
        (["--loss", "logprobs"], "--loss"),
        (["--frontier-points", "1"], "--frontier-points must be >= 2"),
        (["--frontier-max-slowdown", "0.5"], "--frontier-max-slowdown must be >= 1"),
        (["--methods", "nonesuch"], "unknown method(s) ['nonesuch']"),
    ],
)
def test_frontier_refuses_what_it_does_not_take(extra: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert run_bench(bench_parser().parse_args(["--frontier", *TINY, *extra])) == 2
    assert message in capsys.readouterr().err


def test_methods_pick_the_ladders_and_the_peers() -> None:
    backends, peers = frontier._selection(None, CPU)
    assert backends == ("torch",) and [m.name for m in peers] == list(frontier.DEFAULT_PEERS["cpu"])
    backends, peers = frontier._selection(["flce:triton", "flce:torch", "torch:eager", "flce:torch[vblocks=16]"], CPU)
    assert backends == ("triton", "torch")
    assert [m.name for m in peers] == ["flce:torch[vblocks=16]", "torch:eager"]
    backends, peers = frontier._selection(["flce"], CPU)
    assert backends == ("torch",) and peers == ()


# ------------------------------------------------------------------ the ladder


def test_spread_along_keeps_both_ends_and_at_most_count() -> None:
    schemes = [
        frontier.Scheme(rows=1, block=None, memory=Memory(peak=w, workspace=w), seconds=100.0 / w) for w in range(1, 40)
    ]
    for count in (2, 3, 7):
        picked = frontier.spread_along(schemes, count)
        assert picked[0] is schemes[0] and picked[-1] is schemes[-1]
        assert 2 <= len(picked) <= count
        workspaces = [s.memory.workspace for s in picked]
        assert workspaces == sorted(set(workspaces))
    assert frontier.spread_along(schemes[:3], 6) == schemes[:3]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_ladder_is_the_choosers_frontier(dtype: torch.dtype) -> None:
    """The default first, with the scheme and budget the driver uses; then rungs whose budgets
    are workspaces of ``scheme_frontier``'s points (both ends among them), each running what
    ``choose_scheme`` picks for it, cheaper in workspace and slower as the budget falls."""
    case = _case(dtype)
    call = frontier.call_shape(case, "torch")
    points = frontier.budget_points(case, "torch", points=4, max_slowdown=None)
    default, rungs = points[0], points[1:]
    options = LossOptions(backend="torch")
    assert default.is_default and default.source == frontier.DEFAULT_RULE
    assert _scheme_key(default.scheme) == _scheme_key(scheme_for_call(call, options, CPU))
    whole = scheme_frontier(call, max_slowdown=None)
    assert len(whole) > 4  # the ladder is a subset
    workspaces = [s.memory.workspace for s in whole]
    assert 2 <= len(rungs) <= 4
    assert rungs[0].budget == workspaces[0]
    for rung in rungs:
        assert not rung.is_default and rung.source == "memory_budget"
        assert rung.budget in workspaces
        assert rung.scheme == choose_scheme(call, rung.budget)
        assert rung.scheme.memory.workspace <= rung.budget
        assert _scheme_key(rung.scheme) != _scheme_key(default.scheme)
    assert [r.budget for r in rungs] == sorted({r.budget for r in rungs})
    seconds = [r.scheme.seconds for r in rungs]
    assert seconds == sorted(seconds, reverse=True)
    if dtype == torch.bfloat16:
        assert {r.scheme.name(SHAPE.n) for r in rungs} >= {"vocabulary blocks", "token chunks"}


def test_the_stand_in_call_is_the_drivers_call() -> None:
    """The ladder's ``CallShape`` (built from one-element stand-ins) is the one the driver
    builds from real tensors: a call given each rung's budget runs the predicted scheme."""
    case = _case()
    inputs = make_inputs(case)
    spec = get_backend("torch")
    request = GradRequest(input=True, weight=True)
    for point in frontier.budget_points(case, "torch", points=4, max_slowdown=None):
        options = LossOptions(backend="torch", memory_budget=None if point.is_default else point.budget)
        real = scheme_of_call(inputs.x, inputs.w, None, request, options, torch.bfloat16, spec, split_rows_of(spec))
        assert real == point.scheme, point


def test_the_default_point_follows_the_budget_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MEMORY_BUDGET_ENV_VAR, "0.1")
    (default, *_) = frontier.budget_points(_case(), "torch", points=3, max_slowdown=None)
    assert default.source == MEMORY_BUDGET_ENV_VAR and default.budget == int(0.1 * 2**20)
    assert default.scheme.memory.workspace <= default.budget


def test_list_methods_prints_the_ladder_and_runs_nothing(capsys: pytest.CaptureFixture) -> None:
    args = bench_parser().parse_args(["--frontier", *TINY, "--frontier-points", "3", "--list-methods"])
    assert run_bench(args) == 0
    out = capsys.readouterr().out
    assert "flce:torch (default)" in out and "flce:torch@" in out and "torch:eager" in out
    assert "the default rule" in out and "memory_budget" in out and "median" not in out


# ------------------------------------------------------------------ a run


def _loss_errors(loss: float, case: BenchCase) -> tuple[float, float]:
    """Relative errors against float64 of ``loss`` and of eager PyTorch's in the case's dtype."""
    inputs = make_inputs(case)
    x, w = inputs.x.detach(), inputs.w.detach()
    truth = float(fused_linear_cross_entropy_reference(x, w, inputs.target).loss)
    eager = float(
        fused_linear_cross_entropy_reference(x, w, inputs.target, logits_dtype=x.dtype, math_dtype=torch.float32).loss
    )
    return abs(loss - truth) / abs(truth), abs(eager - truth) / abs(truth)


def test_cpu_run_writes_points_csv_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Every budget of the ladder measured, with its predicted and measured numbers, in the
    JSON and the CSV; every budget's loss right against float64; a plot per shape."""
    assert run_bench(bench_parser().parse_args(["--frontier", *RUN, "--out", str(tmp_path)])) == 0
    payload = json.loads((tmp_path / "bench-frontier-bf16.json").read_text())
    assert payload["config"]["frontier"] is True and payload["config"]["backends"] == ["torch"]
    rows = payload["results"]
    flce_rows = [r for r in rows if r["backend"] == "torch"]
    assert [r["method"] for r in rows] == payload["config"]["methods"]["16x300x32"]
    assert rows[0]["method"] == "floor:gemm" and rows[-1]["method"] == "torch:eager"
    (default,) = [r for r in flce_rows if r["default_budget"]]
    assert default["method"] == "flce:torch" and default["budget_source"] == frontier.DEFAULT_RULE
    rungs = [r for r in flce_rows if not r["default_budget"]]
    assert 2 <= len(rungs) <= 3
    for row in flce_rows:
        assert row["status"] == "ok", row
        assert (
            row["method"] == "flce:torch" or row["method"] == f"flce:torch@{frontier.budget_text(row['budget_bytes'])}"
        )
        assert row["predicted_workspace_bytes"] <= row["budget_bytes"] < row["predicted_peak_bytes"] + 2**30
        assert row["predicted_peak_gib"] == pytest.approx(row["predicted_peak_bytes"] / 2**30)
        assert row["predicted_ms"] > 0 and row["predicted_ratio_to_floor"] > 1
        # Off the GPU: no measured peak or ratio, and the host side is the plain bench's.
        assert row["peak_extra_bytes"] is None and row["ratio_to_floor"] is None and row["median_ms"] > 0
        assert row["host_reason"] == frontier.HOST_NOT_MEASURED
        ours, eager = _loss_errors(row["loss"], _case())
        assert ours <= TOLERANCE_FACTOR * eager + EPS[torch.bfloat16], (row["method"], ours, eager)
    for row in rows:
        if row["backend"] is None:
            assert row["predicted_ms"] is None and row["budget_bytes"] is None
    with (tmp_path / "bench-frontier-bf16.csv").open() as f:
        csv_rows = list(csv.DictReader(f))
    assert [r["method"] for r in csv_rows] == [r["method"] for r in rows]
    assert set(frontier.FRONTIER_FIELDS) <= set(csv_rows[0])
    assert {r["scheme"] for r in csv_rows if r["backend"]} >= {"one chunk"}
    out = capsys.readouterr().out
    assert "pred. × floor" in out and "flce:torch (default)" in out
    plot = tmp_path / "bench-frontier-bf16-plots" / "frontier_n16_v300_h32.png"
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed: no plot to check")
    assert plot.stat().st_size > 0


def test_no_plots_writes_no_png(tmp_path: Path) -> None:
    argv = ["--frontier", *RUN, "--frontier-points", "2", "--no-plots", "--out", str(tmp_path)]
    assert run_bench(bench_parser().parse_args(argv)) == 0
    assert not list(tmp_path.rglob("*.png")) and (tmp_path / "bench-frontier-bf16.json").exists()


def test_the_scheme_cell_names_the_blocks_inside_dw() -> None:
    """The table's few words say which blocks hold their workspace inside dW (the JSON's
    ``scheme_text`` says it in full)."""
    row = {"scheme": "vocabulary blocks", "rows_per_chunk": 64, "vocab_block": 512, "n": 64}
    assert frontier.scheme_cell({**row, "weight_grad_tail_start": None}) == "512-column blocks"
    assert frontier.scheme_cell({**row, "weight_grad_tail_start": 2048}) == "512-column blocks, inside dW"
    assert frontier.scheme_cell({**row, "rows_per_chunk": 32, "weight_grad_tail_start": None}) == (
        "512-column blocks, 32-row chunks"
    )
