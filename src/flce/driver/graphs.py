"""CUDA-graph replay of small calls' forward: the host work of a call, not its GPU work,
is what a small shape pays for (issue: training-loop speed).

At N = 1024, H = 1024, V = 32000 a fused fwd+bwd call's kernels take ~0.35 ms of GPU time
and its host work (argument checks, the plan, a dozen launches, autograd) 0.7-1.5 ms, so
a training loop waits on Python. A call whose layout repeats (a training loop's) is
captured once into a CUDA graph and replayed: per call, the per-call tensors are copied
into the graph's own inputs, the graph replays every kernel of the forward in one launch,
and the outputs are copied out, so that no output is ever overwritten by a later replay.

What a graph keys on and what it copies (``GraphedCalls.forward``):

- the per-call tensors (``copied``: the hidden states, the targets, the class weights) are
  copied into the graph's inputs on every call, whatever their address;
- the parameters (``pinned``: the LM-head weight and bias) are read in place: their
  address, shape, strides and dtype are part of the key, so a call with another weight
  tensor gets another graph, and a weight updated in place (an optimizer step) is read
  with its new values at the next replay;
- everything else that decides the kernels (the plan's options, backend and compute dtype,
  the gradients requested, the current stream, the deterministic-algorithms switch,
  inference mode, cuBLAS's math settings: ``gemm_settings``) is part of the key given by
  the caller, and so is the calling thread (each thread's calls use graphs of their own).

A graph is captured on the second call of its key (the first one runs as usual and
compiles what it launches), after one warm-up run on a side stream, with no host sync.
Graphs apply only where the call is host-bound and small (``graph_applies``: a graph holds
at most ``HELD_BYTES_LIMIT``), hold at most ``total_held_bytes_limit`` of device memory in
all (the least recently used one is dropped past it), are captured again only while the
replays pay for the captures (``capture_allowed``: keys that keep evicting each other end
up launched), and never while the caller is itself capturing a graph. A graph keeps its memory
between calls and its outputs are copied out, so a call that states a memory bound (a
budget, chunk sizes: ``flce.plan.graphed_forward``) is never graphed. The input checks of a
replayed call are deferred as usual (``flce.driver.validation``): its outputs are NaN for
bad targets, and the next call raises. ``FLCE_CUDA_GRAPHS=off`` turns them off.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache, partial

import torch

from flce.driver import validation
from flce.options import environment_mode

GRAPHS_ENV_VAR = "FLCE_CUDA_GRAPHS"
_MODES = ("auto", "off")

# N * V * H of the largest call that is graphed. At 2**36 (6.9e10) a fwd+bwd call's three
# GEMMs take ~0.6 ms on an H100/H200 (6 * 6.9e10 flop at ~700 TFLOP/s), under the 0.7-1.5 ms
# of host work of a call launched op by op: below it the call is host-bound and a replay
# removes most of its time; above it the GPU work hides the host work anyway.
MAX_GRAPHED_WORK = 2**36
# Device memory one graph may hold between calls (its inputs, the logits and the gradients
# it writes): a small model's whole head (the small shape's graph holds 200 MB).
HELD_BYTES_LIMIT = 256 * 2**20
# All graphs together: a few such heads (a training and an evaluation layout, a few backends
# side by side in a benchmark), at most 1/32 of the GPU's memory, never several GiB.
TOTAL_HELD_BYTES_LIMIT = 2**30
TOTAL_HELD_FRACTION = 32
# A capture (a warm-up run, the capture, the instantiation: a few ms) pays for itself after
# ~10 replays (each saves 0.3-1 ms of host work). Past the first few, a capture is allowed
# only while the replays have paid for the earlier ones, so that keys that keep evicting
# each other (more graphs than the memory held allows, called in turn) end up launched as
# usual instead of captured again on every call.
FREE_CAPTURES = 4
REPLAYS_PER_CAPTURE = 16
# Calls of a key before the one that captures it: the first runs launch by launch
# (compiling its kernels); a key seen once (an evaluation shape) is never captured.
CALLS_BEFORE_CAPTURE = 1
# Keys whose calls are counted before capture; past it the count starts afresh.
_SEEN_LIMIT = 1024


def graphs_enabled() -> bool:
    """Whether small calls may be replayed from CUDA graphs (``FLCE_CUDA_GRAPHS``)."""
    return environment_mode(GRAPHS_ENV_VAR, _MODES) == "auto"


def graph_pays(n_rows: int, vocab: int, hidden: int, held_bytes: int) -> bool:
    """Whether a call of this size is worth a graph: it has rows, its work is at most
    ``MAX_GRAPHED_WORK`` (host-bound) and its graph holds at most ``HELD_BYTES_LIMIT``."""
    return 0 < n_rows * vocab * hidden <= MAX_GRAPHED_WORK and held_bytes <= HELD_BYTES_LIMIT


def graph_applies(device: torch.device, n_rows: int, vocab: int, hidden: int, held_bytes: int) -> bool:
    """Whether a fused call is replayed from a graph (module docstring): on the current CUDA
    device, where it pays (``graph_pays``), with asynchronous validation (a synchronous
    check reads the host), and not inside the caller's own capture."""
    return (
        device.type == "cuda"
        and graph_pays(n_rows, vocab, hidden, held_bytes)
        and graphs_enabled()
        and not validation.validates_synchronously(device)
        and device.index in (None, torch.cuda.current_device())  # captured and replayed on the current device
        and not torch.cuda.is_current_stream_capturing()
    )


