"""``flce.fused_linear_distillation`` end to end (the plan, the token-chunk driver with the
teacher's GEMM, the backend's kernel, autograd, the custom ops) against the float64
reference, with eager PyTorch's error in the same dtype as the yardstick (end_to_end.py).

On CPU the Triton kernel runs through Triton's interpreter (tests/conftest.py sets it);
the tests marked ``gpu`` need CUDA.
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
import torch.nn.functional as F

import flce
from flce.dispatch import BackendUnavailableError
from flce.reference import distillation_from_logits_reference, distillation_reference
from flce.testing import TOLERANCE_FACTOR

from .end_to_end import Head, assert_gradients, assert_parity, make_head, make_target
from .harness import BACKENDS, DEVICE, DTYPES, requires_cuda, requires_triton

gpu = pytest.mark.gpu
# 300 classes: two tiles of the CPU launch heuristic, the second ragged; 11 rows in
# chunks of 4 (a ragged last chunk); the teacher's hidden size differs from the student's.
LEADING, HIDDEN, TEACHER_HIDDEN, VOCAB, CHUNK = (11,), 24, 17, 300, 4
BETAS = [0.0, 0.5, 1.0]  # forward KL, the mixture, reverse KL: the kernels' three formulas


def make_teacher(student: Head, dtype: torch.dtype, seed: int, hidden: int = TEACHER_HIDDEN) -> Head:
    """A teacher whose distributions are independent of the student's on some rows and
    close to them on others (the divergence then nearly cancels)."""
    leading, vocab = student.input.shape[:-1], student.weight.shape[0]
    teacher = make_head(tuple(leading), hidden, vocab, torch.float32, seed + 100)
    # Rows 1, 4, 7, ...: the teacher's input chosen so that its logits follow the student's.
    x_s = student.input.detach().float().cpu().reshape(-1, student.input.shape[-1])
    w_s, w_t = student.weight.detach().float().cpu(), teacher.weight.float().cpu()
    b_s = 0 if student.bias is None else student.bias.detach().float().cpu()
    b_t = teacher.bias.float().cpu()
    follow = torch.linalg.lstsq(w_t, (x_s @ w_s.T + b_s - b_t).T).solution.T  # (N, H_t)
    x_t = teacher.input.float().cpu().reshape(-1, hidden)
    rows = torch.arange(x_t.shape[0]) % 3 == 1
    x_t[rows] = follow[rows]

    def put(t):
        return t.to(device=DEVICE, dtype=dtype)

    return Head(put(x_t.reshape(*leading, hidden)), put(w_t), put(b_t))


def reference_run(student: Head, teacher: Head, target, options, upstream, dtype, math_dtype):
    """The reference on student leaves of ``dtype`` (logits in it; the teacher's in its
    own dtype, float64 for the truth) with the math in ``math_dtype``: (student with
    gradients, loss, dL/dlogits)."""
    leaves = student.leaves(dtype)
    logits = F.linear(leaves.input, leaves.weight, leaves.bias)
    logits.retain_grad()
    vocab = student.weight.shape[0]
    t = teacher.leaves(torch.float64 if dtype == torch.float64 else teacher.weight.dtype, requires_grad=False)
    loss = distillation_from_logits_reference(
        logits.reshape(-1, vocab),
        F.linear(t.input, t.weight, t.bias).reshape(-1, vocab),
        None if target is None else target.reshape(-1),
        math_dtype=math_dtype,
        **options,
    )
    (loss * upstream.reshape(loss.shape).to(loss.dtype)).sum().backward()
    return leaves, loss.detach(), logits.grad.reshape(-1, vocab)


def check_parity(
    backend,
    dtype,
    beta,
    reduction,
    *,
    temperature=1.0,
    leading=LEADING,
    vocab=VOCAB,
    chunk_size=CHUNK,
    with_target=True,
    teacher_dtype=None,
    seed=0,
):
    student = make_head(leading, HIDDEN, vocab, dtype, seed)
    teacher = make_teacher(student, teacher_dtype or dtype, seed)
    target = make_target(student, seed) if with_target else None
    options = dict(beta=beta, temperature=temperature, reduction=reduction)
    g = torch.Generator().manual_seed(seed + 3)
    upstream = (torch.randn(leading, generator=g) if reduction == "none" else torch.tensor(1.5)).to(DEVICE)
    ours = student.leaves(dtype)
    loss = flce.fused_linear_distillation(
        ours.input,
        ours.weight,
        teacher.input,
        teacher.weight,
        target,
        student_bias=ours.bias,
        teacher_bias=teacher.bias,
        backend=backend,
        chunk_size=chunk_size,
        **options,
    )
    assert loss.dtype == torch.float32
    assert loss.shape == (leading if reduction == "none" else ())
    (loss * upstream).sum().backward()
    truth, truth_loss, grad_logits = reference_run(
        student, teacher, target, options, upstream, torch.float64, torch.float64
    )
    eager, eager_loss, _ = reference_run(student, teacher, target, options, upstream, dtype, torch.float32)
    assert_parity("loss", loss.reshape(truth_loss.shape), truth_loss, eager_loss, torch.float32)
    assert_gradients(ours, truth, eager, grad_logits, dtype)
    if reduction == "none" and target is not None:
        assert torch.all(loss[target == -100] == 0)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference(backend, dtype, beta):
    check_parity(backend, dtype, beta, "mean", temperature=0.8)


@pytest.mark.parametrize("reduction", ["sum", "none"])
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_reductions(backend, beta, reduction):
    check_parity(backend, torch.float32, beta, reduction, temperature=2.0, seed=1)


# (B, T) inputs in one chunk; no target (no row ignored); a bf16 teacher for an fp32
# student (each LM head's GEMM in its own dtype).
@pytest.mark.parametrize(
    "leading,chunk_size,with_target,teacher_dtype",
    [((3, 4), None, True, None), ((11,), 4, False, None), ((11,), 4, True, torch.bfloat16)],
    ids=["batched-one-chunk", "no-target", "bf16-teacher"],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_shapes_targets_and_teacher_dtype(backend, leading, chunk_size, with_target, teacher_dtype):
    check_parity(
        backend,
        torch.float32,
        0.5,
        "none" if len(leading) > 1 else "mean",
        leading=leading,
        chunk_size=chunk_size,
        with_target=with_target,
        teacher_dtype=teacher_dtype,
        seed=2,
    )


def _trl_generalized_jsd_loss():
    """TRL's GKD loss (``GKDTrainer.generalized_jsd_loss``), wherever this TRL keeps it."""
    pytest.importorskip("trl", reason="trl is not installed")
    for module in ("trl.experimental.gkd.gkd_trainer", "trl.trainer.gkd_trainer"):
        try:
            with warnings.catch_warnings():  # trl.experimental warns that it is experimental
                warnings.simplefilter("ignore")
                return importlib.import_module(module).GKDTrainer.generalized_jsd_loss
        except (ImportError, AttributeError):
            continue
    pytest.skip("this trl has no GKDTrainer.generalized_jsd_loss")


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0, 0.2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_trl_generalized_jsd_loss(backend, beta):
    """The definition GKD users compare with: TRL's generalized JSD of ``logits /
    temperature`` (float64 logits here), its "batchmean" over the labels kept being our
    "mean" and its "sum" our "sum"."""
    generalized_jsd_loss = _trl_generalized_jsd_loss()
    student = make_head((2, 5), HIDDEN, 37, torch.float32, seed=13)
    teacher = make_teacher(student, torch.float32, seed=13)
    labels = make_target(student, seed=13)  # (2, 5), two of them -100
    logits = [F.linear(*(t.double() for t in (h.input, h.weight, h.bias))) for h in (student, teacher)]
    for reduction, trl_reduction in (("mean", "batchmean"), ("sum", "sum")):
        expected = generalized_jsd_loss(*logits, labels=labels, beta=beta, temperature=0.8, reduction=trl_reduction)
        loss = _call(student, teacher, labels, beta=beta, temperature=0.8, reduction=reduction, backend=backend)
        torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)


