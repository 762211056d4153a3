"""The shared chunked driver: one control flow for every backend.

For a block of ``C`` token rows at a time it runs the logits GEMM into a reused
``(C, V)`` buffer, calls the backend's chunk CE kernel (loss statistics, and the
gradient written in place over the logits), then the dX GEMM and the dW/db
accumulation. The full ``(N, V)`` logits never exist.

Chunk size (``default_chunk_size``): the rows whose logits fit the memory budget,

    C = budget_bytes // (V * (itemsize(compute dtype) + backend.extra_bytes_per_logit))

clamped to [1, N] and then balanced so every chunk has about the same size. The
budget is ``DEFAULT_CHUNK_BUDGET_BYTES`` (512 MiB; ``FLCE_CHUNK_BUDGET_MIB`` overrides
it, ``chunk_size=`` overrides C).

When dW of a bf16/fp16 weight is accumulated in fp32 (the default with gradients) and
no budget is set, ``whole_row_chunk_size`` picks the chunk by what sets the peak:

- one chunk, when the whole batch's logits fit in the size of the fp32 accumulator,
  ``N*V*(itemsize + extra) <= V*H*4``. With one chunk the dW GEMM already sums over all
  N rows in fp32 inside cuBLAS, so it writes dW in the weight's dtype directly (one
  rounding, as exact as an fp32 accumulator) and there is no accumulator, no second
  pass over one and no cast;
- otherwise the budget is raised to the size of dW, ``V*H*itemsize(weight)``: the
  end-of-call cast holds the accumulator and dW together anyway, so a chunk that size
  does not raise the peak, and fewer chunks mean fewer passes over the accumulator.

Peak extra memory of a forward+backward call with a bf16/fp16 weight and fp32 dW
accumulation is then

    N*V*(itemsize + extra) + V*H*itemsize     one chunk: logits + kernel workspace + dW
  or
    max(C*V*(itemsize + extra) + V*H*4,       several: chunk logits + kernel workspace
                                              + the fp32 dW accumulator
        V*H*(4 + itemsize))                   at the end: the accumulator and its cast
  + N*H*itemsize(input) + V*4 (db)            both: dX, and db in fp32

(``extra`` is an upper bound for the torch backend, whose temporaries are not all alive
at once; ``peak_extra_bytes`` computes it). With an fp32 weight, or ``accum_dtype``
equal to the weight's dtype, the accumulator is the returned dW:
``C*V*(itemsize + extra) + V*H*itemsize + N*H*itemsize``.

dW and db are accumulated in fp32 unless ``accum_dtype`` equals a low-precision
weight dtype (then in that dtype: less memory, rounding per chunk, the user's choice).

``run_vocab_blocks`` (``vocab_chunk_size=``) splits the vocabulary too and keeps dW's
fp32 accumulation exact with one ``V_b x H`` block alive instead of ``V x H``, for one
more logits GEMM.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flce.backends.base import BackendSpec, ChunkScalars
from flce.backends.torch.ce import loss_rows
from flce.options import LossOptions

DEFAULT_CHUNK_BUDGET_BYTES = 512 * 2**20
CHUNK_BUDGET_ENV_VAR = "FLCE_CHUNK_BUDGET_MIB"


def chunk_budget_bytes() -> int:
    """The transient-logits budget: ``FLCE_CHUNK_BUDGET_MIB`` if set, else 512 MiB."""
    value = os.environ.get(CHUNK_BUDGET_ENV_VAR)
    if not value:
        return DEFAULT_CHUNK_BUDGET_BYTES
    try:
        mib = float(value)
    except ValueError:
        raise ValueError(f"{CHUNK_BUDGET_ENV_VAR} must be a positive number of MiB, got {value!r}") from None
    if not mib > 0:
        raise ValueError(f"{CHUNK_BUDGET_ENV_VAR} must be a positive number of MiB, got {value!r}")
    return int(mib * 2**20)


def default_chunk_size(
    n_rows: int,
    vocab: int,
    logits_dtype: torch.dtype,
    extra_bytes_per_logit: int = 0,
    budget_bytes: int | None = None,
) -> int:
    """Rows per chunk so that a chunk's logits (plus the kernel's workspace) fit the budget."""
    if n_rows <= 0:
        return 1
    budget = chunk_budget_bytes() if budget_bytes is None else budget_bytes
    bytes_per_row = vocab * (torch.empty((), dtype=logits_dtype).element_size() + extra_bytes_per_logit)
    rows = max(1, min(n_rows, budget // max(bytes_per_row, 1)))
    # Balance the chunks: with k chunks needed, make them all ceil(N / k) rows, so the
    # last one is not a tiny, inefficient GEMM (never larger than the budget allows).
    num_chunks = math.ceil(n_rows / rows)
    return math.ceil(n_rows / num_chunks)


def whole_row_chunk_size(
    n_rows: int,
    vocab: int,
    hidden: int,
    compute_dtype: torch.dtype,
    weight_dtype: torch.dtype,
    extra_bytes_per_logit: int,
    fp32_weight_accumulator: bool,
) -> int:
    """``run_chunks``'s default rows per chunk (see the module docstring)."""
    budget = chunk_budget_bytes()
    if fp32_weight_accumulator and weight_dtype != torch.float32 and not os.environ.get(CHUNK_BUDGET_ENV_VAR):
        logit_bytes = torch.empty((), dtype=compute_dtype).element_size() + extra_bytes_per_logit
        if n_rows * vocab * logit_bytes <= vocab * hidden * 4:
            # One chunk no larger than the fp32 accumulator it makes unnecessary.
            return max(1, n_rows)
        budget = max(budget, vocab * hidden * torch.empty((), dtype=weight_dtype).element_size())
    return default_chunk_size(n_rows, vocab, compute_dtype, extra_bytes_per_logit, budget)


