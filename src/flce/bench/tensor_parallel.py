"""Vocab-parallel FLCE on GPUs: parity with a single-GPU flce run and time/memory per rank.

    flce bench --tp 8 --out results/                          # launches the processes itself
    torchrun --nproc-per-node=8 -m flce.bench.tensor_parallel --out vp.json
    python -m flce.bench.tensor_parallel --out vp.json       # one process, group of size 1
    ... --tokens 8192 --hidden 4096 --vocab 128256 --dtype bf16 --single-backend torch

One process per GPU (NCCL, ``torch.cuda.set_device(LOCAL_RANK)``); the environment
is used as given (no NCCL variable is set or changed here). Default shape: N=8192,
H=4096, V=128256, bf16, the weight split over the ranks in contiguous row blocks (the
first ``V % world`` ranks one row more).

1. Timing: forward+backward of the vocab-parallel loss on every rank, CUDA events,
   warm-up, median of ``--iters``; peak memory above the call's starting point
   (``max_memory_allocated`` - ``memory_allocated`` before), which includes the
   returned gradients. The same for ``flce.fused_linear_cross_entropy`` with the full
   weight on rank 0's GPU (the other ranks wait).
2. Parity (rank 0, after the timing): loss, token accuracy, predicted tokens, dX and
   dW (shards gathered to rank 0) of the vocab-parallel run against the single-GPU
   run, and both against an fp32 single-GPU run (fp32 copies of the same bf16 data):
   the vocab-parallel error must be of the single-GPU bf16 run's size.

``--device cpu`` runs the same on CPU over gloo (small shapes; no memory numbers), which
is how the script itself is smoke-tested without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

import flce
from flce.bench.cases import DTYPES
from flce.parallel import vocab_parallel_fused_linear_cross_entropy


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON result path (written by rank 0)")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens N")
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size H")
    parser.add_argument("--vocab", type=int, default=128256, help="vocabulary V")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--ignore-fraction", type=float, default=0.05, help="share of targets set to ignore_index")
    parser.add_argument("--label-smoothing", type=float, default=0.0)
    parser.add_argument("--lse-square-scale", type=float, default=0.0)
    parser.add_argument("--softcap", type=float, default=None)
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--single-backend", default=None, help="flce backend of the single-GPU run (default: auto)")
    parser.add_argument(
        "--backend",
        default=None,
        help="local kernels of the vocab-parallel run (default: the auto choice of flce.dispatch)",
    )
    return parser.parse_args(argv)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(device_kind: str) -> tuple[int, int, torch.device]:
    """torchrun (RANK/WORLD_SIZE/LOCAL_RANK in the environment) or a 1-process group."""
    backend = "nccl" if device_kind == "cuda" else "gloo"
    timeout = datetime.timedelta(minutes=10)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        if device_kind == "cuda":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend, timeout=timeout)
    else:
        rank, world, local_rank = 0, 1, 0
        if device_kind == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1, timeout=timeout
        )
    device = torch.device("cuda", local_rank) if device_kind == "cuda" else torch.device("cpu")
    return rank, world, device


def shard_rows(vocab: int, world: int) -> list[tuple[int, int]]:
    base, extra = divmod(vocab, world)
    bounds, start = [], 0
    for r in range(world):
        size = base + (1 if r < extra else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


class Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def measure(self, fn, warmup: int, iters: int) -> dict:
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(iters):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "iters": iters}

    def peak_extra_bytes(self, fn, params):
        """Peak allocated memory above the starting point while ``fn`` runs (CUDA only),
        with the ``.grad`` of ``params`` dropped first: the gradients the call returns
        count, not those of an earlier call that the new ones would replace."""
        if not self.cuda:
            return None
        for param in params:
            param.grad = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        result = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        del result
        return peak


def loss_options(args) -> dict:
    return dict(
        label_smoothing=args.label_smoothing,
        lse_square_scale=args.lse_square_scale,
        softcap=args.softcap,
        chunk_size=args.chunk_size,
    )


def _errors(actual: torch.Tensor, expected: torch.Tensor) -> dict:
    a, e = actual.double(), expected.double()
    diff = a - e
    norm = e.norm().item()
    return {
        "max_abs": diff.abs().max().item() if diff.numel() else 0.0,
        "rel_fro": diff.norm().item() / norm if norm > 0 else diff.norm().item(),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    kind = args.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    rank, world, device = init_distributed(kind)
    dtype = DTYPES[args.dtype]
    n, hidden, vocab = args.tokens, args.hidden, args.vocab
    timer = Timer(device)
    opts = loss_options(args)

    # The same full problem on every rank (same seed, same device type).
    gen = torch.Generator(device=device).manual_seed(args.seed)
    x = torch.randn(n, hidden, generator=gen, device=device, dtype=torch.float32).to(dtype)
    full_weight = torch.randn(vocab, hidden, generator=gen, device=device, dtype=torch.float32)
    full_weight = full_weight.mul_(2.0 / hidden**0.5).to(dtype)
    target = torch.randint(0, vocab, (n,), generator=gen, device=device)
    ignored = torch.rand(n, generator=gen, device=device) < args.ignore_fraction
    target = torch.where(ignored, torch.full_like(target, -100), target)
    bounds = shard_rows(vocab, world)
    v0, v1 = bounds[rank]
    weight_shard = full_weight[v0:v1].clone().requires_grad_()
    if rank != 0:
        del full_weight  # only rank 0 runs the single-GPU comparison
        full_weight = None
    x = x.requires_grad_()

    def parallel_step(**extra):
        x.grad = None
        weight_shard.grad = None
        out = vocab_parallel_fused_linear_cross_entropy(x, weight_shard, target, backend=args.backend, **opts, **extra)
        loss = out if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
        return out

    parallel_time = timer.measure(parallel_step, args.warmup, args.iters)
    parallel_peak = timer.peak_extra_bytes(parallel_step, (x, weight_shard))
    per_rank = {
        "rank": rank,
        "vocab_range": [v0, v1],
        "fwd_bwd": parallel_time,
        "peak_extra_bytes": parallel_peak,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }

    # Parity run of the vocab-parallel loss (every rank takes part).
    parallel_out = parallel_step(return_token_accuracy=True, return_predicted_tokens=True)
    dx_parallel = x.grad.detach().clone()
    dw_local = weight_shard.grad.detach()
    width = max(b1 - b0 for b0, b1 in bounds)
    padded = torch.zeros(width, hidden, dtype=dw_local.dtype, device=device)
    padded[: v1 - v0] = dw_local
    gathered = [torch.empty_like(padded) for _ in range(world)] if rank == 0 else None
    dist.gather(padded, gathered, dst=0)
    per_rank_all = [None] * world
    dist.all_gather_object(per_rank_all, per_rank)

    result = None
    if rank == 0:
        dw_parallel = torch.cat([gathered[r][: b1 - b0] for r, (b0, b1) in enumerate(bounds)])
        del gathered, padded
        full = full_weight.clone().requires_grad_()
        x_single = x.detach().clone().requires_grad_()

        def single_step(**extra):
            x_single.grad = None
            full.grad = None
            out = flce.fused_linear_cross_entropy(x_single, full, target, backend=args.single_backend, **opts, **extra)
            loss = out if isinstance(out, torch.Tensor) else out.loss
            loss.backward()
            return out

        single_time = timer.measure(single_step, args.warmup, args.iters)
        single_peak = timer.peak_extra_bytes(single_step, (x_single, full))
        single_out = single_step(return_token_accuracy=True, return_predicted_tokens=True)
        dx_single, dw_single = x_single.grad.detach().clone(), full.grad.detach().clone()
        del full

        # fp32 run on fp32 copies of the same data: the yardstick of both bf16 runs.
        x32 = x.detach().float().requires_grad_()
        w32 = full_weight.float().requires_grad_()
        out32 = flce.fused_linear_cross_entropy(x32, w32, target, backend=args.single_backend, **opts)
        out32.backward()
        dx32, dw32 = x32.grad, w32.grad
        del w32

        loss_p, loss_s = parallel_out.loss.item(), single_out.loss.item()
        mismatched = (parallel_out.predicted_tokens != single_out.predicted_tokens).sum().item()
        parity = {
            "loss_parallel": loss_p,
            "loss_single": loss_s,
            "loss_fp32": out32.item(),
            "loss_abs_diff": abs(loss_p - loss_s),
            "token_accuracy_parallel": parallel_out.token_accuracy.item(),
            "token_accuracy_single": single_out.token_accuracy.item(),
            "predicted_mismatches": mismatched,
            "dx_vs_single": _errors(dx_parallel, dx_single),
            "dw_vs_single": _errors(dw_parallel, dw_single),
            "dx_parallel_vs_fp32": _errors(dx_parallel, dx32),
            "dx_single_vs_fp32": _errors(dx_single, dx32),
            "dw_parallel_vs_fp32": _errors(dw_parallel, dw32),
            "dw_single_vs_fp32": _errors(dw_single, dw32),
        }
        # Pass: the loss agrees to fp32 rounding of the statistics, and the vocab-parallel
        # gradients are as close to fp32 as the single-GPU run's (bf16 rounding of dX
        # partials and of their sum adds at most a few ulps).
        low_precision = dtype != torch.float32
        slack = 2.0 if low_precision else 10.0
        floor = 1e-3 if low_precision else 1e-6
        checks = {
            "loss": abs(loss_p - loss_s) <= 1e-4 * max(1.0, abs(loss_s)),
            "dx": parity["dx_parallel_vs_fp32"]["rel_fro"] <= slack * parity["dx_single_vs_fp32"]["rel_fro"] + floor,
            "dw": parity["dw_parallel_vs_fp32"]["rel_fro"] <= slack * parity["dw_single_vs_fp32"]["rel_fro"] + floor,
            "predicted": mismatched <= max(1, n // 1000),
        }
        parity["checks"] = checks
        parity["passed"] = all(checks.values())
        result = {
            "config": {
                "n": n,
                "hidden": hidden,
                "vocab": vocab,
                "dtype": args.dtype,
                "world_size": world,
                "warmup": args.warmup,
                "iters": args.iters,
                "ignore_fraction": args.ignore_fraction,
                **opts,
                "torch": torch.__version__,
                "backend": dist.get_backend(),
                "single_backend": args.single_backend or "auto",
                "parallel_backend": args.backend or "auto",
            },
            "per_rank": per_rank_all,
            "single_gpu": {"fwd_bwd": single_time, "peak_extra_bytes": single_peak},
            "speedup_vs_single": single_time["median_ms"] / max(p["fwd_bwd"]["median_ms"] for p in per_rank_all),
            "parity": parity,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(
            json.dumps(
                {
                    "parity": parity,
                    "speedup_vs_single": result["speedup_vs_single"],
                    "per_rank_ms": [p["fwd_bwd"]["median_ms"] for p in per_rank_all],
                    "single_ms": single_time["median_ms"],
                    "per_rank_peak": [p["peak_extra_bytes"] for p in per_rank_all],
                    "single_peak": single_peak,
                },
                indent=2,
            )
        )
    dist.barrier()
    dist.destroy_process_group()
    return 0 if rank != 0 or result["parity"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
