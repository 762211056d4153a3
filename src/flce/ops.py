"""``torch.library`` custom ops, so ``torch.compile(..., fullgraph=True)`` traces through flce.

Under compilation the public functions call ``compiled_loss`` (``compiled_logprobs``,
``compiled_distillation``) instead of the eager autograd Function. Each op is opaque to
the compiler (the plan, the chunk loop and the kernels stay inside), has a fake
implementation giving output shapes, and registered autograd; all of them run
``flce.plan``'s one forward/backward pair. The options travel field by field, in a
schema derived from the head's options dataclass (``flce.options.options_schema``).

The forward op returns the gradients it computed as extra outputs (empty when not
requested or deferred), at the upstream gradient ``flce.driver.scaling.forward_gradient_prescale``
gives (1 but for an fp16 mean); backward scales them out of place (an op must not modify its
saved outputs), so a repeated backward never compounds. ``reduction="none"`` (and the
logprobs head, always) recomputes in a backward op with the per-token upstream
gradients; the logprobs forward op returns the float64 lse the backward op needs. So
does a gradient autograd needs that the forward was not asked for (a ``torch.export``
program traced under ``torch.no_grad()``, run with autograd).
"""

from __future__ import annotations

import torch
from torch import Tensor

from flce.driver.chunks import NO_GRADIENTS, Gradients, GradRequest
from flce.driver.scaling import forward_gradient_prescale, prescaled_upstream, scaled_gradients, sums_rows_in_fp16
from flce.heads.distillation import DistillationOperands, make_distillation_plan
from flce.heads.logprobs import LogprobsOperands, make_logprobs_plan
from flce.options import (
    OPTION_FIELDS,
    DistillationOptions,
    LogprobsOptions,
    LossOptions,
    option_fields,
    option_values,
    options_from_values,
    options_schema,
    refuse_create_graph,
    refuse_function_transforms,
)
from flce.plan import LinearOperands, LogitsOperands, Operands, backward, make_plan, op_forward
from flce.rows.cross_entropy import Reduced

_EMPTY = (0,)
_N_OPTIONS = len(OPTION_FIELDS)
_REDUCED = "Tensor loss, Tensor z_loss, Tensor token_accuracy, Tensor predicted_tokens"


def _define(name: str, arguments: str, returns: str, impl, fake):
    """A custom op ``flce::name`` whose schema is spelled here once; ``impl`` and ``fake``
    take the arguments positionally."""
    op = torch.library.custom_op(f"flce::{name}", impl, mutates_args=(), schema=f"({arguments}) -> ({returns})")
    op.register_fake(fake)
    return op


def _split(args: tuple, n_tensors: int, options_type: type = LossOptions) -> tuple[tuple, object, tuple]:
    """(tensors, options, the remaining arguments) of an op's positional arguments."""
    n_options = len(option_fields(options_type))
    options = options_from_values(args[n_tensors : n_tensors + n_options], options_type)
    return args[:n_tensors], options, args[n_tensors + n_options :]


def _save_for_backward(
    ctx,
    arguments: tuple,
    options,
    inputs: tuple,
    gradients: tuple,
    computed: tuple[bool, ...],
    wanted: tuple[bool, ...],
    gradient_prescale: float,
    backward_takes_flags: bool = True,
) -> None:
    """What a loss op's backward needs: with ``reduction="none"`` (upstream gradients per
    token, known only then) its inputs and ``arguments`` for the backward op; otherwise the
    gradients the forward computed, to be scaled.

    ``computed``: the differentiable inputs' gradients the forward was asked for (its
    flags, fixed when the call was traced); ``wanted``: those autograd needs now
    (``ctx.needs_input_grad``). They differ in a program exported by ``torch.export``
    under ``torch.no_grad()``, or with an input that did not require grad, and then run
    with autograd: a gradient wanted but not computed is recomputed by the backward op,
    as for ``reduction="none"``, rather than silently missing. (Under ``torch.compile``
    the flags are guarded: they always agree.) The backward op is asked for the wanted
    gradients (its trailing flags, ``backward_takes_flags``). ``gradient_prescale``: the
    upstream gradient the forward op computed its gradients at
    (``flce.driver.scaling.forward_gradient_prescale``, as the plan's)."""
    ctx.wanted = wanted
    ctx.gradient_prescale = gradient_prescale
    ctx.deferred = options.reduction == "none" or any(w and not c for w, c in zip(wanted, computed, strict=True))
    ctx.arguments = arguments + (wanted if backward_takes_flags else ())
    ctx.n_arguments = len(arguments) + len(computed)  # the op's non-tensor arguments, flags included
    ctx.save_for_backward(*(inputs if ctx.deferred else gradients))


