"""``flce bench --loss logprobs|distill``: the RL and distillation heads, flce's backends
against eager PyTorch (and Liger's fused linear JSD for ``distill``), with the GEMM floor
of each head, time and peak memory. The sweep, timing and report are ``flce bench``'s
(``flce.bench.runner``, ``flce.bench.report``); what differs is here: the methods, the
teacher's inputs and the floors.

- ``logprobs``: ``flce.fused_linear_logprobs(..., return_entropy=True)`` and the scalar a
  GRPO step differentiates, ``sum(logprobs * advantages) + 0.01 * sum(entropy)`` (fixed
  signed advantages). Floor: the cross-entropy's three GEMMs (logits, dX, dW; 6NVH
  fwd+bwd). flce recomputes the logits in backward (the gradient needs each token's
  upstream gradient), so its own GEMMs are four (8NVH): 1.33x that floor at cuBLAS speed.
- ``distill``: ``flce.fused_linear_distillation`` (beta 0.5, mean over the tokens) from a
  teacher of the student's hidden size. Floor: two logits GEMMs (the student's and the
  teacher's) + dX + dW (8NVH fwd+bwd, 4NVH forward).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

import flce
from flce.bench import report
from flce.bench.cases import BenchCase, Inputs, Shape, dtype_name
from flce.bench.graph import GraphStep, capture
from flce.bench.methods import FLOOR, GRAPH_MODES, LossFn, Method, floor_workload, select_methods
from flce.bench.peers.optional import first_reason, needs_cuda, optional_import
from flce.bench.runner import BenchConfig, Result
from flce.bench.timing import Workload
from flce.dispatch import BACKEND_NAMES, availability, get_backend
from flce.reference import distillation_from_logits_reference

HEAD_LOSSES = ("logprobs", "distill")
# The slot of flce.backends.base.BackendSpec each head runs on.
HEAD_SLOT = {"logprobs": "logprobs", "distill": "distillation"}
# The shapes: N=8192, H=4096 at the two vocabularies of today's RL models.
GPU_DEFAULT = ((8192,), (128256, 151936), (4096,))
CPU_DEFAULT = ((256,), (2048,), (128,))
CPU_DEFAULT_METHODS = ("flce:torch", "torch:eager")

TEMPERATURE = 1.0
ENTROPY_BONUS = 0.01
BETA = 0.5
# The teacher: the student's weights and hidden states perturbed by this relative noise,
# so that the two distributions are close but not equal, as after some distillation.
TEACHER_NOISE = 0.3
LIGER_FUNCTIONAL = "liger_kernel.transformers.functional"
LOGPROBS_OBJECTIVE = f"sum(logprobs * advantages) + {ENTROPY_BONUS} * sum(entropy)"
FLOOR_TEXT = {
    "logprobs": "the cross-entropy's GEMMs: logits, dX, dW (6NVH fwd+bwd; flce keeps the logits when the memory "
    "budget allows, else recomputes them: 8NVH)",
    "distill": "the student's and the teacher's logits, dX, dW (8NVH fwd+bwd, 4NVH forward)",
}


@dataclasses.dataclass(frozen=True)
class DistillShape(Shape):
    """A distillation problem (the teacher's hidden size equal to the student's): two
    logits GEMMs in the forward."""

    def flops(self, mode: str) -> int:
        """fwd: both logits GEMMs (4NVH); bwd: dX + dW (4NVH); full: the four (8NVH)."""
        return {"fwd": 4, "bwd": 4, "full": 8}[mode] * self.n * self.v * self.h


# --------------------------------------------------------------------- inputs


def advantages(inputs: Inputs) -> torch.Tensor:
    """(N,) fp32 signed per-token weights, as a policy-gradient loss gives its logprobs."""
    n = inputs.x.shape[0]
    return torch.linspace(-1.0, 1.0, n, device=inputs.x.device)


def teacher(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's ``(input (N, H), weight (V, H))`` for the shared inputs, drawn once and
    kept with them (every method of a shape reads the same teacher; the runner frees
    both with the inputs)."""
    cached = inputs.__dict__.get("teacher")
    if cached is None:
        gen = torch.Generator(device=inputs.x.device).manual_seed(17)

        def perturbed(t: torch.Tensor) -> torch.Tensor:
            noise = torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float32)
            return (t.detach().float() + noise.mul_(TEACHER_NOISE * t.detach().float().std())).to(t.dtype)

        cached = inputs.__dict__["teacher"] = (perturbed(inputs.x), perturbed(inputs.w))
    return cached


