"""Loss options: one frozen dataclass per loss head, built and validated once at the API
boundary (``LossOptions`` for the cross-entropy, ``LogprobsOptions``,
``DistillationOptions``); the custom-op schemas derive from their fields
(``options_schema``).

Every check here runs before any kernel, names the offending argument and says what
was expected. Tensor checks that need the data (target range) run in the driver on the
device (``flce.driver.statistics.batch_statistics``).
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
import os
import sys
from dataclasses import dataclass, fields, replace

import torch

from flce.dispatch import backend_name

REDUCTIONS = ("mean", "sum", "none")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = torch.finfo(torch.float32).max
# The kernels compute z' = softcap * tanh(z * (1 / softcap)) with both constants in
# float32: each must be a normal float32 (an Inf or a reciprocal flushed to 0 gives NaN,
# or every logit 0), so softcap lies in [2^-126, 2^126].
MIN_SOFTCAP, MAX_SOFTCAP = 2.0**-126, 2.0**126


@dataclass(frozen=True)
class LossOptions:
    """Options of one loss call (everything but the tensors).

    Numbers may be given as Python or NumPy scalars (bools excepted) and are stored as
    Python ``int``/``float``; ``backend`` is stored lower-case (``flce.dispatch.backend_name``).
    """

    ignore_index: int = -100
    lse_square_scale: float = 0.0
    label_smoothing: float = 0.0
    reduction: str = "mean"
    softcap: float | None = None
    return_z_loss: bool = False
    accum_dtype: torch.dtype | None = None
    use_token_scaling: bool = False
    return_token_accuracy: bool = False
    return_predicted_tokens: bool = False
    backend: str | None = None
    chunk_size: int | None = None
    vocab_chunk_size: int | None = None
    memory_budget: int | None = None  # bytes of workspace (flce.driver.sizing)

    def __post_init__(self) -> None:
        # Integral and real options are stored as Python ints and floats (NumPy scalars
        # are accepted and converted), so op schemas, kernels and repr() see one type.
        self._set("ignore_index", as_ignore_index(self.ignore_index))
        self._set("lse_square_scale", as_float("lse_square_scale", self.lse_square_scale))
        if self.lse_square_scale < 0:
            raise ValueError(f"lse_square_scale must be >= 0, got {self.lse_square_scale}")
        if self.lse_square_scale > FLOAT32_MAX:
            raise ValueError(
                f"lse_square_scale must be <= {FLOAT32_MAX:.3g} (the kernels take it as a float32, "
                f"which would be Inf), got {self.lse_square_scale}"
            )
        self._set("label_smoothing", as_float("label_smoothing", self.label_smoothing))
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {self.label_smoothing}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        if self.softcap is not None:
            self._set("softcap", as_float("softcap", self.softcap))
            if not self.softcap > 0:
                raise ValueError(f"softcap must be > 0 or None, got {self.softcap}")
            if not MIN_SOFTCAP <= self.softcap <= MAX_SOFTCAP:
                raise ValueError(
                    f"softcap must be in [{MIN_SOFTCAP:.3g}, {MAX_SOFTCAP:.3g}] or None (the kernels take it and "
                    f"1 / softcap as normal float32 numbers; beyond them the loss would be NaN), got {self.softcap}"
                )
        for flag in ("return_z_loss", "use_token_scaling", "return_token_accuracy", "return_predicted_tokens"):
            self._set(flag, as_bool(flag, getattr(self, flag)))
        if self.accum_dtype is not None and self.accum_dtype not in FLOAT_DTYPES:
            raise ValueError(f"accum_dtype must be None, torch.float32 or the weight's dtype, got {self.accum_dtype!r}")
        for name in ("chunk_size", "vocab_chunk_size", "memory_budget"):
            self._set(name, as_positive_int_or_none(name, getattr(self, name)))
        self._set("backend", backend_name(self.backend))

    def _set(self, name: str, value) -> None:
        _set_field(self, name, value)

    @property
    def needs_z_loss_rows(self) -> bool:
        """Whether the kernel must produce per-row z-loss (it enters the loss or is returned)."""
        return self.lse_square_scale > 0 or self.return_z_loss

    @property
    def returns_structured(self) -> bool:
        return self.return_z_loss or self.return_token_accuracy or self.return_predicted_tokens


@dataclass(frozen=True)
class LogprobsOptions:
    """Options of one ``flce.fused_linear_logprobs`` call (everything but the tensors);
    numbers normalised as in ``LossOptions``. Logits are ``(x W^T + b) / temperature``."""

    temperature: float = 1.0
    return_entropy: bool = False
    return_predicted_tokens: bool = False
    ignore_index: int = -100
    backend: str | None = None
    chunk_size: int | None = None
    # bytes of workspace (flce.driver.sizing); it also decides whether the forward's
    # logits are kept for the backward (flce.heads.logprobs)
    memory_budget: int | None = None

    def __post_init__(self) -> None:
        _set_field(self, "temperature", as_temperature(self.temperature))
        _set_field(self, "return_entropy", as_bool("return_entropy", self.return_entropy))
        _set_field(self, "return_predicted_tokens", as_bool("return_predicted_tokens", self.return_predicted_tokens))
        _set_field(self, "ignore_index", as_ignore_index(self.ignore_index))
        _set_field(self, "backend", backend_name(self.backend))
        for name in ("chunk_size", "memory_budget"):
            _set_field(self, name, as_positive_int_or_none(name, getattr(self, name)))

    @property
    def inv_temperature(self) -> float:
        return 1.0 / self.temperature


@dataclass(frozen=True)
class DistillationOptions:
    """Options of one ``flce.fused_linear_distillation`` call (everything but the tensors):
    ``beta`` in [0, 1] (0: forward KL(teacher || student), 1: reverse KL), the softmax
    ``temperature`` of both models, and the reduction over the tokens not ignored."""

    beta: float = 0.5
    temperature: float = 1.0
    ignore_index: int = -100
    reduction: str = "mean"
    backend: str | None = None
    chunk_size: int | None = None

    def __post_init__(self) -> None:
        _set_field(self, "beta", as_float("beta", self.beta))
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1] (0: forward KL, 1: reverse KL), got {self.beta}")
        _set_field(self, "temperature", as_temperature(self.temperature))
        _set_field(self, "ignore_index", as_ignore_index(self.ignore_index))
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        _set_field(self, "backend", backend_name(self.backend))
        _set_field(self, "chunk_size", as_positive_int_or_none("chunk_size", self.chunk_size))

    @property
    def inv_temperature(self) -> float:
        return 1.0 / self.temperature


def _set_field(options, name: str, value) -> None:
    object.__setattr__(options, name, value)  # normalising a field of a frozen options dataclass


@functools.lru_cache(maxsize=256, typed=True)
def _built_options(options_type: type, **values) -> Options:
    return options_type(**values)


def cached_options(options_type: type, **values) -> Options:
    """``options_type(**values)``, built and validated once per distinct values: a training
    loop passes the same options call after call.

    ``typed``: ``True``, ``1`` and ``1.0`` are equal keys but not equal options (a bool is
    refused where a number is expected), so each type is built and checked on its own.
    Bad values raise and are not cached; unhashable ones (a list) skip the cache and get
    the dataclass's own error. Under ``torch.compile`` the tracer builds them itself.
    """
    if torch.compiler.is_compiling():
        return options_type(**values)
    try:
        return _built_options(options_type, **values)
    except TypeError:
        return options_type(**values)  # raises the validation's error, or builds an unhashable-key one


# ------------------------------------------- the options as custom-op arguments

Options = LossOptions | LogprobsOptions | DistillationOptions


def option_fields(options_type: type = LossOptions) -> tuple[str, ...]:
    """The field names of an options dataclass, in declaration order (the ops' order)."""
    return tuple(f.name for f in fields(options_type))


OPTION_FIELDS: tuple[str, ...] = option_fields(LossOptions)
# Annotation (as written in the options dataclasses) -> torch.library schema type.
_SCHEMA_TYPES = {"int": "int", "float": "float", "str": "str", "bool": "bool", "torch.dtype": "ScalarType"}


def _schema_type(annotation: str) -> str:
    base, optional = annotation.removesuffix(" | None"), annotation.endswith(" | None")
    return _SCHEMA_TYPES[base] + ("?" if optional else "")


def options_schema(options_type: type = LossOptions) -> str:
    """An options dataclass's fields as a ``torch.library`` schema fragment (``"int
    ignore_index, float lse_square_scale, ..."`` for ``LossOptions``): the custom ops take
    the options field by field without spelling them out."""
    return ", ".join(f"{_schema_type(f.type)} {f.name}" for f in fields(options_type))


def option_values(options: Options) -> tuple:
    """The field values in declaration order (normalised to the schema's Python types by
    the dataclass's validation)."""
    return tuple(getattr(options, f.name) for f in fields(options))  # of the instance: traceable


def options_from_values(values, options_type: type = LossOptions) -> Options:
    return options_type(**dict(zip(option_fields(options_type), values, strict=True)))


def _is_tensor_or_bool(value) -> bool:
    """Values refused where a number is expected: bools (Python's and NumPy's) are not
    numbers here, and tensors would be read on the host (a device sync, and a graph
    break under torch.compile) for what the kernels take as a constant."""
    numpy = sys.modules.get("numpy")  # a NumPy value exists only if NumPy is imported
    return isinstance(value, (bool, torch.Tensor)) or (numpy is not None and isinstance(value, numpy.bool_))


def as_int(name: str, value) -> int:
    """``value`` as a Python int: any integral scalar (``int``, NumPy integers: whatever
    ``operator.index`` takes), not a bool, a float or a tensor."""
    if not _is_tensor_or_bool(value):
        try:
            return operator.index(value)
        except TypeError:
            pass
    hint = "; pass int(t)" if isinstance(value, torch.Tensor) else ""
    raise TypeError(f"{name} must be an int (a Python or NumPy integer), got {value!r}{hint}")


def as_float(name: str, value) -> float:
    """``value`` as a finite Python float: any real scalar (``int``, ``float``, NumPy
    integers and floats), not a bool, a tensor, NaN or Inf. The range is checked with
    comparisons rather than ``math.isfinite``, which cannot take the symbolic float that
    ``torch.compile`` makes of an option changing between calls (NaN fails both)."""
    if (
        not _is_tensor_or_bool(value)
        # A tuple, not ``numbers.Real | torch.SymFloat``: Dynamo before torch 2.5 cannot trace a union type.
        and isinstance(value, (numbers.Real, torch.SymFloat))  # noqa: UP038
        and -math.inf < value < math.inf
    ):
        return float(value)
    hint = "; pass float(t)" if isinstance(value, torch.Tensor) else ""
    raise TypeError(f"{name} must be a finite float, got {value!r}{hint}")


def as_ignore_index(value) -> int:
    """``ignore_index`` as a Python int that fits in int64 (the kernels compare it as one)."""
    value = as_int("ignore_index", value)
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"ignore_index must fit in int64 (the kernels compare it as one), got {value}")
    return value


