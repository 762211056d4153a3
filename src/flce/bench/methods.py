"""What a competitor of ``flce bench`` is, and the unit of work it is timed on.

Every method is a ``Method``: a name, a ``check`` that says why it cannot run a case
(missing package, wrong device, unsupported dtype/shape/feature) or None, and a
``make_loss`` that returns a zero-argument callable computing the loss on the shared
inputs. The floor (the cuBLAS GEMMs alone) is a method too, with its own workload per
mode. The adapters of flce's backends and of the peers live in ``flce.bench.peers``;
``flce.bench.registry`` lists them all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flce.bench.cases import MODES, BenchCase, Inputs
from flce.bench.graph import GraphStep, capture
from flce.bench.timing import Workload

FLOOR = "floor:gemm"
# The modes ``--graph`` captures: bwd alone has no call to capture (its forward would run
# outside the graph, and a replay would read the saved tensors of a freed autograd graph).
GRAPH_MODES = ("fwd", "full")

LossFn = Callable[[], torch.Tensor]
CheckFn = Callable[[BenchCase], "str | None"]
MakeLossFn = Callable[[BenchCase, Inputs], LossFn]


@dataclass(frozen=True)
class Method:
    """One competitor. ``check`` returns why it cannot run a case, or None."""

    name: str
    label: str
    family: str
    check: CheckFn
    make_loss: MakeLossFn | None = None
    chunk_size: int | None = None
    is_floor: bool = False
    base: str = ""
    # What the method runs for a case, in words (flce's: the scheme its driver picks), or None.
    describe: Callable[[BenchCase], str] | None = None

    @property
    def base_name(self) -> str:
        """The name without a chunk-size suffix (``flce:triton`` for ``flce:triton[chunk=4096]``)."""
        return self.base or self.name

    def workload(self, case: BenchCase, inputs: Inputs) -> Workload:
        """The timed unit of work of this method in ``case.mode``; with ``case.graph``, the
        call captured once in a CUDA graph and replayed."""
        if case.graph:
            return capture(self.graph_step(case, inputs), case.device)
        if self.is_floor:
            return floor_workload(case, inputs)
        assert self.make_loss is not None
        return loss_workload(self.make_loss(case, inputs), inputs, case.mode)

    def graph_step(self, case: BenchCase, inputs: Inputs) -> GraphStep:
        """The call ``--graph`` captures (fwd, or fwd+bwd with ``--mode full``)."""
        if case.mode not in GRAPH_MODES:
            raise ValueError(f"a CUDA graph captures the modes {GRAPH_MODES}, not {case.mode!r}")
        if self.is_floor:
            floor_run = floor_workload(case, inputs).run
            return lambda: (floor_run(None),)
        assert self.make_loss is not None
        return loss_graph_step(self.make_loss(case, inputs), inputs, case.mode)


def always(case: Any) -> str | None:
    """The check of a method that runs everywhere."""
    return None


def as_loss(out: Any) -> torch.Tensor:
    """The loss tensor of a method's return value (tensor, tuple or output object)."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "loss"):
        return out.loss
    if isinstance(out, (tuple, list)):
        return out[0]
    raise TypeError(f"cannot find a loss in {type(out).__name__}")


def loss_workload(loss_fn: LossFn, inputs: Inputs, mode: str) -> Workload:
    """fwd: forward under no_grad; full: forward + backward; bwd: backward only
    (the forward runs in the untimed setup). Gradients are dropped after each
    call so they are allocated afresh, and counted, by the next one. Only the loss
    takes part in the backward: per-token outputs (accuracy, predicted tokens) have no grad."""
    params = inputs.params()

    def drop_grads() -> None:
        for p in params:
            p.grad = None

    if mode == "fwd":

        def run_fwd(_: Any) -> torch.Tensor:
            with torch.no_grad():
                return loss_fn()

        return Workload(setup=lambda: None, run=run_fwd)
    if mode == "full":

        def run_full(_: Any) -> torch.Tensor:
            loss = loss_fn()
            loss.backward()
            return loss.detach()

        return Workload(setup=lambda: None, run=run_full, teardown=drop_grads)
    if mode == "bwd":

        def run_bwd(loss: torch.Tensor) -> torch.Tensor:
            loss.backward()
            return loss.detach()

        return Workload(setup=loss_fn, run=run_bwd, teardown=drop_grads)
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def loss_graph_step(loss_fn: LossFn, inputs: Inputs, mode: str) -> GraphStep:
    """The call of ``loss_workload`` as a graph captures it: the forward under no_grad, or
    the forward and the gradients of the parameters, returned (rather than accumulated in
    ``.grad``) so that they stay at the addresses the graph writes on every replay."""
    if mode == "fwd":

        def forward() -> tuple[torch.Tensor]:
            with torch.no_grad():
                return (loss_fn().detach(),)

        return forward
    if mode == "full":
        params = inputs.params()

        def forward_backward() -> tuple[torch.Tensor, ...]:
            loss = loss_fn()
            return (loss.detach(), *torch.autograd.grad(loss, params))

        return forward_backward
    raise ValueError(f"a CUDA graph captures the modes {GRAPH_MODES}, not {mode!r}")


def floor_workload(case: BenchCase, inputs: Inputs) -> Workload:
    """The GEMMs no LM-head loss can avoid, in the input dtype.

    The bias of ``--features bias`` is left out: adding it and summing its gradient are
    O(N·V) elementwise work beside the O(N·V·H) GEMMs, which is what the floor measures.
    fwd: logits = X Wᵀ. full: logits, then dX = G W and dW = Gᵀ X with the logits
    standing in for G. bwd: dX and dW from a random G allocated here, outside the
    measurement, as a forward would have left it.
    """
    x, w = inputs.x.detach(), inputs.w.detach()
    if case.mode == "fwd":
        return Workload(setup=lambda: None, run=lambda _: torch.mm(x, w.t()))
    if case.mode == "full":

        def run_full(_: Any) -> tuple[torch.Tensor, torch.Tensor]:
            logits = torch.mm(x, w.t())
            return torch.mm(logits, w), torch.mm(logits.t(), x)

        return Workload(setup=lambda: None, run=run_full)
    if case.mode == "bwd":
        gen = torch.Generator(device=case.device).manual_seed(1)
        grad = torch.randn(case.shape.n, case.shape.v, generator=gen, device=case.device, dtype=case.dtype)
        grad.mul_(1e-2)
        return Workload(setup=lambda: None, run=lambda _: (torch.mm(grad, w), torch.mm(grad.t(), x)))
    raise ValueError(f"mode must be one of {MODES}, got {case.mode!r}")


def floor_method() -> Method:
    return Method(name=FLOOR, label="GEMMs alone (floor)", family="floor", check=always, is_floor=True)


def select_methods(methods: Sequence[Any], wanted: Sequence[str] | None) -> list[Any]:
    """The methods matching ``wanted`` (names, base names or families), the floor always.

    A method is anything with ``name``, ``base_name``, ``family`` and ``is_floor``: a
    ``Method``, or a method of the CE-kernel benchmark.

    None selects everything. An unknown name raises ValueError listing the choices.
    """
    if wanted is None:
        return list(methods)
    keys = {key for m in methods for key in (m.name, m.base_name, m.family)}
    unknown = [w for w in wanted if w not in keys]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose among {sorted(keys)}")
    chosen = set(wanted)
    return [m for m in methods if m.is_floor or chosen & {m.name, m.base_name, m.family}]
