"""flce: the LM-head loss (linear projection + cross-entropy, forward and backward)
without materializing the tokens x vocab logits; and the RL and distillation heads
(per-token logprobs and entropy, teacher-student divergence) on the same driver."""

from flce.torch_version import check_torch_version

check_torch_version()

from flce.dispatch import BACKEND_NAMES  # noqa: E402
from flce.driver.validation import check_errors  # noqa: E402
from flce.functional import (  # noqa: E402
    cross_entropy,
    fused_linear_cross_entropy,
    fused_linear_distillation,
    fused_linear_logprobs,
)
from flce.modules import CrossEntropyLoss, FusedLinearCrossEntropyLoss  # noqa: E402
from flce.options import DistillationOptions, LogprobsOptions, LossOptions  # noqa: E402
from flce.output import CrossEntropyOutput, LogprobsOutput  # noqa: E402

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
