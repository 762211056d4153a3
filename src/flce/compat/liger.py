"""Liger-Kernel 0.8.5 names, parameter order, defaults and return types, on flce.

Swap ``from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy``
for ``from flce.compat.liger import liger_fused_linear_cross_entropy``. Behaviour matches
Liger's (values, gradients, which results are returned and which are None) except for its
known defects, which flce does not have: only-weight-requires-grad returns the weight
gradient, repeated backward does not compound the upstream scaling, out-of-range targets
raise, and the caller's logits are never overwritten by the standalone cross-entropy
(``liger_cross_entropy``, ``LigerCrossEntropyLoss``). Where Liger rounds or divides by
zero, flce keeps the exact value: the loss and the z-loss are fp32 whatever the inputs'
dtype (Liger's standalone cross-entropy returns both in the logits' dtype, its fused loss
the z-loss in the input's: bf16/fp16-rounded), the mean's sum of bf16/fp16 class weights
is not rounded to their dtype (Liger's is), dW and db are accumulated in fp32 unless
``accum_dtype`` names the weight's dtype (Liger's default accumulates in the weight's),
the token accuracy of a batch whose every token is ignored is 0 (Liger's is 0/0 = NaN),
and so is the cross-entropy part of a ``"mean"`` whose targets' class weights sum to 0
(Liger's loss and gradients are NaN). The z-loss and the accuracy are returned detached
(Liger's carry a grad_fn through which no gradient flows: ``loss + z_loss`` has the same
gradients either way). Arguments that Liger's functions take unchecked raise, as
docs/errors.md lists: a negative ``label_smoothing`` or ``lse_square_scale``, an unknown
``reduction``, ``softcap <= 0`` (a wrong or NaN result in Liger), negative class weights,
and an ``accum_dtype`` other than None, torch.float32 or the weight's dtype (float64 too:
flce accumulates dW in fp32 and never below what is asked). ``ce_mode`` is accepted and
ignored; ``ce_impl`` selects an flce backend ("torch", "triton", "cutedsl"; Liger's names
"nvidia-triton" and "nvidia-cutedsl" mean "triton" and "cutedsl"). The modules' class
weights are checked when the module is built and kept as buffers outside the state dict
(Liger's are plain attributes, which ``.to()``/``.cuda()`` leave behind; a dtype
conversion, ``.to(torch.bfloat16)``, rounds them as it rounds ``torch.nn.CrossEntropyLoss``'s
weight). (B, T, H) inputs (Liger's take (BT, H) only) are taken too.

The fused linear JSD (``LigerFusedLinearJSD``, ``liger_fused_linear_jsd``,
``LigerFusedLinearJSDFunction``) runs ``flce.fused_linear_distillation`` with
``reduction="mean"``: the same loss, the mean over the tokens whose label is not
``ignore_index`` (0 when every token is ignored, as Liger's); unlike Liger's, it never
materializes a chunk's fp32 log-probabilities beside the logits, refuses bad arguments
with exceptions instead of asserts or NaN (``jsd_beta`` outside [0, 1], ``temperature <=
0``, a label neither in [0, V) nor ``ignore_index``, which Liger reads as a kept token),
and takes (B, T, H) inputs with (B, T) labels too. Its ``accum_dtype`` is checked and
selects nothing: dW is accumulated in fp32; ``jsd_impl`` selects a backend as ``ce_impl``
does and ``jsd_mode`` is ignored.
"""

from __future__ import annotations

import math

import torch

from flce.functional import (
    cross_entropy_with_options,
    fused_linear_cross_entropy_with_options,
    fused_linear_distillation_with_options,
)
from flce.options import (
    FLOAT_DTYPES,
    OPTION_FIELDS,
    DistillationOptions,
    LossOptions,
    NotScriptable,
    as_int,
    check_tensor_type,
    register_class_weight,
    row_count,
)
from flce.output import CrossEntropyOutput

__all__ = [
    "CrossEntropyOutput",
    "LigerCrossEntropyFunction",
    "LigerCrossEntropyLoss",
    "LigerFusedLinearCrossEntropyFunction",
    "LigerFusedLinearCrossEntropyLoss",
    "LigerFusedLinearJSD",
    "LigerFusedLinearJSDFunction",
    "liger_cross_entropy",
    "liger_fused_linear_cross_entropy",
    "liger_fused_linear_jsd",
]

