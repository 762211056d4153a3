"""The CUDA-graph replay of small calls (``flce.driver.graphs``, ``flce.plan.graphed_forward``):
what can be checked without a GPU. The replays themselves: tests/gpu/test_gpu_graphed_calls.py."""

from __future__ import annotations

import pytest
import torch

import flce
from flce import plan as plan_module
from flce.driver import graphs, validation
from flce.driver.chunks import Gradients, GradRequest
from flce.options import LossOptions
from flce.rows.cross_entropy import Reduced

FULL = GradRequest(input=True, weight=True)


def test_mode_from_the_environment(monkeypatch):
    monkeypatch.delenv(graphs.GRAPHS_ENV_VAR, raising=False)
    assert graphs.graphs_enabled()
    monkeypatch.setenv(graphs.GRAPHS_ENV_VAR, " OFF ")
    assert not graphs.graphs_enabled()
    monkeypatch.setenv(graphs.GRAPHS_ENV_VAR, "always")
    with pytest.raises(ValueError, match=r"FLCE_CUDA_GRAPHS must be one of \('auto', 'off'\), got 'always'"):
        graphs.graphs_enabled()


@pytest.mark.parametrize(
    ("n", "v", "h", "held", "pays"),
    [
        (1024, 32000, 1024, 200 * 2**20, True),  # the small shape of the training-loop issue
        (0, 32000, 1024, 0, False),  # no rows: nothing to replay
        (8192, 128256, 4096, 0, False),  # the reference shape: GPU-bound
        (2**12, 2**12, 2**12, 0, True),  # exactly MAX_GRAPHED_WORK
        (2**12, 2**12, 2**12 + 1, 0, False),
        (1024, 32000, 1024, graphs.HELD_BYTES_LIMIT + 1, False),  # would hold too much
    ],
)
def test_graph_pays(n, v, h, held, pays):
    assert graphs.graph_pays(n, v, h, held) is pays


@pytest.mark.parametrize(
    ("captures", "replays", "allowed"),
    [
        (0, 0, True),
        (3, 0, True),
        (4, 0, False),
        (4, 16, True),
        (5, 16, False),
        (9, 96, True),
        (10, 111, False),
        (10, 112, True),
    ],
)
def test_captures_must_be_paid_by_replays(captures, replays, allowed):
    assert graphs.capture_allowed(captures, replays) is allowed


def test_no_graph_on_the_cpu():
    assert not graphs.graph_applies(torch.device("cpu"), 1024, 32000, 1024, 0)


def test_held_bytes_of_the_small_shape_fit():
    """The issue's small shape (bf16, fwd+bwd) is graphed; its graph holds its logits,
    the copies of its inputs, dX and dW counted in fp32."""
    n, h, v = 1024, 1024, 32000
    x = torch.empty(n, h, dtype=torch.bfloat16)
    w = torch.empty(v, h, dtype=torch.bfloat16)
    operands = plan_module.LinearOperands(x, w, None, torch.zeros(n, dtype=torch.long), None)
    plan = plan_module.make_plan(LossOptions(), x.device, operands.target, None, v, torch.bfloat16)
    held = plan_module._graph_held_bytes(plan, operands, FULL)
    expected = 2 * n * h + 8 * n + 2 * n * v + 2 * n * h + 4 * v * h + 16 * n
    assert held == expected
    assert graphs.graph_pays(n, v, h, held)


@pytest.mark.parametrize(
    "options",
    [dict(memory_budget=2**30), dict(chunk_size=256), dict(vocab_chunk_size=4096)],
)
def test_a_stated_memory_bound_is_never_graphed(options):
    assert plan_module._states_memory_bound(LossOptions(**options))
    assert not plan_module._states_memory_bound(LossOptions())


def test_the_budget_variables_state_a_memory_bound(monkeypatch):
    monkeypatch.setenv("FLCE_MEMORY_BUDGET_MIB", "512")
    assert plan_module._states_memory_bound(LossOptions())


