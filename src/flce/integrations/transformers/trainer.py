"""One line to train with flce in the HF ``Trainer`` and trainers built on it.

``enable_flce(trainer, **loss_options)`` patches the trainer's model (``apply_flce``: the
loss of every call with labels, training and evaluation) and makes evaluation ask the model
for logits only when the trainer keeps them (``prediction_loss_only=False``, e.g. for
``compute_metrics``). It works on the instance and imports nothing of the trainer's
library, so ``Trainer`` subclasses are covered alike.

TRL's trainers are refused with the reason: TRL (1.x) gives its SFT, DPO, GRPO, RLOO and KTO
trainers a fused LM head of its own (``trl.trainer.utils.add_fused_lm_head``, called as
``model(..., fused_lm_head=True)``, returning per-token log-probabilities, entropy and
top-1 hits), which never materialises the logits either; flce's patch would replace it and
drop the fields those trainers read.
"""

from __future__ import annotations

from typing import Any


def _trl_class(trainer) -> type | None:
    return next((cls for cls in type(trainer).__mro__ if cls.__module__.split(".")[0] == "trl"), None)


def enable_flce(trainer, **loss_options: Any):
    """Patch ``trainer.model`` with flce and keep evaluation right. Returns ``trainer``.

    Call it after building the trainer and before ``train()``:
    ``enable_flce(Trainer(model=model, args=args, ...)).train()``.
    """
    from flce.integrations.transformers import apply_flce

    trl_class = _trl_class(trainer)
    if trl_class is not None:
        raise NotImplementedError(
            f"{type(trainer).__name__} is built on TRL's {trl_class.__name__}, which computes its loss through TRL's "
            "own fused LM head (model(..., fused_lm_head=True)); flce's patch would replace it: use the trainer as is."
        )
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