def peak_extra_bytes(
    n_rows: int,
    vocab: int,
    hidden: int,
    itemsize: int,
    extra_bytes_per_logit: int,
    chunk: int,
) -> int:
    """The module docstring's peak extra memory of a forward+backward call with a
    bf16/fp16 weight (``itemsize`` bytes) and fp32 dW accumulation, for ``chunk`` rows
    per chunk (a promise that the GPU tests hold the driver to)."""
    logits = chunk * vocab * (itemsize + extra_bytes_per_logit)
    if chunk >= n_rows:
        body = logits + vocab * hidden * itemsize
    else:
        body = max(logits + vocab * hidden * 4, vocab * hidden * (4 + itemsize))
    return body + n_rows * hidden * itemsize + vocab * 4


@contextlib.contextmanager
def _full_precision_reductions():
    """cuBLAS may reduce split-K partial sums of bf16/fp16 GEMMs in that dtype unless
    told not to (PyTorch allows it by default); a dW GEMM that replaces the fp32
    accumulator must keep every partial sum in fp32."""
    matmul = torch.backends.cuda.matmul
    saved = (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction)
    matmul.allow_bf16_reduced_precision_reduction = False
    matmul.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction = saved


@dataclass(frozen=True)
class BatchStatistics:
    """Per-call counts read back from the device in one transfer."""

    n_valid: int  # rows whose target is not ignore_index
    ce_denominator: float  # mean reduction's divisor of the CE part: sum of w_y, or n_valid
    weight_sum: float  # sum of ce_weight over the vocabulary (V without weights)


def batch_statistics(
    target: torch.Tensor, ce_weight: torch.Tensor | None, vocab: int, ignore_index: int
) -> BatchStatistics:
    """Validates the target range (and class weights) and counts the valid rows with a
    single device-to-host read, the only host sync of a call. Raises ``ValueError``
    naming the first offending value before any kernel reads out of bounds."""
    valid = target != ignore_index
    out_of_range = valid & ((target < 0) | (target >= vocab))
    parts = [valid.sum(), out_of_range.sum()]
    if ce_weight is not None:
        w = ce_weight.float()
        safe_target = torch.where(valid & ~out_of_range, target, torch.zeros_like(target)).long()
        parts += [(w[safe_target] * valid).sum(), w.sum(), ((w < 0) | ~torch.isfinite(w)).sum()]
    values = torch.stack([p.double() for p in parts]).tolist()  # the one host sync
    n_valid, n_bad = int(values[0]), int(values[1])
    if n_bad:
        bad = target[out_of_range][:3].tolist()
        raise ValueError(
            f"target values must be in [0, {vocab}) or equal ignore_index={ignore_index}; "
            f"found {n_bad} out of range (e.g. {bad})"
        )
    if ce_weight is None:
        return BatchStatistics(n_valid, float(n_valid), float(vocab))
    if values[4]:
        raise ValueError("ce_weight must be finite and non-negative; it has negative, NaN or Inf entries")
    return BatchStatistics(n_valid, values[2], values[3])


