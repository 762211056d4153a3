"""``flce.fused_linear_logprobs`` end to end (the plan, the token-chunk driver, the
backend's kernels, autograd, the custom ops) against the float64 reference, with eager
PyTorch's error in the same dtype as the yardstick (end_to_end.py).

On CPU the Triton kernels run through Triton's interpreter (tests/conftest.py sets it);
the tests marked ``gpu`` need CUDA.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import flce
from flce.dispatch import BackendUnavailableError
from flce.reference import logprobs_from_logits_reference

from .end_to_end import Head, assert_gradients, assert_parity, make_head, make_target
from .harness import BACKENDS, DEVICE, DTYPES, requires_cuda, requires_triton

gpu = pytest.mark.gpu
# 300 classes: two tiles of the CPU launch heuristic (256), the second ragged; 11 rows in
# chunks of 4: a ragged last chunk; H = 24.
LEADING, HIDDEN, VOCAB, CHUNK = (11,), 24, 300, 4


def upstream_gradients(shape, seed):
    """Signed per-token gradients, as a policy-gradient advantage and an entropy bonus give."""
    g = torch.Generator().manual_seed(seed + 2)
    return torch.randn(shape, generator=g).to(DEVICE), torch.randn(shape, generator=g).to(DEVICE)


def weighted_sum(grad_logprob, grad_entropy):
    """The objective ``sum(g_lp * logprobs + g_H * entropy)``: its gradient is the
    backward with those upstream gradients."""

    def objective(logprobs, entropy):
        total = (logprobs * grad_logprob.reshape(logprobs.shape).to(logprobs.dtype)).sum()
        return total + (entropy * grad_entropy.reshape(entropy.shape).to(entropy.dtype)).sum()

    return objective


def reference_run(head: Head, target, temperature, objective, dtype, math_dtype):
    """The reference on leaves of ``dtype`` (logits in it) with softmax math in
    ``math_dtype``, ``objective(logprobs, entropy)`` differentiated: (head with
    gradients, logprobs, entropy, dL/dlogits)."""
    leaves = head.leaves(dtype)
    logits = F.linear(leaves.input, leaves.weight, leaves.bias)
    logits.retain_grad()
    vocab = head.weight.shape[0]
    ref = logprobs_from_logits_reference(
        logits.reshape(-1, vocab), target.reshape(-1), temperature=temperature, math_dtype=math_dtype
    )
    objective(ref.logprobs, ref.entropy).backward()
    return leaves, ref.logprobs.detach(), ref.entropy.detach(), logits.grad.reshape(-1, vocab)


def check_parity(backend, dtype, temperature, *, leading=LEADING, vocab=VOCAB, chunk_size=CHUNK, seed=0, bias=True):
    head = make_head(leading, HIDDEN, vocab, dtype, seed, bias=bias)
    target = make_target(head, seed)
    objective = weighted_sum(*upstream_gradients(target.shape, seed))
    ours = head.leaves(dtype)
    out = flce.fused_linear_logprobs(
        ours.input,
        ours.weight,
        target,
        bias=ours.bias,
        temperature=temperature,
        return_entropy=True,
        backend=backend,
        chunk_size=chunk_size,
    )
    assert out.logprobs.shape == target.shape and out.entropy.shape == target.shape
    assert out.logprobs.dtype == torch.float32 and out.entropy.dtype == torch.float32
    objective(out.logprobs, out.entropy).backward()
    truth, truth_lp, truth_h, grad_logits = reference_run(
        head, target, temperature, objective, torch.float64, torch.float64
    )
    eager, eager_lp, eager_h, _ = reference_run(head, target, temperature, objective, dtype, torch.float32)
    assert_parity("logprobs", out.logprobs.reshape(-1), truth_lp, eager_lp, torch.float32)
    assert_parity("entropy", out.entropy.reshape(-1), truth_h, eager_h, torch.float32)
    assert_gradients(ours, truth, eager, grad_logits, dtype)
    ignored = target == -100
    assert torch.all(out.logprobs[ignored] == 0) and torch.all(out.entropy[ignored] == 0)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference(backend, dtype):
    check_parity(backend, dtype, temperature=0.7)


# Temperatures below and above 1 (sharper and flatter than the logits), fp32; (B, T)
# inputs; one chunk holding every row; no bias.
@pytest.mark.parametrize(
    "temperature,leading,chunk_size,bias",
    [(0.5, (11,), 4, True), (2.0, (3, 4), 5, True), (1.0, (3, 4), None, False)],
    ids=["T0.5", "T2-batched", "one-chunk-no-bias"],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_temperatures_shapes_and_chunks(backend, temperature, leading, chunk_size, bias):
    check_parity(backend, torch.float32, temperature, leading=leading, chunk_size=chunk_size, seed=7, bias=bias)


def _call(backend, head, target, **kwargs):
    return flce.fused_linear_logprobs(head.input, head.weight, target, bias=head.bias, backend=backend, **kwargs)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_trl_selective_log_softmax_and_entropy(backend, temperature):
    """The definition GRPO/PPO users compare with: TRL's per-token logps and entropies of
    ``logits / temperature`` (float64 logits here: TRL's own rounding out of the way)."""
    trl_utils = pytest.importorskip("trl.trainer.utils", reason="trl is not installed")
    head = make_head((2, 5), HIDDEN, 37, torch.float32, seed=12)
    target = make_target(head, seed=12, n_ignored=0)
    logits = F.linear(*(t.double() for t in (head.input, head.weight, head.bias))) / temperature
    out = flce.fused_linear_logprobs(
        head.input, head.weight, target, bias=head.bias, temperature=temperature, return_entropy=True, backend=backend
    )
    # fp32 logits against float64 ones: a few fp32 roundings of values of size ~5
    close = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.logprobs.double(), trl_utils.selective_log_softmax(logits, target), **close)
    torch.testing.assert_close(out.entropy.double(), trl_utils.entropy_from_logits(logits), **close)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_tokens_ignored(backend):
    head = make_head((6,), HIDDEN, VOCAB, torch.float32, seed=3).leaves(torch.float32)
    target = torch.full((6,), -100, device=DEVICE)
    out = _call(backend, head, target, return_entropy=True)
    (out.logprobs.sum() + out.entropy.sum()).backward()
    assert torch.all(out.logprobs == 0) and torch.all(out.entropy == 0)
    for leaf in head.tensors():
        assert torch.all(leaf.grad == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vocabulary_of_one(backend):
    """V = 1: p = 1 exactly, so logprob, entropy and every gradient are exactly 0."""
    head = make_head((5,), HIDDEN, 1, torch.float32, seed=4).leaves(torch.float32)
    target = torch.zeros(5, dtype=torch.long, device=DEVICE)
    out = _call(backend, head, target, return_entropy=True)
    (out.logprobs.sum() * 2 + out.entropy.sum()).backward()
    assert torch.all(out.logprobs == 0) and torch.all(out.entropy == 0)
    for leaf in head.tensors():
        assert torch.all(leaf.grad == 0)


@pytest.mark.parametrize("which", ["logprobs", "entropy"])
def test_gradient_through_one_output(which):
    """Only one output is used (here squared: an upstream gradient of its own per
    token): the other's gradient is absent, not zeros to be read."""
    head = make_head(LEADING, HIDDEN, VOCAB, torch.float32, seed=5)
    target = make_target(head, seed=5)

    def objective(logprobs, entropy):
        return (logprobs if which == "logprobs" else entropy).pow(2).sum()

    ours = head.leaves(torch.float32)
    out = _call("torch", ours, target, return_entropy=True, temperature=1.5)
    objective(out.logprobs, out.entropy).backward()
    truth, *_, grad_logits = reference_run(head, target, 1.5, objective, torch.float64, torch.float64)
    eager, *_ = reference_run(head, target, 1.5, objective, torch.float32, torch.float32)
    assert_gradients(ours, truth, eager, grad_logits, torch.float32)


def test_without_entropy_and_without_grad():
    """No entropy asked for: None, and the logprobs equal the call's with it; nothing
    requiring grad runs the forward alone, with the same values."""
    head = make_head(LEADING, HIDDEN, VOCAB, torch.float32, seed=6)
    target = make_target(head, seed=6)
    plain = _call("torch", head, target)
    assert plain.entropy is None and not plain.logprobs.requires_grad
    with_entropy = _call("torch", head.leaves(torch.float32), target, return_entropy=True)
    torch.testing.assert_close(plain.logprobs, with_entropy.logprobs.detach(), rtol=0, atol=0)


def test_repeated_backward_does_not_compound():
    head = make_head(LEADING, HIDDEN, VOCAB, torch.float32, seed=8).leaves(torch.float32)
    target = make_target(head, seed=8)
    out = _call("torch", head, target, return_entropy=True)
    loss = (out.logprobs * 3.0).sum() + out.entropy.sum()
    loss.backward(retain_graph=True)
    first = [leaf.grad.clone() for leaf in head.tensors()]
    loss.backward()
    for leaf, grad in zip(head.tensors(), first, strict=True):
        torch.testing.assert_close(leaf.grad, 2 * grad)


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8], ids=["int32", "uint8"])
def test_narrow_integer_targets(dtype):
    head = make_head((6,), HIDDEN, 200, torch.float32, seed=9)
    target = make_target(head, seed=9, n_ignored=0)
    expected = _call("torch", head, target).logprobs
    torch.testing.assert_close(_call("torch", head, target.to(dtype)).logprobs, expected, rtol=0, atol=0)


