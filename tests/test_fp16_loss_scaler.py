"""fp16 under a loss scaler: the gradients of a mean, which flce computes in the forward
before the scaler's factor is known, must be as accurate as eager PyTorch's, which folds
the factor into the logits' gradient before rounding it to fp16.

At an upstream gradient of 1, ``(p - y) / N`` lies mostly below fp16's normal range
(2^-14) from N of a few thousand; computed so and scaled by 2^16 afterwards, dX and dW
were 10x (N = 4096) to 200x (N = 2048, V = 128256) less accurate than eager's. The forward
now computes them at a power-of-two upstream gradient (``forward_gradient_prescale``)
wherever no gradient summed over the rows is kept in fp16. Judged against float64:
``err(flce) <= CLOSE_TO_EAGER * err(eager) + 1e-6`` (the suite's floor of two fp16 ulps
alone would let a 3x loss of accuracy through), in the two setups a scaler runs in:

- automatic mixed precision: fp32 parameters, fp16 compute under ``torch.autocast``
  (``torch.amp.GradScaler``'s setup; dW is an fp32 sum);
- a frozen fp16 weight (LoRA on an fp16 base model): only dX (or the logits' gradient).
"""

from __future__ import annotations

import pytest
import torch

import flce
from flce.driver.scaling import forward_gradient_prescale, requested_sums_in_fp16
from tests.entry_points import (
    ENTRIES,
    Problem,
    assert_matches_reference,
    fused_leaves,
    logits_leaves,
    plain_fused,
    plain_logits,
    process_group_of_one,  # noqa: F401 (a fixture)
    reference,
    relative_error,
    run_entry,
)
from tests.marks import CPU, triton_on_cpu

# Large enough that (p - y) / N is subnormal in fp16 for most probabilities.
N, H, V = 4096, 16, 1000
SCALER = 2.0**16
# flce's gradient error over eager fp16's: the prescaled gradients measure 1.00-1.01x.
CLOSE_TO_EAGER = 1.5


def assert_as_accurate_as_eager(entry, problem: Problem, outputs, grads, what: str = "") -> None:
    assert_matches_reference(entry, problem, outputs, grads, what)
    _, truth = reference(entry.kind, problem)
    _, eager = reference(entry.kind, problem, torch.float32, problem.dtype)
    for name, exact in truth.items():
        err, err_eager = relative_error(grads[name], exact), relative_error(eager[name], exact)
        assert err <= CLOSE_TO_EAGER * err_eager + 1e-6, f"{what}grad {name}: {err:.3g} against eager's {err_eager:.3g}"


def frozen_weight_problem(kind: str, upstream: float, vocab: int = V, **options) -> Problem:
    """All fp16, only the hidden states (or logits) requiring grad."""
    if kind == "fused":
        leaves = fused_leaves(n=N, h=H, v=vocab, ignored=range(0, N, 7))
    else:
        leaves = logits_leaves(n=N, v=vocab)
    return Problem(
        leaves,
        plain_fused if kind == "fused" else plain_logits,
        options=dict(reduction="mean", **options),
        differentiable=("x",) if kind == "fused" else ("z",),
        upstream=lambda loss: torch.full_like(loss, upstream),
        dtype=torch.float16,
    )


@pytest.mark.usefixtures("process_group_of_one")
@pytest.mark.parametrize("upstream", [SCALER, 1.0], ids=["scaler", "one"])
@pytest.mark.parametrize("entry", list(ENTRIES), ids=str)
def test_frozen_fp16_weight_gradients_are_as_accurate_as_eager(entry, upstream):
    entry = ENTRIES[entry]
    problem = frozen_weight_problem(entry.kind, upstream)
    outputs, grads = run_entry(entry, problem, "torch", CPU)
    assert_as_accurate_as_eager(entry, problem, outputs, grads)


# ------------------------------------------------------------- mixed precision


def _amp_leaves(vocab: int, seed: int = 0):
    leaves = fused_leaves(n=N, h=H, v=vocab, seed=seed, ignored=range(0, N, 7))
    return leaves["x"], leaves["w"], leaves["b"], leaves["t"]


def _exact_gradients(x64, w64, b64, target) -> list[torch.Tensor]:
    x, w, b = (t.clone().requires_grad_() for t in (x64, w64, b64))
    _eager_loss(x, w, b, target).backward()
    return [x.grad, w.grad, b.grad]