def _backward_gradients(ctx, grad_loss: Tensor, backward_op) -> tuple:
    """The gradients of ``_save_for_backward``'s op, None where not wanted: computed by
    ``backward_op`` or scaled out of place."""
    if ctx.deferred:
        gradients = backward_op(grad_loss, *ctx.saved_tensors, *ctx.arguments)
        if not isinstance(gradients, tuple):
            gradients = (gradients,)  # an op of one output returns it bare
    else:
        if ctx.gradient_prescale != 1.0:
            grad_loss = prescaled_upstream(grad_loss, ctx.gradient_prescale)
        gradients = scaled_gradients(ctx.saved_tensors, grad_loss)
    return tuple(g if wanted else None for g, wanted in zip(gradients, ctx.wanted, strict=True))


def _or_empty(t: Tensor | None, like: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` contiguous, as the fake implementations describe every output; an empty (0,)
    tensor when absent. (The driver allocates dX like the input, ``torch.empty_like``: a
    transposed input would give a transposed dX, whose strides the compiled graph, built
    from the fake's, would misread; the copy happens only then.)"""
    return like.new_empty(_EMPTY, dtype=dtype) if t is None else t.contiguous()


def _reduced_outputs(reduced: Reduced, like: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    f32 = torch.float32
    return (
        reduced.loss,
        _or_empty(reduced.z_loss, like, f32),
        _or_empty(reduced.token_accuracy, like, f32),
        _or_empty(reduced.predicted_tokens, like, torch.int64),
    )


def _fake_reduced(options: LossOptions, n_rows: int, like: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    scalar_or_rows = (n_rows,) if options.reduction == "none" else ()

    def f32(present: bool) -> Tensor:
        return like.new_empty(scalar_or_rows if present else _EMPTY, dtype=torch.float32)

    return (
        f32(True),
        f32(options.return_z_loss),
        f32(options.return_token_accuracy),
        like.new_empty((n_rows,) if options.return_predicted_tokens else _EMPTY, dtype=torch.int64),
    )


def _plan_for(operands: Operands, options: LossOptions, compute_dtype: torch.dtype, request: GradRequest | None = None):
    """The call's plan; ``request``: the forward op's (its gradients' prescale depends on
    it, ``sums_rows_in_fp16``), None for a backward op (which folds the upstream gradient
    in: no prescale)."""
    o = operands
    logits = isinstance(o, LogitsOperands)
    vocab = o.logits.shape[1] if logits else o.weight.shape[0]
    device = o.tensors()[0].device
    fp16_sums = not logits and request is not None and sums_rows_in_fp16(o.weight, o.bias, request.weight, request.bias)
    return make_plan(
        options, device, o.target, o.ce_weight, vocab, compute_dtype, o.class_weight_name, fp16_row_sums=fp16_sums
    )


def _fake_gradients(input, weight, bias, grad_input, grad_weight, grad_bias) -> tuple[Tensor, Tensor, Tensor]:
    """The gradient outputs' shapes and dtypes, as the ops fill them (``_or_empty``)."""

    def grad_like(t: Tensor | None, wanted: bool, empty_dtype: torch.dtype) -> Tensor:
        return t.new_empty(t.shape) if t is not None and wanted else input.new_empty(_EMPTY, dtype=empty_dtype)

    return (
        grad_like(input, grad_input, input.dtype),
        grad_like(weight, grad_weight, weight.dtype),
        grad_like(bias, grad_bias, torch.float32),
    )


def _gradient_outputs(grads: Gradients, input: Tensor, weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return (
        _or_empty(grads.input, input, input.dtype),
        _or_empty(grads.weight, input, weight.dtype),
        _or_empty(grads.bias, input, torch.float32),
    )


# ------------------------------------------------------------- fused linear CE
# Arguments: input (N, H), weight (V, H), target (N,), bias (V,)?, ce_weight (V,) fp32?,
# the options, compute_dtype, grad_input, grad_weight, grad_bias.
_LINEAR = "Tensor input, Tensor weight, Tensor target, Tensor? bias, Tensor? ce_weight"
_LINEAR_REST = "ScalarType compute_dtype, bool grad_input, bool grad_weight, bool grad_bias"


def _linear_forward(*args):
    """-> (loss, z_loss, token_accuracy, predicted_tokens, grad_input, grad_weight, grad_bias);
    entries not requested (or deferred to backward) are empty (0,) tensors."""
    (input, weight, target, bias, ce_weight), options, (compute_dtype, *flags) = _split(args, 5)
    operands = LinearOperands(input, weight, bias, target, ce_weight)
    request = GradRequest(flags[0], flags[1], flags[2] and bias is not None)
    result = op_forward(_plan_for(operands, options, compute_dtype, request), operands, request)
    grads = result.gradients or Gradients(None, None, None)
    return _reduced_outputs(result.outputs, input) + _gradient_outputs(grads, input, weight)


def _linear_forward_fake(*args):
    (input, weight, _, bias, _), options, (_, grad_input, grad_weight, grad_bias) = _split(args, 5)
    now = options.reduction != "none"  # mean/sum compute the gradients in the forward
    return _fake_reduced(options, input.shape[0], input) + _fake_gradients(
        input, weight, bias, grad_input and now, grad_weight and now, grad_bias and now
    )


def _linear_backward(*args):
    """Recomputes the chunks with the upstream gradient (first argument) folded into each
    row -> (dX, dW, db), empty where not requested."""
    (grad_loss, input, weight, target, bias, ce_weight), options, (compute_dtype, *flags) = _split(args, 6)
    operands = LinearOperands(input, weight, bias, target, ce_weight)
    request = GradRequest(flags[0], flags[1], flags[2] and bias is not None)
    plan = _plan_for(operands, options, compute_dtype)
    grads = backward(plan, operands, request, (grad_loss,), (), None, owned=False)
    return _gradient_outputs(grads or Gradients(None, None, None), input, weight)


def _linear_backward_fake(*args):
    (_, input, weight, _, bias, _), _, (_, grad_input, grad_weight, grad_bias) = _split(args, 6)
    return _fake_gradients(input, weight, bias, grad_input, grad_weight, grad_bias)


fused_linear_cross_entropy_fwd = _define(
    "fused_linear_cross_entropy_fwd",
    f"{_LINEAR}, {options_schema()}, {_LINEAR_REST}",
    f"{_REDUCED}, Tensor grad_input, Tensor grad_weight, Tensor grad_bias",
    _linear_forward,
    _linear_forward_fake,
)
fused_linear_cross_entropy_bwd = _define(
    "fused_linear_cross_entropy_bwd",
    f"Tensor grad_loss, {_LINEAR}, {options_schema()}, {_LINEAR_REST}",
    "Tensor grad_input, Tensor grad_weight, Tensor grad_bias",
    _linear_backward,
    _linear_backward_fake,
)


def _linear_setup_context(ctx, inputs, output):
    tensors, options, (compute_dtype, *computed) = _split(inputs, 5)
    needs = ctx.needs_input_grad
    ctx.mark_non_differentiable(*output[1:])  # only the loss has a gradient, as in eager
    wanted = (needs[0], needs[1], needs[3])  # input, weight, bias
    input, weight, _, bias, _ = tensors
    fp16_sums = sums_rows_in_fp16(weight, bias, computed[1], computed[2])  # as the forward op's plan
    prescale = forward_gradient_prescale(options.reduction, compute_dtype, input.shape[0], fp16_sums)
    _save_for_backward(ctx, inputs[5:-3], options, tensors, output[4:], tuple(computed), wanted, prescale)


def _linear_backward_autograd(ctx, grad_loss, _z, _acc, _pred, _dx, _dw, _db):
    refuse_create_graph("flce.fused_linear_cross_entropy (compiled)")
    dx, dw, db = _backward_gradients(ctx, grad_loss, fused_linear_cross_entropy_bwd)
    return (dx, dw, None, db, None) + (None,) * ctx.n_arguments


fused_linear_cross_entropy_fwd.register_autograd(_linear_backward_autograd, setup_context=_linear_setup_context)


# ------------------------------------------------------------ CE on given logits
# Arguments: logits (N, V), target (N,), ce_weight (V,) fp32?, the options, grad_logits.
_LOGITS = "Tensor logits, Tensor target, Tensor? ce_weight"


def _logits_forward(*args):
    """-> (loss, z_loss, token_accuracy, predicted_tokens, dL/dlogits with the reduction
    folded in); entries not requested (or deferred to backward) are empty (0,) tensors."""
    (logits, target, ce_weight), options, (grad_logits,) = _split(args, 3)
    operands = LogitsOperands(logits, target, ce_weight)
    result = op_forward(_plan_for(operands, options, logits.dtype), operands, GradRequest(input=grad_logits))
    grads = result.gradients or Gradients(None, None, None)
    return _reduced_outputs(result.outputs, logits) + (_or_empty(grads.input, logits, logits.dtype),)


def _logits_forward_fake(*args):
    (logits, _, _), options, (grad_logits,) = _split(args, 3)
    now = grad_logits and options.reduction != "none"
    return _fake_reduced(options, logits.shape[0], logits) + (logits.new_empty(logits.shape if now else _EMPTY),)


def _logits_backward(*args):
    """Recomputes dL/dlogits with the upstream gradient (first argument) folded into each row."""
    (grad_loss, logits, target, ce_weight), options, () = _split(args, 4)
    operands = LogitsOperands(logits, target, ce_weight)
    plan = _plan_for(operands, options, logits.dtype)
    grads = backward(plan, operands, GradRequest(input=True), (grad_loss,), (), None, owned=False)
    return grads.input.contiguous()  # as the fake describes it (_or_empty)


def _logits_backward_fake(*args):
    return args[1].new_empty(args[1].shape)


cross_entropy_fwd = _define(
    "cross_entropy_fwd",
    f"{_LOGITS}, {options_schema()}, bool grad_logits",
    f"{_REDUCED}, Tensor grad_logits",
    _logits_forward,
    _logits_forward_fake,
)
cross_entropy_bwd = _define(
    "cross_entropy_bwd",
    f"Tensor grad_loss, {_LOGITS}, {options_schema()}",
    "Tensor grad_logits",
    _logits_backward,
    _logits_backward_fake,
)


def _logits_setup_context(ctx, inputs, output):
    tensors, options, (grad_logits,) = _split(inputs, 3)
    ctx.mark_non_differentiable(*output[1:])  # only the loss has a gradient, as in eager
    wanted = ctx.needs_input_grad[:1]  # the logits
    logits = tensors[0]
    prescale = forward_gradient_prescale(options.reduction, logits.dtype, logits.shape[0])
    _save_for_backward(
        ctx, inputs[3:-1], options, tensors, (output[4],), (grad_logits,), wanted, prescale, backward_takes_flags=False
    )


def _logits_backward_autograd(ctx, grad_loss, _z, _acc, _pred, _grad):
    refuse_create_graph("flce.cross_entropy (compiled)")
    if not ctx.wanted[0]:
        return (None,) * (3 + ctx.n_arguments)
    (grad,) = _backward_gradients(ctx, grad_loss, cross_entropy_bwd)
    return (grad, None, None) + (None,) * ctx.n_arguments


cross_entropy_fwd.register_autograd(_logits_backward_autograd, setup_context=_logits_setup_context)


# ------------------------------------------------------------------- logprobs
# Arguments: input (N, H), weight (V, H), bias (V,)?, target (N,), the options, compute_dtype.
_LOGPROBS = "Tensor input, Tensor weight, Tensor? bias, Tensor target"
_LOGPROBS_OPTIONS = options_schema(LogprobsOptions)


def _logprobs_plan(operands: LogprobsOperands, options: LogprobsOptions, compute_dtype: torch.dtype):
    return make_logprobs_plan(options, operands, compute_dtype)  # planned apart: the logits are recomputed


def _logprobs_forward(*args):
    """-> (logprobs, entropy (empty without return_entropy), predicted tokens (empty without
    return_predicted_tokens), lse (N,) float64 for the backward op)."""
    tensors, options, (compute_dtype,) = _split(args, 4, LogprobsOptions)
    operands = LogprobsOperands(*tensors)
    result = op_forward(_logprobs_plan(operands, options, compute_dtype), operands, NO_GRADIENTS)
    logprobs, entropy, predicted = result.outputs.as_tuple()
    lse, _ = result.residuals
    return logprobs, _or_empty(entropy, logprobs, torch.float32), _or_empty(predicted, logprobs, torch.int64), lse


def _logprobs_forward_fake(*args):
    (input, *_), options, _ = _split(args, 4, LogprobsOptions)
    rows = (input.shape[0],)
    return (
        input.new_empty(rows, dtype=torch.float32),
        input.new_empty(rows if options.return_entropy else _EMPTY, dtype=torch.float32),
        input.new_empty(rows if options.return_predicted_tokens else _EMPTY, dtype=torch.int64),
        input.new_empty(rows, dtype=torch.float64),
    )


def _logprobs_backward(*args):
    """Recomputes the chunks with the upstream gradients of the logprobs and the entropy
    folded into each row -> (dX, dW, db), empty where not requested."""
    tensors, options, (compute_dtype, *flags) = _split(args, 8, LogprobsOptions)
    grad_logprobs, grad_entropy, input, weight, bias, target, lse, entropy = tensors
    operands = LogprobsOperands(input, weight, bias, target)
    request = GradRequest(flags[0], flags[1], flags[2] and bias is not None)
    plan = _logprobs_plan(operands, options, compute_dtype)
    residuals = (lse, entropy if options.return_entropy else None)
    grads = backward(plan, operands, request, (grad_logprobs, grad_entropy), residuals, None, owned=False)
    return _gradient_outputs(grads or Gradients(None, None, None), input, weight)


def _logprobs_backward_fake(*args):
    tensors, _, (_, grad_input, grad_weight, grad_bias) = _split(args, 8, LogprobsOptions)
    _, _, input, weight, bias, *_ = tensors
    return _fake_gradients(input, weight, bias, grad_input, grad_weight, grad_bias)


fused_linear_logprobs_fwd = _define(
    "fused_linear_logprobs_fwd",
    f"{_LOGPROBS}, {_LOGPROBS_OPTIONS}, ScalarType compute_dtype",
    "Tensor logprobs, Tensor entropy, Tensor predicted, Tensor lse",
    _logprobs_forward,
    _logprobs_forward_fake,
)
fused_linear_logprobs_bwd = _define(
    "fused_linear_logprobs_bwd",
    f"Tensor? grad_logprobs, Tensor? grad_entropy, {_LOGPROBS}, Tensor lse, Tensor entropy, {_LOGPROBS_OPTIONS}, "
    "ScalarType compute_dtype, bool grad_input, bool grad_weight, bool grad_bias",
    "Tensor grad_input, Tensor grad_weight, Tensor grad_bias",
    _logprobs_backward,
    _logprobs_backward_fake,
)


def _logprobs_setup_context(ctx, inputs, output):
    tensors, options, _ = _split(inputs, 4, LogprobsOptions)
    ctx.arguments = inputs[4:]  # the options and compute_dtype, for the backward op
    ctx.return_entropy = options.return_entropy
    ctx.has_bias = tensors[2] is not None
    _, entropy, predicted, lse = output
    ctx.mark_non_differentiable(predicted)
    ctx.save_for_backward(*tensors, lse, entropy)


def _logprobs_backward_autograd(ctx, grad_logprobs, grad_entropy, _grad_predicted, _grad_lse):
    refuse_create_graph("flce.fused_linear_logprobs (compiled)")
    grad_input, grad_weight, grad_bias = ctx.needs_input_grad[:3]
    grad_bias = grad_bias and ctx.has_bias
    unused = (None,) * (4 + len(ctx.arguments))
    if not (grad_input or grad_weight or grad_bias):
        return unused
    if not ctx.return_entropy:
        grad_entropy = None  # the entropy output is an empty placeholder
    dx, dw, db = fused_linear_logprobs_bwd(
        grad_logprobs, grad_entropy, *ctx.saved_tensors, *ctx.arguments, grad_input, grad_weight, grad_bias
    )
    return (dx if grad_input else None, dw if grad_weight else None, db if grad_bias else None) + unused[3:]


fused_linear_logprobs_fwd.register_autograd(_logprobs_backward_autograd, setup_context=_logprobs_setup_context)


# --------------------------------------------------------------- distillation
# Arguments: the student's input (N, H), weight (V, H), bias (V,)?, the teacher's
# input (N, H_t), weight (V, H_t), bias (V,)?, target (N,)?, the options, both compute
# dtypes, grad_input, grad_weight, grad_bias.
_DISTILLATION = (
    "Tensor input, Tensor weight, Tensor? bias, Tensor teacher_input, Tensor teacher_weight, "
    "Tensor? teacher_bias, Tensor? target"
)
_DISTILLATION_OPTIONS = options_schema(DistillationOptions)
_DISTILLATION_REST = (
    "ScalarType compute_dtype, ScalarType teacher_dtype, bool grad_input, bool grad_weight, bool grad_bias"
)


def _distillation_plan(
    operands: DistillationOperands, options: DistillationOptions, compute_dtype, teacher_dtype, request=None
):
    """As ``_plan_for``: ``request`` of a forward op, None for a backward op."""
    o = operands
    fp16_sums = request is not None and sums_rows_in_fp16(o.weight, o.bias, request.weight, request.bias)
    return make_distillation_plan(
        options, o.input.device, o.target, o.n_rows, o.weight.shape[0], compute_dtype, teacher_dtype, fp16_sums
    )


def _distillation_forward(*args):
    """-> (loss, grad_input, grad_weight, grad_bias); gradients not requested (or deferred
    to backward) are empty (0,) tensors."""
    tensors, options, (compute_dtype, teacher_dtype, *flags) = _split(args, 7, DistillationOptions)
    operands = DistillationOperands(*tensors)
    request = GradRequest(flags[0], flags[1], flags[2] and operands.bias is not None)
    result = op_forward(_distillation_plan(operands, options, compute_dtype, teacher_dtype, request), operands, request)
    grads = result.gradients or Gradients(None, None, None)
    return result.outputs.as_tuple() + _gradient_outputs(grads, operands.input, operands.weight)


def _distillation_forward_fake(*args):
    (input, weight, bias, *_), options, (_, _, grad_input, grad_weight, grad_bias) = _split(
        args, 7, DistillationOptions
    )
    deferred = options.reduction == "none"
    loss = input.new_empty((input.shape[0],) if deferred else (), dtype=torch.float32)
    now = not deferred
    return (loss,) + _fake_gradients(input, weight, bias, grad_input and now, grad_weight and now, grad_bias and now)


def _distillation_backward(*args):
    """Recomputes the chunks with the upstream gradient (first argument) folded into each
    row -> (dX, dW, db), empty where not requested."""
    (grad_loss, *tensors), options, (compute_dtype, teacher_dtype, *flags) = _split(args, 8, DistillationOptions)
    operands = DistillationOperands(*tensors)
    request = GradRequest(flags[0], flags[1], flags[2] and operands.bias is not None)
    plan = _distillation_plan(operands, options, compute_dtype, teacher_dtype)
    grads = backward(plan, operands, request, (grad_loss,), (), None, owned=False)
    return _gradient_outputs(grads or Gradients(None, None, None), operands.input, operands.weight)


def _distillation_backward_fake(*args):
    (_, input, weight, bias, *_), _, (_, _, grad_input, grad_weight, grad_bias) = _split(args, 8, DistillationOptions)
    return _fake_gradients(input, weight, bias, grad_input, grad_weight, grad_bias)


fused_linear_distillation_fwd = _define(
    "fused_linear_distillation_fwd",
    f"{_DISTILLATION}, {_DISTILLATION_OPTIONS}, {_DISTILLATION_REST}",
    "Tensor loss, Tensor grad_input, Tensor grad_weight, Tensor grad_bias",
    _distillation_forward,
    _distillation_forward_fake,
)
fused_linear_distillation_bwd = _define(
    "fused_linear_distillation_bwd",
    f"Tensor grad_loss, {_DISTILLATION}, {_DISTILLATION_OPTIONS}, {_DISTILLATION_REST}",
    "Tensor grad_input, Tensor grad_weight, Tensor grad_bias",
    _distillation_backward,
    _distillation_backward_fake,
)


def _distillation_setup_context(ctx, inputs, output):
    tensors, options, (compute_dtype, _, *computed) = _split(inputs, 7, DistillationOptions)
    wanted = ctx.needs_input_grad[:3]  # the student's input, weight, bias
    input, weight, bias = tensors[:3]
    fp16_sums = sums_rows_in_fp16(weight, bias, computed[1], computed[2])  # as the forward op's plan
    prescale = forward_gradient_prescale(options.reduction, compute_dtype, input.shape[0], fp16_sums)
    _save_for_backward(ctx, inputs[7:-3], options, tensors, output[1:], tuple(computed), wanted, prescale)


def _distillation_backward_autograd(ctx, grad_loss, _dx, _dw, _db):
    refuse_create_graph("flce.fused_linear_distillation (compiled)")
    return _backward_gradients(ctx, grad_loss, fused_linear_distillation_bwd) + (None,) * (4 + ctx.n_arguments)


fused_linear_distillation_fwd.register_autograd(
    _distillation_backward_autograd, setup_context=_distillation_setup_context
)


# ----------------------------------------------------------------- entry points


def _wants_grad(t: Tensor | None) -> bool:
    return torch.is_grad_enabled() and t is not None and t.requires_grad


def _refuse_transforms(operands) -> None:
    """The eager entry points' refusal of ``torch.func`` transforms and forward-mode AD,
    traced by the compiler into each compiled call: PyTorch gives a custom op no tangent
    and raises nothing (a compiled ``jvp`` returned a tangent of 0, a dual tensor's
    tangent was None) or fails in its internals (``grad``, ``vjp``)."""
    refuse_function_transforms(operands.entry, operands.tensors())


def compiled_loss(operands: Operands, options: LossOptions, compute_dtype: torch.dtype) -> tuple:
    """The reduced outputs of a call under ``torch.compile``, through the ops above."""
    _refuse_transforms(operands)
    values = option_values(options)
    if isinstance(operands, LogitsOperands):
        o = operands
        outputs = cross_entropy_fwd(o.logits, o.target, o.ce_weight, *values, _wants_grad(o.logits))
    else:
        o = operands
        outputs = fused_linear_cross_entropy_fwd(
            o.input, o.weight, o.target, o.bias, o.ce_weight, *values, compute_dtype,
            _wants_grad(o.input), _wants_grad(o.weight), _wants_grad(o.bias),
        )  # fmt: skip
    return outputs[:4]


def compiled_logprobs(operands: LogprobsOperands, options: LogprobsOptions, compute_dtype: torch.dtype) -> tuple:
    """``(logprobs, entropy, predicted)`` of a call under ``torch.compile`` (entropy and
    predicted empty placeholders without ``return_entropy``/``return_predicted_tokens``)."""
    _refuse_transforms(operands)
    o = operands
    logprobs, entropy, predicted, _ = fused_linear_logprobs_fwd(
        o.input, o.weight, o.bias, o.target, *option_values(options), compute_dtype
    )
    return logprobs, entropy, predicted


def compiled_distillation(
    operands: DistillationOperands, options: DistillationOptions, compute_dtype: torch.dtype, teacher_dtype
) -> tuple:
    """``(loss,)`` of a call under ``torch.compile``."""
    _refuse_transforms(operands)
    o = operands
    outputs = fused_linear_distillation_fwd(
        o.input, o.weight, o.bias, o.teacher_input, o.teacher_weight, o.teacher_bias, o.target,
        *option_values(options), compute_dtype, teacher_dtype,
        _wants_grad(o.input), _wants_grad(o.weight), _wants_grad(o.bias),
    )  # fmt: skip
    return outputs[:1]
