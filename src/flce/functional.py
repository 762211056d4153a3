"""Public functions and their autograd: ``fused_linear_cross_entropy`` and ``cross_entropy``.

Both validate at the boundary (``flce.options``), pick a backend (``flce.dispatch``),
read the batch statistics with one host sync (``flce.driver.batch_statistics``) and run
the shared chunked driver. With nothing requiring grad (or under ``torch.no_grad`` /
inference mode) they run the loss-only path and no gradient work at all; with the
``cutedsl`` backend on Hopper that path computes the per-row outputs from the fused
forward statistics kernel where it supports the call (``_Plan.run_chunks``), with no
logits buffer.

Backward for ``mean``/``sum``: the gradients are computed during the forward (the
logits exist only there) and scaled by the upstream gradient in backward. The first
backward takes ownership of them and scales them in place (``scale_gradients_``: on CUDA
the pass is skipped on the device when the upstream gradient is exactly 1, with no host
sync); a repeated backward
(``retain_graph=True``) recomputes them, so scaling never compounds. For
``reduction="none"`` the fused loss recomputes the chunks in backward with the
per-token upstream gradient folded into each row before the dW/db sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from flce.backends.base import BackendSpec, ChunkScalars
from flce.backends.cutedsl import fused_forward_applicable
from flce.dispatch import resolve_backend
from flce.driver import (
    BatchStatistics,
    Gradients,
    RowOutputs,
    batch_statistics,
    chunk_scalars,
    default_chunk_size,
    reduce_rows,
    rows_from_forward_statistics,
    run_chunks,
    run_vocab_blocks,
    scale_gradients_,
)
from flce.options import LossOptions, first_order_backward, validate_fused_inputs, validate_logits_inputs
from flce.output import CrossEntropyOutput

LossResult = torch.Tensor | CrossEntropyOutput


@dataclass(frozen=True)
class _Plan:
    """Everything one call decided before its first kernel, and how to run its chunks.

    Other execution schemes (``flce.parallel``'s plan) provide the same interface,
    ``run_chunks`` and ``finish_gradients``, and share the autograd below.
    """

    options: LossOptions
    backend: BackendSpec | None  # None when split_kernels run the chunks instead
    compute_dtype: torch.dtype
    stats: BatchStatistics
    scalars: ChunkScalars
    split_kernels: object = None  # flce.split_rows kernels, with options.vocab_chunk_size

    def run_chunks(self, input, weight, target, bias, ce_weight, **flags):
        """The driver with this plan's decisions -> (RowOutputs, Gradients): token chunks
        (``flce.driver.run_chunks``), or token x vocabulary blocks with ``vocab_chunk_size``.
        A call that asks for no gradient (the loss-only path, the forward of
        ``reduction="none"``, the compiled forward op) takes its rows from the fused forward
        statistics instead (one GEMM whose epilogue reduces each logits tile; no logits
        buffer) where ``fused_forward_applicable`` allows it."""
        if not any(flags.values()) and self.uses_fused_forward(input, weight, ce_weight):
            return _fused_forward_rows(self, input, weight, target, bias, ce_weight), Gradients(None, None, None)
        if self.split_kernels is not None:
            return run_vocab_blocks(
                input,
                weight,
                target,
                bias,
                ce_weight,
                self.options,
                self.split_kernels,
                self.compute_dtype,
                self.scalars,
                **flags,
            )
        return run_chunks(
            input,
            weight,
            target,
            bias,
            ce_weight,
            self.options,
            self.backend,
            self.compute_dtype,
            self.scalars,
            **flags,
        )

    def finish_gradients(self, grads) -> None:
        """Hook run on the final gradients of a backward (the single-device loss has none)."""

    def uses_fused_forward(self, input, weight, ce_weight) -> bool:
        """``fused_forward_applicable`` for this plan and these operands."""
        # A dtype cast keeps the strides (preserve_format) but allocates afresh (aligned).
        weight_tma_ready = weight.is_contiguous() and (
            weight.dtype != self.compute_dtype or weight.data_ptr() % 16 == 0
        )
        applicable, _ = fused_forward_applicable(
            self.options,
            None if self.backend is None else self.backend.name,
            _cuda_capability(input.device),
            self.compute_dtype,
            input.shape[1],
            weight.shape[0],
            ce_weight is not None,
            weight_tma_ready,
        )
        return applicable


@cache
def _capability_of(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _cuda_capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda":
        return None
    return _capability_of(device.index if device.index is not None else torch.cuda.current_device())


def _fused_forward_rows(plan: _Plan, input, weight, target, bias, ce_weight) -> RowOutputs:
    """``flce.driver.rows_from_forward_statistics`` of ``fused_forward_statistics``, with the
    operands in the compute dtype as the driver's GEMM takes them (the bias rounded to it,
    as the driver's ``addmm`` rounds it)."""
    from flce.backends.cutedsl.fused_forward import fused_forward_statistics

    dtype = plan.compute_dtype
    x = input.to(dtype)
    if not x.is_contiguous() or x.data_ptr() % 16:
        # TMA needs a row-major, 16-byte aligned X; a copy of it is small next to the logits.
        x = x.clone(memory_format=torch.contiguous_format)
    y = target if target.dtype in (torch.int64, torch.int32) else target.long()
    statistics = fused_forward_statistics(
        x,
        weight.to(dtype),
        y,
        bias=None if bias is None else bias.to(dtype),
        softcap=plan.options.softcap,
        with_logit_sum=plan.options.label_smoothing > 0,
    )
    return rows_from_forward_statistics(statistics, target, ce_weight, plan.options, plan.scalars, weight.shape[0])


def _no_autocast(device: torch.device):
    # The driver picks its dtypes itself; autocast must not re-cast the kernel's fp32 math.
    return torch.autocast(device_type=device.type, enabled=False)


def make_plan(
    options: LossOptions, device: torch.device, target: torch.Tensor, ce_weight, vocab: int, compute_dtype: torch.dtype
) -> _Plan:
    """Backend (or split-row kernels for ``vocab_chunk_size``), the one host sync of batch
    statistics, and the kernel scalars: everything decided before the first kernel."""
    split_kernels = None
    if options.vocab_chunk_size is not None:
        from flce.split_rows import split_row_kernels

        split_kernels = split_row_kernels(options.backend, device, "vocab_chunk_size")
        backend = None
    else:
        backend = resolve_backend(options.backend, device)
    stats = batch_statistics(target, ce_weight, vocab, options.ignore_index)
    return _Plan(options, backend, compute_dtype, stats, chunk_scalars(options, stats), split_kernels)


def _mark_outputs(ctx, reduced) -> tuple:
    extras = [t for t in (reduced.z_loss, reduced.token_accuracy, reduced.predicted_tokens) if t is not None]
    if extras:
        ctx.mark_non_differentiable(*extras)
    return reduced.loss, reduced.z_loss, reduced.token_accuracy, reduced.predicted_tokens


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd of the fused loss; inputs already validated and flattened."""

    @staticmethod
    def forward(ctx, input, weight, bias, target, ce_weight, plan: _Plan):
        # input (N, H), weight (V, H), bias (V,) or None, target (N,), ce_weight (V,) fp32 or None
        grad_input, grad_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_bias = bias is not None and ctx.needs_input_grad[2]
        ctx.plan = plan
        ctx.grad_flags = (grad_input, grad_weight, grad_bias)
        ctx.save_for_backward(input, weight, bias, target, ce_weight)
        defer = plan.options.reduction == "none"
        with _no_autocast(input.device):
            rows, grads = plan.run_chunks(
                input,
                weight,
                target,
                bias,
                ce_weight,
                grad_input=grad_input and not defer,
                grad_weight=grad_weight and not defer,
                grad_bias=grad_bias and not defer,
            )
        ctx.grads = None if defer else grads
        return _mark_outputs(ctx, reduce_rows(rows, plan.options, plan.scalars, plan.stats))

    @staticmethod
    @first_order_backward("flce.fused_linear_cross_entropy")
    def backward(ctx, grad_loss, _grad_z_loss, _grad_accuracy, _grad_predicted):
        if grad_loss is None:
            return None, None, None, None, None, None
        grads, ctx.grads = ctx.grads, None
        if grads is not None:
            # First backward of a mean/sum loss: we own these tensors now; scale in place.
            scale_gradients_((grads.input, grads.weight, grads.bias), grad_loss)
        else:
            # reduction="none", or a repeated backward: recompute with the upstream
            # gradient folded into each row before the dW/db sums.
            input, weight, bias, target, ce_weight = ctx.saved_tensors
            row_scale = grad_loss.float().expand(input.shape[0]).contiguous()
            grad_input, grad_weight, grad_bias = ctx.grad_flags
            with _no_autocast(input.device):
                _, grads = ctx.plan.run_chunks(
                    input,
                    weight,
                    target,
                    bias,
                    ce_weight,
                    grad_input=grad_input,
                    grad_weight=grad_weight,
                    grad_bias=grad_bias,
                    row_grad_scale=row_scale,
                )
        ctx.plan.finish_gradients(grads)
        return grads.input, grads.weight, grads.bias, None, None, None


def _package(options: LossOptions, target_shape, loss, z_loss, accuracy, predicted) -> LossResult:
    """The public result. Outputs not asked for are dropped first (the custom ops return
    empty placeholders for them); per-token outputs take ``target``'s shape."""
    z_loss = z_loss if options.return_z_loss else None
    accuracy = accuracy if options.return_token_accuracy else None
    predicted = predicted if options.return_predicted_tokens else None
    if options.reduction == "none" and len(target_shape) > 1:
        loss = loss.view(target_shape)
        z_loss = None if z_loss is None else z_loss.view(target_shape)
        accuracy = None if accuracy is None else accuracy.view(target_shape)
    if predicted is not None and len(target_shape) > 1:
        predicted = predicted.view(target_shape)
    if not options.returns_structured:
        return loss
    return CrossEntropyOutput(loss=loss, z_loss=z_loss, token_accuracy=accuracy, predicted_tokens=predicted)


def _prepare_ce_weight(ce_weight: torch.Tensor | None) -> torch.Tensor | None:
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
    compute_dtype = validate_fused_inputs(input, weight, target, bias, ce_weight, options)
    hidden, vocab = input.shape[-1], weight.shape[0]
    input_2d = input.reshape(input.shape[:-1].numel(), hidden)  # explicit N: H may be 0
    target_1d = target.reshape(-1)
    ce_weight = _prepare_ce_weight(ce_weight)
    if torch.compiler.is_compiling():
        return _compiled_fused(input_2d, weight, target, target_1d, bias, ce_weight, options, compute_dtype)
    plan = make_plan(options, input.device, target_1d, ce_weight, vocab, compute_dtype)

    tensors = (input, weight) if bias is None else (input, weight, bias)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        outputs = FusedLinearCrossEntropyFunction.apply(input_2d, weight, bias, target_1d, ce_weight, plan)
    else:
        with _no_autocast(input.device):
            rows, _ = plan.run_chunks(
                input_2d, weight, target_1d, bias, ce_weight, grad_input=False, grad_weight=False, grad_bias=False
            )
        reduced = reduce_rows(rows, options, plan.scalars, plan.stats)
        outputs = (reduced.loss, reduced.z_loss, reduced.token_accuracy, reduced.predicted_tokens)
    return _package(options, tuple(target.shape), *outputs)


def _compiled_fused(input_2d, weight, target, target_1d, bias, ce_weight, options, compute_dtype) -> LossResult:
    """Under torch.compile: the same computation through the opaque custom op (``flce.ops``)."""
    from flce import ops  # registers the ops on first use

    grad_enabled = torch.is_grad_enabled()
    outputs = ops.fused_linear_cross_entropy_fwd(
        input_2d,
        weight,
        target_1d,
        bias,
        ce_weight,
        options.ignore_index,
        float(options.lse_square_scale),
        float(options.label_smoothing),
        options.reduction,
        options.softcap,
        options.use_token_scaling,
        options.accum_dtype,
        options.return_z_loss,
        options.return_token_accuracy,
        options.return_predicted_tokens,
        options.backend,
        options.chunk_size,
        options.vocab_chunk_size,
        compute_dtype,
        grad_enabled and input_2d.requires_grad,
        grad_enabled and weight.requires_grad,
        grad_enabled and bias is not None and bias.requires_grad,
    )
    return _package(options, tuple(target.shape), *outputs[:4])


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
            (``flce.driver.default_chunk_size``).
        vocab_chunk_size: also split the vocabulary into blocks of this many classes
            (``flce.driver.run_vocab_blocks``): dW and dX are accumulated exactly in fp32
            with only a block of fp32 dW alive, at the price of computing the logits twice
            (8NVH instead of 6NVH FLOPs). ``None`` (default): whole rows per chunk.

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
    )
    return fused_linear_cross_entropy_with_options(input, weight, target, bias, ce_weight, options)


