"""The logprobs head's two schemes (flce.heads.logprobs): the forward's logits kept for
the backward (three GEMMs, 6NVH) when one chunk of every row fits the memory budget, else
recomputed in the backward (four, 8NVH). Which one runs, where the budget puts the
boundary, that each is exact against float64, that they agree bit for bit where they run
the same GEMMs, and that the kept logits are consumed once.

On CPU the Triton kernels run through Triton's interpreter (tests/conftest.py sets it).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import flce
from flce.dispatch import get_backend
from flce.driver.chunks import GradRequest
from flce.driver.sizing import logits_row_stride
from flce.heads.logprobs import LogprobsOperands, choose_logprobs_scheme
from flce.options import LogprobsOptions

from .end_to_end import make_head, make_target
from .harness import BACKENDS, requires_cuda, requires_triton
from .test_logprobs_function import (
    HIDDEN,
    LEADING,
    VOCAB,
    check_parity,
    plan_of,
    upstream_gradients,
    weighted_sum,
)

gpu = pytest.mark.gpu
N_ROWS = 11  # LEADING's rows


def extra_bytes(backend: str) -> int:
    return get_backend(backend).logprobs.extra_bytes_per_logit


def keep_workspace(backend: str, dtype: torch.dtype, n_rows: int = N_ROWS, vocab: int = VOCAB) -> int:
    """One chunk of every row's workspace with fp32 weights (flce.driver.sizing: its
    dW is the returned gradient, no accumulator): the logits, whose rows are
    ``logits_row_stride(V)`` elements apart, and the kernel's workspace."""
    return n_rows * (logits_row_stride(vocab) * dtype.itemsize + vocab * extra_bytes(backend))


# ------------------------------------------------------------ which scheme runs


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_budget_decides_at_one_chunk_of_every_row(backend):
    """fp32: keeping needs exactly the logits and the kernel's workspace of every row; a
    byte less recomputes in chunks that fit."""
    need = keep_workspace(backend, torch.float32)
    for budget, kept in ((need, True), (need - 1, False)):
        head = make_head(LEADING, HIDDEN, VOCAB, torch.float32, seed=30).leaves(torch.float32)
        out = flce.fused_linear_logprobs(
            head.input, head.weight, make_target(head, 30), bias=head.bias, backend=backend, memory_budget=budget
        )
        scheme = plan_of(out.logprobs).scheme
        assert scheme.keeps_logits is kept
        assert scheme.rows == N_ROWS if kept else 1 <= scheme.rows < N_ROWS


@pytest.mark.parametrize("fraction,kept", [(1.0, True), (0.5, False)])
def test_the_budget_variable_decides_too(monkeypatch, fraction, kept):
    """``FLCE_MEMORY_BUDGET_MIB`` as ``memory_budget`` (flce.driver.sizing's order)."""
    monkeypatch.setenv("FLCE_MEMORY_BUDGET_MIB", str(fraction * keep_workspace("torch", torch.float32) / 2**20))
    head = make_head(LEADING, HIDDEN, VOCAB, torch.float32, seed=40).leaves(torch.float32)
    out = flce.fused_linear_logprobs(head.input, head.weight, make_target(head, 40), backend="torch")
    assert plan_of(out.logprobs).scheme.keeps_logits is kept


def _reference_shape(n_rows: int, requires_grad=(True, True)) -> LogprobsOperands:
    """The H200 bench's shape (H = 4096, V = 128256, bf16) on the meta device: sizes and
    dtypes only, no memory."""
    x = torch.empty(n_rows, 4096, dtype=torch.bfloat16, device="meta", requires_grad=requires_grad[0])
    w = torch.empty(128256, 4096, dtype=torch.bfloat16, device="meta", requires_grad=requires_grad[1])
    return LogprobsOperands(x, w, None, torch.empty(n_rows, dtype=torch.long, device="meta"))


@pytest.mark.parametrize(
    "n_rows,backward,kept",
    [
        (8192, GradRequest(True, True), True),  # N = 2H: the logits are the size of dW's fp32 accumulator
        (8193, GradRequest(True, True), False),  # one row more: they are larger, the budget refuses
        (8192, GradRequest(True, False), False),  # a frozen LM head: no accumulator, the 512 MiB default
        (2048, GradRequest(True, False), True),  # ... which 512 MiB of logits fit
        (8192, GradRequest(), False),  # no backward to come (no grad)
        (8192, None, False),  # the compiled ops: forward and backward planned apart
    ],
)
def test_default_budget_at_the_bench_shape(monkeypatch, n_rows, backward, kept):
    """The default budget, max(512 MiB, V'*H*4 with dW of a bf16 weight), keeps the
    logits of a training step while N <= 2H, and never without a backward to come."""
    monkeypatch.delenv("FLCE_MEMORY_BUDGET_MIB", raising=False)
    monkeypatch.delenv("FLCE_CHUNK_BUDGET_MIB", raising=False)
    scheme = choose_logprobs_scheme(_reference_shape(n_rows), LogprobsOptions(), torch.bfloat16, 0, backward)
    assert scheme.keeps_logits is kept
    assert scheme.rows == n_rows if kept else scheme.rows <= n_rows


