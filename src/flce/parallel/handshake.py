"""The once-per-call handshake of the vocab-parallel loss: every rank's small record
gathered once, so all ranks refuse an inconsistent call together (instead of
deadlocking in a collective) and learn the global vocabulary and each shard's start."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flce.dispatch import BACKEND_NAMES
from flce.driver.scaling import requested_sums_in_fp16
from flce.driver.sizing import CHUNK_BUDGET_ENV_VAR, chunk_budget_bytes
from flce.driver.validation import take_pending_error
from flce.options import FLOAT_DTYPES, OPTION_FIELDS, LossOptions, row_count

ENTRY = "vocab_parallel_fused_linear_cross_entropy"

# One field of the record per loss option (a crc32 of its value), so that a refusal names
# the option that differs.
_OPTION_PREFIX = "option "

# Fields of the per-rank record gathered once per call (int64).
_FIELDS = (
    "error",  # 1 if this rank's local validation failed
    "earlier_error",  # 1 if an earlier flce call of this rank had bad input (found on the device)
    "vocab_start_given",
    "vocab_start",
    "shard_size",
    "rows",
    "hidden",
    "has_bias",
    "has_ce_weight",
    "grad_input",
    "grad_weight",
    "grad_bias",
    *(_OPTION_PREFIX + name for name in OPTION_FIELDS),
    "backend",  # the per-shard kernels, as an index into BACKEND_NAMES
    "chunk_budget",  # the budget that sizes the chunks when chunk_size is None (else 0)
    "compute_dtype",
    "input_dtype",  # the dtype of dX, all-reduced in backward
    "row_sums_in_fp16",  # dW/db requested of an fp16 shard: sets dX's prescale (flce.driver.scaling)
    "target",  # checksum of the target
)
_MUST_AGREE = {
    "vocab_start_given": "whether vocab_start is passed",
    "rows": "the number of tokens (input rows)",
    "hidden": "the hidden size H",
    "has_bias": "whether bias_shard is passed",
    "has_ce_weight": "whether ce_weight_shard is passed",
    "grad_input": "whether input requires grad",
    "grad_weight": "whether weight_shard requires grad",
    "grad_bias": "whether bias_shard requires grad",
    # The two process-local settings that decide the chunks besides the options: ranks
    # sizing them differently would pair collectives of different sizes.
    "backend": "the per-shard kernels (backend=, else FLCE_BACKEND, else the device's default)",
    "chunk_budget": f"the chunk budget in bytes ({CHUNK_BUDGET_ENV_VAR}, read when chunk_size is None)",
    "compute_dtype": "the compute dtype (input/weight dtype or autocast dtype)",
    "input_dtype": "the input dtype (dX, all-reduced in backward, has it)",
    "row_sums_in_fp16": "whether a gradient of an fp16 weight_shard or bias_shard is requested "
    "(the scale of the forward's dX, all-reduced in backward, depends on it)",
    "target": "the target (every rank must pass the same full target; shown: its checksums)",
}

# Fields recorded as an index into a tuple of names, shown as the names.
_NAMED_FIELDS = {"compute_dtype": FLOAT_DTYPES, "input_dtype": FLOAT_DTYPES, "backend": BACKEND_NAMES}


def gather_class_weights(ce_weight, sizes, starts, vocab, group, world) -> torch.Tensor:
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


def resolve_group(process_group):
    """The process group to run on (the world group by default). Refused here, before any
    collective: a rank outside the group (no other rank waits for it) and an object that
    is not a process group."""
    if not dist.is_available():
        raise RuntimeError(f"{ENTRY} needs torch.distributed, which this PyTorch build lacks")
    if not dist.is_initialized():
        raise RuntimeError(
            f"{ENTRY}: torch.distributed is not initialized; call torch.distributed.init_process_group() "
            "first (a group of size 1 is fine) or pass a DTensor weight_shard"
        )
    if process_group is None:
        return dist.group.WORLD
    if process_group is dist.GroupMember.NON_GROUP_MEMBER:  # what dist.new_group returns on the ranks left out
        raise ValueError(
            f"{ENTRY}: this rank is not a member of process_group; call the loss only on the ranks of the "
            "group it is given (dist.new_group(ranks) returns a placeholder on the other ranks)"
        )
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"{ENTRY}: process_group must be None or a torch.distributed ProcessGroup (dist.new_group(ranks)), "
            f"got {type(process_group).__name__}"
        )
    return process_group


def _comm_device(group, input) -> torch.device:
    if isinstance(input, torch.Tensor) and input.device.type != "meta":  # a meta input is refused, on the host
        return input.device
    backend = str(dist.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# An odd multiplier: position -> (position * it) mod 2**31 is a bijection on [0, 2**31).
_POSITION_HASH = 2654435761


def _target_checksum(target: torch.Tensor) -> torch.Tensor:
    """A position-weighted sum of the target (no extra host read): equal targets give
    equal sums. Every position has its own weight (a bijection of the position, not a
    period, which two positions a period apart shared), so two rows swapped or any single
    difference is caught, other differences with overwhelming likelihood. Sums past int64
    wrap alike on every rank."""
    flat = target.reshape(-1).long()
    positions = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64)
    weights = ((positions * _POSITION_HASH) & 0x7FFFFFFF) + 1
    return (flat * weights).sum()


def _fingerprint(value) -> int:
    return zlib.crc32(repr(value).encode())


def _describe(values: list) -> str:
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))


def _record(
    input, weight, target, bias, ce_weight, options: LossOptions, compute_dtype, backend: str, vocab_start, device
) -> torch.Tensor:
    """This rank's record (``_FIELDS``), built from its checked arguments."""
    grad_enabled = torch.is_grad_enabled()
    record = dict(
        error=0,
        earlier_error=0,
        vocab_start_given=int(vocab_start is not None),
        vocab_start=vocab_start or 0,
        shard_size=weight.shape[0],
        rows=row_count(input),
        hidden=input.shape[-1],
        has_bias=int(bias is not None),
        has_ce_weight=int(ce_weight is not None),
        grad_input=int(grad_enabled and input.requires_grad),
        grad_weight=int(grad_enabled and weight.requires_grad),
        grad_bias=int(grad_enabled and bias is not None and bias.requires_grad),
        backend=BACKEND_NAMES.index(backend),
        chunk_budget=chunk_budget_bytes() if options.chunk_size is None else 0,
        compute_dtype=FLOAT_DTYPES.index(compute_dtype),
        input_dtype=FLOAT_DTYPES.index(input.dtype),
        row_sums_in_fp16=int(requested_sums_in_fp16(weight, bias)),
        target=0,
    )
    for name in OPTION_FIELDS:
        record[_OPTION_PREFIX + name] = _fingerprint(getattr(options, name))
    mine = torch.tensor([record[f] for f in _FIELDS], dtype=torch.int64, device=device)
    mine[_FIELDS.index("target")] = _target_checksum(target).to(device)
    return mine


