"""GEMM helpers of the drivers: the logits product, fp32 accumulation of dW/dX/db across
chunks, the rule for writing dW with one GEMM, and the split of every product whose
vocabulary extent is unaligned (``vocabulary_main_extent``)."""

from __future__ import annotations

import contextlib
import threading
from typing import Literal

import torch

from flce.torch_version import TORCH_VERSION

# cuBLAS runs a 16-bit GEMM whose vocabulary extent (the logits' columns, dX's reduction,
# dW's rows) is not a multiple of 16 bytes on kernels several times slower. Measured on
# the H200 (N = 8192, H = 4096, bf16, logits rows 64-element aligned,
# benchmarks/results/odd-vocabulary-h200): at V = 50257 the logits GEMM took 31.4 ms, dX
# 26.0 and dW 6.7, against 4.6, 4.9 and 4.4 for the same products split into the first
# columns and the rest; 4.3, 4.3 and 4.6 at V = 50304 and 4.6, 4.9 and 4.9 at V = 50264 (a
# multiple of 8, not of 64). An odd token count costs nothing (8191 rows: 4.3, 4.3, 4.8).
# So the drivers run each product whose vocabulary extent is unaligned as an aligned main
# part and a tail of fewer than 16 bytes of columns.
VOCABULARY_EXTENT_ALIGNMENT_BYTES = 16

# Which extent of a product ``acc = a @ b`` is the vocabulary: acc's rows (dW = G^T X),
# its columns (the logits; db = 1^T G) or the reduction (dX = G W).
VocabularyAxis = Literal["rows", "columns", "reduction"]


