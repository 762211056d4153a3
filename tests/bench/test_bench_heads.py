"""``flce bench --loss logprobs|distill`` end to end on the CPU with tiny shapes: the
JSON payload, flce's value equal to eager PyTorch's, skip reasons, refused options."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from flce.bench.cases import BenchCase, BenchLossSettings, make_inputs
from flce.bench.cli import bench_parser, run_bench
from flce.bench.graph import NotCapturable
from flce.bench.heads import DistillShape, head_methods

TINY = ["--device", "cpu", "--tokens", "24", "--vocab", "301", "--hidden", "40", "--rounds", "1", "--warmup", "0"]


@pytest.mark.usefixtures("no_peers")
@pytest.mark.parametrize("loss", ["logprobs", "distill"])
def test_cpu_run_writes_json_and_matches_eager(loss, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    methods = "flce:torch,flce:cutedsl,torch:eager" + (",liger:jsd" if loss == "distill" else "")
    args = bench_parser().parse_args([*TINY, "--loss", loss, "--methods", methods, "--out", str(tmp_path)])
    assert run_bench(args) == 0
    payload = json.loads((tmp_path / f"bench-{loss}-full-fp32.json").read_text())
    assert payload["config"]["loss"] == loss and payload["config"]["shapes"] == [{"n": 24, "v": 301, "h": 40}]
    rows = {r["method"]: r for r in payload["results"]}
    assert rows["floor:gemm"]["status"] == rows["flce:torch"]["status"] == rows["torch:eager"]["status"] == "ok"
    # The same objective of the same inputs.
    assert rows["flce:torch"]["loss"] == pytest.approx(rows["torch:eager"]["loss"], rel=1e-4, abs=1e-5)
    assert rows["flce:cutedsl"]["status"] == "skipped"
    if loss == "distill":
        assert "liger-kernel is not installed" in rows["liger:jsd"]["reason"]
    assert f"--loss {loss}" in capsys.readouterr().out


@pytest.mark.parametrize("extra", [["--features", "softcap"], ["--reduction", "sum"], ["--chunk-size", "8"]])
def test_cross_entropy_options_are_refused(extra, capsys: pytest.CaptureFixture) -> None:
    args = bench_parser().parse_args([*TINY, "--loss", "logprobs", *extra])
    assert run_bench(args) == 2
    assert "--loss logprobs does not take" in capsys.readouterr().err


def test_list_methods_names_the_heads_methods(capsys: pytest.CaptureFixture) -> None:
    assert run_bench(bench_parser().parse_args(["--device", "cpu", "--loss", "distill", "--list-methods"])) == 0
    out = capsys.readouterr().out
    assert "liger:jsd" in out and "floor:gemm" in out and "flce:triton" in out


def test_distillation_floor_counts_both_logits_gemms() -> None:
    shape = DistillShape(8, 10, 4)
    assert shape.flops("full") == 8 * 8 * 10 * 4 and shape.flops("fwd") == 4 * 8 * 10 * 4


@pytest.mark.parametrize("loss", ["logprobs", "distill"])
@pytest.mark.parametrize("mode", ["fwd", "full"])
def test_graph_captures_the_heads_floor_as_its_methods(loss: str, mode: str) -> None:
    """With ``--graph`` every method is a replay of a captured call: the floor too, or the
    ratios to it would set replays against plain calls. Off CUDA the capture refuses."""
    floor = head_methods(loss)[0]
    case = BenchCase(DistillShape(8, 30, 12), torch.float32, mode, BenchLossSettings(), torch.device("cpu"))
    inputs = make_inputs(case)
    with pytest.raises(NotCapturable, match="CUDA graphs need a CUDA device"):
        floor.workload(replace(case, graph=True), inputs)
    # What the graph captures is the plain floor's work: both logits GEMMs for distill's forward.
    captured = floor.graph_step(case, inputs)()
    plain = floor.workload(case, inputs).run(None)
    assert len(captured) == 1
    torch.testing.assert_close(captured[0], plain)


@pytest.mark.parametrize("loss", ["logprobs", "distill"])
def test_graph_off_cuda_is_a_skip(loss: str, capsys: pytest.CaptureFixture) -> None:
    assert run_bench(bench_parser().parse_args([*TINY, "--loss", loss, "--graph"])) == 0
    assert "skipped: CUDA graphs need a CUDA device" in capsys.readouterr().out
