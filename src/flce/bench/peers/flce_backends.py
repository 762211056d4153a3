"""flce's own backends as benchmark methods: the default call, chunk sizes, and the exact
low-memory mode (the vocabulary in blocks)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

import flce
from flce.bench.cases import BenchCase, BenchLossSettings, Inputs
from flce.bench.methods import CheckFn, LossFn, MakeLossFn, Method, as_loss
from flce.dispatch import BACKEND_NAMES, availability, get_backend
from flce.driver.chunks import GradRequest
from flce.driver.schemes import describe_call, scheme_for_call
from flce.driver.sizing import CallShape
from flce.options import LossOptions
from flce.plan import fused_statistics_apply, split_kernels_for

# Vocabulary blocks of the low-memory method. With every row in one chunk each dW block is
# written directly, so the extra memory is dW + dX (+ its fp32 accumulator) + one block of
# logits: 1/16 of them is 0.12 GiB at N=8192, V=128256, while each block GEMM
# (8016 columns x 8192 rows) stays large enough to run at full speed.
LOW_MEMORY_VOCAB_BLOCKS = 16


def flce_loss_kwargs(settings: BenchLossSettings, backend: str | None) -> dict[str, Any]:
    """Keyword arguments of the public flce functions (and of ``flce.options.LossOptions``)
    for the run's loss settings; the tensors (bias, class weights) are passed apart."""
    return {
        "ignore_index": settings.ignore_index,
        "lse_square_scale": settings.lse_square_scale,
        "label_smoothing": settings.label_smoothing,
        "reduction": settings.reduction,
        "softcap": settings.softcap,
        "use_token_scaling": settings.use_token_scaling,
        "return_token_accuracy": settings.return_token_accuracy,
        "return_predicted_tokens": settings.return_predicted_tokens,
        "backend": backend,
    }


def flce_loss_options(case: BenchCase, backend: str, **extra: Any) -> LossOptions:
    """The options of ``backend``'s call for ``case`` (``extra``: the method's own, such
    as ``vocab_chunk_size``)."""
    return LossOptions(**flce_loss_kwargs(case.loss, backend), **extra)


def flce_call_shape(case: BenchCase, backend: str, options: LossOptions | None = None) -> CallShape:
    """The ``CallShape`` the driver sees for ``case`` on ``backend``: the gradients of
    ``case.mode`` (none for a forward-only call)."""
    spec = get_backend(backend)
    options = flce_loss_options(case, backend) if options is None else options
    n, v, h = case.shape.n, case.shape.v, case.shape.h

    def stand_in(*size: int) -> torch.Tensor:
        # The chooser reads a tensor's shape, dtype and device only: one element, expanded.
        return torch.empty((), dtype=case.dtype, device=case.device).expand(*size)

    bias = stand_in(v) if case.loss.use_bias else None
    grads = case.mode != "fwd"
    request = GradRequest(input=grads, weight=grads, bias=grads and bias is not None)
    split_kernels = split_kernels_for(options, spec)  # as the plan takes them
    # The bench's weight is contiguous and freshly allocated (16-byte aligned).
    whole_rows = fused_statistics_apply(
        spec,
        options,
        case.dtype,
        case.device,
        h,
        v,
        has_ce_weight=case.loss.use_weights,
        weight_tma_ready=True,
        loss_only=False,
    )
    return describe_call(
        stand_in(n, h),
        stand_in(v, h),
        bias,
        request,
        options,
        case.dtype,
        spec,
        split_kernels,
        whole_row_statistics=spec.loss_only if whole_rows else None,
    )


def describe_scheme(backend: str, **extra: Any) -> Callable[[BenchCase], str]:
    """What flce runs for a case on ``backend`` (``Method.describe``): the fused loss-only
    GEMM where a forward-only call takes it, else the scheme its memory budget picks
    (``flce.driver.schemes``), as the driver decides them."""

    def describe(case: BenchCase) -> str:
        options = flce_loss_options(case, backend, **extra)
        spec, shape = get_backend(backend), case.shape
        # The bench's weight is contiguous and freshly allocated (16-byte aligned).
        if case.mode == "fwd" and fused_statistics_apply(
            spec,
            options,
            case.dtype,
            case.device,
            shape.h,
            shape.v,
            has_ce_weight=case.loss.use_weights,
            weight_tma_ready=True,
            loss_only=True,
        ):
            return "one fused GEMM: row statistics, no logits"
        scheme = scheme_for_call(flce_call_shape(case, backend, options), options, case.device)
        return scheme.describe(case.shape.n)

    return describe


