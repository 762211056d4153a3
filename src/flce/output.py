"""The structured result returned when a ``return_*`` flag is set (same fields as Liger's)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CrossEntropyOutput:
    loss: torch.Tensor
    z_loss: torch.Tensor | None = None
    token_accuracy: torch.Tensor | None = None
    predicted_tokens: torch.Tensor | None = None
