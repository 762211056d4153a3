"""The ``torch`` backend: chunk kernels in plain PyTorch (fp32 math, any device) for every
loss head: cross-entropy, logprobs and distillation."""

from __future__ import annotations

import torch

from flce.backends.base import BackendSpec, DistillationKernels, LogprobsKernels
from flce.backends.torch import distillation, logprobs
from flce.backends.torch.ce import EXTRA_BYTES_PER_LOGIT, cross_entropy_chunk
from flce.backends.torch.partial import TorchSplitRowKernels


def availability(device: torch.device) -> tuple[bool, str]:
    return True, ""


BACKEND = BackendSpec(
    name="torch",
    cross_entropy_chunk=cross_entropy_chunk,
    split_rows=TorchSplitRowKernels,
    availability=availability,
    extra_bytes_per_logit=EXTRA_BYTES_PER_LOGIT,
    auto_priority=0,
    description="PyTorch ops, fp32 math; runs everywhere; the default on CPU",
    logprobs=LogprobsKernels(
        forward=logprobs.logprobs_forward_chunk,
        backward=logprobs.logprobs_backward_chunk,
        extra_bytes_per_logit=logprobs.EXTRA_BYTES_PER_LOGIT,
    ),
    distillation=DistillationKernels(
        chunk=distillation.distillation_chunk, extra_bytes_per_logit=distillation.EXTRA_BYTES_PER_LOGIT
    ),
)
