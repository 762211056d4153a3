"""Vocab-parallel fused linear + cross-entropy over ``torch.distributed``.

Every rank of a process group holds a contiguous slice ``W[v0:v1]`` of the LM-head
weight (uneven slices allowed), the full input ``x`` (N, H) and the full target (global
class ids). The loss is the one of ``flce.fused_linear_cross_entropy(x, W, target)``
with the same options (``docs/parallel.md``; per-token math in ``flce.rows.cross_entropy``),
and neither the ``(N, V)`` logits nor a rank's ``(N, V_r)`` logits are ever
materialized: tokens are processed in chunks of ``C`` rows, sized as ``flce.cross_entropy``
sizes its chunks (``flce.driver.sizing.default_chunk_size`` on the largest shard with the
kernels' workspace, the same ``C`` on every rank).

Per chunk, on rank r with its ``(C, V_r)`` local logits ``z = x_c @ W_r^T (+ b_r)``
(softcap applied, ``z' = c tanh(z / c)``, statistics in fp32):

1. ``all_reduce(MAX)`` of the ``(C,)`` row maxima. When token accuracy or predicted
   tokens are requested the maximum travels as an int64 key that packs the fp32 value
   (order-preserving bits) with the complement of the global class index, so the same
   single MAX gives the global argmax with the first index winning ties.
2. ``all_reduce(SUM)`` of one packed ``(C, k)`` fp32 tensor of partial sums of the
   shifted logits ``z' - max``: ``sum_i exp(z'_i - max)``, ``z'_y - max`` (from the rank
   that owns ``y``, 0 elsewhere) and, with label smoothing, ``sum_i w_i (z'_i - max)``
   (``k`` = 2 or 3). Each rank computes them relative to its local max in one read of
   the chunk (the backend's split-row kernels, ``BackendSpec.split_rows``) and moves them
   to the global max before the reduce.
3. ``lse = max + log(sum)``; loss rows (identical on every rank); the local gradient
   chunk ``G_r`` (C, V_r) with the global softmax, in the grouped form of
   ``flce.rows.cross_entropy``; ``dX_r[c] = G_r @ W_r``, ``dW_r += G_r^T x_c`` (fp32
   accumulation), ``db_r += sum(G_r)``.

Once per call, before the chunks: one ``all_gather`` of a small int64 record per rank
(shard size and start, shapes, flags, a fingerprint of each option, the per-shard kernels
and chunk budget that size the chunks, and a target checksum):
it yields the global vocabulary ``V`` and the default ``vocab_start`` (exclusive prefix
sum of the shard sizes) and lets every rank refuse inconsistent calls together instead
of deadlocking. With class weights, one ``all_gather`` of the ``(V_r,)`` weight shards
(``V`` fp32 values in all), so every rank knows ``w_y`` of every token, ``sum_i w_i``
and the mean divisor ``sum_t w_{y_t}``. Backward: one ``all_reduce(SUM)`` of ``dX``
(N, H) in the input's dtype; ``dW_r`` and ``db_r`` stay local.

The local GEMMs are cuBLAS (``torch.mm``/``addmm``); the per-chunk CE math runs in the
split-row kernels of ``backend`` (``flce.dispatch.split_row_kernels``: Triton or CuTe DSL,
in place, or PyTorch).
With a process group of size 1 no collective runs and the result equals
``flce.fused_linear_cross_entropy`` (up to fp32 rounding).

Not traceable by ``torch.compile`` (host reads and collectives at the boundary): the
entry point is excluded from compilation and runs eagerly.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields, replace

import torch
import torch.distributed as dist
from torch import nn

from flce.backends.base import BackendSpec, SplitRowKernels, softcap_tanh_is_approximate
from flce.dispatch import split_row_kernels
from flce.driver.chunks import Gradients, GradRequest, run_chunks
from flce.driver.scaling import forward_gradient_prescale, requested_sums_in_fp16
from flce.driver.sizing import default_chunk_size
from flce.driver.statistics import BatchStatistics, batch_statistics, chunk_scalars
from flce.options import (
    INT64_MAX,
    OPTION_FIELDS,
    HeadNames,
    LossOptions,
    NotScriptable,
    OptionAttributes,
    as_int,
    index_target,
    refuse_function_transforms,
    register_class_weight,
    row_count,
    validate_ce_weight,
    validate_fused_inputs,
)
from flce.output import LossResult, package_result
from flce.parallel.dtensor import mesh_group, unwrap_dtensors
from flce.parallel.handshake import agree_on_call, gather_class_weights, resolve_group
from flce.plan import CrossEntropyPlan, LinearOperands, Operands, run_loss
from flce.rows.cross_entropy import (
    ChunkScalars,
    RowOutputs,
    gather_safe_target,
    row_scale,
    rows_from_statistics,
)

__all__ = ["VocabParallelFusedLinearCrossEntropyLoss", "vocab_parallel_fused_linear_cross_entropy"]


# What a rank's own checks may raise before the handshake: any error (a refusal of the
# options, the backend, the DTensor adapter or the tensors, or PyTorch's own for an
# argument of the wrong kind) travels in the handshake's record and is raised there, on
# every rank alike, instead of leaving the other ranks in its all_gather (or pairing it
# with their next call's).
_LOCAL_ERRORS = (Exception,)

# --------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class ParallelPlan(CrossEntropyPlan):
    """Everything one call decided before its first chunk (identical on every rank
    except ``vocab_start``); runs through ``flce.plan``'s forward/backward pair."""

    options: LossOptions
    group: object  # the torch.distributed ProcessGroup
    world_size: int
    vocab_start: int  # first global class id of this rank's shard
    vocab: int  # global V
    compute_dtype: torch.dtype
    chunk_size: int  # rows per chunk, the same on every rank
    stats: BatchStatistics
    scalars: ChunkScalars
    local_kernels: SplitRowKernels
    gradient_prescale: float = 1.0  # flce.driver.scaling.forward_gradient_prescale

    def run(
        self, operands: Operands, request: GradRequest, row_grad_scale: torch.Tensor | None = None
    ) -> tuple[RowOutputs, Gradients]:
        """Every chunk of this rank's shard through the token-chunk driver
        (``flce.driver.chunks.run_chunks``) with ``_chunk`` as its chunk kernel: per-row
        outputs (replicated) and the local gradients (dX partial, not yet all-reduced;
        dW_r; db_r)."""
        o = operands
        if row_grad_scale is None and self.gradient_prescale != 1.0 and request.any:
            row_grad_scale = self.prescaled_rows(o)
        v0 = self.vocab_start
        ce_local = None if o.ce_weight is None else o.ce_weight[v0 : v0 + o.weight.shape[0]]

        def shard_kernel(logits, target, _ce_weight, _scalars, *, row_grad_scale, compute_grad, **outputs):
            _chunk(logits, target, o.ce_weight, ce_local, self, outputs, row_grad_scale, compute_grad)

        spec = BackendSpec(
            name=f"vocab-parallel/{self.local_kernels.name}",
            cross_entropy_chunk=shard_kernel,
            split_rows=lambda: self.local_kernels,
            availability=lambda device: (True, ""),
            extra_bytes_per_logit=self.local_kernels.extra_bytes_per_logit,
            auto_priority=0,
            description="one vocabulary shard of a row; statistics combined across ranks",
        )
        # Every rank must run the same chunks (each runs the collectives): the plan's size.
        options = replace(self.options, chunk_size=self.chunk_size)
        return run_chunks(
            o.input,
            o.weight,
            o.target,
            o.bias,
            o.ce_weight,
            options,
            spec,
            self.compute_dtype,
            self.scalars,
            request,
            row_grad_scale,
        )

    def finish_gradients(self, grads: Gradients) -> None:
        if grads.input is not None:
            _all_reduce(grads.input, dist.ReduceOp.SUM, self)  # dX = sum_r G_r @ W_r; dW, db stay local


