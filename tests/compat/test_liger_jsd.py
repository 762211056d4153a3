"""The Liger fused linear JSD shims: Liger 0.8.5's exact parameter names, order and
defaults (frozen below from its source), the float64 reference's loss and gradients, and
the same results as ``flce.fused_linear_distillation``."""

import inspect

import pytest
import torch

import flce
from flce.compat import liger
from flce.reference import distillation_reference
from flce.testing import EPS, TOLERANCE_FACTOR, relative_error
from tests.marks import triton_on_cpu

_NO_DEFAULT = inspect.Parameter.empty
# (name, default) per parameter, copied from liger-kernel 0.8.5's source
# (transformers/fused_linear_jsd.py, transformers/functional.py, ops/fused_linear_jsd.py);
# ``accum_dtype`` is in all three since 0.8.2; the autograd function's ``jsd_impl`` and
# ``jsd_mode``, which Liger's own functional and module pass (as None), in 0.8.5.
LIGER_0_8_5 = {
    "LigerFusedLinearJSD.__init__": [
        ("self", _NO_DEFAULT),
        ("jsd_beta", 0.5),
        ("ignore_index", -100),
        ("temperature", 1.0),
        ("accum_dtype", None),
    ],
    "LigerFusedLinearJSD.forward": [
        ("self", _NO_DEFAULT),
        ("student_input", _NO_DEFAULT),
        ("student_weight", _NO_DEFAULT),
        ("teacher_input", _NO_DEFAULT),
        ("teacher_weight", _NO_DEFAULT),
        ("shift_labels", _NO_DEFAULT),
    ],
    "liger_fused_linear_jsd": [
        ("student_input", _NO_DEFAULT),
        ("student_weight", _NO_DEFAULT),
        ("teacher_input", _NO_DEFAULT),
        ("teacher_weight", _NO_DEFAULT),
        ("shift_labels", None),
        ("jsd_beta", 0.5),
        ("ignore_index", -100),
        ("temperature", 1.0),
        ("accum_dtype", None),
    ],
    "LigerFusedLinearJSDFunction.forward": [
        ("ctx", _NO_DEFAULT),
        ("student_input", _NO_DEFAULT),
        ("student_weight", _NO_DEFAULT),
        ("teacher_input", _NO_DEFAULT),
        ("teacher_weight", _NO_DEFAULT),
        ("shift_labels", None),
        ("jsd_beta", 0.5),
        ("ignore_index", -100),
        ("temperature", 1.0),
        ("accum_dtype", None),
        ("jsd_impl", None),
        ("jsd_mode", None),
    ],
}


@pytest.mark.parametrize("qualname", list(LIGER_0_8_5))
def test_signature_matches_liger(qualname):
    obj = liger
    for part in qualname.split("."):
        obj = getattr(obj, part)
    params = [(p.name, p.default) for p in inspect.signature(obj).parameters.values()]
    assert params == LIGER_0_8_5[qualname]


def _inputs(seed=0, n=10, h_s=12, h_t=7, v=53):
    g = torch.Generator().manual_seed(seed)
    student_input = torch.randn(n, h_s, generator=g)
    student_weight = torch.randn(v, h_s, generator=g) * (3.0 / h_s**0.5)
    teacher_input = torch.randn(n, h_t, generator=g)
    teacher_weight = torch.randn(v, h_t, generator=g) * (3.0 / h_t**0.5)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[[1, 6]] = -100
    return student_input, student_weight, teacher_input, teacher_weight, labels


@pytest.mark.parametrize("with_labels", [True, False], ids=["labels", "no-labels"])
@pytest.mark.parametrize("jsd_beta", [0.0, 0.1, 1.0])
def test_functional_matches_reference(jsd_beta, with_labels):
    """Loss and student gradients against float64, judged by eager fp32's error."""
    x, w, xt, wt, labels = _inputs(seed=int(jsd_beta * 10))
    labels = labels if with_labels else None
    leaves = [t.clone().requires_grad_() for t in (x, w)]
    loss = liger.liger_fused_linear_jsd(*leaves, xt, wt, labels, jsd_beta=jsd_beta, temperature=1.7)
    loss.backward()

    def reference(dtype, math_dtype):
        ref_leaves = [t.to(dtype).requires_grad_() for t in (x, w)]
        ref = distillation_reference(
            *ref_leaves, xt.to(dtype), wt.to(dtype), labels, beta=jsd_beta, temperature=1.7, math_dtype=math_dtype
        )
        ref.backward()
        return ref.detach(), [t.grad for t in ref_leaves]

    truth, truth_grads = reference(torch.float64, torch.float64)
    eager, eager_grads = reference(torch.float32, torch.float32)
    floor = EPS[torch.float32]
    assert relative_error(loss, truth) <= TOLERANCE_FACTOR * relative_error(eager, truth) + floor
    for name, ours, exact, eager_grad in zip(("input", "weight"), leaves, truth_grads, eager_grads, strict=True):
        err, err_eager = relative_error(ours.grad, exact), relative_error(eager_grad, exact)
        assert err <= TOLERANCE_FACTOR * err_eager + floor, f"grad_{name}: {err:.3g} vs eager {err_eager:.3g}"


