"""Hugging Face ``transformers`` integration: a model's own causal-LM loss, through flce.

``apply_flce(model, **loss_options)`` patches one model instance (a PEFT model or a
``torch.compile``'d one is unwrapped), ``patch_model_type("llama")`` every instance of the
classes ``AutoModelForCausalLM`` / ``AutoModelForImageTextToText`` load for that
``model_type`` (or of a class passed in).

A patched model runs its own forward (decoder, vision tower, router auxiliary loss, output
type: all its own); only its LM head and its loss are intercepted (``patch.py`` says how).
With labels, the loss is flce's on the head's input and weight, so the ``(tokens, vocab)``
logits are never materialised, and it equals the model's own loss and gradients: the label
shift the model uses (or not), its logit scale (Cohere, Granite; a learnable one gets its
gradient) and soft-cap (Gemma), MoE auxiliary losses, LoRA on the head, PEFT
``modules_to_save`` and accelerate offloading of the head. Each model instance is probed
once (a few forwards on a 6-token input) to establish this; what cannot be established is
refused with ``UnsupportedModelError``, leaving the model as it was.

Behaviour of the patched forward, the model's own otherwise:

- no labels: the model's own forward, untouched (``generate`` included);
- labels (or ``shift_labels``): ``logits`` is None in the output, in training and in eval,
  unless ``skip_logits=False`` is passed (then they are the model's own logits and the loss is
  ``flce.cross_entropy`` on them); ``skip_logits=True`` without labels is an error;
- ``num_items_in_batch`` (the HF Trainer's count under gradient accumulation): the sum
  divided by it, as transformers;
- ``return_dict=False``: the output's ``to_tuple()``, as the model's own.

``loss_options`` go to ``flce.fused_linear_cross_entropy``: ``ignore_index`` (the default
when the model passes none), ``label_smoothing``, ``lse_square_scale``, ``ce_weight``,
``use_token_scaling``, ``accum_dtype``, ``backend``, ``chunk_size``, ``vocab_chunk_size``,
``memory_budget``.
``reduction``, ``softcap`` and the ``return_*`` flags are decided by the model and refused.

``enable_flce(trainer)`` is the one line for the HF ``Trainer`` and its subclasses: it
patches the trainer's model and keeps evaluation's logits when needed; on TRL's SFT, GRPO
and DPO trainers, which fuse their LM head themselves, it puts flce's kernels behind that
head (``flce.integrations.trl``; other TRL trainers are refused with the reason).
"""

from __future__ import annotations

import types
from typing import Any

import torch

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
from flce.integrations.transformers.trainer import enable_flce

__all__ = [
    "UnsupportedModelError",
    "apply_flce",
    "enable_flce",
    "is_patched",
    "model_classes",
    "patch_model_type",
    "remove_flce",
    "unpatch_model_type",
]


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


def apply_flce(model, **loss_options: Any):
    """Patch this model instance so its loss with labels is computed by flce.

    Returns ``model`` (as given: a PEFT or compiled wrapper stays the wrapper). Raises
    ``UnsupportedModelError`` with the reason, leaving the model unpatched, when flce cannot
    give it its own loss and gradients. Patching again replaces the options;
    ``remove_flce`` undoes it. Other instances of the class are not affected.
    """
    settings = LossSettings.from_kwargs(loss_options)
    target = unwrap_model(model)
    call = _forward_call(type(target))
    attach(target, settings, call)
    forward = types.MethodType(make_forward(call.original, settings), target)
    if hasattr(target, "_hf_hook") and hasattr(target, "_old_forward"):
        target._old_forward = forward  # accelerate's hook calls `_old_forward` from `forward`
    else:
        target.forward = forward
    return model


def remove_flce(model):
    """Undo ``apply_flce`` on this instance (a class-level patch stays in effect)."""
    target = unwrap_model(model)
    if hasattr(target, "_hf_hook") and is_flce_forward(getattr(target, "_old_forward", None)):
        target._old_forward = types.MethodType(unwrap_forward(target._old_forward), target)
    elif is_flce_forward(target.__dict__.get("forward")):
        del target.forward
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
    if hasattr(target, "_hf_hook") and hasattr(target, "_old_forward"):
        return is_flce_forward(target._old_forward)
    return is_flce_forward(target.forward)
