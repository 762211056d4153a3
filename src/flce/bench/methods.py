"""The methods the benchmark compares, and the inputs they run on.

Every method is a ``Method``: a name, a ``check`` that says why it cannot run a
case (missing package, wrong device, unsupported dtype/shape/feature) or None,
and a ``make_loss`` that returns a zero-argument callable computing the loss on
shared inputs. The floor (the cuBLAS GEMMs alone) is a method too, with its own
workload per mode. Optional peers are imported lazily, so a missing one is a
skip reason and never an import error.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache, lru_cache
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from flce.bench.timing import Workload

MODES = ("fwd", "bwd", "full")
FEATURES = ("label_smoothing", "z_loss", "softcap", "weights")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def dtype_name(dtype: torch.dtype) -> str:
    """The ``--dtype`` name of ``dtype`` (bf16, fp16, fp32)."""
    return next(k for k, v in DTYPES.items() if v == dtype)

FLCE_BACKENDS = ("torch", "triton", "cutedsl")
FLOOR = "floor:gemm"

# Feature values: typical of LLM training recipes (Gemma-2 softcap 30, PaLM z-loss 1e-4).
LABEL_SMOOTHING = 0.1
LSE_SQUARE_SCALE = 1e-4
SOFTCAP = 30.0

# GEMM multiply-adds per mode, in units of N*V*H (2 flops each): logits; dX + dW; all three.
FLOPS_PER_NVH = {"fwd": 2, "bwd": 4, "full": 6}


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
class LossOptions:
    """Loss options shared by every method of a run (turned on by ``--features``)."""

    reduction: str = "mean"
    ignore_index: int = -100
    label_smoothing: float = 0.0
    lse_square_scale: float = 0.0
    softcap: float | None = None
    use_weights: bool = False

    @classmethod
    def from_features(cls, features: Sequence[str], reduction: str = "mean") -> LossOptions:
        unknown = sorted(set(features) - set(FEATURES))
        if unknown:
            raise ValueError(f"unknown feature(s) {unknown}; choose among {list(FEATURES)}")
        return cls(
            reduction=reduction,
            label_smoothing=LABEL_SMOOTHING if "label_smoothing" in features else 0.0,
            lse_square_scale=LSE_SQUARE_SCALE if "z_loss" in features else 0.0,
            softcap=SOFTCAP if "softcap" in features else None,
            use_weights="weights" in features,
        )

    def enabled(self) -> tuple[str, ...]:
        """The features that are on, by their ``--features`` names."""
        on = {
            "label_smoothing": self.label_smoothing != 0.0,
            "z_loss": self.lse_square_scale != 0.0,
            "softcap": self.softcap is not None,
            "weights": self.use_weights,
        }
        return tuple(name for name in FEATURES if on[name])


@dataclass(frozen=True)
class Case:
    """What one measurement runs: a shape, a dtype, a mode and the loss options."""

    shape: Shape
    dtype: torch.dtype
    mode: str
    loss: LossOptions
    device: torch.device


@dataclass
class Inputs:
    """Tensors shared by all methods at one shape (allocated once, before timing)."""

    x: torch.Tensor
    w: torch.Tensor
    target: torch.Tensor
    ce_weight: torch.Tensor | None


def make_inputs(case: Case, seed: int = 0, ignore_fraction: float = 0.0) -> Inputs:
    """Random inputs whose softmax is peaked at the target on most rows.

    W has rows of unit norm on average, so plain logits are ~N(0, 1); each row of
    X gets ``a * W[target]`` added, with ``a`` uniform in [0, 1.5 ln V], which lifts
    the target logit by ``a``: rows range from flat to confidently right, as in a
    trained model, and nothing is zero.
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
    needs_grad = case.mode != "fwd"
    x = x.to(case.dtype).requires_grad_(needs_grad)
    w = w.to(case.dtype).requires_grad_(needs_grad)
    return Inputs(x=x, w=w, target=target, ce_weight=ce_weight)


LossFn = Callable[[], torch.Tensor]
CheckFn = Callable[[Case], str | None]
MakeLossFn = Callable[[Case, Inputs], LossFn]


