"""flce: the LM-head loss (linear projection + cross-entropy, forward and backward)
without materializing the tokens x vocab logits."""

from flce.dispatch import BACKEND_NAMES
from flce.driver.validation import check_errors
from flce.functional import cross_entropy, fused_linear_cross_entropy
from flce.modules import CrossEntropyLoss, FusedLinearCrossEntropyLoss
from flce.options import LossOptions
from flce.output import CrossEntropyOutput

__version__ = "0.1.0"

__all__ = [
    "BACKEND_NAMES",
    "CrossEntropyLoss",
    "CrossEntropyOutput",
    "FusedLinearCrossEntropyLoss",
    "LossOptions",
    "check_errors",
    "cross_entropy",
    "fused_linear_cross_entropy",
]
