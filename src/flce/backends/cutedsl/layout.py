"""How the cutedsl row kernels read a row of logits: in vectors of ``vec`` elements.

Plain torch (no ``cutlass``), so the rule can be checked on any machine.

A vector is one load of at most 16 bytes, aligned to its own size, so ``vec`` must divide
the row stride and the base address. It need not divide V: where the row's memory extends
to V rounded up to ``vec`` (the driver's logits buffers have rows ``logits_row_stride(V)``
elements apart, a multiple of 64), the last vector of a row is *ragged*. The kernels read
it whole, use only its first ``V mod vec`` elements, and write only those
(``flce.backends.cutedsl.common.RowStream``). Without that, an odd vocabulary such as
GPT-2's 50257 would be read one 2-byte element at a time, with no ``cp.async``.
"""

from __future__ import annotations

import torch

MAX_VECTOR_BYTES = 16  # the widest load and cp.async copy


def padded_row_end_is_readable(logits: torch.Tensor, vec: int) -> bool:
    """Whether the last row of ``logits`` (M, V), read up to V rounded up to ``vec``, stays
    inside the tensor's storage. The rows before it do when the row stride is a multiple
    of ``vec`` (it is at least V, so at least V rounded up)."""
    rows, vocab = logits.shape
    padded = -(-vocab // vec) * vec
    end = logits.storage_offset() + (rows - 1) * logits.stride(0) + padded  # elements
    return end * logits.element_size() <= logits.untyped_storage().nbytes()


def row_vector_width(logits: torch.Tensor) -> int:
    """The widest power-of-two vector (at most 16 bytes) that divides the row stride (of
    more than one row) and the base address of ``logits`` (M, V) and, when it does not
    divide V, whose rounding up of the last row stays inside the tensor's memory
    (``padded_row_end_is_readable``)."""
    rows, vocab = logits.shape
    stride = logits.stride(0)
    element = logits.data_ptr() // logits.element_size()

    def fits(vec: int) -> bool:
        if (rows > 1 and stride % vec) or element % vec:
            return False
        return vocab % vec == 0 or padded_row_end_is_readable(logits, vec)

    vec = MAX_VECTOR_BYTES // logits.element_size()
    while vec > 1 and not fits(vec):
        vec //= 2
    return vec
