"""The public results: a bare loss tensor, or a ``CrossEntropyOutput`` when a ``return_*``
flag is set (same fields as Liger's); ``LogprobsOutput`` for ``fused_linear_logprobs``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flce.options import LossOptions


@dataclass
class CrossEntropyOutput:
    """Results of a cross-entropy call with a ``return_*`` flag (Liger's fields); those not
    asked for are None. ``loss`` and ``z_loss`` (the z-loss part, already inside ``loss``)
    are fp32, scalars for mean/sum and shaped like the target for ``"none"`` (0 at ignored
    tokens); ``token_accuracy`` is fp32, the fraction of the non-ignored tokens whose first
    maximum logit is the target for mean/sum, per token (0 or 1, 0 at ignored tokens) for
    ``"none"``; ``predicted_tokens`` is int64 shaped like the target, -1 at ignored tokens.
    ``z_loss`` and ``token_accuracy`` are detached."""

    loss: torch.Tensor
    z_loss: torch.Tensor | None = None
    token_accuracy: torch.Tensor | None = None
    predicted_tokens: torch.Tensor | None = None


LossResult = torch.Tensor | CrossEntropyOutput


@dataclass
class LogprobsOutput:
    """Per-token results of ``flce.fused_linear_logprobs``, shaped like the target: the
    logprobs and the entropy fp32, 0 at ignored tokens, differentiable; the predicted
    tokens int64, -1 at ignored tokens."""

    logprobs: torch.Tensor  # log softmax(z)_y, z = (x W^T + b) / temperature
    entropy: torch.Tensor | None = None  # -sum_i p_i log p_i, with return_entropy
    predicted_tokens: torch.Tensor | None = None  # first argmax_i z_i, with return_predicted_tokens


# Pytree nodes, so that a model returning them can be traced by torch.export (which
# refuses unknown output types) and its program run; None fields are allowed.
for _output in (CrossEntropyOutput, LogprobsOutput):
    torch.export.register_dataclass(_output, serialized_type_name=f"flce.{_output.__name__}")


def package_result(
    options: LossOptions,
    target_shape: tuple[int, ...],
    loss: torch.Tensor,
    z_loss: torch.Tensor | None,
    accuracy: torch.Tensor | None,
    predicted: torch.Tensor | None,
) -> LossResult:
    """The public result. Outputs not asked for are dropped first (the custom ops return
    empty placeholders for them); per-token outputs take ``target``'s shape."""
    z_loss = z_loss if options.return_z_loss else None
    accuracy = accuracy if options.return_token_accuracy else None
    predicted = predicted if options.return_predicted_tokens else None
    if options.reduction == "none" and len(target_shape) > 1:
        loss = loss.view(target_shape)
        z_loss = None if z_loss is None else z_loss.view(target_shape)
        accuracy = None if accuracy is None else accuracy.view(target_shape)
    if predicted is not None and len(target_shape) > 1:
        predicted = predicted.view(target_shape)
    if not options.returns_structured:
        return loss
    return CrossEntropyOutput(loss=loss, z_loss=z_loss, token_accuracy=accuracy, predicted_tokens=predicted)