# -------------------------------------------------------------------- methods


def _flce_check(head: str, backend: str):
    def check(case: BenchCase) -> str | None:
        spec = get_backend(backend)
        if getattr(spec, HEAD_SLOT[head]) is None:
            return f"backend {backend!r} has no {HEAD_SLOT[head]} kernels"
        ok, reason = availability(backend, case.device)
        return None if ok else f"backend {backend!r} unavailable: {reason}"

    return check


def _logprobs_objective(out, weights: torch.Tensor) -> torch.Tensor:
    return (out.logprobs * weights).sum() + ENTROPY_BONUS * out.entropy.sum()


def _flce_make(head: str, backend: str):
    def make(case: BenchCase, inputs: Inputs) -> LossFn:
        if head == "logprobs":
            weights = advantages(inputs)
            return lambda: _logprobs_objective(
                flce.fused_linear_logprobs(
                    inputs.x, inputs.w, inputs.target, temperature=TEMPERATURE, return_entropy=True, backend=backend
                ),
                weights,
            )
        teacher_x, teacher_w = teacher(inputs)
        return lambda: flce.fused_linear_distillation(
            inputs.x, inputs.w, teacher_x, teacher_w, inputs.target, beta=BETA, temperature=TEMPERATURE, backend=backend
        )

    return make


def eager_logprobs(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor, temperature: float):
    """Eager PyTorch as RL trainers write it: fp32 logits, log-softmax, gather, entropy."""
    log_p = torch.log_softmax(F.linear(x, w).float() / temperature, dim=-1)  # (N, V)
    valid = target != -100
    logprobs = log_p.gather(1, torch.where(valid, target, 0)[:, None]).squeeze(1) * valid
    entropy = -(torch.exp(log_p) * log_p).sum(dim=-1) * valid
    return flce.LogprobsOutput(logprobs, entropy)


def _eager_make(head: str):
    def make(case: BenchCase, inputs: Inputs) -> LossFn:
        if head == "logprobs":
            weights = advantages(inputs)
            return lambda: _logprobs_objective(eager_logprobs(inputs.x, inputs.w, inputs.target, TEMPERATURE), weights)
        teacher_x, teacher_w = teacher(inputs)

        def distill() -> torch.Tensor:
            with torch.no_grad():
                teacher_logits = F.linear(teacher_x, teacher_w).float()
            return distillation_from_logits_reference(
                F.linear(inputs.x, inputs.w).float(),
                teacher_logits,
                inputs.target,
                beta=BETA,
                temperature=TEMPERATURE,
                math_dtype=torch.float32,
            )

        return distill

    return make


def _liger_check(case: BenchCase) -> str | None:
    return first_reason(lambda: optional_import(LIGER_FUNCTIONAL)[1], lambda: needs_cuda(case))


def _liger_make(case: BenchCase, inputs: Inputs) -> LossFn:
    fn = optional_import(LIGER_FUNCTIONAL)[0].liger_fused_linear_jsd
    teacher_x, teacher_w = teacher(inputs)
    return lambda: fn(inputs.x, inputs.w, teacher_x, teacher_w, inputs.target, BETA, -100, TEMPERATURE)


