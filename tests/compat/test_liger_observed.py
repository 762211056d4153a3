"""The Liger shims against Liger-Kernel 0.8.5's observed behaviour, without Liger installed.

Every expectation below was observed from liger-kernel 0.8.5 itself (its Triton kernels
run through Triton's interpreter on CPU, with the same inputs) and is written here as an
eager model of its math (``_liger_semantics``, float64 for the truth, float32 for eager
PyTorch's own error) or as explicit values: which results a call returns and which are
None, the z-loss never weighted and divided by the valid-token count, the accuracy of
``"mean"`` and ``"sum"`` a fraction of the valid tokens, token scaling multiplying the
loss, the z-loss and the gradient by the detached p(target). The deliberate differences
(fp32 results where Liger rounds to the inputs' dtype, accuracy 0 where Liger's is 0/0)
are marked where tested. ``test_matches_installed_liger`` compares with Liger itself
when it is installed.
"""

import itertools
import os

import pytest
import torch

import flce
from flce.compat import liger
from flce.testing import EPS, TOLERANCE_FACTOR, relative_error
from tests.marks import triton_on_cpu

N, H, V = 9, 8, 13
OPTION_GRID = list(
    itertools.product(
        ["mean", "sum", "none"],  # reduction
        [0.0, 0.1],  # label_smoothing
        [0.0, 1e-2],  # lse_square_scale
        [None, 3.0],  # softcap
        [False, True],  # ce_weight
        [False, True],  # use_token_scaling
    )
)


def _liger_semantics(
    logits, target, ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap, use_token_scaling
):
    """(loss, z_loss, token_accuracy, predicted_tokens) as Liger 0.8.5 computes them,
    differentiable through ``logits``, in ``logits``' dtype."""
    z = logits if softcap is None else softcap * torch.tanh(logits / softcap)
    valid = target != ignore_index
    y = torch.where(valid, target, 0)
    lse = torch.logsumexp(z, dim=-1)
    weight = torch.ones(z.shape[-1], dtype=z.dtype) if ce_weight is None else ce_weight.to(z.dtype)
    ce = (1 - label_smoothing) * weight[y] * (lse - z.gather(1, y[:, None]).squeeze(1))
    ce = ce + label_smoothing / z.shape[-1] * (weight * (lse[:, None] - z)).sum(-1)
    z_term = lse_square_scale * lse**2  # never weighted by the class weights
    n_valid = valid.sum()
    if reduction == "mean":  # each token divided before any token scaling
        ce = ce / (weight[y] * valid).sum()
        z_term = z_term / n_valid
    if use_token_scaling:  # p(target) of the soft-capped logits, no gradient through it
        scale = torch.softmax(z.detach(), dim=-1).gather(1, y[:, None]).squeeze(1)
        ce, z_term = ce * scale, z_term * scale
    ce, z_term = torch.where(valid, ce, 0.0), torch.where(valid, z_term, 0.0)
    predicted = torch.where(valid, z.detach().argmax(-1), -1)  # the first maximum
    correct = ((predicted == target) & valid).to(torch.float32)
    if reduction == "none":
        return ce + z_term, z_term, correct, predicted
    return (ce + z_term).sum(), z_term.sum(), correct.sum() / n_valid, predicted


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.8
    b = torch.randn(V, generator=g)
    t = torch.randint(0, V, (N,), generator=g)
    t[[2, 5]] = -100
    class_weights = torch.rand(V, generator=g) + 0.5
    upstream = torch.randn(N, generator=g)
    return x, w, b, t, class_weights, upstream


def _backward(loss, reduction, upstream):
    (loss * upstream).sum().backward() if reduction == "none" else (loss * 1.7).backward()