@dataclass(frozen=True)
class Method:
    """One competitor. ``check`` returns why it cannot run a case, or None."""

    name: str
    label: str
    family: str
    check: CheckFn
    make_loss: MakeLossFn | None = None
    chunk_size: int | None = None
    is_floor: bool = False
    base: str = field(default="")

    @property
    def base_name(self) -> str:
        """The name without a chunk-size suffix (``flce:triton`` for ``flce:triton[chunk=4096]``)."""
        return self.base or self.name

    def workload(self, case: Case, inputs: Inputs) -> Workload:
        """The timed unit of work of this method in ``case.mode``."""
        if self.is_floor:
            return floor_workload(case, inputs)
        assert self.make_loss is not None
        return loss_workload(self.make_loss(case, inputs), inputs, case.mode)


# ----------------------------------------------------------------------------- workloads


def as_loss(out: Any) -> torch.Tensor:
    """The loss tensor of a method's return value (tensor, tuple or output object)."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "loss"):
        return out.loss
    if isinstance(out, (tuple, list)):
        return out[0]
    raise TypeError(f"cannot find a loss in {type(out).__name__}")


def loss_workload(loss_fn: LossFn, inputs: Inputs, mode: str) -> Workload:
    """fwd: forward under no_grad; full: forward + backward; bwd: backward only
    (the forward runs in the untimed setup). Gradients are dropped after each
    call so they are allocated afresh, and counted, by the next one."""
    params = (inputs.x, inputs.w)

    def drop_grads() -> None:
        for p in params:
            p.grad = None

    if mode == "fwd":

        def run_fwd(_: Any) -> torch.Tensor:
            with torch.no_grad():
                return loss_fn()

        return Workload(setup=lambda: None, run=run_fwd)
    if mode == "full":

        def run_full(_: Any) -> torch.Tensor:
            loss = loss_fn()
            loss.backward()
            return loss.detach()

        return Workload(setup=lambda: None, run=run_full, teardown=drop_grads)
    if mode == "bwd":

        def run_bwd(loss: torch.Tensor) -> torch.Tensor:
            loss.backward()
            return loss.detach()

        return Workload(setup=loss_fn, run=run_bwd, teardown=drop_grads)
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def floor_workload(case: Case, inputs: Inputs) -> Workload:
    """The GEMMs no LM-head loss can avoid, in the input dtype.

    fwd: logits = X Wᵀ. full: logits, then dX = G W and dW = Gᵀ X with the logits
    standing in for G. bwd: dX and dW from a random G allocated here, outside the
    measurement, as a forward would have left it.
    """
    x, w = inputs.x.detach(), inputs.w.detach()
    if case.mode == "fwd":
        return Workload(setup=lambda: None, run=lambda _: torch.mm(x, w.t()))
    if case.mode == "full":

        def run_full(_: Any) -> tuple[torch.Tensor, torch.Tensor]:
            logits = torch.mm(x, w.t())
            return torch.mm(logits, w), torch.mm(logits.t(), x)

        return Workload(setup=lambda: None, run=run_full)
    if case.mode == "bwd":
        gen = torch.Generator(device=case.device).manual_seed(1)
        grad = torch.randn(case.shape.n, case.shape.v, generator=gen, device=case.device, dtype=case.dtype)
        grad.mul_(1e-2)
        return Workload(setup=lambda: None, run=lambda _: (torch.mm(grad, w), torch.mm(grad.t(), x)))
    raise ValueError(f"mode must be one of {MODES}, got {case.mode!r}")


# ----------------------------------------------------------------------------- optional imports


# Distribution (pip) names of the optional packages, for skip reasons.
DISTRIBUTIONS = {"liger_kernel": "liger-kernel", "cut_cross_entropy": "cut-cross-entropy", "flce": "flce"}


def _installed(top: str) -> bool:
    """Whether a top-level package can be imported at all (a None entry in
    ``sys.modules`` marks one as deliberately absent)."""
    if top in sys.modules:
        return sys.modules[top] is not None
    return importlib.util.find_spec(top) is not None


@cache
def _import(module: str) -> tuple[ModuleType | None, str]:
    """``(module, "")`` or ``(None, why it does not import)``; cached."""
    top = module.split(".")[0]
    if not _installed(top):
        return None, f"{DISTRIBUTIONS.get(top, top)} is not installed"
    try:
        return importlib.import_module(module), ""
    except Exception as exc:  # noqa: BLE001 - any import failure is a skip reason
        return None, f"{module} does not import ({type(exc).__name__}: {exc})"


def _needs_cuda(case: Case) -> str | None:
    return None if case.device.type == "cuda" else "needs a CUDA device"


def _unsupported_features(case: Case, supported: Sequence[str], who: str) -> str | None:
    missing = [f for f in case.loss.enabled() if f not in supported]
    if missing:
        return f"{who} does not support {', '.join(missing)}"
    return None


def _first_reason(*reasons: Callable[[], str | None]) -> str | None:
    """The first non-None reason, evaluating lazily in order."""
    for reason in reasons:
        why = reason()
        if why:
            return why
    return None


# ----------------------------------------------------------------------------- flce backends


def _flce_function() -> tuple[Callable[..., Any] | None, str]:
    module, why = _import("flce")
    if module is None:
        return None, why
    fn = getattr(module, "fused_linear_cross_entropy", None)
    if fn is None:
        return None, "flce.fused_linear_cross_entropy is missing"
    return fn, ""


def _flce_check(backend: str, chunk_size: int | None) -> CheckFn:
    def check(case: Case) -> str | None:
        fn, why = _flce_function()
        if fn is None:
            return why
        dispatch, why = _import("flce.dispatch")
        if dispatch is None:
            return why
        ok, reason = dispatch.availability(backend, case.device)
        if not ok:
            return f"backend {backend!r} unavailable: {reason}"
        if chunk_size is not None and "chunk_size" not in inspect.signature(fn).parameters:
            return "flce.fused_linear_cross_entropy takes no chunk_size"
        return None

    return check


def flce_loss_kwargs(opts: LossOptions, backend: str | None) -> dict[str, Any]:
    """Keyword arguments of the public flce functions for the run's loss options."""
    return {
        "ignore_index": opts.ignore_index,
        "lse_square_scale": opts.lse_square_scale,
        "label_smoothing": opts.label_smoothing,
        "reduction": opts.reduction,
        "softcap": opts.softcap,
        "backend": backend,
    }