def vocabulary_main_extent(vocab: int, dtype: torch.dtype) -> int:
    """The columns of a product's aligned main part (``VOCABULARY_EXTENT_ALIGNMENT_BYTES``):
    ``vocab`` rounded down to a multiple of 16 bytes of ``dtype``; ``vocab`` itself when it
    is one already or narrower than one (no split)."""
    unit = max(1, VOCABULARY_EXTENT_ALIGNMENT_BYTES // dtype.itemsize)
    main = vocab - vocab % unit
    return main if main > 0 else vocab


class _FullPrecisionReductions:
    """Who is inside ``full_precision_reductions`` and what the flags were before the first
    of them: the flags are process-wide, and threads (``torch.nn.DataParallel``'s replicas,
    a loss per device) enter and leave in any order."""

    lock = threading.Lock()
    users = 0
    saved: tuple[bool, bool] | None = None


@contextlib.contextmanager
def full_precision_reductions():
    """cuBLAS may reduce split-K partial sums of bf16/fp16 GEMMs in that dtype unless
    told not to (PyTorch allows it by default); a dW GEMM that replaces the fp32
    accumulator must keep every partial sum in fp32.

    The flags are global and read when a GEMM is queued, so they are cleared while any
    thread is inside and restored when the last one leaves: with a plain save and restore
    per call, one thread's restore re-allowed the reduced reductions under another
    thread's dW GEMM, and two threads' saves could leave them cleared for good."""
    matmul = torch.backends.cuda.matmul
    state = _FullPrecisionReductions
    with state.lock:
        if state.users == 0:
            state.saved = (
                matmul.allow_bf16_reduced_precision_reduction,
                matmul.allow_fp16_reduced_precision_reduction,
            )
            matmul.allow_bf16_reduced_precision_reduction = False
            matmul.allow_fp16_reduced_precision_reduction = False
        state.users += 1
    try:
        yield
    finally:
        with state.lock:
            state.users -= 1
            if state.users == 0:
                bf16, fp16 = state.saved
                matmul.allow_bf16_reduced_precision_reduction = bf16
                matmul.allow_fp16_reduced_precision_reduction = fp16
                state.saved = None


def weight_accumulator_dtype(accum_dtype: torch.dtype | None, param_dtype: torch.dtype) -> torch.dtype:
    """fp32 unless the caller asked to accumulate in the (low-precision) parameter dtype."""
    if accum_dtype is not None and accum_dtype == param_dtype:
        return param_dtype
    return torch.float32


def weight_grad_in_one_gemm(
    n_rows: int, chunk: int, weight_dtype: torch.dtype, compute_dtype: torch.dtype, accumulator_dtype
) -> bool:
    """Whether dW (or a block of its rows) comes from one GEMM written in the weight's
    dtype: with one chunk the GEMM sums over every row with fp32 accumulation (cuBLAS, and
    PyTorch's CPU GEMM), so an fp32 accumulator would only add a pass over it and a cast.
    The caller runs that GEMM under ``full_precision_reductions``."""
    return (
        n_rows > 0
        and chunk >= n_rows
        and weight_dtype == compute_dtype
        and accumulator_dtype == torch.float32
        and weight_dtype in (torch.bfloat16, torch.float16)
    )


def fp32_output_gemm_supported(device: torch.device) -> bool:
    # addmm(out_dtype=float32) with bf16/fp16 operands: a cuBLAS GEMM whose C/D are fp32,
    # added in torch 2.8 and implemented for CUDA only.
    return device.type == "cuda" and TORCH_VERSION >= (2, 8)


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    beta = 0.0 if first else 1.0  # beta = 0: the GEMM ignores acc's contents (even NaN)
    if acc.dtype == a.dtype:
        if first:
            torch.mm(a, b, out=acc)
        else:
            torch.addmm(acc, a, b, out=acc)
    elif acc.dtype == torch.float32 and fp32_output_gemm_supported(acc.device):
        torch.addmm(acc, a, b, beta=beta, out_dtype=torch.float32, out=acc)
    else:
        # CPU (or an old torch): upcast the chunk operands, which is exact and small.
        torch.addmm(acc, a.to(acc.dtype), b.to(acc.dtype), beta=beta, out=acc)


def accumulate_product(
    acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool, vocabulary: VocabularyAxis | None = None
) -> None:
    """acc += a @ b (acc = a @ b when ``first``: the accumulator starts uninitialised, so
    neither a memset nor a read of it is paid), in acc's dtype, with no parameter-sized
    temporary. ``vocabulary``: which extent is the vocabulary, split where it is unaligned
    (``vocabulary_main_extent``): acc's rows or columns into two GEMMs over disjoint parts
    of acc; the reduction into the tail's product first and the main part's added to it
    inside its GEMM (one more rounding of acc in its dtype, of a sum of at most 7 terms)."""
    if vocabulary is None:
        _accumulate(acc, a, b, first)
        return
    vocab = a.shape[1] if vocabulary == "reduction" else acc.shape[0 if vocabulary == "rows" else 1]
    main = vocabulary_main_extent(vocab, a.dtype)
    if main == vocab:
        _accumulate(acc, a, b, first)
    elif vocabulary == "rows":
        _accumulate(acc[:main], a[:main], b, first)
        _accumulate(acc[main:], a[main:], b, first)
    elif vocabulary == "columns":
        _accumulate(acc[:, :main], a, b[:, :main], first)
        _accumulate(acc[:, main:], a, b[:, main:], first)
    else:
        _accumulate(acc, a[:, main:], b[main:], first)
        _accumulate(acc, a[:, :main], b[:main], False)


def logits_product(
    out: torch.Tensor | None,  # (C, V) or None: a new tensor
    x: torch.Tensor,  # (C, H)
    w_t: torch.Tensor,  # (H, V)
    b: torch.Tensor | None,  # (V,)
) -> torch.Tensor:
    """``out = x @ w_t + b`` (the bias added inside the GEMM: one rounding), in two GEMMs
    over disjoint columns where V is unaligned (``vocabulary_main_extent``; the drivers
    then always give ``out``: a buffer with aligned rows). An fp32 ``out`` of 16-bit
    operands gets the GEMM's fp32 sums unrounded (``_fp32_logits``)."""
    if out is None:
        return torch.mm(x, w_t) if b is None else torch.addmm(b, x, w_t)
    vocab = w_t.shape[1]
    main = vocabulary_main_extent(vocab, x.dtype)
    same_dtype = out.dtype == x.dtype
    if same_dtype and main == vocab:  # the common case, without a call more (host time per call)
        return torch.mm(x, w_t, out=out) if b is None else _biased_logits(out, x, w_t, b)
    product = _logits if same_dtype else _fp32_logits
    if main == vocab:
        return product(out, x, w_t, b)
    for part in (slice(0, main), slice(main, vocab)):
        product(out[:, part], x, w_t[:, part], None if b is None else b[part])
    return out


def _logits(out: torch.Tensor, x: torch.Tensor, w_t: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.mm(x, w_t, out=out) if b is None else _biased_logits(out, x, w_t, b)


# A biased product into padded rows is written through contiguous row slabs of at most
# this many bytes (``_biased_logits``): a small bounded temporary, outside the budgets.
BIASED_SLAB_BYTES = 32 * 2**20
# Slabs of more rows than this take a multiple of it: the GEMMs' row tiles (128 on Hopper)
# then have no partial tile in any slab but the last.
BIASED_SLAB_ROW_MULTIPLE = 128


def _biased_logits(
    out: torch.Tensor,  # (C, V) x's dtype, unit stride along V; rows maybe padded (logits_row_stride)
    x: torch.Tensor,  # (C, H)
    w_t: torch.Tensor,  # (H, V)
    b: torch.Tensor,  # (V,) x's dtype
) -> torch.Tensor:
    """``out = x @ w_t + b`` rounded once, as ``F.linear`` rounds it. cuBLAS adds a bias
    before its one rounding only in the epilogue of a GEMM writing a contiguous output;
    into any other (rows padded to ``LOGITS_ROW_ALIGNMENT``, a column range) CUDA's addmm
    copies the bias into ``out`` and runs the GEMM with beta = 1, which rounds the product
    to fp16/bf16 before adding it, with or without reduced-precision reductions. Measured
    on an H100 (N = 4096, H = 16, a bias of scale 4, against float64): the logits' error
    2.67e-4 against F.linear's 2.07e-4 in fp16 (2.14e-3 against 1.66e-3 in bf16) at
    V = 1000, and equal at V = 32000 (rows unpadded); under fp16 autocast with label
    smoothing, dX, dW and db had 1.2x, 1.7x and 1.8x eager's error. Such an ``out`` is
    written from contiguous row slabs (``_biased_logits_in_row_slabs``), which cost a pass
    over the logits; the drivers' buffers of a biased product have unpadded rows wherever
    V allows (``flce.driver.sizing.logits_row_stride``), so that this path is left to an
    unaligned vocabulary or vocabulary block (GPT-2's 50257)."""
    if out.is_cuda and not out.is_contiguous():
        return _biased_logits_in_row_slabs(out, x, w_t, b)
    return torch.addmm(b, x, w_t, out=out)


def _biased_logits_in_row_slabs(
    out: torch.Tensor,  # (C, V)
    x: torch.Tensor,  # (C, H)
    w_t: torch.Tensor,  # (H, V)
    b: torch.Tensor,  # (V,)
    slab_bytes: int = BIASED_SLAB_BYTES,
) -> torch.Tensor:
    """``out = x @ w_t + b``, each slab of rows computed into a new contiguous tensor (the
    GEMM's bias epilogue) and copied into ``out``: one more pass over the logits."""
    rows = max(1, slab_bytes // max(1, out.shape[1] * out.element_size()))
    if rows > BIASED_SLAB_ROW_MULTIPLE:
        rows -= rows % BIASED_SLAB_ROW_MULTIPLE
    for start in range(0, out.shape[0], rows):
        out[start : start + rows].copy_(torch.addmm(b, x[start : start + rows], w_t))
    return out


def _fp32_logits(
    out: torch.Tensor,  # (C, V) fp32, unit stride along V
    x: torch.Tensor,  # (C, H) bf16/fp16
    w_t: torch.Tensor,  # (H, V) x's dtype
    b: torch.Tensor | None,  # (V,)
) -> torch.Tensor:
    """``out = x @ w_t + b`` in fp32 from 16-bit operands, never rounded to their dtype: a
    product of two bf16 (or fp16) values is exact in fp32 and the GEMM sums in fp32, so
    these are the logits of the fp32 GEMM of the same operands. Where a divergence of two
    nearly equal distributions is computed, 16-bit logits' rounding (2^-9 of each logit
    in bf16) would swamp their difference. On CUDA the GEMM writes fp32 itself
    (``fp32_output_gemm_supported``); elsewhere (a CPU: the tests of this path) the
    operands are cast up first, which is exact."""
    if fp32_output_gemm_supported(out.device):
        torch.mm(x, w_t, out_dtype=torch.float32, out=out)
    else:
        torch.mm(x.float(), w_t.float(), out=out)
    if b is not None:
        out.add_(b)  # b's values are exact in fp32: one rounding, as inside the GEMM
    return out


def accumulate_column_sums(acc: torch.Tensor, a: torch.Tensor, first: bool) -> None:
    """acc += a.sum(dim=0) (acc = ... when ``first``): db's fp32 sum over a chunk's rows of
    dL/dlogits, ``acc`` (V,) fp32, ``a`` (C, V) bf16/fp16/fp32.

    On CUDA it is the product ``ones(1, C) @ a`` with an fp32 output, one read of ``a``
    with fp32 accumulation: PyTorch's column reduction of a row-major ``(C, V)`` bf16 matrix
    stages its partial sums in a workspace, 0.49 GiB at C = 8192, V = 128256, which raised
    a reference-shape call's peak by as much; the product takes the same time there
    (measured on an H200, ``benchmarks/results/features-h200``)."""
    if a.dtype != torch.float32 and fp32_output_gemm_supported(a.device):
        ones = torch.ones(1, a.shape[0], dtype=a.dtype, device=a.device)  # exact in any dtype
        with full_precision_reductions():
            accumulate_product(acc.view(1, -1), ones, a, first, vocabulary="columns")
    elif first:
        torch.sum(a, dim=0, dtype=torch.float32, out=acc)
    else:
        acc += a.sum(dim=0, dtype=torch.float32)