def as_positive_int_or_none(name: str, value) -> int | None:
    """A size option (``chunk_size``, ...): a positive int, or None for the default. Each
    is an upper bound (rows, columns, bytes), so one beyond int64 is stored as
    ``INT64_MAX``, which bounds the same: the custom ops (``flce.ops``) take the options
    as int64 and refused a larger Python int from inside ``torch.compile``."""
    if value is None:
        return None
    number = as_int(name, value)
    if number <= 0:
        raise ValueError(f"{name} must be a positive int or None, got {value}")
    return min(number, INT64_MAX)


# The kernels multiply the logits by 1 / temperature in fp32: below this it is not finite.
MIN_TEMPERATURE = 1.0 / torch.finfo(torch.float32).max


def as_temperature(value) -> float:
    """The softmax temperature: a finite float > 0 (the logits are divided by it) whose
    reciprocal is a finite fp32 (a smaller one would give NaN, not a sharper softmax)."""
    value = as_float("temperature", value)
    if not value > 0:
        raise ValueError(f"temperature must be > 0 (the logits are divided by it), got {value}")
    if value < MIN_TEMPERATURE:
        raise ValueError(
            f"temperature must be >= {MIN_TEMPERATURE:.3g} (the kernels scale the logits by 1 / temperature "
            f"in float32, which overflows below it), got {value}"
        )
    return value


