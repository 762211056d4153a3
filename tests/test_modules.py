"""The ``nn.Module`` front-ends as a user handles them: copies, pickles, ``.to()``, the
state dict, ``torch.jit.script``, keyword calls, and the same result as the functional form."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import flce
from flce.compat import liger
from flce.parallel import VocabParallelFusedLinearCrossEntropyLoss

V, H, N = 16, 4, 8


def _modules(class_weight: torch.Tensor) -> list[torch.nn.Module]:
    return [
        flce.FusedLinearCrossEntropyLoss(ce_weight=class_weight, label_smoothing=0.1, reduction="sum", softcap=5.0),
        flce.CrossEntropyLoss(weight=class_weight, label_smoothing=0.1, ignore_index=3),
    ]


def _call(module: torch.nn.Module, x: torch.Tensor, w: torch.Tensor, z: torch.Tensor, t: torch.Tensor):
    if isinstance(module, flce.FusedLinearCrossEntropyLoss):
        return module(input=x, weight=w, target=t)
    return module(logits=z, target=t)


@pytest.mark.parametrize("index", [0, 1])
def test_copies_and_pickles_keep_options_and_class_weight(index: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x, w, z = torch.randn(N, H, generator=gen), torch.randn(V, H, generator=gen), torch.randn(N, V, generator=gen)
    t = torch.randint(0, V, (N,), generator=gen)
    module = _modules(torch.rand(V, generator=gen) + 0.5)[index]
    expected = _call(module, x, w, z, t)
    saved = io.BytesIO()
    torch.save(module, saved)
    saved.seek(0)
    for copied in (copy.deepcopy(module), pickle.loads(pickle.dumps(module)), torch.load(saved, weights_only=False)):
        assert repr(copied) == repr(module) and "label_smoothing=0.1" in repr(copied)
        torch.testing.assert_close(_call(copied, x, w, z, t), expected, rtol=0, atol=0)


@pytest.mark.parametrize("index", [0, 1])
def test_class_weight_is_a_buffer_outside_the_state_dict(index: int) -> None:
    """The class weight follows ``.to()`` but is no checkpoint key: loading a model's
    checkpoint into a model with the loss as a submodule neither misses nor adds a key."""
    module = _modules(torch.rand(V) + 0.5)[index]
    assert len(list(module.buffers())) == 1 and module.state_dict() == {}
    assert next(module.double().buffers()).dtype == torch.float64
    module.load_state_dict({})


@pytest.mark.parametrize("index", [0, 1])
def test_jit_script_is_refused_with_a_clear_message(index: int) -> None:
    module = _modules(torch.rand(V) + 0.5)[index]
    container = torch.nn.Sequential(module)
    for scripted in (module, container):
        with pytest.raises(RuntimeError, match=rf"torch\.jit\.script.*{type(module).__name__}.*torch\.compile"):
            torch.jit.script(scripted)


@pytest.mark.parametrize(
    "make",
    [
        lambda: liger.LigerFusedLinearCrossEntropyLoss(label_smoothing=0.1),
        lambda: liger.LigerCrossEntropyLoss(label_smoothing=0.1),
        lambda: liger.LigerFusedLinearJSD(jsd_beta=0.5),
        lambda: VocabParallelFusedLinearCrossEntropyLoss(),
    ],
    ids=["liger-flce", "liger-ce", "liger-jsd", "vocab-parallel"],
)
def test_jit_script_of_every_other_loss_module_is_refused_with_a_clear_message(make) -> None:
    module = make()
    for scripted in (module, torch.nn.Sequential(module)):
        with pytest.raises(RuntimeError, match=rf"torch\.jit\.script.*{type(module).__name__}.*torch\.compile"):
            torch.jit.script(scripted)


@pytest.mark.parametrize("name", ["accum_dtype", "vocab_chunk_size", "memory_budget"])
def test_cross_entropy_module_refuses_fused_only_options_at_construction(name: str) -> None:
    """``flce.cross_entropy`` refuses these options; the module must too, when it is
    built, not at its first forward."""
    value = torch.float32 if name == "accum_dtype" else 4096
    with pytest.raises(ValueError, match=rf"{name} applies to the fused linear loss only"):
        flce.CrossEntropyLoss(**{name: value})


_BAD_CLASS_WEIGHTS = [
    (lambda: torch.ones(V, dtype=torch.int64), TypeError, "must be a floating-point tensor"),
    (lambda: torch.ones(V, 2), ValueError, r"must have shape \(V,\)"),
    (lambda: torch.ones(()), ValueError, r"must have shape \(V,\)"),
    (lambda: torch.ones(V).to_sparse(), TypeError, "must be a dense"),
    (lambda: -torch.ones(V), ValueError, "must be finite and non-negative"),
    (lambda: torch.full((V,), float("nan")), ValueError, "must be finite and non-negative"),
]


@pytest.mark.parametrize("bad", range(len(_BAD_CLASS_WEIGHTS)))
@pytest.mark.parametrize(
    "make,name",
    [
        (lambda w: flce.FusedLinearCrossEntropyLoss(ce_weight=w), "ce_weight"),
        (lambda w: flce.CrossEntropyLoss(weight=w), "weight"),
        (lambda w: liger.LigerFusedLinearCrossEntropyLoss(ce_weight=w), "ce_weight"),
        (lambda w: liger.LigerCrossEntropyLoss(weight=w), "weight"),
    ],
    ids=["flce", "ce", "liger-flce", "liger-ce"],
)
def test_a_bad_class_weight_is_refused_at_construction_naming_the_argument(make, name: str, bad: int) -> None:
    value, error, message = _BAD_CLASS_WEIGHTS[bad]
    with pytest.raises(error, match=rf"{name} {message}"):
        make(value())


@pytest.mark.parametrize(
    "make,call",
    [
        (
            lambda w: liger.LigerFusedLinearCrossEntropyLoss(ce_weight=w, label_smoothing=0.1),
            lambda m, x, w, z, t: m(w, x, t),
        ),
        (lambda w: liger.LigerCrossEntropyLoss(weight=w, label_smoothing=0.1), lambda m, x, w, z, t: m(z, t)),
    ],
    ids=["liger-flce", "liger-ce"],
)
def test_liger_modules_class_weight_follows_to_and_stays_out_of_the_state_dict(make, call) -> None:
    """As flce's own modules: a model moved with ``.to()`` moves its loss's class weights
    (Liger keeps them as a plain attribute, left behind on the CPU by ``model.cuda()``);
    the state dict stays empty, as Liger's."""
    gen = torch.Generator().manual_seed(1)
    x, w, z = torch.randn(N, H, generator=gen), torch.randn(V, H, generator=gen), torch.randn(N, V, generator=gen)
    t = torch.randint(0, V, (N,), generator=gen)
    module = make(torch.rand(V, generator=gen) + 0.5)
    expected = call(module, x, w, z, t)
    assert len(list(module.buffers())) == 1 and module.state_dict() == {}
    module.double()
    class_weight = next(module.buffers())
    assert class_weight.dtype == torch.float64
    torch.testing.assert_close(call(module, x, w, z, t), expected)
    for copied in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        torch.testing.assert_close(call(copied, x, w, z, t), expected)
    module.load_state_dict({})


