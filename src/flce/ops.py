"""torch.library custom ops, so ``torch.compile(..., fullgraph=True)`` traces through flce.

Under compilation the public functions call these ops instead of the eager autograd
functions: each op is opaque to the compiler (its one host sync, the chunk loop and
the kernels stay inside), has a fake implementation giving output shapes, and
registered autograd. The forward op returns the gradients it computed as extra
outputs (empty when not requested); backward scales them out of place, so a repeated
backward never compounds. ``reduction="none"`` recomputes in a backward op with the
per-token upstream gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flce.driver import reduce_rows
from flce.functional import make_plan
from flce.options import LossOptions, refuse_create_graph

_EMPTY_SHAPE = (0,)


def _options(
    ignore_index,
    lse_square_scale,
    label_smoothing,
    reduction,
    softcap,
    use_token_scaling,
    accum_dtype,
    return_z_loss,
    return_token_accuracy,
    return_predicted_tokens,
    backend,
    chunk_size,
    vocab_chunk_size,
) -> LossOptions:
    return LossOptions(
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
    )


def _empty_like_device(t: Tensor, dtype=torch.float32) -> Tensor:
    return torch.empty(_EMPTY_SHAPE, dtype=dtype, device=t.device)


@torch.library.custom_op("flce::fused_linear_cross_entropy_fwd", mutates_args=())
def fused_linear_cross_entropy_fwd(
    input: Tensor,  # (N, H)
    weight: Tensor,  # (V, H)
    target: Tensor,  # (N,)
    bias: Tensor | None,  # (V,)
    ce_weight: Tensor | None,  # (V,) fp32
    ignore_index: int,
    lse_square_scale: float,
    label_smoothing: float,
    reduction: str,
    softcap: float | None,
    use_token_scaling: bool,
    accum_dtype: torch.dtype | None,
    return_z_loss: bool,
    return_token_accuracy: bool,
    return_predicted_tokens: bool,
    backend: str | None,
    chunk_size: int | None,
    vocab_chunk_size: int | None,
    compute_dtype: torch.dtype,
    grad_input: bool,
    grad_weight: bool,
    grad_bias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (loss, z_loss, token_accuracy, predicted_tokens, grad_input, grad_weight, grad_bias);
    entries not requested are empty (0,) tensors."""
    options = _options(
        ignore_index,
        lse_square_scale,
        label_smoothing,
        reduction,
        softcap,
        use_token_scaling,
        accum_dtype,
        return_z_loss,
        return_token_accuracy,
        return_predicted_tokens,
        backend,
        chunk_size,
        vocab_chunk_size,
    )
    plan = make_plan(options, input.device, target, ce_weight, weight.shape[0], compute_dtype)
    defer = reduction == "none"
    with torch.autocast(device_type=input.device.type, enabled=False):
        rows, grads = plan.run_chunks(
            input,
            weight,
            target,
            bias,
            ce_weight,
            grad_input=grad_input and not defer,
            grad_weight=grad_weight and not defer,
            grad_bias=grad_bias and bias is not None and not defer,
        )
    scalars, stats = plan.scalars, plan.stats
    reduced = reduce_rows(rows, options, scalars, stats)
    empty = _empty_like_device(input)

    def or_empty(t: Tensor | None, dtype=torch.float32) -> Tensor:
        return _empty_like_device(input, dtype) if t is None else t

    return (
        reduced.loss,
        or_empty(reduced.z_loss),
        or_empty(reduced.token_accuracy),
        or_empty(reduced.predicted_tokens, torch.int64),
        or_empty(grads.input, input.dtype),
        or_empty(grads.weight, weight.dtype),
        empty if grads.bias is None else grads.bias,
    )


@fused_linear_cross_entropy_fwd.register_fake
def _(
    input,
    weight,
    target,
    bias,
    ce_weight,
    ignore_index,
    lse_square_scale,
    label_smoothing,
    reduction,
    softcap,
    use_token_scaling,
    accum_dtype,
    return_z_loss,
    return_token_accuracy,
    return_predicted_tokens,
    backend,
    chunk_size,
    vocab_chunk_size,
    compute_dtype,
    grad_input,
    grad_weight,
    grad_bias,
):
    n_rows = input.shape[0]
    per_row = reduction == "none"

    def f32(shape):
        return input.new_empty(shape, dtype=torch.float32)

    scalar_or_rows = (n_rows,) if per_row else ()
    defer = per_row
    return (
        f32(scalar_or_rows),
        f32(scalar_or_rows if return_z_loss else _EMPTY_SHAPE),
        f32(scalar_or_rows if return_token_accuracy else _EMPTY_SHAPE),
        input.new_empty((n_rows,) if return_predicted_tokens else _EMPTY_SHAPE, dtype=torch.int64),
        input.new_empty(input.shape if grad_input and not defer else _EMPTY_SHAPE),
        weight.new_empty(weight.shape if grad_weight and not defer else _EMPTY_SHAPE),
        (bias.new_empty(bias.shape) if bias is not None and grad_bias and not defer else f32(_EMPTY_SHAPE)),
    )


