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
FEATURES = ("label_smoothing", "z_loss", "softcap", "weights", "bias", "token_scaling", "accuracy", "predicted")
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
# The LM-head bias of ``--features bias``: N(0, BIAS_STD²), small next to the logits' unit
# spread, so that the rows stay as peaked at the target as without it.
BIAS_STD = 0.1

# The features that are flags of flce's call, by the keyword flce and Liger's FLCE share
# (also the field of ``LossOptions`` that holds each).
FLAG_KEYWORDS = {
    "token_scaling": "use_token_scaling",
    "accuracy": "return_token_accuracy",
    "predicted": "return_predicted_tokens",
}

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
    use_bias: bool = False
    use_token_scaling: bool = False
    return_token_accuracy: bool = False
    return_predicted_tokens: bool = False

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
    bias: torch.Tensor | None = None  # (V,) in the dtype of w, a parameter like it

    def params(self) -> tuple[torch.Tensor, ...]:
        """The tensors a backward gives gradients: X, W and the bias when there is one."""
        return (self.x, self.w) if self.bias is None else (self.x, self.w, self.bias)


def make_inputs(case: Case, seed: int = 0, ignore_fraction: float = 0.0) -> Inputs:
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
    call so they are allocated afresh, and counted, by the next one. Only the loss
    takes part in the backward: per-token outputs (accuracy, predicted tokens) have no grad."""
    params = inputs.params()

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

    The bias of ``--features bias`` is left out: adding it and summing its gradient are
    O(N·V) elementwise work beside the O(N·V·H) GEMMs, which is what the floor measures.
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
    """Keyword arguments of the public flce functions (and of ``flce.options.LossOptions``)
    for the run's loss options; the tensors (bias, class weights) are passed apart."""
    return {
        "ignore_index": opts.ignore_index,
        "lse_square_scale": opts.lse_square_scale,
        "label_smoothing": opts.label_smoothing,
        "reduction": opts.reduction,
        "softcap": opts.softcap,
        "use_token_scaling": opts.use_token_scaling,
        "return_token_accuracy": opts.return_token_accuracy,
        "return_predicted_tokens": opts.return_predicted_tokens,
        "backend": backend,
    }


def _flce_make(backend: str, chunk_size: int | None, vocab_blocks: int | None = None) -> MakeLossFn:
    def make(case: Case, inputs: Inputs) -> LossFn:
        fn, why = _flce_function()
        if fn is None:
            raise RuntimeError(why)
        kwargs: dict[str, Any] = {
            "bias": inputs.bias,
            "ce_weight": inputs.ce_weight,
            **flce_loss_kwargs(case.loss, backend),
        }
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


# The loss alone, or (loss, token accuracy, predicted tokens) when either of the last two
# is asked for (the one not asked for is None): flce's convention, and a tuple compiles.
EagerResult = torch.Tensor | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def eager_loss(
    x: torch.Tensor,
    w: torch.Tensor,
    target: torch.Tensor,
    ce_weight: torch.Tensor | None,
    opts: LossOptions,
    bias: torch.Tensor | None = None,
) -> EagerResult:
    """The Hugging Face recipe: materialized logits (the bias added by ``F.linear``), upcast
    to fp32, then cross_entropy; softcap and z-loss are applied to the fp32 logits as extra
    elementwise passes."""
    return eager_cross_entropy(F.linear(x, w, bias).float(), target, ce_weight, opts)


def eager_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ce_weight: torch.Tensor | None,
    opts: LossOptions,
) -> EagerResult:
    """``F.cross_entropy`` on given logits in their own dtype, with softcap and z-loss as
    extra elementwise passes (``eager_loss`` passes fp32 logits); token scaling reduces
    per-row losses by hand, and accuracy and predicted tokens come from an argmax."""
    if opts.softcap is not None:
        logits = opts.softcap * torch.tanh(logits / opts.softcap)
    weight = None if ce_weight is None else ce_weight.to(logits.dtype)  # F.cross_entropy wants one dtype
    valid = target != opts.ignore_index
    loss = F.cross_entropy(
        logits,
        target,
        weight=weight,
        ignore_index=opts.ignore_index,
        label_smoothing=opts.label_smoothing,
        # Token scaling weighs the rows before reducing them.
        reduction="none" if opts.use_token_scaling else opts.reduction,
    )
    if opts.use_token_scaling:
        loss = _token_scaled_reduction(loss, logits, target, weight, valid, opts)
    elif opts.lse_square_scale != 0.0:
        z = (torch.logsumexp(logits, dim=-1).square() * valid).sum() * opts.lse_square_scale
        loss = loss + (z / valid.sum().clamp_min(1) if opts.reduction == "mean" else z)
    if not opts.returns_extras:
        return loss
    return loss, *_eager_token_outputs(logits, target, valid, opts)