# Liger's implementation names (``nvidia-<dsl>``, and the bare ``<dsl>`` it also takes) and
# flce's own backend names, each as the flce backend that runs it.
_LIGER_IMPL_ALIASES = {
    "nvidia-triton": "triton",
    "triton": "triton",
    "nvidia-cutedsl": "cutedsl",
    "cutedsl": "cutedsl",
    "torch": "torch",
}


def _backend_from_ce_impl(impl, name: str = "ce_impl") -> str | None:
    """Liger's ``ce_impl`` (or ``jsd_impl``, named by ``name``) as an flce backend name;
    case-insensitive, as ``backend=``."""
    if impl is None:
        return None
    key = impl.strip().lower() if isinstance(impl, str) else None
    if key not in _LIGER_IMPL_ALIASES:
        raise ValueError(f"{name} must be None or one of {sorted(_LIGER_IMPL_ALIASES)}, got {impl!r}")
    return _LIGER_IMPL_ALIASES[key]


def _liger_chunk_size(n_rows: int, vocab: int, hidden: int, chunk_mem_const) -> int | None:
    """Liger's chunk rule for a non-default ``chunk_mem_const``: logits per chunk bounded
    by ``chunk_mem_const * N * H`` elements, rounded to a power of two; the default (1)
    keeps flce's memory-budget sizing, as does H = 0 (no rule: the logits are the bias)."""
    chunk_mem_const = as_int("chunk_mem_const", chunk_mem_const)
    if chunk_mem_const < 1:
        raise ValueError(f"chunk_mem_const must be a positive int, got {chunk_mem_const!r}")
    if chunk_mem_const == 1 or n_rows == 0 or hidden == 0:
        return None
    inc_factor = math.ceil(vocab / (chunk_mem_const * hidden))
    rows = math.ceil(n_rows / max(inc_factor, 1))
    return min(1 << (rows - 1).bit_length(), n_rows)


def _chunk_size_for(input, weight, chunk_mem_const) -> int | None:
    """``_liger_chunk_size`` of these operands (N counts every row of a (B, T, H) input).
    Shapes the boundary check will refuse are left to it, for its message (the value of
    ``chunk_mem_const`` is checked all the same)."""
    shapes_known = (
        isinstance(input, torch.Tensor)
        and isinstance(weight, torch.Tensor)
        and not input.is_nested  # (its shape raises: the boundary check names it)
        and input.dim() >= 1
        and weight.dim() == 2
    )
    if not shapes_known:
        return _liger_chunk_size(0, 0, 0, chunk_mem_const)
    return _liger_chunk_size(row_count(input), weight.shape[0], input.shape[-1], chunk_mem_const)


def _options(arguments: dict, **overrides) -> LossOptions:
    """``LossOptions`` from a shim's arguments: the fields of ``LossOptions`` that the
    shim's signature (Liger's) names, each shim passing them as a dict by name (a test
    checks each passes exactly those its signature has)."""
    return LossOptions(**{name: arguments[name] for name in OPTION_FIELDS if name in arguments}, **overrides)


def _shim_options(
    ignore_index,
    lse_square_scale,
    label_smoothing,
    reduction,
    softcap,
    return_z_loss,
    return_token_accuracy,
    return_predicted_tokens,
    **fused_only,  # accum_dtype, use_token_scaling: the fused shims' own
) -> dict:
    """A shim's options by name, for ``_options``. Spelled out, not read with ``locals()``,
    which torch 2.11's dynamo cannot trace (a shim called or built in a compiled function)."""
    return dict(
        ignore_index=ignore_index,
        lse_square_scale=lse_square_scale,
        label_smoothing=label_smoothing,
        reduction=reduction,
        softcap=softcap,
        return_z_loss=return_z_loss,
        return_token_accuracy=return_token_accuracy,
        return_predicted_tokens=return_predicted_tokens,
        **fused_only,
    )


def _fused(input, weight, target, bias, ce_weight, arguments: dict, ce_impl=None, chunk_mem_const=1):
    options = _options(
        arguments,
        backend=_backend_from_ce_impl(ce_impl),
        chunk_size=_chunk_size_for(input, weight, chunk_mem_const),
    )
    return fused_linear_cross_entropy_with_options(input, weight, target, bias, ce_weight, options)