def _amp_gradients(loss_of, x64, w64, b64, device=CPU) -> list[torch.Tensor]:
    """(dX, dW, db) of ``SCALER * loss_of(x, w, b)`` divided by ``SCALER``: x in fp16, w
    and b fp32 parameters, under fp16 autocast."""
    x = x64.to(device, torch.float16).requires_grad_()
    w, b = (t.to(device, torch.float32).requires_grad_() for t in (w64, b64))
    with torch.autocast(device.type, dtype=torch.float16):
        loss = loss_of(x, w, b)
    (loss * SCALER).backward()
    return [g.double().cpu() / SCALER for g in (x.grad, w.grad, b.grad)]


def _eager_loss(x, w, b, target):
    logits = torch.nn.functional.linear(x, w, b)
    return torch.nn.functional.cross_entropy(logits.float(), target, label_smoothing=0.1)


def assert_amp_as_accurate_as_eager(call, vocab: int = V, device=CPU, what: str = "") -> None:
    """``call(x, w, b, target)``, flce's mean loss with ``label_smoothing=0.1``, under fp16
    autocast with fp32 parameters, against eager PyTorch's in the same setup."""
    x64, w64, b64, target = _amp_leaves(vocab)
    exact = _exact_gradients(x64, w64, b64, target)
    eager = _amp_gradients(lambda x, w, b: _eager_loss(x, w, b, target), x64, w64, b64)
    ours = _amp_gradients(lambda x, w, b: call(x, w, b, target.to(x.device)), x64, w64, b64, device)
    for name, mine, theirs, truth in zip(("dX", "dW", "db"), ours, eager, exact, strict=True):
        err, err_eager = relative_error(mine, truth), relative_error(theirs, truth)
        assert err <= CLOSE_TO_EAGER * err_eager + 1e-6, f"{what}{name}: {err:.3g} against eager's {err_eager:.3g}"


SCHEMES = {
    "one-chunk": dict(),
    "token-chunks": dict(chunk_size=512),
    "vocab-blocks": dict(vocab_chunk_size=256),
    "chunks-and-blocks": dict(chunk_size=1024, vocab_chunk_size=256),
}


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_mixed_precision_under_a_loss_scaler_on_every_scheme(scheme):
    def call(x, w, b, target):
        return flce.fused_linear_cross_entropy(
            x, w, target, bias=b, label_smoothing=0.1, backend="torch", **SCHEMES[scheme]
        )

    assert_amp_as_accurate_as_eager(call, what=f"{scheme}: ")


@pytest.mark.usefixtures("process_group_of_one")
def test_mixed_precision_under_a_loss_scaler_vocab_parallel():
    def call(x, w, b, target):
        return flce.parallel.vocab_parallel_fused_linear_cross_entropy(
            x, w, target, bias_shard=b, label_smoothing=0.1, backend="torch"
        )

    assert_amp_as_accurate_as_eager(call)


@triton_on_cpu
def test_triton_kernels_under_a_loss_scaler():
    """The prescale is the plan's, backend-neutral; Triton's kernels take it as the per-row
    upstream gradient. A narrow vocabulary keeps the interpreter's time down."""

    def call(x, w, b, target):
        return flce.fused_linear_cross_entropy(
            x, w, target, bias=b, label_smoothing=0.1, backend="triton", chunk_size=1024, vocab_chunk_size=64
        )

    assert_amp_as_accurate_as_eager(call, vocab=128)


