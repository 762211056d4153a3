"""Parity of the fused linear + cross-entropy loss against float64, flce's backends side
by side with Liger-Kernel's Triton FLCE, at small and real vocabularies.

    python3 benchmarks/parity_vs_liger.py OUTDIR [--quick] [--backends triton,cutedsl,torch]
        [--vocab 32000,128256] [--dtypes bf16,fp32] [--configs plain,sum] [--tokens 256] [--hidden 512]

For each vocabulary V, dtype and loss configuration (plain mean, sum, ignored rows,
label smoothing, z-loss, softcap, class weights, everything together with a bias) it
computes the loss and the gradients dX, dW (and db) with each flce backend and with
``liger_fused_linear_cross_entropy``, and measures each against the float64 reference of
``flce.testing`` (``loss.backward()``: upstream gradient 1). The yardstick is eager
PyTorch in the same dtype (logits GEMM in the dtype, softmax math in fp32), the same
one flce's tests use: an output passes when ``err <= 3 * err(torch same dtype) + eps``.

Errors per quantity: ``norm_rel = ||got - truth|| / ||truth||`` (the tests' measure),
``max_abs = max |got - truth|`` and ``max_rel = max_abs / max |truth|``.

Writes ``OUTDIR/parity_vs_liger.json`` (every number, versions, the command) and
``OUTDIR/parity_vs_liger.md`` (a summary per implementation, then one row per case and
quantity). Without a GPU it runs the torch backend only and reports Liger as skipped;
``--quick`` shrinks the cases (N=32, H=64, V in 1000/3001) for a run in seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import flce
from flce.bench.report import environment, utc_now
from flce.dispatch import BACKEND_NAMES, availability
from flce.testing import EPS, TOLERANCE_FACTOR, Case, Tensors, _run_reference

SCHEMA = "flce-parity-vs-liger/1"
VOCABS = (32000, 128256, 151936, 262144)
QUICK_VOCABS = (1000, 3001)
TOKENS, HIDDEN = 256, 512
QUICK_TOKENS, QUICK_HIDDEN = 32, 64
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
IGNORE_INDEX = -100
LIGER = "liger:triton"
YARDSTICK = "torch same dtype"
# Logits of standard deviation ~5 (as flce.testing's cases): peaked softmaxes whose
# largest logits reach the softcap's curved region at real vocabularies.
LOGIT_SCALE = 5.0


@dataclass(frozen=True)
class LossConfig:
    """One loss configuration; every option here is one Liger's FLCE takes as well."""

    name: str
    reduction: str = "mean"
    label_smoothing: float = 0.0
    lse_square_scale: float = 0.0
    softcap: float | None = None
    ce_weight: bool = False
    bias: bool = False
    ignored_fraction: float = 0.0

    def options(self) -> dict[str, Any]:
        """The non-default loss options, as keyword arguments (``ce_weight`` as a flag)."""
        opts: dict[str, Any] = {}
        if self.label_smoothing:
            opts["label_smoothing"] = self.label_smoothing
        if self.lse_square_scale:
            opts["lse_square_scale"] = self.lse_square_scale
        if self.softcap is not None:
            opts["softcap"] = self.softcap
        if self.ce_weight:
            opts["ce_weight"] = True
        return opts

    def describe(self) -> str:
        parts = [f"reduction={self.reduction}", *(f"{k}={v}" for k, v in self.options().items() if k != "ce_weight")]
        if self.ce_weight:
            parts.append("ce_weight")
        if self.bias:
            parts.append("bias")
        if self.ignored_fraction:
            parts.append(f"{self.ignored_fraction:.0%} rows ignored")
        return ", ".join(parts)


CONFIGS = (
    LossConfig("plain"),
    LossConfig("sum", reduction="sum"),
    LossConfig("ignore_index", ignored_fraction=0.25),
    LossConfig("label_smoothing", label_smoothing=0.1),
    LossConfig("z_loss", lse_square_scale=1e-4),
    LossConfig("softcap", softcap=30.0),
    LossConfig("ce_weight", ce_weight=True),
    LossConfig(
        "all",
        label_smoothing=0.1,
        lse_square_scale=1e-4,
        softcap=30.0,
        ce_weight=True,
        bias=True,
        ignored_fraction=0.25,
    ),
)