# The shards' argument names, in the errors of the checks this loss shares with the
# single-device one.
SHARD_NAMES = HeadNames(weight="weight_shard", bias="bias_shard")


def _local_checks(input, weight, target, bias, ce_weight, options: LossOptions, vocab_start):
    """This rank's own checks of its tensors and backend -> (compute dtype, vocab_start as
    an int or None, the per-shard kernels)."""
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] == 0:
        raise ValueError(
            "weight_shard has no rows on this rank: the vocab-parallel loss needs at least one row (V >= 1) "
            "on every rank (a Shard(0) DTensor of V rows over more than V ranks, or a split such as "
            "torch.chunk's of V=6 over 4, leaves a rank empty); use a group of at most V ranks, or shards "
            "of at least one row each"
        )
    compute_dtype = validate_fused_inputs(input, weight, target, bias, None, options, SHARD_NAMES)
    validate_ce_weight(ce_weight, weight.shape[0], input.device, "ce_weight_shard")
    kernels = split_row_kernels(options.backend, input.device)  # an unusable backend, with the reason
    if vocab_start is not None:
        vocab_start = as_int("vocab_start", vocab_start)
        if vocab_start < 0:
            raise ValueError(f"vocab_start must be >= 0, got {vocab_start}")
        if vocab_start > INT64_MAX:  # the handshake's record holds it as an int64
            raise ValueError(f"vocab_start must be <= 2**63 - 1 (a row index), got {vocab_start}")
    return compute_dtype, vocab_start, kernels


