"""Dense float64 reference of every formula in the contract.

Written directly from the math (log-softmax, autograd for gradients), with no code
shared with the chunked driver or any kernel, so it can judge them. It materializes
the (N, V) logits: use it on small shapes only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ReferenceResult:
    loss: torch.Tensor  # scalar, or (N,) for reduction="none"
    z_loss: torch.Tensor
    token_accuracy: torch.Tensor
    predicted_tokens: torch.Tensor  # (N,) int64, -1 on ignored rows


def cross_entropy_reference(
    logits: torch.Tensor,  # (N, V) float64 (anything else is upcast)
    target: torch.Tensor,  # (N,)
    *,
    ce_weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    lse_square_scale: float = 0.0,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    softcap: float | None = None,
    use_token_scaling: bool = False,
    math_dtype: torch.dtype = torch.float64,
) -> ReferenceResult:
    """Loss on given logits, differentiable through ``logits`` (autograd in ``math_dtype``).

    ``math_dtype=torch.float32`` on low-precision logits is what eager PyTorch code
    does (``cross_entropy(logits.float())``): tests use it to measure PyTorch's own
    error in a dtype, the yardstick of every tolerance.
    """
    z = logits.to(math_dtype)
    n, vocab = z.shape
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    valid = target != ignore_index
    y = torch.where(valid, target, torch.zeros_like(target)).long()
    log_p = torch.log_softmax(z, dim=-1)  # log p_i = z'_i - lse
    lse = torch.logsumexp(z, dim=-1)
    w = torch.ones(vocab, dtype=math_dtype) if ce_weight is None else ce_weight.to(math_dtype).cpu()
    w = w.to(z.device)
    w_y = w[y]
    nll = -log_p.gather(1, y[:, None]).squeeze(1)
    smooth = -(log_p * w[None, :]).sum(dim=-1)  # sum_i w_i (lse - z'_i)
    ce = (1 - label_smoothing) * w_y * nll + (label_smoothing / vocab) * smooth
    zl = lse_square_scale * lse**2
    if use_token_scaling:
        token_scale = torch.exp(-nll).detach()
        ce = ce * token_scale
        zl = zl * token_scale
    zero = torch.zeros((), dtype=math_dtype, device=z.device)
    ce = torch.where(valid, ce, zero)
    zl = torch.where(valid, zl, zero)
    predicted = torch.where(valid, z.detach().argmax(dim=-1), torch.full_like(y, -1))
    correct = ((predicted == target) & valid).to(math_dtype)

    n_valid = valid.sum().to(math_dtype)
    if reduction == "none":
        return ReferenceResult(ce + zl, zl, correct, predicted)
    accuracy = correct.sum() / n_valid if n_valid > 0 else zero
    if reduction == "sum":
        return ReferenceResult(ce.sum() + zl.sum(), zl.sum(), accuracy, predicted)
    ce_denominator = (w_y * valid).sum() if ce_weight is not None else n_valid
    ce_mean = ce.sum() / ce_denominator if ce_denominator > 0 else ce.sum() * 0
    z_mean = zl.sum() / n_valid if n_valid > 0 else zl.sum() * 0
    return ReferenceResult(ce_mean + z_mean, z_mean, accuracy, predicted)


def fused_linear_cross_entropy_reference(
    input: torch.Tensor,  # (N, H)
    weight: torch.Tensor,  # (V, H)
    target: torch.Tensor,  # (N,)
    bias: torch.Tensor | None = None,  # (V,)
    logits_dtype: torch.dtype = torch.float64,
    **options,
) -> ReferenceResult:
    """``cross_entropy_reference(input @ weight.T + bias)``, differentiable through
    whichever of ``input``/``weight``/``bias`` require grad. The logits GEMM runs in
    ``logits_dtype`` (float64 for the reference; the inputs' own dtype to measure eager
    PyTorch's error, with ``math_dtype=torch.float32``)."""
    # F.linear, as an LM head computes it (the bias is added inside the GEMM, one rounding).
    logits = torch.nn.functional.linear(
        input.to(logits_dtype), weight.to(logits_dtype), None if bias is None else bias.to(logits_dtype)
    )
    return cross_entropy_reference(logits, target, **options)
