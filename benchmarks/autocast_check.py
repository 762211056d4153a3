"""Mixed precision as trainers run it: fp32 weights and hidden states under
``torch.autocast`` (bf16, or fp16 with a loss scaler's upstream gradient), fused fwd+bwd,
against eager PyTorch's ``F.linear`` + ``F.cross_entropy`` under the same autocast.

    python3 benchmarks/autocast_check.py [--shapes N,V,H;N,V,H] [--backends cutedsl,triton] [--rounds 5]
                                         [--dtype bf16|fp16] [--upstream 65536] [--prescale-ab]

Per shape: the scheme the memory budget chose (``flce.driver.schemes``), the loss's error
and the relative errors of dX and dW against float64 beside eager's, and the median fwd+bwd
time (CUDA events, each call after 100 ms of GEMMs, methods interleaved round by round), one
JSON line each. ``--upstream`` multiplies the loss before its backward, as a loss scaler does
(the gradients' errors are taken after dividing it back out). ``--prescale-ab`` adds, per
backend, the same call with an fp16 mean's forward gradient prescale turned off
(``flce.driver.scaling.forward_gradient_prescale`` returning 1, the code before it): the
prescale's cost and what it buys, measured in one interleaved run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from unittest import mock

import torch
import torch.nn.functional as F

import flce
import flce.plan
from flce.bench.timing import Heater, Workload, interleaved_times
from flce.driver import schemes
from flce.testing import relative_error

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def without_prescale():
    """The plan's fp16 forward gradient prescale forced to 1 for the calls inside."""
    return mock.patch.object(flce.plan, "forward_gradient_prescale", lambda *args, **kwargs: 1.0)


def run_shape(n: int, v: int, h: int, args: argparse.Namespace, heater: Heater, chosen: list) -> None:
    """One shape: the JSON line of each method (module docstring)."""
    dtype, upstream = DTYPES[args.dtype], args.upstream
    gen = torch.Generator(device=DEV).manual_seed(0)
    x = (torch.randn(n, h, generator=gen, device=DEV) / h**0.5).requires_grad_()  # (N, H) fp32
    w = torch.randn(v, h, generator=gen, device=DEV).requires_grad_()  # (V, H) fp32
    y = torch.randint(0, v, (n,), generator=gen, device=DEV)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    truth_loss = F.cross_entropy(x64 @ w64.t(), y)
    truth_loss.backward()
    truth = (truth_loss.item(), x64.grad, w64.grad)
    del x64, w64, truth_loss

    def eager():
        with torch.autocast(DEV.type, dtype=dtype):
            loss = F.cross_entropy(F.linear(x, w), y)
        (loss * upstream).backward()
        return loss

    methods = {"torch:eager": eager}
    for backend in args.backends.split(","):
        variants = {"": contextlib.nullcontext}
        if args.prescale_ab:
            variants[":unprescaled"] = without_prescale
        for suffix, context in variants.items():

            def fused(b=backend, context=context):
                with context(), torch.autocast(DEV.type, dtype=dtype):
                    loss = flce.fused_linear_cross_entropy(x, w, y, backend=b)
                    (loss * upstream).backward()
                return loss

            methods[f"flce:{backend}{suffix}"] = fused

    def clear():
        x.grad = w.grad = None

    workloads = {
        name: Workload(setup=lambda: None, run=lambda _, f=f: f().detach(), teardown=clear)
        for name, f in methods.items()
    }
    checks, scheme = {}, None
    for name, f in methods.items():
        chosen.clear()
        loss = f().item()
        # The chooser is cached per call shape: a call like the last one records nothing
        # (eager, first, records nothing either and keeps None).
        scheme = chosen[0] if chosen else scheme
        checks[name] = dict(
            scheme=scheme,
            loss_abs_error=abs(loss - truth[0]),
            dx_rel_error=relative_error(x.grad / upstream, truth[1]),
            dw_rel_error=relative_error(w.grad / upstream, truth[2]),
        )
        clear()
    times = interleaved_times(workloads, DEV, args.rounds, heater)
    eager_ms = statistics.median(times["torch:eager"])
    for name, ts in times.items():
        ms = statistics.median(ts)
        row = dict(n=n, v=v, h=h, dtype=args.dtype, upstream=upstream, method=name) | checks[name]
        print(json.dumps(row | dict(median_ms=round(ms, 3), ratio_to_eager=round(ms / eager_ms, 3))), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1024,128256,4096;8192,128256,4096")
    parser.add_argument("--backends", default="cutedsl,triton")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--upstream", type=float, default=1.0, help="the loss scaler's factor (default 1)")
    parser.add_argument("--prescale-ab", action="store_true", help="add each backend without the fp16 prescale")
    args = parser.parse_args()
    heater = Heater(DEV, 100.0 if DEV.type == "cuda" else 0.0)
    chosen = []
    original = schemes.scheme_for_call

    def record(call, options, device):
        scheme = original(call, options, device)
        chosen.append(scheme.describe(call.n_rows))
        return scheme

    schemes.scheme_for_call = record  # the plan reaches it through scheme_of_call
    for shape in args.shapes.split(";"):
        n, v, h = (int(s) for s in shape.split(","))
        run_shape(n, v, h, args, heater, chosen)
        if DEV.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