def _flce_make(backend: str, chunk_size: int | None, vocab_blocks: int | None = None) -> MakeLossFn:
    def make(case: Case, inputs: Inputs) -> LossFn:
        fn, why = _flce_function()
        if fn is None:
            raise RuntimeError(why)
        kwargs: dict[str, Any] = {"ce_weight": inputs.ce_weight, **flce_loss_kwargs(case.loss, backend)}
        if chunk_size is not None:
            kwargs["chunk_size"] = chunk_size
        if vocab_blocks is not None:
            kwargs["vocab_chunk_size"] = -(-inputs.w.shape[0] // vocab_blocks)
        return lambda: as_loss(fn(inputs.x, inputs.w, inputs.target, **kwargs))

    return make


def flce_methods(chunk_sizes: Sequence[int | None] = (None,)) -> list[Method]:
    """One method per flce backend and chunk size (None: the library's default)."""
    methods = []
    for backend in FLCE_BACKENDS:
        base = f"flce:{backend}"
        for chunk in chunk_sizes:
            name = base if chunk is None else f"{base}[chunk={chunk}]"
            label = f"flce {backend}" + ("" if chunk is None else f" (chunk {chunk})")
            methods.append(
                Method(
                    name=name,
                    label=label,
                    family="flce",
                    check=_flce_check(backend, chunk),
                    make_loss=_flce_make(backend, chunk),
                    chunk_size=chunk,
                    base=base,
                )
            )
    # The exact low-memory mode: the vocabulary in LOW_MEMORY_VOCAB_BLOCKS blocks as well.
    for backend in ("triton", "cutedsl", "torch"):
        methods.append(
            Method(
                name=f"flce:{backend}[vblocks={LOW_MEMORY_VOCAB_BLOCKS}]",
                label=f"flce {backend} (vocabulary in {LOW_MEMORY_VOCAB_BLOCKS} blocks)",
                family="flce",
                check=_flce_check(backend, None),
                make_loss=_flce_make(backend, None, LOW_MEMORY_VOCAB_BLOCKS),
            )
        )
    return methods


# Vocabulary blocks of the low-memory method. With every row in one chunk each dW block is
# written directly, so the extra memory is dW + dX (+ its fp32 accumulator) + one block of
# logits: 1/16 of them is 0.12 GiB at N=8192, V=128256, while each block GEMM
# (8016 columns x 8192 rows) stays large enough to run at full speed.
LOW_MEMORY_VOCAB_BLOCKS = 16


# ----------------------------------------------------------------------------- PyTorch baselines


def eager_loss(
    x: torch.Tensor,
    w: torch.Tensor,
    target: torch.Tensor,
    ce_weight: torch.Tensor | None,
    opts: LossOptions,
) -> torch.Tensor:
    """The Hugging Face recipe: materialized logits, upcast to fp32, then cross_entropy;
    softcap and z-loss are applied to the fp32 logits as extra elementwise passes."""
    return eager_cross_entropy(F.linear(x, w).float(), target, ce_weight, opts)


def eager_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ce_weight: torch.Tensor | None,
    opts: LossOptions,
) -> torch.Tensor:
    """``F.cross_entropy`` on given logits in their own dtype, with softcap and z-loss as
    extra elementwise passes (``eager_loss`` passes fp32 logits)."""
    if opts.softcap is not None:
        logits = opts.softcap * torch.tanh(logits / opts.softcap)
    loss = F.cross_entropy(
        logits,
        target,
        weight=None if ce_weight is None else ce_weight.to(logits.dtype),  # F.cross_entropy wants one dtype
        ignore_index=opts.ignore_index,
        label_smoothing=opts.label_smoothing,
        reduction=opts.reduction,
    )
    if opts.lse_square_scale != 0.0:
        valid = target != opts.ignore_index
        z = (torch.logsumexp(logits, dim=-1).square() * valid).sum() * opts.lse_square_scale
        loss = loss + (z / valid.sum().clamp_min(1) if opts.reduction == "mean" else z)
    return loss


