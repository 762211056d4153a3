"""``nn.Module`` front-ends: options validated at construction, and again when one is set
as an attribute (``loss.ignore_index = 0``, as on ``torch.nn.CrossEntropyLoss``)."""

from __future__ import annotations

import torch
from torch import nn

from flce.functional import cross_entropy_with_options, fused_linear_cross_entropy_with_options
from flce.options import OPTION_FIELDS, LossOptions, NotScriptable, OptionAttributes, register_class_weight
from flce.output import LossResult

# Options of the fused loss that ``flce.cross_entropy`` refuses (it has no GEMM to chunk
# nor dW to accumulate): ``CrossEntropyLoss`` refuses them when it is built.
FUSED_ONLY_OPTIONS = ("accum_dtype", "vocab_chunk_size", "memory_budget")


def module_options(module: nn.Module, class_weight_name: str, options: dict) -> LossOptions:
    """``LossOptions(**options)`` for a module's keyword options; a keyword that is no
    option is refused naming the module and what it takes (the class weights' keyword
    included: ``weight=`` given to the fused loss is a likely slip), not as an unexpected
    argument of ``LossOptions``."""
    unknown = [name for name in options if name not in OPTION_FIELDS]
    if unknown:
        raise TypeError(
            f"{type(module).__name__} got unexpected keyword argument(s) {unknown}; it takes the class weights "
            f"as {class_weight_name}= and the options {', '.join(OPTION_FIELDS)}"
        )
    return LossOptions(**options)


class FusedLinearCrossEntropyLoss(NotScriptable, OptionAttributes, nn.Module):
    """``forward(input, weight, target, bias=None)``: the loss of ``input @ weight.T + bias``.

    Takes the keyword options of ``flce.fused_linear_cross_entropy``, each also an attribute
    that can be set (``OptionAttributes``); ``ce_weight`` is registered as a buffer so it
    follows ``.to()`` (``register_class_weight``).
    """

    option_names = OPTION_FIELDS

    def __init__(self, ce_weight: torch.Tensor | None = None, **options) -> None:
        super().__init__()
        self.options = module_options(self, "ce_weight", options)
        register_class_weight(self, "ce_weight", ce_weight)

    def forward(
        self, input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None
    ) -> LossResult:
        return fused_linear_cross_entropy_with_options(input, weight, target, bias, self.ce_weight, self.options)

    def extra_repr(self) -> str:
        return repr(self.options)


class CrossEntropyLoss(NotScriptable, OptionAttributes, nn.Module):
    """``forward(logits, target)`` with the options of ``flce.cross_entropy``, each also an
    attribute that can be set; ``weight`` is registered as a buffer as
    ``FusedLinearCrossEntropyLoss``'s ``ce_weight``."""

    option_names = OPTION_FIELDS

    def __init__(self, weight: torch.Tensor | None = None, **options) -> None:
        super().__init__()
        self.options = module_options(self, "weight", options)
        self.check_options(self.options)
        register_class_weight(self, "weight", weight)

    def check_options(self, options: LossOptions) -> None:
        for name in FUSED_ONLY_OPTIONS:
            if getattr(options, name) is not None:
                raise ValueError(
                    f"{name} applies to the fused linear loss only (FusedLinearCrossEntropyLoss); "
                    "pass None for CrossEntropyLoss"
                )

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> LossResult:
        return cross_entropy_with_options(logits, target, self.weight, self.options)

    def extra_repr(self) -> str:
        return repr(self.options)
