"""Integrations of the fused linear + cross-entropy loss with model libraries.

Each integration is its own submodule and imports its library lazily, so importing
``flce.integrations`` never requires any of them:

- ``flce.integrations.transformers``: Hugging Face ``transformers`` causal LMs
  (``apply_flce`` for one model instance, ``patch_model_type`` for a whole class,
  ``enable_flce`` for an HF ``Trainer``);
- ``flce.integrations.trl``: TRL's SFT, GRPO and DPO trainers, whose fused LM head runs
  flce's kernels (reached through ``enable_flce``).
"""

__all__ = ["transformers", "trl"]