def _check(backend: str) -> CheckFn:
    def check(case: BenchCase) -> str | None:
        ok, reason = availability(backend, case.device)
        return None if ok else f"backend {backend!r} unavailable: {reason}"

    return check


def _make(
    backend: str, chunk_size: int | None, vocab_blocks: int | None = None, memory_budget: int | None = None
) -> MakeLossFn:
    def make(case: BenchCase, inputs: Inputs) -> LossFn:
        kwargs: dict[str, Any] = {
            "bias": inputs.bias,
            "ce_weight": inputs.ce_weight,
            **flce_loss_kwargs(case.loss, backend),
        }
        if chunk_size is not None:
            kwargs["chunk_size"] = chunk_size
        if vocab_blocks is not None:
            kwargs["vocab_chunk_size"] = _block_width(inputs.w.shape[0], vocab_blocks)
        if memory_budget is not None:
            kwargs["memory_budget"] = memory_budget
        # Looked up on each call, so a test can wrap the public function.
        return lambda: as_loss(flce.fused_linear_cross_entropy(inputs.x, inputs.w, inputs.target, **kwargs))

    return make


def flce_methods(chunk_sizes: Sequence[int | None] = (None,)) -> list[Method]:
    """One method per flce backend and chunk size (None: the library's default), then each
    backend in the exact low-memory mode (``LOW_MEMORY_VOCAB_BLOCKS`` vocabulary blocks)."""
    methods = []
    for backend in BACKEND_NAMES:
        base = f"flce:{backend}"
        for chunk in chunk_sizes:
            methods.append(
                Method(
                    name=base if chunk is None else f"{base}[chunk={chunk}]",
                    label=f"flce {backend}" + ("" if chunk is None else f" (chunk {chunk})"),
                    family="flce",
                    check=_check(backend),
                    make_loss=_make(backend, chunk),
                    chunk_size=chunk,
                    base=base,
                    describe=describe_scheme(backend) if chunk is None else describe_scheme(backend, chunk_size=chunk),
                )
            )
    for backend in BACKEND_NAMES:
        methods.append(
            Method(
                name=f"flce:{backend}[vblocks={LOW_MEMORY_VOCAB_BLOCKS}]",
                label=f"flce {backend} (vocabulary in {LOW_MEMORY_VOCAB_BLOCKS} blocks)",
                family="flce",
                check=_check(backend),
                make_loss=_make(backend, None, LOW_MEMORY_VOCAB_BLOCKS),
                describe=_describe_vocab_blocks(backend),
            )
        )
    return methods


def _block_width(vocab: int, blocks: int) -> int:
    """``vocab_chunk_size`` that splits ``vocab`` columns into ``blocks`` blocks."""
    return -(-vocab // blocks)


def _describe_vocab_blocks(backend: str) -> Callable[[BenchCase], str]:
    def describe(case: BenchCase) -> str:
        block = _block_width(case.shape.v, LOW_MEMORY_VOCAB_BLOCKS)
        return describe_scheme(backend, vocab_chunk_size=block)(case)

    return describe


def flce_budget_method(backend: str, memory_budget: int, budget_text: str) -> Method:
    """flce's ``backend`` under ``memory_budget`` bytes of workspace (``flce:<backend>@<budget_text>``):
    the scheme the driver picks for that budget (``flce bench --frontier``)."""
    return Method(
        name=f"flce:{backend}@{budget_text}",
        label=f"flce {backend} (memory budget {budget_text})",
        family="flce",
        check=_check(backend),
        make_loss=_make(backend, None, memory_budget=memory_budget),
        base=f"flce:{backend}",
        describe=describe_scheme(backend, memory_budget=memory_budget),
    )
