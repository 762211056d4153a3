"""One line to train with flce in the HF ``Trainer`` and trainers built on it.

``enable_flce(trainer, **loss_options)`` patches the trainer's model (``apply_flce``: the
loss of every call with labels, training and evaluation) and makes evaluation ask the model
for logits only when the trainer keeps them (``prediction_loss_only=False``, e.g. for
``compute_metrics``). It works on the instance and imports nothing of the trainer's
library, so ``Trainer`` subclasses are covered alike.

TRL's SFT, GRPO and DPO trainers (and subclasses of them) are handled by
``flce.integrations.trl``: TRL (1.x) gives their models a fused LM head of its own
(``model(..., fused_lm_head=True)``, per-token log-probabilities, entropy, top-1 hits
without the logits), and flce's kernels are put behind it on the trainer's model and
reference model, TRL's losses and metrics unchanged. Other TRL trainers (RLOO, KTO...) are
refused with the reason.
"""

from __future__ import annotations

from typing import Any


def _trl_class(trainer) -> type | None:
    """The most derived class of TRL's among the trainer's classes (found by module, so
    nothing of TRL is imported for other trainers)."""
    return next((cls for cls in type(trainer).__mro__ if cls.__module__.split(".")[0] == "trl"), None)


def enable_flce(trainer, **loss_options: Any):
    """Patch ``trainer.model`` with flce and keep evaluation right. Returns ``trainer``.

    Call it after building the trainer and before ``train()``:
    ``enable_flce(Trainer(model=model, args=args, ...)).train()``. On TRL's SFT, GRPO and DPO
    trainers it takes only ``backend`` and ``chunk_size`` (``flce.integrations.trl``).
    """
    from flce.integrations.transformers.install import apply_flce

    trl_class = _trl_class(trainer)
    if trl_class is not None:
        from flce.integrations.trl import enable_on_trl_trainer

        return enable_on_trl_trainer(trainer, trl_class, loss_options)
    if getattr(trainer, "model", None) is None:
        raise ValueError("the trainer has no model yet (model_init); call enable_flce after the model exists")
    apply_flce(trainer.model, **loss_options)
    trainer.prediction_step = _LogitsWhenKept(trainer.prediction_step)
    return trainer


class _LogitsWhenKept:
    """``Trainer.prediction_step`` that passes ``skip_logits=False`` when the trainer keeps
    the logits (``prediction_loss_only`` False), so they are the model's own."""

    def __init__(self, prediction_step):
        self.prediction_step = prediction_step

    def __call__(self, model, inputs, prediction_loss_only, ignore_keys=None, **kwargs):
        if not prediction_loss_only and inputs.get("labels") is not None:
            inputs = {**inputs, "skip_logits": False}
        return self.prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **kwargs)
