"""``benchmarks/block_width_sweep.py``: its dry run on the CPU times every width beside the
floor and writes a run record whose command names the script as typed (CPU)."""

from __future__ import annotations

import json
import sys

from tests.bench.scripts import load_benchmark_script


def _tool():
    return load_benchmark_script("block_width_sweep")


def test_default_widths_span_the_budget_pick_down_to_two_thirds_and_sixteen_equal_blocks():
    widths = _tool().default_widths(151936)
    assert widths[0] == 9496 and 9088 in widths and 8960 in widths  # 16 blocks, the budget's pick, 128 less
    assert all(w % 128 == 0 for w in widths if w != 9496) and min(widths) > 9088 * 2 / 3
    assert widths == sorted(widths, reverse=True)


def test_dry_run_writes_one_row_per_width_and_the_command_as_typed(tmp_path, monkeypatch):
    tool = _tool()
    argv = ["block_width_sweep.py", str(tmp_path), "--device", "cpu", "--backend", "torch"]
    argv += ["--shapes", "16x300", "--hidden", "8", "--widths", "128,300", "--rounds", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    assert tool.main(argv[1:]) == 0
    record = json.loads((tmp_path / "block-width-sweep.json").read_text())
    assert record["command"].startswith("python3 benchmarks/block_width_sweep.py ")
    rows = record["results"]
    assert [(r["width"], r["blocks"]) for r in rows] == [(128, 3), (300, 1)]
    assert all(r["flce_ms"] > 0 and r["floor_ms"] > 0 and r["predicted_ms"] > 0 for r in rows)
