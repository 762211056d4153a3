"""Host work per loss call: the dispatched PyTorch ops and the Python function calls of a
fused call, counted on the CPU with tiny tensors (the torch backend), so that a change
that adds per-call work fails here before it shows up as host time on a GPU (each op
costs some microseconds of host time on CUDA, a Python call a fraction of one).

The bounds sit a little above what the code reaches; the comments give the counts before
the per-call work was cut (validation and options cached per layout, no view per tensor
for a call of one chunk, the CPU's batch statistics derived on the host, no upstream
scaling pass for a scale of 1 on the CPU). The counts include the torch backend's chunk
kernel (its PyTorch ops are its math) and PyTorch's own autograd calls.

The other tests check that what is cached still refuses bad input: a cached layout still
runs the checks that need the data, and a layout that changes is checked again.
"""

from __future__ import annotations

import cProfile
import math
import pstats

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flce
import flce.dispatch
from flce import plan as flce_plan
from flce.driver.statistics import _host_statistics, _statistics_buffer
from flce.options import LossOptions, cached_options
from tests.aten_ops import GEMM_OPS, NO_KERNEL_OPS, AtenOps, op_name

N, V, H = 8, 64, 16


def _work_per_call(call) -> tuple[int, int]:
    """(aten ops, Python function calls) of one ``call`` after a warm-up call."""
    names, python_calls = _ops_per_call(call)
    return len(names), python_calls


def _ops_per_call(call) -> tuple[list[str], int]:
    """(the aten ops, the number of Python function calls) of one ``call`` after a warm-up call."""
    call()  # the caches a training loop fills on its first step
    with AtenOps() as ops:
        call()
    profiler = cProfile.Profile()
    profiler.enable()
    call()
    profiler.disable()
    return ops.names, pstats.Stats(profiler).total_calls


@pytest.fixture
def tensors():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, H, generator=gen).requires_grad_()
    w = torch.randn(V, H, generator=gen).requires_grad_()
    target = torch.randint(0, V, (N,), generator=gen)
    return x, w, target


def test_fused_forward_and_backward(tensors):
    x, w, target = tensors

    def call():
        x.grad = w.grad = None
        flce.fused_linear_cross_entropy(x, w, target, backend="torch").backward()

    ops, python_calls = _work_per_call(call)
    # Before: 106 ops (35 of them the batch statistics) and 413 Python calls; 136 ops and
    # 9388 calls with TRITON_INTERPRET=1 (the upstream scaling ran through Triton's interpreter).
    # Reached: 76 ops, 267 calls.
    assert ops <= 80, ops
    assert python_calls <= 290, python_calls


def test_fused_forward_only(tensors):
    x, w, target = tensors

    def call():
        with torch.no_grad():
            flce.fused_linear_cross_entropy(x, w, target, backend="torch")

    ops, python_calls = _work_per_call(call)
    # Before: 72 ops, 302 Python calls. Reached: 45 ops, 177 calls.
    assert ops <= 48, ops
    assert python_calls <= 195, python_calls


def test_cross_entropy_forward_only(tensors):
    _, _, target = tensors
    logits = torch.randn(N, V)

    def call():
        flce.cross_entropy(logits, target, backend="torch")

    ops, python_calls = _work_per_call(call)
    # Before: 68 ops, 253 Python calls. Reached: 43 ops, 141 calls.
    assert ops <= 46, ops
    assert python_calls <= 155, python_calls