@dataclass(frozen=True)
class BaseTensors:
    """fp32 inputs of one vocabulary, shared by every dtype and configuration."""

    x: torch.Tensor  # (N, H)
    w: torch.Tensor  # (V, H)
    target: torch.Tensor  # (N,) no row ignored
    ignored: torch.Tensor  # (N,) bool: rows that configurations with ignored rows ignore
    bias: torch.Tensor  # (V,)
    ce_weight: torch.Tensor  # (V,) in [0.5, 1.5)


def base_tensors(n: int, h: int, v: int, ignored_fraction: float, device: torch.device, seed: int) -> BaseTensors:
    gen = torch.Generator(device=device).manual_seed(seed)
    kw: dict[str, Any] = {"device": device, "generator": gen}
    x = torch.randn(n, h, **kw)
    w = torch.randn(v, h, **kw).mul_(LOGIT_SCALE / math.sqrt(h))
    target = torch.randint(0, v, (n,), **kw)
    ignored = torch.rand(n, **kw) < ignored_fraction
    bias = torch.randn(v, **kw)
    ce_weight = torch.rand(v, **kw).add_(0.5)
    return BaseTensors(x, w, target, ignored, bias, ce_weight)


def case_tensors(base: BaseTensors, config: LossConfig, dtype: torch.dtype) -> Tensors:
    """``flce.testing.Tensors`` of one case: inputs in ``dtype``, upstream gradient 1."""
    target = base.target.masked_fill(base.ignored, IGNORE_INDEX) if config.ignored_fraction else base.target
    return Tensors(
        input=base.x.to(dtype),
        weight=base.w.to(dtype),
        target=target,
        bias=base.bias.to(dtype) if config.bias else None,
        ce_weight=base.ce_weight if config.ce_weight else None,
        upstream=torch.ones((), device=base.x.device),
    )


def testing_case(config: LossConfig, dtype: torch.dtype, n: int, h: int, v: int) -> Case:
    """The ``flce.testing.Case`` whose options the reference runs with."""
    return Case(
        n_rows=n,
        hidden=h,
        vocab=v,
        dtype=dtype,
        reduction=config.reduction,
        bias=config.bias,
        ignore_index=IGNORE_INDEX,
        options=tuple(sorted(config.options().items())),
    )


def grad_names(config: LossConfig) -> tuple[str, ...]:
    return ("input", "weight", "bias") if config.bias else ("input", "weight")


QUANTITY = {"loss": "loss", "input": "dX", "weight": "dW", "bias": "db"}


def errors(got: torch.Tensor, truth: torch.Tensor) -> dict[str, float]:
    """norm_rel, max_abs and max_rel of ``got`` against ``truth`` (computed in float64 where they live)."""
    got, truth = got.detach().double(), truth.detach().double()
    if not torch.isfinite(got).all():
        return {"norm_rel": math.inf, "max_abs": math.inf, "max_rel": math.inf}
    diff = got - truth
    scale = truth.abs().max().item()
    norm = truth.norm().item()
    max_abs = diff.abs().max().item()
    return {
        "norm_rel": diff.norm().item() / norm if norm > 0 else diff.norm().item(),
        "max_abs": max_abs,
        "max_rel": max_abs / scale if scale > 0 else max_abs,
    }