@pytest.mark.parametrize(
    "make,keyword,weight_name",
    [
        (lambda: flce.FusedLinearCrossEntropyLoss(weight=torch.ones(V)), "weight", "ce_weight"),
        (lambda: flce.CrossEntropyLoss(ce_weight=torch.ones(V)), "ce_weight", "weight"),
        (lambda: flce.FusedLinearCrossEntropyLoss(label_smothing=0.1), "label_smothing", "ce_weight"),
    ],
    ids=["fused-weight", "ce-ce_weight", "misspelt-option"],
)
def test_an_unknown_keyword_is_refused_naming_the_module_and_what_it_takes(make, keyword, weight_name) -> None:
    with pytest.raises(TypeError, match=rf"Loss got unexpected keyword argument\(s\) \['{keyword}'\].*{weight_name}="):
        make()


_SETTABLE_MODULES = [
    (lambda: flce.FusedLinearCrossEntropyLoss(), lambda m, x, w, z, t: m(x, w, t)),
    (lambda: flce.CrossEntropyLoss(), lambda m, x, w, z, t: m(z, t)),
]


@pytest.mark.parametrize("make,call", _SETTABLE_MODULES, ids=["flce", "ce"])
@pytest.mark.parametrize(
    "option,value",
    [("reduction", "sum"), ("ignore_index", 3), ("label_smoothing", 0.2), ("softcap", 2.0), ("lse_square_scale", 0.1)],
)
def test_an_option_set_as_an_attribute_is_used_by_the_next_call(make, call, option, value) -> None:
    """As on ``torch.nn.CrossEntropyLoss`` (``loss.reduction = "sum"``): the assignment
    must change the loss, not add an attribute that no call reads."""
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(N, H, generator=gen), torch.randn(V, H, generator=gen)
    t = torch.randint(0, V, (N,), generator=gen)
    t[:2] = 3
    module = make()
    setattr(module, option, value)
    assert getattr(module, option) == value and f"{option}={value!r}" in repr(module)
    expected = flce.fused_linear_cross_entropy(x, w, t, **{option: value})
    torch.testing.assert_close(call(module, x, w, x @ w.T, t), expected)


@pytest.mark.parametrize("make", [lambda: flce.FusedLinearCrossEntropyLoss(), lambda: flce.CrossEntropyLoss()])
def test_a_bad_option_set_as_an_attribute_is_refused_and_leaves_the_options(make) -> None:
    module = make()
    with pytest.raises(ValueError, match="reduction must be one of"):
        module.reduction = "avg"
    assert module.reduction == "mean" and module.options == make().options


@pytest.mark.parametrize("name", ["accum_dtype", "vocab_chunk_size", "memory_budget"])
def test_cross_entropy_module_refuses_fused_only_options_set_as_attributes(name: str) -> None:
    module = flce.CrossEntropyLoss()
    with pytest.raises(ValueError, match=rf"{name} applies to the fused linear loss only"):
        setattr(module, name, torch.float32 if name == "accum_dtype" else 4096)
    assert getattr(module, name) is None


def test_vocab_parallel_module_takes_options_as_attributes_and_refuses_its_unsupported_ones() -> None:
    module = VocabParallelFusedLinearCrossEntropyLoss()
    module.label_smoothing = 0.1
    assert module.options.label_smoothing == 0.1
    with pytest.raises(TypeError, match=r"unsupported option\(s\) \['vocab_chunk_size'\]"):
        module.vocab_chunk_size = 8
    assert module.vocab_chunk_size is None
