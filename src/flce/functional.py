"""The public loss functions: ``fused_linear_cross_entropy`` and ``cross_entropy``, and
the RL and distillation heads ``fused_linear_logprobs`` and ``fused_linear_distillation``.

Each builds its options (``flce.options``: one frozen dataclass per head, validated
once), checks its tensors at the boundary, and runs the call's plan (``flce.plan``,
``flce.heads``): through the custom ops of ``flce.ops`` under ``torch.compile``, else
through the shared autograd Function, or the forward alone when nothing needs a gradient.
"""

from __future__ import annotations

import torch

from flce.driver.scaling import requested_sums_in_fp16
from flce.heads.distillation import DistillationOperands, make_distillation_plan
from flce.heads.logprobs import LogprobsOperands, backward_request, make_logprobs_plan
from flce.options import (
    DistillationOptions,
    HeadNames,
    LogprobsOptions,
    LossOptions,
    cached_options,
    check_tensor_type,
    index_target,
    refuse_function_transforms,
    row_count,
    validate_fused_inputs,
    validate_head_target,
    validate_linear_head,
    validate_logits_inputs,
)
from flce.output import LogprobsOutput, LossResult, package_result
from flce.plan import LinearOperands, LogitsOperands, make_plan, run_loss


def as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """``(..., D)`` -> ``(N, D)``: a 2-D tensor as it is (no view op per call), else flattened
    with an explicit N (D may be 0)."""
    return tensor if tensor.dim() == 2 else tensor.reshape(row_count(tensor), tensor.shape[-1])


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
    compiling = torch.compiler.is_compiling()
    compute_dtype = validate_fused_inputs(input, weight, target, bias, ce_weight, options)
    vocab = weight.shape[0]
    operands = LinearOperands(
        input=as_rows(input),
        weight=weight,
        bias=bias,
        target=index_target(target, options.ignore_index),
        ce_weight=prepare_ce_weight(ce_weight),
    )
    if compiling:
        from flce import ops  # registers the ops on first use

        outputs = ops.compiled_loss(operands, options, compute_dtype)
    else:
        refuse_function_transforms(operands.entry, operands.tensors())
        fp16_sums = compute_dtype == torch.float16 and requested_sums_in_fp16(weight, bias)
        o = operands
        plan = make_plan(options, input.device, o.target, o.ce_weight, vocab, compute_dtype, fp16_row_sums=fp16_sums)
        outputs = run_loss(plan, operands)
    return package_result(options, tuple(target.shape), *outputs)