def _cross_entropy_rows(
    logits: torch.Tensor, target: torch.Tensor, ce_weight, plan: _Plan, grad_buffer: torch.Tensor | None
) -> RowOutputs:
    """Runs the kernel over row chunks of given logits (the torch backend's workspace
    stays bounded); the gradient, if asked for, goes to ``grad_buffer`` (the kernels read
    the logits and write it there, so the caller's logits are never modified and never
    copied)."""
    n_rows, vocab = logits.shape
    rows = RowOutputs.allocate(n_rows, plan.options, logits.device)
    source = logits if logits.stride(-1) == 1 else logits.contiguous()
    chunk = plan.options.chunk_size or default_chunk_size(
        n_rows, vocab, logits.dtype, plan.backend.extra_bytes_per_logit
    )
    for start in range(0, n_rows, chunk):
        end = min(start + chunk, n_rows)
        plan.backend.cross_entropy_chunk(
            source[start:end],
            target[start:end],
            ce_weight,
            plan.scalars,
            **rows.chunk_kwargs(start, end),
            row_grad_scale=None,
            compute_grad=grad_buffer is not None,
            grad_out=None if grad_buffer is None else grad_buffer[start:end],
        )
    return rows


class CrossEntropyFunction(torch.autograd.Function):
    """Autograd of the loss on given logits: the gradient (per row, reduction scale
    folded in) is computed in the forward into a copy of the logits."""

    @staticmethod
    def forward(ctx, logits, target, ce_weight, plan: _Plan):
        # logits (N, V), target (N,), ce_weight (V,) fp32 or None
        grad_buffer = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # (N, V) dL/dlogits
        with _no_autocast(logits.device):
            rows = _cross_entropy_rows(logits, target, ce_weight, plan, grad_buffer)
        ctx.plan = plan
        ctx.grad_buffer = grad_buffer
        ctx.save_for_backward(logits, target, ce_weight)
        return _mark_outputs(ctx, reduce_rows(rows, plan.options, plan.scalars, plan.stats))

    @staticmethod
    @first_order_backward("flce.cross_entropy")
    def backward(ctx, grad_loss, _grad_z_loss, _grad_accuracy, _grad_predicted):
        if grad_loss is None:
            return None, None, None, None
        grad, ctx.grad_buffer = ctx.grad_buffer, None
        if grad is None:  # repeated backward: recompute
            logits, target, ce_weight = ctx.saved_tensors
            grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
            with _no_autocast(logits.device):
                _cross_entropy_rows(logits.detach(), target, ce_weight, ctx.plan, grad)
        if grad_loss.dim() == 0:
            scale_gradients_([grad], grad_loss)  # skipped on the device when it is 1
        else:  # reduction="none": one upstream gradient per row, multiplied in fp32, rounded once
            grad.mul_(grad_loss.float()[:, None])
        return grad, None, None, None