def as_bool(name: str, value) -> bool:
    """``value`` as a Python bool: ``True``/``False`` or a NumPy bool, nothing else (a
    flag given as 1 or "yes" is more likely a misplaced argument than a choice)."""
    numpy = sys.modules.get("numpy")
    if isinstance(value, bool) or (numpy is not None and isinstance(value, numpy.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {value!r}")


def environment_mode(variable: str, modes: tuple[str, ...]) -> str:
    """The mode an environment variable sets, one of ``modes`` (``modes[0]`` when unset or
    empty; case and surrounding spaces ignored); a ValueError naming the variable otherwise."""
    return _environment_mode(variable, os.environ.get(variable), modes)


@functools.cache  # every call asks (an error is not kept: a bad value raises again)
def _environment_mode(variable: str, value: str | None, modes: tuple[str, ...]) -> str:
    mode = (value or modes[0]).strip().lower()
    if mode not in modes:
        raise ValueError(f"{variable} must be one of {modes}, got {mode!r}")
    return mode


def row_count(tensor: torch.Tensor) -> int:
    """The rows of a ``(..., D)`` tensor: the product of its leading dimensions. Not
    ``shape[:-1].numel()``, which turns a symbolic size into a constant (``torch.export``
    with a dynamic batch would refuse the export as specialised)."""
    return math.prod(tensor.shape[:-1])


def check_tensor_type(name: str, value) -> None:
    """A tensor argument given as something else (None, a list, a NumPy array, a number)
    is refused by name, before any attribute of it is read."""
    if not isinstance(value, torch.Tensor):
        hint = f"; pass torch.as_tensor({name})" if not (value is None or isinstance(value, numbers.Number)) else ""
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}{hint}")


def check_optional_tensor_type(name: str, value) -> None:
    """``check_tensor_type`` for a tensor argument that may be None."""
    if value is not None:
        check_tensor_type(name, value)


def check_compute_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {tensor.dtype}")


TARGET_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def index_target(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """A validated target as every kernel and row formula reads it: ``(N,)``, int64 or int32.

    They compare the target with ``ignore_index`` and with ``V`` in the target's own dtype,
    where PyTorch wraps a Python int: against a uint8 target ``ignore_index=-100`` is class
    156, against an int32 one ``ignore_index=2**32`` is class 0. So a target narrower than
    int32, or an int32 target whose ``ignore_index`` int32 cannot hold, is widened to int64
    (a copy of N values); int64, and int32 with an int32 ``ignore_index``, pass as they are."""
    flat = target if target.dim() == 1 else target.reshape(-1)
    if flat.dtype == torch.int64 or (flat.dtype == torch.int32 and _INT32_MIN <= ignore_index <= _INT32_MAX):
        return flat
    return flat.long()


def validate_target(target: torch.Tensor, leading_shape: torch.Size, rows_name: str) -> None:
    """``target`` holds one integer class index per row of ``rows_name``, whose leading
    (all but the last) dimensions are ``leading_shape``: ``(N,)``, or ``(B, T)`` against
    a 3-D ``(B, T, ·)`` tensor (a 1-D target of ``B * T`` values is taken as the rows in
    order; a 2-D target of ``N`` values against a 2-D tensor likewise)."""
    check_tensor_type("target", target)
    _refuse_dtensor("target", target)
    refuse_non_dense("target", target)
    if target.dtype not in TARGET_DTYPES:
        raise TypeError(f"target must be an integer tensor (int64, int32, int16, int8 or uint8), got {target.dtype}")
    if len(leading_shape) == 2 and target.dim() == 2 and tuple(target.shape) != tuple(leading_shape):
        raise ValueError(f"target must be (B, T) = {tuple(leading_shape)}, got {tuple(target.shape)}")
    if target.dim() not in (1, 2):
        raise ValueError(f"target must be (N,) or (B, T), got shape {tuple(target.shape)}")
    expected_rows = math.prod(leading_shape)  # not Size.numel(), which fixes a symbolic size (row_count)
    if target.numel() != expected_rows:
        raise ValueError(
            f"target must have one class index per row of {rows_name} ({expected_rows} values), "
            f"got shape {tuple(target.shape)}"
        )


def _check_class_weight_kind(name: str, class_weight: torch.Tensor) -> None:
    """What class weights must be whatever the vocabulary: dense and floating-point."""
    refuse_non_dense(name, class_weight)
    if not class_weight.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {class_weight.dtype}")


def bad_class_weights_message(name: str) -> str:
    """The error of class weights with negative, NaN or Inf entries (checked when a module
    is built, and by the call's batch statistics)."""
    return f"{name} must be finite and non-negative; it has negative, NaN or Inf entries"


def validate_ce_weight(ce_weight: torch.Tensor | None, vocab: int, device: torch.device, name: str) -> None:
    if ce_weight is None:
        return
    if not isinstance(ce_weight, torch.Tensor):
        raise TypeError(f"{name} must be a tensor of shape ({vocab},) or None, got {type(ce_weight).__name__}")
    _refuse_dtensor(name, ce_weight)
    _check_class_weight_kind(name, ce_weight)
    if ce_weight.shape != (vocab,):
        raise ValueError(f"{name} must have shape ({vocab},) (one weight per class), got {tuple(ce_weight.shape)}")
    if ce_weight.device != device:
        raise ValueError(f"{name} is on {ce_weight.device} but the logits are on {device}; put them on one device")
    if ce_weight.requires_grad and torch.is_grad_enabled():
        # As torch.nn.functional.cross_entropy: no gradient flows to class weights, and
        # detaching them silently would leave a parameter without the gradient it expects.
        raise ValueError(
            f"{name} requires grad, but the loss is not differentiable with respect to the class weights "
            f"(as in torch.nn.functional.cross_entropy); pass {name}.detach()"
        )


def refuse_meta(name: str, tensor: torch.Tensor) -> None:
    """The meta device holds shapes, not data: flce computes values (and reads the target
    to check its range), so a meta tensor is refused before anything runs."""
    if tensor.device.type == "meta":
        raise ValueError(
            f"{name} is on the meta device, which holds no data; flce computes real values: "
            "materialize the tensors on a real device first (e.g. load the model's weights)"
        )


def refuse_non_dense(name: str, tensor: torch.Tensor | None) -> None:
    """The kernels and GEMMs read a tensor through its strides: a sparse (COO, CSR, ...) or
    nested one is refused here rather than by an operator deep inside that has no kernel
    for its layout."""
    if tensor is None:
        return
    if tensor.is_nested:
        raise TypeError(f"{name} is a nested tensor; flce takes dense tensors: pad or concatenate the sequences")
    if tensor.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {tensor.layout}; pass {name}.to_dense()")


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


def resolve_compute_dtype(device: torch.device, *tensors: torch.Tensor | None, names: tuple[str, ...]) -> torch.dtype:
    """dtype the GEMMs and the kernel run in: the autocast dtype inside autocast,
    else the common dtype of the floating inputs (which must then agree)."""
    present = [(n, t) for n, t in zip(names, tensors, strict=False) if t is not None]
    for name, tensor in present:
        check_compute_dtype(name, tensor)
    cast = _autocast_dtype(device)
    if cast is not None:
        return cast
    first_name, first = present[0]
    for name, tensor in present[1:]:
        if tensor.dtype != first.dtype:
            raise TypeError(
                f"{name} has dtype {tensor.dtype} but {first_name} has {first.dtype}; outside torch.autocast "
                f"they must match (cast one, or run under torch.autocast)"
            )
    return first.dtype


@dataclass(frozen=True)
class HeadNames:
    """The argument names of one LM head's tensors, for the errors that name them."""

    input: str = "input"
    weight: str = "weight"
    bias: str = "bias"


def validate_linear_head(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, names: HeadNames = HeadNames()
) -> torch.dtype:
    """``input`` (N, H) or (B, T, H), ``weight`` (V, H) with V >= 1 and ``bias`` (V,) or
    None, on one device, not meta, not DTensors; returns their compute dtype
    (``resolve_compute_dtype``)."""
    check_tensor_type(names.input, input)
    check_tensor_type(names.weight, weight)
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"{names.bias} must be a tensor of shape (V,) or None, got {type(bias).__name__}")
    for name, t in ((names.input, input), (names.weight, weight), (names.bias, bias)):
        _refuse_dtensor(name, t)
        refuse_non_dense(name, t)
    if input.dim() not in (2, 3):
        raise ValueError(f"{names.input} must be (N, H) or (B, T, H), got shape {tuple(input.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"{names.weight} must be (V, H), got shape {tuple(weight.shape)}")
    hidden = input.shape[-1]
    if weight.shape[1] != hidden:
        raise ValueError(
            f"{names.weight} must be (V, H) with H = {names.input}.shape[-1] = {hidden}, "
            f"got shape {tuple(weight.shape)}"
        )
    vocab = weight.shape[0]
    if vocab == 0:
        raise ValueError(f"{names.weight} must have at least one row (V >= 1)")
    refuse_meta(names.input, input)
    for name, t in ((names.weight, weight), (names.bias, bias)):
        if t is not None and t.device != input.device:
            raise ValueError(
                f"{name} is on {t.device} but {names.input} is on {input.device}; all tensors must share a device"
            )
    if bias is not None and bias.shape != (vocab,):
        raise ValueError(f"{names.bias} must have shape ({vocab},) = (V,), got {tuple(bias.shape)}")
    return resolve_compute_dtype(input.device, input, weight, bias, names=(names.input, names.weight, names.bias))


def validate_head_target(target: torch.Tensor, input: torch.Tensor, input_name: str = "input") -> None:
    """``target`` holds one class index per row of ``input`` (``validate_target``), on its device."""
    validate_target(target, input.shape[:-1], input_name)
    if target.device != input.device:
        raise ValueError(
            f"target is on {target.device} but {input_name} is on {input.device}; all tensors must share a device"
        )


# ------------------------------------------------- boundary checks, once per layout
#
# The checks below read only what a training loop passes unchanged call after call: the
# tensors' types, shapes, dtypes and devices, the autocast state, grad mode and a few
# options. A call whose key was checked before skips them (a dict lookup instead of a
# few hundred Python operations); a call that fails them raises and is never remembered.
# The checks that need the data (target range, class-weight values) run on the device
# for every call (``flce.driver.statistics``). Under ``torch.compile`` the checks always
# run: the tracer sees them once, and a global cache would only cost guards.


class KeptAnswers:
    """Answers kept per key, for decisions a training loop asks again with the same key call
    after call, whose computation needs the call's tensors (so not an ``lru_cache`` on
    them): ``get(key, compute)`` runs ``compute()`` the first time ``key`` is seen only.
    An answer is never None; a ``compute()`` that raises keeps nothing. A process that keeps
    changing keys (a sweep) starts afresh past ``limit`` of them, rather than keep them all."""

    def __init__(self, limit: int = 256) -> None:
        self._answers: dict = {}
        self._limit = limit

    def get(self, key, compute):
        answer = self._answers.get(key)
        if answer is None:
            if len(self._answers) >= self._limit:
                self._answers.clear()
            answer = self._answers[key] = compute()
        return answer

    def clear(self) -> None:
        self._answers.clear()

    def __len__(self) -> int:
        return len(self._answers)


# Tensors whose data is their storage at their address: a layout checked once is kept, a
# CUDA graph reads them in place, a kernel takes them. Others (DTensor, torch.compile's
# fake and functional tensors, ...) are checked every call and take the plain paths.
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_checked_layouts = KeptAnswers()


def _layout_key(required: tuple, optional: tuple = ()) -> tuple | None:
    """(shape, dtype, device) of each tensor (None where an ``optional`` one is absent), or
    None when one is not a plain dense tensor (the full checks then run, and name what is
    wrong: a sparse tensor has the shape, dtype and device of a dense one checked before;
    a ``required`` argument given as None, a list or an array is no layout at all)."""
    key = []
    for tensor in (*required, *optional):
        if tensor is None and len(key) >= len(required):
            key.append(None)
        elif type(tensor) in PLAIN_TENSOR_TYPES and tensor.layout == torch.strided and not tensor.is_nested:
            key.append((tensor.shape, tensor.dtype, tensor.device))
        else:
            return None
    return tuple(key)


def _class_weight_needs_grad(ce_weight: torch.Tensor | None) -> bool:
    return ce_weight is not None and ce_weight.requires_grad and torch.is_grad_enabled()


def _autocast_key(device: torch.device):
    """The autocast dtype on ``device`` (None outside autocast), or ``_NO_KEY`` where the
    device type has no autocast (the meta device: the full checks then refuse it)."""
    if device.type not in ("cpu", "cuda"):
        return _NO_KEY
    return _autocast_dtype(device)


_NO_KEY = object()


def _checked(key: tuple | None, check):
    """``check()``'s result, run only the first time ``key`` is seen (None: every time)."""
    return check() if key is None else _checked_layouts.get(key, check)


def validate_fused_inputs(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ce_weight: torch.Tensor | None,
    options: LossOptions,
    names: HeadNames = HeadNames(),
) -> torch.dtype:
    """Shape/dtype/device checks for the fused linear + CE; returns the compute dtype.
    Run once per layout (the section's comment). ``names``: the weight's and bias's
    argument names in the errors (the vocab-parallel loss's shards)."""
    key = None
    if not torch.compiler.is_compiling():
        layout = _layout_key((input, weight, target), (bias, ce_weight))
        autocast = _NO_KEY if layout is None else _autocast_key(input.device)
        if autocast is not _NO_KEY:
            key = ("fused", layout, autocast, _class_weight_needs_grad(ce_weight), options.accum_dtype)
    return _checked(key, lambda: _validate_fused_inputs(input, weight, target, bias, ce_weight, options, names))


def _validate_fused_inputs(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ce_weight: torch.Tensor | None,
    options: LossOptions,
    names: HeadNames,
) -> torch.dtype:
    check_tensor_type("target", target)
    dtype = validate_linear_head(input, weight, bias, names)
    validate_head_target(target, input)
    validate_ce_weight(ce_weight, weight.shape[0], input.device, "ce_weight")
    _check_accum_dtype(options, weight.dtype)
    return dtype


def _refuse_dtensor(name: str, tensor: torch.Tensor | None) -> None:
    """A sharded DTensor reaching the single-device loss is a usage error, not something
    to gather silently: gathering would double-count gradients under data parallelism.
    Every tensor argument is checked (the target, class weights and logits too: their
    kernels and indexing would fail deep inside PyTorch's DTensor dispatch otherwise)."""
    if tensor is None or type(tensor).__name__ != "DTensor":
        return
    placements = getattr(tensor, "placements", "?")
    raise TypeError(
        f"{name} is a DTensor with placements {placements}; flce's loss takes local tensors. "
        "Under FSDP2 (fully_shard), compute the loss inside the forward of a module whose "
        "parameters FSDP has unsharded (e.g. the causal-LM model that owns lm_head, without "
        "wrapping lm_head in its own fully_shard unit), where they are plain tensors. For a "
        "vocabulary-sharded (tensor-parallel) weight the cross-entropy has "
        "flce.parallel.vocab_parallel_fused_linear_cross_entropy; the logprobs and distillation heads "
        "have no vocab-parallel form (gather the weight first)."
    )


def validate_logits_inputs(
    logits: torch.Tensor, target: torch.Tensor, ce_weight: torch.Tensor | None, options: LossOptions
) -> None:
    """Shape/dtype/device checks for the loss on given logits, once per layout."""
    key = None
    if not torch.compiler.is_compiling():
        layout = _layout_key((logits, target), (ce_weight,))
        if layout is not None:
            key = (
                "logits",
                layout,
                _class_weight_needs_grad(ce_weight),
                options.accum_dtype,
                options.vocab_chunk_size,
                options.memory_budget,
            )
    _checked(key, lambda: _validate_logits_inputs(logits, target, ce_weight, options) or True)


def _validate_logits_inputs(
    logits: torch.Tensor, target: torch.Tensor, ce_weight: torch.Tensor | None, options: LossOptions
) -> None:
    check_tensor_type("logits", logits)
    check_tensor_type("target", target)
    _refuse_dtensor("logits", logits)
    refuse_non_dense("logits", logits)
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits must be (N, V) or (B, T, V), got shape {tuple(logits.shape)}")
    check_compute_dtype("logits", logits)
    vocab = logits.shape[-1]
    if vocab == 0:
        raise ValueError("logits must have at least one class (V >= 1)")
    validate_target(target, logits.shape[:-1], "logits")
    refuse_meta("logits", logits)
    if target.device != logits.device:
        raise ValueError(f"target is on {target.device} but logits are on {logits.device}; put them on one device")
    validate_ce_weight(ce_weight, vocab, logits.device, "weight")
    if options.accum_dtype is not None:
        raise ValueError("accum_dtype applies to the fused linear loss only; pass None for cross_entropy")
    if options.vocab_chunk_size is not None:
        raise ValueError("vocab_chunk_size applies to the fused linear loss only; pass None for cross_entropy")
    if options.memory_budget is not None:
        raise ValueError("memory_budget applies to the fused linear loss only; pass None for cross_entropy")


def _check_accum_dtype(options: LossOptions, param_dtype: torch.dtype) -> None:
    if options.accum_dtype not in (None, torch.float32, param_dtype):
        raise ValueError(
            f"accum_dtype must be None, torch.float32 or the weight's dtype ({param_dtype}), got {options.accum_dtype}"
        )


def refuse_function_transforms(entry: str, tensors) -> None:
    """Raises under ``torch.func`` transforms (``grad``, ``vmap``, ``jvp``...) and for
    forward-mode AD dual tensors: flce's outputs come from fused kernels that carry no
    tangent and have no batching rule, so these would give a tangent of zero (or a
    differentiated ``detach``) or an error from PyTorch's internals. Two cheap reads
    when neither is active."""
    dual = torch.autograd.forward_ad._current_level >= 0 and any(
        t is not None and torch.autograd.forward_ad.unpack_dual(t).tangent is not None for t in tensors
    )
    if dual or torch._C._are_functorch_transforms_active():
        raise RuntimeError(
            f"{entry} does not support torch.func transforms (grad, vmap, jvp, ...) or forward-mode AD "
            "(torch.autograd.forward_ad dual tensors): its fused kernels carry no tangents and have no batching "
            "rule. Use reverse-mode autograd (loss.backward() or torch.autograd.grad), or eager PyTorch "
            "(torch.nn.functional.cross_entropy on the logits) inside the transform."
        )


class NotScriptable:
    """Refuses ``torch.jit.script`` (also of a model holding the loss as a submodule) with
    a message, instead of TorchScript's error from deep inside the functional form. Every
    loss module of flce (``flce.modules``, ``flce.compat``, ``flce.parallel``) takes it
    first among its bases."""

    def __prepare_scriptable__(self) -> torch.nn.Module:
        raise RuntimeError(
            f"torch.jit.script cannot compile {type(self).__module__}.{type(self).__qualname__}: its forward "
            "dispatches to Python and Triton kernels that TorchScript does not support; use torch.compile "
            "(flce registers custom ops for it) or call the module eagerly"
        )


class OptionAttributes:
    """A loss module's options (``self.options``, a frozen options dataclass) read and set
    as attributes of the module, as ``torch.nn.CrossEntropyLoss``'s ``reduction`` or
    ``ignore_index`` are: ``loss.reduction = "sum"`` rebuilds ``self.options`` with it,
    validated there (a bad value raises naming the option), and the next call uses it.
    Without this, nn.Module would store the assignment as a new attribute that no call reads.

    A subclass names its options in ``option_names`` (declared once: its properties are made
    from it) and may refuse a combination in ``check_options`` (called on every change)."""

    option_names: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        for name in cls.__dict__.get("option_names", ()):
            setattr(cls, name, property(_option_getter(name), _option_setter(name), doc=f"The option {name}."))

    def check_options(self, options) -> None:
        """Raises for options this module cannot run; every option set passes by default."""


def _option_getter(name: str):
    return lambda module: getattr(module.options, name)


def _option_setter(name: str):
    def set_option(module, value) -> None:
        options = replace(module.options, **{name: value})
        module.check_options(options)
        module.options = options

    return set_option


def refuse_create_graph(entry: str) -> None:
    """Raises when called from a backward that autograd runs with ``create_graph=True``
    (grad mode is on inside a backward exactly then): flce's gradients come from fused
    kernels that autograd cannot differentiate again, and handing back a detached
    gradient would silently drop every higher-order term (a gradient penalty, a
    Hessian-vector product)."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{entry}: backward was called with create_graph=True (torch.autograd.grad(..., create_graph=True) "
            "or .backward(create_graph=True)), but flce's loss has no second derivative: its gradients come "
            "from fused kernels that autograd cannot differentiate again. For higher-order gradients (gradient "
            "penalties, Hessian-vector products) compute this loss with eager PyTorch "
            "(torch.nn.functional.cross_entropy on the logits), or call backward without create_graph=True."
        )


def first_order_backward(entry: str):
    """Decorator for the ``backward`` of an ``autograd.Function`` whose gradient is not
    differentiable: ``refuse_create_graph(entry)`` first, then the backward (run with
    grad mode off, as autograd runs it without ``create_graph``). Replaces
    ``once_differentiable``, which returns a detached gradient there instead."""

    def decorate(backward):
        @functools.wraps(backward)
        def checked(ctx, *grad_outputs):
            refuse_create_graph(entry)
            return backward(ctx, *grad_outputs)

        return checked

    return decorate


def check_class_weight(name: str, class_weight: torch.Tensor | None) -> None:
    """The checks of ``class_weight`` that need no vocabulary: a dense, floating-point, 1-D
    tensor of finite, non-negative weights (None passes); errors name it ``name``. The
    forward checks the rest (shape (V,), device) against its operands."""
    if class_weight is None:
        return
    check_tensor_type(name, class_weight)
    _check_class_weight_kind(name, class_weight)
    if class_weight.dim() != 1:
        raise ValueError(f"{name} must have shape (V,) (one weight per class), got {tuple(class_weight.shape)}")
    # One host read, once per module or patch; none for a meta tensor (no values yet) or
    # while torch.compile traces a forward that builds the loss (the call checks them then).
    readable = class_weight.device.type != "meta" and not torch.compiler.is_compiling()
    if readable and not bool(((class_weight >= 0) & class_weight.isfinite()).all()):
        raise ValueError(bad_class_weights_message(name))


def register_class_weight(module: torch.nn.Module, name: str, class_weight: torch.Tensor | None) -> None:
    """``class_weight`` as ``module.<name>``, checked (``check_class_weight``) and registered
    as a buffer outside the state dict, so that it follows ``.to()``/``.cuda()`` of a model
    holding the loss without adding a checkpoint key."""
    check_class_weight(name, class_weight)
    module.register_buffer(name, class_weight, persistent=False)
