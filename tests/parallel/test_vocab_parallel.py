"""Vocab-parallel FLCE on CPU over gloo: 2 and 4 spawned ranks with uneven vocabulary
splits, random shapes and feature combinations, judged in the parent against the
float64 reference and against ``flce.fused_linear_cross_entropy`` on the full weight;
plus in-process tests on a process group of size 1.

Each spawn runs every case of its world size in one process group (process start-up
dominates the cost); workers save their results to ``tmp_path`` and the parent asserts.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import math
import os
import random
import time
from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flce
from flce.parallel import VocabParallelFusedLinearCrossEntropyLoss, vocab_parallel_fused_linear_cross_entropy
from flce.reference import fused_linear_cross_entropy_reference
from tests.gloo_ranks import free_port, gloo_rank

SPAWN_TIMEOUT_S = 240
FIXED_SPLITS = {2: (10, 27), 4: (5, 9, 11, 12)}  # V = 37


# ----------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Spec:
    name: str
    seed: int
    split: tuple  # shard sizes, in group-rank order
    batch: tuple  # (N,) or (B, T)
    hidden: int
    reduction: str = "mean"
    label_smoothing: float = 0.0
    lse_square_scale: float = 0.0
    softcap: float | None = None
    ce_weight: bool = False
    use_token_scaling: bool = False
    accuracy: bool = False
    predicted: bool = False
    return_z_loss: bool = False
    bias: bool = False
    ignore_index: int = -100
    ignore_fraction: float = 0.2
    grads: tuple = ("input", "weight", "bias")
    chunk_size: int | None = None
    upstream: float = 1.0
    layout: str = "default"  # "default": vocab_start inferred; "given": passed; "reversed": passed, reversed order
    repeat_backward: bool = False
    module: bool = False
    backend: str | None = None  # the per-shard kernels (None: auto, PyTorch on CPU)

    @property
    def vocab(self) -> int:
        return sum(self.split)

    def starts(self) -> list[int]:
        order = list(range(len(self.split)))
        if self.layout == "reversed":
            order.reverse()
        starts, offset = [0] * len(self.split), 0
        for r in order:
            starts[r] = offset
            offset += self.split[r]
        return starts

    def kwargs(self) -> dict:
        return dict(
            ignore_index=self.ignore_index,
            lse_square_scale=self.lse_square_scale,
            label_smoothing=self.label_smoothing,
            reduction=self.reduction,
            softcap=self.softcap,
            return_z_loss=self.return_z_loss,
            use_token_scaling=self.use_token_scaling,
            return_token_accuracy=self.accuracy,
            return_predicted_tokens=self.predicted,
            backend=self.backend,
        )


def _random_split(rng: random.Random, world: int) -> tuple:
    vocab = rng.randint(world + 3, 70)
    cuts = sorted(rng.sample(range(1, vocab), world - 1))
    edges = [0, *cuts, vocab]
    return tuple(edges[i + 1] - edges[i] for i in range(world))


def make_specs(world: int) -> list[Spec]:
    rng = random.Random(4242 + world)
    fixed = FIXED_SPLITS[world]
    specs = [
        Spec("plain", 1, fixed, (29,), 16),
        Spec(
            "all_features",
            2,
            fixed,
            (4, 9),
            12,
            label_smoothing=0.1,
            lse_square_scale=1e-2,
            softcap=4.0,
            ce_weight=True,
            accuracy=True,
            predicted=True,
            return_z_loss=True,
            bias=True,
            chunk_size=7,
        ),
        Spec(
            "token_scaling_sum",
            3,
            fixed,
            (31,),
            8,
            reduction="sum",
            use_token_scaling=True,
            bias=True,
            accuracy=True,
            upstream=-0.7,
        ),
        Spec(
            "none_backward",
            4,
            fixed,
            (3, 7),
            8,
            reduction="none",
            label_smoothing=0.2,
            ce_weight=True,
            return_z_loss=True,
            lse_square_scale=1e-3,
            bias=True,
            chunk_size=5,
            predicted=True,
        ),
        Spec(
            "ignore_is_class", 5, fixed, (25,), 8, ignore_index=3, accuracy=True, predicted=True, label_smoothing=0.05
        ),
        Spec(
            "all_ignored",
            6,
            fixed,
            (9,),
            8,
            ignore_fraction=1.0,
            ce_weight=True,
            lse_square_scale=1e-2,
            accuracy=True,
            bias=True,
        ),
        Spec("weight_only_grad", 7, fixed, (17,), 8, grads=("weight",), ce_weight=True, label_smoothing=0.1),
        Spec("no_grad", 8, fixed, (17,), 8, grads=(), accuracy=True, predicted=True, softcap=2.0),
        Spec(
            "repeat_backward",
            9,
            fixed,
            (19,),
            8,
            bias=True,
            upstream=2.5,
            repeat_backward=True,
            lse_square_scale=1e-2,
            chunk_size=6,
        ),
        Spec("given_layout", 10, fixed, (21,), 8, layout="given", predicted=True, accuracy=True),
        Spec(
            "reversed_layout",
            11,
            fixed,
            (21,),
            8,
            layout="reversed",
            ce_weight=True,
            label_smoothing=0.1,
            bias=True,
            predicted=True,
            chunk_size=4,
        ),
        Spec("module", 12, fixed, (2, 8), 8, module=True, ce_weight=True, bias=True, reduction="sum", accuracy=True),
        Spec(
            "one_row_chunks",
            13,
            fixed,
            (6,),
            8,
            chunk_size=1,
            softcap=1.5,
            use_token_scaling=True,
            label_smoothing=0.3,
            ce_weight=True,
            bias=True,
            predicted=True,
        ),
    ]
    # Random shapes, splits and feature combinations.
    for i in range(10):
        reduction = rng.choice(["mean", "sum", "none"])
        n = rng.randint(1, 40)
        specs.append(
            Spec(
                f"random{i}",
                100 + i,
                _random_split(rng, world) if i % 2 else fixed,
                (n,) if rng.random() < 0.7 else (rng.randint(1, 4), rng.randint(1, 8)),
                rng.choice([4, 8, 24]),
                reduction=reduction,
                label_smoothing=rng.choice([0.0, 0.0, 0.1, 0.5]),
                lse_square_scale=rng.choice([0.0, 1e-3, 0.1]),
                softcap=rng.choice([None, None, 1.0, 5.0]),
                ce_weight=rng.random() < 0.5,
                use_token_scaling=rng.random() < 0.3,
                accuracy=rng.random() < 0.5,
                predicted=rng.random() < 0.5,
                return_z_loss=rng.random() < 0.5,
                bias=rng.random() < 0.5,
                ignore_index=rng.choice([-100, -100, 0]),
                ignore_fraction=rng.choice([0.0, 0.25, 0.6]),
                chunk_size=rng.choice([None, 1, 3, 8]),
                upstream=rng.choice([1.0, 0.5, -2.0]),
                layout=rng.choice(["default", "given", "reversed"]),
            )
        )
    # The Triton split-row kernels (through Triton's interpreter on CPU), on the cases
    # that reach every branch: targets owned by another rank, smoothing with class
    # weights, softcap, z-loss, token scaling, ignored rows, one-row chunks.
    if flce.dispatch.availability("triton", torch.device("cpu"))[0]:
        for spec in list(specs):
            if spec.name in TRITON_CASES:
                specs.append(replace(spec, name=f"{spec.name}_triton", backend="triton"))
    return specs


TRITON_CASES = (
    "all_features",
    "token_scaling_sum",
    "none_backward",
    "ignore_is_class",
    "all_ignored",
    "reversed_layout",
    "one_row_chunks",
    "random3",
)


def make_tensors(spec: Spec) -> dict:
    """The full problem of a case (identical in every process)."""
    gen = torch.Generator().manual_seed(spec.seed)
    n = 1
    for d in spec.batch:
        n *= d
    vocab, hidden = spec.vocab, spec.hidden
    x = torch.randn(*spec.batch, hidden, generator=gen)
    weight = torch.randn(vocab, hidden, generator=gen) / hidden**0.25
    bias = torch.randn(vocab, generator=gen) if spec.bias else None
    ce_weight = torch.rand(vocab, generator=gen) + 0.1 if spec.ce_weight else None
    target = torch.randint(0, vocab, spec.batch, generator=gen)
    ignored = torch.rand(spec.batch, generator=gen) < spec.ignore_fraction
    target = torch.where(ignored, torch.full_like(target, spec.ignore_index), target)
    upstream = torch.randn(spec.batch, generator=gen) if spec.reduction == "none" else torch.tensor(spec.upstream)
    return dict(x=x, weight=weight, bias=bias, ce_weight=ce_weight, target=target, upstream=upstream, n=n)


def _unpack(out):
    if isinstance(out, torch.Tensor):
        return out, None, None, None
    return out.loss, out.z_loss, out.token_accuracy, out.predicted_tokens


# ---------------------------------------------------------------------------- worker


def _run_case(spec: Spec, rank: int) -> dict:
    t = make_tensors(spec)
    starts = spec.starts()
    v0, size = starts[rank], spec.split[rank]
    rows = slice(v0, v0 + size)
    x = t["x"].clone().requires_grad_("input" in spec.grads)
    w = t["weight"][rows].clone().requires_grad_("weight" in spec.grads)
    b = None if t["bias"] is None else t["bias"][rows].clone().requires_grad_("bias" in spec.grads)
    cw = None if t["ce_weight"] is None else t["ce_weight"][rows].clone()
    vocab_start = None if spec.layout == "default" else v0
    if spec.module:
        loss_fn = VocabParallelFusedLinearCrossEntropyLoss(
            cw, vocab_start=vocab_start, chunk_size=spec.chunk_size, **spec.kwargs()
        )
        out = loss_fn(x, w, t["target"], b)
    else:
        out = vocab_parallel_fused_linear_cross_entropy(
            x,
            w,
            t["target"],
            bias_shard=b,
            ce_weight_shard=cw,
            vocab_start=vocab_start,
            chunk_size=spec.chunk_size,
            **spec.kwargs(),
        )
    loss, z_loss, accuracy, predicted = _unpack(out)
    result = dict(loss=loss.detach(), z_loss=z_loss, accuracy=accuracy, predicted=predicted)
    leaves = [
        (name, tensor)
        for name, tensor in (("input", x), ("weight", w), ("bias", b))
        if tensor is not None and tensor.requires_grad
    ]
    if leaves:
        objective = (loss * t["upstream"]).sum()
        grads = torch.autograd.grad(objective, [v for _, v in leaves], retain_graph=spec.repeat_backward)
        result["grads"] = {name: g for (name, _), g in zip(leaves, grads, strict=False)}
        if spec.repeat_backward:
            again = torch.autograd.grad(objective, [v for _, v in leaves])
            result["grads_again"] = {name: g for (name, _), g in zip(leaves, again, strict=False)}
    return result


@contextlib.contextmanager
def _environment(name: str, value: str | None):
    """The environment variable ``name`` set to ``value`` (None: unset) inside the block."""
    saved = os.environ.pop(name, None)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)
        if saved is not None:
            os.environ[name] = saved


def _capture(fn) -> tuple:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the parent asserts on type and message
        return type(exc).__name__, str(exc)
    return None, None


def _error_cases(rank: int, world: int) -> dict:
    """Refusals, each raised on every rank alike (no rank left waiting in a collective)."""
    split = FIXED_SPLITS[world]
    vocab, hidden = sum(split), 8
    v0 = sum(split[:rank])
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(11, hidden, generator=gen)
    weight = torch.randn(vocab, hidden, generator=gen)[v0 : v0 + split[rank]]
    target = torch.randint(0, vocab, (11,), generator=gen)
    call = vocab_parallel_fused_linear_cross_entropy
    out = {}

    bad_target = target.clone()
    bad_target[4] = vocab  # valid for no shard: must be checked against the global V
    out["range"] = _capture(lambda: call(x, weight, bad_target))
    w_bad_h = torch.randn(split[rank], hidden + 1) if rank == 1 else weight
    out["hidden"] = _capture(lambda: call(x, w_bad_h, target))
    out["overlap"] = _capture(lambda: call(x, weight, target, vocab_start=0))
    out["options"] = _capture(lambda: call(x, weight, target, label_smoothing=0.1 if rank == 1 else 0.0))
    other_target = target.roll(1) if rank == world - 1 else target
    out["target_differs"] = _capture(lambda: call(x, weight, other_target))
    cw = torch.ones(split[rank] + (1 if rank == 0 else 0))
    out["ce_weight_shape"] = _capture(lambda: call(x, weight, target, ce_weight_shard=cw))
    cw_some = torch.ones(split[rank]) if rank == 0 else None
    out["ce_weight_some_ranks"] = _capture(lambda: call(x, weight, target, ce_weight_shard=cw_some))
    cw_negative = -torch.ones(split[rank]) if rank == 1 else torch.ones(split[rank])
    out["negative_ce_weight"] = _capture(lambda: call(x, weight, target, ce_weight_shard=cw_negative))
    out["dtype"] = _capture(lambda: call(x.double(), weight.double(), target))
    # Refusals found before the handshake (the options, the backend) on one rank only.
    out["option_one_rank"] = _capture(lambda: call(x, weight, target, label_smoothing=1.5 if rank == 1 else 0.0))
    out["backend_one_rank"] = _capture(lambda: call(x, weight, target, backend="cutedsl" if rank == 0 else None))
    out["input_none_one_rank"] = _capture(lambda: call(None if rank == 1 else x, weight, target))
    only_rank0 = dist.new_group([0])  # a placeholder on the other ranks

    def mixed_input_dtypes():  # one compute dtype (autocast), but dX all-reduced in two dtypes
        leaf = (x if rank == 0 else x.bfloat16()).clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            call(leaf, weight, target).backward()

    out["input_dtype"] = _capture(mixed_input_dtypes)
    out["not_a_member"] = _capture(lambda: call(x, weight, target, process_group=only_rank0)) if rank else None
    # A vocab_start past int64 on one rank (the others pass theirs): refused by name, not
    # an overflow building that rank's record while the others wait in the handshake.
    out["vocab_start_past_int64"] = _capture(lambda: call(x, weight, target, vocab_start=2**64 if rank == 1 else v0))
    # Process-local settings that decide the chunks (every rank runs the same collectives):
    # the chunk budget and the per-shard kernels chosen by FLCE_BACKEND, on one rank only.
    with _environment("FLCE_CHUNK_BUDGET_MIB", "1" if rank == 0 else None):
        out["chunk_budget_one_rank"] = _capture(lambda: call(x, weight, target))
    if flce.dispatch.availability("triton", torch.device("cpu"))[0]:
        with _environment("FLCE_BACKEND", "triton" if rank == 0 else None):
            out["env_backend_one_rank"] = _capture(lambda: call(x, weight, target))
    # Targets that differ by a swap of two rows (7919 apart: the old checksum weighted
    # their positions alike) on the last rank.
    long_x = torch.randn(2 * 7919, 2, generator=gen)
    long_target = torch.arange(2 * 7919) % vocab
    if rank == world - 1:
        long_target[[0, 7919]] = long_target[[7919, 0]]
    out["target_swapped"] = _capture(lambda: call(long_x, weight[:, :2], long_target))
    # An earlier call's bad input found on the device of one rank only (CUDA defers the
    # checks; simulated here): raised by the handshake on every rank, not after the
    # forward on that rank alone, which left the others in the backward's all-reduce.
    from flce.parallel import handshake

    real_take = handshake.take_pending_error
    if rank == 1:
        handshake.take_pending_error = lambda wait=False, earlier=None: "target has values outside [0, V)"
    try:
        out["earlier_error_one_rank"] = _capture(lambda: call(x.requires_grad_(), weight, target).backward())
    finally:
        handshake.take_pending_error = real_take
        x.requires_grad_(False)
    # A rank that raises its own error leaves the earlier checks pending (for its next call)
    # instead of reading and dropping them.
    taken = []
    handshake.take_pending_error = lambda wait=False, earlier=None: taken.append(wait)
    try:
        out["earlier_error_kept_by_a_local_error"] = (_capture(lambda: call(x, w_bad_h, target)), taken[:])
    finally:
        handshake.take_pending_error = real_take
    # The group is still usable after every refusal.
    out["after"] = call(x, weight, target).detach()
    return out


# Columns whose weight row holds one +-inf (V = 37, on several ranks): their logit is NaN
# where the row's hidden value there is 0 (inf * 0), +-inf elsewhere.
NAN_INF_COLUMNS = {3: (0, math.inf), 12: (0, -math.inf), 30: (1, math.inf), 36: (2, math.inf)}


def nan_logit_problem() -> tuple:
    """``x, weight, target``: every sign pattern of the first three hidden values (rows
    with NaN and +-inf logits on one rank or several) and a row of NaN only; targets at
    the eager argmax on every other row."""
    gen = torch.Generator().manual_seed(21)
    weight = torch.randn(37, 4, generator=gen)
    for column, (k, value) in NAN_INF_COLUMNS.items():
        weight[column] = 0.0
        weight[column, k] = value
    signs = torch.tensor(list(itertools.product((0.0, 1.0, -1.0), repeat=3)))
    x = torch.cat([signs, torch.randn(len(signs), 1, generator=gen)], dim=1)
    x = torch.cat([x, torch.full((1, 4), math.nan)])
    target = torch.randint(0, 37, (len(x),), generator=gen)
    target[::2] = (x @ weight.T).argmax(dim=-1)[::2]
    return x, weight, target


def _nan_argmax_case(rank: int, world: int) -> dict:
    """Predicted tokens and accuracy of rows with NaN logits, per backend."""
    split = FIXED_SPLITS[world]
    v0 = sum(split[:rank])
    x, weight, target = nan_logit_problem()
    backends = ["torch"] + (["triton"] if flce.dispatch.availability("triton", torch.device("cpu"))[0] else [])
    results = {}
    for backend in backends:
        out = vocab_parallel_fused_linear_cross_entropy(
            x,
            weight[v0 : v0 + split[rank]],
            target,
            reduction="none",
            return_predicted_tokens=True,
            return_token_accuracy=True,
            chunk_size=8,
            backend=backend,
        )
        results[backend] = (out.predicted_tokens, out.token_accuracy)
    return results


def _dtensor_case(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    t = make_tensors(Spec("dtensor", 77, FIXED_SPLITS[world], (13,), 8, bias=True, ce_weight=True))
    weight = torch.nn.Parameter(distribute_tensor(t["weight"], mesh, [Shard(0)]))
    bias = torch.nn.Parameter(distribute_tensor(t["bias"], mesh, [Shard(0)]))
    ce_weight = distribute_tensor(t["ce_weight"], mesh, [Shard(0)])
    x = t["x"].clone().requires_grad_()
    out = vocab_parallel_fused_linear_cross_entropy(
        x,
        weight,
        t["target"],
        bias_shard=bias,
        ce_weight_shard=ce_weight,
        label_smoothing=0.1,
        return_predicted_tokens=True,
    )
    out.loss.backward()
    replicated = distribute_tensor(t["weight"], mesh, [Replicate()])
    # The adapter's refusals on some ranks only: raised in the handshake, on every rank.
    vocab_start_on_rank1 = _capture(
        lambda: vocab_parallel_fused_linear_cross_entropy(x, weight, t["target"], vocab_start=0 if rank == 1 else None)
    )
    # A Shard(0) DTensor built from local shards that do not split like torch.chunk: the
    # first and last ranks' sizes differ from torch.chunk's, the middle ones' do not.
    sizes = [2] + [3] * (world - 2) + [2] if world > 2 else [1, 3]
    start = sum(sizes[:rank])
    uneven = DTensor.from_local(
        t["weight"][start : start + sizes[rank]],
        mesh,
        [Shard(0)],
        run_check=False,
        shape=torch.Size([sum(sizes), t["weight"].shape[1]]),
        stride=(t["weight"].shape[1], 1),
    )
    uneven_target = t["target"].clamp(max=sum(sizes) - 1)
    return dict(
        vocab_start_on_rank1=vocab_start_on_rank1,
        uneven_error=_capture(lambda: vocab_parallel_fused_linear_cross_entropy(x, uneven, uneven_target)),
        loss=out.loss.detach(),
        predicted=out.predicted_tokens,
        dx=x.grad,
        dw=weight.grad.to_local(),
        db=bias.grad.to_local(),
        dw_is_dtensor=type(weight.grad).__name__,
        replicate_error=_capture(lambda: vocab_parallel_fused_linear_cross_entropy(x, replicated, t["target"])),
    )


class _GatherTokens(torch.autograd.Function):
    """The all-gather of sequence-parallel hidden states that docs/parallel.md prescribes
    (Megatron's ``gather_from_sequence_parallel_region(tensor_parallel_output_grad=False)``):
    its backward takes this rank's slice of the gradient, which the loss has already summed
    over the ranks."""

    @staticmethod
    def forward(ctx, tokens):
        parts = [torch.empty_like(tokens) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tokens.contiguous())
        ctx.rows = tokens.shape[0]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        start = dist.get_rank() * ctx.rows
        return grad[start : start + ctx.rows]


def _sequence_parallel_case(rank: int, world: int) -> dict:
    """Each rank holds a slice of the tokens, gathered before the loss: its gradient is
    its slice of the full dX (not the sum of the ranks' identical copies)."""
    split = FIXED_SPLITS[world]
    v0 = sum(split[:rank])
    t = make_tensors(Spec("sequence_parallel", 31, split, (4 * world,), 8))
    rows = slice(4 * rank, 4 * rank + 4)
    tokens = t["x"][rows].clone().requires_grad_()
    vocab_parallel_fused_linear_cross_entropy(
        _GatherTokens.apply(tokens), t["weight"][v0 : v0 + split[rank]], t["target"]
    ).backward()
    return dict(dx=tokens.grad, rows=rows)


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    with gloo_rank(rank, world, port):
        results = {"cases": {spec.name: _run_case(spec, rank) for spec in make_specs(world)}}
        results["errors"] = _error_cases(rank, world)
        results["dtensor"] = _dtensor_case(rank, world)
        results["nan_argmax"] = _nan_argmax_case(rank, world)
        results["sequence_parallel"] = _sequence_parallel_case(rank, world)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _spawn(world: int, out_dir) -> list[dict]:
    context = mp.spawn(_worker, args=(world, free_port(), str(out_dir)), nprocs=world, join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not context.join(timeout=2):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"vocab-parallel workers (world {world}) did not finish in {SPAWN_TIMEOUT_S} s")
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def spawned(request, tmp_path_factory):
    world = request.param
    return world, _spawn(world, tmp_path_factory.mktemp(f"vp{world}"))


# ------------------------------------------------------------------------- judging

LOSS_TOL = dict(rtol=2e-5, atol=2e-6)
GRAD_TOL = dict(rtol=1e-4, atol=1e-5)


def _reference(spec: Spec) -> dict:
    t = make_tensors(spec)
    hidden = spec.hidden
    x = t["x"].double().requires_grad_("input" in spec.grads)
    w = t["weight"].double().requires_grad_("weight" in spec.grads)
    b = None if t["bias"] is None else t["bias"].double().requires_grad_("bias" in spec.grads)
    opts = spec.kwargs()
    for flag in ("return_z_loss", "return_token_accuracy", "return_predicted_tokens", "backend"):
        opts.pop(flag)
    ref = fused_linear_cross_entropy_reference(
        x.reshape(-1, hidden), w, t["target"].reshape(-1), b, ce_weight=t["ce_weight"], **opts
    )
    upstream = t["upstream"].double().reshape(-1) if spec.reduction == "none" else t["upstream"].double()
    leaves = {name: v for name, v in (("input", x), ("weight", w), ("bias", b)) if v is not None and v.requires_grad}
    grads = {}
    if leaves:
        values = torch.autograd.grad((ref.loss * upstream).sum(), list(leaves.values()))
        grads = dict(zip(leaves, values, strict=False))
    # The single-process library on the full weight, same options.
    full = flce.fused_linear_cross_entropy(
        t["x"],
        t["weight"],
        t["target"],
        bias=t["bias"],
        ce_weight=t["ce_weight"],
        chunk_size=spec.chunk_size,
        **dict(spec.kwargs(), backend="torch"),
    )
    return dict(ref=ref, grads=grads, full=_unpack(full), tensors=t)


def _check_case(spec: Spec, results: list[dict]) -> None:
    world = len(results)
    expected = _reference(spec)
    ref, t = expected["ref"], expected["tensors"]
    full_loss, _, full_acc, full_pred = expected["full"]
    starts = spec.starts()
    for rank, res in enumerate(results):
        where = f"{spec.name} rank {rank}/{world}"
        loss = res["loss"].double()
        torch.testing.assert_close(loss.reshape(-1), ref.loss.detach().reshape(-1), **LOSS_TOL, msg=where)
        torch.testing.assert_close(res["loss"], full_loss, **LOSS_TOL, msg=where)
        assert res["loss"].shape == full_loss.shape, where
        if spec.return_z_loss:
            z_loss = res["z_loss"].double().reshape(-1)
            torch.testing.assert_close(z_loss, ref.z_loss.reshape(-1), **LOSS_TOL, msg=where)
        else:
            assert res["z_loss"] is None, where
        if spec.accuracy:
            torch.testing.assert_close(res["accuracy"].double().reshape(-1), ref.token_accuracy.reshape(-1), msg=where)
            torch.testing.assert_close(res["accuracy"], full_acc, msg=where)
        else:
            assert res["accuracy"] is None, where
        if spec.predicted:
            assert torch.equal(res["predicted"].reshape(-1), ref.predicted_tokens), where
            assert torch.equal(res["predicted"], full_pred), where
            assert res["predicted"].shape == t["target"].shape, where
        else:
            assert res["predicted"] is None, where
        grads = res.get("grads", {})
        assert set(grads) == set(expected["grads"]), where
        rows = slice(starts[rank], starts[rank] + spec.split[rank])
        for key in ("grads", "grads_again") if spec.repeat_backward else ("grads",):
            for name, g in res.get(key, {}).items():
                want = expected["grads"][name]
                if name == "input":
                    want = want.reshape(g.shape)
                else:
                    want = want[rows]
                torch.testing.assert_close(g.double(), want, **GRAD_TOL, msg=f"{where} {key} d{name}")
    if "input" in spec.grads:  # dX is all-reduced: bitwise the same on every rank
        for res in results[1:]:
            assert torch.equal(res["grads"]["input"], results[0]["grads"]["input"]), spec.name


def test_cases_match_reference(spawned):
    world, results = spawned
    specs = make_specs(world)
    assert len(specs) >= 20
    for spec in specs:
        _check_case(spec, [r["cases"][spec.name] for r in results])


def test_refusals_are_collective(spawned):
    world, results = spawned
    errors = [r["errors"] for r in results]
    vocab = sum(FIXED_SPLITS[world])
    for rank, e in enumerate(errors):
        kind, msg = e["range"]
        assert kind == "ValueError" and f"[0, {vocab})" in msg, (rank, e["range"])
        kind, msg = e["hidden"]
        if rank == 1:
            assert kind == "ValueError" and "weight_shard must be (V, H) with H" in msg, msg
        else:
            assert kind == "ValueError" and "rank(s) [1]" in msg, msg
        kind, msg = e["overlap"]
        assert kind == "ValueError" and "tile [0, V)" in msg, msg
        kind, msg = e["options"]
        assert kind == "ValueError" and "loss options" in msg and "same on every rank" in msg, msg
        assert "label_smoothing" in msg and "rank(s) [1]" in msg, msg  # names the option and the ranks
        kind, msg = e["vocab_start_past_int64"]
        assert kind == "ValueError", msg
        assert ("vocab_start must be" in msg) if rank == 1 else ("rank(s) [1]" in msg), msg
        kind, msg = e["chunk_budget_one_rank"]
        assert kind == "ValueError" and "FLCE_CHUNK_BUDGET_MIB" in msg and "same on every rank" in msg, msg
        if "env_backend_one_rank" in e:
            kind, msg = e["env_backend_one_rank"]
            assert kind == "ValueError" and "rank 0: triton, rank 1: torch" in msg, msg
        kind, msg = e["earlier_error_one_rank"]
        assert kind == "ValueError", msg
        assert ("outside [0, V)" in msg) if rank == 1 else ("rank(s) [1] found bad input in an earlier" in msg), msg
        (kind, msg), taken = e["earlier_error_kept_by_a_local_error"]
        assert kind == "ValueError" and taken == ([] if rank == 1 else [True]), (kind, msg, taken)
        kind, msg = e["target_swapped"]
        assert kind == "ValueError" and "the target" in msg, msg
        kind, msg = e["target_differs"]
        assert kind == "ValueError" and "the target" in msg, msg
        kind, msg = e["ce_weight_shape"]
        assert kind == "ValueError", msg
        assert ("ce_weight_shard must have shape" in msg) if rank == 0 else ("rank(s) [0]" in msg), msg
        kind, msg = e["ce_weight_some_ranks"]
        assert kind == "ValueError" and "ce_weight_shard is passed" in msg, msg
        kind, msg = e["negative_ce_weight"]
        assert kind == "ValueError" and "finite and non-negative" in msg, msg
        kind, msg = e["dtype"]
        assert kind == "TypeError" and "float16, bfloat16 or float32" in msg, msg
        kind, msg = e["option_one_rank"]
        assert kind == "ValueError", msg
        assert ("label_smoothing must be in [0, 1]" in msg) if rank == 1 else ("rank(s) [1]" in msg), msg
        kind, msg = e["backend_one_rank"]
        if rank == 0:
            assert kind == "BackendUnavailableError" and "cutedsl" in msg, msg
        else:
            assert kind == "ValueError" and "rank(s) [0]" in msg, msg
        kind, msg = e["input_none_one_rank"]  # whatever the exception, every rank raises
        assert kind is not None and (rank == 1 or (kind == "ValueError" and "rank(s) [1]" in msg)), (kind, msg)
        kind, msg = e["input_dtype"]
        assert kind == "ValueError" and "the input dtype" in msg and "rank 1: torch.bfloat16" in msg, msg
        if rank:
            kind, msg = e["not_a_member"]
            assert kind == "ValueError" and "not a member of process_group" in msg, msg
        assert torch.isfinite(e["after"]), rank
        torch.testing.assert_close(e["after"], errors[0]["after"])


def test_dtensor_adapter(spawned):
    world, results = spawned
    spec = Spec(
        "dtensor", 77, FIXED_SPLITS[world], (13,), 8, bias=True, ce_weight=True, label_smoothing=0.1, predicted=True
    )
    expected = _reference(spec)
    ref = expected["ref"]
    vocab = spec.vocab
    per_rank = -(-vocab // world)  # Shard(0) splits like torch.chunk
    for rank, r in enumerate(results):
        d = r["dtensor"]
        rows = slice(min(rank * per_rank, vocab), min((rank + 1) * per_rank, vocab))
        torch.testing.assert_close(d["loss"].double(), ref.loss.detach(), **LOSS_TOL)
        assert torch.equal(d["predicted"], ref.predicted_tokens)
        torch.testing.assert_close(d["dx"].double(), expected["grads"]["input"], **GRAD_TOL)
        torch.testing.assert_close(d["dw"].double(), expected["grads"]["weight"][rows], **GRAD_TOL)
        torch.testing.assert_close(d["db"].double(), expected["grads"]["bias"][rows], **GRAD_TOL)
        assert d["dw_is_dtensor"] == "DTensor"
        kind, msg = d["replicate_error"]
        assert kind == "ValueError" and "Shard(0)" in msg and "to_local()" in msg, msg
        kind, msg = d["vocab_start_on_rank1"]
        assert kind == "ValueError", msg
        assert ("vocab_start is inferred" in msg) if rank == 1 else ("rank(s) [1]" in msg), msg
        kind, msg = d["uneven_error"]
        last = world - 1
        assert kind == "ValueError", msg
        if rank in (0, last):
            assert "cannot infer the vocabulary range" in msg, msg
        else:
            assert f"rank(s) [0, {last}]" in msg, msg


def test_predicted_tokens_of_rows_with_a_nan_logit_follow_torch_argmax(spawned):
    """torch.argmax ranks a NaN above every number (the first NaN's index wins): the
    ranks' combination must keep it (a NaN local max, negative NaN included, ranked below
    every number in the order-preserving keys, and the shard's argmax was taken after
    shifting by that NaN max: column 0)."""
    world, results = spawned
    x, weight, target = nan_logit_problem()
    eager = (x @ weight.T).argmax(dim=-1)
    assert (x @ weight.T).isnan().any(dim=-1).sum() >= 19, "most rows should hold a NaN logit"
    for rank, r in enumerate(results):
        for backend, (predicted, accuracy) in r["nan_argmax"].items():
            where = f"rank {rank}/{world} {backend}"
            assert predicted.tolist() == eager.tolist(), where
            assert accuracy.tolist() == (eager == target).float().tolist(), where


def test_sequence_parallel_hidden_states_get_their_slice_of_dx(spawned):
    """The gather docs/parallel.md prescribes for sequence-sharded hidden states: each
    rank's slice of the reference dX (a reduce-scatter there would multiply it by the
    world size)."""
    world, results = spawned
    expected = _reference(Spec("sequence_parallel", 31, FIXED_SPLITS[world], (4 * world,), 8))
    for rank, r in enumerate(results):
        case = r["sequence_parallel"]
        want = expected["grads"]["input"][case["rows"]]
        torch.testing.assert_close(case["dx"].double(), want, **GRAD_TOL, msg=f"rank {rank}")


# ------------------------------------------------------------- process group of size 1


def test_requires_initialized_process_group():
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    x, w, t = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2])
    with pytest.raises(RuntimeError, match="not initialized"):
        vocab_parallel_fused_linear_cross_entropy(x, w, t)


@pytest.fixture(scope="module")
def single_group():
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


SINGLE_OPTIONS = [
    dict(),
    dict(reduction="sum", label_smoothing=0.1, lse_square_scale=1e-2, return_z_loss=True),
    dict(
        reduction="none", softcap=3.0, use_token_scaling=True, return_token_accuracy=True, return_predicted_tokens=True
    ),
    dict(label_smoothing=0.2, softcap=2.0, ignore_index=2, return_token_accuracy=True),
]


@pytest.mark.parametrize("options", SINGLE_OPTIONS, ids=range(len(SINGLE_OPTIONS)))
@pytest.mark.parametrize("class_weights", [False, True], ids=["", "ce_weight"])
def test_group_of_one_equals_single_process(single_group, options, class_weights):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 11, 16, generator=gen)
    w = torch.randn(41, 16, generator=gen)
    b = torch.randn(41, generator=gen)
    cw = torch.rand(41, generator=gen) if class_weights else None
    target = torch.randint(0, 41, (2, 11), generator=gen)
    target[0, 3] = options.get("ignore_index", -100)

    def parallel(xx, ww, bb, **kw):
        return vocab_parallel_fused_linear_cross_entropy(
            xx, ww, target, process_group=single_group, bias_shard=bb, ce_weight_shard=cw, **kw
        )

    def single(xx, ww, bb, **kw):
        return flce.fused_linear_cross_entropy(xx, ww, target, bias=bb, ce_weight=cw, backend="torch", **kw)

    results = []
    for fn in (parallel, single):
        leaves = [x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()]
        out = fn(*leaves, chunk_size=5, **options)
        loss = _unpack(out)[0]
        upstream = torch.linspace(-1, 2, loss.numel()).reshape(loss.shape)
        grads = torch.autograd.grad((loss * upstream).sum(), leaves)
        results.append((_unpack(out), grads))
    (p_out, p_grads), (s_out, s_grads) = results
    for a, e in zip(p_out, s_out, strict=False):
        assert (a is None) == (e is None)
        if a is not None:
            torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)
    for a, e in zip(p_grads, s_grads, strict=False):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


