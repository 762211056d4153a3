"""What one benchmark measurement runs: the shape, the dtype, the mode, the loss settings,
and the inputs every method shares.

The names say ``Bench`` where the library has a namesake: ``BenchLossSettings`` holds the
``--features`` switches (class weights and the bias as on/off, the library's tensors
being drawn here), not ``flce.options.LossOptions``; ``BenchCase`` is one benchmark cell,
not a parity case of ``flce.testing``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

MODES = ("fwd", "bwd", "full")
FEATURES = ("label_smoothing", "z_loss", "softcap", "weights", "bias", "token_scaling", "accuracy", "predicted")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Feature values: typical of LLM training recipes (Gemma-2 softcap 30, PaLM z-loss 1e-4).
LABEL_SMOOTHING = 0.1
LSE_SQUARE_SCALE = 1e-4
SOFTCAP = 30.0
# The LM-head bias of ``--features bias``: N(0, BIAS_STD²), small next to the logits' unit
# spread, so that the rows stay as peaked at the target as without it.
BIAS_STD = 0.1

# The features that are flags of flce's call, by the keyword flce and Liger's FLCE share
# (also the field of ``BenchLossSettings`` that holds each).
FLAG_KEYWORDS = {
    "token_scaling": "use_token_scaling",
    "accuracy": "return_token_accuracy",
    "predicted": "return_predicted_tokens",
}

# GEMM multiply-adds per mode, in units of N*V*H (2 flops each): logits; dX + dW; all three.
FLOPS_PER_NVH = {"fwd": 2, "bwd": 4, "full": 6}


def dtype_name(dtype: torch.dtype) -> str:
    """The ``--dtype`` name of ``dtype`` (bf16, fp16, fp32)."""
    return next(k for k, v in DTYPES.items() if v == dtype)


@dataclass(frozen=True)
class Shape:
    """Tokens N, vocabulary V, hidden H of one LM-head problem."""

    n: int
    v: int
    h: int

    def flops(self, mode: str) -> int:
        """GEMM flops the mode cannot avoid (6NVH full, 2NVH fwd, 4NVH bwd)."""
        return FLOPS_PER_NVH[mode] * self.n * self.v * self.h

    def label(self) -> str:
        return f"N={self.n} V={self.v} H={self.h}"


@dataclass(frozen=True)
class BenchLossSettings:
    """Loss settings shared by every method of a run (turned on by ``--features``)."""

    reduction: str = "mean"
    ignore_index: int = -100
    label_smoothing: float = 0.0
    lse_square_scale: float = 0.0
    softcap: float | None = None
    use_weights: bool = False
    use_bias: bool = False
    use_token_scaling: bool = False
    return_token_accuracy: bool = False
    return_predicted_tokens: bool = False

    @classmethod
    def from_features(cls, features: Sequence[str], reduction: str = "mean") -> BenchLossSettings:
        unknown = sorted(set(features) - set(FEATURES))
        if unknown:
            raise ValueError(f"unknown feature(s) {unknown}; choose among {list(FEATURES)}")
        return cls(
            reduction=reduction,
            label_smoothing=LABEL_SMOOTHING if "label_smoothing" in features else 0.0,
            lse_square_scale=LSE_SQUARE_SCALE if "z_loss" in features else 0.0,
            softcap=SOFTCAP if "softcap" in features else None,
            use_weights="weights" in features,
            use_bias="bias" in features,
            use_token_scaling="token_scaling" in features,
            return_token_accuracy="accuracy" in features,
            return_predicted_tokens="predicted" in features,
        )

    def enabled(self) -> tuple[str, ...]:
        """The features that are on, by their ``--features`` names, in ``FEATURES`` order."""
        on = {
            "label_smoothing": self.label_smoothing != 0.0,
            "z_loss": self.lse_square_scale != 0.0,
            "softcap": self.softcap is not None,
            "weights": self.use_weights,
            "bias": self.use_bias,
            "token_scaling": self.use_token_scaling,
            "accuracy": self.return_token_accuracy,
            "predicted": self.return_predicted_tokens,
        }
        return tuple(name for name in FEATURES if on[name])

    @property
    def returns_extras(self) -> bool:
        """Whether the call also returns per-token outputs (accuracy, predicted tokens)."""
        return self.return_token_accuracy or self.return_predicted_tokens

    def flags(self) -> dict[str, bool]:
        """The flag features that are on, as keyword arguments (``use_token_scaling=True``, ...):
        only those, so that a peer whose release lacks a keyword is called as before."""
        return {keyword: True for feature, keyword in FLAG_KEYWORDS.items() if feature in self.enabled()}

    def record(self) -> dict[str, Any]:
        """The settings as the results JSON records them (``config.loss_options``): the
        library's keyword names, class weights and bias as on/off."""
        return {
            "reduction": self.reduction,
            "ignore_index": self.ignore_index,
            "label_smoothing": self.label_smoothing,
            "lse_square_scale": self.lse_square_scale,
            "softcap": self.softcap,
            "ce_weight": self.use_weights,
            "bias": self.use_bias,
            "use_token_scaling": self.use_token_scaling,
            "return_token_accuracy": self.return_token_accuracy,
            "return_predicted_tokens": self.return_predicted_tokens,
        }


