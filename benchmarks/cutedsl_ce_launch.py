"""Correctness and timing of the cutedsl chunk CE kernel per launch shape, on a GPU (sm_90+):
the measurements behind its launch heuristics (``flce.backends.cutedsl.ce``).

    python benchmarks/cutedsl_ce_launch.py [--sweep] [--json OUT.json] [--no-checks] [--bf16-only]

1. Compiles the kernel for a few shapes and features and prints its max errors next
   to the torch backend's, both against float64.
2. Times it at N=8192, V=128256 (bf16 and fp32) with CUDA events (warm-up, median of
   >= 20 runs, logits restored and L2 flushed before each run), next to the torch
   backend and, when installed, Liger's Triton CE (same in-place loss+grad work).

GB/s counts the bytes the kernel must move: the logits read once and the gradient
written once (2 * N * V * itemsize with the gradient, N * V * itemsize without). With
the default launch shapes this is also what it does move (each row slice stays in
shared memory between the passes); launch shapes that keep only part of a row
resident re-read the rest. "% of copy" compares with a measured device-to-device copy
(read + write bytes). ``--sweep`` also times other launch shapes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from flce.backends.base import ChunkScalars  # noqa: E402
from flce.backends.cutedsl import availability  # noqa: E402
from flce.backends.torch.ce import cross_entropy_chunk as torch_chunk  # noqa: E402
from flce.reference import cross_entropy_reference  # noqa: E402

DEV = torch.device("cuda")
# The timed shape: the reference shape's logits (N tokens x V classes).
TIMED_N, TIMED_V = 8192, 128256


def scalars_for(target, vocab, ignore_index=-100, weight=None, **kw) -> ChunkScalars:
    valid = target != ignore_index
    n = int(valid.sum())
    wsum = float(weight[target[valid]].sum()) if weight is not None else float(n)
    d = dict(
        ignore_index=ignore_index,
        label_smoothing=0.0,
        lse_square_scale=0.0,
        softcap=None,
        use_token_scaling=False,
        ce_grad_scale=1.0 / max(wsum, 1e-30),
        z_grad_scale=1.0 / max(n, 1),
        weight_sum=float(weight.sum()) if weight is not None else float(vocab),
    )
    d.update(kw)
    return ChunkScalars.from_numbers(**d, device=target.device)


def run_chunk(fn, logits, target, weight, sc, zl=True, acc=True, grad=True, **kw):
    m = logits.shape[0]
    out = dict(
        loss=torch.full((m,), math.nan, device=DEV),
        z_loss=torch.full((m,), math.nan, device=DEV) if zl else None,
        correct=torch.full((m,), math.nan, device=DEV) if acc else None,
        predicted=torch.full((m,), -7, dtype=torch.int64, device=DEV) if acc else None,
    )
    fn(
        logits,
        target,
        weight,
        sc,
        loss_out=out["loss"],
        z_loss_out=out["z_loss"],
        correct_out=out["correct"],
        predicted_out=out["predicted"],
        row_grad_scale=None,
        compute_grad=grad,
        **kw,
    )
    out["grad"] = logits
    return out


def correctness(ce) -> bool:
    print("== correctness (max abs error vs float64; cutedsl | torch backend) ==")
    ok = True
    cases = [
        (torch.bfloat16, 64, 32000, {}),
        (torch.bfloat16, 8, 128256, dict(label_smoothing=0.1, lse_square_scale=1e-3, softcap=30.0)),
        (torch.float32, 8, 128256, {}),
        (torch.float16, 48, 151936, dict(use_token_scaling=True)),
        (torch.bfloat16, 64, 123, dict(label_smoothing=0.2, softcap=5.0)),
        (torch.float32, 64, 7, dict(lse_square_scale=1e-3)),
        (torch.bfloat16, 32, 32000, dict(label_smoothing=0.1, weighted=True)),
    ]
    for dtype, m, vocab, kw in cases:
        kw = dict(kw)
        weighted = kw.pop("weighted", False)
        gen = torch.Generator(device=DEV).manual_seed(vocab + m)
        z = (torch.randn(m, vocab, device=DEV, generator=gen) * 3).to(dtype)
        z[torch.arange(m, device=DEV), torch.randint(0, vocab, (m,), device=DEV, generator=gen)] += 8
        target = torch.randint(0, vocab, (m,), device=DEV, generator=gen)
        target[::5] = -100
        weight = (torch.rand(vocab, device=DEV, generator=gen) + 0.5) if weighted else None
        sc = scalars_for(target, vocab, weight=weight, **kw)
        ours = run_chunk(ce.cross_entropy_chunk, z.clone(), target, weight, sc)
        twin = run_chunk(torch_chunk, z.clone(), target, weight, sc)
        zz = z.double().requires_grad_(True)
        ref = cross_entropy_reference(
            zz,
            target,
            ce_weight=weight,
            ignore_index=-100,
            reduction="none",
            lse_square_scale=sc.lse_square_scale,
            label_smoothing=sc.label_smoothing,
            softcap=sc.softcap,
            use_token_scaling=sc.use_token_scaling,
        )
        ce_ref = ref.loss - ref.z_loss
        total = (sc.ce_grad_scale * ce_ref + sc.z_grad_scale * ref.z_loss).sum()
        (g_ref,) = torch.autograd.grad(total, zz)
        torch.cuda.synchronize()

        def err(a, b):
            return (a.double() - b.double()).abs().max().item()

        e = {
            "loss": (err(ours["loss"], ce_ref), err(twin["loss"], ce_ref)),
            "z_loss": (err(ours["z_loss"], ref.z_loss), err(twin["z_loss"], ref.z_loss)),
            "grad": (err(ours["grad"], g_ref), err(twin["grad"], g_ref)),
        }
        pred_ok = torch.equal(ours["predicted"], ref.predicted_tokens)
        corr_ok = torch.equal(ours["correct"].double(), ref.token_accuracy)
        good = pred_ok and corr_ok and all(a <= 3 * b + 1e-6 * (1 + b) for a, b in e.values())
        good = good and all(torch.isfinite(ours[k]).all().item() for k in ("loss", "z_loss", "grad"))
        ok &= good
        print(f"{'ok ' if good else 'BAD'} {str(dtype):15s} M={m:3d} V={vocab:6d} {kw or ''}")
        print(
            "      "
            + "  ".join(f"{k} {a:.2e} | {b:.2e}" for k, (a, b) in e.items())
            + f"  predicted {'==' if pred_ok else '!='} ref, correct {'==' if corr_ok else '!='} ref"
        )
    return ok


def time_ms(fn, src, buf, iters=20, warmup=3, flush=None):
    """Median ms of ``fn`` over ``iters`` runs; ``buf`` is restored from ``src`` and the
    L2 flushed before every run (neither is timed)."""
    times = []
    for i in range(warmup + iters):
        buf.copy_(src)
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth() -> float:
    n = 1 << 30  # 2 GiB of bf16 each way
    a = torch.empty(n, dtype=torch.bfloat16, device=DEV).normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    ts = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    ms = statistics.median(ts)
    del a, b
    return 2 * n * 2 / ms / 1e6


def timing(ce, sweep: bool, results: dict, dtypes=(torch.bfloat16, torch.float32)) -> None:
    copy_gbs = copy_bandwidth()
    results["copy_GBps"] = copy_gbs
    print(f"\n== timing (N={TIMED_N}, V={TIMED_V}); device copy bandwidth {copy_gbs:.0f} GB/s (read+write) ==")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    try:
        from liger_kernel.ops.cross_entropy import cross_entropy_forward as liger_forward
    except Exception as exc:  # optional comparison
        liger_forward = None
        print(f"(Liger CE not importable: {exc})")
    for dtype in dtypes:
        time_dtype(ce, dtype, sweep, results, copy_gbs, flush, liger_forward)
        torch.cuda.empty_cache()  # the dtype's tensors are gone: free them before the next


def time_dtype(ce, dtype, sweep: bool, results: dict, copy_gbs: float, flush, liger_forward) -> None:
    """Times of the cutedsl kernel (default launch shape, features, loss only, and with
    ``sweep`` other launch shapes), Liger's Triton CE and the torch backend, in ``dtype``."""
    n, vocab = TIMED_N, TIMED_V
    es = torch.finfo(dtype).bits // 8
    gen = torch.Generator(device=DEV).manual_seed(0)
    src = (torch.randn(n, vocab, device=DEV, generator=gen) * 3).to(dtype)
    buf = torch.empty_like(src)
    target = torch.randint(0, vocab, (n,), device=DEV, generator=gen)
    target[::10] = -100
    loss = torch.empty(n, device=DEV)
    sc = scalars_for(target, vocab)
    weight = torch.rand(vocab, device=DEV, generator=gen) + 0.5
    sc_feat = scalars_for(target, vocab, weight=weight, label_smoothing=0.1, lse_square_scale=1e-4)
    sc_cap = scalars_for(target, vocab, weight=weight, label_smoothing=0.1, lse_square_scale=1e-4, softcap=30.0)
    zl, correct = torch.empty(n, device=DEV), torch.empty(n, device=DEV)
    predicted = torch.empty(n, dtype=torch.int64, device=DEV)

    def ours(grad=True, s=sc, config=None, features=False):
        extra = dict(ce_weight=weight, z_loss_out=zl, correct_out=correct, predicted_out=predicted) if features else {}
        kw = dict(dict(ce_weight=None, z_loss_out=None, correct_out=None, predicted_out=None), **extra)
        return lambda: ce.cross_entropy_chunk(
            buf,
            target,
            kw["ce_weight"],
            s,
            loss_out=loss,
            z_loss_out=kw["z_loss_out"],
            correct_out=kw["correct_out"],
            predicted_out=kw["predicted_out"],
            row_grad_scale=None,
            compute_grad=grad,
            config=config,
        )

    rows = []

    def report(name, ms, nbytes):
        gbs = nbytes / ms / 1e6
        rows.append((name, ms, gbs))
        results[f"{dtype}/{name}"] = {"ms": ms, "GBps": gbs, "pct_copy": 100 * gbs / copy_gbs}
        print(
            f"  {str(dtype):15s} {name:42s} {ms:8.3f} ms  {gbs:7.0f} GB/s  {100 * gbs / copy_gbs:5.1f}% of copy",
            flush=True,
        )

    rw = 2 * n * vocab * es
    print(f"  default config: {ce.default_config(ce.KernelKey(dtype, vocab, 16 // es, True, *[False] * 9, True))}")
    report("cutedsl loss+grad", time_ms(ours(), src, buf, flush=flush), rw)
    report("cutedsl +weights+ls+zloss+argmax", time_ms(ours(s=sc_feat, features=True), src, buf, flush=flush), rw)
    report(
        "cutedsl +weights+ls+zloss+argmax+softcap",
        time_ms(ours(s=sc_cap, features=True), src, buf, flush=flush),
        rw,
    )
    report("cutedsl loss only (no grad)", time_ms(ours(grad=False), src, buf, flush=flush), rw // 2)
    lbuf = None
    if liger_forward is not None:
        lbuf = buf.detach().requires_grad_(True)  # Liger writes the gradient only when this is set

        def liger():
            liger_forward(lbuf, target, None, -100, 0.0, 0.0, "mean", None, False)

        report("liger triton CE loss+grad", time_ms(liger, src, buf, flush=flush), rw)

    def twin():
        torch_chunk(
            buf,
            target,
            None,
            sc,
            loss_out=loss,
            z_loss_out=None,
            correct_out=None,
            predicted_out=None,
            row_grad_scale=None,
            compute_grad=True,
        )

    report("torch backend loss+grad", time_ms(twin, src, buf, iters=5, warmup=1, flush=flush), rw)
    if sweep:
        # One CTA per row with 76 KiB resident; clusters of 2/4/8 CTAs with the slice
        # partly (2) or wholly (4, 8) resident; prefetch distance; 128/512 threads.
        key_cfgs = [
            (256, 8, 19, 1),
            (256, 8, 32, 2),
            (256, 8, 16, 4),
            (256, 16, 16, 4),
            (256, 4, 16, 4),
            (128, 8, 32, 4),
            (512, 8, 8, 4),
            (256, 8, 8, 8),
            (256, 16, 8, 8),
            (256, 8, 16, 8),
            (256, 16, 16, 8),
            (128, 16, 32, 8),
            (512, 8, 8, 8),
        ]
        for t, s_, r, c in key_cfgs:
            cfg = ce.KernelConfig(threads=t, stages=s_, resident=r, cluster=c)
            try:
                report(
                    f"  sweep threads={t} stages={s_} resident={r} cluster={c}",
                    time_ms(ours(config=cfg), src, buf, flush=flush),
                    rw,
                )
            except Exception as exc:
                print(f"  sweep {cfg}: failed {type(exc).__name__}: {str(exc)[:200]}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="also time other launch configurations")
    parser.add_argument("--json", default=None, help="write the timings here")
    parser.add_argument("--no-checks", action="store_true", help="time only (skip the correctness step)")
    parser.add_argument("--bf16-only", action="store_true", help="time bf16 logits only")
    args = parser.parse_args()
    ok, why = availability(DEV)
    if not ok:
        print(f"cutedsl backend unavailable: {why}")
        return 2
    from importlib import metadata

    from flce.backends.cutedsl import ce

    dsl = metadata.version("nvidia-cutlass-dsl")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | nvidia-cutlass-dsl {dsl}")
    good = True if args.no_checks else correctness(ce)
    results = {"correct": None if args.no_checks else good}
    dtypes = (torch.bfloat16,) if args.bf16_only else (torch.bfloat16, torch.float32)
    timing(ce, args.sweep, results, dtypes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print("\ncorrectness:", "not checked" if args.no_checks else "PASS" if good else "FAIL")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