@pytest.mark.parametrize("variable", ["FLCE_MEMORY_BUDGET_MIB", "FLCE_CHUNK_BUDGET_MIB"])
def test_an_empty_budget_variable_states_no_memory_bound(monkeypatch, variable):
    """The sizing reads an empty variable as unset (``export FLCE_MEMORY_BUDGET_MIB=``):
    so does the graphs' refusal, which took it for a stated budget."""
    monkeypatch.setenv(variable, "")
    assert not plan_module._states_memory_bound(LossOptions())


def test_the_matmul_settings_are_part_of_the_key():
    """cuBLAS's math settings (TF32, the reduced-precision reductions) decide the kernels a
    graph captures: a graph's key holds them, so a change of one gets another graph."""
    matmul = torch.backends.cuda.matmul
    tf32, bf16_reduction = matmul.allow_tf32, matmul.allow_bf16_reduced_precision_reduction
    try:
        matmul.allow_tf32 = False
        before = graphs.gemm_settings()
        matmul.allow_tf32 = True
        with_tf32 = graphs.gemm_settings()
        matmul.allow_bf16_reduced_precision_reduction = not bf16_reduction
        with_other_reduction = graphs.gemm_settings()
    finally:
        matmul.allow_tf32 = tf32
        matmul.allow_bf16_reduced_precision_reduction = bf16_reduction
    assert len({before, with_tf32, with_other_reduction}) == 3
    assert graphs.gemm_settings() == (with_tf32 if tf32 else before)


def test_the_first_calls_of_a_key_launch():
    """A key is captured on its call after ``CALLS_BEFORE_CAPTURE`` launched ones; until
    then the caller launches (None), and nothing is run or captured."""
    calls = graphs.GraphedCalls()

    def run(_copied):
        raise AssertionError("not captured yet")

    for _ in range(graphs.CALLS_BEFORE_CAPTURE):
        assert calls.forward(("key",), (torch.zeros(2),), run, 0) is None
    assert len(calls) == 0 and calls.replays == 0


def test_recording_checks_instead_of_copying():
    """While recording, ``defer`` keeps the counts and their message (a captured call's
    checks, deferred after each replay), nested recordings restore the outer one, and
    nothing is pending."""
    pending = validation.pending_checks()
    outer, inner = [], []
    counts = torch.zeros(2)
    with validation.recording_checks(outer):
        validation.defer(counts, str)
        with validation.recording_checks(inner):
            validation.defer(counts, repr)
        validation.defer(counts, ascii)
    assert [d for _, d in outer] == [str, ascii] and [d for _, d in inner] == [repr]
    assert all(c is counts for c, _ in outer + inner)
    assert validation.pending_checks() == pending


def test_recording_is_per_thread():
    """A capture recording in one thread does not take the checks of another's calls:
    there, nothing records (their counts go to the host as usual)."""
    import threading

    mine, in_other_thread = [], []
    with validation.recording_checks(mine):
        other = threading.Thread(target=lambda: in_other_thread.append(validation._recording.checks))
        other.start()
        other.join()
        validation.defer(torch.zeros(2), str)
    assert in_other_thread == [None] and [d for _, d in mine] == [str]


def test_forward_result_copied_owns_its_tensors():
    loss, dx = torch.tensor(1.5), torch.arange(4.0)
    result = plan_module.ForwardResult(Reduced(loss, None, None, None), (), Gradients(dx, None, None))
    copy = result.copied()
    assert copy.outputs.z_loss is None and copy.gradients.weight is None
    assert torch.equal(copy.outputs.loss, loss) and torch.equal(copy.gradients.input, dx)
    assert copy.outputs.loss.data_ptr() != loss.data_ptr() and copy.gradients.input.data_ptr() != dx.data_ptr()
    loss.add_(1)
    dx.add_(1)
    assert float(copy.outputs.loss) == 1.5 and copy.gradients.input.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_cpu_calls_do_not_touch_the_graphs():
    graphs.GRAPHED_CALLS.clear()
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(32, 16, requires_grad=True)
    y = torch.randint(0, 32, (8,))
    for _ in range(3):
        flce.fused_linear_cross_entropy(x, w, y, backend="torch").backward()
    assert len(graphs.GRAPHED_CALLS) == 0 and graphs.GRAPHED_CALLS.replays == 0
