"""``flce bench --kernel ce``: the cross-entropy kernel alone, on logits that already exist.

Every method computes the loss and the gradient of an ``(N, V)`` logits tensor:

- ``flce:<backend>:kernel``: the backend's chunk CE kernel called directly
  (``BackendSpec.cross_entropy_chunk``, gradient written over the logits), with the
  per-call scalars computed once outside the timing: what the fused loss runs per chunk;
- ``flce:<backend>``: the public ``flce.cross_entropy`` forward + backward (validation,
  the one host sync, a copy of the logits for the gradient, the backward's scaling);
- ``liger:triton:kernel`` / ``liger:cute:kernel``: Liger-Kernel's in-place loss-and-grad
  primitives (Triton; CuTe DSL), the kernels its fused loss runs per chunk;
- ``liger:triton`` / ``liger:cute``: Liger's cross-entropy autograd functions, fwd + bwd;
- ``torch:eager``: ``F.cross_entropy`` on the logits in their dtype, fwd + bwd;
- ``copy``: ``dst.copy_(src)`` of the logits, the HBM bandwidth yardstick.

Effective bandwidth counts the least traffic the work needs, one read of the logits and
one write of the gradient (``2 * N * V * itemsize`` bytes), for every method, the copy
included (it reads and writes as many bytes): "% of copy" is then the copy's time over
the method's. Methods that move more (an fp32 workspace, a copy of the logits) show it
as a lower percentage, which is the point of comparing them this way.

Before every call, timed or not, the working logits are restored from a pristine copy
(several methods overwrite them with the gradient) and, on a GPU, a scratch buffer
twice the L2 size is written so that no method finds the logits in L2; both happen in
the untimed ``Workload.setup``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from flce.bench.cases import BenchCase, BenchLossSettings, Shape, dtype_name, make_inputs
from flce.bench.methods import always, as_loss
from flce.bench.peers.flce_backends import flce_loss_kwargs
from flce.bench.peers.liger import LIGER_FUNCTIONAL
from flce.bench.peers.optional import first_reason, needs_cuda, optional_import, unsupported_features
from flce.bench.peers.torch_eager import eager_cross_entropy
from flce.bench.runner import Running, SweepSettings, measure_runs, skip_reason, unusable_methods
from flce.bench.timing import TimingStats, Workload, free_memory

SCHEMA = "flce-bench-kernel/1"
COPY = "copy"
# Hidden size of the projection that makes the benchmark's logits: small, since only the
# logits' distribution matters here (peaked at the target on most rows, as in training).
LOGITS_HIDDEN = 64
# L2 scrub size, in multiples of the device's L2 cache.
L2_SCRUB_FACTOR = 2
FALLBACK_L2_BYTES = 64 * 2**20

LIGER_TRITON_CE = "liger_kernel.ops.backends._triton.cross_entropy"
LIGER_CUTE_CE = "liger_kernel.ops.backends._cutedsl.cross_entropy"
# Liger's CuTe CE loads 16 bytes per thread; other vocabularies fall back to its Triton kernel.
LIGER_CUTE_VECTOR_BYTES = 16
LIGER_CUTE_MIN_CAPABILITY = (9, 0)
# Liger's CE kernels and autograd take no token scaling (its FLCE applies it around the
# kernel); they return token accuracy and predicted tokens on request.
LIGER_CE_FEATURES = ("label_smoothing", "z_loss", "softcap", "weights", "accuracy", "predicted")


@dataclass(frozen=True)
class KernelCase:
    """One logits tensor to take the cross-entropy of: N rows of V classes in ``dtype``."""

    n: int
    v: int
    dtype: torch.dtype
    loss: BenchLossSettings
    device: torch.device

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def traffic_bytes(self) -> int:
        """The least bytes the work moves: the logits read once, the gradient written once."""
        return 2 * self.n * self.v * self.itemsize

    def label(self) -> str:
        return f"N={self.n} V={self.v} {dtype_name(self.dtype)}"


@dataclass
class LogitsInputs:
    """Tensors shared by all methods of one case (allocated once, before any timing)."""

    pristine: torch.Tensor  # (N, V), never written
    logits: torch.Tensor  # (N, V) leaf that requires grad; restored before every call
    target: torch.Tensor  # (N,) int64
    ce_weight: torch.Tensor | None  # (V,) fp32
    l2_scrub: torch.Tensor | None  # bytes written before every call on a GPU

    def restore(self) -> None:
        """Untimed set-up of every call: pristine logits, gradient dropped, L2 cold."""
        self.logits.grad = None
        with torch.no_grad():
            self.logits.copy_(self.pristine)
        if self.l2_scrub is not None:
            self.l2_scrub.zero_()

    def drop_grad(self) -> None:
        self.logits.grad = None


def _l2_scrub(device: torch.device) -> torch.Tensor | None:
    if device.type != "cuda":
        return None
    l2_bytes = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or FALLBACK_L2_BYTES
    return torch.empty(L2_SCRUB_FACTOR * l2_bytes, dtype=torch.uint8, device=device)


def make_logits_inputs(case: KernelCase, seed: int = 0, ignore_fraction: float = 0.0) -> LogitsInputs:
    """Logits ``X Wᵀ`` of the fused benchmark's inputs (``cases.make_inputs``), so both
    benchmarks see the same kind of rows, from flat to confidently right."""
    loss_case = BenchCase(
        shape=Shape(case.n, case.v, LOGITS_HIDDEN),
        dtype=torch.float32,
        mode="fwd",
        loss=case.loss,
        device=case.device,
    )
    fused = make_inputs(loss_case, seed=seed, ignore_fraction=ignore_fraction)
    pristine = (fused.x @ fused.w.t()).to(case.dtype)
    logits = torch.empty_like(pristine).requires_grad_(True)
    inputs = LogitsInputs(pristine, logits, fused.target, fused.ce_weight, _l2_scrub(case.device))
    inputs.restore()
    return inputs


@dataclass(frozen=True)
class Step:
    """The timed work of a method. ``latest_loss`` reads the reduced loss of the latest
    call where ``run`` itself returns per-row values (the raw kernels): it runs after the
    measurement, untimed, so that every method's loss can be compared with the others'."""

    run: Callable[[], Any]
    latest_loss: Callable[[], torch.Tensor] | None = None


KernelCheckFn = Callable[[KernelCase], "str | None"]
MakeStepFn = Callable[[KernelCase, LogitsInputs], Step]


@dataclass(frozen=True)
class KernelMethod:
    """One competitor of the CE-kernel benchmark. ``make`` returns the timed step (the
    restore of the logits is the workload's untimed set-up). Shaped like ``Method`` for
    ``methods.select_methods`` (name, base name, family, ``is_floor``: the copy), so
    ``--methods flce:triton`` selects the public call and its raw kernel together."""

    name: str
    label: str
    family: str
    check: KernelCheckFn
    make: MakeStepFn
    is_floor: bool = False

    @property
    def base_name(self) -> str:
        """The name without the ``:kernel`` suffix of a raw-kernel method."""
        return self.name.removesuffix(":kernel")


def workload(step: Step, inputs: LogitsInputs) -> Workload:
    """``step`` timed on freshly restored logits (``LogitsInputs.restore``, untimed)."""
    return Workload(setup=inputs.restore, run=lambda _: step.run(), teardown=inputs.drop_grad)


# ----------------------------------------------------------------------------- flce


def flce_options(settings: BenchLossSettings) -> Any:
    """The library's ``flce.options.LossOptions`` for the benchmark's loss settings."""
    from flce.options import LossOptions

    return LossOptions(**flce_loss_kwargs(settings, None))


def _flce_available(backend: str) -> KernelCheckFn:
    def check(case: KernelCase) -> str | None:
        from flce.dispatch import availability

        ok, why = availability(backend, case.device)
        return None if ok else f"backend {backend!r} unavailable: {why}"

    return check


def _flce_kernel_make(backend: str) -> MakeStepFn:
    def make(case: KernelCase, inputs: LogitsInputs) -> Step:
        from flce.dispatch import get_backend
        from flce.driver.chunks import allocate_rows
        from flce.driver.sizing import default_chunk_size
        from flce.driver.statistics import batch_statistics, chunk_scalars
        from flce.rows.cross_entropy import reduce_rows

        spec = get_backend(backend)
        options = flce_options(case.loss)
        stats = batch_statistics(inputs.target, inputs.ce_weight, case.v, options.ignore_index)
        scalars = chunk_scalars(options, stats)
        rows = allocate_rows(case.n, options, case.device)
        # In-place kernels take all rows in one launch; a kernel with a workspace per logit
        # (the torch backend) gets the chunks the library would give it, so memory stays bounded.
        step = case.n
        if spec.extra_bytes_per_logit:
            step = default_chunk_size(case.n, case.v, case.dtype, spec.extra_bytes_per_logit)
        logits = inputs.logits.detach()  # same storage; the kernel writes the gradient there

        def run() -> None:
            for start in range(0, case.n, step):
                end = min(start + step, case.n)
                spec.cross_entropy_chunk(
                    logits[start:end],
                    inputs.target[start:end],
                    inputs.ce_weight,
                    scalars,
                    **rows.chunk_kwargs(start, end),
                    row_grad_scale=None,
                    compute_grad=True,
                )

        def loss() -> torch.Tensor:
            add_z = options.lse_square_scale > 0
            reduced = reduce_rows(rows, options.reduction, add_z, False, scalars, stats.accuracy_scale)
            return reduced.loss

        return Step(run, loss)

    return make


def _flce_public_make(backend: str) -> MakeStepFn:
    def make(case: KernelCase, inputs: LogitsInputs) -> Step:
        from flce.functional import cross_entropy

        kwargs = flce_loss_kwargs(case.loss, backend)

        def run() -> torch.Tensor:
            # The public call as users make it: options built and validated on every call.
            loss = as_loss(cross_entropy(inputs.logits, inputs.target, weight=inputs.ce_weight, **kwargs))
            loss.backward()
            return loss.detach()

        return Step(run)

    return make


def flce_kernel_backends() -> tuple[str, ...]:
    """flce's backends in the auto policy's order of preference (the fastest first)."""
    from flce.dispatch import BACKEND_NAMES, get_backend

    return tuple(sorted(BACKEND_NAMES, key=lambda name: -get_backend(name).auto_priority))


def flce_kernel_methods() -> list[KernelMethod]:
    methods = []
    for backend in flce_kernel_backends():
        check = _flce_available(backend)
        methods.append(
            KernelMethod(
                f"flce:{backend}:kernel", f"flce {backend} chunk kernel", "flce", check, _flce_kernel_make(backend)
            )
        )
        methods.append(
            KernelMethod(
                f"flce:{backend}", f"flce.cross_entropy ({backend}), fwd+bwd", "flce", check, _flce_public_make(backend)
            )
        )
    return methods


# ----------------------------------------------------------------------------- Liger-Kernel


def _liger_batch_numbers(case: KernelCase, inputs: LogitsInputs) -> tuple[int, int | float, float]:
    """Liger's per-call host numbers, read once, untimed: the non-ignored rows, their
    summed class weight and the weights' sum. Without weights Liger passes the row count
    (an int) and 0.0; the same Python types give the same Triton specialization."""
    from flce.driver.statistics import batch_statistics

    stats = batch_statistics(inputs.target, inputs.ce_weight, case.v, case.loss.ignore_index)
    if inputs.ce_weight is None:
        return int(stats.n_valid), int(stats.n_valid), 0.0
    return int(stats.n_valid), float(stats.ce_denominator), float(stats.weight_sum)


def _liger_cute_check(case: KernelCase) -> str | None:
    def capability() -> str | None:
        if torch.cuda.get_device_capability(case.device) < LIGER_CUTE_MIN_CAPABILITY:
            return "needs compute capability 9.0 or newer"
        vector = LIGER_CUTE_VECTOR_BYTES // case.itemsize
        if case.v % vector:
            return f"V={case.v} is not a multiple of {vector}: Liger falls back to its Triton kernel"
        return None

    return first_reason(
        lambda: optional_import(LIGER_CUTE_CE)[1], lambda: needs_cuda(case), capability, lambda: _liger_features(case)
    )


def _liger_triton_check(case: KernelCase) -> str | None:
    return first_reason(
        lambda: optional_import(LIGER_TRITON_CE)[1], lambda: needs_cuda(case), lambda: _liger_features(case)
    )


def _liger_functional_check(case: KernelCase) -> str | None:
    return first_reason(
        lambda: optional_import(LIGER_FUNCTIONAL)[1], lambda: needs_cuda(case), lambda: _liger_features(case)
    )


def _liger_features(case: KernelCase) -> str | None:
    return unsupported_features(case, LIGER_CE_FEATURES, "Liger CE")


def _liger_kernel_make(module: str, function: str) -> MakeStepFn:
    def make(case: KernelCase, inputs: LogitsInputs) -> Step:
        fn = getattr(optional_import(module)[0], function)
        n_valid, weight_denominator, weight_sum = _liger_batch_numbers(case, inputs)
        settings = case.loss
        logits = inputs.logits.detach()  # the primitive writes the gradient here
        latest: list[torch.Tensor] = []

        def run() -> None:
            row_losses = fn(
                logits,
                inputs.target,
                inputs.ce_weight,
                settings.ignore_index,
                settings.lse_square_scale,
                settings.label_smoothing,
                settings.reduction,
                settings.softcap,
                n_valid,
                weight_denominator,
                weight_sum,
                # No z-loss output; accuracy and predictions as asked; with gradients.
                False,
                settings.return_token_accuracy,
                settings.return_predicted_tokens,
                True,
            )[0]
            latest[:] = [row_losses]

        # Liger's rows already carry the reduction's scale and the z-loss; its fused loss sums them.
        return Step(run, lambda: latest[0].sum())

    return make


def _liger_autograd_make(loss_fn: Callable[[LogitsInputs, BenchLossSettings], Any]) -> MakeStepFn:
    def make(case: KernelCase, inputs: LogitsInputs) -> Step:
        def run() -> torch.Tensor:
            loss = as_loss(loss_fn(inputs, case.loss))
            loss.backward()
            return loss.detach()

        return Step(run)

    return make


def _liger_triton_loss(inputs: LogitsInputs, settings: BenchLossSettings) -> Any:
    fn = optional_import(LIGER_FUNCTIONAL)[0].liger_cross_entropy
    return fn(
        inputs.logits,
        inputs.target,
        weight=inputs.ce_weight,
        ignore_index=settings.ignore_index,
        reduction=settings.reduction,
        label_smoothing=settings.label_smoothing,
        lse_square_scale=settings.lse_square_scale,
        softcap=settings.softcap,
        **settings.flags(),
    )


def _liger_cute_loss(inputs: LogitsInputs, settings: BenchLossSettings) -> Any:
    fn = optional_import(LIGER_CUTE_CE)[0].cross_entropy_cutedsl
    return fn(
        inputs.logits,
        inputs.target,
        inputs.ce_weight,
        settings.ignore_index,
        settings.lse_square_scale,
        settings.label_smoothing,
        settings.reduction,
        settings.softcap,
        False,
        settings.return_token_accuracy,
        settings.return_predicted_tokens,
    )


def liger_kernel_methods() -> list[KernelMethod]:
    return [
        KernelMethod(
            "liger:cute:kernel",
            "Liger CuTe CE loss-and-grad primitive",
            "liger",
            _liger_cute_check,
            _liger_kernel_make(LIGER_CUTE_CE, "cross_entropy_loss_and_grad_cutedsl"),
        ),
        KernelMethod(
            "liger:cute",
            "Liger CuTe CE autograd, fwd+bwd",
            "liger",
            _liger_cute_check,
            _liger_autograd_make(_liger_cute_loss),
        ),
        KernelMethod(
            "liger:triton:kernel",
            "Liger Triton CE loss-and-grad primitive",
            "liger",
            _liger_triton_check,
            _liger_kernel_make(LIGER_TRITON_CE, "cross_entropy_loss_and_grad_triton"),
        ),
        KernelMethod(
            "liger:triton",
            "Liger Triton CE (liger_cross_entropy), fwd+bwd",
            "liger",
            _liger_functional_check,
            _liger_autograd_make(_liger_triton_loss),
        ),
    ]


# ----------------------------------------------------------------------------- PyTorch and the copy


def _eager_make(case: KernelCase, inputs: LogitsInputs) -> Step:
    def run() -> torch.Tensor:
        loss = as_loss(eager_cross_entropy(inputs.logits, inputs.target, inputs.ce_weight, case.loss))
        loss.backward()
        return loss.detach()

    return Step(run)


def _copy_make(case: KernelCase, inputs: LogitsInputs) -> Step:
    destination = torch.empty_like(inputs.pristine)
    return Step(lambda: destination.copy_(inputs.pristine))


def all_kernel_methods() -> list[KernelMethod]:
    """The copy first (the yardstick), then flce, Liger and eager PyTorch."""
    return [
        KernelMethod(COPY, "copy of the logits (read + write)", "copy", always, _copy_make, is_floor=True),
        *flce_kernel_methods(),
        *liger_kernel_methods(),
        KernelMethod("torch:eager", "torch F.cross_entropy (logits dtype), fwd+bwd", "torch", always, _eager_make),
    ]


# ----------------------------------------------------------------------------- the sweep


@dataclass(frozen=True, kw_only=True)
class KernelBenchConfig(SweepSettings):
    """Everything the CE-kernel benchmark needs, resolved from the command line."""

    shapes: tuple[tuple[int, int], ...]  # (N, V)
    dtypes: tuple[torch.dtype, ...]

    def cases(self) -> list[KernelCase]:
        return [KernelCase(n, v, dtype, self.loss, self.device) for dtype in self.dtypes for n, v in self.shapes]


@dataclass(frozen=True)
class KernelResult:
    """One method on one logits tensor: measured, or skipped with the reason."""

    method: str
    label: str
    case: KernelCase
    is_floor: bool = False
    reason: str | None = None
    timing: TimingStats | None = None
    peak_extra_bytes: int | None = None
    loss: float | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return self.reason is None and self.timing is not None

    @property
    def gb_per_s(self) -> float | None:
        if not self.ok:
            return None
        return self.case.traffic_bytes / (self.timing.median_ms * 1e-3) / 1e9


Progress = Callable[[int, str], None]


def run_case(
    config: KernelBenchConfig, case: KernelCase, methods: Sequence[KernelMethod], progress: Progress
) -> list[KernelResult]:
    """All methods on one logits tensor, interleaved round by round (``runner.measure_runs``)."""
    skipped = unusable_methods(methods, case)
    inputs = make_logits_inputs(case, seed=config.seed, ignore_fraction=config.ignore_fraction)
    runs: list[Running] = []
    steps: dict[str, Step] = {}
    for m in methods:
        if m.name in skipped:
            continue
        try:
            steps[m.name] = m.make(case, inputs)
        except Exception as exc:  # noqa: BLE001 - e.g. a peer that fails while preparing
            skipped[m.name] = skip_reason(exc)
            continue
        runs.append(Running(method=m, workload=workload(steps[m.name], inputs)))
    progress(config.steps_per_case(len(methods) - len(runs)), f"{case.label()} skipped")
    measure_runs(config, case.label(), runs, progress)
    finished = {run.method.name: _result(case, run, steps[run.method.name]) for run in runs}
    del runs, steps, inputs
    free_memory(config.device)
    return [
        finished.get(m.name) or KernelResult(m.name, m.label, case, m.is_floor, reason=skipped[m.name]) for m in methods
    ]


def _result(case: KernelCase, run: Running, step: Step) -> KernelResult:
    m = run.method
    base = {"method": m.name, "label": m.label, "case": case, "is_floor": m.is_floor, "notes": tuple(run.notes)}
    if run.failure is not None or not run.times_ms:
        return KernelResult(**base, reason=run.failure or "no timing")
    loss = run.loss
    if step.latest_loss is not None:
        loss = float(step.latest_loss().float().item())
    timing = TimingStats.from_times(run.times_ms)
    return KernelResult(**base, timing=timing, peak_extra_bytes=run.peak, loss=loss)


def run_kernel_sweep(
    config: KernelBenchConfig, methods: Sequence[KernelMethod], progress: Progress | None = None
) -> list[KernelResult]:
    """Every case of ``config`` in turn; results in case order, then method order."""
    tick = progress or (lambda n, what: None)
    results: list[KernelResult] = []
    for case in config.cases():
        results.extend(run_case(config, case, methods, tick))
    return results


# ----------------------------------------------------------------------------- rows


def result_rows(results: Sequence[KernelResult]) -> list[dict[str, Any]]:
    """JSON-ready rows, with the bandwidth and the percentage of the copy's of the same case."""
    copy_speed = {(r.case.n, r.case.v, r.case.dtype): r.gb_per_s for r in results if r.method == COPY and r.ok}
    rows = []
    for r in results:
        t = r.timing
        speed = r.gb_per_s
        yardstick = copy_speed.get((r.case.n, r.case.v, r.case.dtype))
        rows.append(
            {
                "method": r.method,
                "label": r.label,
                "n": r.case.n,
                "v": r.case.v,
                "dtype": dtype_name(r.case.dtype),
                "floor": r.is_floor,
                "status": "ok" if r.ok else "skipped",
                "reason": r.reason,
                "traffic_bytes": r.case.traffic_bytes,
                "median_ms": t.median_ms if t else None,
                "min_ms": t.min_ms if t else None,
                "max_ms": t.max_ms if t else None,
                "times_ms": list(t.times_ms) if t else None,
                "gb_per_s": speed,
                "pct_of_copy": None if speed is None or not yardstick else 100.0 * speed / yardstick,
                "peak_extra_bytes": r.peak_extra_bytes,
                "loss": None if r.loss is None or not math.isfinite(r.loss) else r.loss,
                "notes": list(r.notes),
            }
        )
    return rows


def case_text(row: dict[str, Any]) -> str:
    return f"{row['n']}×{row['v']} {row['dtype']}"


KERNEL_TABLE_HEADER = ("N × V dtype", "method", "median ms", "min–max ms", "GB/s", "% of copy", "peak extra GiB")


def table_cells(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """Cells of the measured rows, the case written once per group."""
    from flce.bench.report import GIB, fmt, grouped_cells, spread_text

    def cells(row: dict[str, Any]) -> list[str]:
        peak = None if row["peak_extra_bytes"] is None else row["peak_extra_bytes"] / GIB
        return [
            row["method"],
            fmt(row["median_ms"], ".3f"),
            spread_text(row),
            fmt(row["gb_per_s"], ".0f" if (row["gb_per_s"] or 0) >= 100 else ".3g"),
            fmt(row["pct_of_copy"], ".1f"),
            fmt(peak, ".3f"),
        ]

    return grouped_cells(rows, lambda row: [case_text(row)], cells)
