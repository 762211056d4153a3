"""Putting flce's forward on models and model classes, and taking it off again.

``apply_flce`` / ``remove_flce`` act on one instance (PEFT, compiled and (D)DP wrappers
unwrapped, the instance's own forward wrappers kept), ``patch_model_type`` /
``unpatch_model_type`` on the classes a ``model_type`` loads; the forward itself and its
loss routes are ``patch.py``'s. The package's docstring says what a patched model does.
"""

from __future__ import annotations

import types
from typing import Any, NamedTuple

import torch

from flce.integrations.forward_wrappers import rewrapped, wrapper_chain
from flce.integrations.transformers.errors import UnsupportedModelError
from flce.integrations.transformers.patch import (
    INTERCEPTOR_ATTRIBUTE,
    ForwardCall,
    LossSettings,
    attach,
    is_flce_forward,
    make_forward,
    unwrap_forward,
)


def _pretrained_model() -> type:
    from transformers import PreTrainedModel

    return PreTrainedModel


def unwrap_model(model):
    """The transformers model inside PEFT, ``torch.compile`` and (D)DP wrappers."""
    while True:
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            model = model._orig_mod
        elif callable(getattr(model, "get_base_model", None)) and type(model).__module__.startswith("peft"):
            model = model.get_base_model()
        elif isinstance(model, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
            model = model.module
        else:
            break
    if not isinstance(model, _pretrained_model()):
        raise TypeError(f"expected a transformers PreTrainedModel (or a PEFT/compiled one), got {type(model).__name__}")
    return model


def _forward_call(cls: type) -> ForwardCall:
    try:
        return ForwardCall.of(unwrap_forward(cls.forward))
    except TypeError as exc:
        raise UnsupportedModelError(cls.__name__, str(exc)) from exc


# On an instance-level flce forward: the instance's own forward (wrappers such as
# accelerate's mixed-precision ones) it was put inside, restored by remove_flce; None where
# the instance had none.
REPLACED_FORWARD = "flce_replaced_forward"


class ReplacedForward(NamedTuple):
    """The instance's own forward flce's was put inside, without the instance: a deep copy of
    the model shares flce's forward function (and so this), and a bound method kept here
    would run the original model when restored on the copy."""

    function: Any  # the function of a bound method of the instance, or the callable itself
    bound: bool  # a bound method of the instance: bound again to the one it is restored on

    @staticmethod
    def of(forward, target) -> ReplacedForward:
        if isinstance(forward, types.MethodType) and forward.__self__ is target:
            return ReplacedForward(forward.__func__, True)
        return ReplacedForward(forward, False)

    def on(self, target):
        """The forward, as the instance ``target``'s."""
        return types.MethodType(self.function, target) if self.bound else self.function


def _has_accelerate_hook(target) -> bool:
    return hasattr(target, "_hf_hook") and hasattr(target, "_old_forward")


def _instance_chain(forward, call: ForwardCall) -> list:
    """The wrappers of an instance's own ``forward`` down to the class's forward (or a
    class-level flce forward around it), outermost first."""
    return wrapper_chain(forward, lambda function: function is call.original or is_flce_forward(function))


def _bound_like(function, forward):
    """``function`` bound to what ``forward`` is bound to, if it is a bound method."""
    bound_to = getattr(forward, "__self__", None)
    return types.MethodType(function, bound_to) if bound_to is not None else function


def _unpatched_instance_forward(target, forward, call: ForwardCall):
    """``target``'s forward as it would be without the flce instance patch that its
    ``forward`` runs (innermost): the forward that patch was put inside (None: the class's),
    within the wrappers put around flce's since (accelerate's mixed-precision ones, when
    ``accelerator.prepare`` came after ``apply_flce``), which must not be dropped with it."""
    chain = _instance_chain(forward, call)
    kept = getattr(chain[-1], REPLACED_FORWARD)
    replaced = None if kept is None else kept.on(target)
    kept_inside = 0 if replaced is None else len(_instance_chain(replaced, call)) - 1  # copied by the patch
    added = chain[: len(chain) - 1 - kept_inside]
    if not added:
        return replaced
    inner = call.original if replaced is None else replaced
    rebuilt = rewrapped([*added, chain[len(added)]], getattr(inner, "__func__", inner))
    if rebuilt is None:
        raise UnsupportedModelError(
            type(target).__name__,
            "its forward was wrapped after flce patched it in a way flce cannot see through to take its own "
            "forward out while keeping the wrappers",
        )
    return _bound_like(rebuilt, forward)


def _wrapped_instance_forward(target, call: ForwardCall):
    """The instance's own forward that flce's goes inside (e.g. accelerate's mixed-precision
    wrappers after ``accelerator.prepare``), or None where the class's forward runs as is."""
    forward = target.__dict__.get("forward")
    if forward is None:
        return None
    innermost = _instance_chain(forward, call)[-1]
    if hasattr(innermost, REPLACED_FORWARD):  # patched before: inside what is there without that patch
        return _unpatched_instance_forward(target, forward, call)
    if innermost is call.original or is_flce_forward(innermost):
        return forward
    raise UnsupportedModelError(
        type(target).__name__,
        f"its instance forward ({getattr(forward, '__qualname__', type(forward).__name__)}) replaces the class's "
        "forward without a __wrapped__ link to it, so flce cannot patch the forward it runs; apply flce before "
        "replacing the forward",
    )


def _patched_forward(target, function, call: ForwardCall) -> tuple[str, Any]:
    """``(attribute, value)`` that makes ``function`` (flce's forward) the one calls on
    ``target`` run: inside the instance's own wrappers where it has some. Raises
    ``UnsupportedModelError`` where they cannot be kept (before the probe touches the model)."""
    if _has_accelerate_hook(target):
        return "_old_forward", types.MethodType(function, target)  # accelerate's hook calls it from `forward`
    outer = _wrapped_instance_forward(target, call)
    setattr(function, REPLACED_FORWARD, None if outer is None else ReplacedForward.of(outer, target))
    if outer is None:
        return "forward", types.MethodType(function, target)
    forward = rewrapped(_instance_chain(outer, call), function)
    if forward is None:
        raise UnsupportedModelError(
            type(target).__name__,
            "its instance forward wraps the class's forward in a way flce cannot see through to put its own "
            "forward inside; apply flce before wrapping the forward (e.g. before accelerator.prepare)",
        )
    return "forward", _bound_like(forward, outer)


def apply_flce(model, **loss_options: Any):
    """Patch this model instance so its loss with labels is computed by flce.

    Returns ``model`` (as given: a PEFT or compiled wrapper stays the wrapper). Raises
    ``UnsupportedModelError`` with the reason, leaving the model unpatched, when flce cannot
    give it its own loss and gradients. Patching again replaces the options;
    ``remove_flce`` undoes it. Other instances of the class are not affected. Wrappers the
    instance's forward already has (accelerate's mixed precision after
    ``accelerator.prepare``, before or after an earlier ``apply_flce``) are kept, flce's
    forward inside them.
    """
    settings = LossSettings.from_kwargs(loss_options)
    target = unwrap_model(model)
    call = _forward_call(type(target))
    attribute, forward = _patched_forward(target, make_forward(call.original, settings), call)
    attach(target, settings, call)
    setattr(target, attribute, forward)
    return model


def remove_flce(model):
    """Undo ``apply_flce`` on this instance (a class-level patch stays in effect). Wrappers
    put around flce's forward since (``accelerator.prepare`` after ``apply_flce``) stay,
    around the model's own forward."""
    target = unwrap_model(model)
    if _has_accelerate_hook(target) and is_flce_forward(getattr(target, "_old_forward", None)):
        target._old_forward = types.MethodType(unwrap_forward(target._old_forward), target)
    elif "forward" in target.__dict__:
        forward = target.__dict__["forward"]
        innermost = wrapper_chain(forward, is_flce_forward)[-1]
        if is_flce_forward(innermost) and hasattr(innermost, REPLACED_FORWARD):  # not a class-level patch
            replaced = _unpatched_instance_forward(target, forward, _forward_call(type(target)))
            if replaced is None:
                del target.forward
            else:
                target.forward = replaced
    interceptor = target.__dict__.get(INTERCEPTOR_ATTRIBUTE)
    if interceptor is not None and not is_flce_forward(type(target).__dict__.get("forward")):
        interceptor.uninstall(target)
    return model


def model_classes(model_type_or_class) -> tuple[type, ...]:
    """The classes ``patch_model_type`` patches: those ``AutoModelForCausalLM`` and
    ``AutoModelForImageTextToText`` load for a ``model_type`` (e.g. ``"gemma3"``: the
    multimodal ``Gemma3ForConditionalGeneration``), or the class passed in."""
    if isinstance(model_type_or_class, type):
        return (model_type_or_class,)
    if not isinstance(model_type_or_class, str):
        raise TypeError(f"expected a model_type string or a model class, got {type(model_type_or_class).__name__}")
    import transformers
    from transformers.models.auto import modeling_auto

    mappings = (
        modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )
    names = dict.fromkeys(m[model_type_or_class] for m in mappings if model_type_or_class in m)
    if not names:
        raise ValueError(
            f"unknown model_type {model_type_or_class!r}: not in transformers' causal-LM or image-text-to-text "
            "auto mappings (pass the model class instead)"
        )
    return tuple(getattr(transformers, name) for name in names)


def patch_model_type(model_type_or_class, **loss_options: Any) -> tuple[type, ...]:
    """Patch the classes of a ``model_type`` (see ``model_classes``) or a class, so every
    instance, existing or future, computes its loss with flce. Returns the patched classes.

    Call it before or after ``from_pretrained``. Each instance is probed at its first call
    with labels (``apply_flce`` probes at once); one that cannot be given its own loss raises
    ``UnsupportedModelError`` there. An instance patch takes precedence over a class patch;
    ``unpatch_model_type`` undoes this one.
    """
    settings = LossSettings.from_kwargs(loss_options)
    classes = model_classes(model_type_or_class)
    calls = {}
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, _pretrained_model())):
            raise TypeError(f"expected a transformers PreTrainedModel subclass, got {cls!r}")
        calls[cls] = _forward_call(cls)
    for cls, call in calls.items():
        current = cls.__dict__.get("forward")
        owned = current.flce_owned if is_flce_forward(current) else "forward" in cls.__dict__
        forward = make_forward(call.original, settings)
        forward.flce_owned = owned
        cls.forward = forward
    return classes


def unpatch_model_type(model_type_or_class) -> tuple[type, ...]:
    """Restore the classes' own forward after ``patch_model_type``."""
    classes = model_classes(model_type_or_class)
    for cls in classes:
        current = cls.__dict__.get("forward")
        if is_flce_forward(current):
            if current.flce_owned:
                cls.forward = current.flce_original_forward
            else:
                delattr(cls, "forward")
    return classes


def is_patched(model_or_class) -> bool:
    """Whether the forward that calls on this instance (or class) would run is flce's."""
    if isinstance(model_or_class, type):
        return is_flce_forward(model_or_class.__dict__.get("forward"))
    target = unwrap_model(model_or_class)
    if _has_accelerate_hook(target):
        return is_flce_forward(target._old_forward)
    return is_flce_forward(wrapper_chain(target.forward, is_flce_forward)[-1])  # inside wrappers too