def chunk_scalars(options: LossOptions, stats: BatchStatistics) -> ChunkScalars:
    """Kernel scalars; the mean reduction is folded into the gradient scales."""
    if options.reduction == "mean":
        ce_scale = 1.0 / stats.ce_denominator if stats.ce_denominator > 0 else 0.0
        z_scale = 1.0 / stats.n_valid if stats.n_valid > 0 else 0.0
    else:
        ce_scale = z_scale = 1.0
    return ChunkScalars(
        ignore_index=options.ignore_index,
        label_smoothing=float(options.label_smoothing),
        lse_square_scale=float(options.lse_square_scale),
        softcap=None if options.softcap is None else float(options.softcap),
        use_token_scaling=options.use_token_scaling,
        ce_grad_scale=ce_scale,
        z_grad_scale=z_scale,
        weight_sum=stats.weight_sum,
    )


@dataclass
class RowOutputs:
    """Per-row results of one call, before reduction."""

    loss: torch.Tensor  # (N,) fp32, CE part
    z_loss: torch.Tensor | None  # (N,) fp32
    correct: torch.Tensor | None  # (N,) fp32
    predicted: torch.Tensor | None  # (N,) int64

    @staticmethod
    def allocate(n_rows: int, options: LossOptions, device: torch.device) -> RowOutputs:
        def rows(dtype):
            return torch.empty(n_rows, dtype=dtype, device=device)

        return RowOutputs(
            loss=rows(torch.float32),
            z_loss=rows(torch.float32) if options.needs_z_loss_rows else None,
            correct=rows(torch.float32) if options.return_token_accuracy else None,
            predicted=rows(torch.int64) if options.return_predicted_tokens else None,
        )

    def store(
        self,
        valid: torch.Tensor,  # (N,) bool: target != ignore_index
        target: torch.Tensor,  # (N,)
        ce: torch.Tensor,  # (N,) fp32 st * ce
        z_loss: torch.Tensor,  # (N,) fp32 st * zl
        argmax: torch.Tensor | None,  # (N,) int64 argmax of z' (first index); None if unused
    ) -> None:
        """Writes whole-row results with the contract's values on ignored rows: loss,
        z-loss and correct 0, predicted -1."""
        zero = torch.zeros((), dtype=torch.float32, device=ce.device)
        self.loss.copy_(torch.where(valid, ce, zero))
        if self.z_loss is not None:
            self.z_loss.copy_(torch.where(valid, z_loss, zero))
        if self.correct is not None:
            self.correct.copy_(((argmax == target) & valid).float())
        if self.predicted is not None:
            self.predicted.copy_(torch.where(valid, argmax, torch.full_like(argmax, -1)))

    def chunk_kwargs(self, start: int, end: int) -> dict:
        def part(t):
            return None if t is None else t[start:end]

        return dict(
            loss_out=self.loss[start:end],
            z_loss_out=part(self.z_loss),
            correct_out=part(self.correct),
            predicted_out=part(self.predicted),
        )


@dataclass
class Gradients:
    input: torch.Tensor | None  # (N, H) input dtype
    weight: torch.Tensor | None  # (V, H) weight dtype
    bias: torch.Tensor | None  # (V,) bias dtype


def _weight_accumulator_dtype(options: LossOptions, param_dtype: torch.dtype) -> torch.dtype:
    """fp32 unless the caller asked to accumulate in the (low-precision) parameter dtype."""
    if options.accum_dtype is not None and options.accum_dtype == param_dtype:
        return param_dtype
    return torch.float32


_TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def _weight_grad_in_one_gemm(
    n_rows: int, chunk: int, weight_dtype: torch.dtype, compute_dtype: torch.dtype, accumulator_dtype
) -> bool:
    """Whether dW (or a block of its rows) comes from one GEMM written in the weight's
    dtype: with one chunk the GEMM sums over every row with fp32 accumulation (cuBLAS, and
    PyTorch's CPU GEMM), so an fp32 accumulator would only add a pass over it and a cast.
    The caller runs that GEMM under ``_full_precision_reductions``."""
    return (
        n_rows > 0
        and chunk >= n_rows
        and weight_dtype == compute_dtype
        and accumulator_dtype == torch.float32
        and weight_dtype in (torch.bfloat16, torch.float16)
    )


def _addmm_out_dtype_supported(device: torch.device) -> bool:
    # addmm(out_dtype=float32) with bf16/fp16 operands: a cuBLAS GEMM whose C/D are fp32,
    # added in torch 2.8 and implemented for CUDA only.
    return device.type == "cuda" and _TORCH_VERSION >= (2, 8)


def _accumulate_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """acc += a @ b (acc = a @ b when ``first``: the accumulator starts uninitialised, so
    neither a memset nor a read of it is paid), in acc's dtype, with no parameter-sized
    temporary."""
    beta = 0.0 if first else 1.0  # beta = 0: the GEMM ignores acc's contents (even NaN)
    if acc.dtype == a.dtype:
        torch.addmm(acc, a, b, beta=beta, out=acc)
    elif acc.dtype == torch.float32 and _addmm_out_dtype_supported(acc.device):
        torch.addmm(acc, a, b, beta=beta, out_dtype=torch.float32, out=acc)
    else:
        # CPU (or an old torch): upcast the chunk operands, which is exact and small.
        torch.addmm(acc, a.to(acc.dtype), b.to(acc.dtype), beta=beta, out=acc)


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
    *,
    grad_input: bool,
    grad_weight: bool,
    grad_bias: bool,
    row_grad_scale: torch.Tensor | None = None,  # (N,) fp32 per-row upstream gradient
) -> tuple[RowOutputs, Gradients]:
    """Runs every chunk; returns per-row outputs and the requested gradients."""
    n_rows, hidden = input.shape
    vocab = weight.shape[0]
    device = input.device
    rows = RowOutputs.allocate(n_rows, options, device)
    compute_grad = grad_input or grad_weight or grad_bias

    w = weight if weight.dtype == compute_dtype else weight.to(compute_dtype)
    b = None if bias is None else (bias if bias.dtype == compute_dtype else bias.to(compute_dtype))
    w_t = w.t()  # (H, V) view: logits = x @ W^T

    dx = torch.empty_like(input) if grad_input else None
    accumulator_dtype = _weight_accumulator_dtype(options, weight.dtype) if grad_weight else None
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
    dw_direct = grad_weight and _weight_grad_in_one_gemm(n_rows, chunk, weight.dtype, compute_dtype, accumulator_dtype)
    # Uninitialised: the first chunk's GEMM overwrites it (zeroed below if there is none).
    dw_acc = (
        torch.empty(vocab, hidden, dtype=weight.dtype if dw_direct else accumulator_dtype, device=device)
        if grad_weight
        else None
    )
    db_acc = torch.zeros(vocab, dtype=torch.float32, device=device) if grad_bias else None

    logits_buffer = torch.empty(chunk, vocab, dtype=compute_dtype, device=device) if n_rows else None

    for start in range(0, n_rows, chunk):
        end = min(start + chunk, n_rows)
        x = input[start:end]
        if x.dtype != compute_dtype:
            x = x.to(compute_dtype)
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
            compute_grad=compute_grad,
        )
        if not compute_grad:
            continue
        grad_logits = logits  # (C, V) dL/dlogits, written in place by the kernel
        if dx is not None:
            if dx.dtype == compute_dtype:
                torch.mm(grad_logits, w, out=dx[start:end])
            else:
                dx[start:end] = grad_logits @ w
        if dw_direct:
            with _full_precision_reductions():
                torch.mm(grad_logits.t(), x, out=dw_acc)
        elif dw_acc is not None:
            _accumulate_product(dw_acc, grad_logits.t(), x, first=start == 0)
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