def _eager_make(case: Case, inputs: Inputs) -> LossFn:
    return lambda: eager_loss(inputs.x, inputs.w, inputs.target, inputs.ce_weight, case.loss)


@lru_cache(maxsize=1)
def _compiled_eager() -> Callable[..., torch.Tensor]:
    return torch.compile(eager_loss, dynamic=False)


def _compile_check(case: Case) -> str | None:
    return None if hasattr(torch, "compile") else "torch.compile is missing"


def _compile_make(case: Case, inputs: Inputs) -> LossFn:
    fn = _compiled_eager()
    return lambda: fn(inputs.x, inputs.w, inputs.target, inputs.ce_weight, case.loss)


def _torch_lce_check(case: Case) -> str | None:
    fn = getattr(F, "linear_cross_entropy", None)
    if fn is None:
        return f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy"
    if "options" not in inspect.signature(fn).parameters or not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        return "torch.nn.functional.linear_cross_entropy has no chunked path (options)"
    # Its chunked path falls back to materialized logits for label smoothing.
    return _unsupported_features(case, ("weights",), "torch linear_cross_entropy (chunked)")


def _torch_lce_make(case: Case, inputs: Inputs) -> LossFn:
    fn = F.linear_cross_entropy
    options = torch.nn.LinearCrossEntropyOptions()
    opts = case.loss
    return lambda: fn(
        inputs.x,
        inputs.w,
        inputs.target,
        weight=inputs.ce_weight,
        reduction=opts.reduction,
        ignore_index=opts.ignore_index,
        options=options,
    )


# ----------------------------------------------------------------------------- Liger-Kernel

LIGER_FUNCTIONAL = "liger_kernel.transformers.functional"
LIGER_SM90 = "liger_kernel.ops.cutedsl.ops.fused_linear_cross_entropy_sm90"
# Tile sizes of Liger's SM90 kernel, which rejects other multiples.
LIGER_SM90_TILE_M = 128
LIGER_SM90_TILE_N = 256


