"""``flce bench`` end to end on the CPU with tiny shapes: the JSON/CSV outputs,
skip reasons for missing peers, and the README renderer reading the JSON."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from flce.bench.cli import CPU_DEFAULT, bench_parser, run_bench
from flce.bench.runner import HOST_CUDA_ONLY
from tests.bench.scripts import load_benchmark_script

REPO = Path(__file__).resolve().parents[2]
# Tiny but not trivial: V and H are not powers of two, so no path relies on
# aligned sizes; two token counts give a swept axis for the plots.
TINY = ["--device", "cpu", "--vocab", "500", "--hidden", "48", "--rounds", "2", "--warmup", "1"]


def _rows(payload: dict, method: str) -> list[dict]:
    return [r for r in payload["results"] if r["method"] == method]


@pytest.mark.usefixtures("no_peers")
def test_cpu_run_writes_json_csv_and_skips_missing_peer(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = bench_parser().parse_args(
        [*TINY, "--tokens", "40,64", "--methods", "flce:torch,torch:eager,liger:triton", "--out", str(tmp_path)]
    )
    assert run_bench(args) == 0
    (json_path,) = tmp_path.glob("*.json")
    (csv_path,) = tmp_path.glob("*.csv")
    payload = json.loads(json_path.read_text())

    assert payload["environment"]["versions"]["torch"]
    assert payload["date_utc"].endswith("+00:00")
    assert payload["config"]["mode"] == "full" and payload["config"]["dtype"] == "fp32"
    assert [s["n"] for s in payload["config"]["shapes"]] == [40, 64]
    for method in ("floor:gemm", "flce:torch", "torch:eager"):
        rows = _rows(payload, method)
        assert len(rows) == 2, method
        for row in rows:
            assert row["status"] == "ok", row
            assert 0 < row["min_ms"] <= row["median_ms"] <= row["max_ms"]
            # Off the GPU the GEMMs are no floor: neither TFLOP/s nor a ratio is recorded.
            assert row["tflops"] is None and row["ratio_to_floor"] is None
            assert row["peak_extra_bytes"] is None  # not tracked off CUDA
            # The host side of a call is measured on CUDA only, and the row says so.
            assert row["host_ms"] is None and row["host_syncs"] is None and row["host_reason"] == HOST_CUDA_ONLY
    assert payload["config"]["host"] == HOST_CUDA_ONLY and payload["config"]["graph"] is False
    # Both losses are the same function of the same inputs.
    for flce_row, eager_row in zip(_rows(payload, "flce:torch"), _rows(payload, "torch:eager"), strict=False):
        assert flce_row["loss"] == pytest.approx(eager_row["loss"], rel=1e-4)
    for row in _rows(payload, "liger:triton"):
        assert row["status"] == "skipped" and "liger-kernel is not installed" in row["reason"]

    with csv_path.open() as f:
        csv_rows = list(csv.DictReader(f))
    assert {r["method"] for r in csv_rows} == {"floor:gemm", "flce:torch", "torch:eager", "liger:triton"}
    measured_csv = [r for r in csv_rows if r["status"] == "ok"]
    assert all(r["host_ms"] == r["host_syncs"] == "" and r["host_reason"] == HOST_CUDA_ONLY for r in measured_csv)
    assert all(float(r["median_ms"]) > 0 for r in csv_rows if r["method"] == "flce:torch")

    out = capsys.readouterr().out
    assert "flce:torch" in out and "liger-kernel is not installed" in out
    assert "results not saved" not in out and f"wrote {json_path}" in out
    if importlib.util.find_spec("matplotlib") is not None:
        assert list(tmp_path.glob("*-plots/vs_n.png"))


def test_cpu_table_leaves_out_what_means_nothing_there(capsys: pytest.CaptureFixture) -> None:
    """On the CPU: no TFLOP/s, × floor or memory column (they were 0.0, below 1 and n/a),
    no host time or syncs column (CUDA only), a note saying why for each, and how to save
    the results when ``--out`` is not given."""
    args = bench_parser().parse_args([*TINY, "--tokens", "32", "--methods", "flce:torch"])
    assert run_bench(args) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "median ms" in line)
    for column in ("TFLOP/s", "× floor", "peak extra GiB", "host ms", "syncs"):
        assert column not in header, column
    assert "TFLOP/s and × floor are left out off the GPU" in out
    assert "syncs (synchronizing CUDA operations per call) are measured on CUDA devices only" in out
    assert "peak extra memory is tracked on CUDA devices only" in out
    assert "results not saved: add --out DIR" in out


def test_one_shape_with_out_leaves_no_empty_plots_folder(tmp_path: Path) -> None:
    """One shape has no swept axis, so there is no plot: no ``*-plots`` folder either."""
    args = bench_parser().parse_args([*TINY, "--tokens", "32", "--methods", "flce:torch", "--out", str(tmp_path)])
    assert run_bench(args) == 0
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".csv", ".json"]


def test_each_flce_row_names_the_scheme_it_ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The results say which scheme each flce method ran (a default that changes scheme is
    a change of speed and memory: a bias once sent the reference shape to vocabulary
    blocks); the floor and the peers say nothing."""
    from flce.driver import schemes

    monkeypatch.delenv("FLCE_MEMORY_BUDGET_MIB", raising=False)
    monkeypatch.delenv("FLCE_CHUNK_BUDGET_MIB", raising=False)
    ran = []
    original = schemes.scheme_for_call

    def record(call, options, device):  # what the calls themselves chose
        scheme = original(call, options, device)
        ran.append(scheme.describe(call.n_rows))
        return scheme

    monkeypatch.setattr(schemes, "scheme_for_call", record)
    methods = "flce:torch,flce:torch[vblocks=16],torch:eager"
    args = bench_parser().parse_args(
        [*TINY, "--tokens", "40", "--features", "bias", "--methods", methods, "--chunk-size", "auto,16"]
        + ["--out", str(tmp_path), "--no-plots"]
    )
    assert run_bench(args) == 0
    payload = json.loads(next(tmp_path.glob("*.json")).read_text())
    scheme = {r["method"]: r["scheme_text"] for r in payload["results"]}
    assert scheme["flce:torch"] == "one chunk of 40 rows"
    assert scheme["flce:torch[chunk=16]"] == "token chunks of 16 rows"
    assert scheme["flce:torch[vblocks=16]"] == "vocabulary blocks of 32 columns, 40 rows per chunk"
    assert scheme["floor:gemm"] is None and scheme["torch:eager"] is None
    flce_schemes = {s for m, s in scheme.items() if m.startswith("flce:")}
    assert flce_schemes <= set(ran)  # the description is what the driver ran
    with next(tmp_path.glob("*.csv")).open() as f:
        assert {r["method"]: r["scheme_text"] for r in csv.DictReader(f)}["flce:torch"] == "one chunk of 40 rows"


