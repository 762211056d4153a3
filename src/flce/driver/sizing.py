"""Chunk sizing: how many token rows' logits a chunk holds, and the peak memory that implies.

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
"""

from __future__ import annotations

import math
import os

import torch

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
