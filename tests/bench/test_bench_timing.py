"""The timing helpers on the CPU: ``interleaved_times`` runs every workload once per round
after an untimed warm-up round, in an order that rotates each round, with ``before``
ahead of every call; ``back_to_back_ms`` runs each call's setup, run and teardown in turn
and divides the batch's time by its calls."""

from __future__ import annotations

import torch

from flce.bench.timing import Workload, back_to_back_ms, interleaved_times
from tests.bench.scripts import load_benchmark_script


def test_interleaved_times_rotates_the_order_and_drops_the_warm_up_round() -> None:
    calls: list[str] = []

    def workload(name: str) -> Workload:
        return Workload(setup=lambda: None, run=lambda _: calls.append(name))

    befores: list[None] = []
    times = interleaved_times(
        {"a": workload("a"), "b": workload("b"), "c": workload("c")},
        torch.device("cpu"),
        rounds=2,
        before=lambda: befores.append(None),
    )
    assert list(times) == ["a", "b", "c"]
    assert all(len(t) == 2 and all(ms >= 0 for ms in t) for t in times.values())
    assert len(calls) == len(befores) == 9  # the warm-up round and two timed rounds
    rounds = [calls[i : i + 3] for i in range(0, 9, 3)]
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds)
    assert rounds[0] != rounds[1] != rounds[2]  # each round starts with another workload


def test_back_to_back_runs_every_step_of_each_call_in_turn() -> None:
    steps: list[str] = []
    workload = Workload(
        setup=lambda: steps.append("setup") or 7,
        run=lambda state: steps.append(f"run {state}"),
        teardown=lambda: steps.append("teardown"),
    )
    ms = back_to_back_ms(workload, torch.device("cpu"), calls=3)
    assert steps == ["setup", "run 7", "teardown"] * 3
    assert ms >= 0


def test_profile_timeline_splits_a_call_into_outside_the_span_and_idle_inside_it() -> None:
    """``benchmarks/profile_breakdown.py``'s ``timeline``: kernels at 10-20 and 15-30 us
    (overlapping) and 50-60 us, in a call of 0.1 ms: a span of 50 us, 30 us busy."""
    module = load_benchmark_script("profile_breakdown")
    result = module.timeline([(50.0, 60.0), (10.0, 20.0), (15.0, 30.0)], 0.1)
    assert result["kernel_span_ms"] == 0.05
    assert abs(result["outside_span_ms"] - 0.05) < 1e-12
    assert abs(result["idle_inside_span_ms"] - 0.02) < 1e-12
    assert result["largest_gaps_ms"] == [0.02]
    assert module.timeline([], 0.1) == {"call_ms": 0.1}