def _token_scaled_reduction(
    rows: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    valid: torch.Tensor,
    opts: LossOptions,
) -> torch.Tensor:
    """Each row's cross-entropy (``rows``, from ``reduction="none"``: 0 on ignored rows) and
    z-loss times its detached ``p(target)``, reduced as flce reduces: for ``mean`` the
    cross-entropy over the rows' class weights (their count without weights), the z-loss over
    the count of rows. ``F.cross_entropy`` has no such option, so the sums are taken here."""
    lse = torch.logsumexp(logits, dim=-1)
    safe_target = torch.where(valid, target, 0)  # ignore_index may lie outside [0, V)
    target_logit = logits.gather(1, safe_target[:, None]).squeeze(1)
    scale = torch.exp(target_logit - lse).detach() * valid
    z_rows = opts.lse_square_scale * lse.square() * scale
    rows = rows * scale
    if opts.reduction == "none":
        return rows + z_rows
    if opts.reduction == "sum":
        return rows.sum() + z_rows.sum()
    count = valid.sum().clamp_min(1)
    denominator = count if weight is None else (weight[safe_target] * valid).sum()
    return rows.sum() / denominator + z_rows.sum() / count


def _eager_token_outputs(
    logits: torch.Tensor,
    target: torch.Tensor,
    valid: torch.Tensor,
    opts: LossOptions,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Token accuracy and predicted tokens from the argmax of the (softcapped) logits, as flce
    defines them: the first index wins ties, ignored rows count as wrong and predict -1, and
    ``mean``/``sum`` give the fraction right among the non-ignored rows. Neither has a grad."""
    predicted = torch.where(valid, logits.detach().argmax(dim=-1), -1)
    accuracy = None
    if opts.return_token_accuracy:
        correct = ((predicted == target) & valid).float()
        accuracy = correct if opts.reduction == "none" else correct.sum() / valid.sum().clamp_min(1)
    return accuracy, predicted if opts.return_predicted_tokens else None


def _eager_make(case: Case, inputs: Inputs) -> LossFn:
    return lambda: as_loss(eager_loss(inputs.x, inputs.w, inputs.target, inputs.ce_weight, case.loss, inputs.bias))


@lru_cache(maxsize=1)
def _compiled_eager() -> Callable[..., torch.Tensor]:
    return torch.compile(eager_loss, dynamic=False)


def _compile_check(case: Case) -> str | None:
    return None if hasattr(torch, "compile") else "torch.compile is missing"


def _compile_make(case: Case, inputs: Inputs) -> LossFn:
    fn = _compiled_eager()
    return lambda: as_loss(fn(inputs.x, inputs.w, inputs.target, inputs.ce_weight, case.loss, inputs.bias))


# The bias keyword of ``F.linear_cross_entropy``.
TORCH_LCE_BIAS = "linear_bias"


def _torch_lce_check(case: Case) -> str | None:
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
    return _unsupported_features(case, supported, "torch linear_cross_entropy (chunked)")


def _torch_lce_make(case: Case, inputs: Inputs) -> LossFn:
    fn = F.linear_cross_entropy
    options = torch.nn.LinearCrossEntropyOptions()
    opts = case.loss
    # Passed only when there is one, so a torch without the keyword is called as before.
    bias = {} if inputs.bias is None else {TORCH_LCE_BIAS: inputs.bias}
    return lambda: fn(
        inputs.x,
        inputs.w,
        inputs.target,
        weight=inputs.ce_weight,
        reduction=opts.reduction,
        ignore_index=opts.ignore_index,
        options=options,
        **bias,
    )


# ----------------------------------------------------------------------------- Liger-Kernel

LIGER_FUNCTIONAL = "liger_kernel.transformers.functional"
LIGER_SM90 = "liger_kernel.ops.cutedsl.ops.fused_linear_cross_entropy_sm90"
# Tile sizes of Liger's SM90 kernel, which rejects other multiples.
LIGER_SM90_TILE_M = 128
LIGER_SM90_TILE_N = 256


# Features every Liger Triton FLCE release the benchmark supports takes (the scalar options,
# class weights, bias). The flag features (FLAG_KEYWORDS) are newer: 0.8.5 takes all three,
# and an older release is skipped for those its signature lacks.
LIGER_TRITON_FEATURES = ("label_smoothing", "z_loss", "softcap", "weights", "bias")


def _liger_triton_features() -> tuple[str, ...]:
    """The features this Liger's ``liger_fused_linear_cross_entropy`` takes, read from its signature."""
    params = inspect.signature(_import(LIGER_FUNCTIONAL)[0].liger_fused_linear_cross_entropy).parameters
    return (*LIGER_TRITON_FEATURES, *(f for f, keyword in FLAG_KEYWORDS.items() if keyword in params))


def _liger_triton_check(case: Case) -> str | None:
    return _first_reason(
        lambda: _import(LIGER_FUNCTIONAL)[1],
        lambda: _needs_cuda(case),
        lambda: _unsupported_features(case, _liger_triton_features(), "Liger Triton FLCE"),
    )


def _liger_triton_make(case: Case, inputs: Inputs) -> LossFn:
    fn = _import(LIGER_FUNCTIONAL)[0].liger_fused_linear_cross_entropy
    opts = case.loss
    return lambda: as_loss(
        fn(
            inputs.x,
            inputs.w,
            inputs.target,
            bias=inputs.bias,
            ce_weight=inputs.ce_weight,
            ignore_index=opts.ignore_index,
            lse_square_scale=opts.lse_square_scale,
            label_smoothing=opts.label_smoothing,
            reduction=opts.reduction,
            softcap=opts.softcap,
            **opts.flags(),
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
        # Of the features, cut-cross-entropy 25.1.1 (PyPI) takes the softcap alone.
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
