"""Host overhead per call of the public loss functions (``flce bench --kernel ce``).

At a shape this small (8 tokens, 1024 classes by default) the GPU work of a call takes
a few microseconds, so the wall time per call is what the host spends on it: argument
checks, dispatch, the launches, and flce's one device-to-host read per call. Each series
runs ``calls`` calls back to back after a warm-up, with a device synchronization only
at the ends of a batch, and reports the median (and min) over ``batches`` batches of
microseconds per call, next to eager PyTorch doing the same loss.

Series: ``flce.cross_entropy`` on given logits and ``flce.fused_linear_cross_entropy``,
each loss-only (``fwd``, under ``torch.no_grad``) and with ``loss.backward()``
(``fwd+bwd``), for each usable backend; eager PyTorch is ``F.cross_entropy`` on the
logits and the Hugging Face recipe (``F.linear``, fp32 upcast, ``F.cross_entropy``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flce.bench.cases import BenchCase, BenchLossSettings, Shape, make_inputs
from flce.bench.peers.torch_eager import eager_cross_entropy, eager_loss
from flce.bench.runner import skip_reason
from flce.bench.timing import synchronize

OVERHEAD_SHAPE = Shape(n=8, v=1024, h=64)
# Calls per batch: (GPU, CPU); a CPU call does the math itself and takes far longer.
DEFAULT_CALLS = (200, 20)
# Warm-up calls before the first batch (kernel compilation, allocator, caches).
WARMUP_CALLS = 20
BATCHES = 3
EAGER = "torch:eager"
APIS = ("cross_entropy", "fused_linear_cross_entropy")
PASSES = ("fwd", "fwd+bwd")


@dataclass(frozen=True)
class OverheadConfig:
    """What the host-overhead measurement runs."""

    dtype: torch.dtype
    device: torch.device
    backends: tuple[str, ...]
    calls: int = DEFAULT_CALLS[0]
    shape: Shape = OVERHEAD_SHAPE
    warmup: int = WARMUP_CALLS
    batches: int = BATCHES
    seed: int = 0


@dataclass(frozen=True)
class OverheadResult:
    """Microseconds per call of one series, or why it was skipped."""

    api: str
    passes: str
    method: str
    batches_us: tuple[float, ...] = ()
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.reason is None and bool(self.batches_us)


@dataclass
class _Tensors:
    x: torch.Tensor  # (N, H), requires grad
    w: torch.Tensor  # (V, H), requires grad
    logits: torch.Tensor  # (N, V) leaf, requires grad
    target: torch.Tensor  # (N,)

    def drop_grads(self) -> None:
        self.x.grad = self.w.grad = self.logits.grad = None


def _tensors(config: OverheadConfig) -> _Tensors:
    case = BenchCase(
        shape=config.shape, dtype=config.dtype, mode="full", loss=BenchLossSettings(), device=config.device
    )
    inputs = make_inputs(case, seed=config.seed)
    logits = (inputs.x.detach() @ inputs.w.detach().t()).requires_grad_(True)
    return _Tensors(inputs.x, inputs.w, logits, inputs.target)


def _loss_fn(api: str, method: str, t: _Tensors) -> Callable[[], torch.Tensor]:
    """The loss of one series as a zero-argument callable."""
    if method == EAGER:
        if api == "cross_entropy":
            return lambda: eager_cross_entropy(t.logits, t.target, None, BenchLossSettings())
        return lambda: eager_loss(t.x, t.w, t.target, None, BenchLossSettings())
    import flce

    backend = method.split(":", 1)[1]
    if api == "cross_entropy":
        return lambda: flce.cross_entropy(t.logits, t.target, backend=backend)
    return lambda: flce.fused_linear_cross_entropy(t.x, t.w, t.target, backend=backend)


def _call(api: str, passes: str, method: str, t: _Tensors) -> Callable[[], Any]:
    loss_fn = _loss_fn(api, method, t)
    if passes == "fwd":

        def forward() -> torch.Tensor:
            with torch.no_grad():
                return loss_fn()

        return forward

    def forward_backward() -> None:
        loss_fn().backward()
        t.drop_grads()  # as an optimizer's zero_grad(set_to_none=True) would

    return forward_backward


def time_per_call_us(call: Callable[[], Any], config: OverheadConfig) -> tuple[float, ...]:
    """Microseconds per call of each batch of ``config.calls`` calls, after a warm-up."""
    for _ in range(min(config.warmup, config.calls)):
        call()
    synchronize(config.device)
    batches = []
    for _ in range(config.batches):
        start = time.perf_counter()
        for _ in range(config.calls):
            call()
        synchronize(config.device)
        batches.append((time.perf_counter() - start) / config.calls * 1e6)
    return tuple(batches)


def measure_host_overhead(config: OverheadConfig) -> list[OverheadResult]:
    """Every series (API x pass x method); a method that fails is a skipped series."""
    if config.calls < 1 or config.batches < 1 or config.warmup < 0:
        raise ValueError("host overhead needs calls >= 1, batches >= 1 and warmup >= 0")
    from flce.dispatch import availability

    unusable = {}
    for backend in config.backends:
        ok, why = availability(backend, config.device)
        if not ok:
            unusable[f"flce:{backend}"] = f"backend {backend!r} unavailable: {why}"
    tensors = _tensors(config)
    methods = (*(f"flce:{b}" for b in config.backends), EAGER)
    results = []
    for api in APIS:
        for passes in PASSES:
            for method in methods:
                if method in unusable:
                    results.append(OverheadResult(api, passes, method, reason=unusable[method]))
                    continue
                try:
                    batches = time_per_call_us(_call(api, passes, method, tensors), config)
                except Exception as exc:  # noqa: BLE001 - a failing backend is a skip, not a crash
                    tensors.drop_grads()
                    results.append(OverheadResult(api, passes, method, reason=skip_reason(exc)))
                    continue
                results.append(OverheadResult(api, passes, method, batches))
    return results


def overhead_rows(results: Sequence[OverheadResult], config: OverheadConfig) -> list[dict[str, Any]]:
    """JSON-ready rows, with the ratio to eager PyTorch's time per call for the same series."""
    eager = {(r.api, r.passes): statistics.median(r.batches_us) for r in results if r.method == EAGER and r.ok}
    rows = []
    for r in results:
        median = statistics.median(r.batches_us) if r.ok else None
        baseline = eager.get((r.api, r.passes))
        rows.append(
            {
                "api": r.api,
                "pass": r.passes,
                "method": r.method,
                "status": "ok" if r.ok else "skipped",
                "reason": r.reason,
                "us_per_call": median,
                "min_us_per_call": min(r.batches_us) if r.ok else None,
                "batches_us": list(r.batches_us),
                "calls_per_batch": config.calls,
                "ratio_to_eager": None if median is None or not baseline else median / baseline,
            }
        )
    return rows


OVERHEAD_TABLE_HEADER = ("call", "pass", "method", "µs/call", "min µs/call", "× eager")


def overhead_cells(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """Cells of the measured rows, the call and pass written once per group."""
    from flce.bench.report import fmt, grouped_cells

    def cells(row: dict[str, Any]) -> list[str]:
        return [
            row["method"],
            fmt(row["us_per_call"], ".1f"),
            fmt(row["min_us_per_call"], ".1f"),
            fmt(row["ratio_to_eager"], ".2f"),
        ]

    return grouped_cells(rows, lambda row: [row["api"], row["pass"]], cells)


def overhead_notes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One line per method and skip reason, with the series it applies to."""
    from flce.bench.report import footnotes

    return footnotes(rows, lambda row: f"{row['api']} {row['pass']}", everywhere="every call")