def scale_gradients_(gradients: Sequence[torch.Tensor | None], grad_loss: torch.Tensor) -> None:
    """Multiplies each gradient by the 0-dim upstream gradient in place.

    On CUDA (and under Triton's interpreter) with Triton installed, a kernel skips the
    pass over dW and dX when ``grad_loss`` is exactly 1, as it is for ``loss.backward()``,
    without reading it on the host (``flce.backends.triton.scale``); elsewhere a plain
    ``mul_``.
    """
    from flce.backends.triton import availability as triton_availability

    present = [g for g in gradients if g is not None]
    if not present:
        return
    if triton_availability(present[0].device)[0]:
        from flce.backends.triton.scale import scale_unless_one_
    else:
        scale_unless_one_ = None
    for gradient in present:
        if scale_unless_one_ is not None and gradient.is_contiguous():
            scale_unless_one_(gradient, grad_loss)
        else:
            gradient.mul_(grad_loss.to(gradient.dtype))


@dataclass
class Reduced:
    loss: torch.Tensor
    z_loss: torch.Tensor | None
    token_accuracy: torch.Tensor | None
    predicted_tokens: torch.Tensor | None


def reduce_rows(rows: RowOutputs, options: LossOptions, scalars: ChunkScalars, stats: BatchStatistics) -> Reduced:
    """Applies the reduction; the mean uses the same scales as the gradient."""
    z_rows = rows.z_loss
    adds_z = options.lse_square_scale > 0 and z_rows is not None
    if options.reduction == "none":
        loss = rows.loss + z_rows if adds_z else rows.loss
        z_loss = z_rows if options.return_z_loss else None
        accuracy = rows.correct
    else:
        ce_total = rows.loss.sum()
        z_total = z_rows.sum() if z_rows is not None else None
        loss = ce_total * scalars.ce_grad_scale
        if adds_z:
            loss = loss + z_total * scalars.z_grad_scale
        z_loss = z_total * scalars.z_grad_scale if options.return_z_loss else None
        accuracy = None
        if rows.correct is not None:
            accuracy = rows.correct.sum() * (1.0 / stats.n_valid if stats.n_valid else 0.0)
    return Reduced(loss, z_loss, accuracy, rows.predicted)


def rows_from_forward_statistics(
    statistics: dict,  # (N,) tensors: lse, target_logit, predicted, and logit_sum with smoothing
    target: torch.Tensor,  # (N,)
    ce_weight: torch.Tensor | None,  # (V,) fp32
    options: LossOptions,
    scalars: ChunkScalars,
    vocab: int,
) -> RowOutputs:
    """Per-row outputs from whole-row statistics of ``z'`` (a loss-only call through
    ``flce.backends.cutedsl.fused_forward``, whose GEMM never stores the logits):
    ``lse``, ``target_logit = z'_y`` (any value on ignored rows), ``predicted`` (argmax,
    first index) and, with label smoothing, ``logit_sum = sum_i z'_i``.

    The loss is ``loss_rows``'s, whose formulas hold for any reference point ``m`` of a row
    as long as ``log_s = lse - m``; here ``m = lse``: ``log_s = 0``, the shifted target
    ``z'_y - lse`` and the shifted smoothing sum ``sum_i (z'_i - lse) = logit_sum - V * lse``.
    Without a weighted logit sum, label smoothing with class weights cannot be computed
    from these statistics (the caller runs ``run_chunks`` for it).
    """
    lse = statistics["lse"]
    rows = RowOutputs.allocate(lse.shape[0], options, lse.device)
    if scalars.label_smoothing > 0 and ce_weight is not None:
        raise ValueError("label smoothing with class weights needs sum_i w_i z'_i, which these statistics lack")
    valid = target != scalars.ignore_index
    safe_target = torch.where(valid, target, torch.zeros_like(target)).long()
    shifted_smooth = None
    if scalars.label_smoothing > 0:
        shifted_smooth = statistics["logit_sum"] - scalars.weight_sum * lse
    w_y = ce_weight[safe_target] if ce_weight is not None else torch.ones_like(lse)
    ce, zl, _ = loss_rows(
        torch.zeros_like(lse),
        statistics["target_logit"] - lse,
        shifted_smooth,
        lse,
        w_y,
        scalars,
        scalars.label_smoothing / vocab,
    )
    rows.store(valid, target, ce, zl, statistics["predicted"])
    return rows


