"""Liger-Kernel's fused linear cross-entropy: its Triton FLCE and its CuTe DSL SM90 kernel.

(Its cross-entropy kernels on given logits are adapted in ``flce.bench.ce_kernel``.)
"""

from __future__ import annotations

import inspect

import torch

from flce.bench.cases import FLAG_KEYWORDS, BenchCase, Inputs
from flce.bench.methods import LossFn, Method, as_loss
from flce.bench.peers.optional import first_reason, needs_cuda, optional_import, unsupported_features

LIGER_FUNCTIONAL = "liger_kernel.transformers.functional"
LIGER_SM90 = "liger_kernel.ops.cutedsl.ops.fused_linear_cross_entropy_sm90"
# Tile sizes of Liger's SM90 kernel, which rejects other multiples.
LIGER_SM90_TILE_M = 128
LIGER_SM90_TILE_N = 256

# Features every Liger Triton FLCE release the benchmark supports takes (the scalar options,
# class weights, bias). The flag features (FLAG_KEYWORDS) are newer: 0.8.5 takes all three,
# and an older release is skipped for those its signature lacks.
LIGER_TRITON_FEATURES = ("label_smoothing", "z_loss", "softcap", "weights", "bias")


def _triton_features() -> tuple[str, ...]:
    """The features this Liger's ``liger_fused_linear_cross_entropy`` takes, read from its signature."""
    params = inspect.signature(optional_import(LIGER_FUNCTIONAL)[0].liger_fused_linear_cross_entropy).parameters
    return (*LIGER_TRITON_FEATURES, *(f for f, keyword in FLAG_KEYWORDS.items() if keyword in params))


def _triton_check(case: BenchCase) -> str | None:
    return first_reason(
        lambda: optional_import(LIGER_FUNCTIONAL)[1],
        lambda: needs_cuda(case),
        lambda: unsupported_features(case, _triton_features(), "Liger Triton FLCE"),
    )


def _triton_make(case: BenchCase, inputs: Inputs) -> LossFn:
    fn = optional_import(LIGER_FUNCTIONAL)[0].liger_fused_linear_cross_entropy
    settings = case.loss
    return lambda: as_loss(
        fn(
            inputs.x,
            inputs.w,
            inputs.target,
            bias=inputs.bias,
            ce_weight=inputs.ce_weight,
            ignore_index=settings.ignore_index,
            lse_square_scale=settings.lse_square_scale,
            label_smoothing=settings.label_smoothing,
            reduction=settings.reduction,
            softcap=settings.softcap,
            **settings.flags(),
        )
    )


def _sm90_shape_check(case: BenchCase) -> str | None:
    if torch.cuda.get_device_capability(case.device) != (9, 0):
        return "needs compute capability 9.0 (Hopper)"
    if case.dtype != torch.bfloat16:
        return "bf16 only"
    if case.loss.reduction not in ("mean", "sum"):
        return "reduction mean/sum only"
    if case.shape.v % LIGER_SM90_TILE_N:
        return f"V={case.shape.v} is not a multiple of {LIGER_SM90_TILE_N}"
    if case.shape.n % LIGER_SM90_TILE_M:
        return f"N={case.shape.n} is not a multiple of {LIGER_SM90_TILE_M}"
    return None


def _sm90_check(case: BenchCase) -> str | None:
    return first_reason(
        lambda: optional_import(LIGER_SM90)[1],
        lambda: needs_cuda(case),
        lambda: unsupported_features(case, (), "Liger CuTe SM90 FLCE"),
        lambda: _sm90_shape_check(case),
    )


def _sm90_make(case: BenchCase, inputs: Inputs) -> LossFn:
    fn = optional_import(LIGER_SM90)[0].liger_fused_linear_cross_entropy_sm90
    settings = case.loss
    return lambda: fn(inputs.x, inputs.w, inputs.target, settings.ignore_index, settings.reduction)


def liger_methods() -> list[Method]:
    return [
        Method("liger:triton", "Liger Triton FLCE", "liger", _triton_check, _triton_make),
        Method("liger:cute-sm90", "Liger CuTe SM90 FLCE", "liger", _sm90_check, _sm90_make),
    ]
