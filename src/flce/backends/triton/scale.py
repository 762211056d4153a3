"""In-place gradient rescale by the upstream gradient, skipped on the device when it is 1.

The fused loss computes its gradients during the forward, for an upstream gradient of
1, so the backward must multiply them by ``grad_loss``. That multiply reads and writes
dW and dX (1.1 GiB at N=8192, H=4096, V=128256 in bf16: 1.5 ms on an H200) although
``loss.backward()`` almost always passes exactly 1. Checking that on the host would
cost a device sync (and break CUDA-graph capture), so each program reads the scale
itself and returns at once when it is 1: the skip costs one small launch.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

BLOCK = 4096  # elements per program step: 8 KiB of bf16, 16 B per thread at 4 warps x 32 x 4
PROGRAMS_PER_SM = 8  # a grid-stride loop over enough programs to fill the GPU, no more


@triton.jit
def _scale_unless_one_kernel(
    values_ptr,  # (n,) contiguous, bf16 / fp16 / fp32, scaled in place
    scale_ptr,  # () fp32 upstream gradient
    n,
    BLOCK: tl.constexpr,
):
    scale = tl.load(scale_ptr)
    if scale != 1.0:  # NaN and Inf scales are applied (NaN != 1.0)
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        start = tl.program_id(0).to(tl.int64) * BLOCK
        for block_start in tl.range(start, n, step):
            offsets = block_start + tl.arange(0, BLOCK)
            mask = offsets < n
            values = tl.load(values_ptr + offsets, mask=mask)
            tl.store(values_ptr + offsets, (values.to(tl.float32) * scale).to(values.dtype), mask=mask)


@cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _program_count(device: torch.device, n: int) -> int:
    blocks = triton.cdiv(n, BLOCK)
    if device.type != "cuda":  # the interpreter: one program per block is simplest
        return max(1, blocks)
    return max(1, min(blocks, _multiprocessors(device) * PROGRAMS_PER_SM))


def scale_unless_one_(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``values *= scale`` in place (the product in fp32, rounded once), skipped on the
    device when ``scale`` is exactly 1. ``values`` contiguous; ``scale`` a 0-dim tensor."""
    if not values.is_contiguous():
        raise ValueError("scale_unless_one_: values must be contiguous")
    n = values.numel()
    if n == 0:
        return values
    # Each step only when needed: the backward calls this per gradient, and each op costs host time.
    if scale.requires_grad:
        scale = scale.detach()
    if scale.dim() != 0:
        scale = scale.reshape(())
    scale32 = scale.to(device=values.device, dtype=torch.float32)  # no op when it already is
    _scale_unless_one_kernel[(_program_count(values.device, n),)](values, scale32, n, BLOCK=BLOCK)
    return values