def _as_tuple(result) -> tuple:
    if isinstance(result, CrossEntropyOutput):
        return result.loss, result.z_loss, result.token_accuracy, result.predicted_tokens
    return result, None, None, None


class LigerFusedLinearCrossEntropyFunction:
    """``LigerFusedLinearCrossEntropyFunction.apply(...)`` -> ``(loss, z_loss, token_accuracy,
    predicted_tokens)``, unused entries None, as Liger's autograd function."""

    @staticmethod
    def forward(
        ctx,
        _input,
        weight,
        target,
        bias=None,
        ce_weight=None,
        ignore_index=-100,
        lse_square_scale=0.0,
        label_smoothing=0.0,
        reduction="mean",
        softcap=None,
        return_z_loss: bool = False,
        accum_dtype=None,
        use_token_scaling: bool = False,
        return_token_accuracy: bool = False,
        return_predicted_tokens: bool = False,
        ce_impl=None,
        ce_mode=None,
        chunk_mem_const: int = 1,
    ):
        arguments = _shim_options(
            ignore_index, lse_square_scale, label_smoothing, reduction, softcap, return_z_loss,
            return_token_accuracy, return_predicted_tokens, accum_dtype=accum_dtype,
            use_token_scaling=use_token_scaling,
        )  # fmt: skip
        return _as_tuple(_fused(_input, weight, target, bias, ce_weight, arguments, ce_impl, chunk_mem_const))

    @staticmethod
    def apply(*args, **kwargs):
        return LigerFusedLinearCrossEntropyFunction.forward(None, *args, **kwargs)


def liger_fused_linear_cross_entropy(
    input,
    weight,
    target,
    bias=None,
    ce_weight=None,
    ignore_index: int = -100,
    lse_square_scale: float = 0.0,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    softcap: float | None = None,
    return_z_loss: bool = False,
    accum_dtype=None,
    use_token_scaling: bool = False,
    return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False,
    chunk_mem_const: int = 1,
):
    """Liger's functional FLCE: the bare loss, or ``CrossEntropyOutput`` when a ``return_*`` flag is set."""
    arguments = _shim_options(
        ignore_index, lse_square_scale, label_smoothing, reduction, softcap, return_z_loss,
        return_token_accuracy, return_predicted_tokens, accum_dtype=accum_dtype,
        use_token_scaling=use_token_scaling,
    )  # fmt: skip
    return _fused(input, weight, target, bias, ce_weight, arguments, chunk_mem_const=chunk_mem_const)


def _keep_options(module: torch.nn.Module, arguments: dict) -> None:
    """A Liger module's options, validated now and kept as attributes of Liger's names
    (normalised as ``LossOptions`` stores them); ``_kept_options`` reads them back."""
    module._option_names = [name for name in OPTION_FIELDS if name in arguments]
    options = _options(arguments)
    for name in module._option_names:
        setattr(module, name, getattr(options, name))


def _kept_options(module: torch.nn.Module) -> dict:
    # From the attributes on each call, as Liger's forward reads them.
    return {name: getattr(module, name) for name in module._option_names}


def _options_repr(module: torch.nn.Module) -> str:
    """The options that differ from their defaults, as ``name=value``."""
    defaults = LossOptions()
    kept = _kept_options(module)
    return ", ".join(f"{name}={value!r}" for name, value in kept.items() if value != getattr(defaults, name))


class LigerFusedLinearCrossEntropyLoss(NotScriptable, torch.nn.Module):
    """Liger's module: ``forward(lin_weight, _input, target, bias=None)`` (weight first). The
    options are validated at construction (clear exceptions, where Liger asserts) and kept
    as attributes of the same names, as Liger's module keeps them, read on each call.
    ``ce_weight`` is checked too and, unlike Liger's plain attribute, is a buffer outside
    the state dict: it follows ``.to()``/``.cuda()`` of a model holding the loss."""

    def __init__(
        self,
        ce_weight: torch.FloatTensor | None = None,
        ignore_index: int = -100,
        lse_square_scale: float = 0.0,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        softcap: float | None = None,
        return_z_loss: bool = False,
        accum_dtype: torch.dtype | None = None,
        use_token_scaling: bool = False,
        return_token_accuracy: bool = False,
        return_predicted_tokens: bool = False,
    ):
        arguments = _shim_options(
            ignore_index, lse_square_scale, label_smoothing, reduction, softcap, return_z_loss,
            return_token_accuracy, return_predicted_tokens, accum_dtype=accum_dtype,
            use_token_scaling=use_token_scaling,
        )  # fmt: skip
        super().__init__()
        _keep_options(self, arguments)
        register_class_weight(self, "ce_weight", ce_weight)

    def forward(self, lin_weight, _input, target, bias=None):
        return _fused(_input, lin_weight, target, bias, self.ce_weight, _kept_options(self))

    def extra_repr(self) -> str:
        return _options_repr(self)