def run_vocab_blocks(
    input: torch.Tensor,  # (N, H)
    weight: torch.Tensor,  # (V, H)
    target: torch.Tensor,  # (N,)
    bias: torch.Tensor | None,  # (V,)
    ce_weight: torch.Tensor | None,  # (V,) fp32
    options: LossOptions,
    kernels,  # flce.split_rows kernels
    compute_dtype: torch.dtype,
    scalars: ChunkScalars,
    *,
    grad_input: bool,
    grad_weight: bool,
    grad_bias: bool,
    row_grad_scale: torch.Tensor | None = None,  # (N,) fp32
) -> tuple[RowOutputs, Gradients]:
    """The driver over token chunks x vocabulary blocks (``options.vocab_chunk_size``).

    Pass 1 runs the logits GEMM block by block and merges each block's row statistics
    (max, sum of exp, target logit, smoothing sum, argmax) into the whole row's. Pass 2,
    only for gradients, recomputes each block's logits, writes their gradient in place
    and finishes that block of dW in one fp32 accumulator of ``V_b x H`` before moving
    on (or, when one chunk holds every row, writes it into dW directly: one GEMM
    accumulates in fp32 inside); dX is accumulated in fp32 over the blocks. Exact fp32
    accumulation of both with peak extra memory ``C*V_b*(itemsize + extra) + V_b*H*4 +
    N*H*4 + dW + dX`` (no ``V_b*H*4`` term with one row chunk) instead of a ``V x H`` fp32
    buffer, for one more logits GEMM (8NVH FLOPs instead of 6NVH).
    """
    n_rows, hidden = input.shape
    vocab = weight.shape[0]
    device = input.device
    rows = RowOutputs.allocate(n_rows, options, device)
    block = max(1, min(options.vocab_chunk_size, vocab))
    chunk = options.chunk_size or default_chunk_size(n_rows, block, compute_dtype, kernels.extra_bytes_per_logit)
    chunk = max(1, min(chunk, max(n_rows, 1)))
    w = weight if weight.dtype == compute_dtype else weight.to(compute_dtype)
    b = None if bias is None else (bias if bias.dtype == compute_dtype else bias.to(compute_dtype))
    ls = scalars.label_smoothing
    eps = ls / vocab
    need_argmax = options.return_token_accuracy or options.return_predicted_tokens
    valid = target != scalars.ignore_index
    safe_target = torch.where(valid, target, torch.zeros_like(target)).long()
    buffer = torch.empty(chunk * block, dtype=compute_dtype, device=device) if n_rows else None

    def blocks():
        for v0 in range(0, vocab, block):
            v1 = min(v0 + block, vocab)
            yield v0, v1, None if ce_weight is None else ce_weight[v0:v1]

    def logits_of(r0: int, r1: int, v0: int, v1: int, x: torch.Tensor) -> torch.Tensor:
        logits = buffer[: (r1 - r0) * (v1 - v0)].view(r1 - r0, v1 - v0)  # (C, V_b) contiguous
        if b is None:
            torch.mm(x, w[v0:v1].t(), out=logits)
        else:
            torch.addmm(b[v0:v1], x, w[v0:v1].t(), out=logits)
        return logits

    def chunks():
        for r0 in range(0, n_rows, chunk):
            r1 = min(r0 + chunk, n_rows)
            x = input[r0:r1]
            yield r0, r1, (x if x.dtype == compute_dtype else x.to(compute_dtype))

    # Pass 1: the whole row's statistics, merged block by block (running max M; the sums
    # kept relative to it; the target logit and the smoothing sum as absolute values).
    f32 = dict(dtype=torch.float32, device=device)
    row_max = torch.full((n_rows,), -float("inf"), **f32)
    row_sum = torch.zeros(n_rows, **f32)
    target_logit = torch.zeros(n_rows, **f32)
    smooth_sum = torch.zeros(n_rows, **f32) if ls > 0 else None
    best = torch.zeros(n_rows, dtype=torch.int64, device=device) if need_argmax else None
    for v0, v1, ce_block in blocks():
        block_weight_sum = ce_block.sum() if ce_block is not None else float(v1 - v0)
        for r0, r1, x in chunks():
            local = safe_target[r0:r1] - v0
            owned = valid[r0:r1] & (local >= 0) & (local < v1 - v0)
            stats = kernels.statistics(
                logits_of(r0, r1, v0, v1, x),
                torch.where(owned, local, v1 - v0),
                ce_block,
                scalars.softcap,
                with_smoothing=ls > 0,
                with_argmax=need_argmax,
            )
            old_max = row_max[r0:r1]
            new_max = torch.maximum(old_max, stats.row_max)
            row_sum[r0:r1] = row_sum[r0:r1] * torch.exp(old_max - new_max) + stats.row_sum * torch.exp(
                stats.row_max - new_max
            )
            target_logit[r0:r1] = torch.where(owned, stats.target_shifted + stats.row_max, target_logit[r0:r1])
            if smooth_sum is not None:
                smooth_sum[r0:r1] += stats.smooth_shifted + stats.row_max * block_weight_sum
            if best is not None:
                # strictly greater: an earlier block keeps a tie (the first index wins)
                best[r0:r1] = torch.where(stats.row_max > old_max, stats.argmax + v0, best[r0:r1])
            row_max[r0:r1] = new_max

    log_s = torch.log(row_sum)
    lse = row_max + log_s
    shifted_smooth = None if smooth_sum is None else smooth_sum - row_max * scalars.weight_sum
    w_y = ce_weight[safe_target] if ce_weight is not None else torch.ones_like(lse)
    ce, zl, token_scale = loss_rows(log_s, target_logit - row_max, shifted_smooth, lse, w_y, scalars, eps)
    rows.store(valid, target, ce, zl, best)
    if not (grad_input or grad_weight or grad_bias):
        return rows, Gradients(None, None, None)

    # Pass 2: the gradient, block by block; each block of dW is final when its loop ends.
    row_scale = valid.float()
    if token_scale is not None:
        row_scale = row_scale * token_scale
    if row_grad_scale is not None:
        row_scale = row_scale * row_grad_scale.float()
    inv_sum = 1.0 / row_sum
    dx_acc = torch.zeros(n_rows, hidden, **f32) if grad_input else None
    dw = torch.empty(vocab, hidden, dtype=weight.dtype, device=device) if grad_weight else None
    db = torch.zeros(vocab, **f32) if grad_bias else None
    acc_dtype = _weight_accumulator_dtype(options, weight.dtype)
    # One row chunk per block: each dW block is written directly, which saves the
    # V_b x H fp32 accumulator, this mode's largest buffer after dW itself.
    dw_direct = grad_weight and _weight_grad_in_one_gemm(n_rows, chunk, weight.dtype, compute_dtype, acc_dtype)
    for v0, v1, ce_block in blocks():
        if dw_direct:
            dw_block = dw[v0:v1]  # (V_b, H) contiguous rows of dW
        elif grad_weight:
            dw_block = torch.empty(v1 - v0, hidden, dtype=acc_dtype, device=device)
        else:
            dw_block = None
        for r0, r1, x in chunks():
            local = safe_target[r0:r1] - v0
            owned = valid[r0:r1] & (local >= 0) & (local < v1 - v0)
            grad_target = torch.where(owned, local, torch.where(valid[r0:r1], v1 - v0, -1))
            grad = logits_of(r0, r1, v0, v1, x)
            kernels.gradient(
                grad,
                grad_target,
                ce_block,
                row_max[r0:r1],
                inv_sum[r0:r1],
                w_y[r0:r1],
                lse[r0:r1],
                row_scale[r0:r1],
                scalars,
                eps,
            )
            if dx_acc is not None:
                _accumulate_product(dx_acc[r0:r1], grad, w[v0:v1], first=False)
            if dw_direct:
                with _full_precision_reductions():
                    torch.mm(grad.t(), x, out=dw_block)
            elif dw_block is not None:
                _accumulate_product(dw_block, grad.t(), x, first=r0 == 0)
            if db is not None:
                db[v0:v1] += grad.sum(dim=0, dtype=torch.float32)
        if dw_block is not None and not dw_direct:
            if n_rows == 0:
                dw_block.zero_()
            dw[v0:v1] = dw_block
            del dw_block
    dx = None if dx_acc is None else (dx_acc if input.dtype == torch.float32 else dx_acc.to(input.dtype))
    return rows, Gradients(dx, dw, None if db is None else db.to(bias.dtype))