def _plan(
    input, weight, target, bias, ce_weight, options: LossOptions | None, group, vocab_start, local_error
) -> tuple[ParallelPlan, torch.Tensor | None, torch.Tensor]:
    """Local validation, then the handshake (``flce.parallel.handshake``): the plan, the
    full class weights and the (N,) target as the kernels read it (``index_target``).
    ``local_error``: a refusal found before (the options, the DTensor adapter's), raised in
    the handshake as the local checks' are."""
    compute_dtype = kernels = None
    if local_error is None:
        try:
            compute_dtype, vocab_start, kernels = _local_checks(
                input, weight, target, bias, ce_weight, options, vocab_start
            )
        except _LOCAL_ERRORS as exc:
            local_error = exc
    agreed = agree_on_call(
        input,
        weight,
        target,
        bias,
        ce_weight,
        options,
        compute_dtype,
        None if kernels is None else kernels.name,
        local_error,
        group,
        vocab_start,
    )
    ce_full = None
    if ce_weight is not None:
        ce_full = gather_class_weights(
            ce_weight, agreed.shard_sizes, agreed.shard_starts, agreed.vocab, group, agreed.world_size
        )
    target_1d = index_target(target, options.ignore_index)
    stats = batch_statistics(target_1d, ce_full, agreed.vocab, options.ignore_index, "ce_weight_shard")
    n_rows = target_1d.numel()
    chunk = options.chunk_size or default_chunk_size(
        n_rows, max(agreed.shard_sizes), compute_dtype, kernels.extra_bytes_per_logit
    )
    plan = ParallelPlan(
        options=options,
        group=group,
        world_size=agreed.world_size,
        vocab_start=agreed.vocab_start,
        vocab=agreed.vocab,
        compute_dtype=compute_dtype,
        chunk_size=max(1, min(chunk, max(n_rows, 1))),
        stats=stats,
        # The shards' logits are this loss's own GEMM output (softcap_tanh_is_approximate).
        scalars=chunk_scalars(
            options, stats, approximate_tanh=softcap_tanh_is_approximate(compute_dtype, input.device)
        ),
        local_kernels=kernels,
        gradient_prescale=forward_gradient_prescale(
            options.reduction, compute_dtype, n_rows, requested_sums_in_fp16(weight, bias)
        ),
    )
    return plan, ce_full, target_1d


# ------------------------------------------------------------------ argmax keys

_LOW32 = 0xFFFFFFFF


_NAN_ORDERED = 0x7FFFFFFF  # above +inf's 0x7F800000: the bits of a NaN, decoded as one


