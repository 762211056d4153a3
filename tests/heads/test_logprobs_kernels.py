"""The logprobs head's chunk kernels (PyTorch twin and Triton) against the float64
reference, with eager PyTorch's error in the same dtype as the yardstick (harness.py).

On CPU the Triton kernels run through Triton's interpreter (tests/conftest.py sets it);
the tests marked ``gpu`` need CUDA.
"""

from __future__ import annotations

import math
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flce.backends.torch.logprobs import EXTRA_BYTES_PER_LOGIT
from flce.reference import logprobs_from_logits_reference
from flce.rows import logprobs as rows

from .harness import (
    BACKENDS,
    DEVICE,
    DTYPES,
    FP32_FLOOR,
    assert_close_to_reference,
    fresh,
    kernels,
    make_logits,
    make_targets,
    requires_cuda,
    requires_triton,
)

gpu = pytest.mark.gpu
TEMPERATURES = [0.5, 1.0, 2.0]
# 300 columns: two tiles of the CPU launch heuristic (256), the second ragged, so the
# online softmax combines tiles; eight rows: every row kind and two ignored rows.
NUM_ROWS, VOCAB = 8, 300


def run_forward(backend, logits, target, temperature, *, with_entropy=True, lse_dtype=torch.float64, **kwargs):
    num_rows = logits.shape[0]
    out = dict(
        logprob=fresh((num_rows,)),
        entropy=fresh((num_rows,)) if with_entropy else None,
        lse=fresh((num_rows,), lse_dtype),
    )
    kernels("logprobs", backend).logprobs_forward_chunk(
        logits,
        target,
        inv_temperature=1.0 / temperature,
        ignore_index=-100,
        logprob_out=out["logprob"],
        entropy_out=out["entropy"],
        lse_out=out["lse"],
        **kwargs,
    )
    return out


def run_backward(backend, logits, target, forward, grad_logprob, grad_entropy, temperature, **kwargs):
    """dL/dlogits on a copy of ``logits`` (in place), which is returned."""
    grad = logits.clone()
    kernels("logprobs", backend).logprobs_backward_chunk(
        grad,
        target,
        forward["lse"],
        forward["entropy"],
        grad_logprob,
        grad_entropy,
        inv_temperature=1.0 / temperature,
        ignore_index=-100,
        **kwargs,
    )
    return grad


def reference(logits, target, grad_logprob, grad_entropy, temperature, math_dtype):
    """logprob, entropy, lse and the gradient of ``sum(g_lp * logprob + g_H * entropy)``
    in ``math_dtype``: float64 for the truth, float32 on the logits as given for eager."""
    leaf = logits.detach().to(torch.float64 if math_dtype == torch.float64 else logits.dtype).requires_grad_()
    ref = logprobs_from_logits_reference(leaf, target, temperature=temperature, math_dtype=math_dtype)
    objective = torch.zeros((), dtype=math_dtype, device=logits.device)
    if grad_logprob is not None:
        objective = objective + (ref.logprobs * grad_logprob.to(math_dtype)).sum()
    if grad_entropy is not None:
        objective = objective + (ref.entropy * grad_entropy.to(math_dtype)).sum()
    grad = torch.autograd.grad(objective, leaf)[0] if objective.requires_grad else torch.zeros_like(leaf)
    lse = torch.logsumexp(leaf.detach().to(math_dtype) / temperature, dim=-1)
    return dict(logprob=ref.logprobs.detach(), entropy=ref.entropy.detach(), lse=lse, grad=grad)