@torch.library.custom_op("flce::fused_linear_cross_entropy_bwd", mutates_args=())
def fused_linear_cross_entropy_bwd(
    row_grad_scale: Tensor,  # (N,) fp32 upstream gradient per row
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    ce_weight: Tensor | None,
    ignore_index: int,
    lse_square_scale: float,
    label_smoothing: float,
    reduction: str,
    softcap: float | None,
    use_token_scaling: bool,
    accum_dtype: torch.dtype | None,
    backend: str | None,
    chunk_size: int | None,
    vocab_chunk_size: int | None,
    compute_dtype: torch.dtype,
    grad_input: bool,
    grad_weight: bool,
    grad_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Recomputes the chunks with ``row_grad_scale`` folded in -> (dX, dW, db), empty if not requested."""
    options = _options(
        ignore_index,
        lse_square_scale,
        label_smoothing,
        reduction,
        softcap,
        use_token_scaling,
        accum_dtype,
        False,
        False,
        False,
        backend,
        chunk_size,
        vocab_chunk_size,
    )
    plan = make_plan(options, input.device, target, ce_weight, weight.shape[0], compute_dtype)
    with torch.autocast(device_type=input.device.type, enabled=False):
        _, grads = plan.run_chunks(
            input,
            weight,
            target,
            bias,
            ce_weight,
            grad_input=grad_input,
            grad_weight=grad_weight,
            grad_bias=grad_bias and bias is not None,
            row_grad_scale=row_grad_scale,
        )
    return (
        _empty_like_device(input, input.dtype) if grads.input is None else grads.input,
        _empty_like_device(input, weight.dtype) if grads.weight is None else grads.weight,
        _empty_like_device(input) if grads.bias is None else grads.bias,
    )


@fused_linear_cross_entropy_bwd.register_fake
def _(
    row_grad_scale,
    input,
    weight,
    target,
    bias,
    ce_weight,
    ignore_index,
    lse_square_scale,
    label_smoothing,
    reduction,
    softcap,
    use_token_scaling,
    accum_dtype,
    backend,
    chunk_size,
    vocab_chunk_size,
    compute_dtype,
    grad_input,
    grad_weight,
    grad_bias,
):
    return (
        input.new_empty(input.shape if grad_input else _EMPTY_SHAPE),
        weight.new_empty(weight.shape if grad_weight else _EMPTY_SHAPE),
        bias.new_empty(bias.shape)
        if bias is not None and grad_bias
        else input.new_empty(_EMPTY_SHAPE, dtype=torch.float32),
    )


_FWD_ARG_NAMES = (
    "ignore_index",
    "lse_square_scale",
    "label_smoothing",
    "reduction",
    "softcap",
    "use_token_scaling",
    "accum_dtype",
    "return_z_loss",
    "return_token_accuracy",
    "return_predicted_tokens",
    "backend",
    "chunk_size",
    "vocab_chunk_size",
    "compute_dtype",
    "grad_input",
    "grad_weight",
    "grad_bias",
)


def _setup_context(ctx, inputs, output):
    input, weight, target, bias, ce_weight = inputs[:5]
    args = dict(zip(_FWD_ARG_NAMES, inputs[5:], strict=False))
    ctx.args = args
    ctx.has_bias = bias is not None
    if args["reduction"] == "none":
        ctx.save_for_backward(input, weight, target, bias, ce_weight)
    else:
        ctx.save_for_backward(*output[4:])


def _backward(ctx, grad_loss, _z, _acc, _pred, _dx, _dw, _db):
    refuse_create_graph("flce.fused_linear_cross_entropy (compiled)")
    args = ctx.args
    if args["reduction"] == "none":
        input, weight, target, bias, ce_weight = ctx.saved_tensors
        dx, dw, db = fused_linear_cross_entropy_bwd(
            grad_loss.float().contiguous(),
            input,
            weight,
            target,
            bias,
            ce_weight,
            args["ignore_index"],
            args["lse_square_scale"],
            args["label_smoothing"],
            "none",
            args["softcap"],
            args["use_token_scaling"],
            args["accum_dtype"],
            args["backend"],
            args["chunk_size"],
            args["vocab_chunk_size"],
            args["compute_dtype"],
            args["grad_input"],
            args["grad_weight"],
            args["grad_bias"],
        )
    else:
        dx, dw, db = (g * grad_loss.to(g.dtype) for g in ctx.saved_tensors)
    return (
        dx if args["grad_input"] else None,
        dw if args["grad_weight"] else None,
        None,
        db if args["grad_bias"] and ctx.has_bias else None,
    ) + (None,) * (1 + len(_FWD_ARG_NAMES))


fused_linear_cross_entropy_fwd.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("flce::cross_entropy_fwd", mutates_args=())
def cross_entropy_fwd(
    logits: Tensor,  # (N, V)
    target: Tensor,  # (N,)
    ce_weight: Tensor | None,  # (V,) fp32
    ignore_index: int,
    lse_square_scale: float,
    label_smoothing: float,
    reduction: str,
    softcap: float | None,
    use_token_scaling: bool,
    return_z_loss: bool,
    return_token_accuracy: bool,
    return_predicted_tokens: bool,
    backend: str | None,
    compute_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (loss, z_loss, token_accuracy, predicted_tokens, dL/dlogits per row with the
    reduction folded in); entries not requested are empty (0,) tensors."""
    from flce.functional import _cross_entropy_rows

    options = _options(
        ignore_index,
        lse_square_scale,
        label_smoothing,
        reduction,
        softcap,
        use_token_scaling,
        None,
        return_z_loss,
        return_token_accuracy,
        return_predicted_tokens,
        backend,
        None,
        None,
    )
    plan = make_plan(options, logits.device, target, ce_weight, logits.shape[1], logits.dtype)
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device) if compute_grad else None
    with torch.autocast(device_type=logits.device.type, enabled=False):
        rows = _cross_entropy_rows(logits, target, ce_weight, plan, grad)
    reduced = reduce_rows(rows, options, plan.scalars, plan.stats)

    def or_empty(t: Tensor | None, dtype=torch.float32) -> Tensor:
        return _empty_like_device(logits, dtype) if t is None else t

    return (
        reduced.loss,
        or_empty(reduced.z_loss),
        or_empty(reduced.token_accuracy),
        or_empty(reduced.predicted_tokens, torch.int64),
        or_empty(grad, logits.dtype),
    )