@dataclass(frozen=True)
class BenchCase:
    """What one measurement runs: a shape, a dtype, a mode and the loss settings."""

    shape: Shape
    dtype: torch.dtype
    mode: str
    loss: BenchLossSettings
    device: torch.device
    # Captured once in a CUDA graph and timed as replays (``--graph``).
    graph: bool = False


@dataclass
class Inputs:
    """Tensors shared by all methods at one shape (allocated once, before timing)."""

    x: torch.Tensor  # (N, H) in the case's dtype
    w: torch.Tensor  # (V, H) in the case's dtype
    target: torch.Tensor  # (N,) int64
    ce_weight: torch.Tensor | None  # (V,) fp32
    bias: torch.Tensor | None = None  # (V,) in the dtype of w, a parameter like it

    def params(self) -> tuple[torch.Tensor, ...]:
        """The tensors a backward gives gradients: X, W and the bias when there is one."""
        return (self.x, self.w) if self.bias is None else (self.x, self.w, self.bias)


def make_inputs(case: BenchCase, seed: int = 0, ignore_fraction: float = 0.0) -> Inputs:
    """Random inputs whose softmax is peaked at the target on most rows.

    W has rows of unit norm on average, so plain logits are ~N(0, 1); each row of
    X gets ``a * W[target]`` added, with ``a`` uniform in [0, 1.5 ln V], which lifts
    the target logit by ``a``: rows range from flat to confidently right, as in a
    trained model, and nothing is zero. The bias (``--features bias``) is drawn last, so
    the other tensors are the same with it or without it.
    """
    n, v, h = case.shape.n, case.shape.v, case.shape.h
    gen = torch.Generator(device=case.device).manual_seed(seed)
    kw: dict[str, Any] = {"device": case.device, "generator": gen}
    w = torch.randn(v, h, dtype=torch.float32, **kw).div_(math.sqrt(h))
    target = torch.randint(0, v, (n,), dtype=torch.int64, **kw)
    lift = torch.rand(n, 1, dtype=torch.float32, **kw).mul_(1.5 * math.log(v))
    x = torch.randn(n, h, dtype=torch.float32, **kw).add_(w[target] * lift)
    del lift
    if ignore_fraction > 0.0:
        ignored = torch.rand(n, **kw) < ignore_fraction
        target = target.masked_fill(ignored, case.loss.ignore_index)
    ce_weight = None
    if case.loss.use_weights:
        ce_weight = torch.rand(v, dtype=torch.float32, **kw).add_(0.5)
    bias = None
    if case.loss.use_bias:
        bias = torch.randn(v, dtype=torch.float32, **kw).mul_(BIAS_STD)
    needs_grad = case.mode != "fwd"
    x = x.to(case.dtype).requires_grad_(needs_grad)
    w = w.to(case.dtype).requires_grad_(needs_grad)
    if bias is not None:
        bias = bias.to(case.dtype).requires_grad_(needs_grad)
    return Inputs(x=x, w=w, target=target, ce_weight=ce_weight, bias=bias)
