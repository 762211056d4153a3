"""The contract between the shared chunked driver and a backend's cross-entropy kernel.

A backend supplies one function, a *chunk CE kernel*, that takes a block of rows of
logits and computes, per row and in fp32 whatever the logits dtype, every quantity
the loss needs, and (optionally) overwrites the logits in place with the gradient.
The driver (``flce.driver``) owns everything else: GEMMs, chunking, reductions,
dW/db accumulation, autograd. Backends differ in their kernels, not in their control flow.

Per-row math (``z`` a row of logits, ``y`` its target, ``c`` the softcap, ``w`` the
class weights, ``W = sum(w)`` (``V`` without weights), ``ls`` the label smoothing,
``eps = ls / V``, ``s`` the z-loss scale)::

    z'    = c * tanh(z / c)            (z' = z without softcap)
    lse   = logsumexp(z'),  p = softmax(z')
    ce    = (1 - ls) * w_y * (lse - z'_y) + eps * (W * lse - sum_i w_i z'_i)
    zl    = s * lse**2
    st    = p_y  (detached)  if use_token_scaling else 1
    loss_out = st * ce,  z_loss_out = st * zl

    dce_i = ((1 - ls) * w_y + eps * W) * p_i - eps * w_i - (1 - ls) * w_y * [i == y]
    dzl_i = 2 * s * lse * p_i
    grad_i = st * row_grad_scale * (ce_grad_scale * dce_i + z_grad_scale * dzl_i) * dz'_i/dz_i
    dz'_i/dz_i = 1 - (z'_i / c)**2      (1 without softcap)

Numerics: evaluate the gradient in the grouped form

    grad_i = ce_grad_scale * ((1 - ls) * w_y * (p_i - [i == y]) + eps * (W * p_i - w_i))
           + z_grad_scale * 2 * s * lse * p_i

(then ``* st * row_grad_scale * dz'_i/dz_i``), with ``p_i = exp((z'_i - m) - log(sum))``
from the row max ``m``. Each group cancels exactly where the true value is ~0 (a
confident row, ``p_y ~ 1``; ``V = 1``), where the expanded coefficient form
``a * p_i - b_i - c * [i == y]`` leaves rounding residue larger than the true gradient.

Rows whose target equals ``ignore_index`` get loss 0, z-loss 0, correct 0,
predicted -1 and an all-zero gradient row, exactly, whatever their logits hold: NaN or
Inf there must not leak out, so kernels select the zeros (or skip the row) instead of
multiplying by a zero row scale (``0 * NaN`` is NaN). ``ignore_index`` may be a real
class id.

Layouts: a kernel either honours a tensor's strides or copies it (the small per-row and
per-class vectors, with the helpers below); logits need unit stride along V only.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class ChunkScalars:
    """Scalars that are the same for every chunk of one call.

    ``ce_grad_scale`` and ``z_grad_scale`` fold the reduction into the gradient:
    for ``reduction="mean"`` they are ``1 / sum(w_y)`` (``1 / n_valid`` without
    weights) and ``1 / n_valid``; for ``"sum"`` and ``"none"`` both are 1. They are 0
    when every row is ignored, so nothing divides by zero.
    """

    ignore_index: int
    label_smoothing: float
    lse_square_scale: float
    softcap: float | None
    use_token_scaling: bool
    ce_grad_scale: float
    z_grad_scale: float
    weight_sum: float  # sum of ce_weight over the vocabulary (V when there are no weights)


class ChunkCEKernel(Protocol):
    """Signature every backend's chunk CE kernel implements.

    Arguments (M rows of one chunk, V the vocabulary):
      logits          (M, V) fp16/bf16/fp32, unit stride along V, any row stride; overwritten with
                      dL/dlogits (same dtype) when ``compute_grad`` is True and ``grad_out``
                      is None, untouched otherwise.
      target          (M,) integer, any strides (``kernel_target``); values in [0, V) or
                      ``ignore_index``.
      ce_weight       (V,) fp32, or None.
      scalars         the per-call ``ChunkScalars``.
      loss_out        (M,) fp32 contiguous (as every ``*_out``), written: ``st * ce`` per row.
      z_loss_out      (M,) fp32 or None: ``st * zl`` per row when given.
      correct_out     (M,) fp32 or None: 1.0 where argmax(z') == y (first index wins ties).
      predicted_out   (M,) int64 or None: argmax(z') (first index wins), -1 on ignored rows.
      row_grad_scale  (M,) fp32 or None: per-row upstream gradient (reduction="none" backward),
                      any strides (``kernel_row_vector``).
      compute_grad    whether to write the gradient (into ``logits``, unless ``grad_out``).
      grad_out        (M, V) logits dtype, unit stride along V, or None: where the gradient
                      goes, the logits then only read (saves the copy a caller who must keep
                      its logits would make); None writes it over the logits.
    """

    def __call__(
        self,
        logits: torch.Tensor,
        target: torch.Tensor,
        ce_weight: torch.Tensor | None,
        scalars: ChunkScalars,
        *,
        loss_out: torch.Tensor,
        z_loss_out: torch.Tensor | None,
        correct_out: torch.Tensor | None,
        predicted_out: torch.Tensor | None,
        row_grad_scale: torch.Tensor | None,
        compute_grad: bool,
        grad_out: torch.Tensor | None = None,
    ) -> None: ...


def unit_stride_along_vocabulary(logits: torch.Tensor) -> bool:
    """Whether a row's classes are adjacent in memory (the kernels' only layout demand on
    logits; the row stride is free). A single column is, whatever its stride says."""
    return logits.shape[-1] <= 1 or logits.stride(-1) == 1


def check_logits_layout(logits: torch.Tensor) -> None:
    """Refuses logits whose classes are not adjacent (``unit_stride_along_vocabulary``).
    Callers that own the logits make them contiguous instead (``flce.functional``); a
    kernel never copies a chunk of logits behind the caller's back."""
    if not unit_stride_along_vocabulary(logits):
        raise ValueError(f"logits must have unit stride along the vocabulary, got strides {tuple(logits.stride())}")


def kernel_target(target: torch.Tensor) -> torch.Tensor:
    """The target as the kernels read it: ``(M,)`` contiguous int64 or int32. A strided
    or expanded (stride-0) target is copied, and other integer dtypes widened to int64:
    M values, nothing next to a chunk of logits (the kernels load ``target_ptr + row``)."""
    if target.dtype not in (torch.int64, torch.int32):
        target = target.long()
    return target.contiguous()


def kernel_row_vector(name: str, vector: torch.Tensor | None, num_rows: int) -> torch.Tensor | None:
    """A per-row fp32 input (``row_grad_scale``, split-row statistics) as the kernels read
    it: ``(M,)`` contiguous fp32, copied when strided or expanded (M values)."""
    if vector is None:
        return None
    if tuple(vector.shape) != (num_rows,):
        raise ValueError(f"{name} must have shape ({num_rows},), got {tuple(vector.shape)}")
    return vector.to(torch.float32).contiguous()


def kernel_class_weights(ce_weight: torch.Tensor | None) -> torch.Tensor | None:
    """Class weights as the kernels read them: ``(V,)`` contiguous fp32 (V values)."""
    return None if ce_weight is None else ce_weight.to(torch.float32).contiguous()


def check_row_outputs(num_rows: int, **outputs: torch.Tensor | None) -> None:
    """Per-row outputs the kernels write at ``ptr + row``: each ``(M,)`` and contiguous.
    They are the driver's own buffers; anything else is a caller bug, refused rather than
    written past or into the wrong rows."""
    for name, out in outputs.items():
        if out is None:
            continue
        if tuple(out.shape) != (num_rows,) or (num_rows > 1 and out.stride(0) != 1):
            raise ValueError(
                f"{name} must be a contiguous ({num_rows},) tensor, got shape {tuple(out.shape)} "
                f"with strides {tuple(out.stride())}"
            )


def gradient_destination(logits: torch.Tensor, grad_out: torch.Tensor | None, compute_grad: bool) -> torch.Tensor:
    """Where a chunk kernel writes the gradient: ``grad_out`` (checked against the
    ``ChunkCEKernel`` contract: the logits' shape, dtype and device, unit stride along V)
    or, without it, the logits themselves; either must give each row its own memory."""
    if not compute_grad:
        return logits
    destination = logits
    if grad_out is not None:
        if grad_out.shape != logits.shape or grad_out.dtype != logits.dtype or grad_out.device != logits.device:
            raise ValueError(
                f"grad_out must match logits ({tuple(logits.shape)}, {logits.dtype}, {logits.device}), got "
                f"({tuple(grad_out.shape)}, {grad_out.dtype}, {grad_out.device})"
            )
        if not unit_stride_along_vocabulary(grad_out):
            raise ValueError(
                f"grad_out must have unit stride along the vocabulary, got strides {tuple(grad_out.stride())}"
            )
        destination = grad_out
    if destination.shape[0] > 1 and destination.stride(0) == 0:
        raise ValueError(
            "the gradient's destination repeats one row (stride 0, e.g. expanded logits written in place); "
            "each row's gradient needs its own memory: pass grad_out"
        )
    return destination


@dataclass(frozen=True)
class BackendSpec:
    """What a backend registers with ``flce.dispatch``.

    ``availability(device)`` returns ``(True, "")`` or ``(False, reason)``; the reason
    is shown to users (``flce info``, errors on explicit request). It must be cheap and
    must not raise. ``extra_bytes_per_logit`` is the kernel's fp32 workspace per logit
    beyond the chunk itself (0 for in-place kernels); the driver's chunk sizing uses it.
    ``auto_priority``: higher wins in auto dispatch among available backends.
    """

    name: str
    cross_entropy_chunk: ChunkCEKernel
    availability: callable
    extra_bytes_per_logit: int
    auto_priority: int
    description: str


def lazy_chunk_kernel(module: str) -> ChunkCEKernel:
    """A ``ChunkCEKernel`` that imports ``module`` (and its DSL: Triton, CUTLASS) on its
    first call, so importing a backend package never needs the optional dependency."""
    kernel = None

    def cross_entropy_chunk(*args, **kwargs) -> None:
        nonlocal kernel
        if kernel is None:
            kernel = importlib.import_module(module).cross_entropy_chunk
        kernel(*args, **kwargs)

    cross_entropy_chunk.__doc__ = f"``{module}.cross_entropy_chunk``, imported on first use."
    return cross_entropy_chunk
