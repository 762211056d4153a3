"""The token-chunk scheme: one control flow for every backend's chunk CE kernel.

For a block of ``C`` token rows at a time, ``run_chunks`` runs the logits GEMM into a
reused ``(C, V)`` buffer, calls the backend's chunk CE kernel (loss statistics, and the
gradient written in place over the logits), then the dX GEMM and the dW/db
accumulation. The full ``(N, V)`` logits never exist. ``C`` comes from
``flce.driver.sizing``; dW and db are accumulated in fp32 unless ``accum_dtype`` equals
a low-precision weight dtype (then in that dtype: less memory, rounding per chunk, the
user's choice), or written by one GEMM when one chunk holds every row
(``flce.driver.gemm.weight_grad_in_one_gemm``).

``run_logits_chunks`` is the same kernel over logits the caller already has
(``flce.cross_entropy``): row chunks bound the torch backend's fp32 workspace, and the
gradient goes to a separate buffer so the caller's logits are never modified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flce.backends.base import BackendSpec
from flce.driver.gemm import (
    accumulate_product,
    full_precision_reductions,
    weight_accumulator_dtype,
    weight_grad_in_one_gemm,
)
from flce.driver.sizing import default_chunk_size, whole_row_chunk_size
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


def in_compute_dtype(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return tensor if tensor is None or tensor.dtype == dtype else tensor.to(dtype)


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
    """Runs every chunk; returns per-row outputs and the requested gradients."""
    n_rows, hidden = input.shape
    vocab = weight.shape[0]
    device = input.device
    rows = allocate_rows(n_rows, options, device)

    w = in_compute_dtype(weight, compute_dtype)
    b = in_compute_dtype(bias, compute_dtype)
    w_t = w.t()  # (H, V) view: logits = x @ W^T

    dx = torch.empty_like(input) if request.input else None
    accumulator_dtype = weight_accumulator_dtype(options.accum_dtype, weight.dtype) if request.weight else None
    chunk = options.chunk_size or whole_row_chunk_size(
        n_rows,
        vocab,
        hidden,
        compute_dtype,
        weight.dtype,
        backend.extra_bytes_per_logit,
        accumulator_dtype == torch.float32,
    )
    chunk = max(1, min(chunk, n_rows))
    dw_direct = request.weight and weight_grad_in_one_gemm(
        n_rows, chunk, weight.dtype, compute_dtype, accumulator_dtype
    )
    # Uninitialised: the first chunk's GEMM overwrites it (zeroed below if there is none).
    dw_acc = (
        torch.empty(vocab, hidden, dtype=weight.dtype if dw_direct else accumulator_dtype, device=device)
        if request.weight
        else None
    )
    db_acc = torch.zeros(vocab, dtype=torch.float32, device=device) if request.bias else None

    logits_buffer = torch.empty(chunk, vocab, dtype=compute_dtype, device=device) if n_rows else None

    for start in range(0, n_rows, chunk):
        end = min(start + chunk, n_rows)
        x = in_compute_dtype(input[start:end], compute_dtype)
        logits = logits_buffer[: end - start]  # (C, V)
        if b is None:
            torch.mm(x, w_t, out=logits)
        else:
            torch.addmm(b, x, w_t, out=logits)
        backend.cross_entropy_chunk(
            logits,
            target[start:end],
            ce_weight,
            scalars,
            **rows.chunk_kwargs(start, end),
            row_grad_scale=None if row_grad_scale is None else row_grad_scale[start:end],
            compute_grad=request.any,
        )
        if not request.any:
            continue
        grad_logits = logits  # (C, V) dL/dlogits, written in place by the kernel
        if dx is not None:
            if dx.dtype == compute_dtype:
                torch.mm(grad_logits, w, out=dx[start:end])
            else:
                dx[start:end] = grad_logits @ w
        if dw_direct:
            with full_precision_reductions():
                torch.mm(grad_logits.t(), x, out=dw_acc)
        elif dw_acc is not None:
            accumulate_product(dw_acc, grad_logits.t(), x, first=start == 0)
        if db_acc is not None:
            db_acc += grad_logits.sum(dim=0, dtype=torch.float32)

    # Free the chunk buffer (the loop's views of it too) before the fp32 -> weight-dtype
    # cast below, so the chunk and the cast's output never coexist.
    logits = grad_logits = x = None
    del logits_buffer
    dw = None
    if dw_acc is not None:
        if n_rows == 0:  # no chunk ran: the gradient is zero
            dw_acc.zero_()
        dw = dw_acc if dw_acc.dtype == weight.dtype else dw_acc.to(weight.dtype)
        del dw_acc
    db = None if db_acc is None else db_acc.to(bias.dtype)
    return rows, Gradients(dx, dw, db)


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
            source[start:end],
            target[start:end],
            ce_weight,
            scalars,
            **rows.chunk_kwargs(start, end),
            row_grad_scale=None if row_grad_scale is None else row_grad_scale[start:end],
            compute_grad=grad is not None,
            grad_out=None if grad is None else grad[start:end],
        )
    return rows, Gradients(grad, None, None)
