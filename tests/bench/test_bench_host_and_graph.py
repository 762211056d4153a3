"""``flce bench``'s host measurement (syncs and host time per call) and ``--graph`` mode,
on the CPU: the options parse and clash where they should, the graph mode skips with its
reason off CUDA, sync warnings are counted (and only they), and the host figures reach the
rows, the notes and the README Markdown. The measurements themselves need CUDA:
``test_bench_gpu.py``."""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from flce.bench import runner
from flce.bench.cases import BenchCase, BenchLossSettings, Shape, make_inputs
from flce.bench.cli import bench_parser, run_bench
from flce.bench.graph import NotCapturable
from flce.bench.methods import floor_method
from flce.bench.report import render_markdown, result_row
from flce.bench.runner import BenchConfig, Running, measure_host, skip_reason
from flce.bench.timing import SYNC_WARNING, Workload, count_host_syncs

TINY = ["--device", "cpu", "--tokens", "32", "--vocab", "500", "--hidden", "48", "--rounds", "1", "--warmup", "0"]
SHAPE = Shape(n=32, v=500, h=48)


def test_graph_option_parses_and_clashes_with_what_it_cannot_capture(capsys: pytest.CaptureFixture) -> None:
    assert bench_parser().parse_args(TINY).graph is False
    assert bench_parser().parse_args([*TINY, "--graph"]).graph is True
    for argv, message in (
        ([*TINY, "--graph", "--mode", "bwd"], "--graph captures --mode fwd or full, not --mode bwd"),
        (["--device", "cpu", "--kernel", "ce", "--graph"], "--kernel ce does not take --graph"),
        ([*TINY, "--graph", "--tp", "2"], "--graph applies to the single-device fused loss, not --tp"),
    ):
        assert run_bench(bench_parser().parse_args(argv)) == 2, argv
        assert message in capsys.readouterr().err, argv


def test_graph_mode_skips_off_cuda_with_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A skip (exit code 0, so a script may ask for it anywhere) that writes nothing."""
    args = bench_parser().parse_args([*TINY, "--graph", "--out", str(tmp_path)])
    assert run_bench(args) == 0
    assert "flce bench --graph: skipped: CUDA graphs need a CUDA device" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


def test_graph_workload_off_cuda_is_a_skip_reason() -> None:
    """Below the command line too: a method's graph workload on the CPU raises, and the
    sweep's skip reason is the error's text as is."""
    case = BenchCase(SHAPE, torch.float32, "full", BenchLossSettings(), torch.device("cpu"), graph=True)
    with pytest.raises(NotCapturable) as caught:
        floor_method().workload(case, make_inputs(case))
    assert skip_reason(caught.value) == "CUDA graphs need a CUDA device, not cpu"


@pytest.fixture
def sync_debug_mode(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """PyTorch's sync debug mode as a list of the modes set (the CPU build has none)."""
    modes: list[object] = [0]
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: modes[-1])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    return modes


def test_count_host_syncs_counts_sync_warnings_only(sync_debug_mode: list[object]) -> None:
    def run(_: object) -> None:
        assert sync_debug_mode[-1] == "warn"
        warnings.warn(SYNC_WARNING, UserWarning, stacklevel=1)
        warnings.warn(SYNC_WARNING, UserWarning, stacklevel=1)  # the same line again: counted again
        warnings.warn("something else", UserWarning, stacklevel=1)

    assert count_host_syncs(Workload(setup=lambda: None, run=run), torch.device("cpu")) == 2
    assert sync_debug_mode[-1] == 0  # restored

    def failing(_: object) -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        count_host_syncs(Workload(setup=lambda: None, run=failing), torch.device("cpu"))
    assert sync_debug_mode[-1] == 0


def _fake_cuda_config() -> BenchConfig:
    """A configuration that says CUDA; nothing is allocated on it (the measurements are faked)."""
    return BenchConfig(
        loss=BenchLossSettings(),
        rounds=1,
        warmup=0,
        device=torch.device("cuda"),
        mode="full",
        dtype=torch.bfloat16,
        shapes=(SHAPE,),
    )


