"""Hugging Face ``transformers`` integration: causal-LM losses through flce.

``apply_flce(model, **loss_options)`` patches one model instance and
``patch_model_type("llama", **loss_options)`` (or a ``*ForCausalLM`` class) patches
every instance of a class. The patched ``forward`` runs the decoder (``model.model``)
for the hidden states and computes the loss with ``flce.fused_linear_cross_entropy``
on ``model.lm_head.weight`` (and its bias, if any), so the ``(tokens, vocab)`` logits
are never materialised for the loss.

Behaviour of the patched forward, matching the model's own forward otherwise:

- ``labels`` are shifted inside (position ``t`` predicts ``labels[t + 1]``; the last
  position is ignored), exactly as ``transformers`` does; a ``shift_labels`` keyword
  (already shifted targets) is used as given instead. Targets equal to
  ``ignore_index`` (-100 unless set in ``loss_options``) are ignored.
- ``num_items_in_batch`` (passed by the HF ``Trainer`` for gradient accumulation):
  the loss is the sum over the micro-batch divided by it, as in ``transformers``;
  otherwise the mean over the non-ignored targets.
- ``logits_to_keep`` restricts the positions as usual (targets must then match the
  kept positions, as with the stock loss).
- Logits: in training with labels the output has ``logits=None`` (computing them
  would defeat the purpose). They are computed in eval mode, without labels, or when
  ``skip_logits=False`` is passed to ``forward`` (``skip_logits=True`` forces them
  off). Final-logit soft-capping (Gemma 2/3 ``final_logit_softcapping``) is applied
  both to the returned logits and, through flce's ``softcap``, to the loss.
- The return value is the usual ``CausalLMOutputWithPast`` (a tuple when
  ``return_dict=False``).

``loss_options`` are passed to ``flce.fused_linear_cross_entropy``: ``ignore_index``,
``label_smoothing``, ``lse_square_scale``, ``ce_weight``, ``softcap`` (overrides the
config's value; ``softcap=None`` disables it), ``accum_dtype``, ``use_token_scaling``,
``backend``, ``chunk_size`` and ``vocab_chunk_size``. ``reduction`` is chosen by the integration (see above),
and the ``return_*`` flags are not supported here (the HF output has no place for
their extra values).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "apply_flce",
    "is_patched",
    "patch_model_type",
    "remove_flce",
    "unpatch_model_type",
]

# model_type -> (modeling module under transformers.models, causal-LM class name).
SUPPORTED_MODEL_TYPES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    # Gemma 3's text-only causal LM (config model_type "gemma3_text"); the multimodal
    # Gemma3ForConditionalGeneration is not covered.
    "gemma3": ("gemma3", "Gemma3ForCausalLM"),
    "gemma3_text": ("gemma3", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
}
_VALIDATED_CLASS_NAMES = frozenset(name for _, name in SUPPORTED_MODEL_TYPES.values())

_PASSTHROUGH_OPTIONS = frozenset(
    {
        "ce_weight",
        "ignore_index",
        "lse_square_scale",
        "label_smoothing",
        "softcap",
        "accum_dtype",
        "use_token_scaling",
        "backend",
        "chunk_size",
        "vocab_chunk_size",
    }
)
_REJECTED_OPTIONS = {
    "reduction": "the integration uses 'mean', or 'sum' divided by num_items_in_batch when the Trainer passes it",
    "return_z_loss": "CausalLMOutputWithPast has no field for the extra values",
    "return_token_accuracy": "CausalLMOutputWithPast has no field for the extra values",
    "return_predicted_tokens": "CausalLMOutputWithPast has no field for the extra values",
    "input": "the hidden states come from the model",
    "weight": "the weight is the model's lm_head.weight",
    "target": "the targets come from labels / shift_labels",
    "bias": "the bias is the model's lm_head.bias",
}

# Keyword arguments of forward that the patched forward consumes itself.
_LOSS_KWARGS = ("num_items_in_batch", "shift_labels", "skip_logits", "return_dict")

_MARK = "_flce_patched"


# --------------------------------------------------------------------------- options


def _validate_options(loss_options: dict[str, Any]) -> dict[str, Any]:
    for key in loss_options:
        if key in _REJECTED_OPTIONS:
            raise ValueError(
                f"loss option {key!r} is not supported by the transformers integration: {_REJECTED_OPTIONS[key]}"
            )
        if key not in _PASSTHROUGH_OPTIONS:
            raise TypeError(f"unknown loss option {key!r}; expected one of {sorted(_PASSTHROUGH_OPTIONS)}")
    ignore_index = loss_options.get("ignore_index", -100)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    return dict(loss_options)


def _config_softcap(config) -> float | None:
    value = getattr(config, "final_logit_softcapping", None)
    return None if value is None else float(value)


def _check_config(config) -> None:
    """Refuse configs whose head does more than linear (+ soft-cap): the generic forward
    would silently compute a different loss for them."""
    for name in ("logit_scale", "logits_scaling"):
        value = getattr(config, name, None)
        if value is not None and float(value) != 1.0:
            raise NotImplementedError(
                f"{type(config).__name__}.{name}={value}: scaled output logits are not supported "
                "by the flce integration"
            )


# --------------------------------------------------------------------------- loss


def _flce_function() -> Callable[..., Any]:
    import flce  # late: always the current ``flce.fused_linear_cross_entropy``

    return flce.fused_linear_cross_entropy


def _loss_value(result) -> torch.Tensor:
    if isinstance(result, torch.Tensor):
        return result
    loss = getattr(result, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    return result[0]


def causal_lm_loss(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
    **loss_options: Any,
) -> torch.Tensor:
    """The causal-LM loss of ``transformers`` (``ForCausalLMLoss``) computed by flce.

    ``hidden_states`` (..., H) are the final decoder states at the positions whose
    targets are ``shift_labels`` (same leading shape), or ``labels`` shifted left by
    one with ``ignore_index`` padded at the end. With ``num_items_in_batch`` the loss
    is the sum divided by it, else the mean over non-ignored targets.
    """
    ignore_index = loss_options.get("ignore_index", -100)
    if shift_labels is None:
        if labels is None:
            raise ValueError("causal_lm_loss needs labels or shift_labels")
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.to(hidden_states.device).reshape(-1)
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    if x.shape[0] != target.numel():
        raise ValueError(
            f"the labels give {target.numel()} targets but the hidden states have {x.shape[0]} positions "
            "(with logits_to_keep the labels must match the kept positions)"
        )
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = _loss_value(_flce_function()(x, weight, target, bias=bias, reduction=reduction, **loss_options))
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


# --------------------------------------------------------------------------- forward


def _slice_positions(hidden_states: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """``transformers``' ``logits_to_keep`` selection (int: last n, 0 = all; tensor: indices)."""
    if isinstance(logits_to_keep, int):
        return hidden_states if logits_to_keep == 0 else hidden_states[:, -logits_to_keep:, :]
    try:
        from transformers.modeling_utils import slice_logits_to_keep
    except ImportError:
        slice_logits_to_keep = None
    if slice_logits_to_keep is not None:
        return slice_logits_to_keep(hidden_states, logits_to_keep)
    return hidden_states[:, logits_to_keep, :]


