"""The float64 references of the RL and distillation heads against independent forms of
the same math: torch.distributions, F.kl_div, the textbook JSD, and Liger 0.8.5's
fused_linear_jsd conventions transcribed step by step (ops/jsd.py: the per-element loss
and dX on log-probabilities; ops/fused_linear_jsd.py: the temperature, the mean over the
rows not ignored and the chain rule back to the logits)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flce.reference import (
    distillation_from_logits_reference,
    distillation_reference,
    logprobs_from_logits_reference,
    logprobs_reference,
)

N, H, V = 10, 6, 13


def tensors(seed=0, h_teacher=H):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    b = torch.randn(V, generator=g, dtype=torch.float64)
    x_t = torch.randn(N, h_teacher, generator=g, dtype=torch.float64)
    w_t = torch.randn(V, h_teacher, generator=g, dtype=torch.float64)
    target = torch.randint(0, V, (N,), generator=g)
    target[[2, 7]] = -100
    return x, w, b, x_t, w_t, target


def test_logprobs_reference_against_categorical():
    x, w, b, _, _, target = tensors()
    logits = x @ w.T + b
    ref = logprobs_reference(x, w, target, b, temperature=0.7)
    dist = torch.distributions.Categorical(logits=logits / 0.7)
    valid = target != -100
    torch.testing.assert_close(ref.logprobs[valid], dist.log_prob(target.clamp_min(0))[valid])
    torch.testing.assert_close(ref.entropy[valid], dist.entropy()[valid])
    assert torch.all(ref.logprobs[~valid] == 0) and torch.all(ref.entropy[~valid] == 0)


def test_logprobs_reference_differentiates_input_weight_and_bias():
    x, w, b, _, _, target = tensors(1)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    ref = logprobs_reference(*leaves[:2], target, leaves[2], temperature=2.0)
    (ref.logprobs.sum() + 0.5 * ref.entropy.sum()).backward()
    logits = (x @ w.T + b).requires_grad_()
    direct = logprobs_from_logits_reference(logits, target, temperature=2.0)
    (direct.logprobs.sum() + 0.5 * direct.entropy.sum()).backward()
    torch.testing.assert_close(leaves[2].grad, logits.grad.sum(dim=0))
    torch.testing.assert_close(leaves[0].grad, logits.grad @ w)
    assert torch.all(logits.grad[target == -100] == 0)


def liger_fused_linear_jsd(x, w, x_t, w_t, shift_labels, beta, ignore_index, temperature):
    """Liger 0.8.5's fused_linear_jsd forward, one chunk, in float64: returns the loss and
    the gradient of the student's logits as Liger computes it."""
    student = (x @ w.T) / temperature
    teacher = (x_t @ w_t.T) / temperature
    X = torch.log_softmax(student, dim=-1)  # log Q, the student
    Y = torch.log_softmax(teacher, dim=-1)  # log P, the teacher
    n_non_ignore = int((shift_labels != ignore_index).sum()) if shift_labels is not None else X.shape[0]
    if beta == 0.0:  # forward KL
        P = torch.exp(Y)
        loss, dX = P * (Y - X), -P
    elif beta == 1.0:  # reverse KL
        Q = torch.exp(X)
        loss = Q * (X - Y)
        dX = loss + Q
    else:
        max_val = torch.maximum(X, Y)
        log_M = max_val + torch.log(beta * torch.exp(Y - max_val) + (1 - beta) * torch.exp(X - max_val))
        Q, P = torch.exp(X), torch.exp(Y)
        loss = beta * P * (Y - log_M) + (1 - beta) * Q * (X - log_M)
        dX = (1 - beta) * Q * (X - log_M)
    if n_non_ignore > 0:
        loss, dX = loss / n_non_ignore, dX / n_non_ignore
    if shift_labels is not None:
        ignored = (shift_labels == ignore_index)[:, None]
        loss, dX = loss.masked_fill(ignored, 0), dX.masked_fill(ignored, 0)
    softmax = torch.softmax(student, dim=-1)
    grad_logits = (dX - softmax * dX.sum(dim=-1, keepdim=True)) / temperature
    return loss.sum(), grad_logits


@pytest.mark.parametrize("with_labels", [True, False])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5, 0.1])
def test_distillation_reference_follows_liger(beta, temperature, with_labels):
    """Same loss and student-logit gradient as Liger's fused_linear_jsd (reduction "mean");
    the teacher may have another hidden size."""
    x, w, _, x_t, w_t, target = tensors(2, h_teacher=H + 3)
    labels = target if with_labels else None
    liger_loss, liger_grad = liger_fused_linear_jsd(x, w, x_t, w_t, labels, beta, -100, temperature)
    x_leaf, w_leaf = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = distillation_reference(x_leaf, w_leaf, x_t, w_t, labels, beta=beta, temperature=temperature)
    loss.backward()
    torch.testing.assert_close(loss, liger_loss)
    torch.testing.assert_close(x_leaf.grad, liger_grad @ w)
    torch.testing.assert_close(w_leaf.grad, liger_grad.T @ x)


