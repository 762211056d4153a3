"""The contracts between the drivers and a backend: the kernels a backend supplies and
the ``BackendSpec`` it registers with ``flce.dispatch``.

A backend supplies, per loss head, kernels over blocks of rows of logits that compute
per row, in fp32 whatever the logits dtype, every quantity the loss needs and (when
asked) the gradient with respect to the logits, written in place or into ``grad_out``.
The drivers (``flce.driver``) own everything else: GEMMs, chunking, reductions, dW/db
accumulation, autograd. Backends differ in their kernels, not in their control flow.

The cross-entropy kernels answer to the row math of ``flce.rows.cross_entropy``
(formulas, the grouped gradient form and why, ignored rows).

Slots of a ``BackendSpec``:

- ``cross_entropy_chunk`` (``ChunkCEKernel``): whole rows of a token chunk;
- ``split_rows`` (``SplitRowKernels``): rows split into column blocks (vocabulary blocks,
  vocab-parallel shards): block statistics, then the gradient given the whole row's;
- ``loss_only`` (``LossOnlyStatistics``, optional): whole-row statistics straight from
  the GEMM, for calls without gradients and the vocabulary blocks' first pass;
- ``block_gradient`` (``BlockGradientGemm``, optional): the vocabulary blocks' second
  pass, each block's gradient straight from its GEMM, where ``loss_only`` applies;
- ``scale_unless_one`` (optional): the upstream-gradient scaling of the gradients the
  forward computed, skipped on the device when the scale is 1; ``scaled_copies``
  (optional): the same scaling out of place, into new tensors;
- ``batch_statistics`` (optional): a call's batch statistics in one launch, a buffer laid
  out as ``STATISTICS_LAYOUT`` (``flce.driver.statistics``), instead of a score of small
  PyTorch ops;
- ``logprobs`` (``LogprobsKernels``, optional): the logprobs head's chunk kernels
  (``flce.rows.logprobs``);
- ``distillation`` (``DistillationKernels``, optional): the distillation head's chunk
  kernel (``flce.rows.distillation``).

A backend without a head's slot is never picked for that head: auto dispatch takes the
best usable backend that has it, and an explicit request raises naming the missing slot
(``flce.dispatch.resolve_backend``).

The device helpers (``scale_unless_one``, ``scaled_copies``, ``batch_statistics``) serve every backend's
calls on a device where the backend that registers them can run
(``flce.dispatch.device_helper``).

Ignored rows (``ignore_index``) come out exactly zero whatever their logits hold: NaN or
Inf there must not leak out, so kernels select the zeros (or skip the row) instead of
multiplying by a zero row scale (``0 * NaN`` is NaN).

Layouts: a kernel either honours a tensor's strides or copies it (the small per-row and
per-class vectors, with the helpers below); logits need unit stride along V only.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from flce.rows.cross_entropy import BlockStatistics, ChunkScalars, gradient_coefficients
from flce.rows.distillation import DistillationKernel
from flce.rows.logprobs import LogprobsBackwardKernel, LogprobsForwardKernel


class ChunkCEKernel(Protocol):
    """Signature every backend's chunk CE kernel implements.

    Arguments (M rows of one chunk, V the vocabulary):
      logits          (M, V) fp16/bf16/fp32, unit stride along V, any row stride; overwritten with
                      dL/dlogits (same dtype) when ``compute_grad`` is True and ``grad_out``
                      is None, untouched otherwise.
      target          (M,) integer, any strides (``kernel_target``); values in [0, V) or
                      ``ignore_index``.
      ce_weight       (V,) fp32, or None.
      scalars         the per-call ``ChunkScalars``.
      loss_out        (M,) fp32 contiguous (as every ``*_out``), written: ``st * ce`` per row.
      z_loss_out      (M,) fp32 or None: ``st * zl`` per row when given.
      correct_out     (M,) fp32 or None: 1.0 where argmax(z') == y (first index wins ties).
      predicted_out   (M,) int64 or None: argmax(z') (first index wins), -1 on ignored rows.
      row_grad_scale  (M,) fp32 or None: per-row upstream gradient (reduction="none" backward),
                      any strides (``kernel_row_vector``).
      compute_grad    whether to write the gradient (into ``logits``, unless ``grad_out``).
      grad_out        (M, V) logits dtype, unit stride along V, or None: where the gradient
                      goes, the logits then only read (saves the copy a caller who must keep
                      its logits would make); None writes it over the logits.
    """

    def __call__(
        self,
        logits: torch.Tensor,
        target: torch.Tensor,
        ce_weight: torch.Tensor | None,
        scalars: ChunkScalars,
        *,
        loss_out: torch.Tensor,
        z_loss_out: torch.Tensor | None,
        correct_out: torch.Tensor | None,
        predicted_out: torch.Tensor | None,
        row_grad_scale: torch.Tensor | None,
        compute_grad: bool,
        grad_out: torch.Tensor | None = None,
    ) -> None: ...


def softcap_tanh_is_approximate(logits_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the compiled GPU kernels may take the softcap's ``tanh`` from the hardware's
    approximation (PTX ``tanh.approx.f32``: one special-function op, relative error about
    2^-11 by the PTX ISA) instead of the accurate one (two special-function ops and about
    fifteen FMAs), for logits the loss computes itself (``ChunkScalars.approximate_tanh``,
    set by the plan of a fused call): bf16 and fp16 logits on a GPU, whose own rounding
    (2^-9, 2^-11) is as large. The accurate one made the CE pass bound by the
    special-function unit: softcap cost 5.1% (cutedsl) and 7.4% (triton) of a fwd+bwd call
    at the reference shape on an H200 (benchmarks/results/features-h200).

    Logits given by the caller (``flce.cross_entropy``) are exact inputs: there the
    approximation's error showed as 10-50x PyTorch's fp32 error on the loss (H200), so
    they always get the accurate ``tanh``, as do fp32 logits and the CPU (Triton's
    interpreter). The kernels of one call (row statistics, target logit, gradient, the
    split-row ones) apply the same one, so a row's ``z'`` agrees between them bit for bit;
    the loss-only fused GEMM (``backends/cutedsl/fused_forward.py``) takes the
    approximation too (16-bit products only)."""
    return device.type == "cuda" and logits_dtype in (torch.float16, torch.bfloat16)


def unit_stride_along_vocabulary(logits: torch.Tensor) -> bool:
    """Whether a row's classes are adjacent in memory (the kernels' only layout demand on
    logits; the row stride is free). A single column is, whatever its stride says."""
    return logits.shape[-1] <= 1 or logits.stride(-1) == 1


def check_logits_layout(logits: torch.Tensor) -> None:
    """Refuses logits whose classes are not adjacent (``unit_stride_along_vocabulary``).
    Callers that own the logits make them contiguous instead (``flce.functional``); a
    kernel never copies a chunk of logits behind the caller's back."""
    if not unit_stride_along_vocabulary(logits):
        raise ValueError(f"logits must have unit stride along the vocabulary, got strides {tuple(logits.stride())}")


def kernel_target(target: torch.Tensor) -> torch.Tensor:
    """The target as the kernels read it: ``(M,)`` contiguous int64 or int32. A strided
    or expanded (stride-0) target is copied, and other integer dtypes widened to int64:
    M values, nothing next to a chunk of logits (the kernels load ``target_ptr + row``)."""
    if target.dtype not in (torch.int64, torch.int32):
        target = target.long()
    return target.contiguous()


def kernel_row_vector(name: str, vector: torch.Tensor | None, num_rows: int) -> torch.Tensor | None:
    """A per-row fp32 input (``row_grad_scale``, split-row statistics) as the kernels read
    it: ``(M,)`` contiguous fp32, copied when strided or expanded (M values)."""
    if vector is None:
        return None
    if tuple(vector.shape) != (num_rows,):
        raise ValueError(f"{name} must have shape ({num_rows},), got {tuple(vector.shape)}")
    return vector.to(torch.float32).contiguous()


def kernel_class_weights(ce_weight: torch.Tensor | None) -> torch.Tensor | None:
    """Class weights as the kernels read them: ``(V,)`` contiguous fp32 (V values)."""
    return None if ce_weight is None else ce_weight.to(torch.float32).contiguous()


def check_row_outputs(num_rows: int, **outputs: torch.Tensor | None) -> None:
    """Per-row outputs the kernels write at ``ptr + row``: each ``(M,)`` and contiguous.
    They are the driver's own buffers; anything else is a caller bug, refused rather than
    written past or into the wrong rows."""
    for name, out in outputs.items():
        if out is None:
            continue
        if tuple(out.shape) != (num_rows,) or (num_rows > 1 and out.stride(0) != 1):
            raise ValueError(
                f"{name} must be a contiguous ({num_rows},) tensor, got shape {tuple(out.shape)} "
                f"with strides {tuple(out.stride())}"
            )


def gradient_destination(logits: torch.Tensor, grad_out: torch.Tensor | None, compute_grad: bool) -> torch.Tensor:
    """Where a chunk kernel writes the gradient: ``grad_out`` (checked against the
    ``ChunkCEKernel`` contract: the logits' shape, dtype and device, unit stride along V)
    or, without it, the logits themselves; either must give each row its own memory."""
    if not compute_grad:
        return logits
    destination = logits
    if grad_out is not None:
        if grad_out.shape != logits.shape or grad_out.dtype != logits.dtype or grad_out.device != logits.device:
            raise ValueError(
                f"grad_out must match logits ({tuple(logits.shape)}, {logits.dtype}, {logits.device}), got "
                f"({tuple(grad_out.shape)}, {grad_out.dtype}, {grad_out.device})"
            )
        if not unit_stride_along_vocabulary(grad_out):
            raise ValueError(
                f"grad_out must have unit stride along the vocabulary, got strides {tuple(grad_out.stride())}"
            )
        destination = grad_out
    if destination.shape[0] > 1 and destination.stride(0) == 0:
        raise ValueError(
            "the gradient's destination repeats one row (stride 0, e.g. expanded logits written in place); "
            "each row's gradient needs its own memory: pass grad_out"
        )
    return destination


class SplitRowKernels(Protocol):
    """Kernels for rows whose vocabulary is split into column blocks: per block, statistics
    relative to the block's own max; later, given the whole row's max and sum, the
    gradient (``flce.driver.vocab_blocks``, ``flce.parallel``).

    ``extra_bytes_per_logit``: the fp32 workspace per logit beyond the block (0 in place).
    """

    name: str
    extra_bytes_per_logit: int

    def statistics(
        self,
        logits: torch.Tensor,  # (C, V_b) compute dtype, unit stride along V_b
        local_target: torch.Tensor,  # (C,) int64 column of the target, outside [0, V_b) where absent
        ce_local: torch.Tensor | None,  # (V_b,) fp32 class weights of the block's columns
        softcap: float | None,
        *,
        with_smoothing: bool,
        with_argmax: bool,
        approximate_tanh: bool = False,  # ChunkScalars.approximate_tanh
    ) -> BlockStatistics: ...

    def gradient(
        self,
        logits: torch.Tensor,  # (C, V_b); overwritten with dL/dlogits
        grad_target: torch.Tensor,  # (C,) target column in the block, V_b where absent, -1 on ignored rows
        ce_local: torch.Tensor | None,  # (V_b,) fp32
        row_max: torch.Tensor,  # (C,) fp32 the whole row's max of z'
        inv_sum: torch.Tensor,  # (C,) fp32 1 / sum_i exp(z'_i - row_max) over the whole row
        w_y: torch.Tensor,  # (C,) fp32 class weight of the target
        lse: torch.Tensor,  # (C,) fp32
        row_scale: torch.Tensor,  # (C,) fp32 flce.rows.cross_entropy.row_scale (0 on ignored rows)
        scalars: ChunkScalars,
        eps: float,  # label_smoothing / V (the whole vocabulary)
    ) -> None: ...


class InPlaceSplitRowKernels:
    """``SplitRowKernels`` from a kernel module with ``partial_statistics`` and
    ``partial_gradient`` (the contract of ``flce.backends.triton.partial``), imported on
    first use: no fp32 copy of the block."""

    extra_bytes_per_logit = 0

    def __init__(self, name: str, module: str) -> None:
        self.name = name
        self._module = module

    def _kernels(self):
        return importlib.import_module(self._module)

    def statistics(
        self, logits, local_target, ce_local, softcap, *, with_smoothing, with_argmax, approximate_tanh=False
    ) -> BlockStatistics:
        return BlockStatistics(
            *self._kernels().partial_statistics(
                logits, local_target, ce_local, softcap, with_smoothing, with_argmax, approximate_tanh
            )
        )

    def gradient(
        self, logits, grad_target, ce_local, row_max, inv_sum, w_y, lse, row_scale, scalars: ChunkScalars, eps: float
    ) -> None:
        onehot_coef, smooth_coef, z_coef = gradient_coefficients(w_y, lse, row_scale, scalars, eps)
        self._kernels().partial_gradient(
            logits,
            grad_target.contiguous(),
            ce_local,
            row_max.contiguous(),
            inv_sum.contiguous(),
            onehot_coef.contiguous(),
            smooth_coef,
            z_coef,
            scalars.weight_sum,
            scalars.softcap,
            scalars.approximate_tanh,
        )


class BlockGradientGemm(Protocol):
    """Optional slot (``BackendSpec.block_gradient``): the vocabulary blocks' second pass
    in one GEMM whose epilogue writes each block's gradient (the logits never reach
    memory), for the calls whose first pass is the ``loss_only`` slot's fused statistics:
    it takes the operands that slot's ``applicable`` accepted for the whole weight.

    Arguments (C rows of one chunk, V_b the block's columns):
      x            (C, H) compute dtype (bf16/fp16)
      w_block      (V_b, H) compute dtype: the block's rows of the weight
      b_block      (V_b,) compute dtype, or None
      out          (C, V_b) compute dtype, unit stride along V_b, an even row stride and a
                   4-byte aligned start: written with dL/dz of ``softcap(x @ w_block^T + b_block)``
      grad_target  (C,) int: the target's column in the block, V_b where absent, -1 on ignored rows
      row_max, inv_sum   (C,) fp32: the whole row's reference point and 1 / its sum of exp
      onehot_coef, smooth_coef, z_coef   (C,) fp32 (the last two None without label smoothing,
                   z-loss): ``flce.rows.cross_entropy.gradient_coefficients``, folded once per call
      weight_sum   () fp32 on the device; softcap: float or None
    """

    def __call__(
        self,
        x: torch.Tensor,
        w_block: torch.Tensor,
        b_block: torch.Tensor | None,
        out: torch.Tensor,
        grad_target: torch.Tensor,
        row_max: torch.Tensor,
        inv_sum: torch.Tensor,
        onehot_coef: torch.Tensor,
        smooth_coef: torch.Tensor | None,
        z_coef: torch.Tensor | None,
        weight_sum: torch.Tensor,
        softcap: float | None,
    ) -> None: ...


@dataclass(frozen=True)
class LossOnlyStatistics:
    """Optional slot: whole-row statistics of ``z' = softcap(x W^T + b)`` from one GEMM whose
    epilogue reduces each logits tile (no logits buffer), for calls without gradients and
    for the first pass of the vocabulary-block scheme.

    ``applicable(device, compute_dtype, hidden, vocab, weight_tma_ready)`` -> ``(ok, reason)``;
    ``statistics(x, w, target, bias=, softcap=, with_logit_sum=)`` -> dict of (N,) tensors
    ``lse``, ``target_logit``, ``predicted`` (and ``logit_sum``), for operands that
    ``applicable`` accepted and ``flce.driver.fused`` prepared (it need not check them again);
    ``workspace_bytes(num_rows, vocab, with_logit_sum, has_bias)`` -> the bytes
    ``statistics`` allocates, its outputs included (the memory model's term for it).
    """

    applicable: Callable[[torch.device, torch.dtype, int, int, bool], tuple[bool, str]]
    statistics: Callable[..., dict]
    workspace_bytes: Callable[[int, int, bool, bool], int]


@dataclass(frozen=True)
class LogprobsKernels:
    """Optional slot: the logprobs head's chunk kernels (contracts in ``flce.rows.logprobs``).
    ``extra_bytes_per_logit``: their fp32 workspace per logit beyond the chunk."""

    forward: LogprobsForwardKernel
    backward: LogprobsBackwardKernel
    extra_bytes_per_logit: int


@dataclass(frozen=True)
class DistillationKernels:
    """Optional slot: the distillation head's chunk kernel (contract in
    ``flce.rows.distillation``). ``extra_bytes_per_logit``: its fp32 workspace per student
    logit beyond the two chunks (the student's and the teacher's logits)."""

    chunk: DistillationKernel
    extra_bytes_per_logit: int


# Slots of the fp32 statistics buffer (one launch writes them all: a backend's
# ``batch_statistics`` slot, or the PyTorch ops of ``flce.driver.statistics``). The checks'
# counts share it: one allocation, and one copy to the host for the asynchronous checks.
STATISTICS_LAYOUT = (
    "n_valid",  # rows whose target is not ignore_index
    "ce_denominator",  # the mean's divisor of the CE part: sum of w_y, or n_valid
    "weight_sum",  # sum of ce_weight over the vocabulary (V without weights)
    "poison",  # 1, or NaN when an input is bad (the call's outputs become NaN)
    "accuracy_scale",  # 1 / n_valid, 0 when every row is ignored
    "mean_ce_scale",  # ChunkScalars.scales of reduction="mean": poison / ce_denominator (0 if 0),
    "mean_z_scale",  # poison / n_valid (0 if 0),
    "mean_weight_sum",  # weight_sum
    "sum_ce_scale",  # ... and of "sum" / "none": poison,
    "sum_z_scale",  # poison,
    "sum_weight_sum",  # weight_sum
    "bad_targets",  # the checks' counts: valid rows whose target is outside [0, V),
    "bad_weights",  # negative or non-finite class weights (fp32: exact up to 2**24)
)

# The optional per-head slots of ``BackendSpec``, by field name (``flce.dispatch``'s
# ``needs`` argument takes one of them).
HEAD_SLOTS = ("logprobs", "distillation")


@dataclass(frozen=True)
class BackendSpec:
    """What a backend registers with ``flce.dispatch``.

    ``availability(device)`` returns ``(True, "")`` or ``(False, reason)``; the reason
    is shown to users (``flce info``, errors on explicit request). It must be cheap and
    must not raise. ``extra_bytes_per_logit`` is the chunk kernel's fp32 workspace per
    logit beyond the chunk itself (0 for in-place kernels); the driver's chunk sizing
    uses it. ``auto_priority``: higher wins in auto dispatch among available backends.
    ``split_rows`` builds the backend's ``SplitRowKernels`` (every registered backend has
    them; a spec without them cannot run the vocabulary-block or vocab-parallel schemes).
    ``logprobs`` and ``distillation`` hold the other loss heads' kernels, None where the
    backend has none (``HEAD_SLOTS``). ``block_gradient`` serves only calls whose
    vocabulary blocks take their first pass from ``loss_only`` (the same operand demands).
    """

    name: str
    cross_entropy_chunk: ChunkCEKernel
    availability: Callable[[torch.device], tuple[bool, str]]
    extra_bytes_per_logit: int
    auto_priority: int
    description: str
    split_rows: Callable[[], SplitRowKernels] | None = None
    loss_only: LossOnlyStatistics | None = None
    block_gradient: BlockGradientGemm | None = None
    scale_unless_one: Callable[[Sequence[torch.Tensor], torch.Tensor], None] | None = None
    scaled_copies: Callable[[Sequence[torch.Tensor], torch.Tensor], list[torch.Tensor]] | None = None
    batch_statistics: Callable[..., torch.Tensor] | None = None
    logprobs: LogprobsKernels | None = None
    distillation: DistillationKernels | None = None


def device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """The guard of a kernel launch on the CUDA ``device`` (Triton and the CuTe DSL launch
    on the current device): none when it is the current one already, as in most calls (a
    guard sets and restores the device: host time on every launch)."""
    if device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device.index)


def lazy_function(module: str, name: str) -> Callable:
    """``module.name``, imported on its first call, so importing a backend package never
    needs the optional dependency (Triton, CUTLASS) of its kernels."""
    function = None

    def call(*args, **kwargs):
        nonlocal function
        if function is None:
            function = getattr(importlib.import_module(module), name)
        return function(*args, **kwargs)

    call.__doc__ = f"``{module}.{name}``, imported on first use."
    call.__name__ = name
    return call


def lazy_chunk_kernel(module: str) -> ChunkCEKernel:
    """The ``cross_entropy_chunk`` of ``module``, imported on first use."""
    return lazy_function(module, "cross_entropy_chunk")


def lazy_logprobs_kernels(module: str, extra_bytes_per_logit: int) -> LogprobsKernels:
    """The ``logprobs_forward_chunk``/``logprobs_backward_chunk`` of ``module``, imported on first use."""
    return LogprobsKernels(
        forward=lazy_function(module, "logprobs_forward_chunk"),
        backward=lazy_function(module, "logprobs_backward_chunk"),
        extra_bytes_per_logit=extra_bytes_per_logit,
    )


def lazy_distillation_kernels(module: str, extra_bytes_per_logit: int) -> DistillationKernels:
    """The ``distillation_chunk`` of ``module``, imported on first use."""
    return DistillationKernels(
        chunk=lazy_function(module, "distillation_chunk"), extra_bytes_per_logit=extra_bytes_per_logit
    )
