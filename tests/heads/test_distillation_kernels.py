"""The distillation head's chunk kernel (PyTorch twin and Triton) against the float64
reference (Liger's generalized JSD), with eager PyTorch's error in the same dtype as the
yardstick (harness.py).

On CPU the Triton kernel runs through Triton's interpreter (tests/conftest.py sets it);
the tests marked ``gpu`` need CUDA.
"""

from __future__ import annotations

import pytest
import torch

from flce.reference import distillation_from_logits_reference
from flce.rows import distillation as rows

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
    make_teacher,
    relative_error,
    requires_cuda,
    requires_triton,
)

gpu = pytest.mark.gpu
# 0 and 1: the forward and reverse KL (Liger's special cases); 0.5 the symmetric JSD;
# 0.1 a skewed mixture.
BETAS = [0.0, 1.0, 0.5, 0.1]
TEMPERATURES = [0.5, 1.0, 2.0]
# As in the logprobs tests: two tiles of the CPU launch heuristic, every row kind of
# harness.py for the student and every teacher kind against them, two ignored rows.
NUM_ROWS, VOCAB = 9, 300


def make_case(num_rows, vocab, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    student = make_logits(num_rows, vocab, dtype, g)
    teacher = make_teacher(student, g)
    target = make_targets(student, g)
    row_grad_scale = (torch.rand(num_rows, generator=g) * 2.0 - 0.5).to(DEVICE)  # signed, like an upstream
    return student, teacher, target, row_grad_scale


def run(backend, student, teacher, target, beta, temperature, row_grad_scale, *, compute_grad=True, **kwargs):
    """Loss per row and the gradient, written over a copy of the student's logits."""
    grad = student.clone()
    loss = fresh((student.shape[0],))
    kernels("distillation", backend).distillation_chunk(
        grad,
        teacher,
        target,
        beta=beta,
        inv_temperature=1.0 / temperature,
        ignore_index=-100,
        loss_out=loss,
        row_grad_scale=row_grad_scale,
        compute_grad=compute_grad,
        **kwargs,
    )
    return loss, grad


def reference(student, teacher, target, beta, temperature, row_grad_scale, math_dtype):
    """Loss per row and the gradient of ``sum(row_grad_scale * loss)`` with respect to the
    student's logits, in ``math_dtype`` (float32 on the logits as given: eager PyTorch)."""
    leaf = student.detach().to(torch.float64 if math_dtype == torch.float64 else student.dtype).requires_grad_()
    loss = distillation_from_logits_reference(
        leaf, teacher, target, beta=beta, temperature=temperature, reduction="none", math_dtype=math_dtype
    )
    scale = torch.ones_like(loss) if row_grad_scale is None else row_grad_scale.to(math_dtype)
    (grad,) = torch.autograd.grad((loss * scale).sum(), leaf)
    return loss.detach(), grad


def check_against_reference(backend, student, teacher, target, beta, temperature, row_grad_scale, **kwargs):
    loss, grad = run(backend, student, teacher, target, beta, temperature, row_grad_scale, **kwargs)
    truth_loss, truth_grad = reference(student, teacher, target, beta, temperature, row_grad_scale, torch.float64)
    eager_loss, eager_grad = reference(student, teacher, target, beta, temperature, row_grad_scale, torch.float32)
    assert_close_to_reference("loss", loss, truth_loss, eager_loss, torch.float32)
    assert_close_to_reference("grad", grad, truth_grad, eager_grad, student.dtype)
    assert grad.dtype == student.dtype
    if target is not None:
        ignored = target == -100
        assert torch.all(loss[ignored] == 0) and torch.all(grad[ignored] == 0)
    return loss, grad


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference(backend, dtype, beta):
    """Every dtype with every beta; the temperature turns with both (a Latin square: each
    dtype and each beta meets every temperature)."""
    temperature = TEMPERATURES[(DTYPES.index(dtype) + BETAS.index(beta)) % len(TEMPERATURES)]
    student, teacher, target, row_grad_scale = make_case(NUM_ROWS, VOCAB, dtype, seed=BETAS.index(beta))
    check_against_reference(backend, student, teacher, target, beta, temperature, row_grad_scale)


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_targets_no_row_is_ignored(backend):
    student, teacher, _, row_grad_scale = make_case(NUM_ROWS, VOCAB, torch.float32, seed=21)
    loss, _ = check_against_reference(backend, student, teacher, None, 0.5, 1.0, row_grad_scale)
    assert torch.all(loss[::3] > 0), "rows with an independent teacher diverge"


@requires_triton
@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_many_small_tiles(beta):
    """Tiles of 16: the softmax statistics combine over 7 steps, and the student's argmax
    (the anchor of beta > 0) may sit in any tile, also tied with an earlier one."""
    from flce.backends.triton.heuristics import CEKernelConfig

    student, teacher, target, row_grad_scale = make_case(5, 100, torch.float32, seed=23)
    student[3, 90] = student[3, 20] = student[3].max() + 1.0  # a tie across tiles: the first wins
    check_against_reference("triton", student, teacher, target, beta, 0.5, row_grad_scale, config=CEKernelConfig(16, 1))


@pytest.mark.parametrize("beta", [1.0, 0.5])
@pytest.mark.parametrize("backend", BACKENDS)
def test_confident_student_against_a_disagreeing_teacher(backend, beta):
    """q_j ~ 1 where the teacher puts almost nothing: r_j and K are large (~30) and nearly
    equal, and the gradient at j is their small difference. Eager PyTorch (and the plain
    form) lose |r_j| / |gradient| ulps there; the anchor of flce.rows.distillation keeps
    the gradient within a few ulps of its own size."""
    g = torch.Generator().manual_seed(39)
    student = torch.randn(NUM_ROWS, VOCAB, generator=g)
    teacher = torch.randn(NUM_ROWS, VOCAB, generator=g)
    columns = torch.randint(0, VOCAB, (NUM_ROWS,), generator=g)
    every_row = torch.arange(NUM_ROWS)
    student[every_row, columns] += 8.0 + torch.rand(NUM_ROWS, generator=g) * 4.0  # 1 - q_j ~ V e^-20 (T = 0.5)
    teacher[every_row, columns] -= 12.0
    student, teacher = student.to(DEVICE), teacher.to(DEVICE)
    row_grad_scale = torch.rand(NUM_ROWS, generator=g).to(DEVICE) + 0.5
    loss, grad = check_against_reference(backend, student, teacher, None, beta, 0.5, row_grad_scale)
    _, truth = reference(student, teacher, None, beta, 0.5, row_grad_scale, torch.float64)
    _, eager = reference(student, teacher, None, beta, 0.5, row_grad_scale, torch.float32)
    bound = 4 * FP32_FLOOR  # 16 fp32 ulps
    assert relative_error(grad, truth) <= bound
    assert relative_error(eager, truth) > bound, "the case should be hard for the plain form"


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_identical_distributions_give_zero(backend, beta):
    """A student equal to its teacher: loss 0 (to an fp32 rounding of ~1) and gradient 0."""
    student, _, target, row_grad_scale = make_case(6, 50, torch.float32, seed=25)
    loss, grad = run(backend, student, student, target, beta, 1.0, row_grad_scale)
    assert torch.all(loss.abs() <= 4 * torch.finfo(torch.float32).eps)
    assert torch.all(grad.abs() <= 4 * torch.finfo(torch.float32).eps)


# A part of the vocabulary masked to -inf (a -inf bias) is a zero probability, as in the
# cross-entropy and the logprobs: its terms are 0 log 0 = 0, never 0 * inf = NaN. Columns
# masked for both models (every beta), for the teacher alone where the divergence stays
# finite (p_i = 0 in KL(p || q) and in the mixture) and for the student alone (q_i = 0 in
# KL(q || p) and in the mixture); the prefix is longer than a tile of 16.
MASKS = {"both": (slice(0, 40), slice(0, 40)), "teacher": (None, slice(40, 60)), "student": (slice(60, 80), None)}
MASK_BETAS = {"both": BETAS, "teacher": [0.0, 0.5, 0.1], "student": [1.0, 0.5, 0.1]}


@pytest.mark.parametrize("mask,beta", [(mask, beta) for mask in MASKS for beta in MASK_BETAS[mask]])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_masked_part_of_the_vocabulary_is_a_zero_probability(backend, mask, beta):
    student, teacher, target, row_grad_scale = make_case(NUM_ROWS, 100, torch.float32, seed=33)
    student_columns, teacher_columns = MASKS[mask]
    kwargs = {}
    if backend == "triton":
        from flce.backends.triton.heuristics import CEKernelConfig

        kwargs["config"] = CEKernelConfig(16, 1)  # whole tiles masked
    for logits, columns in ((student, student_columns), (teacher, teacher_columns)):
        if columns is not None:
            logits[:, columns] = -float("inf")
    loss, grad = run(backend, student, teacher, target, beta, 0.5, row_grad_scale, **kwargs)
    # The reference on the same -inf columns: their terms are 0, in value and gradient.
    truth_loss, truth_grad = reference(student, teacher.double(), target, beta, 0.5, row_grad_scale, torch.float64)
    assert torch.isfinite(truth_loss).all() and torch.isfinite(truth_grad).all()
    torch.testing.assert_close(loss.double(), truth_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), truth_grad, rtol=1e-5, atol=1e-6)
    if student_columns is not None:
        assert torch.all(grad[:, student_columns] == 0)


