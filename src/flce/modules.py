"""``nn.Module`` front-ends: options fixed at construction, validated once there."""

from __future__ import annotations

import torch
from torch import nn

from flce.functional import cross_entropy_with_options, fused_linear_cross_entropy_with_options
from flce.options import LossOptions, NotScriptable, check_optional_tensor_type
from flce.output import LossResult


class FusedLinearCrossEntropyLoss(NotScriptable, nn.Module):
    """``forward(input, weight, target, bias=None)``: the loss of ``input @ weight.T + bias``.

    Takes the keyword options of ``flce.fused_linear_cross_entropy``; ``ce_weight`` is
    registered as a buffer so it follows ``.to()``.
    """

    def __init__(self, ce_weight: torch.Tensor | None = None, **options) -> None:
        super().__init__()
        self.options = LossOptions(**options)
        check_optional_tensor_type("ce_weight", ce_weight)
        self.register_buffer("ce_weight", ce_weight, persistent=False)

    def forward(
        self, input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None
    ) -> LossResult:
        return fused_linear_cross_entropy_with_options(input, weight, target, bias, self.ce_weight, self.options)

    def extra_repr(self) -> str:
        return repr(self.options)


class CrossEntropyLoss(NotScriptable, nn.Module):
    """``forward(logits, target)`` with the options of ``flce.cross_entropy``."""

    def __init__(self, weight: torch.Tensor | None = None, **options) -> None:
        super().__init__()
        self.options = LossOptions(**options)
        if self.options.accum_dtype is not None:
            raise ValueError("accum_dtype applies to FusedLinearCrossEntropyLoss only")
        check_optional_tensor_type("weight", weight)
        self.register_buffer("weight", weight, persistent=False)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> LossResult:
        return cross_entropy_with_options(logits, target, self.weight, self.options)

    def extra_repr(self) -> str:
        return repr(self.options)