def _lm_head_params(model) -> tuple[torch.Tensor, torch.Tensor | None]:
    head = model.lm_head
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(
            f"{type(model).__name__}.lm_head ({type(head).__name__}) has no weight tensor; flce needs a linear head"
        )
    bias = getattr(head, "bias", None)
    return weight, bias if isinstance(bias, torch.Tensor) else None


def _build_output(base_outputs, loss, logits):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    fields = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
    values: dict[str, Any] = {"loss": loss, "logits": logits}
    if isinstance(base_outputs, dict):  # ModelOutput is an OrderedDict of its non-None fields
        cache = None
        for key in ("cache", "past_key_values"):
            if key in base_outputs:
                cache = base_outputs[key]
                break
        cache_field = "cache" if "cache" in fields else "past_key_values"
        values[cache_field] = cache
        values["hidden_states"] = base_outputs.get("hidden_states")
        values["attentions"] = base_outputs.get("attentions")
    return CausalLMOutputWithPast(**{k: v for k, v in values.items() if k in fields})


def _make_forward(original_forward: Callable, loss_options: dict[str, Any]) -> Callable:
    signature = inspect.signature(original_forward)
    params = signature.parameters
    var_kw = next((p.name for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    options = dict(loss_options)
    user_softcap = options.pop("softcap", _MARK)

    @functools.wraps(original_forward)
    def forward(self, *args, **kwargs):
        special = {key: kwargs.pop(key) for key in _LOSS_KWARGS if key in kwargs and key not in params}
        bound = signature.bind_partial(self, *args, **kwargs)
        arguments = dict(bound.arguments)
        arguments.pop(next(iter(params)))  # self
        extra = arguments.pop(var_kw, {}) if var_kw is not None else {}
        for key in _LOSS_KWARGS:  # explicit parameters of older signatures
            if key in arguments:
                special[key] = arguments.pop(key)
        labels = arguments.pop("labels", None)
        logits_to_keep = arguments.pop("logits_to_keep", 0)
        shift_labels = special.get("shift_labels")
        num_items_in_batch = special.get("num_items_in_batch")
        skip_logits = special.get("skip_logits")
        return_dict = special.get("return_dict")
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
            return_dict = True if return_dict is None else return_dict

        _check_config(self.config)
        outputs = self.model(**arguments, **extra)
        hidden_states = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
        hidden_states = _slice_positions(hidden_states, logits_to_keep)

        softcap = _config_softcap(self.config) if user_softcap is _MARK else user_softcap
        has_targets = labels is not None or shift_labels is not None
        if skip_logits and not has_targets:
            raise ValueError("skip_logits=True needs labels or shift_labels")
        if skip_logits is None:
            skip_logits = self.training and has_targets

        weight, bias = _lm_head_params(self)
        loss = None
        if has_targets:
            loss = causal_lm_loss(
                hidden_states,
                weight,
                labels,
                bias=bias,
                shift_labels=shift_labels,
                num_items_in_batch=num_items_in_batch,
                softcap=softcap,
                **options,
            )
        logits = None
        if not skip_logits:
            logits = self.lm_head(hidden_states)
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap

        output = _build_output(outputs, loss, logits)
        return output if return_dict else output.to_tuple()

    setattr(forward, _MARK, True)
    forward._flce_original_forward = original_forward
    forward._flce_loss_options = dict(loss_options)
    return forward


def _is_flce_forward(fn) -> bool:
    fn = getattr(fn, "__func__", fn)
    return bool(getattr(fn, _MARK, False)) and not isinstance(fn, functools.partial)


def _unwrap_forward(fn: Callable) -> Callable:
    """The model's own forward under a (possibly) flce-patched one."""
    fn = getattr(fn, "__func__", fn)
    while _is_flce_forward(fn):
        fn = fn._flce_original_forward
    return fn


def _check_structure(model_or_class, what: str) -> None:
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    names = {c.__name__ for c in cls.__mro__}
    if not names & _VALIDATED_CLASS_NAMES:
        warnings.warn(
            f"{cls.__name__} is not among the architectures the flce integration is validated on "
            f"({sorted(_VALIDATED_CLASS_NAMES)}); it is patched on the assumption that its forward is "
            "`model.model(...)` then `lm_head` (+ optional final_logit_softcapping) and the stock causal-LM loss",
            stacklevel=3,
        )
    if not isinstance(model_or_class, type):
        if not isinstance(getattr(model_or_class, "model", None), torch.nn.Module):
            raise TypeError(f"{what}: {cls.__name__} has no decoder at `.model`")
        if not isinstance(getattr(model_or_class, "lm_head", None), torch.nn.Module):
            raise TypeError(f"{what}: {cls.__name__} has no `.lm_head`")


# --------------------------------------------------------------------------- public API


def apply_flce(model, **loss_options: Any):
    """Patch this model instance's forward so its causal-LM loss is computed by flce.

    Returns the model. Patching again replaces the options; ``remove_flce`` undoes it.
    Other instances of the class are unaffected (see ``patch_model_type`` for those).
    """
    options = _validate_options(loss_options)
    _check_structure(model, "apply_flce")
    _check_config(model.config)
    original = _unwrap_forward(type(model).forward)
    bound = types.MethodType(_make_forward(original, options), model)
    if hasattr(model, "_hf_hook") and hasattr(model, "_old_forward"):
        # accelerate hooks (device_map / offloading) call `_old_forward` from `forward`.
        model._old_forward = bound
    else:
        model.forward = bound
    return model


def remove_flce(model):
    """Undo ``apply_flce`` on this instance (a class-level patch stays in effect)."""
    if hasattr(model, "_hf_hook") and _is_flce_forward(getattr(model, "_old_forward", None)):
        model._old_forward = types.MethodType(_unwrap_forward(model._old_forward), model)
    elif _is_flce_forward(model.__dict__.get("forward")):
        del model.forward
    return model


def _resolve_class(model_type_or_class) -> type:
    if isinstance(model_type_or_class, type):
        return model_type_or_class
    if not isinstance(model_type_or_class, str):
        raise TypeError(f"expected a model_type string or a model class, got {type(model_type_or_class).__name__}")
    key = model_type_or_class.lower()
    if key not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type_or_class!r}; supported: {sorted(SUPPORTED_MODEL_TYPES)} "
            "(or pass the class)"
        )
    module_name, class_name = SUPPORTED_MODEL_TYPES[key]
    module = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    return getattr(module, class_name)