class LigerCrossEntropyLoss(NotScriptable, torch.nn.Module):
    """Liger's module: ``LigerCrossEntropyLoss(weight=None, ...)``, ``forward(_input, target)``
    on the caller's logits (never modified) -> the bare loss, or ``CrossEntropyOutput``
    when a ``return_*`` flag is set. Options and class weights kept as
    ``LigerFusedLinearCrossEntropyLoss`` keeps them."""

    def __init__(
        self,
        weight: torch.FloatTensor | None = None,
        ignore_index: int = -100,
        lse_square_scale: float = 0.0,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        softcap: float | None = None,
        return_z_loss: bool = False,
        return_token_accuracy: bool = False,
        return_predicted_tokens: bool = False,
    ):
        arguments = _shim_options(
            ignore_index, lse_square_scale, label_smoothing, reduction, softcap, return_z_loss,
            return_token_accuracy, return_predicted_tokens,
        )  # fmt: skip
        super().__init__()
        _keep_options(self, arguments)
        register_class_weight(self, "weight", weight)

    def forward(self, _input: torch.Tensor, target: torch.Tensor):
        return _ce(_input, target, self.weight, _kept_options(self))

    def extra_repr(self) -> str:
        return _options_repr(self)


def _ce(input, target, weight, arguments: dict):
    check_tensor_type("input", input)  # Liger's name for the logits
    return cross_entropy_with_options(input, target, weight, _options(arguments))


class LigerCrossEntropyFunction:
    """``LigerCrossEntropyFunction.apply(...)`` -> ``(loss, z_loss, token_accuracy, predicted_tokens)``."""

    @staticmethod
    def forward(
        ctx,
        _input: torch.Tensor,
        target: torch.Tensor,
        weight: torch.FloatTensor | None,
        ignore_index: int = -100,
        lse_square_scale: float = 0.0,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        softcap: float | None = None,
        return_z_loss: bool = False,
        return_token_accuracy: bool = False,
        return_predicted_tokens: bool = False,
    ):
        arguments = _shim_options(
            ignore_index, lse_square_scale, label_smoothing, reduction, softcap, return_z_loss,
            return_token_accuracy, return_predicted_tokens,
        )  # fmt: skip
        return _as_tuple(_ce(_input, target, weight, arguments))

    @staticmethod
    def apply(*args, **kwargs):
        return LigerCrossEntropyFunction.forward(None, *args, **kwargs)


def liger_cross_entropy(
    input,
    target,
    weight=None,
    size_average=None,
    ignore_index: int = -100,
    reduce=None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False,
):
    """Liger's functional CE. ``size_average``/``reduce`` are PyTorch's deprecated
    placeholders: Liger ignores them, flce refuses any value but None rather than ignore it."""
    arguments = _shim_options(
        ignore_index, lse_square_scale, label_smoothing, reduction, softcap, return_z_loss,
        return_token_accuracy, return_predicted_tokens,
    )  # fmt: skip
    for name, value in (("size_average", size_average), ("reduce", reduce)):
        if value is not None:
            raise ValueError(f"{name} is a deprecated placeholder and must be None; use reduction=")
    return _ce(input, target, weight, arguments)


# --------------------------------------------------------------- fused linear JSD