def _model_run(dtype, x, w, b, t, class_weights, upstream, options):
    leaves = [tensor.to(dtype, copy=True).requires_grad_() for tensor in (x, w, b)]
    logits = leaves[0] @ leaves[1].T + leaves[2]
    results = _liger_semantics(logits, t, class_weights, -100, *options)
    _backward(results[0], options[2], upstream.to(dtype))
    return results, [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("option_values", OPTION_GRID, ids=lambda v: "-".join(map(str, v)))
def test_fused_function_matches_liger_semantics(option_values):
    """``LigerFusedLinearCrossEntropyFunction.apply`` with every flag set: loss, z-loss,
    accuracy, predictions and the gradients of input, weight and bias, against the model
    of Liger 0.8.5 in float64, judged by eager fp32's own error."""
    reduction, label_smoothing, lse_square_scale, softcap, with_class_weights, use_token_scaling = option_values
    x, w, b, t, class_weights, upstream = _inputs()
    class_weights = class_weights if with_class_weights else None
    options = (lse_square_scale, label_smoothing, reduction, softcap, use_token_scaling)
    truth, truth_grads = _model_run(torch.float64, x, w, b, t, class_weights, upstream, options)
    eager, eager_grads = _model_run(torch.float32, x, w, b, t, class_weights, upstream, options)

    leaves = [tensor.clone().requires_grad_() for tensor in (x, w, b)]
    out = liger.LigerFusedLinearCrossEntropyFunction.apply(
        *leaves[:2], t, leaves[2], class_weights, -100, lse_square_scale, label_smoothing, reduction, softcap,
        True, None, use_token_scaling, True, True,
    )  # fmt: skip
    assert isinstance(out, tuple) and len(out) == 4
    _backward(out[0], reduction, upstream)
    for name, ours, exact, eager_value in zip(("loss", "z_loss"), out, truth, eager, strict=False):
        assert ours.dtype == torch.float32 and ours.shape == exact.shape, name
        err, err_eager = relative_error(ours, exact), relative_error(eager_value, exact)
        assert err <= TOLERANCE_FACTOR * err_eager + EPS[torch.float32], f"{name}: {err:.3g} vs eager {err_eager:.3g}"
    torch.testing.assert_close(out[2], truth[2].float(), rtol=0, atol=0)
    assert torch.equal(out[3], truth[3])
    for name, leaf, exact, eager_grad in zip(
        ("input", "weight", "bias"), leaves, truth_grads, eager_grads, strict=True
    ):
        err, err_eager = relative_error(leaf.grad, exact), relative_error(eager_grad, exact)
        assert err <= TOLERANCE_FACTOR * err_eager + EPS[torch.float32], f"grad_{name}: {err:.3g} vs {err_eager:.3g}"


@triton_on_cpu
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_function_matches_liger_semantics_on_triton(reduction):
    """The standalone cross-entropy on the Triton backend (its kernels through the
    interpreter on CPU) with every option of Liger's: the same model."""
    x, w, b, t, class_weights, upstream = _inputs(seed=1)
    logits = (x @ w.T + b) * 2
    options = (1e-2, 0.1, reduction, 3.0, False)
    exact = logits.double().requires_grad_()
    truth = _liger_semantics(exact, t, class_weights, -100, *options)
    _backward(truth[0], reduction, upstream.double())
    ours = logits.clone().requires_grad_()
    out = flce.cross_entropy(
        ours, t, weight=class_weights, ignore_index=-100, lse_square_scale=1e-2, label_smoothing=0.1,
        reduction=reduction, softcap=3.0, return_z_loss=True, return_token_accuracy=True,
        return_predicted_tokens=True, backend="triton",
    )  # fmt: skip
    shim = liger.LigerCrossEntropyFunction.apply(
        logits.clone(), t, class_weights, -100, 1e-2, 0.1, reduction, 3.0, True, True, True
    )
    _backward(out.loss, reduction, upstream)
    for ours_value, shim_value, exact_value in zip((out.loss, out.z_loss), shim[:2], truth[:2], strict=True):
        torch.testing.assert_close(ours_value, exact_value.float(), rtol=2e-6, atol=1e-6)
        torch.testing.assert_close(shim_value, exact_value.float(), rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(ours.grad, exact.grad.float(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out.token_accuracy, truth[2], rtol=0, atol=0)
    assert torch.equal(out.predicted_tokens, truth[3])


FLAG_SUBSETS = list(itertools.product([False, True], repeat=3))


@pytest.mark.parametrize("flags", FLAG_SUBSETS, ids=lambda f: "z{}-acc{}-pred{}".format(*map(int, f)))
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_every_combination_of_return_flags_returns_what_liger_returns(flags, reduction):
    """As Liger 0.8.5: the functions and modules return the bare loss without a flag, else
    ``CrossEntropyOutput`` whose unrequested fields are None; the autograd functions a
    4-tuple (loss, z_loss, token_accuracy, predicted_tokens), None where not requested.
    The z-loss is returned (0 without ``lse_square_scale``) when asked for; the accuracy
    is fp32, the predictions int64; per token under ``"none"``."""
    return_z_loss, return_token_accuracy, return_predicted_tokens = flags
    x, w, b, t, class_weights, _ = _inputs(seed=2)
    logits = x @ w.T + b
    kwargs = dict(
        reduction=reduction,
        return_z_loss=return_z_loss,
        return_token_accuracy=return_token_accuracy,
        return_predicted_tokens=return_predicted_tokens,
    )
    fused_tuple = liger.LigerFusedLinearCrossEntropyFunction.apply(
        x, w, t, b, None, -100, 0.0, 0.0, reduction, None, return_z_loss, None, False, return_token_accuracy,
        return_predicted_tokens,
    )  # fmt: skip
    ce_tuple = liger.LigerCrossEntropyFunction.apply(
        logits, t, None, -100, 0.0, 0.0, reduction, None, return_z_loss, return_token_accuracy, return_predicted_tokens
    )
    structured = [
        liger.liger_fused_linear_cross_entropy(x, w, t, b, **kwargs),
        liger.LigerFusedLinearCrossEntropyLoss(**kwargs)(w, x, t, b),
        liger.liger_cross_entropy(logits, t, **kwargs),
        liger.LigerCrossEntropyLoss(**kwargs)(logits, t),
    ]
    rows = N if reduction == "none" else None
    truth = _liger_semantics(logits.double(), t, None, -100, 0.0, 0.0, reduction, None, False)
    for result in [fused_tuple, ce_tuple, *structured]:
        if isinstance(result, tuple):
            loss, z_loss, accuracy, predicted = result
        elif not any(flags):
            assert isinstance(result, torch.Tensor)
            loss, z_loss, accuracy, predicted = result, None, None, None
        else:
            assert isinstance(result, liger.CrossEntropyOutput)
            loss, z_loss, accuracy, predicted = (
                result.loss, result.z_loss, result.token_accuracy, result.predicted_tokens
            )  # fmt: skip
        assert loss.dtype == torch.float32 and loss.shape == truth[0].shape
        torch.testing.assert_close(loss, truth[0].float())
        assert (z_loss is None) == (not return_z_loss)
        if z_loss is not None:
            assert z_loss.dtype == torch.float32 and z_loss.shape == truth[1].shape and not z_loss.any()
        assert (accuracy is None) == (not return_token_accuracy)
        if accuracy is not None:
            assert accuracy.dtype == torch.float32 and accuracy.shape == ((rows,) if rows else ())
            torch.testing.assert_close(accuracy, truth[2], rtol=0, atol=0)
        assert (predicted is None) == (not return_predicted_tokens)
        if predicted is not None:
            assert predicted.dtype == torch.int64 and torch.equal(predicted, truth[3])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_every_token_ignored(reduction):
    """Liger 0.8.5: loss 0, z-loss 0, every gradient 0, predictions -1, per-token accuracy
    0; the accuracy of "mean"/"sum" is 0/0 = NaN there, where flce returns 0 (the
    documented difference)."""
    x, w, b, t, class_weights, _ = _inputs(seed=3)
    leaves = [tensor.clone().requires_grad_() for tensor in (x, w, b)]
    out = liger.liger_fused_linear_cross_entropy(
        *leaves[:2], torch.full_like(t, -100), leaves[2], class_weights, lse_square_scale=1e-2, label_smoothing=0.1,
        reduction=reduction, return_z_loss=True, use_token_scaling=True, return_token_accuracy=True,
        return_predicted_tokens=True,
    )  # fmt: skip
    out.loss.sum().backward()
    for value in (out.loss, out.z_loss, out.token_accuracy):
        assert not value.isnan().any() and not value.any()
    assert torch.equal(out.predicted_tokens, torch.full((N,), -1))
    assert all(not leaf.grad.any() for leaf in leaves)


def test_class_weights_summing_to_zero_give_the_all_ignored_rule():
    """Liger 0.8.5 divides the mean's cross-entropy part by the targets' class weights'
    sum: 0/0 = NaN loss and gradients where it is 0; flce gives that part 0 and gradient 0
    (the documented difference), the z-loss part still divided by the valid tokens."""
    x, w, b, t, _, _ = _inputs(seed=8)
    leaves = [tensor.clone().requires_grad_() for tensor in (x, w, b)]
    class_weights = torch.zeros(V)
    out = liger.liger_fused_linear_cross_entropy(
        *leaves[:2], t, leaves[2], class_weights, lse_square_scale=1e-2, return_z_loss=True
    )
    out.loss.backward()
    truth = _liger_semantics(x @ w.T + b, t, None, -100, 1e-2, 0.0, "mean", None, False)
    torch.testing.assert_close(out.loss, truth[1])  # the z-loss part alone
    torch.testing.assert_close(out.z_loss, truth[1])
    assert all(leaf.grad.isfinite().all() for leaf in leaves)


def test_z_loss_and_accuracy_carry_no_gradient():
    """Liger 0.8.5 returns the z-loss and the accuracy with a grad_fn whose backward ignores
    their upstream gradients (``z_loss.backward()`` gives zero gradients there); flce
    returns them detached: ``loss + z_loss`` has the gradients of ``loss`` in both."""
    x, w, b, t, _, _ = _inputs(seed=10)
    leaves = [tensor.clone().requires_grad_() for tensor in (x, w, b)]
    loss, z_loss, accuracy, _ = liger.LigerFusedLinearCrossEntropyFunction.apply(
        *leaves[:2], t, leaves[2], None, -100, 1e-2, 0.0, "mean", None, True, None, False, True
    )
    assert not z_loss.requires_grad and not accuracy.requires_grad
    (loss + z_loss).backward()
    expected = [tensor.clone().requires_grad_() for tensor in (x, w, b)]
    liger.liger_fused_linear_cross_entropy(*expected[:2], t, expected[2], lse_square_scale=1e-2).backward()
    for leaf, reference in zip(leaves, expected, strict=True):
        torch.testing.assert_close(leaf.grad, reference.grad, rtol=0, atol=0)


def test_low_precision_class_weights_are_summed_exactly():
    """Liger 0.8.5 sums bf16 class weights in bf16 for the mean's divisor (observed: 4.4070
    where the exact loss of the same weights is 4.4102); flce's divisor is the exact sum of
    the weights as given (the documented difference)."""
    x, w, b, t, class_weights, _ = _inputs(seed=9)
    class_weights = (class_weights * 3).bfloat16()
    loss = liger.liger_fused_linear_cross_entropy(x, w, t, b, class_weights)
    exact = torch.nn.functional.cross_entropy((x @ w.T + b).double(), t, weight=class_weights.double())
    torch.testing.assert_close(loss, exact.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_losses_are_fp32_for_low_precision_inputs(dtype):
    """Liger 0.8.5 returns the standalone cross-entropy's loss and z-loss in the logits'
    dtype and the fused loss's z-loss in the input's (rounded); flce returns both fp32,
    the exact value of the same logits (the documented difference). The gradients are in
    each tensor's dtype, as Liger's."""
    x, w, b, t, _, _ = _inputs(seed=4)
    logits = (x @ w.T + b).to(dtype).requires_grad_()
    for reduction in ("mean", "none"):
        out = liger.liger_cross_entropy(logits, t, reduction=reduction, lse_square_scale=1e-2, return_z_loss=True)
        truth = _liger_semantics(logits.double(), t, None, -100, 1e-2, 0.0, reduction, None, False)
        assert out.loss.dtype == out.z_loss.dtype == torch.float32
        torch.testing.assert_close(out.loss, truth[0].float())
        torch.testing.assert_close(out.z_loss, truth[1].float())
    leaves = [tensor.to(dtype).requires_grad_() for tensor in (x, w, b)]
    out = liger.liger_fused_linear_cross_entropy(*leaves[:2], t, leaves[2], lse_square_scale=1e-2, return_z_loss=True)
    assert out.loss.dtype == out.z_loss.dtype == torch.float32
    out.loss.backward()
    assert [leaf.grad.dtype for leaf in leaves] == [dtype] * 3


@triton_on_cpu
@pytest.mark.parametrize("ce_impl", ["nvidia-triton", "NVIDIA-Triton", "triton"])
def test_ce_impl_takes_liger_implementation_names(ce_impl):
    """Liger 0.8.5 registers its kernels as "nvidia-triton" and "nvidia-cutedsl" (the bare
    "triton" and "cutedsl" being its legacy aliases): each selects that flce backend."""
    x, w, b, t, _, _ = _inputs(seed=5)
    expected = flce.fused_linear_cross_entropy(x, w, t, bias=b, backend="triton")
    loss = liger.LigerFusedLinearCrossEntropyFunction.apply(
        x, w, t, b, None, -100, 0.0, 0.0, "mean", None, False, None, False, False, False, ce_impl, "default"
    )[0]
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    assert liger._backend_from_ce_impl("nvidia-cutedsl") == "cutedsl"
    with pytest.raises(ValueError, match="ce_impl must be None or one of"):
        liger.LigerFusedLinearCrossEntropyFunction.apply(
            x, w, t, b, None, -100, 0.0, 0.0, "mean", None, False, None, False, False, False, "nvidia-cutile"
        )


def _liger_kernel_runs_here():
    try:
        import liger_kernel.ops  # noqa: F401
    except Exception:  # absent, or its import fails on this machine
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not _liger_kernel_runs_here(), reason="liger-kernel is not installed (or cannot run here)")
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_installed_liger(reduction):
    """Against Liger itself where it is installed: the options its kernel takes through
    Triton's interpreter (no class weights or soft-cap there: the interpreter hands its
    kernel Python floats, on which it calls ``.to``), with every return flag."""
    from liger_kernel.ops import LigerFusedLinearCrossEntropyFunction as LigerFunction

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, w, b, t, _, upstream = (tensor.to(device) for tensor in _inputs(seed=6))
    results = []
    for function in (LigerFunction, liger.LigerFusedLinearCrossEntropyFunction):
        leaves = [tensor.clone().requires_grad_() for tensor in (x, w, b)]
        out = function.apply(
            *leaves[:2], t, leaves[2], None, -100, 1e-2, 0.1, reduction, None, True, torch.float32, True, True, True
        )
        (out[0] * upstream).sum().backward() if reduction == "none" else out[0].backward()
        results.append((out, [leaf.grad for leaf in leaves]))
    (theirs, their_grads), (ours, our_grads) = results
    for their_value, our_value in zip(theirs, ours, strict=True):
        torch.testing.assert_close(our_value, their_value, rtol=1e-5, atol=1e-6)
    for their_grad, our_grad in zip(their_grads, our_grads, strict=True):
        torch.testing.assert_close(our_grad, their_grad, rtol=1e-5, atol=1e-6)