@dataclasses.dataclass(frozen=True)
class HeadFloor(Method):
    """The GEMMs a head cannot avoid: the cross-entropy's for ``logprobs``; for
    ``distill`` the teacher's logits GEMM besides (dX and dW from the student's logits
    standing in for the gradient)."""

    head: str = "logprobs"

    def workload(self, case: BenchCase, inputs: Inputs) -> Workload:
        """The floor's GEMMs; with ``case.graph`` captured once and replayed, as the methods
        timed against it are."""
        if case.graph:
            return capture(self.graph_step(case, inputs), case.device)
        return self.gemm_workload(case, inputs)

    def graph_step(self, case: BenchCase, inputs: Inputs) -> GraphStep:
        if case.mode not in GRAPH_MODES:
            raise ValueError(f"a CUDA graph captures the modes {GRAPH_MODES}, not {case.mode!r}")
        run = self.gemm_workload(case, inputs).run
        return lambda: (run(None),)

    def gemm_workload(self, case: BenchCase, inputs: Inputs) -> Workload:
        """The GEMMs as plain calls."""
        if self.head == "logprobs" or case.mode == "bwd":
            return floor_workload(case, inputs)
        x, w = inputs.x.detach(), inputs.w.detach()
        teacher_x, teacher_w = teacher(inputs)

        def run(_: Any):
            logits = torch.mm(x, w.t())
            teacher_logits = torch.mm(teacher_x, teacher_w.t())
            if case.mode == "fwd":
                return logits, teacher_logits
            return torch.mm(logits, w), torch.mm(logits.t(), x)

        return Workload(setup=lambda: None, run=run)


def head_methods(head: str) -> list[Method]:
    """The floor, flce's backends, eager PyTorch and (``distill``) Liger's fused linear JSD."""
    floor_label = "GEMMs alone (" + ("logits, dX, dW" if head == "logprobs" else "2 logits, dX, dW") + ")"
    methods: list[Method] = [HeadFloor(FLOOR, floor_label, "floor", lambda case: None, is_floor=True, head=head)]
    for backend in BACKEND_NAMES:
        methods.append(
            Method(f"flce:{backend}", f"flce {backend}", "flce", _flce_check(head, backend), _flce_make(head, backend))
        )
    methods.append(Method("torch:eager", "torch eager (fp32 logits)", "torch", lambda case: None, _eager_make(head)))
    if head == "distill":
        methods.append(Method("liger:jsd", "Liger fused linear JSD", "liger", _liger_check, _liger_make))
    return methods


# ------------------------------------------------------------------------ run


def _refuse_options(args: argparse.Namespace) -> None:
    """Options of the cross-entropy benchmark that these heads do not take."""
    given = [
        flag
        for flag, value in (
            ("--features", args.features),
            ("--chunk-size", args.chunk_size),
            ("--reduction sum", args.reduction != "mean"),
        )
        if value
    ]
    if given:
        raise ValueError(f"--loss {args.loss} does not take {', '.join(given)}")


def resolve_head_run(args: argparse.Namespace, base: BenchConfig) -> tuple[BenchConfig, list[Method]]:
    """``flce bench``'s configuration (``base``) with the head's shapes (its own defaults
    without ``--sweep``; ``DistillShape`` for ``distill``), and the selected methods."""
    _refuse_options(args)
    shape_type = DistillShape if args.loss == "distill" else Shape
    if args.sweep is None:
        tokens, vocab, hidden = GPU_DEFAULT if base.device.type == "cuda" else CPU_DEFAULT
        triples = [(n, v, h) for h in args.hidden or hidden for n in args.tokens or tokens for v in args.vocab or vocab]
    else:
        triples = [(s.n, s.v, s.h) for s in base.shapes]
    config = dataclasses.replace(base, shapes=tuple(shape_type(*triple) for triple in triples))
    wanted = args.methods or (CPU_DEFAULT_METHODS if config.device.type != "cuda" else None)
    return config, select_methods(head_methods(args.loss), wanted)


def head_payload(
    args: argparse.Namespace,
    config: BenchConfig,
    methods: Sequence[Method],
    results: Sequence[Result],
    environment: dict[str, Any],
    command: str,
) -> dict[str, Any]:
    """The JSON of a run (``flce bench``'s schema, with the head's settings in ``config``)."""
    config_record = {
        "loss": args.loss,
        "mode": config.mode,
        "dtype": dtype_name(config.dtype),
        "shapes": [{"n": s.n, "v": s.v, "h": s.h} for s in config.shapes],
        **config.record(),
        "temperature": TEMPERATURE,
        "objective": LOGPROBS_OBJECTIVE if args.loss == "logprobs" else f"generalized JSD, beta {BETA}, mean",
        "floor": FLOOR_TEXT[args.loss],
        "methods": [m.name for m in methods],
        "graph": config.graph,
    }
    return report.run_record(command, environment, config_record, [report.result_row(r) for r in results])
