"""The upstream-gradient scaling of gradients computed in the forward, and the power of
two they are computed at in fp16 (``forward_gradient_prescale``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from flce.dispatch import device_helper
from flce.options import PLAIN_TENSOR_TYPES


def sums_rows_in_fp16(
    weight: torch.Tensor | None, bias: torch.Tensor | None, weight_grad: bool, bias_grad: bool
) -> bool:
    """Whether a requested gradient is a sum over the rows kept in fp16: dW or db of an
    fp16 parameter (``forward_gradient_prescale`` then keeps 1)."""
    fp16 = torch.float16
    return (weight_grad and weight is not None and weight.dtype == fp16) or (
        bias_grad and bias is not None and bias.dtype == fp16
    )


def requested_sums_in_fp16(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """``sums_rows_in_fp16`` of the request autograd will make of a call (grad mode on and
    the parameter requiring grad), known before its plan is."""
    grad = torch.is_grad_enabled()
    return sums_rows_in_fp16(
        weight, bias, grad and weight.requires_grad, grad and bias is not None and bias.requires_grad
    )


def forward_gradient_prescale(
    reduction: str, compute_dtype: torch.dtype, n_rows: int, sums_rows_in_fp16: bool = False
) -> float:
    """The upstream gradient (a power of two) at which the forward computes the gradients
    of a mean or sum loss; ``flce.plan.backward`` multiplies them by ``grad_loss / prescale``
    (exact: a power of two) in fp32 and rounds once.

    1 except for an fp16 mean. There the logits' gradient ``(p - y) / N`` is rounded to
    fp16, and from N of a few thousand most of it lies below fp16's normal range (2^-14)
    or flushes to 0; dX (``(C, H)``, rounded to fp16) follows. Eager PyTorch under a loss
    scaler (``torch.amp.GradScaler``: 2^16) folds the scaler's factor in before rounding;
    the forward cannot, as the upstream gradient is not known yet. Computing at
    ``2^floor(log2 N)`` puts the gradients at the sum's scale, where eager's accuracy is.
    Measured on the CPU (torch backend, H = 64, upstream 2^16, fp32 parameters under fp16
    autocast, N = 8192, V = 32000): dX's relative error 6.3e-2 and dW's 3.3e-2 at a
    prescale of 1, 3.1e-4 and 2.3e-4 with it, eager's 3.1e-4 and 3.1e-4; on an H100 at
    N = 8192, V = 128256, H = 4096 (cutedsl, triton): 1.6e-2 and 6.0e-3 at 1, 3.3e-4 and
    2.1e-4 with it, eager's 3.3e-4 and 2.9e-4 (benchmarks/results/fp16-loss-scaler-h100).
    A smaller one
    falls short at a large vocabulary, whose probabilities are small: with every operand
    fp16 at N = 2048, V = 128256, dX's error was 3.0e-4 at ``2^floor(log2 N)`` and 6.4e-4
    at ``2^(floor(log2 N) - 4)``, eager's 3.0e-4. dX, kept at the prescale until the
    backward, is then at most about ``2 max|W| 2^floor(log2 N) / n_valid``: within fp16's
    range unless nearly every row is ignored and the weight is large.

    1 for bf16 (eight exponent bits), the sum (its gradient is at that scale already), and
    where ``sums_rows_in_fp16``: a dW or db of an fp16 parameter, a sum over the rows, would
    be kept at the prescale and could exceed fp16's largest value (65504) where the
    gradient times the scaler's factor does not (a pure fp16 model's loss scaler, as in
    DeepSpeed's fp16 training, adapts its factor to what fits; it could not undo an
    overflow of a fixed prescale). Those calls keep the accuracy of an upstream gradient
    of 1 (README). ``GradScaler``'s own setup keeps fp32 parameters (dW is an fp32 sum),
    and a frozen fp16 weight (LoRA on an fp16 base model) computes no dW: both are
    prescaled."""
    if compute_dtype != torch.float16 or reduction != "mean" or sums_rows_in_fp16 or n_rows < 2:
        return 1.0
    return float(2 ** math.floor(math.log2(n_rows)))


def prescaled_upstream(grad_loss: torch.Tensor, prescale: float) -> torch.Tensor:
    """The factor taking gradients computed at the upstream gradient ``prescale``
    (``forward_gradient_prescale``) to ``grad_loss``'s: ``grad_loss / prescale`` in fp32,
    exact (a power of two). Callers skip it at a prescale of 1 (the backward's hot path)."""
    return grad_loss.float() * (1.0 / prescale)


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