def make_case(num_rows, vocab, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    logits = make_logits(num_rows, vocab, dtype, g)
    target = make_targets(logits, g)
    grad_logprob = torch.randn(num_rows, generator=g).to(DEVICE)  # signed, like a policy-gradient advantage
    grad_entropy = torch.randn(num_rows, generator=g).to(DEVICE)
    return logits, target, grad_logprob, grad_entropy


def check_against_reference(
    backend, logits, target, grad_logprob, grad_entropy, temperature, lse_dtype=torch.float64, **kwargs
):
    dtype = logits.dtype
    forward = run_forward(backend, logits, target, temperature, lse_dtype=lse_dtype, **kwargs)
    grad = run_backward(backend, logits, target, forward, grad_logprob, grad_entropy, temperature, **kwargs)
    truth = reference(logits, target, grad_logprob, grad_entropy, temperature, torch.float64)
    eager = reference(logits, target, grad_logprob, grad_entropy, temperature, torch.float32)
    valid = target != -100
    for name in ("logprob", "entropy"):
        assert_close_to_reference(name, forward[name], truth[name], eager[name], torch.float32)
    assert_close_to_reference("lse", forward["lse"][valid], truth["lse"][valid], eager["lse"][valid], torch.float32)
    assert_close_to_reference("grad", grad, truth["grad"], eager["grad"], dtype)
    assert grad.dtype == dtype
    ignored = ~valid
    for name in ("logprob", "entropy", "lse"):
        assert torch.all(forward[name][ignored] == 0), f"{name} not 0 on ignored rows"
    assert torch.all(grad[ignored] == 0)
    return forward, grad


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference(backend, dtype, temperature):
    logits, target, grad_logprob, grad_entropy = make_case(NUM_ROWS, VOCAB, dtype, seed=int(temperature * 10))
    check_against_reference(backend, logits, target, grad_logprob, grad_entropy, temperature)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_many_small_tiles(dtype):
    """Tiles of 16 make the online softmax (max, sum and spread) combine over 7 steps."""
    from flce.backends.triton.heuristics import CEKernelConfig

    logits, target, grad_logprob, grad_entropy = make_case(5, 100, dtype, seed=3)
    check_against_reference("triton", logits, target, grad_logprob, grad_entropy, 0.5, config=CEKernelConfig(16, 1))


@pytest.mark.parametrize("upstream", ["logprob", "entropy", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_upstream_gradients_of_one_output_or_none(backend, upstream):
    """Only one output (or none) receives a gradient: None stands for zeros, and the
    entropy need not have been computed when its gradient is absent."""
    logits, target, grad_logprob, grad_entropy = make_case(NUM_ROWS, VOCAB, torch.float32, seed=5)
    grad_logprob = grad_logprob if upstream == "logprob" else None
    grad_entropy = grad_entropy if upstream == "entropy" else None
    forward = run_forward(backend, logits, target, 2.0, with_entropy=upstream == "entropy")
    grad = run_backward(backend, logits, target, forward, grad_logprob, grad_entropy, 2.0)
    truth = reference(logits, target, grad_logprob, grad_entropy, 2.0, torch.float64)
    eager = reference(logits, target, grad_logprob, grad_entropy, 2.0, torch.float32)
    if upstream == "none":
        assert torch.all(grad == 0)
    else:
        assert_close_to_reference("grad", grad, truth["grad"], eager["grad"], torch.float32)
    assert_close_to_reference("logprob", forward["logprob"], truth["logprob"], eager["logprob"], torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_logits_keep_eager_precision(backend):
    """Logits around 40 at temperature 0.5: an fp32 ulp of lse (~80) is 8e-6, which a
    float32 lse would put on every p (flce.rows.logprobs); the float64 lse keeps the
    gradient within the parity bound."""
    logits, target, grad_logprob, grad_entropy = make_case(NUM_ROWS, VOCAB, torch.float32, seed=37)
    logits = logits / 4.0 + 40.0  # softmax of scale ~1 after the temperature, far from 0
    check_against_reference(backend, logits, target, grad_logprob, grad_entropy, 0.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_lse_is_enough_for_low_precision_gradients(backend, dtype):
    """The contract's float32 lse: the gradient's own bf16/fp16 rounding hides its error
    (flce.rows.logprobs), so the parity holds unchanged."""
    logits, target, grad_logprob, grad_entropy = make_case(NUM_ROWS, VOCAB, dtype, seed=7)
    check_against_reference(backend, logits, target, grad_logprob, grad_entropy, 0.5, lse_dtype=torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_lse_error_is_the_rounding_of_lse(backend):
    """With fp32 logits and a float32 lse, each row's p carries the relative error
    r = lse - fp32(lse), |r| <= half an ulp of lse (flce.rows.logprobs): the gradient moves
    from the float64-lse one by at most |r| p_i (|c_lp| + |c_H| (|log p_i + H| + 1)) per
    element, to first order (bound doubled for the second order and the roundings)."""
    temperature = 0.5  # logits of up to ~50: an ulp of lse is 4e-6
    logits, target, grad_logprob, grad_entropy = make_case(NUM_ROWS, VOCAB, torch.float32, seed=9)
    precise = run_forward(backend, logits, target, temperature)
    rounded = dict(precise, lse=precise["lse"].float())
    grad_precise = run_backward(backend, logits, target, precise, grad_logprob, grad_entropy, temperature)
    grad_rounded = run_backward(backend, logits, target, rounded, grad_logprob, grad_entropy, temperature)
    lse = precise["lse"]
    r = (lse - lse.float().double()).abs()[:, None]  # (M, 1)
    log_p = logits.double() / temperature - lse[:, None]
    p = log_p.exp()
    entropy = precise["entropy"].double()[:, None]
    c_lp = grad_logprob.double().abs()[:, None] / temperature
    c_h = grad_entropy.double().abs()[:, None] / temperature
    # plus the roundings of p and of the gradient itself, which differ between the runs
    sensitivity = p * (c_lp + c_h * ((log_p + entropy).abs() + 1))
    bound = (2 * r + FP32_FLOOR) * sensitivity + FP32_FLOOR * grad_precise.double().abs()
    assert torch.all((grad_rounded.double() - grad_precise.double()).abs() <= bound)
    assert r.max() > 0, "the case should round some lse"


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_into_grad_out_leaves_logits_untouched(backend):
    """With ``grad_out`` the kernel only reads the logits and writes the same gradient
    (bit for bit) as in place, into a buffer of its own row stride."""
    logits, target, grad_logprob, grad_entropy = make_case(NUM_ROWS, VOCAB, torch.bfloat16, seed=11)
    forward = run_forward(backend, logits, target, 1.0)
    in_place = run_backward(backend, logits, target, forward, grad_logprob, grad_entropy, 1.0)
    source = logits.clone()
    wide = torch.full((NUM_ROWS, VOCAB + 5), 7.0, dtype=logits.dtype, device=DEVICE)
    kernels("logprobs", backend).logprobs_backward_chunk(
        source,
        target,
        forward["lse"],
        forward["entropy"],
        grad_logprob,
        grad_entropy,
        inv_temperature=1.0,
        ignore_index=-100,
        grad_out=wide[:, :VOCAB],
    )
    assert torch.equal(source, logits)
    assert torch.equal(wide[:, :VOCAB], in_place)
    assert torch.all(wide[:, VOCAB:] == 7.0)
    with pytest.raises(ValueError, match="grad_out must match logits"):
        kernels("logprobs", backend).logprobs_backward_chunk(
            source,
            target,
            forward["lse"],
            forward["entropy"],
            grad_logprob,
            None,
            inv_temperature=1.0,
            ignore_index=-100,
            grad_out=wide[:, : VOCAB - 1],
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_ignore_index_is_a_real_class(backend):
    """ignore_index = 3 is a class id: rows with target 3 are ignored (zeros), and class
    3 keeps its gradient on the other rows."""
    logits, target, grad_logprob, grad_entropy = make_case(NUM_ROWS, 7, torch.float32, seed=13)
    target = torch.tensor([3, 0, 3, 6, 1, 3, 2, 5], device=DEVICE)
    kernel = kernels("logprobs", backend)
    forward = dict(logprob=fresh((NUM_ROWS,)), entropy=fresh((NUM_ROWS,)), lse=fresh((NUM_ROWS,), torch.float64))
    kernel.logprobs_forward_chunk(
        logits,
        target,
        inv_temperature=1.0,
        ignore_index=3,
        logprob_out=forward["logprob"],
        entropy_out=forward["entropy"],
        lse_out=forward["lse"],
    )
    grad = logits.clone()
    kernel.logprobs_backward_chunk(
        grad,
        target,
        forward["lse"],
        forward["entropy"],
        grad_logprob,
        grad_entropy,
        inv_temperature=1.0,
        ignore_index=3,
    )
    ignored = target == 3
    ref = logprobs_from_logits_reference(logits.double(), target, ignore_index=3)
    torch.testing.assert_close(forward["logprob"], ref.logprobs.float())
    torch.testing.assert_close(forward["entropy"], ref.entropy.float())
    assert torch.all(forward["logprob"][ignored] == 0) and torch.all(grad[ignored] == 0)
    assert torch.all(grad[~ignored][:, 3] != 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_rows_ignored(backend):
    logits, target, grad_logprob, grad_entropy = make_case(6, VOCAB, torch.bfloat16, seed=15)
    target.fill_(-100)
    forward = run_forward(backend, logits, target, 1.0)
    grad = run_backward(backend, logits, target, forward, grad_logprob, grad_entropy, 1.0)
    for name in ("logprob", "entropy", "lse"):
        assert torch.all(forward[name] == 0)
    assert torch.all(grad == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vocabulary_of_one(backend):
    """V = 1: p = 1, so logprob, entropy and the gradient are exactly 0 (lse = z)."""
    logits = torch.tensor([[3.5], [-2.0], [40.0], [0.0]], device=DEVICE)
    target = torch.tensor([0, 0, -100, 0], device=DEVICE)
    ones = torch.ones(4, device=DEVICE)
    forward = run_forward(backend, logits, target, 0.5)
    grad = run_backward(backend, logits, target, forward, ones, ones, 0.5)
    assert torch.all(forward["logprob"] == 0) and torch.all(forward["entropy"] == 0)
    assert torch.equal(forward["lse"], torch.tensor([7.0, -4.0, 0.0, 0.0], dtype=torch.float64, device=DEVICE))
    assert torch.all(grad == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_vectors_of_any_stride(backend):
    """Targets, outputs, lse and upstream gradients as strided and expanded views give
    the contiguous results bit for bit; the logits' row stride may exceed V."""
    logits, target, grad_logprob, grad_entropy = make_case(NUM_ROWS, VOCAB, torch.float32, seed=17)
    kernel = kernels("logprobs", backend)
    contiguous = run_forward(backend, logits, target, 2.0)
    upstream = torch.tensor(0.75, device=DEVICE).expand(NUM_ROWS)  # stride 0, as from a mean's backward
    expected = run_backward(backend, logits, target, contiguous, upstream, grad_entropy, 2.0)

    wide_logits = torch.zeros(NUM_ROWS, VOCAB + 9, device=DEVICE)
    wide_logits[:, :VOCAB] = logits
    strided_target = torch.zeros(2 * NUM_ROWS, dtype=torch.int64, device=DEVICE)[::2]
    strided_target.copy_(target)
    outputs = fresh((NUM_ROWS, 3))  # columns of an (M, 3) buffer: stride 3
    lse = fresh((NUM_ROWS, 2), torch.float64)[:, 1]
    kernel.logprobs_forward_chunk(
        wide_logits[:, :VOCAB],
        strided_target,
        inv_temperature=0.5,
        ignore_index=-100,
        logprob_out=outputs[:, 0],
        entropy_out=outputs[:, 1],
        lse_out=lse,
    )
    assert torch.equal(outputs[:, 0], contiguous["logprob"]) and torch.equal(outputs[:, 1], contiguous["entropy"])
    assert torch.isnan(outputs[:, 2]).all()
    assert torch.equal(lse, contiguous["lse"])
    strided_grad_entropy = torch.zeros(NUM_ROWS, 3, device=DEVICE)[:, 2]
    strided_grad_entropy.copy_(grad_entropy)
    kernel.logprobs_backward_chunk(
        wide_logits[:, :VOCAB],
        strided_target,
        lse,
        outputs[:, 1],
        upstream,
        strided_grad_entropy,
        inv_temperature=0.5,
        ignore_index=-100,
    )
    assert torch.equal(wide_logits[:, :VOCAB], expected)
    assert torch.all(wide_logits[:, VOCAB:] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_rows_is_a_no_op(backend):
    empty = torch.empty(0, VOCAB, dtype=torch.bfloat16, device=DEVICE)
    target = torch.empty(0, dtype=torch.int64, device=DEVICE)
    forward = run_forward(backend, empty, target, 1.0)
    run_backward(backend, empty, target, forward, forward["logprob"], forward["entropy"], 1.0)


BAD_FORWARD_ARGUMENTS = {
    "logits must be 2-D": dict(logits=torch.zeros(4)),
    "logits must have unit stride": dict(logits=torch.zeros(5, 4).T),
    "target must have shape": dict(target=torch.zeros(3, dtype=torch.int64)),
    "target must be int32 or int64": dict(target=torch.zeros(4)),
    "inv_temperature must be finite and > 0": dict(inv_temperature=0.0),
    "lse_out must be float64 or float32": dict(lse_out=torch.zeros(4, dtype=torch.float16)),
    "logprob_out must be float32": dict(logprob_out=torch.zeros(4, dtype=torch.float64)),
}


@pytest.mark.parametrize("message", list(BAD_FORWARD_ARGUMENTS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments_raise_before_any_kernel_runs(backend, message):
    arguments = dict(
        logits=torch.zeros(4, 5),
        target=torch.zeros(4, dtype=torch.int64),
        inv_temperature=1.0,
        ignore_index=-100,
        logprob_out=torch.zeros(4),
        entropy_out=None,
        lse_out=torch.zeros(4, dtype=torch.float64),
    )
    arguments.update(BAD_FORWARD_ARGUMENTS[message])
    logits, target = arguments.pop("logits"), arguments.pop("target")
    with pytest.raises(ValueError, match=message):
        kernels("logprobs", backend).logprobs_forward_chunk(logits, target, **arguments)


@pytest.mark.parametrize("backend", BACKENDS)
def test_entropy_gradient_needs_the_entropy(backend):
    logits = torch.zeros(4, 5)
    target = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="entropy .* is needed when grad_entropy is given"):
        kernels("logprobs", backend).logprobs_backward_chunk(
            logits, target, torch.zeros(4), None, None, torch.ones(4), inv_temperature=1.0, ignore_index=-100
        )


@settings(max_examples=30, deadline=None)
@given(split=st.integers(1, 39), seed=st.integers(0, 2**16))
def test_block_statistics_merge_like_the_whole_row(split, seed):
    """Two column blocks of a row combine into the whole row's statistics (the online
    softmax over tiles and the vocabulary shards rely on it), in float64 to rounding."""
    z = make_logits(NUM_ROWS, 40, torch.float32, torch.Generator().manual_seed(seed)).cpu().double()
    whole = rows.block_statistics(z.clone(), with_spread=True)
    merged = rows.merge_statistics(
        rows.block_statistics(z[:, :split].clone(), with_spread=True),
        rows.block_statistics(z[:, split:].clone(), with_spread=True),
    )
    assert torch.equal(merged.row_max, whole.row_max)
    torch.testing.assert_close(merged.row_sum, whole.row_sum, rtol=1e-13, atol=0)
    torch.testing.assert_close(merged.spread, whole.spread, rtol=1e-12, atol=1e-300)


@gpu
@requires_cuda
@requires_triton
@pytest.mark.parametrize("vocab", [128256, 151936])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_gpu_large_vocabulary(dtype, vocab):
    logits, target, grad_logprob, grad_entropy = make_case(32, vocab, dtype, seed=vocab)
    check_against_reference("triton", logits, target, grad_logprob, grad_entropy, 0.7)


@gpu
@requires_cuda
@requires_triton
def test_gpu_row_offsets_beyond_int32():
    """M * V > 2^31: rows past the 32-bit range must be read and written correctly."""
    num_rows, vocab = 16400, 131072
    g = torch.Generator(device=DEVICE).manual_seed(0)
    logits = (torch.randn(num_rows, vocab, device=DEVICE, generator=g) * 4.0).to(torch.bfloat16)
    target = torch.randint(0, vocab, (num_rows,), device=DEVICE, generator=g)
    upstream = torch.ones(num_rows, device=DEVICE)
    tail = slice(num_rows - 8, num_rows)
    expected_forward = run_forward("torch", logits[tail], target[tail], 1.0)
    expected_grad = run_backward("torch", logits[tail], target[tail], expected_forward, upstream[tail], None, 1.0)
    forward = run_forward("triton", logits, target, 1.0)
    kernels("logprobs", "triton").logprobs_backward_chunk(
        logits, target, forward["lse"], None, upstream, None, inv_temperature=1.0, ignore_index=-100
    )
    torch.testing.assert_close(forward["logprob"][tail], expected_forward["logprob"])
    torch.testing.assert_close(logits[tail], expected_grad)


class _FreshBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """The most bytes of tensors that ops allocate (not their in-place results or views)
    alive at once, each counted until its tensor is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        known = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t._base is None and t.untyped_storage().data_ptr() not in known:
                nbytes = t.untyped_storage().nbytes()
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, nbytes)
        return out

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes


def test_the_logits_gradient_holds_two_fp32_temporaries_per_logit():
    """``logits_gradient`` consumes z and allocates p and the gradient: the 12 bytes per
    logit the torch backend's chunk sizing counts (z, p, grad: ``EXTRA_BYTES_PER_LOGIT``). With the entropy it held
    three more (M, V) temporaries at once (p * log p, its mask and the ``where``), so a call
    under a ``memory_budget`` ran 1.66x over it."""
    gen = torch.Generator().manual_seed(0)
    m, v = 64, 1000
    z = torch.randn(m, v, generator=gen) * 3
    z[0, 5] = -math.inf  # a masked column: p = 0 there, and its term must stay 0
    lse = torch.logsumexp(z, dim=1)
    p = torch.softmax(z, dim=1)
    entropy = -(p * torch.where(p > 0, p.log(), 0.0)).sum(dim=1)
    target = torch.randint(0, v, (m,), generator=gen)
    coef = torch.rand(m, generator=gen)
    with _FreshBytes() as tracked:  # z's copy, p and the gradient: 12 bytes per logit
        grad = rows.logits_gradient(z.clone(), target, lse, entropy, coef, coef)
    assert tracked.peak <= EXTRA_BYTES_PER_LOGIT * m * v + 64 * m, tracked.peak / (m * v)
    assert torch.isfinite(grad).all()
