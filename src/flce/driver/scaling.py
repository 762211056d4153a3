"""The upstream-gradient scaling of gradients computed in the forward."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flce.dispatch import device_helper
from flce.options import PLAIN_TENSOR_TYPES


def scale_gradients_(gradients: Sequence[torch.Tensor | None], grad_loss: torch.Tensor) -> None:
    """Multiplies each gradient by the 0-dim upstream gradient in place.

    Where a backend registers a scaling kernel for the device (Triton's, on CUDA and
    under its interpreter) the contiguous gradients (dX, dW, db: all the driver makes)
    are scaled in one launch, which skips the pass on the device when ``grad_loss`` is
    exactly 1, as it is for ``loss.backward()``, without reading it on the host; a
    strided gradient, or a device without the kernel, gets ``_multiply_in_fp32_``. On the
    CPU the scale is read on the host and a scale of exactly 1 skips every pass
    (multiplying by 1 changes no value, NaN included).
    """
    present = [g for g in gradients if g is not None]
    if not present:
        return
    device = present[0].device
    if device.type == "cpu" and grad_loss.item() == 1.0:
        return  # reading the scale costs no device sync on the CPU: skip the passes on the host
    scale_unless_one_ = device_helper("scale_unless_one", device)
    in_one_launch, multiplied = [], []
    for gradient in present:
        kernel_takes_it = scale_unless_one_ is not None and gradient.is_contiguous()
        (in_one_launch if kernel_takes_it else multiplied).append(gradient)
    if in_one_launch:
        scale_unless_one_(in_one_launch, grad_loss)
    for gradient in multiplied:
        _multiply_in_fp32_(gradient, grad_loss)


# Elements of a 16-bit gradient scaled per fp32 temporary (64 MiB of it).
FP32_SCALING_ELEMENTS = 2**24


def _multiply_in_fp32_(gradient: torch.Tensor, grad_loss: torch.Tensor) -> None:
    """``gradient *= grad_loss`` with the product in fp32, rounded once, as the kernels do.
    Not ``gradient.mul_(grad_loss.to(gradient.dtype))``: the scale rounded to a 16-bit
    dtype is Inf from 65520 on in fp16 (a loss scaler's 2^16 made every gradient Inf or
    NaN), subnormal or 0 below 6e-5 (the gradients flushed to 0), and 3 digits in bf16 (a
    bias of every gradient). A 16-bit gradient is scaled through an fp32 copy of at most
    ``FP32_SCALING_ELEMENTS`` elements at a time."""
    if gradient.dtype == grad_loss.dtype or gradient.numel() == 0:
        gradient.mul_(grad_loss)
        return
    flat = gradient.view(-1) if gradient.is_contiguous() else gradient
    row_elements = max(flat[0].numel(), 1)
    for part in flat.split(max(1, FP32_SCALING_ELEMENTS // row_elements)):
        part.copy_(part.float().mul_(grad_loss))


def scaled_gradients(gradients: Sequence[torch.Tensor | None], grad_loss: torch.Tensor) -> list[torch.Tensor | None]:
    """Each gradient times the 0-dim upstream gradient, out of place (for callers that
    must not modify the gradients they hold: a custom op's saved outputs, a CUDA graph's).
    Where a backend registers the ``scaled_copies`` kernel for the device, the contiguous
    gradients are scaled in one launch (the product in fp32, rounded once, as in place);
    the others (strided, or traced by ``torch.compile``) get a plain product, in fp32 and
    rounded once (as ``_multiply_in_fp32_``, and fused under ``torch.compile``)."""
    present = [g for g in gradients if g is not None]
    scaled_copies = device_helper("scaled_copies", present[0].device) if present else None
    # Plain tensors only: a traced call (torch.compile's fake and functional tensors) has no data.
    in_one_launch = [
        type(g) in PLAIN_TENSOR_TYPES and scaled_copies is not None and g.is_contiguous() for g in gradients
    ]
    taken = [g for g, kernel_takes_it in zip(gradients, in_one_launch, strict=True) if kernel_takes_it]
    copies = iter(scaled_copies(taken, grad_loss) if taken else ())
    return [
        next(copies) if kernel_takes_it else None if g is None else (g.float() * grad_loss).to(g.dtype)
        for g, kernel_takes_it in zip(gradients, in_one_launch, strict=True)
    ]
