"""``flce bench --kernel ce`` (the CE kernel's bandwidth and the host overhead per call)
and ``benchmarks/parity_vs_liger.py`` on the CPU with tiny shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flce.cli import main
from flce.dispatch import availability

REPO = Path(__file__).resolve().parents[2]
# Odd sizes, so nothing relies on aligned rows; few rounds and calls, so it takes seconds.
TINY = [
    "bench",
    "--kernel",
    "ce",
    "--device",
    "cpu",
    "--tokens",
    "12",
    "--vocab",
    "250",
    "--rounds",
    "2",
    "--warmup",
    "1",
]


def _by_method(rows: list[dict]) -> dict[str, dict]:
    return {row["method"]: row for row in rows}


@pytest.mark.usefixtures("no_peers")
def test_kernel_bench_writes_bandwidth_and_host_overhead(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = [
        *TINY,
        "--methods",
        "flce:torch,torch:eager,liger",
        "--overhead-calls",
        "2",
        "--features",
        "label_smoothing,z_loss,softcap,weights",
        "--ignore-fraction",
        "0.25",
        "--out",
        str(tmp_path),
    ]
    monkeypatch.setattr(sys, "argv", ["flce", *argv])  # the command line the JSON records
    assert main(argv) == 0
    payload = json.loads((tmp_path / "bench-kernel-ce.json").read_text())
    assert payload["schema"] == "flce-bench-kernel/1"
    assert "bench --kernel ce --device cpu" in payload["command"] and payload["date_utc"].endswith("+00:00")
    assert payload["environment"]["versions"]["torch"] and "triton" in payload["environment"]["versions"]
    assert payload["config"]["dtypes"] == ["fp32"] and payload["config"]["shapes"] == [{"n": 12, "v": 250}]

    rows = _by_method(payload["results"])
    assert set(rows) == {
        "copy",
        "flce:torch:kernel",
        "flce:torch",
        "liger:cute:kernel",
        "liger:cute",
        "liger:triton:kernel",
        "liger:triton",
        "torch:eager",
    }
    assert rows["copy"]["pct_of_copy"] == pytest.approx(100.0)
    for name in ("flce:torch:kernel", "flce:torch", "torch:eager"):
        row = rows[name]
        assert row["status"] == "ok", row
        assert 0 < row["min_ms"] <= row["median_ms"] <= row["max_ms"] and len(row["times_ms"]) == 2
        assert row["traffic_bytes"] == 2 * 12 * 250 * 4
        assert row["gb_per_s"] == pytest.approx(row["traffic_bytes"] / row["median_ms"] / 1e6)
        assert row["pct_of_copy"] > 0
    # The raw kernel (rows reduced after timing) and both losses agree: the logits were
    # restored before each call, though the kernel overwrites them with the gradient.
    reference = rows["torch:eager"]["loss"]
    assert rows["flce:torch:kernel"]["loss"] == pytest.approx(reference, rel=1e-4)
    assert rows["flce:torch"]["loss"] == pytest.approx(reference, rel=1e-4)
    for name in ("liger:cute", "liger:triton:kernel"):
        assert rows[name]["status"] == "skipped" and "liger-kernel is not installed" in rows[name]["reason"]

    overhead = payload["host_overhead"]
    assert payload["config"]["host_overhead"]["backends"] == ["torch"]
    assert {(r["api"], r["pass"]) for r in overhead} == {
        (api, passes) for api in ("cross_entropy", "fused_linear_cross_entropy") for passes in ("fwd", "fwd+bwd")
    }
    for row in overhead:
        assert row["status"] == "ok", row
        assert row["us_per_call"] > 0 and len(row["batches_us"]) == 3 and row["calls_per_batch"] == 2
        if row["method"] == "torch:eager":
            assert row["ratio_to_eager"] == pytest.approx(1.0)

    out = capsys.readouterr().out
    assert "% of copy" in out and "µs/call" in out and "liger-kernel is not installed" in out


@pytest.mark.skipif(not availability("triton", torch.device("cpu"))[0], reason="Triton's interpreter is unavailable")
def test_in_place_triton_kernel_is_timed_on_restored_logits(tmp_path: Path) -> None:
    code = main(
        [
            *TINY,
            "--tokens",
            "4",
            "--vocab",
            "96",
            "--methods",
            "flce:triton:kernel,flce:torch",
            "--overhead-calls",
            "0",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    payload = json.loads((tmp_path / "bench-kernel-ce.json").read_text())
    rows = _by_method(payload["results"])
    assert rows["flce:triton:kernel"]["status"] == "ok" and "flce:triton" not in rows
    assert rows["flce:triton:kernel"]["loss"] == pytest.approx(rows["flce:torch"]["loss"], rel=1e-5)
    assert payload["host_overhead"] == [] and payload["config"]["host_overhead"] is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([*TINY, "--hidden", "64"], "does not take --hidden"),
        ([*TINY, "--mode", "fwd"], "does not take --mode"),
        ([*TINY, "--loss", "logprobs"], "does not take --loss"),
        ([*TINY, "--overhead-calls", "-1"], "--overhead-calls must be >= 0"),
        ([*TINY, "--methods", "nope"], "unknown method"),
        (["bench", "--device", "cpu", "--overhead-calls", "5"], "applies to --kernel ce only"),
    ],
)
def test_bad_arguments_are_clear_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_list_methods_names_the_kernel_methods(capsys: pytest.CaptureFixture) -> None:
    assert main([*TINY, "--list-methods"]) == 0
    out = capsys.readouterr().out
    for name in ("copy", "flce:cutedsl:kernel", "flce:triton", "liger:cute:kernel", "liger:triton", "torch:eager"):
        assert name in out


def test_parity_script_runs_on_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "parity_vs_liger.py"),
            str(tmp_path),
            "--quick",
            "--configs",
            "plain,all",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    payload = json.loads((tmp_path / "parity_vs_liger.json").read_text())
    assert payload["complete"] and payload["implementations"]["flce:torch"] is None
    assert payload["implementations"]["liger:triton"]  # skipped off the GPU, with the reason
    assert len(payload["cases"]) == 2 * 2 * 2  # vocabularies x dtypes x configurations
    quantities = {s["quantity"] for s in payload["summary"]}
    assert quantities == {"loss", "dX", "dW", "db"}
    for summary in payload["summary"]:
        assert summary["within_tolerance"] == summary["cases"] > 0, summary
    text = (tmp_path / "parity_vs_liger.md").read_text()
    assert "## Summary" in text and "| flce:torch | dW |" in text and "torch same dtype" in text
    # The command to repeat the run, with no path of this machine in it.
    command = "python3 benchmarks/parity_vs_liger.py OUTDIR --quick --configs plain,all"
    assert payload["command"] == command and f"Command: `{command}`" in text and str(tmp_path) not in text