def _jsd_options(jsd_beta, ignore_index, temperature, accum_dtype, jsd_impl=None) -> DistillationOptions:
    """The distillation's options from Liger's arguments. ``accum_dtype`` (Liger's dW
    accumulation dtype) is checked and has nothing to select: flce accumulates dW in fp32,
    never less precise than any dtype it may name. ``jsd_impl`` selects a backend, as
    ``ce_impl`` does."""
    if accum_dtype is not None and accum_dtype not in FLOAT_DTYPES:
        raise ValueError(f"accum_dtype must be None, torch.float32 or the weight's dtype, got {accum_dtype!r}")
    backend = _backend_from_ce_impl(jsd_impl, name="jsd_impl")
    try:
        return DistillationOptions(
            beta=jsd_beta, temperature=temperature, ignore_index=ignore_index, reduction="mean", backend=backend
        )
    except (TypeError, ValueError) as error:  # named as the caller spelled it: jsd_beta, not beta
        message = str(error)
        if message.startswith("beta "):
            raise type(error)("jsd_" + message) from None
        raise


def _jsd(student_input, student_weight, teacher_input, teacher_weight, shift_labels, options: DistillationOptions):
    return fused_linear_distillation_with_options(
        student_input, student_weight, teacher_input, teacher_weight, shift_labels, None, None, options
    )


class LigerFusedLinearJSDFunction:
    """``LigerFusedLinearJSDFunction.apply(student_input, student_weight, teacher_input,
    teacher_weight, shift_labels=None, jsd_beta=0.5, ignore_index=-100, temperature=1.0,
    accum_dtype=None, jsd_impl=None, jsd_mode=None)`` -> the loss, as Liger's autograd
    function (Liger's own functional and module pass all eleven). ``jsd_impl`` selects an
    flce backend as ``ce_impl`` does; ``jsd_mode`` is accepted and ignored."""

    @staticmethod
    def forward(
        ctx,
        student_input: torch.Tensor,
        student_weight: torch.Tensor,
        teacher_input: torch.Tensor,
        teacher_weight: torch.Tensor,
        shift_labels: torch.Tensor | None = None,
        jsd_beta: float = 0.5,
        ignore_index: int = -100,
        temperature: float = 1.0,
        accum_dtype: torch.dtype | None = None,
        jsd_impl=None,
        jsd_mode=None,
    ):
        options = _jsd_options(jsd_beta, ignore_index, temperature, accum_dtype, jsd_impl)
        return _jsd(student_input, student_weight, teacher_input, teacher_weight, shift_labels, options)

    @staticmethod
    def apply(*args, **kwargs):
        return LigerFusedLinearJSDFunction.forward(None, *args, **kwargs)


def liger_fused_linear_jsd(
    student_input,
    student_weight,
    teacher_input,
    teacher_weight,
    shift_labels=None,
    jsd_beta: float = 0.5,
    ignore_index: int = -100,
    temperature: float = 1.0,
    accum_dtype: torch.dtype | None = None,
):
    """Liger's functional fused linear JSD: the generalized JSD of the student's and the
    teacher's LM heads (``flce.fused_linear_distillation``), mean over the tokens kept."""
    options = _jsd_options(jsd_beta, ignore_index, temperature, accum_dtype)
    return _jsd(student_input, student_weight, teacher_input, teacher_weight, shift_labels, options)


class LigerFusedLinearJSD(NotScriptable, torch.nn.Module):
    """Liger's module: ``LigerFusedLinearJSD(jsd_beta=0.5, ignore_index=-100, temperature=1.0,
    accum_dtype=None)``, ``forward(student_input, student_weight, teacher_input,
    teacher_weight, shift_labels)``."""

    def __init__(self, jsd_beta=0.5, ignore_index=-100, temperature=1.0, accum_dtype: torch.dtype | None = None):
        super().__init__()
        # Validated now, as Liger asserts at construction (with clear exceptions, not asserts).
        _jsd_options(jsd_beta, ignore_index, temperature, accum_dtype)
        self.jsd_beta = jsd_beta
        self.temperature = temperature
        self.ignore_index = ignore_index
        self.accum_dtype = accum_dtype

    def forward(
        self,
        student_input: torch.Tensor,
        student_weight: torch.Tensor,
        teacher_input: torch.Tensor,
        teacher_weight: torch.Tensor,
        shift_labels: torch.LongTensor | None,
    ):
        # From the attributes on each call, as Liger's forward reads them.
        options = _jsd_options(self.jsd_beta, self.ignore_index, self.temperature, self.accum_dtype)
        return _jsd(student_input, student_weight, teacher_input, teacher_weight, shift_labels, options)
