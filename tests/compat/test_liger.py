"""The Liger shims: Liger 0.8.5's exact parameter names, order and defaults (frozen
below from its source), and the same results as flce's idiomatic API."""

import inspect

import pytest
import torch

import flce
from flce.compat import liger

_NO_DEFAULT = inspect.Parameter.empty
# (name, default) per parameter, copied from liger-kernel 0.8.5's source.
LIGER_0_8_5 = {
    "LigerFusedLinearCrossEntropyFunction.forward": [
        ("ctx", _NO_DEFAULT),
        ("_input", _NO_DEFAULT),
        ("weight", _NO_DEFAULT),
        ("target", _NO_DEFAULT),
        ("bias", None),
        ("ce_weight", None),
        ("ignore_index", -100),
        ("lse_square_scale", 0.0),
        ("label_smoothing", 0.0),
        ("reduction", "mean"),
        ("softcap", None),
        ("return_z_loss", False),
        ("accum_dtype", None),
        ("use_token_scaling", False),
        ("return_token_accuracy", False),
        ("return_predicted_tokens", False),
        ("ce_impl", None),
        ("ce_mode", None),
        ("chunk_mem_const", 1),
    ],
    "liger_fused_linear_cross_entropy": [
        ("input", _NO_DEFAULT),
        ("weight", _NO_DEFAULT),
        ("target", _NO_DEFAULT),
        ("bias", None),
        ("ce_weight", None),
        ("ignore_index", -100),
        ("lse_square_scale", 0.0),
        ("label_smoothing", 0.0),
        ("reduction", "mean"),
        ("softcap", None),
        ("return_z_loss", False),
        ("accum_dtype", None),
        ("use_token_scaling", False),
        ("return_token_accuracy", False),
        ("return_predicted_tokens", False),
        ("chunk_mem_const", 1),
    ],
    "LigerFusedLinearCrossEntropyLoss.__init__": [
        ("self", _NO_DEFAULT),
        ("ce_weight", None),
        ("ignore_index", -100),
        ("lse_square_scale", 0.0),
        ("label_smoothing", 0.0),
        ("reduction", "mean"),
        ("softcap", None),
        ("return_z_loss", False),
        ("accum_dtype", None),
        ("use_token_scaling", False),
        ("return_token_accuracy", False),
        ("return_predicted_tokens", False),
    ],
    "LigerFusedLinearCrossEntropyLoss.forward": [
        ("self", _NO_DEFAULT),
        ("lin_weight", _NO_DEFAULT),
        ("_input", _NO_DEFAULT),
        ("target", _NO_DEFAULT),
        ("bias", None),
    ],
    "LigerCrossEntropyLoss.__init__": [
        ("self", _NO_DEFAULT),
        ("weight", None),
        ("ignore_index", -100),
        ("lse_square_scale", 0.0),
        ("label_smoothing", 0.0),
        ("reduction", "mean"),
        ("softcap", None),
        ("return_z_loss", False),
        ("return_token_accuracy", False),
        ("return_predicted_tokens", False),
    ],
    "LigerCrossEntropyLoss.forward": [
        ("self", _NO_DEFAULT),
        ("_input", _NO_DEFAULT),
        ("target", _NO_DEFAULT),
    ],
    "LigerCrossEntropyFunction.forward": [
        ("ctx", _NO_DEFAULT),
        ("_input", _NO_DEFAULT),
        ("target", _NO_DEFAULT),
        ("weight", _NO_DEFAULT),
        ("ignore_index", -100),
        ("lse_square_scale", 0.0),
        ("label_smoothing", 0.0),
        ("reduction", "mean"),
        ("softcap", None),
        ("return_z_loss", False),
        ("return_token_accuracy", False),
        ("return_predicted_tokens", False),
    ],
    "liger_cross_entropy": [
        ("input", _NO_DEFAULT),
        ("target", _NO_DEFAULT),
        ("weight", None),
        ("size_average", None),
        ("ignore_index", -100),
        ("reduce", None),
        ("reduction", "mean"),
        ("label_smoothing", 0.0),
        ("lse_square_scale", 0.0),
        ("softcap", None),
        ("return_z_loss", False),
        ("return_token_accuracy", False),
        ("return_predicted_tokens", False),
    ],
}


@pytest.mark.parametrize("qualname", list(LIGER_0_8_5))
def test_signature_matches_liger(qualname):
    obj = liger
    for part in qualname.split("."):
        obj = getattr(obj, part)
    params = [(p.name, p.default) for p in inspect.signature(obj).parameters.values()]
    assert params == LIGER_0_8_5[qualname]


def _inputs(requires_grad=True):
    torch.manual_seed(0)
    x = torch.randn(29, 16, requires_grad=requires_grad)
    w = (torch.randn(37, 16) * 0.8).requires_grad_(requires_grad)
    b = torch.randn(37, requires_grad=requires_grad)
    t = torch.randint(0, 37, (29,))
    t[::5] = -100
    return x, w, b, t