@pytest.mark.parametrize("chunk_size,kept", [(N_ROWS, True), (N_ROWS + 5, True), (4, False)])
def test_explicit_chunk_size_names_the_rows(chunk_size, kept):
    """``chunk_size`` names the rows per chunk: fewer than every row recomputes; one chunk
    of every row keeps the logits when the budget allows, and runs (recomputing) when it
    does not, even under a budget too small to size any chunk."""
    head = make_head(LEADING, HIDDEN, VOCAB, torch.float32, seed=31).leaves(torch.float32)
    target = make_target(head, 31)
    for budget in (None, 1):
        out = flce.fused_linear_logprobs(
            head.input, head.weight, target, backend="torch", chunk_size=chunk_size, memory_budget=budget
        )
        scheme = plan_of(out.logprobs).scheme
        assert scheme.keeps_logits is (kept and budget is None)
        assert scheme.rows == min(chunk_size, N_ROWS) if scheme.keeps_logits else scheme.rows == chunk_size


def test_too_small_a_budget_names_the_option():
    head = make_head(LEADING, HIDDEN, VOCAB, torch.float32, seed=32).leaves(torch.float32)
    with pytest.raises(ValueError, match="memory_budget: a workspace of 1 bytes"):
        flce.fused_linear_logprobs(head.input, head.weight, make_target(head, 32), backend="torch", memory_budget=1)
    with pytest.raises(ValueError, match="memory_budget must be a positive int"):
        flce.fused_linear_logprobs(head.input, head.weight, make_target(head, 32), memory_budget=0)


def test_nothing_is_kept_without_a_backward_to_come():
    head = make_head(LEADING, HIDDEN, VOCAB, torch.float32, seed=33)
    target = make_target(head, 33)
    leaves = head.leaves(torch.float32)
    with torch.no_grad():
        out = flce.fused_linear_logprobs(leaves.input, leaves.weight, target, return_entropy=True)
    assert out.logprobs.grad_fn is None
    frozen = head.leaves(torch.float32, requires_grad=False)
    assert not flce.fused_linear_logprobs(frozen.input, frozen.weight, target).logprobs.requires_grad


# ------------------------------------------------------------- GEMM FLOPs


@contextlib.contextmanager
def counted_gemm_flops(monkeypatch):
    """Counts the FLOPs of every ``torch.mm``/``torch.addmm`` (the driver's GEMMs) in a
    list of one number."""
    total = [0]
    real_mm, real_addmm = torch.mm, torch.addmm

    def mm(a, b, **kwargs):
        total[0] += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return real_mm(a, b, **kwargs)

    def addmm(c, a, b, **kwargs):
        total[0] += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return real_addmm(c, a, b, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch, "mm", mm)
        patch.setattr(torch, "addmm", addmm)
        yield total


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "options,gemms",
    [
        (dict(), 3),  # kept: logits, dX, dW
        (dict(chunk_size=N_ROWS, memory_budget=1), 4),  # one chunk, recomputed
        (dict(chunk_size=4), 4),  # three chunks, recomputed
    ],
    ids=["kept", "recomputed-one-chunk", "recomputed-chunks"],
)
def test_gemm_flops(monkeypatch, backend, options, gemms):
    """fwd+bwd of the input and weight gradients runs ``gemms`` GEMMs of 2NVH FLOPs."""
    head = make_head(LEADING, HIDDEN, VOCAB, torch.float32, seed=34, bias=False).leaves(torch.float32)
    target = make_target(head, 34)
    with counted_gemm_flops(monkeypatch) as flops:
        out = flce.fused_linear_logprobs(
            head.input, head.weight, target, return_entropy=True, backend=backend, **options
        )
        forward = flops[0]
        (out.logprobs.sum() + out.entropy.sum()).backward()
    one_gemm = 2 * N_ROWS * VOCAB * HIDDEN
    assert (forward, flops[0]) == (one_gemm, gemms * one_gemm)