@cross_entropy_fwd.register_fake
def _(
    logits,
    target,
    ce_weight,
    ignore_index,
    lse_square_scale,
    label_smoothing,
    reduction,
    softcap,
    use_token_scaling,
    return_z_loss,
    return_token_accuracy,
    return_predicted_tokens,
    backend,
    compute_grad,
):
    n_rows = logits.shape[0]
    scalar_or_rows = (n_rows,) if reduction == "none" else ()

    def f32(shape):
        return logits.new_empty(shape, dtype=torch.float32)

    return (
        f32(scalar_or_rows),
        f32(scalar_or_rows if return_z_loss else _EMPTY_SHAPE),
        f32(scalar_or_rows if return_token_accuracy else _EMPTY_SHAPE),
        logits.new_empty((n_rows,) if return_predicted_tokens else _EMPTY_SHAPE, dtype=torch.int64),
        logits.new_empty(logits.shape if compute_grad else _EMPTY_SHAPE),
    )


def _ce_setup_context(ctx, inputs, output):
    ctx.compute_grad = inputs[-1]
    ctx.save_for_backward(output[4])


def _ce_backward(ctx, grad_loss, _z, _acc, _pred, _grad):
    refuse_create_graph("flce.cross_entropy (compiled)")
    (grad,) = ctx.saved_tensors
    if not ctx.compute_grad:
        return (None,) * 14
    scale = grad_loss.float()[:, None] if grad_loss.dim() == 1 else grad_loss.float()
    # The product in fp32, rounded once to the gradient's dtype (no fp32 temporary).
    return (torch.mul(grad, scale, out=torch.empty_like(grad)),) + (None,) * 13


cross_entropy_fwd.register_autograd(_ce_backward, setup_context=_ce_setup_context)