OPTIONS = dict(
    ignore_index=-100,
    lse_square_scale=1e-3,
    label_smoothing=0.1,
    reduction="mean",
    softcap=5.0,
    return_z_loss=True,
    use_token_scaling=True,
    return_token_accuracy=True,
    return_predicted_tokens=True,
)


def _grads(*tensors):
    return [t.grad.clone() for t in tensors]


def test_function_functional_and_module_equal_idiomatic_api():
    cw = torch.rand(37) + 0.5
    x, w, b, t = _inputs()
    expected = flce.fused_linear_cross_entropy(x, w, t, bias=b, ce_weight=cw, **OPTIONS)
    (expected.loss * 2).backward()
    expected_grads = _grads(x, w, b)

    calls = {
        "function": lambda x, w, b: liger.LigerFusedLinearCrossEntropyFunction.apply(
            x, w, t, b, cw, -100, 1e-3, 0.1, "mean", 5.0, True, None, True, True, True
        ),
        "functional": lambda x, w, b: liger.liger_fused_linear_cross_entropy(x, w, t, b, cw, **OPTIONS),
        "module": lambda x, w, b: liger.LigerFusedLinearCrossEntropyLoss(ce_weight=cw, **OPTIONS)(w, x, t, b),
    }
    for name, call in calls.items():
        x, w, b, _ = _inputs()
        out = call(x, w, b)
        if name == "function":
            assert isinstance(out, tuple) and len(out) == 4
            loss, z_loss, accuracy, predicted = out
        else:
            assert isinstance(out, flce.CrossEntropyOutput)
            loss, z_loss, accuracy, predicted = out.loss, out.z_loss, out.token_accuracy, out.predicted_tokens
        torch.testing.assert_close(loss, expected.loss, rtol=0, atol=0)
        torch.testing.assert_close(z_loss, expected.z_loss, rtol=0, atol=0)
        torch.testing.assert_close(accuracy, expected.token_accuracy, rtol=0, atol=0)
        assert torch.equal(predicted, expected.predicted_tokens)
        (loss * 2).backward()
        for got, want in zip(_grads(x, w, b), expected_grads, strict=False):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


# A value unlike its default for every option a shim takes, so that an option handed on
# under another name, or left out, shows.
_DISTINCT_OPTIONS = dict(
    ignore_index=-7,
    lse_square_scale=0.25,
    label_smoothing=0.125,
    reduction="sum",
    softcap=30.0,
    return_z_loss=True,
    accum_dtype=torch.float32,
    use_token_scaling=True,
    return_token_accuracy=True,
    return_predicted_tokens=True,
)
_SHIMS = {
    "LigerFusedLinearCrossEntropyFunction.forward": lambda x, w, t, o: liger.LigerFusedLinearCrossEntropyFunction.apply(
        x, w, t, **o
    ),
    "liger_fused_linear_cross_entropy": lambda x, w, t, o: liger.liger_fused_linear_cross_entropy(x, w, t, **o),
    "LigerFusedLinearCrossEntropyLoss.__init__": lambda x, w, t, o: liger.LigerFusedLinearCrossEntropyLoss(**o),
    "LigerCrossEntropyFunction.forward": lambda x, w, t, o: liger.LigerCrossEntropyFunction.apply(
        x @ w.T, t, None, **o
    ),
    "liger_cross_entropy": lambda x, w, t, o: liger.liger_cross_entropy(x @ w.T, t, **o),
    "LigerCrossEntropyLoss.__init__": lambda x, w, t, o: liger.LigerCrossEntropyLoss(**o),
}


@pytest.mark.parametrize("qualname", list(_SHIMS))
def test_each_shim_hands_on_every_option_of_its_signature_by_name(qualname, monkeypatch):
    """The shims list their options by name (torch.compile cannot trace ``locals()`` in
    every release): each hands on exactly the options its signature takes, each under
    its own name."""
    function = liger
    for part in qualname.split("."):
        function = getattr(function, part)
    taken = {name: value for name, value in _DISTINCT_OPTIONS.items() if name in inspect.signature(function).parameters}
    assert set(taken) == set(inspect.signature(function).parameters) & set(flce.options.OPTION_FIELDS)
    handed = []
    real = liger._options
    monkeypatch.setattr(
        liger, "_options", lambda arguments, **overrides: handed.append(dict(arguments)) or real(arguments, **overrides)
    )
    x, w, _, t = _inputs(requires_grad=False)
    _SHIMS[qualname](x, w, t.masked_fill(t == -100, -7), taken)
    assert handed and handed[0] == taken


def test_bare_loss_without_return_flags():
    x, w, b, t = _inputs()
    out = liger.liger_fused_linear_cross_entropy(x, w, t, b)
    assert isinstance(out, torch.Tensor) and out.dim() == 0
    loss, z, acc, pred = liger.LigerFusedLinearCrossEntropyFunction.apply(x, w, t, b)
    assert z is None and acc is None and pred is None
    torch.testing.assert_close(loss, out)