@dataclass(frozen=True)
class Agreement:
    """What the handshake established, the same on every rank."""

    world_size: int
    vocab: int  # global V
    shard_sizes: list[int]
    shard_starts: list[int]
    vocab_start: int  # this rank's first global class id


def agree_on_call(
    input,
    weight,
    target,
    bias,
    ce_weight,
    options: LossOptions,
    compute_dtype: torch.dtype | None,
    backend: str | None,  # the name of the per-shard kernels
    local_error: Exception | None,
    group,
    vocab_start: int | None,
) -> Agreement:
    """One all_gather of every rank's record (after each rank's local validation, whose
    error ``local_error`` is raised here on the rank that had it, and reported on the
    others); refuses, on every rank alike, calls that do not match across ranks."""
    world = dist.get_world_size(group)
    device = _comm_device(group, input)
    mine = None
    if local_error is None:
        try:  # an error building the record is this rank's too: raised after the gather
            mine = _record(input, weight, target, bias, ce_weight, options, compute_dtype, backend, vocab_start, device)
        except Exception as exc:  # noqa: BLE001 - re-raised below, once the other ranks know
            local_error = exc
    # An earlier call's bad input that the device found (CUDA defers the checks) is raised
    # here, on every rank: raised after this call's forward on the ranks whose check had
    # landed, it would leave the others waiting in the backward's all-reduce. Waiting for
    # the checks costs nothing the handshake's own host read does not wait for. A rank that
    # raises its own error now leaves them pending, for its next call.
    earlier_error = take_pending_error(wait=True) if local_error is None else None
    if mine is None:
        mine = torch.zeros(len(_FIELDS), dtype=torch.int64, device=device)
        mine[_FIELDS.index("error")] = 1
    mine[_FIELDS.index("earlier_error")] = int(earlier_error is not None)

    if world > 1:
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=group)
        table = torch.stack(gathered).tolist()  # the setup's host read
    else:
        table = [mine.tolist()]
    columns = {name: [row[i] for row in table] for i, name in enumerate(_FIELDS)}

    if local_error is not None:
        raise local_error
    if earlier_error is not None:
        raise ValueError(earlier_error)
    bad = [r for r, e in enumerate(columns["error"]) if e]
    if bad:
        raise ValueError(
            f"{ENTRY}: rank(s) {bad} of the process group rejected their inputs (see the error raised "
            "there); every rank must call with valid, matching arguments"
        )
    bad_earlier = [r for r, e in enumerate(columns["earlier_error"]) if e]
    if bad_earlier:
        raise ValueError(
            f"{ENTRY}: rank(s) {bad_earlier} found bad input in an earlier flce call (see the error raised there); "
            "this call is refused on every rank"
        )
    for name in OPTION_FIELDS:
        values = columns[_OPTION_PREFIX + name]
        differing = [r for r, v in enumerate(values) if v != values[0]]
        if differing:
            raise ValueError(
                f"{ENTRY}: the loss options must be the same on every rank, but {name} on rank(s) {differing} "
                f"differs from rank 0's (this rank's: {name}={getattr(options, name)!r})"
            )
    for field, what in _MUST_AGREE.items():
        values = columns[field]
        if any(v != values[0] for v in values):
            shown = [_NAMED_FIELDS[field][v] for v in values] if field in _NAMED_FIELDS else values
            raise ValueError(f"{ENTRY}: {what} must be the same on every rank, got {_describe(shown)}")

    sizes = columns["shard_size"]
    starts = [sum(sizes[:r]) for r in range(world)] if vocab_start is None else columns["vocab_start"]
    end = 0
    for r in sorted(range(world), key=lambda r: starts[r]):
        if starts[r] != end:
            raise ValueError(
                f"{ENTRY}: the vocabulary shards must tile [0, V) without gaps or overlaps; got "
                + ", ".join(f"rank {q}: [{starts[q]}, {starts[q] + sizes[q]})" for q in range(world))
            )
        end += sizes[r]
    return Agreement(world, sum(sizes), sizes, starts, starts[dist.get_rank(group)])