def test_measure_host_fills_runs_and_keeps_the_timing_when_it_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bookkeeping of the host measurement, with the CUDA measurements faked: syncs and
    host times reach the run, a call that outlasted the spin becomes a note, and a failure
    of the host measurement is the run's ``host_reason`` (the method stays measured)."""
    waited = iter([True, False, True, False, False])
    monkeypatch.setattr(runner, "GpuBusy", lambda device: None)
    monkeypatch.setattr(runner, "free_memory", lambda device: None)
    monkeypatch.setattr(runner, "wall_time_once", lambda workload, device: 1.0)
    monkeypatch.setattr(runner, "host_time_once", lambda workload, device, busy, ms: (ms / 10, next(waited)))
    loop_batches: list[int] = []
    monkeypatch.setattr(runner, "back_to_back_ms", lambda workload, device, calls: loop_batches.append(calls) or 0.5)

    def count(workload: Workload, device: torch.device) -> int:
        if workload.run is failing_run:
            raise RuntimeError("sync debug mode unavailable\nsecond line")
        return 1

    def failing_run(_: object) -> None:
        return None

    monkeypatch.setattr(runner, "count_host_syncs", count)
    method = floor_method()
    good = Running(method, Workload(setup=lambda: None, run=lambda _: None), times_ms=[2.0])
    broken = Running(method, Workload(setup=lambda: None, run=failing_run), times_ms=[2.0])
    ticks: list[int] = []
    config = _fake_cuda_config()
    measure_host(config, "case", [good, broken], lambda n, what: ticks.append(n))

    assert sum(ticks) == config.steps_per_case(2) - runner.SweepSettings.steps_per_case(config, 2)
    assert good.host_syncs == 1 and good.host_reason is None
    assert good.host_times_ms == [runner.MIN_BUSY_MS / 10] * runner.HOST_CALLS  # the spin is at least MIN_BUSY_MS
    assert good.notes == [
        f"the GPU had run out of queued work before the call returned in 2 of {runner.HOST_CALLS} host-timed "
        f"calls ({runner.MIN_BUSY_MS:.0f} ms of spin queued before each): the call waits for the GPU"
    ]
    # A 1 ms call: batches of 20 calls (LOOP_BATCH_MS), for the good run only.
    assert loop_batches == [round(runner.LOOP_BATCH_MS)] * runner.LOOP_BATCHES
    assert good.loop_times_ms == [0.5] * runner.LOOP_BATCHES
    assert broken.host_syncs is None and broken.host_times_ms == [] and broken.failure is None
    assert broken.loop_times_ms == []
    assert broken.host_reason == "error: RuntimeError: sync debug mode unavailable"
    assert broken.notes == [f"host syncs and host time not measured: {broken.host_reason}"]


def test_loop_time_is_measured_where_setup_does_no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """The back-to-back batches time each call's setup too: the bwd mode (whose setup runs
    the forward) has no loop time; a batch holds enough calls for LOOP_BATCH_MS, at most
    LOOP_MAX_CALLS."""
    monkeypatch.setattr(runner, "GpuBusy", lambda device: None)
    monkeypatch.setattr(runner, "wall_time_once", lambda workload, device: 4.0)
    monkeypatch.setattr(runner, "host_time_once", lambda workload, device, busy, ms: (0.1, False))
    monkeypatch.setattr(runner, "count_host_syncs", lambda workload, device: 0)
    monkeypatch.setattr(runner, "back_to_back_ms", lambda workload, device, calls: float(calls))
    for mode, expected in (("full", [5.0] * runner.LOOP_BATCHES), ("fwd", [5.0] * runner.LOOP_BATCHES), ("bwd", [])):
        run = Running(floor_method(), Workload(setup=lambda: None, run=lambda _: None), times_ms=[4.0])
        config = replace(_fake_cuda_config(), mode=mode)
        measure_host(config, "case", [run], lambda n, what: None)
        assert run.loop_times_ms == expected, mode
    assert runner.loop_calls(0.001) == runner.LOOP_MAX_CALLS
    assert runner.loop_calls(1000.0) == 1


def test_markdown_shows_the_host_columns_when_the_run_has_them() -> None:
    rows = [
        result_row(
            runner.Result(
                "flce:triton",
                "flce triton",
                SHAPE,
                timing=runner.TimingStats.from_times([2.0, 3.0, 4.0]),
                host_syncs=0,
                host_timing=runner.TimingStats.from_times([0.25, 0.5, 0.75]),
                loop_timing=runner.TimingStats.from_times([1.5, 1.25, 2.0]),
            )
        ),
        result_row(runner.Result("cce", "Apple CCE", SHAPE, reason="needs a CUDA device")),
    ]
    payload = {
        "environment": {"gpu": "GPU", "versions": {}},
        "date_utc": "2026-12-01T00:00:00+00:00",
        "command": "flce bench --graph",
        "config": {"mode": "full", "dtype": "bf16", "reduction": "mean", "rounds": 3, "warmup": 1, "graph": True},
        "results": rows,
    }
    markdown = render_markdown(payload)
    assert "each call replayed from a CUDA graph captured once" in markdown
    header = "| N × V × H | method | median ms (min–max) | host ms | syncs | loop ms | peak extra GiB | × floor |"
    assert header in markdown
    assert "|---|---|---:|---:|---:|---:|---:|---:|" in markdown
    assert "| 32 × 500 × 48 | flce:triton | 3.00 (2–4) | 0.50 | 0 | 1.50 | n/a | n/a |" in markdown
    assert "|  | cce | skipped (1) | | | | | |" in markdown


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_loss_is_noted(value):
    """A method whose loss is NaN or infinite keeps its timing, with a note saying the
    result is wrong (the loss was only in the JSON and CSV, as a bare NaN)."""
    run = Running(floor_method(), Workload(setup=lambda: None, run=lambda _: torch.tensor(value)))
    runner._probe(run)
    assert run.notes == [f"the loss is {value}: this method's result is wrong at this case"]
    finite = Running(floor_method(), Workload(setup=lambda: None, run=lambda _: torch.tensor(2.5)))
    runner._probe(finite)
    assert finite.loss == 2.5 and finite.notes == []