@pytest.mark.parametrize("mode", ["fwd", "bwd"])
def test_cpu_modes_and_features(tmp_path: Path, mode: str) -> None:
    args = bench_parser().parse_args(
        [
            *TINY,
            "--tokens",
            "32",
            "--mode",
            mode,
            "--features",
            "label_smoothing,z_loss,softcap,weights",
            "--methods",
            "flce:torch,torch:eager,torch:lce,cce",
            "--out",
            str(tmp_path),
            "--no-plots",
        ]
    )
    assert run_bench(args) == 0
    payload = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert payload["config"]["features"] == ["label_smoothing", "z_loss", "softcap", "weights"]
    assert {r["method"] for r in payload["results"] if r["status"] == "ok"} >= {
        "floor:gemm",
        "flce:torch",
        "torch:eager",
    }
    lce = _rows(payload, "torch:lce")[0]
    assert lce["status"] == "skipped" and lce["reason"]
    cce = _rows(payload, "cce")[0]
    assert cce["status"] == "skipped" and cce["reason"]


def test_unknown_method_is_an_argument_error(capsys: pytest.CaptureFixture) -> None:
    assert run_bench(bench_parser().parse_args([*TINY, "--tokens", "32", "--methods", "nope"])) == 2
    assert "unknown method" in capsys.readouterr().err


def _readme_script():
    return load_benchmark_script("make_readme_perf")