def capture_allowed(captures: int, replays: int) -> bool:
    """Whether another capture is allowed after ``captures`` captures and ``replays``
    replays (``FREE_CAPTURES``, ``REPLAYS_PER_CAPTURE``)."""
    return captures < FREE_CAPTURES + replays // REPLAYS_PER_CAPTURE


@cache
def total_held_bytes_limit(device: torch.device) -> int:
    """The memory all graphs may hold: ``TOTAL_HELD_BYTES_LIMIT``, at most 1/32 of ``device``'s."""
    total = torch.cuda.get_device_properties(device).total_memory
    return min(TOTAL_HELD_BYTES_LIMIT, total // TOTAL_HELD_FRACTION)


# The process-wide cuBLAS settings a GEMM is launched under: TF32 for fp32 products (the
# legacy flag, and the precision of the newer API at each level it may be set at: CUDA
# matmuls, all of CUDA, every backend), the reduced-precision split-K reductions of bf16 and
# fp16 products, fp16 accumulation. Getters this torch lacks are left out.
_cublas_getters = [
    getattr(torch._C, name, None)
    for name in (
        "_get_cublas_allow_tf32",
        "_get_cublas_allow_bf16_reduced_precision_reduction",
        "_get_cublas_allow_fp16_reduced_precision_reduction",
        "_get_cublas_allow_fp16_accumulation",
    )
]
_precision_getter = getattr(torch._C, "_get_fp32_precision_getter", None)
if _precision_getter is not None:
    _cublas_getters += [
        partial(_precision_getter, *level) for level in (("cuda", "matmul"), ("cuda", "all"), ("generic", "all"))
    ]
_GEMM_SETTING_GETTERS = tuple(getter for getter in _cublas_getters if getter is not None)


def gemm_settings() -> tuple:
    """cuBLAS's math settings now (``_GEMM_SETTING_GETTERS``): part of a graph's key, as a
    captured GEMM keeps the kernel chosen under the settings of its capture, where a launched
    one follows those of its call (TF32 turned off for an evaluation, say). A getter that
    refuses to answer (the legacy TF32 flag once the newer API has set the precision) stands
    as None: the newer API's values then tell the settings apart."""
    values = []
    for getter in _GEMM_SETTING_GETTERS:
        try:
            values.append(getter())
        except RuntimeError:
            values.append(None)
    return tuple(values)


def tensor_key(tensor: torch.Tensor | None) -> tuple | None:
    """What a graph keys on of a tensor it reads in place (a parameter): its address,
    shape, strides and dtype."""
    if tensor is None:
        return None
    return tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype


def copied_key(tensor: torch.Tensor | None) -> tuple | None:
    """What a graph keys on of a tensor it copies in: its shape and dtype."""
    return None if tensor is None else (tensor.shape, tensor.dtype)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor | None, ...]  # the graph's copies of the per-call tensors
    result: object  # what the captured function returned (its tensors: the graph's outputs)
    checks: list  # the captured calls' deferred checks: (counts, describe)
    held_bytes: int
    replays: int = 0


@dataclass(frozen=True)
class Replay:
    """One replay: the captured function's ``result``, whose tensors are the graph's
    outputs, valid until the graph's next replay (``current``)."""

    result: object
    graph: _Graph
    index: int  # the graph's replays before this one

    def current(self) -> bool:
        """Whether no later replay of the graph has been launched since (its outputs still
        hold this call's values, in stream order)."""
        return self.graph.replays == self.index + 1


