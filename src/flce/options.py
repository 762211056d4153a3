"""Loss options: one frozen dataclass, built and validated once at the API boundary.

Every check here runs before any kernel, names the offending argument and says what
was expected. Tensor checks that need the data (target range) run in the driver as
one batched device-to-host read (``flce.driver.batch_statistics``).
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
import sys
from dataclasses import dataclass, fields

import torch

from flce.dispatch import backend_name

REDUCTIONS = ("mean", "sum", "none")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


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
        self._set("ignore_index", as_int("ignore_index", self.ignore_index))
        if not INT64_MIN <= self.ignore_index <= INT64_MAX:
            raise ValueError(f"ignore_index must fit in int64 (the kernels compare it as one), got {self.ignore_index}")
        self._set("lse_square_scale", as_float("lse_square_scale", self.lse_square_scale))
        if self.lse_square_scale < 0:
            raise ValueError(f"lse_square_scale must be >= 0, got {self.lse_square_scale}")
        self._set("label_smoothing", as_float("label_smoothing", self.label_smoothing))
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {self.label_smoothing}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        if self.softcap is not None:
            self._set("softcap", as_float("softcap", self.softcap))
            if not self.softcap > 0:
                raise ValueError(f"softcap must be > 0 or None, got {self.softcap}")
        for flag in ("return_z_loss", "use_token_scaling", "return_token_accuracy", "return_predicted_tokens"):
            self._set(flag, as_bool(flag, getattr(self, flag)))
        if self.accum_dtype is not None and self.accum_dtype not in FLOAT_DTYPES:
            raise ValueError(f"accum_dtype must be None, torch.float32 or the weight's dtype, got {self.accum_dtype!r}")
        for name in ("chunk_size", "vocab_chunk_size"):
            value = getattr(self, name)
            if value is not None:
                self._set(name, as_int(name, value))
                if getattr(self, name) <= 0:
                    raise ValueError(f"{name} must be a positive int or None, got {value}")
        if self.memory_budget is not None:
            self._set("memory_budget", as_int("memory_budget", self.memory_budget))
            if self.memory_budget <= 0:
                raise ValueError(f"memory_budget must be a positive number of bytes or None, got {self.memory_budget}")
        self._set("backend", backend_name(self.backend))

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)  # normalising a field of the frozen dataclass

    @property
    def needs_z_loss_rows(self) -> bool:
        """Whether the kernel must produce per-row z-loss (it enters the loss or is returned)."""
        return self.lse_square_scale > 0 or self.return_z_loss

    @property
    def returns_structured(self) -> bool:
        return self.return_z_loss or self.return_token_accuracy or self.return_predicted_tokens


# ------------------------------------------- the options as custom-op arguments

OPTION_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(LossOptions))
# Annotation (as written in LossOptions) -> torch.library schema type.
_SCHEMA_TYPES = {"int": "int", "float": "float", "str": "str", "bool": "bool", "torch.dtype": "ScalarType"}


def _schema_type(annotation: str) -> str:
    base, optional = annotation.removesuffix(" | None"), annotation.endswith(" | None")
    return _SCHEMA_TYPES[base] + ("?" if optional else "")


def options_schema() -> str:
    """``LossOptions``' fields as a ``torch.library`` schema fragment (``"int ignore_index,
    float lse_square_scale, ..."``): the custom ops take the options field by field
    without spelling them out."""
    return ", ".join(f"{_schema_type(f.type)} {f.name}" for f in fields(LossOptions))


def option_values(options: LossOptions) -> tuple:
    """The field values in ``OPTION_FIELDS`` order (normalised to the schema's Python
    types by ``LossOptions``' validation)."""
    return tuple(getattr(options, name) for name in OPTION_FIELDS)


def options_from_values(values) -> LossOptions:
    return LossOptions(**dict(zip(OPTION_FIELDS, values, strict=True)))


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
    integers and floats), not a bool, a tensor, NaN or Inf."""
    if not _is_tensor_or_bool(value) and isinstance(value, numbers.Real) and math.isfinite(value):
        return float(value)
    hint = "; pass float(t)" if isinstance(value, torch.Tensor) else ""
    raise TypeError(f"{name} must be a finite float, got {value!r}{hint}")


def as_bool(name: str, value) -> bool:
    """``value`` as a Python bool: ``True``/``False`` or a NumPy bool, nothing else (a
    flag given as 1 or "yes" is more likely a misplaced argument than a choice)."""
    numpy = sys.modules.get("numpy")
    if isinstance(value, bool) or (numpy is not None and isinstance(value, numpy.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {value!r}")


def check_compute_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {tensor.dtype}")


def validate_target(target: torch.Tensor, leading_shape: torch.Size, rows_name: str) -> None:
    """``target`` holds one integer class index per row of ``rows_name``, whose leading
    (all but the last) dimensions are ``leading_shape``: ``(N,)``, or ``(B, T)`` against
    a 3-D ``(B, T, ·)`` tensor (a 1-D target of ``B * T`` values is taken as the rows in
    order; a 2-D target of ``N`` values against a 2-D tensor likewise)."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"target must be an integer tensor (int64 or int32), got {target.dtype}")
    if len(leading_shape) == 2 and target.dim() == 2 and tuple(target.shape) != tuple(leading_shape):
        raise ValueError(f"target must be (B, T) = {tuple(leading_shape)}, got {tuple(target.shape)}")
    if target.dim() not in (1, 2):
        raise ValueError(f"target must be (N,) or (B, T), got shape {tuple(target.shape)}")
    expected_rows = leading_shape.numel()
    if target.numel() != expected_rows:
        raise ValueError(
            f"target must have one class index per row of {rows_name} ({expected_rows} values), "
            f"got shape {tuple(target.shape)}"
        )