def _liger_triton_check(case: Case) -> str | None:
    return _first_reason(lambda: _import(LIGER_FUNCTIONAL)[1], lambda: _needs_cuda(case))


def _liger_triton_make(case: Case, inputs: Inputs) -> LossFn:
    fn = _import(LIGER_FUNCTIONAL)[0].liger_fused_linear_cross_entropy
    opts = case.loss
    return lambda: as_loss(
        fn(
            inputs.x,
            inputs.w,
            inputs.target,
            ce_weight=inputs.ce_weight,
            ignore_index=opts.ignore_index,
            lse_square_scale=opts.lse_square_scale,
            label_smoothing=opts.label_smoothing,
            reduction=opts.reduction,
            softcap=opts.softcap,
        )
    )


def _liger_sm90_shape_check(case: Case) -> str | None:
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


def _liger_sm90_check(case: Case) -> str | None:
    return _first_reason(
        lambda: _import(LIGER_SM90)[1],
        lambda: _needs_cuda(case),
        lambda: _unsupported_features(case, (), "Liger CuTe SM90 FLCE"),
        lambda: _liger_sm90_shape_check(case),
    )


def _liger_sm90_make(case: Case, inputs: Inputs) -> LossFn:
    fn = _import(LIGER_SM90)[0].liger_fused_linear_cross_entropy_sm90
    opts = case.loss
    return lambda: fn(inputs.x, inputs.w, inputs.target, opts.ignore_index, opts.reduction)


# ----------------------------------------------------------------------------- Apple CCE

CCE = "cut_cross_entropy"


def _cce_check(case: Case) -> str | None:
    return _first_reason(
        lambda: _import(CCE)[1],
        lambda: _needs_cuda(case),
        lambda: _unsupported_features(case, ("softcap",), "CCE"),
    )


def _cce_make(case: Case, inputs: Inputs) -> LossFn:
    fn = _import(CCE)[0].linear_cross_entropy
    opts = case.loss
    return lambda: fn(
        inputs.x,
        inputs.w,
        inputs.target,
        ignore_index=opts.ignore_index,
        softcap=opts.softcap,
        reduction=opts.reduction,
    )


# ----------------------------------------------------------------------------- registry


def _always(case: Case) -> str | None:
    return None


def floor_method() -> Method:
    return Method(name=FLOOR, label="GEMMs alone (floor)", family="floor", check=_always, is_floor=True)


def peer_methods() -> list[Method]:
    """The non-flce competitors, in table order."""
    return [
        Method("torch:eager", "torch eager (fp32 logits)", "torch", _always, _eager_make),
        Method("torch:compile", "torch.compile (fp32 logits)", "torch", _compile_check, _compile_make),
        Method("torch:lce", "torch linear_cross_entropy", "torch", _torch_lce_check, _torch_lce_make),
        Method("liger:triton", "Liger Triton FLCE", "liger", _liger_triton_check, _liger_triton_make),
        Method("liger:cute-sm90", "Liger CuTe SM90 FLCE", "liger", _liger_sm90_check, _liger_sm90_make),
        Method("cce", "Apple CCE", "cce", _cce_check, _cce_make),
    ]


def all_methods(chunk_sizes: Sequence[int | None] = (None,)) -> list[Method]:
    """Every known method: the floor first, then flce backends, then peers."""
    return [floor_method(), *flce_methods(chunk_sizes), *peer_methods()]


def method_names() -> list[str]:
    """Names accepted by ``--methods`` (besides family names such as ``flce``)."""
    return [m.name for m in all_methods()]


def select_methods(
    methods: Sequence[Method],
    wanted: Sequence[str] | None,
) -> list[Method]:
    """The methods matching ``wanted`` (names, base names or families), floor always.

    None selects everything. An unknown name raises ValueError listing the choices.
    """
    if wanted is None:
        return list(methods)
    keys = {key for m in methods for key in (m.name, m.base_name, m.family)}
    unknown = [w for w in wanted if w not in keys]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose among {sorted(keys)}")
    chosen = set(wanted)
    return [m for m in methods if m.is_floor or chosen & {m.name, m.base_name, m.family}]
