"""The public loss functions: ``fused_linear_cross_entropy`` and ``cross_entropy``.

Each builds its options (``flce.options.LossOptions``, validated once), checks its
tensors at the boundary, and runs the call's plan (``flce.plan``): through the custom
ops of ``flce.ops`` under ``torch.compile``, else through the shared autograd Function,
or the forward alone when nothing needs a gradient.
"""

from __future__ import annotations

import torch

from flce.driver.validation import raise_pending
from flce.options import LossOptions, validate_fused_inputs, validate_logits_inputs
from flce.output import LossResult, package_result
from flce.plan import LinearOperands, LogitsOperands, make_plan, run_loss


def prepare_ce_weight(ce_weight: torch.Tensor | None) -> torch.Tensor | None:
    """Class weights as the kernels read them: detached (they get no gradient), fp32, contiguous."""
    return None if ce_weight is None else ce_weight.detach().float().contiguous()


def fused_linear_cross_entropy_with_options(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ce_weight: torch.Tensor | None,
    options: LossOptions,
) -> LossResult:
    """``fused_linear_cross_entropy`` with prebuilt options (modules and shims use this)."""
    if not torch.compiler.is_compiling():
        raise_pending()  # an earlier call's bad input, found on the device since
    compute_dtype = validate_fused_inputs(input, weight, target, bias, ce_weight, options)
    hidden, vocab = input.shape[-1], weight.shape[0]
    operands = LinearOperands(
        input=input.reshape(input.shape[:-1].numel(), hidden),  # explicit N: H may be 0
        weight=weight,
        bias=bias,
        target=target.reshape(-1),
        ce_weight=prepare_ce_weight(ce_weight),
    )
    if torch.compiler.is_compiling():
        from flce import ops  # registers the ops on first use

        outputs = ops.compiled_loss(operands, options, compute_dtype)
    else:
        plan = make_plan(options, input.device, operands.target, operands.ce_weight, vocab, compute_dtype)
        outputs = run_loss(plan, operands)
    return package_result(options, tuple(target.shape), *outputs)


def cross_entropy_with_options(
    logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, options: LossOptions
) -> LossResult:
    """``cross_entropy`` with prebuilt options (modules and shims use this)."""
    if not torch.compiler.is_compiling():
        raise_pending()
    validate_logits_inputs(logits, target, weight, options)
    vocab = logits.shape[-1]
    operands = LogitsOperands(
        logits=logits.reshape(-1, vocab), target=target.reshape(-1), ce_weight=prepare_ce_weight(weight)
    )
    if torch.compiler.is_compiling():
        from flce import ops  # registers the ops on first use

        outputs = ops.compiled_loss(operands, options, logits.dtype)
    else:
        plan = make_plan(options, logits.device, operands.target, operands.ce_weight, vocab, logits.dtype)
        outputs = run_loss(plan, operands)
    return package_result(options, tuple(target.shape), *outputs)


def fused_linear_cross_entropy(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ce_weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    lse_square_scale: float = 0.0,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    softcap: float | None = None,
    return_z_loss: bool = False,
    accum_dtype: torch.dtype | None = None,
    use_token_scaling: bool = False,
    return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False,
    backend: str | None = None,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    memory_budget: int | None = None,
) -> LossResult:
    """Cross-entropy of ``input @ weight.T + bias`` against ``target`` without materializing the logits.

    Args:
        input: ``(N, H)`` or ``(B, T, H)`` hidden states (fp16/bf16/fp32).
        weight: ``(V, H)`` LM-head weight, same dtype as ``input`` outside ``torch.autocast``.
        target: ``(N,)`` or ``(B, T)`` integer class indices in ``[0, V)`` or ``ignore_index``.
        bias: optional ``(V,)``.
        ce_weight: optional ``(V,)`` float class weights (finite, non-negative).
        ignore_index: target value whose rows contribute nothing (may be a real class id).
        lse_square_scale: z-loss scale ``s``; adds ``s * logsumexp(z)**2`` per row.
        label_smoothing: in ``[0, 1]``.
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (per token, shaped like ``target``;
            backward supported by recomputation).
        softcap: logits become ``softcap * tanh(z / softcap)``; ``None`` disables.
        return_z_loss / return_token_accuracy / return_predicted_tokens: also return these
            (then the result is a ``CrossEntropyOutput``).
        accum_dtype: dW/db accumulation dtype; ``None`` (default) and ``torch.float32``
            accumulate in fp32; the weight's own dtype accumulates in it (less memory).
        use_token_scaling: scale each row's loss and gradient by its detached ``p(target)``.
        backend: ``"torch"``, ``"triton"``, ``"cutedsl"`` or ``None`` (``FLCE_BACKEND``, then auto).
        chunk_size: rows per chunk; ``None`` sizes chunks from the memory budget
            (``flce.driver.sizing``).
        vocab_chunk_size: also split the vocabulary into blocks of this many classes
            (``flce.driver.vocab_blocks``): dW and dX are accumulated exactly in fp32
            with only a block of fp32 dW alive, at the price of computing the logits twice
            (8NVH instead of 6NVH FLOPs). ``None`` (default): the memory budget decides.
        memory_budget: bytes of workspace the call may use beyond its inputs and the
            gradients it returns; the fastest scheme that fits runs (``flce.driver.schemes``),
            or ``ValueError`` names the least it needs. ``None``: ``FLCE_MEMORY_BUDGET_MIB``,
            else the default rule (``flce.driver.sizing``). ``chunk_size`` and
            ``vocab_chunk_size`` given explicitly win over it.

    Returns:
        The fp32 loss (scalar for mean/sum, per token for none), or a ``CrossEntropyOutput``
        when a ``return_*`` flag is set.
    """
    options = LossOptions(
        ignore_index=ignore_index,
        lse_square_scale=lse_square_scale,
        label_smoothing=label_smoothing,
        reduction=reduction,
        softcap=softcap,
        return_z_loss=return_z_loss,
        accum_dtype=accum_dtype,
        use_token_scaling=use_token_scaling,
        return_token_accuracy=return_token_accuracy,
        return_predicted_tokens=return_predicted_tokens,
        backend=backend,
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
        memory_budget=memory_budget,
    )
    return fused_linear_cross_entropy_with_options(input, weight, target, bias, ce_weight, options)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    lse_square_scale: float = 0.0,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    softcap: float | None = None,
    return_z_loss: bool = False,
    use_token_scaling: bool = False,
    return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False,
    backend: str | None = None,
) -> LossResult:
    """Cross-entropy on logits the caller already has (``(N, V)`` or ``(B, T, V)``),
    with the same options and math as ``fused_linear_cross_entropy``; ``weight`` is the
    ``(V,)`` class weight. The caller's logits are never modified."""
    options = LossOptions(
        ignore_index=ignore_index,
        lse_square_scale=lse_square_scale,
        label_smoothing=label_smoothing,
        reduction=reduction,
        softcap=softcap,
        return_z_loss=return_z_loss,
        use_token_scaling=use_token_scaling,
        return_token_accuracy=return_token_accuracy,
        return_predicted_tokens=return_predicted_tokens,
        backend=backend,
    )
    return cross_entropy_with_options(logits, target, weight, options)