def validate_ce_weight(ce_weight: torch.Tensor | None, vocab: int, device: torch.device, name: str) -> None:
    if ce_weight is None:
        return
    if not isinstance(ce_weight, torch.Tensor):
        raise TypeError(f"{name} must be a tensor of shape ({vocab},) or None, got {type(ce_weight).__name__}")
    if not ce_weight.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {ce_weight.dtype}")
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


def validate_fused_inputs(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ce_weight: torch.Tensor | None,
    options: LossOptions,
) -> torch.dtype:
    """Shape/dtype/device checks for the fused linear + CE; returns the compute dtype."""
    for name, t in (("input", input), ("weight", weight), ("target", target)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a tensor of shape (V,) or None, got {type(bias).__name__}")
    for name, t in (("input", input), ("weight", weight), ("bias", bias)):
        _refuse_dtensor(name, t)
    if input.dim() not in (2, 3):
        raise ValueError(f"input must be (N, H) or (B, T, H), got shape {tuple(input.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be (V, H), got shape {tuple(weight.shape)}")
    hidden = input.shape[-1]
    if weight.shape[1] != hidden:
        raise ValueError(f"weight must be (V, H) with H = input.shape[-1] = {hidden}, got shape {tuple(weight.shape)}")
    vocab = weight.shape[0]
    if vocab == 0:
        raise ValueError("weight must have at least one row (V >= 1)")
    validate_target(target, input.shape[:-1], "input")
    refuse_meta("input", input)
    device = input.device
    for name, t in (("weight", weight), ("target", target), ("bias", bias)):
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but input is on {device}; all tensors must share a device")
    if bias is not None and bias.shape != (vocab,):
        raise ValueError(f"bias must have shape ({vocab},) = (V,), got {tuple(bias.shape)}")
    validate_ce_weight(ce_weight, vocab, device, "ce_weight")
    dtype = resolve_compute_dtype(device, input, weight, bias, names=("input", "weight", "bias"))
    _check_accum_dtype(options, weight.dtype)
    return dtype


def _refuse_dtensor(name: str, tensor: torch.Tensor | None) -> None:
    """A sharded DTensor reaching the single-device loss is a usage error, not something
    to gather silently: gathering would double-count gradients under data parallelism."""
    if tensor is None or type(tensor).__name__ != "DTensor":
        return
    placements = getattr(tensor, "placements", "?")
    raise TypeError(
        f"{name} is a DTensor with placements {placements}; flce's loss takes local tensors. "
        "Under FSDP2 (fully_shard), compute the loss inside the forward of a module whose "
        "parameters FSDP has unsharded (e.g. the causal-LM model that owns lm_head, without "
        "wrapping lm_head in its own fully_shard unit), where they are plain tensors. For a "
        "vocabulary-sharded (tensor-parallel) weight use "
        "flce.parallel.vocab_parallel_fused_linear_cross_entropy."
    )


def validate_logits_inputs(
    logits: torch.Tensor, target: torch.Tensor, ce_weight: torch.Tensor | None, options: LossOptions
) -> None:
    if not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TypeError("logits and target must be torch.Tensors")
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
