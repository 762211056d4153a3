"""``flce bench`` and the profile script on a CUDA device, at shapes that take seconds: what
the CPU tests cannot see (the floor's ratios and TFLOP/s, peak memory, CUDA-only peers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flce.bench.cli import bench_parser, run_bench

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--device", "cuda", "--tokens", "256", "--vocab", "4096", "--hidden", "128", "--rounds", "2", "--warmup", "1"]


def test_gpu_run_records_ratio_tflops_and_memory(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """On a GPU the floor is one: every measured row has TFLOP/s, a ratio to the floor and
    its peak memory, and the table shows those columns."""
    args = bench_parser().parse_args([*SMALL, "--methods", "flce:torch,torch:eager", "--out", str(tmp_path)])
    assert run_bench(args) == 0
    payload = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert payload["config"]["dtype"] == "bf16" and payload["config"]["heat_ms"] > 0
    rows = {row["method"]: row for row in payload["results"]}
    for method in ("floor:gemm", "flce:torch", "torch:eager"):
        row = rows[method]
        assert row["status"] == "ok", row
        assert row["tflops"] > 0 and row["ratio_to_floor"] > 0 and row["peak_extra_bytes"] > 0, row
    assert rows["floor:gemm"]["ratio_to_floor"] == 1.0
    header = next(line for line in capsys.readouterr().out.splitlines() if "median ms" in line)
    for column in ("peak extra GiB", "TFLOP/s", "× floor"):
        assert column in header, column


def test_profile_breakdown_script(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "profile_breakdown.py"),
            str(tmp_path),
            "--n",
            "256",
            "--v",
            "4096",
            "--h",
            "128",
            "--methods",
            "floor:gemm,flce:torch",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    profile = json.loads((tmp_path / "profile.json").read_text())
    for method in ("floor:gemm", "flce:torch"):
        row = profile["methods"][method]
        assert row["kernel_ms_total"] > 0 and row["groups_ms"]["gemm"] > 0, row
