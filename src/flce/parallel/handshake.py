"""The once-per-call handshake of the vocab-parallel loss: every rank's small record
gathered once, so all ranks refuse an inconsistent call together (instead of
deadlocking in a collective) and learn the global vocabulary and each shard's start."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flce.options import FLOAT_DTYPES, LossOptions, row_count

ENTRY = "vocab_parallel_fused_linear_cross_entropy"


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
    "input_dtype",  # the dtype of dX, all-reduced in backward
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
    "input_dtype": "the input dtype (dX, all-reduced in backward, has it)",
    "target": "the target (every rank must pass the same full target)",
}

_DTYPE_FIELDS = ("compute_dtype", "input_dtype")  # recorded as indices into FLOAT_DTYPES


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
    local_error: Exception | None,
    group,
    vocab_start: int | None,
) -> Agreement:
    """One all_gather of every rank's record (after each rank's local validation, whose
    error ``local_error`` is raised here on the rank that had it, and reported on the
    others); refuses, on every rank alike, calls that do not match across ranks."""
    world = dist.get_world_size(group)
    device = _comm_device(group, input)
    grad_enabled = torch.is_grad_enabled()
    if local_error is None:
        record = dict(
            error=0,
            vocab_start_given=int(vocab_start is not None),
            vocab_start=vocab_start or 0,
            shard_size=weight.shape[0],
            rows=row_count(input),
            hidden=input.shape[-1],
            has_bias=int(bias is not None),
            has_ce_weight=int(ce_weight is not None),
            chunk_size=options.chunk_size or 0,
            grad_input=int(grad_enabled and input.requires_grad),
            grad_weight=int(grad_enabled and weight.requires_grad),
            grad_bias=int(grad_enabled and bias is not None and bias.requires_grad),
            options=_options_fingerprint(options),
            compute_dtype=FLOAT_DTYPES.index(compute_dtype),
            input_dtype=FLOAT_DTYPES.index(input.dtype),
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
            f"{ENTRY}: rank(s) {bad} of the process group rejected their inputs (see the error raised "
            "there); every rank must call with valid, matching arguments"
        )
    for field, what in _MUST_AGREE.items():
        values = columns[field]
        if any(v != values[0] for v in values):
            shown = [FLOAT_DTYPES[v] for v in values] if field in _DTYPE_FIELDS else values
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
