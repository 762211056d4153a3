"""flce inside a training step on CUDA: no host syncs, CUDA-graph capture and replay,
``torch.compile(mode="reduce-overhead")``, and the asynchronous validation of bad
targets (NaN outputs, then a ``ValueError``), on every CUDA backend. Judged against the
float64 reference."""

from __future__ import annotations

import pytest
import torch

import flce
from flce.options import LossOptions
from flce.reference import fused_linear_cross_entropy_reference
from tests.budgets import call_of, inside_dw_budget
from tests.gpu.common import CUDA, skip_unless_usable

if not torch.cuda.is_available():
    pytest.skip("training-loop tests: need a CUDA GPU", allow_module_level=True)

pytestmark = pytest.mark.gpu
BACKENDS = ["torch", "triton", "cutedsl"]
# H a multiple of 64 and bf16: the cutedsl loss-only route (fused GEMM) applies too.
N, H, V = 256, 128, 1031
OPTIONS = dict(label_smoothing=0.1, lse_square_scale=1e-4, softcap=30.0)
# The vocabulary blocks with their workspace inside dW pay off where a chunk of logits
# outweighs dX's fp32 accumulator: a larger vocabulary (prime: ragged blocks).
V_INSIDE_DW = 4099


def _inputs(seed: int, dtype=torch.bfloat16, vocab: int = V):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    x = torch.randn(N, H, device=CUDA, generator=gen).to(dtype)
    w = (torch.randn(vocab, H, device=CUDA, generator=gen) * 0.3).to(dtype)
    y = torch.randint(0, vocab, (N,), device=CUDA, generator=gen)
    y[::7] = -100
    return x, w, y


def _reference(x, w, y, **options):
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    loss = fused_linear_cross_entropy_reference(xd, wd, y, **options).loss
    dx, dw = torch.autograd.grad(loss, (xd, wd))
    return loss.detach(), dx, dw


def _assert_close_to(reference, *got, rtol=2e-2):
    for ref, ours in zip(reference, got, strict=True):
        err = (ours.double() - ref).norm() / ref.norm().clamp(min=1e-30)
        assert err < rtol, f"relative error {float(err):.3g}"


def _blocks_inside_dw(backend: str, x, w) -> dict:
    """The options that run the vocabulary blocks with their workspace inside dW."""
    budget, _ = inside_dw_budget(call_of(x, w, backend, options=LossOptions(**OPTIONS)))
    return dict(memory_budget=budget)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["fwd_bwd", "loss_only", "per_token", "vocab_blocks", "blocks_inside_dw"])
def test_no_host_sync(backend, mode):
    skip_unless_usable(backend)
    x, w, y = _inputs(0, vocab=V_INSIDE_DW if mode == "blocks_inside_dw" else V)
    extra = dict(reduction="none") if mode == "per_token" else {}
    if mode == "vocab_blocks":
        extra = dict(vocab_chunk_size=256)
    if mode == "blocks_inside_dw":
        extra = _blocks_inside_dw(backend, x, w)

    def step():
        xr = x.clone().requires_grad_(mode != "loss_only")
        wr = w.clone().requires_grad_(mode != "loss_only")
        loss = flce.fused_linear_cross_entropy(xr, wr, y, backend=backend, **OPTIONS, **extra)
        if mode == "loss_only":
            return loss
        loss.sum().backward()
        return loss

    step()  # compiles the kernels (compilation may synchronize)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)


# "vocab_blocks": the exact low-memory mode (with cutedsl on Hopper, its first pass from the
# fused statistics GEMM, captured too).
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scheme", ["default", "vocab_blocks", "blocks_inside_dw"])
def test_cuda_graph_capture_and_replay(backend, scheme):
    skip_unless_usable(backend)
    vocab = V_INSIDE_DW if scheme == "blocks_inside_dw" else V
    x, w, y = _inputs(1, vocab=vocab)
    static_x, static_w, static_y = x.clone().requires_grad_(), w.clone().requires_grad_(), y.clone()
    extra = dict(vocab_chunk_size=384) if scheme == "vocab_blocks" else {}
    if scheme == "blocks_inside_dw":
        extra = _blocks_inside_dw(backend, x, w)

    def step():
        loss = flce.fused_linear_cross_entropy(static_x, static_w, static_y, backend=backend, **OPTIONS, **extra)
        dx, dw = torch.autograd.grad(loss, (static_x, static_w))
        return loss, dx, dw

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up outside the graph: kernels compiled, allocator primed
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()

    for seed in (2, 3):  # new data copied into the captured buffers, then replayed
        x, w, y = _inputs(seed, vocab=vocab)
        with torch.no_grad():
            static_x.copy_(x)
            static_w.copy_(w)
            static_y.copy_(y)
        graph.replay()
        torch.cuda.synchronize()
        _assert_close_to(_reference(x, w, y, **OPTIONS), *outputs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_reduce_overhead(backend):
    skip_unless_usable(backend)
    torch._dynamo.reset()

    def loss_of(x, w, y):
        return flce.fused_linear_cross_entropy(x, w, y, backend=backend, **OPTIONS)

    # AOT autograd compiles the backward as well; reduce-overhead replays both as graphs.
    compiled = torch.compile(loss_of, mode="reduce-overhead", fullgraph=True)
    for seed in (4, 5, 6):  # the first calls record, later ones replay the graphs
        x, w, y = _inputs(seed)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = compiled(xr, wr, y)
        loss.backward()
        loss = loss.detach().clone()
        torch.cuda.synchronize()
        _assert_close_to(_reference(x, w, y, **OPTIONS), loss, xr.grad, wr.grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_target_gives_nan_then_an_error(backend):
    skip_unless_usable(backend)
    flce.check_errors()  # nothing pending from earlier tests
    x, w, y = _inputs(7)
    y[3] = V + 5  # out of range: never read, and never a silently finite loss
    xr = x.clone().requires_grad_()
    loss = flce.fused_linear_cross_entropy(xr, w, y, backend=backend)
    loss.backward()
    counted = y != -100  # ignored rows keep their exact zero gradient
    assert torch.isnan(loss).item() and torch.isnan(xr.grad[counted]).all().item()
    assert (xr.grad[~counted] == 0).all().item()
    with pytest.raises(ValueError, match="out of range"):
        flce.check_errors()
    flce.check_errors()  # reported once
    # Synchronous validation raises before any kernel runs.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FLCE_VALIDATE", "sync")
        with pytest.raises(ValueError, match=r"out of range \(e\.g\. \["):
            flce.fused_linear_cross_entropy(x, w, y, backend=backend)