class GraphedCalls:
    """The graphs of the calls seen so far, by key, least recently used first."""

    def __init__(self, held_bytes_limit: int | None = None) -> None:
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._seen: dict[tuple, int] = {}
        self._refused: set[tuple] = set()  # keys whose capture failed: launched as usual
        self._held_bytes_limit = held_bytes_limit  # None: total_held_bytes_limit(device)
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}
        self.captures = 0
        self.replays = 0  # calls served by a replay (the captures' included)
        # Threads calling flce at once take turns here (the cache's bookkeeping); each has
        # graphs of its own (the caller's key holds the thread: a graph's inputs and outputs
        # are used between the calls' turns here).
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._graphs)

    @property
    def held_bytes(self) -> int:
        return sum(g.held_bytes for g in self._graphs.values())

    def clear(self) -> None:
        """Drops every graph (their memory returns to PyTorch's allocator) and the counts."""
        self._graphs.clear()
        self._seen.clear()
        self._refused.clear()
        self.captures = self.replays = 0

    def forward(
        self,
        key: tuple,
        copied: Sequence[torch.Tensor | None],
        run: Callable[[tuple[torch.Tensor | None, ...]], object],
        held_bytes: int,
    ) -> Replay | None:
        """``run(copied)``'s result as a graph's replay returns it (its tensors are the
        graph's outputs, overwritten by the next replay: the caller copies them out, or
        uses them while ``Replay.current``), or None where the caller runs the call
        itself: a key not seen often enough yet, or refused. ``run`` must read the
        per-call tensors only through its argument."""
        with self._lock:
            return self._forward(key, copied, run, held_bytes)

    def _forward(self, key, copied, run, held_bytes: int) -> Replay | None:
        graph = self._graphs.get(key)
        if graph is None:
            if key in self._refused:
                return None
            seen = self._seen.get(key, 0)
            if seen < CALLS_BEFORE_CAPTURE:
                if len(self._seen) >= _SEEN_LIMIT:
                    self._seen.clear()
                self._seen[key] = seen + 1
                return None
            if not capture_allowed(self.captures, self.replays):
                return None
            graph = self._capture(key, copied, run, held_bytes)
            if graph is None:
                return None
        else:
            self._graphs.move_to_end(key)
            for mine, given in zip(graph.inputs, copied, strict=True):
                if mine is not None:
                    mine.copy_(given)
        graph.graph.replay()
        for counts, describe in graph.checks:
            validation.defer(counts, describe)
        self.replays += 1
        graph.replays += 1
        return Replay(graph.result, graph, graph.replays - 1)

    def _capture(self, key, copied, run, held_bytes: int) -> _Graph | None:
        """Captures ``run`` on a side stream (after one warm-up run there), with the
        per-call tensors copied into inputs of its own; None if the capture fails (the
        call and later ones of ``key`` run as usual: a real error raises there)."""
        device = next(t.device for t in copied if t is not None)
        limit = total_held_bytes_limit(device) if self._held_bytes_limit is None else self._held_bytes_limit
        self._seen.pop(key, None)
        if held_bytes > limit:
            self._refused.add(key)
            return None
        while self._graphs and self.held_bytes + held_bytes > limit:
            self._graphs.popitem(last=False)
        self.captures += 1
        # Made outside inference mode: later calls outside it copy into them.
        with torch.inference_mode(False):
            inputs = tuple(
                None if t is None else torch.empty_like(t, memory_format=torch.contiguous_format) for t in copied
            )
        for mine, given in zip(inputs, copied, strict=True):
            if mine is not None:
                mine.copy_(given)
        current = torch.cuda.current_stream(device)
        side = self._side_streams.get(device)
        if side is None:
            side = self._side_streams[device] = torch.cuda.Stream(device)
        side.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        checks: list = []
        try:
            with torch.cuda.stream(side):
                # The warm-up: kernels this layout has not launched yet compile here. Its
                # checks are the replay's below (the same inputs): dropped.
                with validation.recording_checks([]):
                    run(inputs)
                with validation.recording_checks(checks):
                    graph.capture_begin(capture_error_mode="thread_local")
                    try:
                        result = run(inputs)
                    finally:
                        graph.capture_end()
        except Exception:  # noqa: BLE001 (the call runs again without a graph; a real error raises there)
            current.wait_stream(side)
            self._refused.add(key)
            return None
        current.wait_stream(side)
        captured = _Graph(graph, inputs, result, checks, held_bytes)
        self._graphs[key] = captured
        return captured


GRAPHED_CALLS = GraphedCalls()