def test_distillation_mean_under_a_loss_scaler_matches_its_per_row_backward():
    """The distillation head's mean computes dX in the forward as the CE does (here of a
    frozen fp16 student weight); its ``reduction="none"`` folds the upstream gradient into
    each row in the backward (eager's order). Under a scaler the two agree."""
    gen = torch.Generator().manual_seed(1)
    n, h, v = 4096, 16, 500
    student_x = torch.randn(n, h, generator=gen, dtype=torch.float64)
    student_w = torch.randn(v, h, generator=gen, dtype=torch.float64) * (3 / h**0.5)
    teacher_x = torch.randn(n, h, generator=gen, dtype=torch.float64)
    teacher_w = torch.randn(v, h, generator=gen, dtype=torch.float64) * (3 / h**0.5)

    def grad_input(dtype, reduction):
        x = student_x.to(dtype).requires_grad_()
        loss = flce.fused_linear_distillation(
            x, student_w.to(dtype), teacher_x.to(dtype), teacher_w.to(dtype), reduction=reduction, backend="torch"
        )
        loss = loss if reduction == "mean" else loss.sum() / n
        (loss * SCALER).backward()
        return x.grad.double() / SCALER

    exact = grad_input(torch.float32, "mean")  # fp32's error is 1e-4 of fp16's
    err = relative_error(grad_input(torch.float16, "mean"), exact)
    err_folded = relative_error(grad_input(torch.float16, "none"), exact)
    assert err <= CLOSE_TO_EAGER * err_folded + 1e-6, f"dX: {err:.3g} against {err_folded:.3g}"


@pytest.mark.parametrize("kind", ["fused", "logits"])
def test_compiled_fp16_mean_under_a_loss_scaler(kind):
    """The custom ops' backward scales by the same prescale as the eager plan's."""
    problem = frozen_weight_problem(kind, SCALER)
    entry = ENTRIES["fused" if kind == "fused" else "cross_entropy"]
    leaves, tensors = problem.tensors(torch.float16, CPU, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(lambda s: entry.call(s, "torch", problem.options), fullgraph=True, backend="aot_eager")
    loss = compiled(tensors)
    wanted = [leaves[name] for name in problem.differentiable]
    found = torch.autograd.grad(loss, wanted, grad_outputs=torch.full_like(loss, SCALER))
    grads = dict(zip(problem.differentiable, found, strict=True))
    assert_as_accurate_as_eager(entry, problem, (loss, None, None, None), grads)


def test_compiled_mixed_precision_under_a_loss_scaler():
    def call(x, w, b, target):
        return flce.fused_linear_cross_entropy(x, w, target, bias=b, label_smoothing=0.1, backend="torch")

    torch._dynamo.reset()
    assert_amp_as_accurate_as_eager(torch.compile(call, fullgraph=True, backend="aot_eager"))


# ------------------------------------------------------------------ the rule


def test_the_prescale_is_a_power_of_two_for_an_fp16_mean_only():
    n = 8192
    assert forward_gradient_prescale("mean", torch.float16, n) == n
    assert forward_gradient_prescale("mean", torch.float16, n + 100) == n
    assert forward_gradient_prescale("mean", torch.float16, 1) == 1.0
    for reduction, dtype in [("sum", torch.float16), ("none", torch.float16), ("mean", torch.bfloat16)]:
        assert forward_gradient_prescale(reduction, dtype, n) == 1.0
    assert forward_gradient_prescale("mean", torch.float32, n) == 1.0
    # A dW or db summed over the rows into fp16 could overflow at the prescale: none.
    assert forward_gradient_prescale("mean", torch.float16, n, True) == 1.0


def test_only_a_requested_fp16_parameter_gradient_turns_the_prescale_off():
    w16, b16 = torch.zeros(3, 2, dtype=torch.float16), torch.zeros(3, dtype=torch.float16)
    assert not requested_sums_in_fp16(w16, b16)  # frozen: no dW, no db
    assert requested_sums_in_fp16(w16.requires_grad_(), None)
    assert not requested_sums_in_fp16(torch.zeros(3, 2, requires_grad=True), b16)  # fp32 weight, frozen bias
    with torch.no_grad():
        assert not requested_sums_in_fp16(w16, None)


def test_pure_fp16_parameters_keep_the_unscaled_gradients():
    """fp16 parameters whose gradients are requested (a pure fp16 model, DeepSpeed's fp16
    training): no prescale, so dW never holds more than the true gradient times the upstream;
    the gradients are those of an upstream gradient of 1, scaled (the README's rule)."""
    x = torch.randn(N, H, dtype=torch.float16, requires_grad=True)
    w = (torch.randn(V, H) * 0.5).half().requires_grad_()
    target = torch.randint(0, V, (N,))
    flce.fused_linear_cross_entropy(x, w, target, backend="torch").backward()
    at_one = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    (flce.fused_linear_cross_entropy(x, w, target, backend="torch") * 4.0).backward()
    assert torch.equal(x.grad, at_one[0] * 4) and torch.equal(w.grad, at_one[1] * 4)
