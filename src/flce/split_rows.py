"""Kernels for rows whose vocabulary is split into column blocks: per block, statistics
relative to the block's own max; later, given the whole row's max and sum, the gradient.

Used where no single kernel sees a whole row: the vocab-parallel loss (blocks on
different ranks, ``flce.parallel``) and the vocabulary-blocked driver mode (blocks one
after another, ``flce.driver.run_vocab_blocks``). Every backend has them: ``torch``
(PyTorch ops on an fp32 copy), ``triton`` (``flce.backends.triton.partial``) and
``cutedsl`` (``flce.backends.cutedsl.partial``, sm_90+); the last two read the block once
for the statistics, and once more with an in-place write for the gradient.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from flce.backends.base import ChunkScalars
from flce.backends.torch.ce import EXTRA_BYTES_PER_LOGIT, apply_softcap, gradient_from_softmax


@dataclass
class BlockStatistics:
    """Per-row statistics of one column block, relative to the block's max of z'."""

    row_max: torch.Tensor  # (C,) max of z' over the block
    row_sum: torch.Tensor  # (C,) sum of exp(z' - row_max)
    target_shifted: torch.Tensor  # (C,) z'_y - row_max where the block holds y (else anything)
    smooth_shifted: torch.Tensor | None  # (C,) sum_i w_i (z'_i - row_max), with label smoothing
    argmax: torch.Tensor | None  # (C,) first argmax within the block


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

    def gradient(
        self, logits, grad_target, ce_local, row_max, inv_sum, w_y, lse, row_scale, scalars: ChunkScalars, eps: float
    ) -> None:
        """Writes dL/dlogits over ``logits`` (C, V_b), with the whole row's softmax
        ``p_i = exp(z'_i - row_max) * inv_sum``. ``grad_target``: the target's column in the
        block, V_b where the block lacks it, -1 on ignored rows."""
        z = logits.float()
        if z.data_ptr() == logits.data_ptr():
            z = z.clone()
        z, softcap_derivative = apply_softcap(z, scalars.softcap, True)
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
            row_scale,
            grad_target >= 0,
        )
        logits.copy_(grad)


class _InPlaceSplitRowKernels:
    """Kernels that work in place on the block, with no fp32 copy of it: ``_module``
    holds ``partial_statistics`` and ``partial_gradient`` (the contract of
    ``flce.backends.triton.partial``), imported on first use."""

    name: str
    _module: str
    extra_bytes_per_logit = 0

    def _kernels(self):
        return importlib.import_module(self._module)

    def statistics(self, logits, local_target, ce_local, softcap, *, with_smoothing, with_argmax):
        return BlockStatistics(
            *self._kernels().partial_statistics(logits, local_target, ce_local, softcap, with_smoothing, with_argmax)
        )

    def gradient(
        self, logits, grad_target, ce_local, row_max, inv_sum, w_y, lse, row_scale, scalars: ChunkScalars, eps: float
    ) -> None:
        ce_scale = scalars.ce_grad_scale
        onehot_coef = row_scale * (ce_scale * (1.0 - scalars.label_smoothing)) * w_y
        smooth_coef = row_scale * (ce_scale * eps) if eps > 0 else None
        s = scalars.lse_square_scale
        z_coef = row_scale * (scalars.z_grad_scale * 2.0 * s) * lse if s > 0 else None
        self._kernels().partial_gradient(
            logits,
            grad_target,
            ce_local,
            row_max,
            inv_sum,
            onehot_coef,
            smooth_coef,
            z_coef,
            scalars.weight_sum,
            scalars.softcap,
        )


class TritonSplitRowKernels(_InPlaceSplitRowKernels):
    """``flce.backends.triton.partial``, in place: no fp32 copy of the block."""

    name = "triton"
    _module = "flce.backends.triton.partial"


class CuteSplitRowKernels(_InPlaceSplitRowKernels):
    """``flce.backends.cutedsl.partial`` (CuTe DSL, sm_90+), in place: no fp32 copy of the block."""

    name = "cutedsl"
    _module = "flce.backends.cutedsl.partial"


def split_row_kernels(backend: str | None, device: torch.device, caller: str):
    """The split-row kernels of ``backend`` (None: ``FLCE_BACKEND``, else Triton on CUDA
    when usable, else PyTorch). Raises ``BackendUnavailableError`` (with the reason) for
    a requested backend that cannot run here."""
    from flce.dispatch import BackendUnavailableError, availability, requested_backend

    name = requested_backend(backend)
    if name is None:
        name = "triton" if device.type == "cuda" and availability("triton", device)[0] else "torch"
    if name in _IN_PLACE:
        ok, why = availability(name, device)
        if not ok:
            raise BackendUnavailableError(f"{caller}: backend {name!r} cannot run on {device}: {why}")
        return _IN_PLACE[name]()
    return TorchSplitRowKernels()


_IN_PLACE = {"triton": TritonSplitRowKernels, "cutedsl": CuteSplitRowKernels}