def run_flce(t: Tensors, config: LossConfig, backend: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    leaves = _leaves(t, config)
    opts = {k: v for k, v in config.options().items() if k != "ce_weight"}
    loss = flce.fused_linear_cross_entropy(
        leaves["input"],
        leaves["weight"],
        t.target,
        bias=leaves.get("bias"),
        ce_weight=t.ce_weight,
        ignore_index=IGNORE_INDEX,
        reduction=config.reduction,
        backend=backend,
        **opts,
    )
    loss.backward()
    return loss.detach(), {name: leaf.grad for name, leaf in leaves.items()}


def run_liger(t: Tensors, config: LossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    leaves = _leaves(t, config)
    loss = liger_fused_linear_cross_entropy(
        leaves["input"],
        leaves["weight"],
        t.target,
        bias=leaves.get("bias"),
        ce_weight=t.ce_weight,
        ignore_index=IGNORE_INDEX,
        lse_square_scale=config.lse_square_scale,
        label_smoothing=config.label_smoothing,
        reduction=config.reduction,
        softcap=config.softcap,
    )
    loss.backward()
    return loss.detach(), {name: leaf.grad for name, leaf in leaves.items()}


def _leaves(t: Tensors, config: LossConfig) -> dict[str, torch.Tensor]:
    leaves = {"input": t.input.detach().clone().requires_grad_(), "weight": t.weight.detach().clone().requires_grad_()}
    if config.bias:
        leaves["bias"] = t.bias.detach().clone().requires_grad_()
    return leaves


def measured(loss: torch.Tensor, grads: dict[str, torch.Tensor], truth, truth_grads, names) -> dict[str, Any]:
    out = {"loss": errors(loss, truth.loss)}
    for name in names:
        out[QUANTITY[name]] = errors(grads[name], truth_grads[name]) if grads.get(name) is not None else None
    return out


def implementations(args: argparse.Namespace, device: torch.device) -> dict[str, str | None]:
    """Implementation name -> None (runs) or why it is skipped."""
    impls: dict[str, str | None] = {}
    for backend in args.backends:
        ok, why = availability(backend, device)
        impls[f"flce:{backend}"] = None if ok else why
    impls[LIGER] = liger_skip_reason(device)
    return impls


def liger_skip_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "needs a CUDA device"
    try:
        import liger_kernel.transformers.functional  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure is a skip reason
        return f"liger-kernel does not import ({type(exc).__name__}: {exc})"
    return None


def run_case(config: LossConfig, dtype_name: str, base: BaseTensors, impls: dict[str, str | None]) -> dict:
    dtype = DTYPES[dtype_name]
    n, h = base.x.shape
    v = base.w.shape[0]
    t = case_tensors(base, config, dtype)
    case = testing_case(config, dtype, n, h, v)
    names = grad_names(config)
    truth, truth_grads = _run_reference(t, case, torch.float64, torch.float64, names)
    eager, eager_grads = _run_reference(t, case, dtype, torch.float32, names)
    row: dict[str, Any] = {
        "vocab": v,
        "dtype": dtype_name,
        "config": config.name,
        "options": config.describe(),
        "n": n,
        "h": h,
        "loss_float64": truth.loss.item(),
        "results": {YARDSTICK: measured(eager.loss, eager_grads, truth, truth_grads, names)},
    }
    for impl, skip in impls.items():
        if skip is not None:
            continue
        try:
            if impl == LIGER:
                loss, grads = run_liger(t, config)
            else:
                loss, grads = run_flce(t, config, impl.split(":", 1)[1])
            row["results"][impl] = measured(loss, grads, truth, truth_grads, names)
        except Exception as exc:  # noqa: BLE001 - one failing implementation must not hide the rest
            first_line = next(iter(str(exc).splitlines()), "")
            row["results"][impl] = {"error": f"{type(exc).__name__}: {first_line}"[:300]}
    return row


def within_tolerance(err: dict[str, float], yardstick: dict[str, float], dtype_name: str) -> bool:
    """flce's own pass criterion (``flce.testing``): err <= 3 * err(torch same dtype) + eps."""
    return err["norm_rel"] <= TOLERANCE_FACTOR * yardstick["norm_rel"] + EPS[DTYPES[dtype_name]]


def summarize(rows: list[dict], impls: dict[str, str | None]) -> list[dict]:
    """Per implementation and quantity: the worst error and worst ratio to the yardstick,
    and how many cases pass flce's tolerance."""
    summary = []
    for impl, skip in impls.items():
        if skip is not None:
            continue
        for quantity in ("loss", "dX", "dW", "db"):
            ratios, worst, passed, total, failed_cases = [], 0.0, 0, 0, []
            for row in rows:
                got = row["results"].get(impl, {})
                if "error" in got:
                    failed_cases.append(f"{row['config']} V={row['vocab']} {row['dtype']} (error)")
                    continue
                err, ref = got.get(quantity), row["results"][YARDSTICK].get(quantity)
                if err is None or ref is None:
                    continue
                total += 1
                worst = max(worst, err["norm_rel"])
                if ref["norm_rel"] > 0:
                    ratios.append(err["norm_rel"] / ref["norm_rel"])
                if within_tolerance(err, ref, row["dtype"]):
                    passed += 1
                else:
                    failed_cases.append(f"{row['config']} V={row['vocab']} {row['dtype']}")
            if total or failed_cases:
                summary.append(
                    {
                        "implementation": impl,
                        "quantity": quantity,
                        "cases": total,
                        "within_tolerance": passed,
                        "worst_norm_rel": worst,
                        "worst_ratio_to_torch": max(ratios) if ratios else None,
                        "median_ratio_to_torch": sorted(ratios)[len(ratios) // 2] if ratios else None,
                        "outside_tolerance": failed_cases,
                    }
                )
    return summary


def _cell(result: dict | None, quantity: str) -> str:
    if result is None:
        return ""
    if "error" in result:
        return "error"
    err = result.get(quantity)
    return "" if err is None else f"{err['norm_rel']:.2e} ({err['max_abs']:.1e})"


def markdown(payload: dict) -> str:
    env = payload["environment"]
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    impls = [name for name, skip in payload["implementations"].items() if skip is None]
    lines = [
        "# Parity against float64: flce backends and Liger's Triton FLCE",
        "",
        f"**{env.get('gpu') or 'CPU'}** · {versions} · {payload['date_utc']}  ",
        f"N = {payload['config']['tokens']}, H = {payload['config']['hidden']}; `loss.backward()` (upstream 1).  ",
        f"Command: `{payload['command']}`",
        "",
        *(
            []
            if payload["complete"]
            else ["**Incomplete run**: the vocabularies after the last one below are missing.", ""]
        ),
        "Error = ‖got − truth‖ / ‖truth‖ against the float64 reference; the yardstick is eager PyTorch in the",
        f"same dtype. Within tolerance: err ≤ {TOLERANCE_FACTOR:g} × err(torch same dtype) + eps "
        "(flce's test criterion).",
        "",
        "## Summary",
        "",
        "| implementation | quantity | within tolerance | worst error | worst × torch | median × torch |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for s in payload["summary"]:
        worst_ratio = "" if s["worst_ratio_to_torch"] is None else f"{s['worst_ratio_to_torch']:.2f}"
        median_ratio = "" if s["median_ratio_to_torch"] is None else f"{s['median_ratio_to_torch']:.2f}"
        lines.append(
            f"| {s['implementation']} | {s['quantity']} | {s['within_tolerance']}/{s['cases']} "
            f"| {s['worst_norm_rel']:.2e} | {worst_ratio} | {median_ratio} |"
        )
    outside = [(s["implementation"], s["quantity"], c) for s in payload["summary"] for c in s["outside_tolerance"]]
    if outside:
        lines += ["", "Outside tolerance: " + "; ".join(f"{i} {q} @ {c}" for i, q, c in outside) + "."]
    skipped = {name: why for name, why in payload["implementations"].items() if why is not None}
    if skipped:
        lines += ["", "Skipped: " + "; ".join(f"{name}: {why}" for name, why in skipped.items()) + "."]
    lines += [
        "",
        "## Every case",
        "",
        "Cells: error (max abs error).",
        "",
        "| V | dtype | config | quantity | " + " | ".join([YARDSTICK, *impls]) + " |",
        "|---|---|---|---|" + "---:|" * (1 + len(impls)),
    ]
    for row in payload["cases"]:
        quantities = [q for q in ("loss", "dX", "dW", "db") if row["results"][YARDSTICK].get(q) is not None]
        for i, quantity in enumerate(quantities):
            head = [str(row["vocab"]), row["dtype"], row["config"]] if i == 0 else ["", "", ""]
            cells = [_cell(row["results"].get(name), quantity) for name in (YARDSTICK, *impls)]
            lines.append("| " + " | ".join([*head, quantity, *cells]) + " |")
    described = payload["config"]["configs"]
    lines += ["", "Configurations: " + "; ".join(f"{name}: {text}" for name, text in described.items()) + "."]
    return "\n".join(lines) + "\n"


def _names(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(item) for item in _names(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path, help="directory for parity_vs_liger.json and parity_vs_liger.md")
    parser.add_argument("--quick", action="store_true", help="N=32, H=64, V in 1000/3001: seconds, also on the CPU")
    parser.add_argument(
        "--backends", type=_names, help="flce backends (default: triton,cutedsl,torch on a GPU; torch on the CPU)"
    )
    parser.add_argument("--vocab", type=_ints, help="comma list of V (default 32000,128256,151936,262144)")
    parser.add_argument("--tokens", type=int, help=f"N (default {TOKENS}; {QUICK_TOKENS} with --quick)")
    parser.add_argument("--hidden", type=int, help=f"H (default {HIDDEN}; {QUICK_HIDDEN} with --quick)")
    parser.add_argument("--dtypes", type=_names, default=("bf16", "fp32"), help="comma list among bf16,fp32")
    parser.add_argument("--configs", type=_names, help="comma list among " + ",".join(c.name for c in CONFIGS))
    parser.add_argument("--device", help="torch device (default cuda when available, else cpu)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    known = {c.name for c in CONFIGS}
    for flag, values, choices in (
        ("--backends", args.backends or (), BACKEND_NAMES),
        ("--dtypes", args.dtypes, tuple(DTYPES)),
        ("--configs", args.configs or (), tuple(known)),
    ):
        unknown = [value for value in values if value not in choices]
        if unknown:
            parser.error(f"{flag}: unknown {unknown}; choose among {sorted(choices)}")
    for flag, value in (("--tokens", args.tokens), ("--hidden", args.hidden)):
        if value is not None and value <= 0:
            parser.error(f"{flag} must be a positive integer, got {value}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.backends is None:
        # Off the GPU only the torch backend is meant to run (Triton there is its interpreter).
        args.backends = ("triton", "cutedsl", "torch") if device.type == "cuda" else ("torch",)
    n = args.tokens or (QUICK_TOKENS if args.quick else TOKENS)
    h = args.hidden or (QUICK_HIDDEN if args.quick else HIDDEN)
    vocabs = args.vocab or (QUICK_VOCABS if args.quick else VOCABS)
    configs = [c for c in CONFIGS if args.configs is None or c.name in args.configs]
    impls = implementations(args, device)
    ignored_fraction = max(c.ignored_fraction for c in CONFIGS)
    config = {
        "tokens": n,
        "hidden": h,
        "vocabs": list(vocabs),
        "dtypes": list(args.dtypes),
        "seed": args.seed,
        "configs": {c.name: c.describe() for c in configs},
        "upstream_gradient": 1.0,
        "tolerance": f"norm_rel <= {TOLERANCE_FACTOR:g} * norm_rel(torch same dtype) + eps(dtype)",
    }
    # As typed from the repository root, OUTDIR for the output folder (no machine paths).
    given = sys.argv[1:] if argv is None else argv
    command = shlex.join(
        [
            "python3",
            "benchmarks/parity_vs_liger.py",
            *("OUTDIR" if Path(word) == args.outdir else word for word in given),
        ]
    )
    env = environment(device)
    args.outdir.mkdir(parents=True, exist_ok=True)
    json_path = args.outdir / "parity_vs_liger.json"
    md_path = args.outdir / "parity_vs_liger.md"
    started = time.perf_counter()
    rows: list[dict] = []
    for v in vocabs:
        base = base_tensors(n, h, v, ignored_fraction, device, args.seed)
        for dtype_name in args.dtypes:
            for loss_config in configs:
                rows.append(run_case(loss_config, dtype_name, base, impls))
                print(f"[{time.perf_counter() - started:6.1f}s] V={v} {dtype_name} {loss_config.name}", flush=True)
        del base
        if device.type == "cuda":
            torch.cuda.empty_cache()
        # Written after every vocabulary, so a run cut short by a time limit keeps what it measured.
        payload = {
            "schema": SCHEMA,
            "command": command,
            "date_utc": utc_now(),
            "environment": env,
            "config": config,
            "complete": v == vocabs[-1],
            "implementations": impls,
            "cases": rows,
            "summary": summarize(rows, impls),
        }
        json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
        md_path.write_text(markdown(payload))
    print(md_path.read_text().split("## Every case")[0].rstrip())
    print(f"wrote {json_path} and {md_path} in {time.perf_counter() - started:.1f}s")
    errors_seen = any("error" in r for row in rows for r in row["results"].values())
    return 1 if errors_seen else 0


if __name__ == "__main__":
    raise SystemExit(main())
