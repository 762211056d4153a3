"""Loss options: one frozen dataclass, built and validated once at the API boundary.

Every check here runs before any kernel, names the offending argument and says what
was expected. Tensor checks that need the data (target range) run in the driver as
one batched device-to-host read (``flce.driver.batch_statistics``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

REDUCTIONS = ("mean", "sum", "none")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class LossOptions:
    """Options of one loss call (everything but the tensors)."""

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

    def __post_init__(self) -> None:
        check_int("ignore_index", self.ignore_index)
        _check_number("lse_square_scale", self.lse_square_scale)
        if self.lse_square_scale < 0:
            raise ValueError(f"lse_square_scale must be >= 0, got {self.lse_square_scale}")
        _check_number("label_smoothing", self.label_smoothing)
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {self.label_smoothing}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        if self.softcap is not None:
            _check_number("softcap", self.softcap)
            if not self.softcap > 0:
                raise ValueError(f"softcap must be > 0 or None, got {self.softcap}")
        for flag in ("return_z_loss", "use_token_scaling", "return_token_accuracy", "return_predicted_tokens"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        if self.accum_dtype is not None and self.accum_dtype not in FLOAT_DTYPES:
            raise ValueError(f"accum_dtype must be None, torch.float32 or the weight's dtype, got {self.accum_dtype!r}")
        if self.chunk_size is not None:
            check_int("chunk_size", self.chunk_size)
            if self.chunk_size <= 0:
                raise ValueError(f"chunk_size must be a positive int or None, got {self.chunk_size}")
        if self.vocab_chunk_size is not None:
            check_int("vocab_chunk_size", self.vocab_chunk_size)
            if self.vocab_chunk_size <= 0:
                raise ValueError(f"vocab_chunk_size must be a positive int or None, got {self.vocab_chunk_size}")
        if self.backend is not None and not isinstance(self.backend, str):
            raise TypeError(f"backend must be a str or None, got {self.backend!r}")

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


_FLOAT_FIELDS = frozenset(f.name for f in fields(LossOptions) if f.type.startswith("float"))


def option_values(options: LossOptions) -> tuple:
    """The field values in ``OPTION_FIELDS`` order, floats as ``float`` (the schema's type)."""
    return tuple(
        float(v) if name in _FLOAT_FIELDS and v is not None else v
        for name, v in ((name, getattr(options, name)) for name in OPTION_FIELDS)
    )


def options_from_values(values) -> LossOptions:
    return LossOptions(**dict(zip(OPTION_FIELDS, values, strict=True)))


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite float, got {value!r}")


def check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")


def check_compute_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {tensor.dtype}")


def validate_target(target: torch.Tensor, expected_rows: int, rows_name: str) -> None:
    if target.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"target must be an integer tensor (int64 or int32), got {target.dtype}")
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
    if input.dim() == 3 and target.dim() == 2 and tuple(target.shape) != tuple(input.shape[:2]):
        raise ValueError(f"target must be (B, T) = {tuple(input.shape[:2])}, got {tuple(target.shape)}")
    if target.dim() not in (1, 2):
        raise ValueError(f"target must be (N,) or (B, T), got shape {tuple(target.shape)}")
    validate_target(target, input.shape[:-1].numel(), "input")
    device = input.device
    for name, t in (("weight", weight), ("target", target), ("bias", bias)):
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but input is on {device}; all tensors must share a device")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a tensor of shape ({vocab},) or None, got {type(bias).__name__}")
        if bias.shape != (vocab,):
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
    validate_target(target, logits.shape[:-1].numel(), "logits")
    if target.device != logits.device:
        raise ValueError(f"target is on {target.device} but logits are on {logits.device}; put them on one device")
    validate_ce_weight(ce_weight, vocab, logits.device, "weight")
    if options.accum_dtype is not None:
        raise ValueError("accum_dtype applies to the fused linear loss only; pass None for cross_entropy")
    if options.vocab_chunk_size is not None:
        raise ValueError("vocab_chunk_size applies to the fused linear loss only; pass None for cross_entropy")


def _check_accum_dtype(options: LossOptions, param_dtype: torch.dtype) -> None:
    if options.accum_dtype not in (None, torch.float32, param_dtype):
        raise ValueError(
            f"accum_dtype must be None, torch.float32 or the weight's dtype ({param_dtype}), got {options.accum_dtype}"
        )
