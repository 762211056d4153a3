"""The batch statistics of one loss call in one Triton launch (``flce.driver.statistics``).

What the drivers need before the first chunk (the count of valid rows, the mean's
divisors, the class-weight sum, the input checks) is a handful of reductions over the
target and the class weights. As PyTorch ops they are some twenty tiny launches, each
costing more host time than GPU time; here one program makes them all and writes the
ready-made kernel scales, so a call spends one launch on them and never reads them on
the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flce.backends.base import STATISTICS_LAYOUT, kernel_class_weights, kernel_target
from flce.backends.triton.launch import launch

BLOCK = 1024  # targets (or classes) per loop step of the one program


@triton.jit
def _batch_statistics_kernel(
    target_ptr,  # (N,) integer, contiguous
    weight_ptr,  # (V,) fp32 contiguous class weights (read only if HAS_WEIGHT)
    out_ptr,  # (13,) fp32, in the order of flce.backends.base.STATISTICS_LAYOUT
    N,
    V,
    ignore_index,
    HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offsets = tl.arange(0, BLOCK)
    valid_count = 0
    weighted = 0.0
    bad_targets = 0
    for start in range(0, N, BLOCK):
        index = start + offsets
        inside = index < N
        y = tl.load(target_ptr + index, mask=inside, other=0).to(tl.int64)
        valid = inside & (y != ignore_index)
        bad = valid & ((y < 0) | (y >= V))
        valid_count += tl.sum(valid.to(tl.int32), axis=0)
        bad_targets += tl.sum(bad.to(tl.int32), axis=0)
        if HAS_WEIGHT:
            # An out-of-range target is never read (its call is poisoned below).
            w_y = tl.load(weight_ptr + y, mask=valid & ~bad, other=0.0)
            weighted += tl.sum(w_y, axis=0)
    n_valid = valid_count.to(tl.float32)
    bad_weights = 0
    if HAS_WEIGHT:
        weight_sum = 0.0
        for start in range(0, V, BLOCK):
            index = start + offsets
            w = tl.load(weight_ptr + index, mask=index < V, other=0.0)
            weight_sum += tl.sum(w, axis=0)
            non_finite = (w != w) | (tl.abs(w) == float("inf"))
            bad_weights += tl.sum(((w < 0.0) | non_finite).to(tl.int32), axis=0)
        denominator = weighted
    else:
        weight_sum = V * 1.0
        denominator = n_valid
    poison = 1.0
    if bad_targets + bad_weights > 0:
        poison = float("nan")
    inv_valid = tl.where(n_valid > 0.0, 1.0 / tl.maximum(n_valid, 1e-30), 0.0)
    inv_denominator = tl.where(denominator > 0.0, 1.0 / tl.maximum(denominator, 1e-30), 0.0)
    tl.store(out_ptr + 0, n_valid)
    tl.store(out_ptr + 1, denominator)
    tl.store(out_ptr + 2, weight_sum)
    tl.store(out_ptr + 3, poison)
    tl.store(out_ptr + 4, inv_valid)
    tl.store(out_ptr + 5, inv_denominator * poison)  # the mean's scales
    tl.store(out_ptr + 6, inv_valid * poison)
    tl.store(out_ptr + 7, weight_sum)
    tl.store(out_ptr + 8, poison)  # sum's and none's
    tl.store(out_ptr + 9, poison)
    tl.store(out_ptr + 10, weight_sum)
    tl.store(out_ptr + 11, bad_targets.to(tl.float32))  # the checks' counts
    tl.store(out_ptr + 12, bad_weights.to(tl.float32))


def batch_statistics_values(
    target: torch.Tensor,  # (N,) integer
    ce_weight: torch.Tensor | None,  # (V,) float
    vocab: int,
    ignore_index: int,
) -> torch.Tensor:
    """-> (13,) fp32 (``STATISTICS_LAYOUT``) on the target's device, from one launch."""
    target = kernel_target(target)
    weight = kernel_class_weights(ce_weight)
    out = torch.empty(len(STATISTICS_LAYOUT), dtype=torch.float32, device=target.device)
    args = (target, out if weight is None else weight, out, target.numel(), vocab, int(ignore_index))
    launch(
        _batch_statistics_kernel,
        (1,),
        args,
        dict(HAS_WEIGHT=weight is not None, BLOCK=BLOCK),
        num_warps=4,
        device=target.device,
    )
    return out
