"""Chunk kernels of the logprobs head in plain PyTorch (fp32 math): run on any device,
and are the readable twin of the fused kernels (formulas in ``flce.rows.logprobs``)."""

from __future__ import annotations

import torch

from flce.backends.base import gradient_destination
from flce.rows import logprobs as rows
from flce.rows.cross_entropy import gather_safe_target

# fp32 temporaries per logit beyond the chunk itself, at most three (M, V) tensors at
# once: z, then in backward log p (in z's storage), p and the gradient.
EXTRA_BYTES_PER_LOGIT = 12


def _scaled_fp32(logits: torch.Tensor, inv_temperature: float) -> torch.Tensor:
    """z = logits * inv_temperature as a new fp32 tensor (M, V): never aliases the
    logits, which may be where the gradient goes."""
    return logits.to(torch.float32, copy=True).mul_(inv_temperature)


def logprobs_forward_chunk(
    logits: torch.Tensor,  # (M, V) fp16/bf16/fp32; only read
    target: torch.Tensor,  # (M,) int
    *,
    inv_temperature: float,
    ignore_index: int,
    logprob_out: torch.Tensor,  # (M,) fp32
    entropy_out: torch.Tensor | None,  # (M,) fp32
    lse_out: torch.Tensor,  # (M,) float64 (or float32)
    predicted_out: torch.Tensor | None = None,  # (M,) int64
) -> None:
    rows.check_forward_arguments(logits, target, inv_temperature, logprob_out, entropy_out, lse_out, predicted_out)
    if logits.shape[0] == 0:
        return
    valid = target != ignore_index  # (M,)
    # An out-of-range target (whose call the batch statistics poison) reads class 0: never out of bounds.
    safe_target = gather_safe_target(target, valid, logits.shape[1])  # (M,) int64
    z = _scaled_fp32(logits, inv_temperature)
    target_logit = z.gather(1, safe_target[:, None]).squeeze(1)  # (M,)
    if predicted_out is not None:  # before the statistics consume z; argmax takes the first maximum
        predicted_out.copy_(torch.where(valid, z.argmax(dim=-1), -1))
    values = rows.row_values(rows.block_statistics(z, with_spread=entropy_out is not None), target_logit)
    logprob_out.copy_(values.logprob.masked_fill_(~valid, 0.0))
    lse_out.copy_(values.lse.masked_fill_(~valid, 0.0))  # rounded to lse_out's dtype here
    if entropy_out is not None:
        entropy_out.copy_(values.entropy.masked_fill_(~valid, 0.0))


def logprobs_backward_chunk(
    logits: torch.Tensor,  # (M, V) fp16/bf16/fp32; the gradient's place unless grad_out
    target: torch.Tensor,  # (M,) int
    lse: torch.Tensor,  # (M,) float64 or float32
    entropy: torch.Tensor | None,  # (M,) fp32
    grad_logprob: torch.Tensor | None,  # (M,) fp32
    grad_entropy: torch.Tensor | None,  # (M,) fp32
    *,
    inv_temperature: float,
    ignore_index: int,
    grad_out: torch.Tensor | None = None,  # (M, V) logits dtype
) -> None:
    rows.check_backward_arguments(logits, target, lse, entropy, grad_logprob, grad_entropy, inv_temperature)
    if logits.shape[0] == 0:
        return
    destination = gradient_destination(logits, grad_out, True)
    valid = target != ignore_index  # (M,)
    safe_target = gather_safe_target(target, valid, logits.shape[1])  # (M,) int64, in bounds
    # dL/dlogits = dL/dz / temperature, folded into the row coefficients
    coef_logprob = None if grad_logprob is None else grad_logprob * inv_temperature
    coef_entropy = None if grad_entropy is None else grad_entropy * inv_temperature
    grad = rows.logits_gradient(
        _scaled_fp32(logits, inv_temperature), safe_target, lse, entropy, coef_logprob, coef_entropy
    )
    # Ignored rows are zeroed here, not through their coefficients: the forward pass left
    # their lse 0, so exp(z - lse) may overflow there and 0 * inf would leave NaN.
    destination.copy_(grad.masked_fill_(~valid[:, None], 0.0))