def test_group_of_one_autocast_and_accum_dtype(single_group):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(19, 16, generator=gen)
    w = torch.randn(33, 16, generator=gen)
    target = torch.randint(0, 33, (19,), generator=gen)
    outs = []
    for fn in (vocab_parallel_fused_linear_cross_entropy, flce.fused_linear_cross_entropy):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn(xx, ww, target, chunk_size=4, accum_dtype=torch.float32)
        loss.backward()
        outs.append((loss, xx.grad, ww.grad))
    for a, e in zip(*outs, strict=False):
        assert a.dtype == e.dtype
        torch.testing.assert_close(a, e, rtol=2e-2, atol=1e-3)


def test_group_of_one_local_refusals(single_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    x, w, t = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2])
    call = vocab_parallel_fused_linear_cross_entropy
    with pytest.raises(ValueError, match=r"^weight_shard must be \(V, H\) with H = input.shape\[-1\] = 4"):
        call(x, torch.randn(5, 3), t)
    with pytest.raises(ValueError, match=r"^bias_shard must have shape \(5,\)"):
        call(x, w, t, bias_shard=torch.zeros(4))
    with pytest.raises(ValueError, match=r"target values must be in \[0, 5\)"):
        call(x, w, torch.tensor([0, 5, 1]))
    with pytest.raises(ValueError, match="vocab_start must be >= 0"):
        call(x, w, t, vocab_start=-1)
    with pytest.raises(ValueError, match="tile"):
        call(x, w, t, vocab_start=2)
    with pytest.raises(ValueError, match="reduction must be one of"):
        call(x, w, t, reduction="avg")
    # A rank whose shard is empty (a Shard(0) DTensor of V rows over more than V ranks)
    # is told so, not that the weight needs a row.
    with pytest.raises(ValueError, match="weight_shard has no rows on this rank"):
        call(x, torch.randn(0, 4), torch.tensor([-100, -100, -100]))
    from flce.dispatch import BackendUnavailableError, availability

    # cutedsl's split-row kernels need an sm_90+ CUDA GPU: refused here with the reason.
    with pytest.raises(BackendUnavailableError, match="backend 'cutedsl' cannot run on cpu") as info:
        call(x, w, t, backend="cutedsl")
    assert availability("cutedsl", torch.device("cpu"))[1] in str(info.value)
    mesh = init_device_mesh("cpu", (1,))
    with pytest.raises(TypeError, match="input is a DTensor"):
        call(distribute_tensor(x, mesh, [Replicate()]), w, t)
    with pytest.raises(ValueError, match="Shard\\(0\\)"):
        call(x, distribute_tensor(w, mesh, [Replicate()]), t)