# ------------------------------------------------------------- numerics


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scheme", ["kept", "recomputed"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference(backend, scheme, dtype):
    """Each scheme against float64: upstream gradients on the logprobs and the entropy,
    ignored tokens, a temperature, a bias (check_parity)."""
    options = dict(chunk_size=None) if scheme == "kept" else dict(chunk_size=4)
    out = check_parity(backend, dtype, temperature=0.7, seed=35, **options)
    assert plan_of(out.logprobs).scheme.keeps_logits is (scheme == "kept")


def _run(backend, dtype, seed, **options):
    """(outputs, gradients) of one fwd+bwd with signed upstream gradients."""
    head = make_head(LEADING, HIDDEN, VOCAB, dtype, seed).leaves(dtype)
    target = make_target(head, seed)
    objective = weighted_sum(*upstream_gradients(target.shape, seed))
    out = flce.fused_linear_logprobs(
        head.input,
        head.weight,
        target,
        bias=head.bias,
        temperature=1.3,
        return_entropy=True,
        backend=backend,
        **options,
    )
    objective(out.logprobs, out.entropy).backward()
    return plan_of(out.logprobs).scheme, [out.logprobs, out.entropy, *(leaf.grad for leaf in head.tensors())]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_kept_logits_are_the_recomputed_bits(backend, dtype):
    """One chunk kept and one chunk recomputed run the same GEMMs: the backward reads the
    same logits, so every output and gradient agrees bit for bit."""
    kept_scheme, kept = _run(backend, dtype, 36, chunk_size=N_ROWS)
    recomputed_scheme, recomputed = _run(backend, dtype, 36, chunk_size=N_ROWS, memory_budget=1)
    assert kept_scheme.keeps_logits and not recomputed_scheme.keeps_logits
    for a, b in zip(kept, recomputed, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kept_logits_serve_one_backward(backend):
    """The first backward overwrites the kept logits with dL/dlogits and lets them go; a
    repeated backward (retain_graph) recomputes them, so the gradients add up exactly."""
    head = make_head(LEADING, HIDDEN, VOCAB, torch.float32, seed=37).leaves(torch.float32)
    out = flce.fused_linear_logprobs(
        head.input, head.weight, make_target(head, 37), bias=head.bias, return_entropy=True, backend=backend
    )
    plan = plan_of(out.logprobs)
    assert plan.scheme.keeps_logits and plan.kept.logits is not None
    loss = (out.logprobs * 3.0).sum() + out.entropy.sum()
    loss.backward(retain_graph=True)
    assert plan.kept.logits is None
    first = [leaf.grad.clone() for leaf in head.tensors()]
    loss.backward()
    for leaf, grad in zip(head.tensors(), first, strict=True):
        torch.testing.assert_close(leaf.grad, 2 * grad)


# ------------------------------------------------------------------- GPU


@gpu
@requires_cuda
@requires_triton
def test_gpu_kept_logits_peak_memory():
    """N = 2H, bf16: the kept scheme's peak extra memory over fwd+bwd is the logits of
    every row and the returned gradients (dW written by one GEMM: no fp32 accumulator),
    within 5%; and the logits are freed by the backward."""
    n, h, v = 2048, 1024, 128256
    g = torch.Generator(device="cuda").manual_seed(38)
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (torch.randn(v, h, device="cuda", generator=g) / h**0.5).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, v, (n,), device="cuda", generator=g)

    def step():
        out = flce.fused_linear_logprobs(x, w, target, return_entropy=True, backend="triton")
        assert plan_of(out.logprobs).scheme.keeps_logits
        (out.logprobs.sum() + out.entropy.sum()).backward()

    step()  # compiles the kernels
    x.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    logits, gradients = n * v * 2, (n * h + v * h) * 2
    assert peak <= 1.05 * (logits + gradients), f"peak {peak / 2**30:.3f} GiB"
    assert torch.cuda.memory_allocated() - base <= 1.01 * gradients  # the logits are gone


@gpu
@requires_cuda
@requires_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_gpu_kept_logits_are_the_recomputed_bits(dtype):
    """On the GPU too: the kept logits are exactly what the backward's recompute gives."""
    kept_scheme, kept = _run("triton", dtype, 39, chunk_size=N_ROWS)
    recomputed_scheme, recomputed = _run("triton", dtype, 39, chunk_size=N_ROWS, memory_budget=1)
    assert kept_scheme.keeps_logits and not recomputed_scheme.keeps_logits
    for a, b in zip(kept, recomputed, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