def test_autocast_computes_in_its_dtype_with_fp32_gradients():
    head = make_head(LEADING, HIDDEN, VOCAB, torch.float32, seed=10).leaves(torch.float32)
    target = make_target(head, seed=10)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out = _call("torch", head, target, return_entropy=True)
    (out.logprobs.sum() + out.entropy.sum()).backward()
    bf16 = _call("torch", head.leaves(torch.bfloat16, requires_grad=False), target).logprobs
    torch.testing.assert_close(out.logprobs.detach(), bf16, rtol=0, atol=0)
    assert all(leaf.grad.dtype == torch.float32 for leaf in head.tensors())


def expected_predicted(head: Head, target: torch.Tensor, temperature: float) -> torch.Tensor:
    """The first maximum of the fp32 logits scaled by 1 / temperature (as the kernels form
    z), -1 at ignored tokens: the reference of ``return_predicted_tokens``."""
    logits = F.linear(head.input.detach(), head.weight.detach(), None if head.bias is None else head.bias.detach())
    z = logits.reshape(-1, head.weight.shape[0]) * (1.0 / temperature)
    flat = target.reshape(-1)
    return torch.where(flat != -100, z.argmax(dim=-1), -1).reshape(target.shape)


@pytest.mark.parametrize("chunk_size", [CHUNK, None], ids=["chunks", "one_chunk"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_predicted_tokens(backend, chunk_size):
    """``return_predicted_tokens``: the first maximum of the scaled logits, -1 at ignored
    tokens, from the same pass as the logprobs (which it leaves unchanged), through
    chunks and through one chunk whose logits are kept for the backward. Columns 3, 7
    (one tile) and 280 (the second tile of 256 columns) are made equal and the largest on
    the rows of a lifted bias: ties go to the first column, within a tile and across."""
    leading = (2, 6)
    head = make_head(leading, HIDDEN, VOCAB, torch.float32, seed=21)
    with torch.no_grad():
        head.weight[7] = head.weight[280] = head.weight[3]
        head.bias[3] = head.bias[7] = head.bias[280] = 40.0
    target = make_target(head, seed=21)
    flat = target.reshape(-1)
    flat[::4] = 3  # the tied columns' first, as a target, on some rows
    leaves = head.leaves(torch.float32)
    out = _call(
        backend, leaves, target, temperature=0.7, return_entropy=True, return_predicted_tokens=True,
        chunk_size=chunk_size,
    )  # fmt: skip
    (out.logprobs.sum() + out.entropy.sum()).backward()  # the kept-logits backward still works
    plain = _call(backend, head.leaves(torch.float32, requires_grad=False), target, temperature=0.7)
    assert plain.predicted_tokens is None
    assert out.predicted_tokens.shape == target.shape and out.predicted_tokens.dtype == torch.int64
    assert not out.predicted_tokens.requires_grad
    expected = expected_predicted(head, target, 0.7)
    assert torch.equal(out.predicted_tokens, expected)
    assert torch.all(expected[target != -100] == 3)  # the tie decided every valid row
    torch.testing.assert_close(out.logprobs.detach(), plain.logprobs, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_predicted_tokens_without_ties(backend):
    """On a head without ties the predicted tokens are the float64 logits' argmax wherever
    its margin exceeds the fp32 rounding of the logits (every row here)."""
    head = make_head(LEADING, HIDDEN, VOCAB, torch.float32, seed=22)
    target = make_target(head, seed=22)
    out = _call(backend, head.leaves(torch.float32, requires_grad=False), target, return_predicted_tokens=True)
    truth = expected_predicted(head.leaves(torch.float64, requires_grad=False), target, 1.0)
    assert torch.equal(out.predicted_tokens, truth)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_target_raises(backend):
    head = make_head((6,), HIDDEN, VOCAB, torch.float32, seed=11)
    target = make_target(head, seed=11)
    target[3] = VOCAB
    with pytest.raises(ValueError, match=r"target values must be in \[0, 300\)"):
        _call(backend, head, target)
        flce.check_errors()  # on CUDA the check runs on the device: raised here, the outputs NaN


def test_compiled_fullgraph_matches_eager():
    def step(x, w, b, t, advantages):
        out = flce.fused_linear_logprobs(
            torch.tanh(x), w, t, bias=b, temperature=0.8, return_entropy=True, return_predicted_tokens=True
        )
        ratio = torch.exp(out.logprobs - out.logprobs.detach())
        return -(ratio * advantages).mean() - 0.01 * out.entropy.mean(), out.logprobs, out.predicted_tokens

    head = make_head((2, 5), HIDDEN, 37, torch.float32, seed=12, bias=True)
    target = make_target(head, seed=12)
    advantages = torch.linspace(-1, 1, 5, device=DEVICE)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (step, compiled):
        leaves = head.leaves(torch.float32)
        loss, logprobs, predicted = fn(leaves.input, leaves.weight, leaves.bias, target, advantages)
        loss.backward()
        results.append([loss.detach(), logprobs.detach(), predicted, *(leaf.grad for leaf in leaves.tensors())])
    for expected, got in zip(*results, strict=True):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("path", ["eager", "op", "compiled"])
def test_create_graph_is_refused(path):
    """Eager and through the custom op called directly, with flce's message; compiled,
    the backward graph is traced ahead of time and PyTorch refuses to differentiate it
    again. Never a silently missing second-order term."""
    head = make_head((4,), HIDDEN, 37, torch.float32, seed=13).leaves(torch.float32)
    target = make_target(head, seed=13, n_ignored=0)
    if path == "op":
        from flce import ops
        from flce.options import LogprobsOptions, option_values

        values = option_values(LogprobsOptions(return_entropy=True))
        logprobs = ops.fused_linear_logprobs_fwd(head.input, head.weight, None, target, *values, torch.float32)[0]
        with pytest.raises(RuntimeError, match="create_graph=True"):
            torch.autograd.grad(logprobs.sum(), head.input, create_graph=True)
        return

    def total(x):
        return flce.fused_linear_logprobs(x, head.weight, target).logprobs.sum()

    if path == "eager":
        with pytest.raises(RuntimeError, match="create_graph=True"):
            torch.autograd.grad(total(head.input), head.input, create_graph=True)
        return
    torch._dynamo.reset()
    value = torch.compile(total, fullgraph=True, backend="aot_eager")(head.input)
    (grad,) = torch.autograd.grad(value, head.input, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        (value + grad.square().sum()).backward()


def _bad_inputs():
    """(description, arguments to change, expected exception, message)."""
    w, x = torch.randn(7, 4), torch.randn(3, 4)
    t = torch.tensor([0, 1, 2])
    return {
        "hidden mismatch": (dict(weight=torch.randn(7, 5)), ValueError, r"weight must be \(V, H\) with H = "),
        "target rows": (dict(target=torch.tensor([0, 1])), ValueError, "one class index per row"),
        "float target": (dict(target=t.float()), TypeError, "integer tensor"),
        "dtype mismatch": (dict(weight=w.double()), TypeError, "float16, bfloat16 or float32"),
        "bias shape": (dict(bias=torch.randn(6)), ValueError, r"bias must have shape \(7,\)"),
        "temperature 0": (dict(temperature=0.0), ValueError, "temperature must be > 0"),
        "temperature nan": (dict(temperature=float("nan")), TypeError, "temperature must be a finite float"),
        "entropy flag": (dict(return_entropy=1), TypeError, "return_entropy must be a bool"),
        "chunk size": (dict(chunk_size=0), ValueError, "chunk_size must be a positive int"),
        "backend name": (dict(backend="cuda"), ValueError, "backend must be one of"),
        "meta input": (dict(input=x.to("meta")), ValueError, "meta device"),
    }, dict(input=x, weight=w, target=t)


BAD_INPUTS, GOOD_INPUTS = _bad_inputs()


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_raise_at_the_boundary(case):
    change, error, message = BAD_INPUTS[case]
    arguments = {**GOOD_INPUTS, **change}
    tensors = {k: arguments.pop(k) for k in ("input", "weight", "target")}
    with pytest.raises(error, match=message):
        flce.fused_linear_logprobs(tensors["input"], tensors["weight"], tensors["target"], **arguments)


def test_cutedsl_is_refused_by_name_and_auto_falls_back(monkeypatch):
    """cutedsl has no logprobs kernels: asked for by name it is refused with the reason;
    auto on a (simulated) Hopper picks the best backend that has them."""
    from flce import dispatch

    usable = dataclasses.replace(dispatch.get_backend("cutedsl"), availability=lambda device: (True, ""))
    real = dispatch.get_backend
    monkeypatch.setattr(dispatch, "get_backend", lambda name: usable if name == "cutedsl" else real(name))
    x, w, t = GOOD_INPUTS["input"], GOOD_INPUTS["weight"], GOOD_INPUTS["target"]
    with pytest.raises(BackendUnavailableError, match="has no logprobs kernels"):
        flce.fused_linear_logprobs(x, w, t, backend="cutedsl")
    monkeypatch.setenv("FLCE_BACKEND", "cutedsl")
    with pytest.raises(BackendUnavailableError, match="FLCE_BACKEND"):
        flce.fused_linear_logprobs(x, w, t)
    monkeypatch.delenv("FLCE_BACKEND")
    cuda = torch.device("cuda", 0)  # auto's choice on a GPU, asked of the registry (no tensor made)
    dispatch._auto_backend.cache_clear()  # auto's choice is cached per device: forget the real one
    try:
        picked = dispatch.resolve_backend(None, cuda, needs="logprobs")
        assert picked.logprobs is not None and picked.name != "cutedsl"
        assert dispatch.resolve_backend(None, cuda).name == "cutedsl"  # the CE keeps its best
    finally:
        dispatch._auto_backend.cache_clear()


# The two schemes of flce.heads.logprobs: chunks of 100 of 256 rows recompute the logits
# in the backward; one chunk of every row (the default budget holds it) keeps them.
GPU_SCHEMES = {"recomputed": 100, "kept": None}


@gpu
@requires_cuda
@requires_triton
@pytest.mark.parametrize("scheme", list(GPU_SCHEMES))
@pytest.mark.parametrize("backend", ["triton", None], ids=["triton", "auto"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_gpu_matches_reference(backend, dtype, scheme):
    """On the GPU: the Triton kernels, and auto dispatch (triton on Hopper, where the
    cutedsl backend has no logprobs kernels), at a vocabulary of several launch tiles."""
    out = check_parity(backend, dtype, 0.7, leading=(4, 64), vocab=32003, chunk_size=GPU_SCHEMES[scheme], seed=21)
    assert plan_of(out.logprobs).scheme.keeps_logits is (scheme == "kept")


@gpu
@requires_cuda
@requires_triton
@pytest.mark.parametrize("chunk_size", [None, 200], ids=["kept", "recomputed"])
def test_gpu_large_vocabulary_bf16(chunk_size):
    out = check_parity("triton", torch.bfloat16, 1.0, leading=(512,), vocab=151936, chunk_size=chunk_size, seed=22)
    assert plan_of(out.logprobs).scheme.keeps_logits is (chunk_size is None)


def plan_of(output: torch.Tensor):
    """The ``LogprobsPlan`` of the call that made ``output`` (autograd keeps it with the graph)."""
    node = output.grad_fn
    while not hasattr(node, "plan"):
        node = node.next_functions[0][0]  # through the reshape back to the call's node
    return node.plan


@gpu
@requires_cuda
@requires_triton
@pytest.mark.parametrize("chunk_size", [None, 100], ids=["kept", "recomputed"])
def test_gpu_predicted_tokens(chunk_size):
    """The Triton kernel's predicted tokens on the GPU (several launch tiles per row),
    against the first maximum of the same fp32 logits scaled as the kernel scales them."""
    head = make_head((4, 64), HIDDEN, 32003, torch.float32, seed=23)
    target = make_target(head, seed=23)
    leaves = head.leaves(torch.float32)
    out = _call("triton", leaves, target, temperature=0.7, return_predicted_tokens=True, chunk_size=chunk_size)
    out.logprobs.sum().backward()
    assert torch.equal(out.predicted_tokens, expected_predicted(head, target, 0.7))