def test_vocabulary_blocks_ops_per_block(tensors):
    """The vocabulary-block scheme runs a few ops per block and pass besides its kernels
    and GEMMs (the blocks' targets from one block index per row, the weights' views made
    once, the statistics stored into per-block row views): with small blocks its host
    time, not the GPU, set the pace. Counted as the ops of 16 blocks minus those of 8,
    per block; the torch backend's split-row kernels (their PyTorch ops are their math)
    are in the count."""
    x, w, target = tensors

    def ops_of(blocks: int) -> int:
        def call():
            x.grad = w.grad = None
            flce.fused_linear_cross_entropy(x, w, target, backend="torch", vocab_chunk_size=V // blocks).backward()

        return _work_per_call(call)[0]

    per_block = (ops_of(16) - ops_of(8)) / 8
    # Before: 81 ops per block (36 of them the driver's). Reached: 60 (15).
    assert per_block <= 62, per_block


def test_vocabulary_blocks_queue_a_gemm_first(tensors, monkeypatch):
    """Every op a call queues before its first GEMM is host time the GPU waits through: the
    blocks' targets and the row outputs (two dozen small ops, 30 before this test) follow
    the first block's logits GEMM, as the token chunks' buffers follow theirs. Traced on an
    H200 before (the fused first pass, N = 8192, V = 32000 and 128256): 1.1-1.6 ms of idle
    GPU between a dozen small kernels before the first GEMM."""
    x, w, target = tensors
    real = flce_plan.run_vocab_blocks
    with AtenOps() as ops:
        entered = []

        def entry(*args, **kwargs):
            entered.append(len(ops.names))
            return real(*args, **kwargs)

        monkeypatch.setattr(flce_plan, "run_vocab_blocks", entry)
        flce.fused_linear_cross_entropy(x, w, target, backend="torch", vocab_chunk_size=V // 4).backward()
    names = [op_name(name) for name in ops.names[entered[0] :]]
    first_gemm = next(i for i, name in enumerate(names) if name in GEMM_OPS)
    assert set(names[:first_gemm]) <= NO_KERNEL_OPS, names[:first_gemm]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cutedsl"])
def test_cuda_fused_forward_and_backward_ops(backend):
    """On CUDA the batch statistics and the upstream scaling are Triton launches, and the
    kernels are one launch per chunk: what is left are the driver's allocations, views,
    GEMMs and the reduction. Expected from the CPU count (not yet measured on a GPU): about
    15 ops (the statistics' buffer 1 and its copy to a reused pinned buffer 1, the scales
    view, the row outputs, the weight's transposes 2, dX and dW 2, the three GEMMs, the
    reduction 3, autograd's seed)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ok, why = flce.dispatch.availability(backend, torch.device("cuda"))
    if not ok:
        pytest.skip(f"{backend}: {why}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(N, H, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = torch.randn(V, H, device="cuda", generator=gen).bfloat16().requires_grad_()
    target = torch.randint(0, V, (N,), device="cuda", generator=gen)

    def call():
        x.grad = w.grad = None
        flce.fused_linear_cross_entropy(x, w, target, backend=backend).backward()

    with pytest.MonkeyPatch.context() as patch:  # each kernel launched from the host
        patch.setenv("FLCE_CUDA_GRAPHS", "off")
        ops, _ = _work_per_call(call)
    assert ops <= 24, ops
    # Replayed from a CUDA graph (flce.driver.graphs; the second call captures it): the
    # copies of x and the targets into the graph, the checks' counts to the host, the copy
    # out of the loss, autograd's seed, and the backward's scaled copies of dX and dW (two
    # allocations, one launch). Earlier tests' graphs may have used up the captures that
    # replays have not paid for yet (flce.driver.graphs.capture_allowed): a fresh start.
    from flce.driver.graphs import GRAPHED_CALLS

    GRAPHED_CALLS.clear()
    call()
    names, _ = _ops_per_call(call)
    assert len(names) <= 9, names


@pytest.mark.gpu
def test_cuda_batch_statistics_ops():
    """The statistics and the checks' counts share one buffer (one allocation), copied to
    a pinned buffer reused from call to call (one copy, no allocation)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ok, why = flce.dispatch.availability("triton", torch.device("cuda"))
    if not ok:
        pytest.skip(f"the one-launch statistics need triton: {why}")
    from flce.driver.statistics import batch_statistics

    target = torch.randint(0, V, (N,), device="cuda")

    def call():
        flce.check_errors()  # reads the previous call's counts: its pinned buffer is free again
        batch_statistics(target, None, V, -100).ensure_computed()  # computed on first use

    call()
    with AtenOps() as ops:
        call()
    assert ops.names == ["aten.empty.memory_format", "aten.copy_.default"], ops.names


# ------------------------------------------------- what is cached still refuses bad input


def test_a_cached_layout_still_checks_the_target_values(tensors):
    x, w, target = tensors
    flce.fused_linear_cross_entropy(x, w, target, backend="torch")
    bad = target.clone()
    bad[3] = V + 5
    with pytest.raises(ValueError, match="target values must be in"):
        flce.fused_linear_cross_entropy(x, w, bad, backend="torch")


def test_a_changed_layout_is_checked_again(tensors):
    x, w, target = tensors
    flce.fused_linear_cross_entropy(x, w, target, backend="torch")
    with pytest.raises(TypeError, match="weight has dtype"):
        flce.fused_linear_cross_entropy(x, w.detach().half(), target, backend="torch")
    with pytest.raises(ValueError, match="target must have one class index per row"):
        flce.fused_linear_cross_entropy(x, w, target[:-1], backend="torch")
    ce_weight = torch.ones(V)
    flce.fused_linear_cross_entropy(x, w, target, ce_weight=ce_weight, backend="torch")
    with pytest.raises(ValueError, match="ce_weight requires grad"):
        flce.fused_linear_cross_entropy(x, w, target, ce_weight=ce_weight.requires_grad_(), backend="torch")
    with pytest.raises(ValueError, match="accum_dtype"):
        flce.fused_linear_cross_entropy(x, w, target, accum_dtype=torch.float16, backend="torch")


def test_autocast_is_part_of_the_checked_layout(tensors):
    x, w, target = tensors
    w_bf16 = w.detach().bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # mixed dtypes are fine under autocast
        flce.fused_linear_cross_entropy(x, w_bf16, target, backend="torch")
    with pytest.raises(TypeError, match="outside torch.autocast"):
        flce.fused_linear_cross_entropy(x, w_bf16, target, backend="torch")


def test_cached_options_refuse_what_the_options_refuse():
    assert cached_options(LossOptions, label_smoothing=0.5) is cached_options(LossOptions, label_smoothing=0.5)
    cached_options(LossOptions, return_z_loss=False, lse_square_scale=1)
    with pytest.raises(TypeError, match="lse_square_scale must be a finite float"):
        cached_options(LossOptions, return_z_loss=False, lse_square_scale=True)  # == 1, but a bool
    with pytest.raises(ValueError, match="reduction must be one of"):
        cached_options(LossOptions, reduction=["mean"])  # unhashable: the dataclass's own error
    with pytest.raises(TypeError, match="label_smoothing must be a finite float"):
        flce.fused_linear_cross_entropy(
            torch.randn(2, 3), torch.randn(4, 3), torch.tensor([0, 1]), label_smoothing=float("nan")
        )


# ------------------------------------------------------- the CPU's batch statistics

_targets = st.lists(st.integers(min_value=-3, max_value=12), min_size=0, max_size=40)


@settings(max_examples=60, deadline=None)
@given(
    target=_targets,
    weights=st.none() | st.lists(st.floats(min_value=-1.0, max_value=3.0, width=32), min_size=10, max_size=10),
    bad_weight=st.sampled_from([None, math.nan, math.inf]),
    ignore_index=st.sampled_from([-100, -1, 0, 5]),
    dtype=st.sampled_from([torch.int64, torch.int32, torch.int8]),
)
def test_host_statistics_equal_the_device_ops_bit_for_bit(target, weights, bad_weight, ignore_index, dtype):
    """The CPU derives the statistics' scalars in Python; the device ops are the definition."""
    vocab = 10
    target = torch.tensor(target, dtype=dtype)
    ce_weight = None
    if weights is not None:
        ce_weight = torch.tensor(weights, dtype=torch.float32)
        if bad_weight is not None:
            ce_weight[1] = bad_weight
    values, host_values = _host_statistics(target, ce_weight, vocab, ignore_index)
    expected_values = _statistics_buffer(target, ce_weight, vocab, ignore_index)
    host_bits = torch.tensor(host_values, dtype=torch.float32).view(torch.int32)
    assert torch.equal(host_bits, values.view(torch.int32))  # the host's list is the tensor
    assert values.dtype == expected_values.dtype and values.shape == expected_values.shape
    assert torch.equal(values.isnan(), expected_values.isnan())
    finite = ~values.isnan()
    assert torch.equal(values[finite].view(torch.int32), expected_values[finite].view(torch.int32))
