"""Mixed precision as trainers run it: fp32 weights and hidden states under
``torch.autocast(dtype=torch.bfloat16)``, fused fwd+bwd, against eager PyTorch's
``F.linear`` + ``F.cross_entropy`` under the same autocast (the floor: the three bf16
GEMMs of the same shapes).

    python3 benchmarks/autocast_check.py [--shapes N,V,H;N,V,H] [--backends cutedsl,triton] [--rounds 5]

Per shape: the scheme the memory budget chose (``flce.driver.schemes``), the loss's error
against float64 beside eager's, and the median fwd+bwd time (CUDA events, each call after
100 ms of GEMMs, methods interleaved round by round), one JSON line each.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

import flce
from flce.bench.timing import Heater, Workload, interleaved_times
from flce.driver import schemes

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def run_shape(n: int, v: int, h: int, backends: list[str], rounds: int, heater: Heater, chosen: list) -> None:
    """One shape: the JSON line of each method (module docstring)."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    x = (torch.randn(n, h, generator=gen, device=DEV) / h**0.5).requires_grad_()  # (N, H) fp32
    w = torch.randn(v, h, generator=gen, device=DEV).requires_grad_()  # (V, H) fp32
    y = torch.randint(0, v, (n,), generator=gen, device=DEV)
    truth = F.cross_entropy(x.double() @ w.double().t(), y).item()

    def eager():
        with torch.autocast(DEV.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(F.linear(x, w), y)
        loss.backward()
        return loss

    methods = {"torch:eager": eager}
    for backend in backends:

        def fused(b=backend):
            with torch.autocast(DEV.type, dtype=torch.bfloat16):
                loss = flce.fused_linear_cross_entropy(x, w, y, backend=b)
            loss.backward()
            return loss

        methods[f"flce:{backend}"] = fused

    def clear():
        x.grad = w.grad = None

    workloads = {
        name: Workload(setup=lambda: None, run=lambda _, f=f: f().detach(), teardown=clear)
        for name, f in methods.items()
    }
    checks = {}
    for name, f in methods.items():
        chosen.clear()
        checks[name] = (abs(f().item() - truth), chosen[0] if chosen else None)
        clear()
    times = interleaved_times(workloads, DEV, rounds, heater)
    eager_ms = statistics.median(times["torch:eager"])
    for name, ts in times.items():
        error, scheme = checks[name]
        ms = statistics.median(ts)
        row = dict(n=n, v=v, h=h, method=name, scheme=scheme, loss_abs_error=error)
        print(json.dumps(row | dict(median_ms=round(ms, 3), ratio_to_eager=round(ms / eager_ms, 3))), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1024,128256,4096;8192,128256,4096")
    parser.add_argument("--backends", default="cutedsl,triton")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    heater = Heater(DEV, 100.0)
    chosen = []
    original = schemes.scheme_for_call

    def record(call, options, device):
        scheme = original(call, options, device)
        chosen.append(scheme.describe(call.n_rows))
        return scheme

    schemes.scheme_for_call = record  # the plan reaches it through scheme_of_call
    for shape in args.shapes.split(";"):
        n, v, h = (int(s) for s in shape.split(","))
        run_shape(n, v, h, args.backends.split(","), args.rounds, heater, chosen)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