def test_distillation_reference_special_cases():
    """beta = 0: F.kl_div(log q, log p); beta = 1: the reverse; beta = 1/2: the textbook
    JSD with M = (p + q) / 2."""
    x, w, _, x_t, w_t, _ = tensors(3)
    log_q = torch.log_softmax(x @ w.T, dim=-1)
    log_p = torch.log_softmax(x_t @ w_t.T, dim=-1)
    forward = F.kl_div(log_q, log_p, log_target=True, reduction="sum") / N
    reverse = F.kl_div(log_p, log_q, log_target=True, reduction="sum") / N
    m = (log_p.exp() + log_q.exp()) / 2
    jsd = (0.5 * (log_p.exp() * (log_p - m.log())).sum() + 0.5 * (log_q.exp() * (log_q - m.log())).sum()) / N
    for beta, expected in ((0.0, forward), (1.0, reverse), (0.5, jsd)):
        torch.testing.assert_close(distillation_reference(x, w, x_t, w_t, beta=beta), expected)
    assert jsd <= math.log(2)


# Columns masked to -inf for both models, the teacher alone (p = 0) or the student alone
# (q = 0), with the betas whose divergence stays finite there.
MASKED_COLUMNS = {"both": ([0, 1, 7], [0, 1, 7]), "teacher": ([], [3, 9]), "student": ([4, 12], [])}
MASKED_BETAS = {"both": [0.0, 1.0, 0.5, 0.1], "teacher": [0.0, 0.5, 0.1], "student": [1.0, 0.5, 0.1]}


@pytest.mark.parametrize("mask,beta", [(mask, beta) for mask in MASKED_COLUMNS for beta in MASKED_BETAS[mask]])
def test_distillation_reference_at_masked_columns_is_their_absence(mask, beta):
    """A -inf logit is a zero probability, whose terms are 0 (0 log 0 = 0), in value and
    gradient: the loss and the student's gradient are their limits at a logit of -1e4
    (where every probability is exactly 0 in float64 and every log finite), with exact
    zeros in the gradient of the student's masked columns, and no NaN (0 * inf was NaN)."""
    x, w, _, x_t, w_t, target = tensors(7)
    student_columns, teacher_columns = MASKED_COLUMNS[mask]
    results = []
    for masked_value in (-math.inf, -1e4):
        student, teacher = (x @ w.T).requires_grad_(), x_t @ w_t.T
        with torch.no_grad():
            student[:, student_columns] = masked_value
            teacher[:, teacher_columns] = masked_value
        loss = distillation_from_logits_reference(student, teacher, target, beta=beta, reduction="none")
        (grad,) = torch.autograd.grad((loss * torch.linspace(0.5, 2, N, dtype=torch.float64)).sum(), student)
        results.append((loss.detach(), grad))
    (loss, grad), limit = results
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    torch.testing.assert_close((loss, grad), limit, rtol=1e-12, atol=1e-12)
    assert torch.all(grad[:, student_columns] == 0)


def test_distillation_reference_reductions_and_ignored_rows():
    x, w, b, x_t, w_t, target = tensors(4)
    rows = distillation_reference(x, w, x_t, w_t, target, reduction="none", student_bias=b)
    valid = target != -100
    assert rows.shape == (N,) and torch.all(rows[~valid] == 0) and torch.all(rows[valid] > 0)
    total = distillation_reference(x, w, x_t, w_t, target, reduction="sum", student_bias=b)
    mean = distillation_reference(x, w, x_t, w_t, target, student_bias=b)
    torch.testing.assert_close(total, rows.sum())
    torch.testing.assert_close(mean, rows.sum() / valid.sum())


def test_distillation_reference_all_ignored_is_zero_without_nan():
    x, w, _, x_t, w_t, target = tensors(5)
    x_leaf = x.clone().requires_grad_()
    loss = distillation_reference(x_leaf, w, x_t, w_t, torch.full_like(target, -100))
    loss.backward()
    assert loss.item() == 0 and torch.all(x_leaf.grad == 0)


def test_distillation_reference_gives_the_teacher_no_gradient():
    x, w, b, x_t, w_t, target = tensors(6)
    leaves = [t.clone().requires_grad_() for t in (x, w, x_t, w_t, b)]
    x_s, w_s, x_teacher, w_teacher, b_t = leaves
    distillation_reference(x_s, w_s, x_teacher, w_teacher, target, teacher_bias=b_t).backward()
    assert x_s.grad is not None and w_s.grad is not None
    assert x_teacher.grad is None and w_teacher.grad is None and b_t.grad is None


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(beta=1.5), "beta must be in"),
        (dict(reduction="mean_over_tokens"), "reduction must be one of"),
    ],
)
def test_distillation_reference_rejects_bad_options(arguments, message):
    x, w, _, x_t, w_t, _ = tensors(7)
    with pytest.raises(ValueError, match=message):
        distillation_reference(x, w, x_t, w_t, **arguments)


def test_distillation_reference_rejects_vocabularies_that_differ():
    x, w, _, x_t, w_t, _ = tensors(8)
    with pytest.raises(ValueError, match="vocabularies must match"):
        distillation_reference(x, w, x_t, w_t[:-1])
    with pytest.raises(ValueError, match="same shape"):
        distillation_from_logits_reference(x @ w.T, (x_t @ w_t.T)[:, :-1])
