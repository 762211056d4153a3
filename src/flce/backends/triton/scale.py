"""In-place gradient rescale by the upstream gradient, skipped on the device when it is 1.

The fused loss computes its gradients during the forward, for an upstream gradient of
1, so the backward must multiply them by ``grad_loss``. That multiply reads and writes
dW and dX (1.1 GiB at N=8192, H=4096, V=128256 in bf16: 1.5 ms on an H200) although
``loss.backward()`` almost always passes exactly 1. Checking that on the host would
cost a device sync (and break CUDA-graph capture), so each program reads the scale
itself and returns at once when it is 1: the skip costs one small launch.

One launch scales up to ``TENSORS_PER_LAUNCH`` tensors (dX, dW and db: every gradient
of a call), of any dtypes: each pointer's element type is part of the compiled kernel's
signature, so a mix of dtypes is one more compiled variant, not one more launch. A
launch costs more host time than the skip saves GPU time, hence one for all.

``scaled_copies`` is the out-of-place twin, for gradients the caller must not modify (a
CUDA graph's outputs, a custom op's saved ones): new tensors, the copy being the
scaling's pass, in one launch too.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import torch
import triton
import triton.language as tl

from flce.backends.triton.common import fp32_to_bf16_rtne
from flce.backends.triton.launch import launch

BLOCK = 4096  # elements per program step: 8 KiB of bf16, 16 B per thread at 4 warps x 32 x 4
PROGRAMS_PER_SM = 8  # a grid-stride loop over enough programs to fill the GPU, no more
TENSORS_PER_LAUNCH = 3  # the pointer slots of the kernel: dX, dW, db


@triton.jit
def _scale_into(
    source_ptr,  # (n,) contiguous, bf16 / fp16 / fp32
    out_ptr,  # (n,) contiguous, the source's dtype: the source itself to scale in place
    n,
    scale,  # fp32
    BLOCK: tl.constexpr,
    BF16_ROUND_BY_BITS: tl.constexpr,  # interpreter only: see fp32_to_bf16_rtne
):
    """This program's blocks of ``out = source * scale`` (every ``num_programs``-th), the
    product in fp32 rounded once to nearest even."""
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    start = tl.program_id(0).to(tl.int64) * BLOCK
    for block_start in tl.range(start, n, step):
        offsets = block_start + tl.arange(0, BLOCK)
        mask = offsets < n
        values = tl.load(source_ptr + offsets, mask=mask)
        product = values.to(tl.float32) * scale
        scaled = product.to(values.dtype)
        if BF16_ROUND_BY_BITS:
            if values.dtype == tl.bfloat16:
                scaled = fp32_to_bf16_rtne(product)
        tl.store(out_ptr + offsets, scaled, mask=mask)


@triton.jit
def _scale_unless_one_kernel(
    a_ptr,  # (a_n,) contiguous, bf16 / fp16 / fp32, scaled in place
    a_n,
    b_ptr,  # (b_n,) contiguous, any of those dtypes; b_n = 0 for an unused slot
    b_n,
    c_ptr,  # (c_n,) likewise
    c_n,
    scale_ptr,  # () fp32 upstream gradient
    BLOCK: tl.constexpr,
    BF16_ROUND_BY_BITS: tl.constexpr,
):
    scale = tl.load(scale_ptr)
    if scale != 1.0:  # NaN and Inf scales are applied (NaN != 1.0)
        # Each program strides over every tensor in turn: at most one block more than
        # another program per tensor, with no table of where each tensor's blocks start.
        _scale_into(a_ptr, a_ptr, a_n, scale, BLOCK, BF16_ROUND_BY_BITS)
        _scale_into(b_ptr, b_ptr, b_n, scale, BLOCK, BF16_ROUND_BY_BITS)
        _scale_into(c_ptr, c_ptr, c_n, scale, BLOCK, BF16_ROUND_BY_BITS)


@triton.jit
def _scaled_copies_kernel(
    a_ptr,  # (a_n,) contiguous, bf16 / fp16 / fp32, read only
    a_out_ptr,  # (a_n,) contiguous, a's dtype: a * scale
    a_n,
    b_ptr,  # (b_n,) likewise; b_n = 0 for an unused slot
    b_out_ptr,
    b_n,
    c_ptr,  # (c_n,) likewise
    c_out_ptr,
    c_n,
    scale_ptr,  # () fp32 upstream gradient
    BLOCK: tl.constexpr,
    BF16_ROUND_BY_BITS: tl.constexpr,
):
    scale = tl.load(scale_ptr)  # applied even when it is 1: the outputs are new tensors
    _scale_into(a_ptr, a_out_ptr, a_n, scale, BLOCK, BF16_ROUND_BY_BITS)
    _scale_into(b_ptr, b_out_ptr, b_n, scale, BLOCK, BF16_ROUND_BY_BITS)
    _scale_into(c_ptr, c_out_ptr, c_n, scale, BLOCK, BF16_ROUND_BY_BITS)


@cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _program_count(device: torch.device, blocks: int) -> int:
    """Programs of a launch whose largest tensor has ``blocks`` blocks."""
    if device.type != "cuda":  # the interpreter: one program per block is simplest
        return max(1, blocks)
    return max(1, min(blocks, _multiprocessors(device) * PROGRAMS_PER_SM))


def _fp32_scalar(scale: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``scale`` as the kernels read it: a 0-dim fp32 tensor on ``device``, detached (each
    step only when needed: each op costs host time in the backward)."""
    if scale.requires_grad:
        scale = scale.detach()
    if scale.dim() != 0:
        scale = scale.reshape(())
    # A dispatched op even where it changes nothing: only when it does.
    return scale if scale.dtype == torch.float32 and scale.device == device else scale.to(device, torch.float32)


