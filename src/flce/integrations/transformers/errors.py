"""The error the integration raises for a model it cannot patch without changing its loss."""

from __future__ import annotations


class UnsupportedModelError(NotImplementedError):
    """This model (or its head) cannot be given its own loss and gradients through flce.

    Raised at patch time (``apply_flce``, ``patch_model_type``) or, for a class patched
    before any instance existed, at the instance's first call with labels; the message
    names the model class and the reason. The model is left unpatched.
    """

    def __init__(self, model_name: str, reason: str):
        super().__init__(f"{model_name}: {reason}")
        self.model_name = model_name
        self.reason = reason