def cross_entropy_with_options(
    logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, options: LossOptions
) -> LossResult:
    validate_logits_inputs(logits, target, weight, options)
    vocab = logits.shape[-1]
    logits_2d = logits.reshape(-1, vocab)
    target_1d = target.reshape(-1)
    weight = _prepare_ce_weight(weight)
    if torch.compiler.is_compiling():
        from flce import ops  # registers the ops on first use

        outputs = ops.cross_entropy_fwd(
            logits_2d,
            target_1d,
            weight,
            options.ignore_index,
            float(options.lse_square_scale),
            float(options.label_smoothing),
            options.reduction,
            options.softcap,
            options.use_token_scaling,
            options.return_z_loss,
            options.return_token_accuracy,
            options.return_predicted_tokens,
            options.backend,
            torch.is_grad_enabled() and logits.requires_grad,
        )
        return _package(options, tuple(target.shape), *outputs[:4])
    backend = resolve_backend(options.backend, logits.device)
    stats = batch_statistics(target_1d, weight, vocab, options.ignore_index)
    plan = _Plan(options, backend, logits.dtype, stats, chunk_scalars(options, stats))
    if torch.is_grad_enabled() and logits.requires_grad:
        outputs = CrossEntropyFunction.apply(logits_2d, target_1d, weight, plan)
    else:
        with _no_autocast(logits.device):
            rows = _cross_entropy_rows(logits_2d, target_1d, weight, plan, None)
        reduced = reduce_rows(rows, options, plan.scalars, stats)
        outputs = (reduced.loss, reduced.z_loss, reduced.token_accuracy, reduced.predicted_tokens)
    return _package(options, tuple(target.shape), *outputs)


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
