"""PyTorch's own chunked loss, ``torch.nn.functional.linear_cross_entropy`` (torch 2.13+)."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from flce.bench.cases import BenchCase, Inputs
from flce.bench.methods import LossFn, Method
from flce.bench.peers.optional import unsupported_features

# The bias keyword of ``F.linear_cross_entropy``.
TORCH_LCE_BIAS = "linear_bias"


def _check(case: BenchCase) -> str | None:
    fn = getattr(F, "linear_cross_entropy", None)
    if fn is None:
        return f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy"
    params = inspect.signature(fn).parameters
    if "options" not in params or not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        return "torch.nn.functional.linear_cross_entropy has no chunked path (options)"
    # Its chunked path falls back to materialized logits for label smoothing; it has no
    # softcap, z-loss or token scaling, and returns the loss alone. It takes a (V,) bias
    # where its signature has linear_bias (torch 2.13 does).
    supported = ("weights", "bias") if TORCH_LCE_BIAS in params else ("weights",)
    return unsupported_features(case, supported, "torch linear_cross_entropy (chunked)")


def _make(case: BenchCase, inputs: Inputs) -> LossFn:
    fn = F.linear_cross_entropy
    options = torch.nn.LinearCrossEntropyOptions()
    settings = case.loss
    # Passed only when there is one, so a torch without the keyword is called as before.
    bias = {} if inputs.bias is None else {TORCH_LCE_BIAS: inputs.bias}
    return lambda: fn(
        inputs.x,
        inputs.w,
        inputs.target,
        weight=inputs.ce_weight,
        reduction=settings.reduction,
        ignore_index=settings.ignore_index,
        options=options,
        **bias,
    )


def torch_lce_methods() -> list[Method]:
    return [Method("torch:lce", "torch linear_cross_entropy", "torch", _check, _make)]
