"""flce: the LM-head loss (linear projection + cross-entropy, forward and backward)
without materializing the tokens x vocab logits; and the RL and distillation heads
(per-token logprobs and entropy, teacher-student divergence) on the same driver."""

from flce.dispatch import BACKEND_NAMES
from flce.driver.validation import check_errors
from flce.functional import (
    cross_entropy,
    fused_linear_cross_entropy,
    fused_linear_distillation,
    fused_linear_logprobs,
)
from flce.modules import CrossEntropyLoss, FusedLinearCrossEntropyLoss
from flce.options import DistillationOptions, LogprobsOptions, LossOptions
from flce.output import CrossEntropyOutput, LogprobsOutput

__version__ = "0.1.0"

__all__ = [
    "BACKEND_NAMES",
    "CrossEntropyLoss",
    "CrossEntropyOutput",
    "DistillationOptions",
    "FusedLinearCrossEntropyLoss",
    "LogprobsOptions",
    "LogprobsOutput",
    "LossOptions",
    "check_errors",
    "cross_entropy",
    "fused_linear_cross_entropy",
    "fused_linear_distillation",
    "fused_linear_logprobs",
]