def scaled_copies(tensors: Sequence[torch.Tensor], scale: torch.Tensor) -> list[torch.Tensor]:
    """``t * scale`` for each of ``tensors``, new contiguous tensors (the product in fp32,
    rounded once): one launch per ``TENSORS_PER_LAUNCH`` tensors. Each tensor contiguous,
    all on one device; ``scale`` a 0-dim tensor. The out-of-place twin of
    ``scale_unless_one_``, for gradients the caller must not modify (a graph's outputs, a
    custom op's saved ones): the copy is the scaling's pass."""
    for values in tensors:
        if not values.is_contiguous():
            raise ValueError("scaled_copies: every tensor must be contiguous")
    outputs = [torch.empty_like(values) for values in tensors]
    present = [(values, out) for values, out in zip(tensors, outputs, strict=True) if values.numel()]
    if not present:
        return outputs
    device = present[0][0].device
    scale32 = _fp32_scalar(scale, device)
    for first in range(0, len(present), TENSORS_PER_LAUNCH):
        group = present[first : first + TENSORS_PER_LAUNCH]
        largest = max(values.numel() for values, _ in group)
        blocks = (largest + BLOCK - 1) // BLOCK
        launch(
            _scaled_copies_kernel,
            (_program_count(device, blocks),),
            (*_flat_slots(group), scale32),
            dict(BLOCK=BLOCK, BF16_ROUND_BY_BITS=device.type == "cpu"),
            num_warps=4,
            device=device,
        )
    return outputs


def _flat_slots(group: list) -> tuple:
    """``(source, out, n)`` per slot of ``_scaled_copies_kernel``; an unused slot repeats
    the first pair with n = 0."""
    first_source, first_out = group[0]
    slots = [(source, out, source.numel()) for source, out in group]
    slots += [(first_source, first_out, 0)] * (TENSORS_PER_LAUNCH - len(group))
    return tuple(item for slot in slots for item in slot)


def scale_unless_one_(tensors: Sequence[torch.Tensor], scale: torch.Tensor) -> None:
    """``t *= scale`` in place for each of ``tensors`` (the product in fp32, rounded once),
    skipped on the device when ``scale`` is exactly 1: one launch per
    ``TENSORS_PER_LAUNCH`` tensors. Each tensor contiguous, all on one device; ``scale``
    a 0-dim tensor."""
    for values in tensors:
        if not values.is_contiguous():
            raise ValueError("scale_unless_one_: every tensor must be contiguous")
    present = [values for values in tensors if values.numel()]
    if not present:
        return
    device = present[0].device
    scale32 = _fp32_scalar(scale, device)
    for first in range(0, len(present), TENSORS_PER_LAUNCH):
        group = present[first : first + TENSORS_PER_LAUNCH]
        # An unused slot gets a real pointer (never read: its size is 0).
        slots = [(values, values.numel()) for values in group]
        slots += [(group[0], 0)] * (TENSORS_PER_LAUNCH - len(group))
        largest = max(n for _, n in slots)
        blocks = (largest + BLOCK - 1) // BLOCK  # the largest tensor's, one per program (not triton.cdiv: 5 calls)
        (a, a_n), (b, b_n), (c, c_n) = slots
        launch(
            _scale_unless_one_kernel,
            (_program_count(device, blocks),),
            (a, a_n, b, b_n, c, c_n, scale32),
            dict(BLOCK=BLOCK, BF16_ROUND_BY_BITS=device.type == "cpu"),
            num_warps=4,
            device=device,
        )