def cross_entropy_with_options(
    logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, options: LossOptions
) -> LossResult:
    """``cross_entropy`` with prebuilt options (modules and shims use this)."""
    compiling = torch.compiler.is_compiling()
    validate_logits_inputs(logits, target, weight, options)
    vocab = logits.shape[-1]
    operands = LogitsOperands(
        logits=as_rows(logits),
        target=index_target(target, options.ignore_index),
        ce_weight=prepare_ce_weight(weight),
    )
    if compiling:
        from flce import ops  # registers the ops on first use

        outputs = ops.compiled_loss(operands, options, logits.dtype)
    else:
        refuse_function_transforms(operands.entry, operands.tensors())
        plan = make_plan(
            options, logits.device, operands.target, operands.ce_weight, vocab, logits.dtype, operands.class_weight_name
        )
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
            (then the result is a ``CrossEntropyOutput``). The z-loss (already inside the
            loss, which carries its gradient) and the accuracy are returned detached.
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
    options = cached_options(
        LossOptions,
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
    options = cached_options(
        LossOptions,
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


# ------------------------------------------------------------ RL and distillation


def fused_linear_logprobs_with_options(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    options: LogprobsOptions,
) -> LogprobsOutput:
    """``fused_linear_logprobs`` with prebuilt options."""
    check_tensor_type("target", target)
    compute_dtype = validate_linear_head(input, weight, bias)
    validate_head_target(target, input)
    operands = LogprobsOperands(
        input=as_rows(input),
        weight=weight,
        bias=bias,
        target=index_target(target, options.ignore_index),
    )
    if torch.compiler.is_compiling():
        from flce import ops  # registers the ops on first use

        logprobs, entropy, predicted = ops.compiled_logprobs(operands, options, compute_dtype)
    else:
        refuse_function_transforms(operands.entry, operands.tensors())
        plan = make_logprobs_plan(options, operands, compute_dtype, backward_request(operands))
        logprobs, entropy, predicted = run_loss(plan, operands)
    return LogprobsOutput(
        logprobs=logprobs.view(target.shape),
        entropy=entropy.view(target.shape) if options.return_entropy else None,
        predicted_tokens=predicted.view(target.shape) if options.return_predicted_tokens else None,
    )


def fused_linear_logprobs(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    return_predicted_tokens: bool = False,
    ignore_index: int = -100,
    backend: str | None = None,
    chunk_size: int | None = None,
    memory_budget: int | None = None,
) -> LogprobsOutput:
    """Per-token log-probabilities of ``target`` (and entropies) under
    ``softmax((input @ weight.T + bias) / temperature)``, without materializing the logits.

    Args:
        input: ``(N, H)`` or ``(B, T, H)`` hidden states (fp16/bf16/fp32).
        weight: ``(V, H)`` LM-head weight, same dtype as ``input`` outside ``torch.autocast``.
        target: ``(N,)`` or ``(B, T)`` integer token ids in ``[0, V)`` or ``ignore_index``
            (the sampled tokens).
        bias: optional ``(V,)``.
        temperature: > 0; the logits are divided by it (the sampler's temperature).
        return_entropy: also return each token's entropy ``-sum_i p_i log p_i``.
        return_predicted_tokens: also return each token's most likely class (the first
            maximum of the temperature-scaled logits; -1 at ignored tokens), computed in
            the same pass over the logits: ``predicted_tokens == target`` is whether the
            target is the top-1 token, with no second GEMM.
        ignore_index: target value whose tokens get logprob 0, entropy 0 and no gradient.
        backend: ``"torch"``, ``"triton"`` or ``None`` (``FLCE_BACKEND``, then the best
            backend with logprobs kernels); ``"cutedsl"`` has none and is refused.
        chunk_size: rows per chunk; ``None`` sizes chunks from the memory budget.
        memory_budget: bytes of workspace (``None``: ``FLCE_MEMORY_BUDGET_MIB``, else the
            default rule of ``flce.driver.sizing``). When one chunk of every row fits it,
            the forward keeps its logits for the backward (3 GEMMs in all); otherwise
            the backward recomputes them chunk by chunk (4 GEMMs).

    Returns:
        A ``LogprobsOutput``: ``logprobs`` and ``entropy`` (None without
        ``return_entropy``), fp32, shaped like ``target``, differentiable with any upstream
        gradients (e.g. ``exp(logprobs - old_logprobs) * advantages`` and an entropy
        bonus); ``predicted_tokens`` (None without ``return_predicted_tokens``), int64.
    """
    options = cached_options(
        LogprobsOptions,
        temperature=temperature,
        return_entropy=return_entropy,
        return_predicted_tokens=return_predicted_tokens,
        ignore_index=ignore_index,
        backend=backend,
        chunk_size=chunk_size,
        memory_budget=memory_budget,
    )
    return fused_linear_logprobs_with_options(input, weight, target, bias, options)


STUDENT = HeadNames("student_input", "student_weight", "student_bias")
TEACHER = HeadNames("teacher_input", "teacher_weight", "teacher_bias")


def _validate_distillation_inputs(
    student_input, student_weight, student_bias, teacher_input, teacher_weight, teacher_bias, target
) -> tuple[torch.dtype, torch.dtype]:
    """The student's and the teacher's LM heads, and the target; returns their compute dtypes."""
    compute_dtype = validate_linear_head(student_input, student_weight, student_bias, STUDENT)
    teacher_dtype = validate_linear_head(teacher_input, teacher_weight, teacher_bias, TEACHER)
    if teacher_input.device != student_input.device:
        raise ValueError(
            f"teacher_input is on {teacher_input.device} but student_input is on {student_input.device}; "
            "all tensors must share a device"
        )
    if teacher_input.shape[:-1] != student_input.shape[:-1]:
        raise ValueError(
            f"teacher_input must have one row per row of student_input: leading shape "
            f"{tuple(student_input.shape[:-1])}, got shape {tuple(teacher_input.shape)}"
        )
    if teacher_weight.shape[0] != student_weight.shape[0]:
        raise ValueError(
            f"the teacher's and the student's vocabularies must match: teacher_weight has V = "
            f"{teacher_weight.shape[0]} rows, student_weight has {student_weight.shape[0]}"
        )
    if target is not None:
        check_tensor_type("target", target)
        validate_head_target(target, student_input, "student_input")
    return compute_dtype, teacher_dtype


def _detached(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach()


def fused_linear_distillation_with_options(
    student_input: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_input: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: torch.Tensor | None,
    student_bias: torch.Tensor | None,
    teacher_bias: torch.Tensor | None,
    options: DistillationOptions,
) -> torch.Tensor:
    """``fused_linear_distillation`` with prebuilt options (the Liger shims use this)."""
    compute_dtype, teacher_dtype = _validate_distillation_inputs(
        student_input, student_weight, student_bias, teacher_input, teacher_weight, teacher_bias, target
    )
    n_rows = row_count(student_input)
    operands = DistillationOperands(
        input=student_input.reshape(n_rows, student_input.shape[-1]),
        weight=student_weight,
        bias=student_bias,
        # The teacher is a constant: no gradient reaches it (as in Liger's).
        teacher_input=teacher_input.detach().reshape(n_rows, teacher_input.shape[-1]),
        teacher_weight=teacher_weight.detach(),
        teacher_bias=_detached(teacher_bias),
        target=None if target is None else index_target(target, options.ignore_index),
    )
    if torch.compiler.is_compiling():
        from flce import ops  # registers the ops on first use

        (loss,) = ops.compiled_distillation(operands, options, compute_dtype, teacher_dtype)
    else:
        refuse_function_transforms(operands.entry, operands.tensors())
        plan = make_distillation_plan(
            options,
            student_input.device,
            operands.target,
            n_rows,
            student_weight.shape[0],
            compute_dtype,
            teacher_dtype,
            fp16_row_sums=requested_sums_in_fp16(student_weight, student_bias),
        )
        (loss,) = run_loss(plan, operands)
    return loss.view(student_input.shape[:-1]) if options.reduction == "none" else loss


def fused_linear_distillation(
    student_input: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_input: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: torch.Tensor | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    backend: str | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Liger's generalized Jensen-Shannon divergence between the teacher's and the
    student's next-token distributions, from their LM heads, without materializing
    either logits tensor. With ``q = softmax(z_student / T)``, ``p = softmax(z_teacher / T)``
    and ``M = beta p + (1 - beta) q``, per token ``beta KL(p || M) + (1 - beta) KL(q || M)``;
    ``beta = 0`` is the forward KL(p || q), ``beta = 1`` the reverse KL(q || p).

    Args:
        student_input: ``(N, H)`` or ``(B, T, H)``; student_weight: ``(V, H)``.
        teacher_input: the same leading shape, ``(.., H_t)``; teacher_weight: ``(V, H_t)``
            (the vocabularies must match, the hidden sizes may differ).
        target: optional ``(N,)`` or ``(B, T)`` token ids; tokens whose target equals
            ``ignore_index`` get loss 0 and no gradient (without a target none is ignored).
        beta: in ``[0, 1]``. temperature: > 0, divides both models' logits (no ``T**2``
            factor, as Liger).
        reduction: ``"mean"`` over the tokens not ignored (0 when every token is),
            ``"sum"``, or ``"none"`` (per token, shaped like the inputs' leading dims).
        student_bias / teacher_bias: optional ``(V,)``.
        backend, chunk_size: as ``fused_linear_logprobs``.

    Returns:
        The fp32 loss. Gradients reach ``student_input``, ``student_weight`` and
        ``student_bias`` only: the teacher's tensors are treated as constants.
    """
    options = cached_options(
        DistillationOptions,
        beta=beta,
        temperature=temperature,
        ignore_index=ignore_index,
        reduction=reduction,
        backend=backend,
        chunk_size=chunk_size,
    )
    return fused_linear_distillation_with_options(
        student_input, student_weight, teacher_input, teacher_weight, target, student_bias, teacher_bias, options
    )
