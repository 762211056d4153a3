"""Split-row kernels in plain PyTorch (``flce.backends.base.SplitRowKernels``): an fp32
copy of the block and the formulas of ``flce.rows.cross_entropy``."""

from __future__ import annotations

import torch

from flce.backends.torch.ce import EXTRA_BYTES_PER_LOGIT
from flce.rows.cross_entropy import (
    BlockStatistics,
    ChunkScalars,
    apply_softcap,
    finite_reference,
    fp32_working_copy,
    gradient_from_softmax,
)


class TorchSplitRowKernels:
    """PyTorch ops on an fp32 copy of the block (up to three fp32 temporaries per logit)."""

    name = "torch"
    extra_bytes_per_logit = EXTRA_BYTES_PER_LOGIT

    def statistics(
        self, logits, local_target, ce_local, softcap, *, with_smoothing, with_argmax, approximate_tanh=False
    ) -> BlockStatistics:
        del approximate_tanh  # the accurate torch.tanh always
        # logits (C, V_b); local_target (C,) int64, outside [0, V_b) where the block lacks y
        z, _ = apply_softcap(fp32_working_copy(logits), softcap, False)
        block_max = z.amax(dim=-1)
        # Before the shift: a NaN logit makes the block max NaN, and z' - NaN would turn
        # the whole row NaN (argmax 0). torch.argmax's rule: first index among ties, the
        # first NaN wins over any number.
        argmax = z.argmax(dim=-1) if with_argmax else None
        z.sub_(finite_reference(block_max)[:, None])  # (C, V_b) z' - block max (0 if all -inf)
        owned = (local_target >= 0) & (local_target < z.shape[1])
        target_shifted = z.gather(1, torch.where(owned, local_target, 0)[:, None]).squeeze(1)
        smooth = (z @ ce_local if ce_local is not None else z.sum(dim=-1)) if with_smoothing else None
        return BlockStatistics(block_max, z.exp_().sum(dim=-1), target_shifted, smooth, argmax)

    def gradient(
        self, logits, grad_target, ce_local, row_max, inv_sum, w_y, lse, row_scale, scalars: ChunkScalars, eps: float
    ) -> None:
        """Writes dL/dlogits over ``logits`` (C, V_b), with the whole row's softmax
        ``p_i = exp(z'_i - row_max) * inv_sum``. ``grad_target``: the target's column in the
        block, V_b where the block lacks it, -1 on ignored rows."""
        z, softcap_derivative = apply_softcap(fp32_working_copy(logits), scalars.softcap, True)
        p = z.sub_(row_max[:, None]).exp_().mul_(inv_sum[:, None])
        owned = (grad_target >= 0) & (grad_target < logits.shape[1])
        grad = gradient_from_softmax(
            p,
            torch.where(owned, grad_target, 0),
            owned.float(),
            w_y,
            lse,
            ce_local,
            scalars,
            eps,
            softcap_derivative,
            torch.where(grad_target >= 0, row_scale, torch.zeros_like(row_scale)),
        )
        logits.copy_(grad)