@pytest.mark.parametrize("value", [None, [[1.0]], 1.5, "numpy"], ids=["None", "list", "float", "numpy"])
@pytest.mark.parametrize("name", ["input", "weight_shard", "target", "bias_shard", "ce_weight_shard", "module"])
def test_group_of_one_a_tensor_argument_given_as_something_else_is_refused_by_name(single_group, name, value):
    """None, a list, a number or a NumPy array where a tensor belongs: a TypeError naming
    the argument, raised in the handshake (not an AttributeError from the layout cache)."""
    if value == "numpy":
        value = pytest.importorskip("numpy").zeros((3, 4), dtype="float32")
    tensors = dict(input=torch.randn(3, 4), weight_shard=torch.randn(5, 4), target=torch.tensor([0, 1, 2]))
    vocab_parallel_fused_linear_cross_entropy(*tensors.values())  # a checked layout must not let it through
    if name == "module":  # its input, and its class weights (refused at construction)
        with pytest.raises(TypeError, match=r"^input must be a torch\.Tensor"):
            VocabParallelFusedLinearCrossEntropyLoss()(value, tensors["weight_shard"], tensors["target"])
        if value is not None:
            with pytest.raises(TypeError, match=r"^ce_weight_shard must be a torch\.Tensor"):
                VocabParallelFusedLinearCrossEntropyLoss(value)
        return
    if value is None and name in ("bias_shard", "ce_weight_shard"):
        return  # their default
    arguments = {**tensors, name: value}
    with pytest.raises(TypeError, match=rf"^{name} must be a (torch\.Tensor|tensor)"):
        vocab_parallel_fused_linear_cross_entropy(
            arguments["input"],
            arguments["weight_shard"],
            arguments["target"],
            bias_shard=arguments.get("bias_shard"),
            ce_weight_shard=arguments.get("ce_weight_shard"),
        )


