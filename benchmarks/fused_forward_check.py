"""Correctness and timing of the fused forward Hopper kernel on an H200 (sm_90).

    python3 benchmarks/fused_forward_check.py [--configs NAME,NAME] [--vocab 128256,32000] [--no-checks]

1. A few correctness checks against float64 (bf16/fp16, V = 32000 / 128256 / 151936,
   N = 1000, bias, softcap, logit sum, cluster shapes), one ``PASS``/``FAIL`` line each:
   ``err(ours) <= 3 * err(torch logits in the input dtype) + 1e-4`` for lse, target
   logit and logit sum (relative to its scale); predicted must be a maximum of the
   float64 logits.
2. Timing with CUDA events of the fused forward against ``torch.mm(x, w.t())`` into a
   preallocated bf16 (N, V) output, at N=8192, H=4096, V in {128256, 32000}, bf16, for a
   few launch shapes: interleaved round by round, each call after ``--heat-ms`` of GEMMs
   (the power state of a training step), median of ``--rounds``; one JSON line each with
   ms, TFLOP/s (2 N V H / t), the ratio to the torch GEMM and the peak extra memory
   (``torch.cuda.max_memory_allocated`` above what the inputs hold).

Every step runs in its own try/except, so one failure does not hide the rest.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from flce.backends.cutedsl import fused_forward as ff  # noqa: E402
from flce.bench.timing import Heater, Workload, interleaved_times  # noqa: E402

DEV = torch.device("cuda")
IGNORE = -100
CONFIGS = {
    "128x256": ff.FusedForwardConfig(),
    "128x256_cluster2x1": ff.FusedForwardConfig(cluster_m=2),
    # One cluster per tile, as the kernel ran before it became persistent.
    "128x256_cluster2x1_oneshot": ff.FusedForwardConfig(cluster_m=2, persistent=False),
    "128x256_oneshot": ff.FusedForwardConfig(persistent=False),
    # Ping-pong: two MMA warpgroups on alternate 64-row tiles, one's epilogue under the
    # other's main loop; W multicast to 4 (or 2) CTAs keeps its L2 reads per flop as low.
    "64x256_pingpong_cluster4x1": ff.FusedForwardConfig(tile_m=64, cluster_m=4, pingpong=True),
    "64x256_pingpong_cluster2x1": ff.FusedForwardConfig(tile_m=64, cluster_m=2, pingpong=True),
    "128x128": ff.FusedForwardConfig(tile_n=128),
    "128x256_cluster1x2": ff.FusedForwardConfig(cluster_n=2),
    # Few stages, so that two CTAs fit on an SM (2 x 96 KiB / 2 x 80 KiB of shared
    # memory): one CTA's epilogue may then overlap the other's main loop.
    "128x128_s3_cluster2x1": ff.FusedForwardConfig(tile_n=128, stages=3, cluster_m=2),
    "128x192_s2_cluster2x1": ff.FusedForwardConfig(tile_n=192, stages=2, cluster_m=2),
}


def make_problem(n, vocab, hidden, dtype, seed, bias=False):
    """Logits of O(3) with one +8 peak per row; some ignored targets, a third at the peak."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    w = torch.randn(vocab, hidden, generator=gen, device=DEV)
    x = torch.randn(n, hidden, generator=gen, device=DEV) * (3.0 / math.sqrt(hidden))
    peak = torch.randint(0, vocab, (n,), generator=gen, device=DEV)
    wp = w[peak]
    x += 8.0 * wp / (wp * wp).sum(1, keepdim=True)
    y = torch.randint(0, vocab, (n,), generator=gen, device=DEV)
    y[::3] = peak[::3]
    y[torch.rand(n, generator=gen, device=DEV) < 0.1] = IGNORE
    b = (torch.randn(vocab, generator=gen, device=DEV) * 0.5).to(dtype) if bias else None
    return x.to(dtype), w.to(dtype), y, b


def row_stats(x, w, y, b, softcap, dtype):
    if dtype == torch.float64:
        z = x.double() @ w.double().t()
        if b is not None:
            z = z + b.double()
    else:
        z = F.linear(x, w, b).float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    vocab = w.shape[0]
    valid = (y >= 0) & (y < vocab)
    zt = torch.where(valid, z.gather(1, y.clamp(0, vocab - 1)[:, None])[:, 0], torch.zeros_like(z[:, 0]))
    return dict(lse=torch.logsumexp(z, 1), target_logit=zt, logit_sum=z.sum(1), z=z)


def check(name, n, vocab, hidden, dtype, bias=False, softcap=None, config=None, seed=0):
    x, w, y, b = make_problem(n, vocab, hidden, dtype, seed, bias)
    out = ff.fused_forward_statistics(x, w, y, bias=b, softcap=softcap, with_logit_sum=True, config=config)
    torch.cuda.synchronize()
    ref = row_stats(x, w, y, b, softcap, torch.float64)
    base = row_stats(x, w, y, b, softcap, dtype)
    msgs = []
    ok = True
    for key in ("lse", "target_logit", "logit_sum"):
        ours = (out[key].double() - ref[key]).abs().max().item()
        theirs = (base[key].double() - ref[key]).abs().max().item()
        scale = 1.0 if key != "logit_sum" else ref[key].abs().max().item() + 1.0
        good = ours <= 3 * theirs + 1e-4 * scale
        ok &= good
        msgs.append(f"{key} {ours:.2e} (torch {theirs:.2e})")
    z = ref["z"]
    pred = out["predicted"]
    zmax = z.max(1).values
    in_range = bool(((pred >= 0) & (pred < vocab)).all())
    at_max = in_range and bool(
        (z.gather(1, pred.clamp(0, vocab - 1)[:, None])[:, 0] >= zmax - 1e-3 * (1 + zmax.abs())).all()
    )
    exact = (pred == z.argmax(1)).double().mean().item()
    ok &= at_max and exact >= 0.99
    msgs.append(f"predicted exact {exact:.4f} at_max {at_max}")
    print(f"{'PASS' if ok else 'FAIL'} {name}: " + ", ".join(msgs), flush=True)
    return ok


