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
gradient) and soft-cap (Gemma), a padded vocabulary (the first rows of the weight), MoE
auxiliary losses, LoRA on the head, PEFT ``modules_to_save`` and accelerate offloading of the
head. Each model instance is probed once (a few forwards on a 6-token input, leaving the
random generators and the grad mode as they were; again when a config entry or module
attribute the result depends on changes) to establish this; what cannot be established is refused with
``UnsupportedModelError``, leaving the model as it was (e.g. encoder-decoder models that
compute their loss inline, heads in float64).

Behaviour of the patched forward, the model's own otherwise:

- no labels: the model's own forward, untouched (``generate`` included);
- labels: ``logits`` is None in the output, in training and in eval, unless
  ``skip_logits=False`` is passed (then they are the model's own logits and the loss is
  ``flce.cross_entropy`` on them); ``skip_logits=True`` without labels is an error;
  ``shift_labels`` without labels: the model's own forward (no loss, its logits);
- ``num_items_in_batch`` (the HF Trainer's count under gradient accumulation): the sum
  divided by it, as transformers;
- ``return_dict=False``: the model's own tuple, None in the logits' slot when they are not
  computed;
- PEFT's per-row adapters (``adapter_names=``) reaching a head with adapters: an error at the
  call, before anything is computed (``skip_logits=False`` scores the model's own logits);
- wrappers the instance's forward has (accelerate's mixed precision after
  ``accelerator.prepare``) stay around flce's.

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

from flce.integrations.transformers.errors import UnsupportedModelError
from flce.integrations.transformers.install import (
    apply_flce,
    is_patched,
    model_classes,
    patch_model_type,
    remove_flce,
    unpatch_model_type,
    unwrap_model,
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
    "unwrap_model",
]