@pytest.mark.usefixtures("no_peers")
def test_readme_script_renders_and_replaces_block(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    argv = [*TINY, "--tokens", "32", "--methods", "flce:torch,torch:eager,liger", "--out", str(out), "--no-plots"]
    monkeypatch.setattr(sys, "argv", ["flce", "bench", *argv])  # the command the JSON records
    assert run_bench(bench_parser().parse_args(argv)) == 0
    results = next(out.glob("*.json"))
    script = _readme_script()
    capsys.readouterr()

    assert script.main([str(results)]) == 0
    markdown = capsys.readouterr().out
    assert "| N × V × H | method | median ms (min–max) | peak extra GiB | × floor |" in markdown
    assert "| 32 × 500 × 48 | floor:gemm |" in markdown
    assert "| flce:torch |" in markdown and "| torch:eager |" in markdown
    assert "torch " in markdown and "Command: `" in markdown
    # The output folder is no part of the command to repeat (nor a machine path in the docs).
    assert "--out OUTDIR" in markdown and str(out) not in markdown
    assert "liger-kernel is not installed" in markdown

    readme = tmp_path / "README.md"
    readme.write_text("# flce\n\n<!-- perf:start -->\nstale\n<!-- perf:end -->\n\nafter\n")
    assert script.main([str(results), "--write", str(readme)]) == 0
    text = readme.read_text()
    assert "stale" not in text and "| flce:torch |" in text
    assert text.startswith("# flce\n\n<!-- perf:start -->\n## Performance") and text.endswith(
        "<!-- perf:end -->\n\nafter\n"
    )

    readme.write_text("# no markers\n")
    assert script.main([str(results), "--write", str(readme)]) == 1


def test_tensor_parallel_bench_runs_over_gloo(tmp_path):
    """``flce bench --tp 2`` on CPU: two gloo processes, parity with the single-process loss."""
    import json

    from flce.cli import main

    code = main(
        [
            "bench",
            "--tp",
            "2",
            "--device",
            "cpu",
            "--tokens",
            "48",
            "--vocab",
            "301",
            "--hidden",
            "16",
            "--dtype",
            "fp32",
            "--rounds",
            "2",
            "--warmup",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    result = json.loads((tmp_path / "bench-tp2-fp32.json").read_text())
    assert result["parity"]["passed"] and result["config"]["world_size"] == 2
    assert [r["rank"] for r in result["per_rank"]] == [0, 1]
    assert result["single_gpu"]["fwd_bwd"]["median_ms"] > 0


def test_tensor_parallel_bench_skips_without_enough_gpus(monkeypatch, capsys):
    """``--tp WORLD`` with fewer GPUs than WORLD is a skip with the reason (exit code 0), so
    a validation script can ask for every world size on any machine."""
    import torch

    from flce.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["bench", "--tp", "64", "--device", "cuda"]) == 0
    assert "skipped: 1 CUDA device(s) here, 64 needed" in capsys.readouterr().out


@pytest.mark.parametrize("mode", [[], ["--frontier"], ["--kernel", "ce"], ["--loss", "logprobs"]])
def test_out_naming_an_existing_file_is_an_argument_error(
    tmp_path: Path, capsys: pytest.CaptureFixture, mode: list[str]
) -> None:
    """``--out`` names a directory: an existing file there is refused before anything runs,
    not a FileExistsError traceback after the whole benchmark."""
    a_file = tmp_path / "results.json"
    a_file.write_text("kept")
    with pytest.raises(SystemExit) as exited:
        bench_parser().parse_args([*mode, "--device", "cpu", "--out", str(a_file)])
    assert exited.value.code == 2
    assert "--out" in capsys.readouterr().err and a_file.read_text() == "kept"


@pytest.mark.parametrize("mode", [[], ["--kernel", "ce"], ["--loss", "logprobs"]])
def test_methods_naming_nothing_is_an_argument_error(capsys: pytest.CaptureFixture, mode: list[str]) -> None:
    """``--methods ''`` (an unset shell variable) would time the floor alone and exit 1."""
    for empty in ("", ","):
        with pytest.raises(SystemExit) as exited:
            bench_parser().parse_args([*mode, *TINY, "--tokens", "8", "--methods", empty])
        assert exited.value.code == 2 and "argument --methods" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-5", "nan"])
def test_negative_heat_is_an_argument_error(capsys: pytest.CaptureFixture, value: str) -> None:
    """A negative (or NaN) --heat-ms would silently turn the heat-up off on a GPU and be
    recorded as given in the results."""
    assert run_bench(bench_parser().parse_args([*TINY, "--tokens", "8", "--heat-ms", value])) == 2
    assert "--heat-ms" in capsys.readouterr().err


def test_repeated_list_values_run_once() -> None:
    """``--tokens 8,8`` or ``--chunk-size 7,7,auto,default`` would time (and write rows
    for) the same case twice under one name."""
    args = bench_parser().parse_args([*TINY, "--tokens", "8,8,16", "--chunk-size", "7,7,auto,default"])
    assert args.tokens == (8, 16) and args.chunk_size == (7, None)


def _tp_child_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, extra: list[str]) -> list[str]:
    import subprocess

    launched: list[list[str]] = []
    monkeypatch.setattr(
        subprocess, "run", lambda argv, check: launched.append(argv) or subprocess.CompletedProcess(argv, 0)
    )
    argv = ["--tp", "2", "--device", "cpu", "--out", str(tmp_path), *extra]
    assert run_bench(bench_parser().parse_args(argv)) == 0
    return launched[0]


def test_tensor_parallel_forwards_the_loss_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """--features, --ignore-fraction, --seed and --chunk-size reach the processes (they were
    dropped: the run measured a different loss than asked, with nothing said)."""
    child = _tp_child_command(
        monkeypatch,
        tmp_path,
        ["--features", "label_smoothing,z_loss,softcap", "--ignore-fraction", "0", "--seed", "7", "--chunk-size", "64"],
    )
    joined = " ".join(child)
    for expected in (
        "--label-smoothing 0.1",
        "--lse-square-scale 0.0001",
        "--softcap 30.0",
        "--ignore-fraction 0.0",
        "--seed 7",
        "--chunk-size 64",
    ):
        assert expected in joined, (expected, joined)
    assert "--ignore-fraction" not in " ".join(_tp_child_command(monkeypatch, tmp_path, []))  # its own 0.05


def test_tensor_parallel_on_the_cpu_runs_the_small_cpu_case(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without a GPU ``flce bench`` runs a small case; ``--tp`` ran the reference shape (an
    fp32 2 GiB weight on every rank, minutes of CPU GEMMs). Shapes given win."""
    joined = " ".join(_tp_child_command(monkeypatch, tmp_path, []))
    tokens, vocab, hidden = (values[0] for values in CPU_DEFAULT)
    assert f"--tokens {tokens} --vocab {vocab} --hidden {hidden}" in joined, joined
    joined = " ".join(_tp_child_command(monkeypatch, tmp_path, ["--tokens", "48", "--vocab", "301"]))
    assert f"--tokens 48 --vocab 301 --hidden {hidden}" in joined, joined


def test_tensor_parallel_without_out_writes_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys) -> None:
    """As every other run without ``--out``: the results are printed, no file is left in the
    working directory (``--tp`` wrote bench-tp2-fp32.json there)."""
    import subprocess

    launched: list[list[str]] = []
    monkeypatch.setattr(
        subprocess, "run", lambda argv, check: launched.append(argv) or subprocess.CompletedProcess(argv, 0)
    )
    monkeypatch.chdir(tmp_path)
    assert run_bench(bench_parser().parse_args(["--tp", "2", "--device", "cpu"])) == 0
    out_file = Path(launched[0][launched[0].index("--out") + 1])
    assert not out_file.is_relative_to(tmp_path) and not out_file.parent.exists(), out_file
    assert list(tmp_path.iterdir()) == []
    assert "results not saved: add --out DIR" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra",
    [
        ["--tokens", "8,16"],
        ["--chunk-size", "8,auto"],
        ["--features", "weights"],
        ["--reduction", "sum"],
        ["--mode", "fwd"],
        ["--methods", "flce:torch"],
        ["--sweep", "vocab"],
        ["--rounds", "0"],
        ["--warmup", "-1"],
        ["--ignore-fraction", "1.5"],
        ["--loss", "logprobs"],
        ["--list-methods"],
    ],
)
def test_tensor_parallel_refuses_what_it_would_drop(capsys: pytest.CaptureFixture, extra: list[str]) -> None:
    assert run_bench(bench_parser().parse_args(["--tp", "2", "--device", "cpu", *extra])) == 2
    assert extra[0] in capsys.readouterr().err