def bench(n, hidden, vocab, configs, rounds, heat_ms, sums=(False, True)):
    """Every launch shape and ``torch.mm`` of the same logits, interleaved round by round
    (the order rotates each round), each timed call after ``heat_ms`` of bf16 GEMMs so
    that all start in the power state of a training step (``flce.bench.timing.Heater``);
    the median of ``rounds`` calls each."""
    dtype = torch.bfloat16
    x, w, y, _ = make_problem(n, vocab, hidden, dtype, seed=1)
    flop = 2.0 * n * vocab * hidden
    logits = torch.empty(n, vocab, dtype=dtype, device=DEV)
    methods = {("torch.mm", None): Workload(setup=lambda: None, run=lambda _: torch.mm(x, w.t(), out=logits))}
    extra_mib = {}
    for cname, cfg in configs.items():
        for with_sum in sums:
            try:
                ff.fused_forward_statistics(x, w, y, config=cfg, with_logit_sum=with_sum)  # compile
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                ff.fused_forward_statistics(x, w, y, config=cfg, with_logit_sum=with_sum)
                torch.cuda.synchronize()
                extra_mib[cname, with_sum] = (torch.cuda.max_memory_allocated() - base) / 2**20
                methods[cname, with_sum] = Workload(
                    setup=lambda: None,
                    run=lambda _, c=cfg, s=with_sum: ff.fused_forward_statistics(x, w, y, config=c, with_logit_sum=s),
                )
            except Exception:
                print(f"FAIL bench {cname} N={n} V={vocab} sum={with_sum}", flush=True)
                traceback.print_exc()
    times = interleaved_times(methods, DEV, rounds, Heater(DEV, heat_ms))
    t_mm = statistics.median(times["torch.mm", None])
    for (cname, with_sum), ts in times.items():
        t = statistics.median(ts)
        row = {"op": cname if with_sum is None else "fused_forward", "N": n, "H": hidden, "V": vocab}
        if with_sum is not None:
            cfg = configs[cname]
            row |= {
                "config": cname,
                "config_fields": cfg.__dict__,
                "with_logit_sum": with_sum,
                "ratio_to_torch_mm": round(t / t_mm, 4),
                "peak_extra_mib": round(extra_mib[cname, with_sum], 2),
                "launches": math.ceil(n / ff.rows_per_launch(n, vocab, with_sum, cfg, ff.DEFAULT_WORKSPACE_BYTES)),
            }
        row |= {"ms": round(t, 4), "min_ms": round(min(ts), 4), "max_ms": round(max(ts), 4)}
        row |= {"tflops": round(flop / t / 1e9, 1), "rounds": rounds, "heat_ms": heat_ms}
        print(json.dumps(row), flush=True)


def main():
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"launch shapes to time, of {list(CONFIGS)}")
    parser.add_argument("--vocab", default="128256,32000", help="vocabularies of the timing step")
    parser.add_argument("--no-checks", action="store_true", help="timing only")
    parser.add_argument("--no-logit-sum", action="store_true", help="time only the kernels without the logit sum")
    parser.add_argument("--rounds", type=int, default=10, help="timed calls per method (interleaved)")
    parser.add_argument("--heat-ms", type=float, default=100.0, help="bf16 GEMM work before each timed call")
    args = parser.parse_args()
    for name in args.configs.split(","):
        if name not in CONFIGS:
            parser.error(f"--configs: unknown launch shape {name!r}; expected some of {list(CONFIGS)}")
    timed = {name: CONFIGS[name] for name in args.configs.split(",")}
    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    if not args.no_checks:
        run_checks()
    for vocab in (int(v) for v in args.vocab.split(",")):
        try:
            bench(8192, 4096, vocab, timed, args.rounds, args.heat_ms, (False,) if args.no_logit_sum else (False, True))
        except Exception:
            print(f"FAIL bench V={vocab}: exception", flush=True)
            traceback.print_exc()


def run_checks():
    checks = [
        ("bf16 V=32000 plain", dict(n=1000, vocab=32000, hidden=4096, dtype=torch.bfloat16)),
        (
            "fp16 V=32000 bias+softcap",
            dict(n=1000, vocab=32000, hidden=2048, dtype=torch.float16, bias=True, softcap=15.0),
        ),
        ("bf16 V=151936 H=5120 bias", dict(n=1000, vocab=151936, hidden=5120, dtype=torch.bfloat16, bias=True)),
        ("bf16 V=128256 N=257 softcap", dict(n=257, vocab=128256, hidden=4096, dtype=torch.bfloat16, softcap=30.0)),
    ]
    for cname, cfg in CONFIGS.items():
        checks.append(
            (
                f"bf16 V=32000 config {cname}",
                dict(n=1000, vocab=32000, hidden=2048, dtype=torch.bfloat16, bias=True, softcap=30.0, config=cfg),
            )
        )
    results = []
    for name, kw in checks:
        try:
            results.append(check(name, **kw))
        except Exception:
            results.append(False)
            print(f"FAIL {name}: exception", flush=True)
            traceback.print_exc()
    print(f"correctness: {sum(results)}/{len(results)} passed", flush=True)


if __name__ == "__main__":
    main()
