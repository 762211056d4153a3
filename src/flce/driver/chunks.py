"""The token-chunk scheme: one control flow for every backend's chunk kernels and every
loss head.

For a block of ``C`` token rows at a time, ``run_token_chunks`` runs the logits GEMM into
a reused ``(C, V)`` buffer (and, for a head with a constant second LM head such as a
distillation teacher, that head's GEMM into a second one), calls the loss head's chunk
kernel (per-row outputs, and the gradient written in place over the logits), then the dX
GEMM and the dW/db accumulation. The full ``(N, V)`` logits never exist. ``run_chunks``
is the cross-entropy on it (the backend's chunk CE kernel); ``flce.heads`` run the
logprobs and distillation heads on it. ``C`` comes from
``flce.driver.sizing``; dW and db are accumulated in fp32 unless ``accum_dtype`` equals
a low-precision weight dtype (then in that dtype: less memory, rounding per chunk, the
user's choice), or written by one GEMM when one chunk holds every row
(``flce.driver.gemm.weight_grad_in_one_gemm``).

``run_logits_chunks`` is the same kernel over logits the caller already has
(``flce.cross_entropy``): row chunks bound the torch backend's fp32 workspace, and the
gradient goes to a separate buffer so the caller's logits are never modified.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from flce.backends.base import BackendSpec
from flce.driver.gemm import (
    accumulate_column_sums,
    accumulate_product,
    fp32_output_gemm_supported,
    full_precision_reductions,
    logits_product,
    weight_accumulator_dtype,
    weight_grad_in_one_gemm,
)
from flce.driver.sizing import default_chunk_size, logits_row_stride, whole_row_chunk_size
from flce.options import LossOptions
from flce.rows.cross_entropy import ChunkScalars, RowOutputs


@dataclass(frozen=True)
class GradRequest:
    """Which gradients a pass computes."""

    input: bool = False
    weight: bool = False
    bias: bool = False

    @property
    def any(self) -> bool:
        return self.input or self.weight or self.bias


NO_GRADIENTS = GradRequest()


@dataclass
class Gradients:
    input: torch.Tensor | None  # (N, H) input dtype; (N, V) logits dtype for the loss on given logits
    weight: torch.Tensor | None  # (V, H) weight dtype
    bias: torch.Tensor | None  # (V,) bias dtype

    def present(self) -> list[torch.Tensor]:
        return [g for g in (self.input, self.weight, self.bias) if g is not None]


def allocate_rows(n_rows: int, options: LossOptions, device: torch.device) -> RowOutputs:
    """The per-row outputs ``options`` asks for."""
    return RowOutputs.allocate(
        n_rows,
        device,
        z_loss=options.needs_z_loss_rows,
        correct=options.return_token_accuracy,
        predicted=options.return_predicted_tokens,
    )


def row_range(tensor: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    """``tensor[start:end]``, or ``tensor`` itself when that is all of its rows: a call of one
    chunk (the common case at small N) then makes no view per tensor and chunk (each is a
    dispatched op: host time on every call)."""
    if tensor is None or (start == 0 and end == tensor.shape[0]):
        return tensor
    return tensor[start:end]


def in_compute_dtype(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return tensor if tensor is None or tensor.dtype == dtype else tensor.to(dtype)


@dataclass(frozen=True)
class LinearHead:
    """An LM head whose logits the token-chunk loop forms chunk by chunk:
    ``logits = input @ weight.T + bias``, a GEMM of ``compute_dtype`` operands whose
    logits are ``logits_dtype`` (that dtype by default; fp32 from 16-bit operands:
    ``flce.driver.gemm.logits_product``)."""

    input: torch.Tensor  # (N, H) any float dtype (cast to compute_dtype per chunk)
    weight: torch.Tensor  # (V, H)
    bias: torch.Tensor | None  # (V,)
    compute_dtype: torch.dtype
    logits_dtype: torch.dtype | None = None  # None: compute_dtype


class TokenChunkKernel(Protocol):
    """What ``run_token_chunks`` calls for each chunk of rows ``[start, end)``: the loss
    head's per-row outputs of those rows from their ``logits`` (C, V) and, with
    ``compute_grad``, dL/dlogits written over ``logits`` (same dtype; the loop casts it to
    the head's compute dtype for dX and dW where its logits are wider). ``constant_logits``
    holds the chunk's logits of each constant head (a teacher), only to be read."""

    def __call__(
        self,
        logits: torch.Tensor,
        start: int,
        end: int,
        compute_grad: bool,
        constant_logits: tuple[torch.Tensor, ...],
    ) -> None: ...


def logits_tile(flat: torch.Tensor, rows: int, vocab: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The first ``rows * logits_row_stride(vocab)`` elements of ``flat`` as a ``(rows, vocab)``
    logits tile whose rows are ``logits_row_stride(vocab)`` elements apart: an aligned
    leading dimension for the GEMMs that write and read it (flce.driver.sizing), whatever
    ``vocab``; the loss kernels take the row stride. ``bias``: the product's, whose GEMM
    adds it only into contiguous rows (``logits_row_stride``)."""
    stride = logits_row_stride(vocab, flat.dtype, bias)
    tile = flat[: rows * stride].view(rows, stride)
    return tile if stride == vocab else tile[:, :vocab]


def logits_buffer(
    rows: int, vocab: int, dtype: torch.dtype, device: torch.device, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """An uninitialised ``logits_tile`` of its own."""
    stride = logits_row_stride(vocab, dtype, bias)
    return logits_tile(torch.empty(rows * stride, dtype=dtype, device=device), rows, vocab, bias)


def _constant_heads_workspace(constant_heads: Sequence[LinearHead], vocab: int) -> tuple[list[torch.dtype], int, int]:
    """The constant heads' logits dtypes; their workspace per logit of a chunk (their logits
    buffers, and their input rows cast to their compute dtype, rounded up to whole bytes
    per logit); and their weights cast to their compute dtype, held for the call as the
    loss head's own cast is."""
    dtypes = [c.logits_dtype or c.compute_dtype for c in constant_heads]
    row_casts = sum(
        c.input.shape[1] * c.compute_dtype.itemsize for c in constant_heads if c.input.dtype != c.compute_dtype
    )
    weight_casts = sum(
        c.weight.numel() * c.compute_dtype.itemsize for c in constant_heads if c.weight.dtype != c.compute_dtype
    )
    return dtypes, sum(d.itemsize for d in dtypes) - (-row_casts // vocab), weight_casts


def run_token_chunks(
    head: LinearHead,
    kernel: TokenChunkKernel,
    request: GradRequest,
    *,
    chunk_size: int | None,  # rows per chunk; None: from the memory budget (flce.driver.sizing)
    accum_dtype: torch.dtype | None,  # LossOptions.accum_dtype
    extra_bytes_per_logit: int,  # the kernel's fp32 workspace per logit
    constant_heads: Sequence[LinearHead] = (),  # same N and V; no gradient (a teacher)
    kept_logits: torch.Tensor | None = None,  # (N, V) compute dtype: ``head``'s logits, kept
    after_first_gemm: Callable[[], None] | None = None,
) -> Gradients:
    """The loop of every loss head: per chunk, the logits GEMM of ``head`` (and of each
    constant head) into reused buffers, ``kernel``, then dX and the dW/db accumulation of
    the requested gradients from the dL/dlogits it wrote in place. ``kept_logits``: the
    logits of every row that an earlier one-chunk run of this loop produced (the same
    GEMM), used as one chunk in place of the logits GEMM, and overwritten.

    The host work before the first GEMM's launch delays the GPU, so what can wait does:
    ``after_first_gemm`` (the head allocating its row outputs) and the gradients' buffers
    run once the first chunk's GEMMs are queued, before its ``kernel`` (at once when there
    are no rows)."""
    input, weight, bias, compute_dtype = head.input, head.weight, head.bias, head.compute_dtype
    n_rows, hidden = input.shape
    vocab = weight.shape[0]
    device = input.device
    if n_rows == 0:  # no rows, no GEMM: the gradients are zero (dX has no rows)
        if after_first_gemm is not None:
            after_first_gemm()
        return Gradients(
            torch.empty_like(input) if request.input else None,
            torch.zeros(vocab, hidden, dtype=weight.dtype, device=device) if request.weight else None,
            torch.zeros(vocab, dtype=bias.dtype, device=device) if request.bias else None,
        )

    w = in_compute_dtype(weight, compute_dtype)
    b = in_compute_dtype(bias, compute_dtype)
    w_t = w.t()  # (H, V) view: logits = x @ W^T
    constants = [
        (c, in_compute_dtype(c.weight, c.compute_dtype).t(), in_compute_dtype(c.bias, c.compute_dtype))
        for c in constant_heads
    ]
    # Wider logits than the operands' count as workspace per logit (the sizing counts them in
    # the compute dtype) and, for gradients, their cast back to it for dX and dW; so do the
    # constant heads' (``_constant_heads_workspace``; no call without them: host time).
    logits_dtype = head.logits_dtype or compute_dtype
    wider_logits = logits_dtype != compute_dtype
    constant_logits_dtypes, extra_bytes, constant_weight_casts = (
        _constant_heads_workspace(constant_heads, vocab) if constant_heads else ((), 0, 0)
    )
    extra_bytes += extra_bytes_per_logit
    if wider_logits:
        extra_bytes += logits_dtype.itemsize - compute_dtype.itemsize + (compute_dtype.itemsize if request.any else 0)

    accumulator_dtype = weight_accumulator_dtype(accum_dtype, weight.dtype) if request.weight else None
    chunk = chunk_size or whole_row_chunk_size(
        n_rows,
        vocab,
        hidden,
        compute_dtype,
        weight.dtype,
        extra_bytes,
        accumulator_dtype == torch.float32,
        upcast_operands=not fp32_output_gemm_supported(device),
        input_dtype=input.dtype,
        constant_weight_cast_bytes=constant_weight_casts,
    )
    chunk = n_rows if kept_logits is not None else max(1, min(chunk, n_rows))
    dw_direct = request.weight and weight_grad_in_one_gemm(
        n_rows, chunk, weight.dtype, compute_dtype, accumulator_dtype
    )

    # kept_logits: the (N, V) tensor the forward kept, the chunks' logits already in it. One
    # chunk of aligned rows in the operands' dtype otherwise: its GEMM allocates the logits
    # (the same memory, one op fewer than a buffer). A biased GEMM's rows are unpadded
    # where V allows (``logits_row_stride``).
    buffer = kept_logits
    if buffer is None and (chunk < n_rows or logits_row_stride(vocab, logits_dtype, b) != vocab or wider_logits):
        buffer = logits_buffer(chunk, vocab, logits_dtype, device, b)
    constant_buffers = [
        logits_buffer(chunk, vocab, dtype, device, c_b)
        for dtype, (_, _, c_b) in zip(constant_logits_dtypes, constants, strict=True)
        if n_rows
    ]
    # Wider logits: dL/dlogits cast back to the compute dtype, the dX and dW GEMMs' operand.
    grad_buffer = logits_buffer(chunk, vocab, compute_dtype, device) if wider_logits and request.any else None

    dx = dw_acc = db_acc = None
    compute_grad = request.any
    for start in range(0, n_rows, chunk):
        end = min(start + chunk, n_rows)
        x = in_compute_dtype(row_range(input, start, end), compute_dtype)
        if kept_logits is None:
            logits = logits_product(row_range(buffer, 0, end - start), x, w_t, b)  # (C, V)
        else:
            logits = row_range(kept_logits, start, end)  # (C, V), computed by the forward
        constant_logits = tuple(
            logits_product(buffer[: end - start], in_compute_dtype(c.input[start:end], c.compute_dtype), c_w_t, c_b)
            for buffer, (c, c_w_t, c_b) in zip(constant_buffers, constants, strict=True)
        )
        if start == 0:  # the first GEMMs are queued: what waited for them (docstring)
            if after_first_gemm is not None:
                after_first_gemm()
            # Uninitialised: the first chunk's GEMMs overwrite them.
            dx = torch.empty_like(input) if request.input else None
            dw_dtype = weight.dtype if dw_direct else accumulator_dtype
            dw_acc = torch.empty(vocab, hidden, dtype=dw_dtype, device=device) if request.weight else None
            db_acc = torch.empty(vocab, dtype=torch.float32, device=device) if request.bias else None
        kernel(logits, start, end, compute_grad, constant_logits)
        constant_logits = None
        if not compute_grad:
            continue
        grad_logits = logits  # (C, V) dL/dlogits, written in place by the kernel
        if grad_buffer is not None:
            grad_logits = row_range(grad_buffer, 0, end - start).copy_(logits)
        if dx is not None:
            if dx.dtype == compute_dtype:
                accumulate_product(row_range(dx, start, end), grad_logits, w, True, vocabulary="reduction")
            else:
                dx_chunk = torch.empty(end - start, hidden, dtype=compute_dtype, device=device)
                accumulate_product(dx_chunk, grad_logits, w, True, vocabulary="reduction")
                dx[start:end] = dx_chunk
        if dw_direct:
            with full_precision_reductions():
                accumulate_product(dw_acc, grad_logits.t(), x, True, vocabulary="rows")
        elif dw_acc is not None:
            accumulate_product(dw_acc, grad_logits.t(), x, first=start == 0, vocabulary="rows")
        if db_acc is not None:
            accumulate_column_sums(db_acc, grad_logits, first=start == 0)

    # Free the chunk buffers (the loop's views of them too) before the fp32 -> weight-dtype
    # cast below, so the chunks and the cast's output never coexist.
    logits = grad_logits = x = None
    del buffer, constant_buffers, grad_buffer
    dw = None
    if dw_acc is not None:
        dw = dw_acc if dw_acc.dtype == weight.dtype else dw_acc.to(weight.dtype)
        del dw_acc
    db = None if db_acc is None else db_acc.to(bias.dtype)
    return Gradients(dx, dw, db)


def run_chunks(
    input: torch.Tensor,  # (N, H) any float dtype (cast to compute_dtype per chunk)
    weight: torch.Tensor,  # (V, H)
    target: torch.Tensor,  # (N,)
    bias: torch.Tensor | None,  # (V,)
    ce_weight: torch.Tensor | None,  # (V,) fp32
    options: LossOptions,
    backend: BackendSpec,
    compute_dtype: torch.dtype,
    scalars: ChunkScalars,
    request: GradRequest,
    row_grad_scale: torch.Tensor | None = None,  # (N,) fp32 per-row upstream gradient
) -> tuple[RowOutputs, Gradients]:
    """The cross-entropy through ``run_token_chunks`` with the backend's chunk CE kernel;
    returns per-row outputs and the requested gradients."""
    rows = None

    def allocate() -> None:  # once the first logits GEMM is queued (run_token_chunks)
        nonlocal rows
        rows = allocate_rows(input.shape[0], options, input.device)

    def cross_entropy_kernel(logits, start, end, compute_grad, _constant_logits) -> None:
        backend.cross_entropy_chunk(
            logits,
            row_range(target, start, end),
            ce_weight,
            scalars,
            **rows.chunk_kwargs(start, end),
            row_grad_scale=row_range(row_grad_scale, start, end),
            compute_grad=compute_grad,
        )

    grads = run_token_chunks(
        LinearHead(input, weight, bias, compute_dtype),
        cross_entropy_kernel,
        request,
        chunk_size=options.chunk_size,
        accum_dtype=options.accum_dtype,
        extra_bytes_per_logit=backend.extra_bytes_per_logit,
        after_first_gemm=allocate,
    )
    return rows, grads


def run_logits_chunks(
    logits: torch.Tensor,  # (N, V) the caller's logits; only read
    target: torch.Tensor,  # (N,)
    ce_weight: torch.Tensor | None,  # (V,) fp32
    options: LossOptions,
    backend: BackendSpec,
    scalars: ChunkScalars,
    request: GradRequest,
    row_grad_scale: torch.Tensor | None = None,  # (N,) fp32 per-row upstream gradient
) -> tuple[RowOutputs, Gradients]:
    """The chunk kernel over given logits, in row chunks (the torch backend's workspace
    stays bounded); ``request.input`` asks for dL/dlogits, written to a new buffer (the
    kernels read the logits and write it there: never modified, never copied)."""
    n_rows, vocab = logits.shape
    rows = allocate_rows(n_rows, options, logits.device)
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device) if request.input else None
    source = logits if logits.stride(-1) == 1 else logits.contiguous()
    chunk = options.chunk_size or default_chunk_size(n_rows, vocab, logits.dtype, backend.extra_bytes_per_logit)
    for start in range(0, n_rows, chunk):
        end = min(start + chunk, n_rows)
        backend.cross_entropy_chunk(
            row_range(source, start, end),
            row_range(target, start, end),
            ce_weight,
            scalars,
            **rows.chunk_kwargs(start, end),
            row_grad_scale=row_range(row_grad_scale, start, end),
            compute_grad=grad is not None,
            grad_out=row_range(grad, start, end),
        )
    return rows, Gradients(grad, None, None)