def _argmax_key(value: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """int64 keys whose maximum is the largest fp32 ``value`` and, among equal values,
    the smallest ``index`` (< 2**32). ``value`` maps to its order-preserving bits; a NaN
    (of either sign) above every number, as ``torch.argmax`` ranks it: the shard's first
    NaN column is its argmax, and the first rank's such column wins across ranks."""
    bits = (value + 0.0).view(torch.int32).to(torch.int64)  # + 0.0 turns -0.0 into +0.0
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    ordered = torch.where(value.isnan(), _NAN_ORDERED, ordered)
    return ordered * (2**32) + (_LOW32 - index)


def _decode_argmax_key(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ordered = key >> 32
    index = _LOW32 - (key & _LOW32)
    bits = torch.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).to(torch.int32)
    return bits.view(torch.float32), index


def _all_reduce(tensor: torch.Tensor, op, plan: ParallelPlan) -> None:
    if plan.world_size > 1:
        dist.all_reduce(tensor, op=op, group=plan.group)


# ------------------------------------------------------------------ chunk math


def _chunk(
    logits: torch.Tensor,  # (C, V_r) compute dtype; overwritten with the gradient if compute_grad
    target: torch.Tensor,  # (C,) global ids
    ce_weight: torch.Tensor | None,  # (V,) fp32, full
    ce_local: torch.Tensor | None,  # (V_r,) fp32 view of ce_weight
    plan: ParallelPlan,
    out: dict,  # the chunk kernel's *_out tensors
    row_grad_scale: torch.Tensor | None,  # (C,) fp32
    compute_grad: bool,
) -> None:
    """Loss rows of one chunk (written to ``out``) and, if asked, the local gradient with
    respect to the logits, written over ``logits``. Two collectives, on every rank."""
    sc = plan.scalars
    v0, vocab_local = plan.vocab_start, logits.shape[1]
    need_argmax = out["correct_out"] is not None or out["predicted_out"] is not None

    valid = target != sc.ignore_index
    safe_target = gather_safe_target(target, valid, plan.vocab)  # global, gather-safe
    local_target = safe_target - v0
    owned = valid & (local_target >= 0) & (local_target < vocab_local)

    kernels = plan.local_kernels
    stats = kernels.statistics(
        logits,
        torch.where(owned, local_target, vocab_local),
        ce_local,
        sc.softcap,
        with_smoothing=sc.label_smoothing > 0,
        with_argmax=need_argmax,
        approximate_tanh=sc.approximate_tanh,
    )

    # 1. Global row maximum (and first global argmax): one MAX all-reduce.
    global_argmax = None
    if need_argmax:
        key = _argmax_key(stats.row_max, stats.argmax + v0)
        _all_reduce(key, dist.ReduceOp.MAX, plan)
        row_max, global_argmax = _decode_argmax_key(key)
    else:
        row_max = stats.row_max.clone()
        _all_reduce(row_max, dist.ReduceOp.MAX, plan)

    # 2. The local parts moved from the local to the global max, one SUM all-reduce
    #    (the same combination as the vocabulary-block driver's, across ranks).
    local_weight_sum = ce_local.sum() if ce_local is not None else float(vocab_local)
    packed = torch.stack(stats.rebased(row_max, owned, local_weight_sum), dim=1)  # (C, 2 or 3)
    _all_reduce(packed, dist.ReduceOp.SUM, plan)
    sum_exp, log_s = packed[:, 0], torch.log(packed[:, 0])

    # 3. Loss rows (the same on every rank), with the single-device formulas.
    rows = RowOutputs(out["loss_out"], out["z_loss_out"], out["correct_out"], out["predicted_out"])
    token_scale = rows_from_statistics(
        rows,
        target,
        valid,
        row_max,
        log_s,
        packed[:, 1],
        packed[:, 2] if packed.shape[1] > 2 else None,
        global_argmax,
        ce_weight,
        sc,
        plan.vocab,
    )
    if not compute_grad:
        return

    # 4. Local gradient with the global softmax (the one-hot only where this shard owns y),
    #    written over the chunk's logits.
    grad_target = torch.where(owned, local_target, torch.where(valid, vocab_local, -1))
    w_y = ce_weight[safe_target] if ce_weight is not None else torch.ones_like(log_s)
    kernels.gradient(
        logits,
        grad_target,
        ce_local,
        row_max,
        1.0 / sum_exp,
        w_y,
        row_max + log_s,
        row_scale(valid, token_scale, row_grad_scale),
        sc,
        sc.smoothing_eps(plan.vocab),
    )


# ------------------------------------------------------------------- public API


@torch.compiler.disable
def vocab_parallel_fused_linear_cross_entropy_with_options(
    input: torch.Tensor,
    weight_shard: torch.Tensor,
    target: torch.Tensor,
    bias_shard: torch.Tensor | None,
    ce_weight_shard: torch.Tensor | None,
    options: LossOptions,
    *,
    process_group=None,
    vocab_start: int | None = None,
) -> LossResult:
    """``vocab_parallel_fused_linear_cross_entropy`` with prebuilt options (the module uses this)."""
    return _vocab_parallel_loss(
        input, weight_shard, target, bias_shard, ce_weight_shard, options, None, process_group, vocab_start
    )


@torch.compiler.disable
def _vocab_parallel_loss(
    input, weight_shard, target, bias_shard, ce_weight_shard, options, options_error, process_group, vocab_start
) -> LossResult:
    """The call; ``options_error`` (then ``options`` is None): why this rank's options were
    refused. Every refusal that may differ between ranks (options, backend, the DTensor
    adapter's, the local validation) is raised in the handshake, on every rank alike: a
    rank raising before it would leave the others blocked in its all_gather."""
    group = mesh_group(weight_shard)
    if group is None:
        group = resolve_group(process_group)
    local_error = options_error
    if local_error is None:
        try:
            input, target, weight_shard, bias_shard, ce_weight_shard, process_group, vocab_start = unwrap_dtensors(
                input, target, weight_shard, bias_shard, ce_weight_shard, process_group, vocab_start
            )
        except _LOCAL_ERRORS as exc:
            local_error = exc
    if local_error is None:
        refuse_function_transforms(
            "flce.parallel.vocab_parallel_fused_linear_cross_entropy", (input, weight_shard, bias_shard)
        )
    plan, ce_full, target_1d = _plan(
        input, weight_shard, target, bias_shard, ce_weight_shard, options, group, vocab_start, local_error
    )
    input_2d = input.reshape(row_count(input), input.shape[-1])  # explicit N: H may be 0
    operands = LinearOperands(input_2d, weight_shard, bias_shard, target_1d, ce_full)
    # An earlier call's bad input was raised by the handshake, on every rank; run_loss finds none.
    return package_result(options, tuple(target.shape), *run_loss(plan, operands))


def vocab_parallel_fused_linear_cross_entropy(
    input: torch.Tensor,
    weight_shard: torch.Tensor,
    target: torch.Tensor,
    *,
    process_group=None,
    vocab_start: int | None = None,
    bias_shard: torch.Tensor | None = None,
    ce_weight_shard: torch.Tensor | None = None,
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
    chunk_size: int | None = None,
    backend: str | None = None,
) -> LossResult:
    """The fused linear + cross-entropy loss with the LM-head weight sharded over the
    vocabulary across the ranks of ``process_group``; call it on every rank.

    Args:
        input: ``(N, H)`` or ``(B, T, H)`` hidden states, the same full tensor on every rank.
        weight_shard: ``(V_r, H)`` this rank's contiguous rows ``W[v0 : v0 + V_r]`` (shard
            sizes may differ between ranks, each >= 1), or a ``DTensor`` sharded
            ``Shard(0)`` over a 1-D device mesh (its local tensor, mesh group and start
            row are used).
        target: ``(N,)`` or ``(B, T)`` global class ids in ``[0, V)`` or ``ignore_index``,
            the same on every rank (``V`` = sum of the shard sizes).
        process_group: the vocabulary-parallel group (default: the world group).
        vocab_start: this rank's first global class id ``v0``; default: the exclusive
            prefix sum of the shard sizes in group-rank order. The shards must tile ``[0, V)``.
        bias_shard: optional ``(V_r,)`` rows of the bias. ce_weight_shard: optional
            ``(V_r,)`` class weights of this shard's classes.
        chunk_size: rows per chunk (must be equal on all ranks); ``None``: the most rows
            whose logits on the largest shard fit ``FLCE_CHUNK_BUDGET_MIB`` (512 MiB by
            default; ``FLCE_MEMORY_BUDGET_MIB`` does not apply).
        backend: the per-shard kernels: ``"triton"`` or ``"cutedsl"`` (sm_90+) (one read
            for the statistics, one read + write for the gradient, in place), ``"torch"``
            (PyTorch ops on an fp32 copy), or ``None``: ``FLCE_BACKEND``, else the auto
            choice of ``flce.dispatch`` (as the single-device loss). A requested backend
            that cannot run here raises ``BackendUnavailableError`` with the reason.
        Other options: as ``flce.fused_linear_cross_entropy`` (README, "Features").

    Returns:
        The loss (identical on every rank; fp32 scalar for mean/sum, per token for none),
        or a ``CrossEntropyOutput`` when a ``return_*`` flag is set. Gradients: ``input``
        receives the full dX (all-reduced in backward), ``weight_shard``/``bias_shard``
        their local slices of dW/db.

    The local GEMMs are cuBLAS (``torch.mm``/``addmm``); the per-chunk CE math runs in the
    chosen backend's split-row kernels (fp32 math).
    Communication per chunk of C rows: one MAX all-reduce of C values (int64 keys when
    accuracy/predicted tokens are requested, else fp32) and one SUM all-reduce of a
    ``(C, 2 or 3)`` fp32 tensor; per call one small all_gather (plus one of the class
    weights if given); backward one SUM all-reduce of dX.
    """
    try:
        options = LossOptions(
            ignore_index=ignore_index,
            lse_square_scale=lse_square_scale,
            label_smoothing=label_smoothing,
            reduction=reduction,
            softcap=softcap,
            return_z_loss=return_z_loss,
            accum_dtype=accum_dtype,
            use_token_scaling=use_token_scaling,
            return_token_accuracy=return_token_accuracy,
            return_predicted_tokens=return_predicted_tokens,
            chunk_size=chunk_size,
            backend=backend,
        )
        options_error = None
    except _LOCAL_ERRORS as exc:
        options, options_error = None, exc
    return _vocab_parallel_loss(
        input, weight_shard, target, bias_shard, ce_weight_shard, options, options_error, process_group, vocab_start
    )


# The loss options the vocab-parallel loss takes: the function's keywords that are LossOptions fields.
_OPTION_NAMES = frozenset(inspect.signature(vocab_parallel_fused_linear_cross_entropy).parameters) & frozenset(
    f.name for f in fields(LossOptions)
)


def _refuse_unsupported_options(options: dict) -> None:
    unsupported = sorted(set(options) - _OPTION_NAMES)
    if unsupported:
        raise TypeError(
            f"VocabParallelFusedLinearCrossEntropyLoss got unsupported option(s) {unsupported}: it takes the "
            f"keyword options of vocab_parallel_fused_linear_cross_entropy, {sorted(_OPTION_NAMES)} (its chunks "
            "are whole shard rows, sized by chunk_size)"
        )


class VocabParallelFusedLinearCrossEntropyLoss(NotScriptable, OptionAttributes, nn.Module):
    """``forward(input, weight_shard, target, bias_shard=None)``: the vocab-parallel loss.

    Takes ``ce_weight_shard``, ``process_group``, ``vocab_start`` and the keyword
    options of ``vocab_parallel_fused_linear_cross_entropy``, each also an attribute that
    can be set (``OptionAttributes``); ``ce_weight_shard`` is a non-persistent buffer so it
    follows ``.to()``.
    """

    option_names = OPTION_FIELDS

    def __init__(
        self,
        ce_weight_shard: torch.Tensor | None = None,
        *,
        process_group=None,
        vocab_start: int | None = None,
        **options,
    ) -> None:
        super().__init__()
        _refuse_unsupported_options(options)
        self.options = LossOptions(**options)
        self.process_group = process_group
        self.vocab_start = vocab_start
        register_class_weight(self, "ce_weight_shard", ce_weight_shard)

    def check_options(self, options: LossOptions) -> None:
        defaults = LossOptions()
        _refuse_unsupported_options(
            {name: value for name in OPTION_FIELDS if (value := getattr(options, name)) != getattr(defaults, name)}
        )

    def forward(
        self,
        input: torch.Tensor,
        weight_shard: torch.Tensor,
        target: torch.Tensor,
        bias_shard: torch.Tensor | None = None,
    ) -> LossResult:
        return vocab_parallel_fused_linear_cross_entropy_with_options(
            input,
            weight_shard,
            target,
            bias_shard,
            self.ce_weight_shard,
            self.options,
            process_group=self.process_group,
            vocab_start=self.vocab_start,
        )

    def extra_repr(self) -> str:
        return f"vocab_start={self.vocab_start}, {self.options!r}"
