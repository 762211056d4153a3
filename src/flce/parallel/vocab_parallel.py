"""Vocab-parallel fused linear + cross-entropy over ``torch.distributed``.

Every rank of a process group holds a contiguous slice ``W[v0:v1]`` of the LM-head
weight (uneven slices allowed), the full input ``x`` (N, H) and the full target (global
class ids). The loss is the one of ``flce.fused_linear_cross_entropy(x, W, target)``
with the same options (``docs/parallel.md``; per-token math in ``flce.backends.base``),
and neither the ``(N, V)`` logits nor a rank's ``(N, V_r)`` logits are ever
materialized: tokens are processed in chunks of ``C`` rows, sized like the single-GPU
driver's (``flce.driver.default_chunk_size`` on the largest shard with the kernels'
workspace, the same ``C`` on every rank).

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
   the chunk (``flce.split_rows``) and moves them to the global max before the reduce.
3. ``lse = max + log(sum)``; loss rows (identical on every rank); the local gradient
   chunk ``G_r`` (C, V_r) with the global softmax, in the grouped form of
   ``flce.backends.base``; ``dX_r[c] = G_r @ W_r``, ``dW_r += G_r^T x_c`` (fp32
   accumulation), ``db_r += sum(G_r)``.

Once per call, before the chunks: one ``all_gather`` of a small int64 record per rank
(shard size and start, shapes, flags, an options fingerprint and a target checksum):
it yields the global vocabulary ``V`` and the default ``vocab_start`` (exclusive prefix
sum of the shard sizes) and lets every rank refuse inconsistent calls together instead
of deadlocking. With class weights, one ``all_gather`` of the ``(V_r,)`` weight shards
(``V`` fp32 values in all), so every rank knows ``w_y`` of every token, ``sum_i w_i``
and the mean divisor ``sum_t w_{y_t}``. Backward: one ``all_reduce(SUM)`` of ``dX``
(N, H) in the input's dtype; ``dW_r`` and ``db_r`` stay local.

The local GEMMs are cuBLAS (``torch.mm``/``addmm``); the per-chunk CE math runs in the
split-row kernels of ``backend`` (``flce.split_rows``: Triton or CuTe DSL, in place, or
PyTorch).
With a process group of size 1 no collective runs and the result equals
``flce.fused_linear_cross_entropy`` (up to fp32 rounding).

Not traceable by ``torch.compile`` (host reads and collectives at the boundary): the
entry point is excluded from compilation and runs eagerly.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from flce.backends.base import BackendSpec, ChunkScalars
from flce.backends.torch.ce import loss_rows
from flce.driver import (
    BatchStatistics,
    Gradients,
    RowOutputs,
    batch_statistics,
    chunk_scalars,
    default_chunk_size,
    reduce_rows,
    run_chunks,
)
from flce.functional import FusedLinearCrossEntropyFunction, _no_autocast, _package
from flce.options import FLOAT_DTYPES, LossOptions, as_int, validate_ce_weight, validate_fused_inputs
from flce.output import CrossEntropyOutput
from flce.split_rows import split_row_kernels

LossResult = torch.Tensor | CrossEntropyOutput

__all__ = ["VocabParallelFusedLinearCrossEntropyLoss", "vocab_parallel_fused_linear_cross_entropy"]

_ENTRY = "vocab_parallel_fused_linear_cross_entropy"


# --------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class _ParallelPlan:
    """Everything one call decided before its first chunk (identical on every rank
    except ``vocab_start``)."""

    options: LossOptions
    group: object  # the torch.distributed ProcessGroup
    world_size: int
    vocab_start: int  # first global class id of this rank's shard
    vocab: int  # global V
    compute_dtype: torch.dtype
    chunk_size: int  # rows per chunk, the same on every rank
    need_argmax: bool
    stats: BatchStatistics
    scalars: ChunkScalars
    local_kernels: object  # flce.split_rows.TorchSplitRowKernels, TritonSplitRowKernels or CuteSplitRowKernels

    # The interface flce.functional.FusedLinearCrossEntropyFunction runs a plan through.
    def run_chunks(self, input, weight, target, bias, ce_weight, **flags):
        return _run_local_chunks(input, weight, target, bias, ce_weight, self, **flags)

    def finish_gradients(self, grads) -> None:
        if grads.input is not None:
            _all_reduce(grads.input, dist.ReduceOp.SUM, self)  # dX = sum_r G_r @ W_r; dW, db stay local


# Fields of the per-rank record gathered once per call (int64).
_FIELDS = (
    "error",  # 1 if this rank's local validation failed
    "vocab_start_given",
    "vocab_start",
    "shard_size",
    "rows",
    "hidden",
    "has_bias",
    "has_ce_weight",
    "chunk_size",
    "grad_input",
    "grad_weight",
    "grad_bias",
    "options",  # crc32 of the options' repr
    "compute_dtype",
    "target",  # checksum of the target
)
_MUST_AGREE = {
    "vocab_start_given": "whether vocab_start is passed",
    "rows": "the number of tokens (input rows)",
    "hidden": "the hidden size H",
    "has_bias": "whether bias_shard is passed",
    "has_ce_weight": "whether ce_weight_shard is passed",
    "chunk_size": "chunk_size",
    "grad_input": "whether input requires grad",
    "grad_weight": "whether weight_shard requires grad",
    "grad_bias": "whether bias_shard requires grad",
    "options": "the loss options (ignore_index, label_smoothing, reduction, ...)",
    "compute_dtype": "the compute dtype (input/weight dtype or autocast dtype)",
    "target": "the target (every rank must pass the same full target)",
}


def _resolve_group(process_group):
    if not dist.is_available():
        raise RuntimeError(f"{_ENTRY} needs torch.distributed, which this PyTorch build lacks")
    if not dist.is_initialized():
        raise RuntimeError(
            f"{_ENTRY}: torch.distributed is not initialized; call torch.distributed.init_process_group() "
            "first (a group of size 1 is fine) or pass a DTensor weight_shard"
        )
    return dist.group.WORLD if process_group is None else process_group


def _comm_device(group, input) -> torch.device:
    if isinstance(input, torch.Tensor) and input.device.type != "meta":  # a meta input is refused, on the host
        return input.device
    backend = str(dist.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _target_checksum(target: torch.Tensor) -> torch.Tensor:
    """A position-weighted sum of the target: equal targets give equal sums; a rank
    whose target differs is caught with overwhelming likelihood (no extra host read)."""
    flat = target.reshape(-1).long()
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64) % 7919 + 1
    return (flat * weights).sum()


def _options_fingerprint(options: LossOptions) -> int:
    return zlib.crc32(repr(options).encode())


def _describe(values: list[int]) -> str:
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))


def _plan(
    input, weight, target, bias, ce_weight, options: LossOptions, group, vocab_start
) -> tuple[_ParallelPlan, torch.Tensor | None]:
    """Local validation, then one all_gather of every rank's record; refuses (on every
    rank alike) inconsistent calls; returns the plan and the full class weights."""
    world = dist.get_world_size(group)
    local_error: Exception | None = None
    compute_dtype = None
    try:
        compute_dtype = validate_fused_inputs(input, weight, target, bias, None, options)
        validate_ce_weight(ce_weight, weight.shape[0], input.device, "ce_weight_shard")
        if vocab_start is not None:
            vocab_start = as_int("vocab_start", vocab_start)
            if vocab_start < 0:
                raise ValueError(f"vocab_start must be >= 0, got {vocab_start}")
    except (TypeError, ValueError) as exc:
        local_error = exc

    device = _comm_device(group, input)
    grad_enabled = torch.is_grad_enabled()
    if local_error is None:
        record = dict(
            error=0,
            vocab_start_given=int(vocab_start is not None),
            vocab_start=vocab_start or 0,
            shard_size=weight.shape[0],
            rows=input.shape[:-1].numel(),
            hidden=input.shape[-1],
            has_bias=int(bias is not None),
            has_ce_weight=int(ce_weight is not None),
            chunk_size=options.chunk_size or 0,
            grad_input=int(grad_enabled and input.requires_grad),
            grad_weight=int(grad_enabled and weight.requires_grad),
            grad_bias=int(grad_enabled and bias is not None and bias.requires_grad),
            options=_options_fingerprint(options),
            compute_dtype=FLOAT_DTYPES.index(compute_dtype),
            target=0,
        )
        mine = torch.tensor([record[f] for f in _FIELDS], dtype=torch.int64, device=device)
        mine[_FIELDS.index("target")] = _target_checksum(target).to(device)
    else:
        mine = torch.zeros(len(_FIELDS), dtype=torch.int64, device=device)
        mine[0] = 1

    if world > 1:
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=group)
        table = torch.stack(gathered).tolist()  # the setup's host read
    else:
        table = [mine.tolist()]
    columns = {name: [row[i] for row in table] for i, name in enumerate(_FIELDS)}

    if local_error is not None:
        raise local_error
    bad = [r for r, e in enumerate(columns["error"]) if e]
    if bad:
        raise ValueError(
            f"{_ENTRY}: rank(s) {bad} of the process group rejected their inputs (see the error raised "
            "there); every rank must call with valid, matching arguments"
        )
    for field, what in _MUST_AGREE.items():
        values = columns[field]
        if any(v != values[0] for v in values):
            raise ValueError(f"{_ENTRY}: {what} must be the same on every rank, got {_describe(values)}")

    sizes = columns["shard_size"]
    if vocab_start is None:
        starts = [sum(sizes[:r]) for r in range(world)]
    else:
        starts = columns["vocab_start"]
    vocab = sum(sizes)
    end = 0
    for r in sorted(range(world), key=lambda r: starts[r]):
        if starts[r] != end:
            raise ValueError(
                f"{_ENTRY}: the vocabulary shards must tile [0, V) without gaps or overlaps; got "
                + ", ".join(f"rank {q}: [{starts[q]}, {starts[q] + sizes[q]})" for q in range(world))
            )
        end += sizes[r]
    rank = dist.get_rank(group)
    my_start = starts[rank]

    ce_full = None
    if ce_weight is not None:
        ce_full = _gather_class_weights(ce_weight, sizes, starts, vocab, group, world)

    target_1d = target.reshape(-1)
    stats = batch_statistics(target_1d, ce_full, vocab, options.ignore_index)
    scalars = chunk_scalars(options, stats)
    n_rows = target_1d.numel()
    kernels = split_row_kernels(options.backend, input.device, _ENTRY)
    chunk = options.chunk_size or default_chunk_size(n_rows, max(sizes), compute_dtype, kernels.extra_bytes_per_logit)
    chunk = max(1, min(chunk, max(n_rows, 1)))
    plan = _ParallelPlan(
        options=options,
        group=group,
        world_size=world,
        vocab_start=my_start,
        vocab=vocab,
        compute_dtype=compute_dtype,
        chunk_size=chunk,
        need_argmax=options.return_token_accuracy or options.return_predicted_tokens,
        stats=stats,
        scalars=scalars,
        local_kernels=kernels,
    )
    return plan, ce_full


def _gather_class_weights(ce_weight, sizes, starts, vocab, group, world) -> torch.Tensor:
    """The full (V,) fp32 class weights on every rank, from each rank's shard."""
    local = ce_weight.detach().float().contiguous()
    if world == 1:
        return local
    width = max(sizes)
    padded = torch.zeros(width, dtype=torch.float32, device=local.device)
    padded[: local.numel()] = local
    pieces = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(pieces, padded, group=group)
    full = torch.empty(vocab, dtype=torch.float32, device=local.device)
    for r in range(world):
        full[starts[r] : starts[r] + sizes[r]] = pieces[r][: sizes[r]]
    return full