def _heads(seed, leading=(6,), vocab=VOCAB):
    student = make_head(leading, HIDDEN, vocab, torch.float32, seed)
    return student.leaves(torch.float32), make_teacher(student, torch.float32, seed)


def _call(student: Head, teacher: Head, target, **kwargs):
    return flce.fused_linear_distillation(
        student.input,
        student.weight,
        teacher.input,
        teacher.weight,
        target,
        student_bias=student.bias,
        teacher_bias=teacher.bias,
        **kwargs,
    )


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_all_tokens_ignored(backend, reduction):
    """Loss 0 (no division by a count of 0) and exact zero gradients."""
    student, teacher = _heads(3)
    target = torch.full((6,), -100, device=DEVICE)
    loss = _call(student, teacher, target, reduction=reduction, backend=backend)
    loss.sum().backward()
    assert torch.all(loss == 0)
    for leaf in student.tensors():
        assert torch.all(leaf.grad == 0)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_vocabulary_of_one(backend, beta):
    """V = 1: both distributions are 1, the divergence and every gradient exactly 0."""
    student, teacher = _heads(4, vocab=1)
    loss = _call(student, teacher, None, beta=beta, backend=backend)
    loss.backward()
    assert loss == 0
    for leaf in student.tensors():
        assert torch.all(leaf.grad == 0)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_vocabulary_masked_by_both_biases(backend, beta):
    """Columns both LM heads mask with a -inf bias (padding tokens, a constrained
    vocabulary) are as absent: the loss and gradients of the vocabulary without them, and
    exact zeros in the student's weight and bias gradients there (no NaN)."""
    student, teacher = _heads(10)
    masked = torch.zeros(VOCAB, dtype=torch.bool, device=DEVICE)
    masked[:200] = True  # more than a tile
    masked[250:260] = True
    with torch.no_grad():
        student.bias[masked] = -float("inf")
    teacher_bias = teacher.bias.masked_fill(masked, -float("inf"))
    target = make_target(student, seed=10)
    loss = flce.fused_linear_distillation(
        student.input,
        student.weight,
        teacher.input,
        teacher.weight,
        target,
        beta=beta,
        temperature=0.7,
        student_bias=student.bias,
        teacher_bias=teacher_bias,
        backend=backend,
        chunk_size=CHUNK,
    )
    loss.backward()
    kept = ~masked
    truth = Head(*(t.detach().double().requires_grad_() for t in (student.input, student.weight[kept])), None)
    truth_bias = student.bias.detach()[kept].double().requires_grad_()
    truth_loss = distillation_reference(
        truth.input,
        truth.weight,
        teacher.input.double(),
        teacher.weight[kept].double(),
        target,
        beta=beta,
        temperature=0.7,
        student_bias=truth_bias,
        teacher_bias=teacher.bias[kept].double(),
    )
    truth_loss.backward()
    torch.testing.assert_close(loss.double(), truth_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(student.input.grad.double(), truth.input.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(student.weight.grad[kept].double(), truth.weight.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(student.bias.grad[kept].double(), truth_bias.grad, rtol=1e-4, atol=1e-6)
    assert torch.all(student.weight.grad[masked] == 0) and torch.all(student.bias.grad[masked] == 0)
    # The reference on the whole vocabulary, -inf columns included (their terms are 0).
    whole = student.leaves(torch.float64)
    whole_loss = distillation_reference(
        whole.input,
        whole.weight,
        teacher.input.double(),
        teacher.weight.double(),
        target,
        beta=beta,
        temperature=0.7,
        student_bias=whole.bias,
        teacher_bias=teacher_bias.double(),
    )
    whole_loss.backward()
    torch.testing.assert_close(whole_loss.detach(), truth_loss.detach(), rtol=1e-12, atol=1e-12)
    for leaf, reference_leaf in zip(student.tensors(), whole.tensors(), strict=True):
        torch.testing.assert_close(leaf.grad.double(), reference_leaf.grad, rtol=1e-4, atol=1e-6)


def test_teacher_gets_no_gradient_and_no_grad_path_agrees():
    student, teacher = _heads(5)
    teacher = teacher.leaves(torch.float32)  # the teacher's tensors requiring grad
    target = make_target(student, seed=5)
    loss = _call(student, teacher, target, beta=0.3)
    loss.backward()
    assert all(t.grad is None for t in teacher.tensors())
    with torch.no_grad():
        again = _call(student, teacher, target, beta=0.3)
    torch.testing.assert_close(again, loss.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_repeated_backward_does_not_compound(reduction):
    student, teacher = _heads(6)
    loss = _call(student, teacher, make_target(student, seed=6), reduction=reduction)
    upstream = torch.full_like(loss, 3.0)
    loss.backward(upstream, retain_graph=True)
    first = [leaf.grad.clone() for leaf in student.tensors()]
    loss.backward(upstream)
    for leaf, grad in zip(student.tensors(), first, strict=True):
        torch.testing.assert_close(leaf.grad, 2 * grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_target_raises(backend):
    student, teacher = _heads(7)
    target = make_target(student, seed=7)
    target[2] = -5
    with pytest.raises(ValueError, match=r"target values must be in \[0, 300\)"):
        _call(student, teacher, target, backend=backend)
        flce.check_errors()  # on CUDA the check runs on the device: raised here, the outputs NaN


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compiled_fullgraph_matches_eager(reduction):
    student = make_head((2, 5), HIDDEN, 37, torch.float32, seed=8)
    teacher = make_teacher(student, torch.float32, seed=8)
    target = make_target(student, seed=8)

    def step(x, w, b):
        loss = flce.fused_linear_distillation(
            torch.tanh(x), w, teacher.input, teacher.weight, target, beta=0.3, reduction=reduction, student_bias=b
        )
        return (loss * torch.linspace(0.5, 2.0, 5, device=DEVICE)).sum() if reduction == "none" else loss * 1.5

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (step, compiled):
        leaves = student.leaves(torch.float32)
        loss = fn(leaves.input, leaves.weight, leaves.bias)
        loss.backward()
        results.append([loss.detach(), *(leaf.grad for leaf in leaves.tensors())])
    for expected, got in zip(*results, strict=True):
        torch.testing.assert_close(got, expected)


def test_create_graph_is_refused():
    student, teacher = _heads(9)
    loss = _call(student, teacher, None)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(loss, student.input, create_graph=True)


def _bad_inputs():
    """(arguments to change, expected exception, message)."""
    x, w, xt, wt = torch.randn(3, 4), torch.randn(7, 4), torch.randn(3, 5), torch.randn(7, 5)
    return {
        "vocabularies differ": (dict(teacher_weight=torch.randn(8, 5)), ValueError, "vocabularies must match"),
        "rows differ": (dict(teacher_input=torch.randn(4, 5)), ValueError, "one row per row of student_input"),
        "teacher hidden": (dict(teacher_weight=torch.randn(7, 6)), ValueError, r"teacher_weight must be \(V, H\)"),
        "teacher dtypes": (dict(teacher_weight=wt.half()), TypeError, "teacher_weight has dtype"),
        "student bias": (dict(student_bias=torch.randn(6)), ValueError, r"student_bias must have shape \(7,\)"),
        "target rows": (dict(target=torch.tensor([0, 1])), ValueError, "one class index per row of student_input"),
        "target type": (dict(target=[0, 1, 2]), TypeError, "target must be a torch.Tensor"),
        "beta": (dict(beta=1.5), ValueError, r"beta must be in \[0, 1\]"),
        "temperature": (dict(temperature=-1.0), ValueError, "temperature must be > 0"),
        "reduction": (dict(reduction="batchmean"), ValueError, "reduction must be one of"),
        "ignore_index": (dict(ignore_index=True), TypeError, "ignore_index must be an int"),
    }, dict(student_input=x, student_weight=w, teacher_input=xt, teacher_weight=wt)


BAD_INPUTS, GOOD_INPUTS = _bad_inputs()


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_raise_at_the_boundary(case):
    change, error, message = BAD_INPUTS[case]
    arguments = {**GOOD_INPUTS, **change}
    tensors = [arguments.pop(k) for k in ("student_input", "student_weight", "teacher_input", "teacher_weight")]
    with pytest.raises(error, match=message):
        flce.fused_linear_distillation(*tensors, **arguments)


def test_cutedsl_is_refused_by_name():
    """cutedsl has no distillation kernel: on a machine where it cannot run the reason
    is its availability, on Hopper the missing slot; never a silent fallback."""
    with pytest.raises(BackendUnavailableError, match="cutedsl"):
        flce.fused_linear_distillation(*GOOD_INPUTS.values(), backend="cutedsl")


@gpu
@requires_cuda
@requires_triton
@pytest.mark.parametrize("backend", ["triton", None], ids=["triton", "auto"])
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_gpu_matches_reference(backend, dtype, beta):
    """On the GPU: the Triton kernel, and auto dispatch (triton on Hopper, where the
    cutedsl backend has no distillation kernel), at a vocabulary of several launch tiles."""
    check_parity(backend, dtype, beta, "mean", temperature=0.9, leading=(4, 64), vocab=32003, chunk_size=100, seed=21)


@gpu
@requires_cuda
@requires_triton
@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_gpu_large_vocabulary_bf16(reduction):
    check_parity("triton", torch.bfloat16, 0.5, reduction, leading=(512,), vocab=151936, chunk_size=None, seed=22)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_teacher_made_under_inference_mode_is_taken_as_a_constant(backend, reduction):
    """A teacher run under torch.inference_mode() (the usual way to run a frozen model)
    gives inference tensors, which save_for_backward refuses ("Inference tensors cannot
    be saved for backward"); eager kl_div takes them. They are constants here: the loss
    and the student's gradients equal those of the same teacher made normally."""
    from flce.compat.liger import liger_fused_linear_jsd

    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(7, 8, generator=gen).to(DEVICE), torch.randn(13, 8, generator=gen).to(DEVICE)
    teacher = tuple(
        t.to(DEVICE)
        for t in (torch.randn(7, 6, generator=gen), torch.randn(13, 6, generator=gen), torch.randn(13, generator=gen))
    )
    target = torch.randint(0, 13, (7,), generator=gen).to(DEVICE)
    target[2] = -100
    with torch.inference_mode():
        inference_teacher = tuple(t.clone() for t in teacher)
        inference_target = target.clone()
    assert all(t.is_inference() for t in (*inference_teacher, inference_target))

    def run(teacher_input, teacher_weight, teacher_bias, target):
        leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
        loss = flce.fused_linear_distillation(
            *leaves,
            teacher_input,
            teacher_weight,
            target,
            teacher_bias=teacher_bias,
            reduction=reduction,
            backend=backend,
            chunk_size=3,
        )
        grads = torch.autograd.grad(loss.sum(), leaves, retain_graph=True)
        again = torch.autograd.grad(loss.sum(), leaves)  # a repeated backward recomputes from the operands
        return loss.detach(), grads, again

    expected, got = run(*teacher, target), run(*inference_teacher, inference_target)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    if reduction == "mean":  # the Liger shim (no teacher bias), likewise
        shim = []
        for teacher_input, teacher_weight, labels in (
            (*teacher[:2], target),
            (*inference_teacher[:2], inference_target),
        ):
            leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
            loss = liger_fused_linear_jsd(*leaves, teacher_input, teacher_weight, labels)
            shim.append((loss.detach(), torch.autograd.grad(loss, leaves)))
        torch.testing.assert_close(shim[1], shim[0], rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nearly_equal_distributions_keep_their_difference_in_bf16(backend):
    """Self-distillation, or a KL term against a reference model: the teacher is the
    student's weights plus 1e-3 noise, so the divergence is a difference of nearly equal
    logits. The logits are fp32 from the bf16 operands (products exact, sums in fp32), so
    the loss stays as close to float64's on the same operands as eager PyTorch's divergence
    of the same fp32 logits, give or take 1e-3 (the rounding of an fp32 log-normalizer is a
    sizeable part of a divergence this small: 1.2e-3 off on the H200 with Triton, 2e-5 on a
    CPU), and dX within two bf16 roundings of it (1.6e-3 on a CPU). bf16 logits, as eager
    PyTorch's, gave a loss 8% off and dX 0.43 off."""
    generator = torch.Generator().manual_seed(0)
    n_rows, hidden, vocab = 64, 64, 256
    student_weight = 0.1 * torch.randn(vocab, hidden, generator=generator)
    teacher_weight = (student_weight + 1e-3 * torch.randn(vocab, hidden, generator=generator)).bfloat16()
    student_weight = student_weight.bfloat16()
    hidden_states = torch.randn(n_rows, hidden, generator=generator).bfloat16()
    x = hidden_states.to(DEVICE, copy=True).requires_grad_()
    loss = flce.fused_linear_distillation(
        x, student_weight.to(DEVICE), hidden_states.to(DEVICE), teacher_weight.to(DEVICE), backend=backend
    )
    loss.backward()

    x64 = hidden_states.double().requires_grad_()
    expected = distillation_from_logits_reference(
        x64 @ student_weight.double().T, hidden_states.double() @ teacher_weight.double().T, None, beta=0.5
    )
    expected.backward()
    student_logits, teacher_logits = (
        x.detach().float() @ weight.to(DEVICE).float().T for weight in (student_weight, teacher_weight)
    )
    eager = distillation_from_logits_reference(student_logits, teacher_logits, None, beta=0.5, math_dtype=torch.float32)
    eager_error = abs(eager.item() - expected.item()) / expected.item()
    error = abs(loss.item() - expected.item()) / expected.item()
    assert error <= TOLERANCE_FACTOR * eager_error + 1e-3, (error, eager_error)
    dx_error = (x.grad.cpu().double() - x64.grad).norm() / x64.grad.norm()
    assert dx_error <= 2 * 2.0**-8, dx_error


@pytest.mark.skipif(DEVICE.type != "cpu", reason="forces the CUDA route on a CPU; a GPU runs the route itself")
def test_the_cuda_route_of_fp32_logits_from_bf16_operands(monkeypatch):
    """Where the GEMM writes fp32 from bf16 operands (CUDA), the heads keep bf16 operands
    and fp32 logits, and the student's gradient is cast back to bf16 for dX and dW; on a
    CPU they run in fp32. Forced here on the CPU (its GEMM then casts the operands up per
    chunk, the same fp32 logits), in chunks and with biases: the same loss, and gradients
    within the bf16 rounding of the gradient the CUDA route casts."""
    from flce.heads import distillation

    student = make_head((3, 7), HIDDEN, 37, torch.bfloat16, seed=21)
    teacher = make_teacher(student, torch.bfloat16, seed=21)
    results = []
    for cuda_route in (False, True):
        monkeypatch.setattr(distillation, "fp32_output_gemm_supported", lambda device, on=cuda_route: on)
        assert distillation.divergence_dtypes(torch.bfloat16, DEVICE) == (
            (torch.bfloat16, torch.float32) if cuda_route else (torch.float32, torch.float32)
        )
        leaves = student.leaves(torch.bfloat16)
        loss = _call(leaves, teacher, None, chunk_size=5, backend="torch")
        loss.backward()
        results.append((loss.detach(), [t.grad.double() for t in (leaves.input, leaves.weight, leaves.bias)]))
    (cpu_loss, cpu_grads), (cuda_loss, cuda_grads) = results
    torch.testing.assert_close(cuda_loss, cpu_loss, rtol=1e-6, atol=0)
    for cuda_grad, cpu_grad in zip(cuda_grads, cpu_grads, strict=True):
        assert (cuda_grad - cpu_grad).norm() <= 2 * 2.0**-8 * cpu_grad.norm()
