"""``nn.Module`` front-ends: options fixed at construction, validated once there."""

from __future__ import annotations

import torch
from torch import nn

from flce.functional import cross_entropy_with_options, fused_linear_cross_entropy_with_options
from flce.options import OPTION_FIELDS, LossOptions, NotScriptable, check_tensor_type, refuse_non_dense
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


def register_class_weight(module: nn.Module, name: str, class_weight: torch.Tensor | None) -> None:
    """``class_weight`` as ``module.<name>``: checked for all that can be known before the
    vocabulary (a dense, floating-point, 1-D tensor of finite, non-negative weights), and
    registered as a buffer outside the state dict, so that it follows ``.to()``/``.cuda()``
    of a model holding the loss without adding a checkpoint key. The forward checks the
    rest (shape (V,), device) against its operands."""
    if class_weight is not None:
        check_tensor_type(name, class_weight)
        refuse_non_dense(name, class_weight)
        if not class_weight.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {class_weight.dtype}")
        if class_weight.dim() != 1:
            raise ValueError(f"{name} must have shape (V,) (one weight per class), got {tuple(class_weight.shape)}")
        # One host read, once per module; none for a meta tensor (no values yet) or while
        # torch.compile traces a forward that builds the loss (the call checks them then).
        readable = class_weight.device.type != "meta" and not torch.compiler.is_compiling()
        if readable and not bool(((class_weight >= 0) & class_weight.isfinite()).all()):
            raise ValueError(f"{name} must be finite and non-negative; it has negative, NaN or Inf entries")
    module.register_buffer(name, class_weight, persistent=False)


class FusedLinearCrossEntropyLoss(NotScriptable, nn.Module):
    """``forward(input, weight, target, bias=None)``: the loss of ``input @ weight.T + bias``.

    Takes the keyword options of ``flce.fused_linear_cross_entropy``; ``ce_weight`` is
    registered as a buffer so it follows ``.to()`` (``register_class_weight``).
    """

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


class CrossEntropyLoss(NotScriptable, nn.Module):
    """``forward(logits, target)`` with the options of ``flce.cross_entropy``; ``weight``
    is registered as a buffer as ``FusedLinearCrossEntropyLoss``'s ``ce_weight``."""

    def __init__(self, weight: torch.Tensor | None = None, **options) -> None:
        super().__init__()
        self.options = module_options(self, "weight", options)
        for name in FUSED_ONLY_OPTIONS:
            if getattr(self.options, name) is not None:
                raise ValueError(
                    f"{name} applies to the fused linear loss only (FusedLinearCrossEntropyLoss); "
                    "pass None for CrossEntropyLoss"
                )
        register_class_weight(self, "weight", weight)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> LossResult:
        return cross_entropy_with_options(logits, target, self.weight, self.options)

    def extra_repr(self) -> str:
        return repr(self.options)
