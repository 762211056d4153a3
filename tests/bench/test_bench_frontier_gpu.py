"""``flce bench --frontier`` on a CUDA device at a shape that takes seconds: what the CPU
tests cannot see (measured peaks within each budget, the ratios to the floor, the plot
with measured memory)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from flce.bench.cases import BenchCase, BenchLossSettings, Shape, make_inputs
from flce.bench.cli import bench_parser, run_bench
from flce.dispatch import availability
from flce.reference import fused_linear_cross_entropy_reference
from flce.testing import EPS, TOLERANCE_FACTOR

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = torch.device("cuda")
SHAPE = Shape(n=256, v=4096, h=128)
SMALL = ["--device", "cuda", "--tokens", "256", "--vocab", "4096", "--hidden", "128", "--rounds", "2", "--warmup", "1"]
# Row outputs, targets and the loss are left out of the peak formulas (``flce.driver.sizing``),
# and the allocator rounds each block up to 512 bytes.
UNCOUNTED_BYTES = 2**20


def test_gpu_frontier_peaks_fit_their_budgets(tmp_path: Path) -> None:
    """Every budget of the triton ladder (every budget kept: at this shape the model's fixed
    cost per chunk would leave only one chunk) runs within its budget plus the gradients,
    has a ratio to the floor, and computes the loss of the float64 reference."""
    ok, why = availability("triton", CUDA)
    if not ok:
        pytest.skip(f"triton backend: {why}")
    argv = [
        "--frontier",
        *SMALL,
        "--methods",
        "flce:triton,torch:eager",
        "--frontier-points",
        "4",
        "--frontier-max-slowdown",
        "0",
        "--out",
        str(tmp_path),
    ]
    assert run_bench(bench_parser().parse_args(argv)) == 0
    payload = json.loads((tmp_path / "bench-frontier-bf16.json").read_text())
    rows = payload["results"]
    ladder = [r for r in rows if r["backend"] == "triton"]
    assert len(ladder) >= 3 and sum(r["default_budget"] for r in ladder) == 1
    inputs = make_inputs(BenchCase(SHAPE, torch.bfloat16, "full", BenchLossSettings(), CUDA))
    x, w = inputs.x.detach(), inputs.w.detach()
    truth = float(fused_linear_cross_entropy_reference(x, w, inputs.target).loss)
    eager = float(
        fused_linear_cross_entropy_reference(x, w, inputs.target, logits_dtype=x.dtype, math_dtype=torch.float32).loss
    )
    eager_error = abs(eager - truth) / abs(truth)
    for row in rows:
        assert row["status"] == "ok", row
        assert row["ratio_to_floor"] > 0 and row["peak_extra_bytes"] > 0, row
    for row in ladder:
        gradients = row["predicted_peak_bytes"] - row["predicted_workspace_bytes"]
        assert row["peak_extra_bytes"] <= row["budget_bytes"] + gradients + UNCOUNTED_BYTES, row
        assert row["peak_extra_bytes"] <= row["predicted_peak_bytes"] + UNCOUNTED_BYTES, row
        error = abs(row["loss"] - truth) / abs(truth)
        assert error <= TOLERANCE_FACTOR * eager_error + EPS[torch.bfloat16], (row["method"], error, eager_error)
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "bench-frontier-bf16-plots" / "frontier_n256_v4096_h128.png").stat().st_size > 0