# ------------------------------------------------------------------ argmax keys

_LOW32 = 0xFFFFFFFF


def _argmax_key(value: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """int64 keys whose maximum is the largest fp32 ``value`` and, among equal values,
    the smallest ``index`` (< 2**32). ``value`` maps to its order-preserving bits."""
    bits = (value + 0.0).view(torch.int32).to(torch.int64)  # + 0.0 turns -0.0 into +0.0
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return ordered * (2**32) + (_LOW32 - index)


def _decode_argmax_key(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ordered = key >> 32
    index = _LOW32 - (key & _LOW32)
    bits = torch.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).to(torch.int32)
    return bits.view(torch.float32), index


def _all_reduce(tensor: torch.Tensor, op, plan: _ParallelPlan) -> None:
    if plan.world_size > 1:
        dist.all_reduce(tensor, op=op, group=plan.group)


# ------------------------------------------------------------------ chunk math


def _chunk(
    logits: torch.Tensor,  # (C, V_r) compute dtype; overwritten with the gradient if compute_grad
    target: torch.Tensor,  # (C,) global ids
    ce_weight: torch.Tensor | None,  # (V,) fp32, full
    ce_local: torch.Tensor | None,  # (V_r,) fp32 view of ce_weight
    plan: _ParallelPlan,
    out: dict,
    row_grad_scale: torch.Tensor | None,  # (C,) fp32
    compute_grad: bool,
) -> bool:
    """Loss rows of one chunk (written to ``out``) and, if asked, the local gradient with
    respect to the logits, written over ``logits``; returns whether it was. Two
    collectives, on every rank."""
    sc = plan.scalars
    ls, c = sc.label_smoothing, sc.softcap
    eps = ls / plan.vocab
    v0, vocab_local = plan.vocab_start, logits.shape[1]

    valid = target != sc.ignore_index
    safe_target = torch.where(valid, target, torch.zeros_like(target)).long()  # global, gather-safe
    local_target = safe_target - v0
    owned = valid & (local_target >= 0) & (local_target < vocab_local)

    kernels = plan.local_kernels
    stats = kernels.statistics(
        logits,
        torch.where(owned, local_target, vocab_local),
        ce_local,
        c,
        with_smoothing=ls > 0,
        with_argmax=plan.need_argmax,
    )

    # 1. Global row maximum (and first global argmax): one MAX all-reduce.
    global_argmax = None
    if plan.need_argmax:
        key = _argmax_key(stats.row_max, stats.argmax + v0)
        _all_reduce(key, dist.ReduceOp.MAX, plan)
        row_max, global_argmax = _decode_argmax_key(key)
    else:
        row_max = stats.row_max.clone()
        _all_reduce(row_max, dist.ReduceOp.MAX, plan)

    # 2. The local sums moved from the local to the global max, one SUM all-reduce.
    #    Differences to the row max keep the precision that max + log(sum) would round away.
    shift = stats.row_max - row_max  # (C,) <= 0
    zero = torch.zeros((), dtype=torch.float32, device=logits.device)
    parts = [stats.row_sum * torch.exp(shift), torch.where(owned, stats.target_shifted + shift, zero)]
    if ls > 0:
        local_weight_sum = ce_local.sum() if ce_local is not None else float(vocab_local)
        parts.append(stats.smooth_shifted + shift * local_weight_sum)  # sum_i w_i (z'_i - max)
    packed = torch.stack(parts, dim=1)  # (C, k)
    _all_reduce(packed, dist.ReduceOp.SUM, plan)
    sum_exp, shifted_target = packed[:, 0], packed[:, 1]
    log_s = torch.log(sum_exp)
    lse = row_max + log_s

    # 3. Loss rows (the same on every rank), with the single-device formulas.
    w_y = ce_weight[safe_target] if ce_weight is not None else torch.ones_like(lse)
    ce, zl, token_scale = loss_rows(log_s, shifted_target, packed[:, 2] if ls > 0 else None, lse, w_y, sc, eps)
    out["loss_out"].copy_(torch.where(valid, ce, zero))
    if out["z_loss_out"] is not None:
        out["z_loss_out"].copy_(torch.where(valid, zl, zero))
    if out["correct_out"] is not None:
        out["correct_out"].copy_(((global_argmax == target) & valid).float())
    if out["predicted_out"] is not None:
        out["predicted_out"].copy_(torch.where(valid, global_argmax, torch.full_like(global_argmax, -1)))
    if not compute_grad:
        return False

    # 4. Local gradient with the global softmax (the one-hot only where this shard owns y),
    #    written over the chunk's logits.
    row_scale = valid.float()
    if token_scale is not None:
        row_scale = row_scale * token_scale
    if row_grad_scale is not None:
        row_scale = row_scale * row_grad_scale
    grad_target = torch.where(owned, local_target, torch.where(valid, vocab_local, -1))
    kernels.gradient(logits, grad_target, ce_local, row_max, 1.0 / sum_exp, w_y, lse, row_scale, sc, eps)
    return True


def _run_local_chunks(
    input: torch.Tensor,  # (N, H)
    weight: torch.Tensor,  # (V_r, H)
    target: torch.Tensor,  # (N,)
    bias: torch.Tensor | None,  # (V_r,)
    ce_weight: torch.Tensor | None,  # (V,) fp32, full
    plan: _ParallelPlan,
    *,
    grad_input: bool,
    grad_weight: bool,
    grad_bias: bool,
    row_grad_scale: torch.Tensor | None = None,  # (N,) fp32
) -> tuple[RowOutputs, Gradients]:
    """Every chunk of this rank's shard through the shared driver (``flce.driver.run_chunks``)
    with ``_chunk`` as its chunk kernel: per-row outputs (replicated) and the local
    gradients (dX partial, not yet all-reduced; dW_r; db_r)."""
    v0 = plan.vocab_start
    ce_local = None if ce_weight is None else ce_weight[v0 : v0 + weight.shape[0]]

    def shard_kernel(
        logits,
        target_chunk,
        _ce_weight,
        _scalars,
        *,
        loss_out,
        z_loss_out,
        correct_out,
        predicted_out,
        row_grad_scale,
        compute_grad,
    ):
        out = dict(loss_out=loss_out, z_loss_out=z_loss_out, correct_out=correct_out, predicted_out=predicted_out)
        _chunk(logits, target_chunk, ce_weight, ce_local, plan, out, row_grad_scale, compute_grad)

    kernels = plan.local_kernels
    spec = BackendSpec(
        name=f"vocab-parallel/{kernels.name}",
        cross_entropy_chunk=shard_kernel,
        availability=lambda device: (True, ""),
        extra_bytes_per_logit=kernels.extra_bytes_per_logit,
        auto_priority=0,
        description="one vocabulary shard of a row; statistics combined across ranks",
    )
    # Every rank must run the same chunks (each runs the collectives): the plan's size.
    options = replace(plan.options, chunk_size=plan.chunk_size)
    return run_chunks(
        input,
        weight,
        target,
        bias,
        ce_weight,
        options,
        spec,
        plan.compute_dtype,
        plan.scalars,
        grad_input=grad_input,
        grad_weight=grad_weight,
        grad_bias=grad_bias,
        row_grad_scale=row_grad_scale,
    )


# ---------------------------------------------------------------------- DTensor


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # pragma: no cover - very old torch
        return None, None
    return DTensor, Shard


def _unwrap_dtensors(input, target, weight_shard, bias_shard, ce_weight_shard, process_group, vocab_start):
    """DTensor adapter: a weight sharded ``Shard(0)`` over a 1-D mesh becomes its local
    tensor, the mesh's process group and the shard's global start row."""
    DTensor, Shard = _dtensor_type()
    if DTensor is None:
        return input, target, weight_shard, bias_shard, ce_weight_shard, process_group, vocab_start
    for name, t in (("input", input), ("target", target)):
        if isinstance(t, DTensor):
            raise TypeError(
                f"{_ENTRY}: {name} is a DTensor; pass the full {name} on every rank as a plain tensor "
                f"({name}.full_tensor())"
            )
    if not isinstance(weight_shard, DTensor):
        for name, t in (("bias_shard", bias_shard), ("ce_weight_shard", ce_weight_shard)):
            if isinstance(t, DTensor):
                raise TypeError(
                    f"{_ENTRY}: {name} is a DTensor but weight_shard is not; pass plain local shards "
                    "for all of them, or DTensors sharded Shard(0) on one mesh for all of them"
                )
        return input, target, weight_shard, bias_shard, ce_weight_shard, process_group, vocab_start

    mesh = weight_shard.device_mesh
    if mesh.ndim != 1 or tuple(weight_shard.placements) != (Shard(0),):
        raise ValueError(
            f"{_ENTRY}: a DTensor weight_shard must be sharded on the vocabulary dim over a 1-D mesh "
            f"(placements (Shard(0),)), got a {mesh.ndim}-D mesh with placements {tuple(weight_shard.placements)}; "
            "otherwise pass weight.to_local() with vocab_start= and process_group= (the mesh dim's group)"
        )
    if vocab_start is not None:
        raise ValueError(f"{_ENTRY}: vocab_start is inferred from a DTensor weight_shard's placement; do not pass it")
    group = mesh.get_group()
    if process_group is not None and process_group is not group:
        raise ValueError(f"{_ENTRY}: process_group must be None or the weight_shard mesh's group (mesh.get_group())")
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"{_ENTRY}: this rank is not part of weight_shard's device mesh")
    local = weight_shard.to_local()  # differentiable: its gradient becomes a Shard(0) DTensor
    vocab, parts = weight_shard.shape[0], mesh.size()
    per_rank = math.ceil(vocab / parts)  # Shard(0) splits like torch.chunk
    start = min(coordinate[0] * per_rank, vocab)
    if local.shape[0] != min(per_rank, vocab - start):
        raise ValueError(
            f"{_ENTRY}: cannot infer the vocabulary range of this rank's DTensor shard (local rows "
            f"{local.shape[0]}, expected {min(per_rank, vocab - start)}); pass weight.to_local() with "
            "vocab_start= and process_group="
        )

    def local_of(name, t):
        if not isinstance(t, DTensor):
            return t
        if t.device_mesh != mesh or tuple(t.placements) != (Shard(0),):
            raise ValueError(f"{_ENTRY}: {name} must be sharded like weight_shard (same mesh, Shard(0))")
        return t.to_local()

    return (
        input,
        target,
        local,
        local_of("bias_shard", bias_shard),
        local_of("ce_weight_shard", ce_weight_shard),
        group,
        start,
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
    split_row_kernels(options.backend, input.device, _ENTRY)  # refuse an unusable backend before any collective
    input, target, weight_shard, bias_shard, ce_weight_shard, process_group, vocab_start = _unwrap_dtensors(
        input, target, weight_shard, bias_shard, ce_weight_shard, process_group, vocab_start
    )
    group = _resolve_group(process_group)
    plan, ce_full = _plan(input, weight_shard, target, bias_shard, ce_weight_shard, options, group, vocab_start)
    input_2d = input.reshape(input.shape[:-1].numel(), input.shape[-1])  # explicit N: H may be 0
    target_1d = target.reshape(-1)
    tensors = (input, weight_shard) if bias_shard is None else (input, weight_shard, bias_shard)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        outputs = FusedLinearCrossEntropyFunction.apply(input_2d, weight_shard, bias_shard, target_1d, ce_full, plan)
    else:
        with _no_autocast(input.device):
            rows, _ = _run_local_chunks(
                input_2d,
                weight_shard,
                target_1d,
                bias_shard,
                ce_full,
                plan,
                grad_input=False,
                grad_weight=False,
                grad_bias=False,
            )
        reduced = reduce_rows(rows, options, plan.scalars, plan.stats)
        outputs = (reduced.loss, reduced.z_loss, reduced.token_accuracy, reduced.predicted_tokens)
    return _package(options, tuple(target.shape), *outputs)


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
        chunk_size: rows per chunk (must be equal on all ranks); ``None`` sizes chunks
            from the memory budget on the largest shard, as the single-GPU driver does.
        backend: the per-shard kernels: ``"triton"`` or ``"cutedsl"`` (sm_90+) (one read
            for the statistics, one read + write for the gradient, in place), ``"torch"``
            (PyTorch ops on an fp32 copy), or ``None``: ``FLCE_BACKEND``, else Triton on
            CUDA when usable, else PyTorch. A requested backend that cannot run here
            raises ``BackendUnavailableError`` with the reason.
        Other options: as ``flce.fused_linear_cross_entropy`` (``CONTRACT.md``).

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
    return vocab_parallel_fused_linear_cross_entropy_with_options(
        input,
        weight_shard,
        target,
        bias_shard,
        ce_weight_shard,
        options,
        process_group=process_group,
        vocab_start=vocab_start,
    )


class VocabParallelFusedLinearCrossEntropyLoss(nn.Module):
    """``forward(input, weight_shard, target, bias_shard=None)``: the vocab-parallel loss.

    Takes ``ce_weight_shard``, ``process_group``, ``vocab_start`` and the keyword
    options of ``vocab_parallel_fused_linear_cross_entropy``; ``ce_weight_shard`` is a
    non-persistent buffer so it follows ``.to()``.
    """

    def __init__(
        self,
        ce_weight_shard: torch.Tensor | None = None,
        *,
        process_group=None,
        vocab_start: int | None = None,
        **options,
    ) -> None:
        super().__init__()
        self.options = LossOptions(**options)
        self.process_group = process_group
        self.vocab_start = vocab_start
        self.register_buffer("ce_weight_shard", ce_weight_shard, persistent=False)

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
