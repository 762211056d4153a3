"""``flce bench`` and the profile script on a CUDA device, at shapes that take seconds: what
the CPU tests cannot see (the floor's ratios and TFLOP/s, peak memory, CUDA-only peers, the
host syncs and host time per call, ``--graph``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flce.bench import runner
from flce.bench.cases import BenchCase, BenchLossSettings, Shape, make_inputs
from flce.bench.cli import bench_parser, run_bench
from flce.bench.graph import NotCapturable, capture
from flce.bench.registry import all_methods
from flce.bench.timing import GpuBusy, Workload, call_once, count_host_syncs, host_time_once
from flce.dispatch import availability
from flce.reference import fused_linear_cross_entropy_reference
from flce.testing import EPS, TOLERANCE_FACTOR

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--device", "cuda", "--tokens", "256", "--vocab", "4096", "--hidden", "128", "--rounds", "2", "--warmup", "1"]
SMALL_SHAPE = Shape(n=256, v=4096, h=128)
CUDA = torch.device("cuda")


def _needs_triton() -> None:
    ok, why = availability("triton", CUDA)
    if not ok:
        pytest.skip(f"triton backend: {why}")


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
        for traced in row["traced_calls"]:
            assert 0 < traced["kernel_span_ms"] <= traced["call_ms"], traced


def test_gpu_run_records_host_syncs_and_host_time(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """On a GPU every measured row has its host syncs, host time and back-to-back time per
    call, and the table shows them.
    PyTorch's ops and flce's default call make no host sync (issue 18's target), so the
    spin queued before each host-timed call outlasts every call."""
    _needs_triton()
    args = bench_parser().parse_args([*SMALL, "--methods", "flce:triton,torch:eager", "--out", str(tmp_path)])
    assert run_bench(args) == 0
    payload = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert isinstance(payload["config"]["host"], dict)
    rows = {row["method"]: row for row in payload["results"]}
    for method in ("floor:gemm", "flce:triton", "torch:eager"):
        row = rows[method]
        assert row["status"] == "ok" and row["host_reason"] is None, row
        assert row["host_syncs"] == 0, row
        assert row["host_ms"] > 0 and len(row["host_times_ms"]) == runner.HOST_CALLS, row
        assert row["loop_ms"] > 0 and len(row["loop_times_ms"]) == runner.LOOP_BATCHES, row
        assert not any("run out of queued work" in note for note in row["notes"]), row
    header = next(line for line in capsys.readouterr().out.splitlines() if "median ms" in line)
    for column in ("host ms", "syncs", "loop ms"):
        assert column in header, column


def test_a_sync_is_counted_and_makes_the_host_wait() -> None:
    """The measurements see a sync where there is one, in the forward and in a backward
    (run on autograd's device thread), and only there."""
    x = torch.randn(1024, 1024, device=CUDA)
    leaf = x.clone().requires_grad_(True)

    class SyncingBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            grad.sum().item()
            return grad

    def backward_with_sync(_):
        SyncingBackward.apply(leaf).sum().backward()
        leaf.grad = None

    syncing = Workload(setup=lambda: None, run=lambda _: (x @ x).sum().item())
    not_syncing = Workload(setup=lambda: None, run=lambda _: (x @ x).sum())
    syncing_backward = Workload(setup=lambda: None, run=backward_with_sync)
    for workload in (syncing, not_syncing, syncing_backward):
        call_once(workload)  # cuBLAS and the kernels loaded outside the measurement
    assert count_host_syncs(syncing, CUDA) == 1
    assert count_host_syncs(syncing_backward, CUDA) == 1
    assert count_host_syncs(not_syncing, CUDA) == 0

    busy, spin_ms = GpuBusy(CUDA), 50.0
    waited_ms, waited = host_time_once(syncing, CUDA, busy, spin_ms)
    assert waited and waited_ms > spin_ms / 2
    free_ms, waited = host_time_once(not_syncing, CUDA, busy, spin_ms)
    assert not waited and free_ms < spin_ms / 2


def _loss_errors(loss: float, inputs) -> tuple[float, float]:
    """Relative errors against float64 of ``loss`` and of eager PyTorch's loss in the inputs' dtype."""
    x, w = inputs.x.detach(), inputs.w.detach()
    truth = float(fused_linear_cross_entropy_reference(x, w, inputs.target).loss)
    eager = float(
        fused_linear_cross_entropy_reference(x, w, inputs.target, logits_dtype=x.dtype, math_dtype=torch.float32).loss
    )
    return abs(loss - truth) / abs(truth), abs(eager - truth) / abs(truth)


def test_graph_mode_replays_flce_triton(tmp_path: Path) -> None:
    """``--graph``: each method captured and replayed; the loss a replay leaves in the graph's
    output (nothing runs during the capture itself) is right against float64, the memory
    is taken at capture, and a replay makes no host sync."""
    _needs_triton()
    argv = [*SMALL, "--graph", "--methods", "flce:triton,torch:eager", "--out", str(tmp_path)]
    assert run_bench(bench_parser().parse_args(argv)) == 0
    payload = json.loads((tmp_path / "bench-full-bf16-graph.json").read_text())
    assert payload["config"]["graph"] is True
    rows = {row["method"]: row for row in payload["results"]}
    for method in ("floor:gemm", "flce:triton", "torch:eager"):
        row = rows[method]
        assert row["status"] == "ok", row
        assert row["median_ms"] > 0 and row["peak_extra_bytes"] > 0 and row["host_syncs"] == 0, row
    case = BenchCase(SMALL_SHAPE, torch.bfloat16, "full", BenchLossSettings(), CUDA)
    ours, eager = _loss_errors(rows["flce:triton"]["loss"], make_inputs(case, seed=0))
    assert ours <= TOLERANCE_FACTOR * eager + EPS[torch.bfloat16], (ours, eager)


def test_graph_workload_replays_new_inputs_copied_into_its_buffers() -> None:
    """New inputs copied into the captured ones, then replayed: the loss follows them. X is
    scaled (by powers of two, exact in bf16) so that each loss differs from the one before
    by far more than the tolerance: a replay that left the previous output would fail."""
    _needs_triton()
    case = BenchCase(SMALL_SHAPE, torch.bfloat16, "full", BenchLossSettings(), CUDA, graph=True)
    inputs = make_inputs(case, seed=0)
    method = next(m for m in all_methods() if m.name == "flce:triton")
    workload = method.workload(case, inputs)
    previous = float(call_once(workload))
    for seed, scale in ((1, 0.5), (2, 2.0)):
        fresh = make_inputs(case, seed=seed)
        with torch.no_grad():
            fresh.x.mul_(scale)
            for static, new in ((inputs.x, fresh.x), (inputs.w, fresh.w), (inputs.target, fresh.target)):
                static.copy_(new)
        loss = float(call_once(workload))
        ours, eager = _loss_errors(loss, fresh)
        allowed = TOLERANCE_FACTOR * eager + EPS[torch.bfloat16]
        assert ours <= allowed, (seed, ours, eager)
        assert abs(loss - previous) / abs(loss) > 2 * allowed, (seed, loss, previous)
        previous = loss


def test_a_call_that_cannot_be_captured_is_a_skip_reason_and_leaves_cuda_usable() -> None:
    x = torch.randn(64, 64, device=CUDA)
    with pytest.raises(NotCapturable, match=r"^not capturable in a CUDA graph: \w+: \S") as caught:
        capture(lambda: ((x @ x).sum().item(),), CUDA)
    assert "\n" not in str(caught.value) and runner.skip_reason(caught.value) == str(caught.value)
    assert torch.cuda.current_stream(CUDA) == torch.cuda.default_stream(CUDA)
    workload = capture(lambda: ((x @ x).sum(),), CUDA)  # a capture after the failed one works
    assert float(call_once(workload)) == pytest.approx(float((x @ x).sum()), rel=1e-4)
