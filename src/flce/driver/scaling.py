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
    strided gradient, or a device without the kernel, gets a plain ``mul_``. On the
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
        gradient.mul_(grad_loss.to(gradient.dtype))


def scaled_gradients(gradients: Sequence[torch.Tensor | None], grad_loss: torch.Tensor) -> list[torch.Tensor | None]:
    """Each gradient times the 0-dim upstream gradient, out of place (for callers that
    must not modify the gradients they hold: a custom op's saved outputs, a CUDA graph's).
    Where a backend registers the ``scaled_copies`` kernel for the device, the contiguous
    gradients are scaled in one launch (the product in fp32, rounded once, as in place);
    the others (strided, or traced by ``torch.compile``) get a plain product."""
    present = [g for g in gradients if g is not None]
    scaled_copies = device_helper("scaled_copies", present[0].device) if present else None
    # Plain tensors only: a traced call (torch.compile's fake and functional tensors) has no data.
    in_one_launch = [
        type(g) in PLAIN_TENSOR_TYPES and scaled_copies is not None and g.is_contiguous() for g in gradients
    ]
    taken = [g for g, kernel_takes_it in zip(gradients, in_one_launch, strict=True) if kernel_takes_it]
    copies = iter(scaled_copies(taken, grad_loss) if taken else ())
    return [
        next(copies) if kernel_takes_it else None if g is None else g * grad_loss.to(g.dtype)
        for g, kernel_takes_it in zip(gradients, in_one_launch, strict=True)
    ]