def test_module_function_and_functional_equal_idiomatic_api():
    x, w, xt, wt, labels = _inputs(seed=3)
    expected = flce.fused_linear_distillation(x, w, xt, wt, labels, beta=0.3, temperature=2.0, ignore_index=-100)
    module = liger.LigerFusedLinearJSD(jsd_beta=0.3, temperature=2.0)
    got = [
        module(x, w, xt, wt, labels),
        liger.liger_fused_linear_jsd(x, w, xt, wt, labels, 0.3, -100, 2.0),
        liger.LigerFusedLinearJSDFunction.apply(x, w, xt, wt, labels, 0.3, -100, 2.0),
    ]
    for loss in got:
        torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    module.jsd_beta = 0.0  # Liger's forward reads its attributes on each call
    torch.testing.assert_close(
        module(x, w, xt, wt, labels), flce.fused_linear_distillation(x, w, xt, wt, labels, beta=0.0, temperature=2.0)
    )


def test_every_label_ignored_gives_zero_not_nan():
    x, w, xt, wt, labels = _inputs(seed=4)
    x.requires_grad_()
    loss = liger.liger_fused_linear_jsd(x, w, xt, wt, torch.full_like(labels, -100))
    loss.backward()
    assert loss == 0 and torch.all(x.grad == 0)


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(jsd_beta=1.5), ValueError, r"beta must be in \[0, 1\]"),
        (dict(temperature=0.0), ValueError, "temperature must be > 0"),
        (dict(ignore_index=1.5), TypeError, "ignore_index must be an int"),
    ],
)
def test_bad_arguments_raise_clear_exceptions(kwargs, error, message):
    with pytest.raises(error, match=message):
        liger.LigerFusedLinearJSD(**kwargs)
    with pytest.raises(error, match=message):
        liger.liger_fused_linear_jsd(*_inputs()[:4], **kwargs)


def test_a_bad_jsd_beta_is_named_as_the_caller_spelled_it():
    from flce.compat.liger import LigerFusedLinearJSD

    with pytest.raises(ValueError, match=r"jsd_beta must be in \[0, 1\]"):
        LigerFusedLinearJSD(jsd_beta=1.5)
    with pytest.raises(TypeError, match="jsd_beta must be a finite float"):
        LigerFusedLinearJSD(jsd_beta=float("nan"))


@pytest.mark.parametrize("accum_dtype", [None, torch.float32, torch.bfloat16])
def test_accum_dtype_is_taken_and_never_accumulates_below_fp32(accum_dtype):
    """Liger's ``accum_dtype`` (dW in that dtype); flce accumulates dW in fp32 whatever
    is asked, which is never less precise: the same loss and gradients as without it."""
    x, w, xt, wt, labels = _inputs(seed=5)
    grads = []
    for call in (
        lambda x, w: liger.liger_fused_linear_jsd(x, w, xt, wt, labels, 0.3, -100, 1.5, accum_dtype),
        lambda x, w: liger.LigerFusedLinearJSDFunction.apply(x, w, xt, wt, labels, 0.3, -100, 1.5, accum_dtype),
        lambda x, w: liger.LigerFusedLinearJSD(0.3, -100, 1.5, accum_dtype)(x, w, xt, wt, labels),
        lambda x, w: liger.liger_fused_linear_jsd(x, w, xt, wt, labels, 0.3, -100, 1.5),
    ):
        leaves = [t.clone().requires_grad_() for t in (x, w)]
        call(*leaves).backward()
        grads.append([t.grad for t in leaves])
    for got in grads[:-1]:
        for ours, expected in zip(got, grads[-1], strict=True):
            torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def test_a_bad_accum_dtype_is_refused():
    with pytest.raises(ValueError, match="accum_dtype must be None, torch.float32 or the weight's dtype"):
        liger.LigerFusedLinearJSD(accum_dtype=torch.int32)
    with pytest.raises(ValueError, match="accum_dtype must be None"):
        liger.liger_fused_linear_jsd(*_inputs()[:4], accum_dtype=torch.float64)


@triton_on_cpu
def test_function_takes_liger_s_eleven_arguments_and_implementation_names():
    """Liger 0.8.5's ``liger_fused_linear_jsd`` and ``LigerFusedLinearJSD`` call
    ``LigerFusedLinearJSDFunction.apply`` with eleven arguments (``..., accum_dtype, None,
    None``): its ``jsd_impl`` ("nvidia-triton", "nvidia-cutedsl" or their legacy bare names)
    selects that flce backend, its ``jsd_mode`` is ignored, and an implementation flce does
    not have is refused by name."""
    x, w, xt, wt, labels = _inputs(seed=6)
    expected = flce.fused_linear_distillation(x, w, xt, wt, labels, beta=0.3, temperature=1.5)
    loss = liger.LigerFusedLinearJSDFunction.apply(x, w, xt, wt, labels, 0.3, -100, 1.5, None, None, None)
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    on_triton = flce.fused_linear_distillation(x, w, xt, wt, labels, beta=0.3, temperature=1.5, backend="triton")
    for jsd_impl in ("nvidia-triton", "triton"):
        loss = liger.LigerFusedLinearJSDFunction.apply(x, w, xt, wt, labels, 0.3, -100, 1.5, None, jsd_impl, "default")
        torch.testing.assert_close(loss, on_triton, rtol=0, atol=0)
    with pytest.raises(ValueError, match="jsd_impl must be None or one of"):
        liger.LigerFusedLinearJSDFunction.apply(x, w, xt, wt, labels, 0.3, -100, 1.5, None, "nvidia-cutile")


def test_labels_liger_would_read_as_kept_tokens_are_refused():
    """Liger 0.8.5 compares each label with ``ignore_index`` only (a label out of [0, V),
    or -100 under ``ignore_index=3``, is a kept token there); flce refuses such labels,
    as every target it takes (the documented difference)."""
    x, w, xt, wt, labels = _inputs(seed=7)
    with pytest.raises(ValueError, match="target values must be in"):
        liger.liger_fused_linear_jsd(x, w, xt, wt, labels, ignore_index=3)