def test_cross_entropy_shims_equal_idiomatic_api_and_keep_logits():
    torch.manual_seed(1)
    logits = (torch.randn(23, 41) * 4).requires_grad_()
    before = logits.detach().clone()
    t = torch.randint(0, 41, (23,))
    cw = torch.rand(41) + 0.5
    expected = flce.cross_entropy(
        logits,
        t,
        weight=cw,
        label_smoothing=0.1,
        lse_square_scale=1e-3,
        softcap=6.0,
        return_z_loss=True,
        return_token_accuracy=True,
    )
    expected.loss.backward()
    expected_grad = logits.grad.clone()
    logits.grad = None
    out = liger.liger_cross_entropy(
        logits,
        t,
        cw,
        label_smoothing=0.1,
        lse_square_scale=1e-3,
        softcap=6.0,
        return_z_loss=True,
        return_token_accuracy=True,
    )
    torch.testing.assert_close(out.loss, expected.loss, rtol=0, atol=0)
    torch.testing.assert_close(out.token_accuracy, expected.token_accuracy, rtol=0, atol=0)
    out.loss.backward()
    torch.testing.assert_close(logits.grad, expected_grad, rtol=0, atol=0)
    assert torch.equal(logits.detach(), before), "Liger overwrites the caller's logits; flce must not"
    loss, z, acc, pred = liger.LigerCrossEntropyFunction.apply(logits, t, cw, -100, 1e-3, 0.1, "mean", 6.0, True)
    torch.testing.assert_close(loss, expected.loss, rtol=0, atol=0)
    assert acc is None and pred is None and z is not None


def test_ce_impl_selects_backend_and_rejects_unknown():
    x, w, b, t = _inputs(requires_grad=False)
    loss = liger.LigerFusedLinearCrossEntropyFunction.apply(
        x, w, t, b, None, -100, 0.0, 0.0, "mean", None, False, None, False, False, False, "torch"
    )[0]
    torch.testing.assert_close(loss, flce.fused_linear_cross_entropy(x, w, t, bias=b, backend="torch"))
    with pytest.raises(ValueError, match="ce_impl"):
        liger.LigerFusedLinearCrossEntropyFunction.apply(
            x, w, t, b, None, -100, 0.0, 0.0, "mean", None, False, None, False, False, False, "cuda-magic"
        )


def test_chunk_mem_const_follows_liger_rule_and_keeps_results():
    x, w, b, t = _inputs()
    reference = liger.liger_fused_linear_cross_entropy(x, w, t, b)
    assert liger._liger_chunk_size(8192, 128256, 4096, 2) == 512  # ceil(8192 / ceil(128256 / 8192)) -> 2^9
    assert liger._liger_chunk_size(8192, 128256, 4096, 1) is None  # default: flce's budget rule
    out = liger.liger_fused_linear_cross_entropy(x, w, t, b, chunk_mem_const=4)
    torch.testing.assert_close(out, reference)
    with pytest.raises(ValueError, match="chunk_mem_const"):
        liger.liger_fused_linear_cross_entropy(x, w, t, b, chunk_mem_const=0)


def test_deprecated_placeholders_are_refused_not_ignored():
    logits, t = torch.randn(4, 5), torch.randint(0, 5, (4,))
    with pytest.raises(ValueError, match="size_average"):
        liger.liger_cross_entropy(logits, t, size_average=True)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_module_equals_the_functional_shim(reduction):
    """``LigerCrossEntropyLoss(weight, ...)(logits, target)``: the bare loss without a
    ``return_*`` flag, else ``CrossEntropyOutput``; options read from its attributes on
    each call, as Liger's forward reads them."""
    torch.manual_seed(2)
    logits = (torch.randn(2, 5, 41) * 4).requires_grad_()
    t = torch.randint(0, 41, (2, 5))
    t[0, 1] = -100
    cw = torch.rand(41) + 0.5
    options = dict(lse_square_scale=1e-3, label_smoothing=0.1, reduction=reduction, softcap=6.0)
    flags = dict(return_z_loss=True, return_token_accuracy=True, return_predicted_tokens=True)
    bare = liger.LigerCrossEntropyLoss(cw, **options)(logits, t)
    assert isinstance(bare, torch.Tensor)
    torch.testing.assert_close(bare, liger.liger_cross_entropy(logits, t, cw, **options), rtol=0, atol=0)
    module = liger.LigerCrossEntropyLoss(cw, **options, **flags)
    out, expected = module(logits, t), liger.liger_cross_entropy(logits, t, cw, **options, **flags)
    assert isinstance(out, flce.CrossEntropyOutput)
    for field in ("loss", "z_loss", "token_accuracy", "predicted_tokens"):
        torch.testing.assert_close(getattr(out, field), getattr(expected, field), rtol=0, atol=0)
    module.label_smoothing = 0.0
    torch.testing.assert_close(
        module(logits, t).loss,
        liger.liger_cross_entropy(logits, t, cw, reduction=reduction, lse_square_scale=1e-3, softcap=6.0),
    )