def patch_model_type(model_type_or_class, **loss_options: Any) -> type:
    """Patch a causal-LM class (by ``model_type``, e.g. ``"llama"``, or the class itself)
    so every instance, existing or future, computes its loss with flce.

    Call it before or after ``from_pretrained``. Returns the patched class;
    ``unpatch_model_type`` undoes it. An instance patch (``apply_flce``) takes
    precedence over a class patch.
    """
    options = _validate_options(loss_options)
    cls = _resolve_class(model_type_or_class)
    _check_structure(cls, "patch_model_type")
    current = cls.__dict__.get("forward")
    if _is_flce_forward(current):
        original, owned = current._flce_original_forward, current._flce_owned
    else:
        original, owned = cls.forward, "forward" in cls.__dict__
    forward = _make_forward(original, options)
    forward._flce_owned = owned
    cls.forward = forward
    return cls


def unpatch_model_type(model_type_or_class) -> type:
    """Restore the class's own forward after ``patch_model_type``."""
    cls = _resolve_class(model_type_or_class)
    current = cls.__dict__.get("forward")
    if _is_flce_forward(current):
        if current._flce_owned:
            cls.forward = current._flce_original_forward
        else:
            delattr(cls, "forward")
    return cls


def is_patched(model_or_class) -> bool:
    """Whether the forward that calls on this instance (or class) would run is flce's."""
    if isinstance(model_or_class, type):
        return _is_flce_forward(model_or_class.__dict__.get("forward"))
    if hasattr(model_or_class, "_hf_hook") and hasattr(model_or_class, "_old_forward"):
        return _is_flce_forward(model_or_class._old_forward)
    return _is_flce_forward(model_or_class.forward)