def test_group_of_one_repeated_backward_does_not_compound(single_group):
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(7, 8, generator=gen, requires_grad=True)
    w = torch.randn(13, 8, generator=gen, requires_grad=True)
    target = torch.randint(0, 13, (7,), generator=gen)
    loss = vocab_parallel_fused_linear_cross_entropy(x, w, target) * 3.0
    first = torch.autograd.grad(loss, (x, w), retain_graph=True)
    second = torch.autograd.grad(loss, (x, w))
    for a, b in zip(first, second, strict=False):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("option", [dict(vocab_chunk_size=8), dict(memory_budget=2**20)])
def test_module_refuses_the_single_device_only_options(option):
    """The vocab-parallel chunks are whole shard rows sized by chunk_size: the module
    refuses the single-device sizing options instead of ignoring them."""
    with pytest.raises(TypeError, match=rf"unsupported option\(s\) \['{next(iter(option))}'\]"):
        VocabParallelFusedLinearCrossEntropyLoss(**option)


@pytest.mark.parametrize(
    "ce_weight_shard,error,message",
    [
        (torch.ones(5, dtype=torch.long), TypeError, "ce_weight_shard must be a floating-point tensor"),
        (torch.ones(5, 1), ValueError, r"ce_weight_shard must have shape \(V,\)"),
        (-torch.ones(5), ValueError, "ce_weight_shard must be finite and non-negative"),
    ],
    ids=["integer", "2-D", "negative"],
)
def test_module_refuses_bad_class_weights_when_built(ce_weight_shard, error, message):
    """As flce's own loss modules: at construction, naming the argument, not at the first
    collective call."""
    with pytest.raises(error, match=rf"^{message}"):
        VocabParallelFusedLinearCrossEntropyLoss(ce_weight_shard)


@pytest.mark.parametrize("head", ["cross_entropy", "logprobs", "distillation"])
def test_a_sharded_weight_given_to_a_single_device_head_is_refused_with_its_way_out(single_group, head):
    """The refusal names vocab_parallel_fused_linear_cross_entropy as the cross-entropy's
    way out, and says the other heads have none (it sent them to the cross-entropy's)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    x, target = torch.randn(4, 8), torch.randint(0, 13, (4,))
    weight = distribute_tensor(torch.randn(13, 8), mesh, [Shard(0)])
    calls = {
        "cross_entropy": lambda: flce.fused_linear_cross_entropy(x, weight, target),
        "logprobs": lambda: flce.fused_linear_logprobs(x, weight, target),
        "distillation": lambda: flce.fused_linear_distillation(x, weight, x, torch.randn(13, 8)),
    }
    with pytest.raises(TypeError, match="is a DTensor") as refused:
        calls[head]()
    assert "vocab_parallel_fused_linear_cross_entropy" in str(refused.value)
    assert "the logprobs and distillation heads have no vocab-parallel form" in str(refused.value)
