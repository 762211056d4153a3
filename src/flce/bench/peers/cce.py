"""Apple's Cut Cross-Entropy (``cut-cross-entropy``): logits recomputed in its backward."""

from __future__ import annotations

from flce.bench.cases import BenchCase, Inputs
from flce.bench.methods import LossFn, Method
from flce.bench.peers.optional import first_reason, needs_cuda, optional_import, unsupported_features

CCE = "cut_cross_entropy"


def _check(case: BenchCase) -> str | None:
    return first_reason(
        lambda: optional_import(CCE)[1],
        lambda: needs_cuda(case),
        # Of the features, cut-cross-entropy 25.1.1 (PyPI) takes the softcap alone.
        lambda: unsupported_features(case, ("softcap",), "CCE"),
    )


def _make(case: BenchCase, inputs: Inputs) -> LossFn:
    fn = optional_import(CCE)[0].linear_cross_entropy
    settings = case.loss
    return lambda: fn(
        inputs.x,
        inputs.w,
        inputs.target,
        ignore_index=settings.ignore_index,
        softcap=settings.softcap,
        reduction=settings.reduction,
    )


def cce_methods() -> list[Method]:
    return [Method("cce", "Apple CCE", "cce", _check, _make)]
