"""The vector width of the cutedsl row kernels (``flce.backends.cutedsl.layout``): plain
torch, checked on any machine. The kernels' results with each width are checked on the GPU
(``test_cutedsl_ce.py``, ``test_cutedsl_partial.py``)."""

from __future__ import annotations

import pytest
import torch

from flce.backends.cutedsl.layout import padded_row_end_is_readable, row_vector_width
from flce.driver.chunks import logits_buffer, logits_tile
from flce.driver.sizing import logits_row_stride

WIDEST = {torch.float32: 4, torch.bfloat16: 8, torch.float16: 8}  # 16 bytes


@pytest.mark.parametrize("dtype", list(WIDEST), ids=str)
@pytest.mark.parametrize("vocab", [1, 7, 1001, 32000, 32001, 50257, 128256])
def test_driver_buffers_get_16_byte_vectors_at_any_vocabulary(dtype, vocab):
    """The driver's logits rows are ``logits_row_stride(V)`` apart (a multiple of 64), so
    even an odd V is read in 16-byte vectors (the last one ragged), in every chunk of a
    reused flat buffer too."""
    assert row_vector_width(logits_buffer(3, vocab, dtype, torch.device("cpu"))) == WIDEST[dtype]
    flat = torch.empty(5 * logits_row_stride(vocab), dtype=dtype)
    assert row_vector_width(logits_tile(flat, 2, vocab)) == WIDEST[dtype]
    assert row_vector_width(logits_tile(flat, 1, vocab)) == WIDEST[dtype]


@pytest.mark.parametrize("dtype", list(WIDEST), ids=str)
def test_contiguous_rows_keep_the_width_that_divides_v(dtype):
    """Rows V apart: the vector divides the row stride, so V itself."""
    assert row_vector_width(torch.empty(4, 32000, dtype=dtype)) == WIDEST[dtype]
    assert row_vector_width(torch.empty(4, 50257, dtype=dtype)) == 1
    assert row_vector_width(torch.empty(4, 50260, dtype=dtype)) == 4
    assert row_vector_width(torch.empty(4, 50258, dtype=dtype)) == 2
    # One row: no stride, but nothing past V to read either.
    assert row_vector_width(torch.empty(1, 50257, dtype=dtype)) == 1


def test_the_last_row_never_reads_past_the_storage():
    """A ragged last vector is read whole: the last row's V rounded up must be memory of
    the tensor. Rows 64 apart whose storage ends at the last row's V get only a width
    that divides V."""
    vocab, stride, rows = 50, 64, 3
    flat = torch.empty((rows - 1) * stride + vocab, dtype=torch.bfloat16)
    tight = flat.as_strided((rows, vocab), (stride, 1))
    assert not padded_row_end_is_readable(tight, 8) and padded_row_end_is_readable(tight, 2)
    assert row_vector_width(tight) == 2
    roomy = torch.empty((rows - 1) * stride + 56, dtype=torch.bfloat16).as_strided((rows, vocab), (stride, 1))
    assert row_vector_width(roomy) == 8


def test_alignment_of_the_stride_and_the_base():
    base = torch.empty(4 * 64 + 8, dtype=torch.bfloat16)
    assert row_vector_width(base[:256].view(4, 64)[:, :50]) == 8
    assert row_vector_width(base[1:257].view(4, 64)[:, :50]) == 1  # base 2 bytes past 16
    assert row_vector_width(base[4:260].view(4, 64)[:, :50]) == 4  # base 8 bytes past 16
    assert row_vector_width(base[: 4 * 60].view(4, 60)[:, :50]) == 4  # stride 120 bytes
