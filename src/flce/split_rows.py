"""Kernels for rows whose vocabulary is split into column blocks: per block, statistics
relative to the block's own max; later, given the whole row's max and sum, the gradient.

Used where no single kernel sees a whole row: the vocab-parallel loss (blocks on
different ranks, ``flce.parallel``) and the vocabulary-blocked driver mode (blocks one
after another, ``flce.driver.run_vocab_blocks``). Each backend that has them: ``torch``
(PyTorch ops on an fp32 copy) and ``triton`` (``flce.backends.triton.partial``: one read
for the statistics, one read and an in-place write for the gradient).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from flce.backends.base import ChunkScalars
from flce.backends.torch.ce import EXTRA_BYTES_PER_LOGIT, apply_softcap, gradient_from_softmax


@dataclass
class BlockStatistics:
    """Per-row statistics of one column block, relative to the block's max of z'."""

    row_max: torch.Tensor  # (C,) max of z' over the block
    row_sum: torch.Tensor  # (C,) sum of exp(z' - row_max)
    target_shifted: torch.Tensor  # (C,) z'_y - row_max where the block holds y (else anything)
    smooth_shifted: Optional[torch.Tensor]  # (C,) sum_i w_i (z'_i - row_max), with label smoothing
    argmax: Optional[torch.Tensor]  # (C,) first argmax within the block


class TorchSplitRowKernels:
    """PyTorch ops on an fp32 copy of the block (up to three fp32 temporaries per logit)."""

    name = "torch"
    extra_bytes_per_logit = EXTRA_BYTES_PER_LOGIT

    def statistics(self, logits, local_target, ce_local, softcap, *, with_smoothing, with_argmax):
        # logits (C, V_b); local_target (C,) int64, outside [0, V_b) where the block lacks y
        z = logits.float()
        if z.data_ptr() == logits.data_ptr():
            z = z.clone()
        z, _ = apply_softcap(z, softcap, False)
        block_max = z.amax(dim=-1)
        z.sub_(block_max[:, None])  # (C, V_b) z' - block max
        argmax = z.argmax(dim=-1) if with_argmax else None  # first index among ties
        owned = (local_target >= 0) & (local_target < z.shape[1])
        target_shifted = z.gather(1, torch.where(owned, local_target, 0)[:, None]).squeeze(1)
        smooth = (z @ ce_local if ce_local is not None else z.sum(dim=-1)) if with_smoothing else None
        return BlockStatistics(block_max, z.exp_().sum(dim=-1), target_shifted, smooth, argmax)

    def gradient(self, logits, grad_target, ce_local, row_max, inv_sum, w_y, lse, row_scale,
                 scalars: ChunkScalars, eps: float) -> None:
        """Writes dL/dlogits over ``logits`` (C, V_b), with the whole row's softmax
        ``p_i = exp(z'_i - row_max) * inv_sum``. ``grad_target``: the target's column in the
        block, V_b where the block lacks it, -1 on ignored rows."""
        z = logits.float()
        if z.data_ptr() == logits.data_ptr():
            z = z.clone()
        z, softcap_derivative = apply_softcap(z, scalars.softcap, True)
        p = z.sub_(row_max[:, None]).exp_().mul_(inv_sum[:, None])
        owned = (grad_target >= 0) & (grad_target < logits.shape[1])
        grad = gradient_from_softmax(p, torch.where(owned, grad_target, 0), owned.float(), w_y, lse, ce_local,
                                     scalars, eps, softcap_derivative, row_scale * (grad_target >= 0))
        logits.copy_(grad)


class TritonSplitRowKernels:
    """``flce.backends.triton.partial``, in place: no fp32 copy of the block."""

    name = "triton"
    extra_bytes_per_logit = 0

    def statistics(self, logits, local_target, ce_local, softcap, *, with_smoothing, with_argmax):
        from flce.backends.triton.partial import partial_statistics

        return BlockStatistics(
            *partial_statistics(logits, local_target, ce_local, softcap, with_smoothing, with_argmax)
        )

    def gradient(self, logits, grad_target, ce_local, row_max, inv_sum, w_y, lse, row_scale,
                 scalars: ChunkScalars, eps: float) -> None:
        from flce.backends.triton.partial import partial_gradient

        ce_scale = scalars.ce_grad_scale
        onehot_coef = row_scale * (ce_scale * (1.0 - scalars.label_smoothing)) * w_y
        smooth_coef = row_scale * (ce_scale * eps) if eps > 0 else None
        s = scalars.lse_square_scale
        z_coef = row_scale * (scalars.z_grad_scale * 2.0 * s) * lse if s > 0 else None
        partial_gradient(logits, grad_target.contiguous(), ce_local, row_max.contiguous(),
                         inv_sum.contiguous(), onehot_coef.contiguous(), smooth_coef, z_coef,
                         scalars.weight_sum, scalars.softcap)


def split_row_kernels(backend: Optional[str], device: torch.device, caller: str):
    """The split-row kernels of ``backend`` (None: ``FLCE_BACKEND``, else Triton on CUDA
    when usable, else PyTorch). Raises for a backend without them or unusable here."""
    from flce.dispatch import BackendUnavailableError, availability, requested_backend

    name = requested_backend(backend)
    if name == "cutedsl":
        raise ValueError(
            f"{caller}: the cutedsl backend has no kernel for rows split into vocabulary blocks yet; "
            "use backend='triton' or 'torch' (or None)"
        )
    if name is None:
        name = "triton" if device.type == "cuda" and availability("triton", device)[0] else "torch"
    if name == "triton":
        ok, why = availability("triton", device)
        if not ok:
            raise BackendUnavailableError(f"backend 'triton' cannot run on {device}: {why}")
        return TritonSplitRowKernels()
    return TorchSplitRowKernels()