@pytest.mark.parametrize("model", ["student", "teacher"])
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_logits_stay_nan(backend, beta, model):
    """A NaN logit (a diverged model) makes its row's loss and gradient NaN, never a 0
    taken for a masked column's; the other rows are untouched."""
    student, teacher, _, row_grad_scale = make_case(4, 50, torch.float32, seed=35)
    (student if model == "student" else teacher)[1, 7] = float("nan")
    loss, grad = run(backend, student, teacher, None, beta, 1.0, row_grad_scale)
    assert torch.isnan(loss[1]) and torch.isnan(grad[1]).all()
    others = [0, 2, 3]
    assert torch.isfinite(loss[others]).all() and torch.isfinite(grad[others]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_only_leaves_the_student_untouched(backend):
    student, teacher, target, row_grad_scale = make_case(NUM_ROWS, VOCAB, torch.bfloat16, seed=27)
    loss_only, untouched = run(backend, student, teacher, target, 0.1, 2.0, row_grad_scale, compute_grad=False)
    with_grad, _ = run(backend, student, teacher, target, 0.1, 2.0, row_grad_scale)
    assert torch.equal(untouched, student)
    assert torch.equal(loss_only, with_grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_row_grad_scale_is_a_scale_of_one(backend):
    student, teacher, target, _ = make_case(NUM_ROWS, VOCAB, torch.float32, seed=29)
    ones = torch.ones(NUM_ROWS, device=DEVICE)
    assert torch.equal(
        run(backend, student, teacher, target, 1.0, 1.0, None)[1],
        run(backend, student, teacher, target, 1.0, 1.0, ones)[1],
    )


@pytest.mark.parametrize("beta", [0.0, 0.5])
@pytest.mark.parametrize("backend", BACKENDS)
def test_all_rows_ignored(backend, beta):
    student, teacher, target, row_grad_scale = make_case(6, VOCAB, torch.bfloat16, seed=31)
    target.fill_(-100)
    loss, grad = run(backend, student, teacher, target, beta, 1.0, row_grad_scale)
    assert torch.all(loss == 0) and torch.all(grad == 0)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_vocabulary_of_one(backend, beta):
    """V = 1: p = q = 1, so the loss and the gradient are exactly 0."""
    student = torch.tensor([[3.5], [-2.0], [40.0]], device=DEVICE)
    teacher = torch.tensor([[-1.0], [5.0], [0.0]], device=DEVICE)
    loss, grad = run(backend, student, teacher, None, beta, 0.5, None)
    assert torch.all(loss == 0) and torch.all(grad == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_teacher_in_another_dtype(backend):
    """The two rows are each read in their own dtype and converted to fp32."""
    student, teacher, target, row_grad_scale = make_case(NUM_ROWS, VOCAB, torch.float32, seed=33)
    check_against_reference(backend, student, teacher.bfloat16(), target, 0.5, 1.0, row_grad_scale)


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_vectors_of_any_stride(backend):
    """Strided targets, loss and row scales, and logits whose row stride exceeds V, give
    the contiguous results bit for bit; the teacher is only read."""
    student, teacher, target, row_grad_scale = make_case(NUM_ROWS, VOCAB, torch.float32, seed=35)
    expected_loss, expected_grad = run(backend, student, teacher, target, 0.5, 2.0, row_grad_scale)
    wide_student = torch.zeros(NUM_ROWS, VOCAB + 3, device=DEVICE)
    wide_student[:, :VOCAB] = student
    wide_teacher = torch.zeros(NUM_ROWS, VOCAB + 5, device=DEVICE)
    wide_teacher[:, :VOCAB] = teacher
    teacher_before = wide_teacher.clone()
    strided_target = torch.zeros(NUM_ROWS, 2, dtype=torch.int32, device=DEVICE)[:, 1]
    strided_target.copy_(target)
    outputs = fresh((NUM_ROWS, 2))
    outputs[:, 1] = row_grad_scale
    kernels("distillation", backend).distillation_chunk(
        wide_student[:, :VOCAB],
        wide_teacher[:, :VOCAB],
        strided_target,
        beta=0.5,
        inv_temperature=0.5,
        ignore_index=-100,
        loss_out=outputs[:, 0],
        row_grad_scale=outputs[:, 1],
        compute_grad=True,
    )
    assert torch.equal(outputs[:, 0], expected_loss)
    assert torch.equal(wide_student[:, :VOCAB], expected_grad)
    assert torch.all(wide_student[:, VOCAB:] == 0)
    assert torch.equal(wide_teacher, teacher_before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_rows_is_a_no_op(backend):
    empty = torch.empty(0, VOCAB, dtype=torch.bfloat16, device=DEVICE)
    run(backend, empty, empty, None, 0.5, 1.0, None)


BAD_ARGUMENTS = {
    "the vocabularies must match": dict(teacher_logits=torch.zeros(4, 6)),
    "beta must be in \\[0, 1\\]": dict(beta=1.5),
    "inv_temperature must be finite and > 0": dict(inv_temperature=float("inf")),
    "target must have shape": dict(target=torch.zeros(5, dtype=torch.int64)),
    "loss_out must be float32": dict(loss_out=torch.zeros(4, dtype=torch.bfloat16)),
    "row_grad_scale must have shape": dict(row_grad_scale=torch.zeros(4, 1)),
    "student_logits must have unit stride": dict(student_logits=torch.zeros(5, 4).T),
}


@pytest.mark.parametrize("message", list(BAD_ARGUMENTS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments_raise_before_any_kernel_runs(backend, message):
    arguments = dict(
        student_logits=torch.zeros(4, 5),
        teacher_logits=torch.zeros(4, 5),
        target=None,
        beta=0.5,
        inv_temperature=1.0,
        ignore_index=-100,
        loss_out=torch.zeros(4),
        row_grad_scale=None,
        compute_grad=True,
    )
    arguments.update(BAD_ARGUMENTS[message])
    student, teacher, target = arguments.pop("student_logits"), arguments.pop("teacher_logits"), arguments.pop("target")
    with pytest.raises(ValueError, match=message):
        kernels("distillation", backend).distillation_chunk(student, teacher, target, **arguments)


def test_beta_selects_liger_divergences():
    """Liger's jsd branches on beta == 0 (forward KL) and beta == 1 (reverse KL)."""
    assert rows.divergence(0.0) == rows.Divergence(0.0, rows.FORWARD_KL, 1.0, 0.0)
    assert rows.divergence(1.0) == rows.Divergence(1.0, rows.REVERSE_KL, 0.0, 1.0)
    assert rows.divergence(0.25) == rows.Divergence(0.25, rows.MIXTURE, 0.25, 0.75)
    for beta in (-0.1, 1.01, float("nan")):
        with pytest.raises(ValueError, match="beta must be in"):
            rows.divergence(beta)


@gpu
@requires_cuda
@requires_triton
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("vocab", [128256, 151936])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_gpu_large_vocabulary(dtype, vocab, beta):
    student, teacher, target, row_grad_scale = make_case(24, vocab, dtype, seed=vocab)
    check_against_reference("triton", student, teacher, target, beta, 0.7, row_grad_scale)


@gpu
@requires_cuda
@requires_triton
def test_gpu_row_offsets_beyond_int32():
    """M * V > 2^31: rows past the 32-bit range must be read and written correctly."""
    num_rows, vocab = 16400, 131072
    g = torch.Generator(device=DEVICE).manual_seed(0)
    student = (torch.randn(num_rows, vocab, device=DEVICE, generator=g) * 4.0).to(torch.bfloat16)
    teacher = (torch.randn(num_rows, vocab, device=DEVICE, generator=g) * 4.0).to(torch.bfloat16)
    tail = slice(num_rows - 8, num_rows)
    expected_loss, expected_grad = run("torch", student[tail], teacher[tail], None, 0.5, 1.0, None)
    loss = fresh((num_rows,))
    kernels("distillation", "triton").distillation_chunk(
        student,
        teacher,
        None,
        beta=0.5,
        inv_temperature=1.0,
        ignore_index=-100,
        loss_out=loss,
        row_grad_scale=None,
        compute_grad=True,
    )
    torch.testing.assert_close(loss[tail], expected_loss)
    torch.testing.assert_close(student[tail], expected_grad)
