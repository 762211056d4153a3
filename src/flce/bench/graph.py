"""``flce bench --graph``: a method's call captured once in a CUDA graph, then timed as replays.

The capture follows PyTorch's recipe (and flce's GPU test of it): the shared inputs are
the graph's static inputs; warm-up calls run on a side stream, so that kernels are
compiled and the caching allocator primed outside the graph; then one capture. A method
that cannot be captured (a host sync, a copy to the host, a CPU tensor made on the way)
raises ``NotCapturable`` with the first line of the error, which the sweep shows as the
method's skip reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flce.bench.timing import Workload

# Warm-up calls before the capture, on the side stream: the first compiles and allocates,
# the second runs as the captured call will (PyTorch's recipe takes a few; flce's test two).
GRAPH_WARMUP_CALLS = 2

# What to capture: one call returning what the eager workload's ``run`` returns first (the
# detached loss), then the tensors that must live as long as the graph (the gradients).
GraphStep = Callable[[], tuple[Any, ...]]


class NotCapturable(RuntimeError):
    """A method's call cannot be captured in a CUDA graph; the text is the skip reason."""


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message``, as a skip reason quotes an error."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def capture(step: GraphStep, device: torch.device) -> Workload:
    """A workload whose ``run`` replays ``step`` captured once in a CUDA graph.

    Its peak extra memory is measured over the capture (``Workload.known_peak_bytes``):
    the graph's private memory pool holds every tensor the call allocates, so a replay
    allocates nothing more. Out of memory is raised as is (the sweep's own skip reason);
    any other failure of the capture as ``NotCapturable``.
    """
    if device.type != "cuda":
        raise NotCapturable(f"CUDA graphs need a CUDA device, not {device.type}")
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(GRAPH_WARMUP_CALLS):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.current_stream(device)
    failure: Exception | None = None
    try:
        with torch.cuda.graph(graph):
            try:
                outputs = step()
            except Exception as exc:
                # Kept: ending a broken capture may raise an error of its own that hides it.
                failure = exc
                raise
    except Exception as exc:
        # When ending the capture raises, ``torch.cuda.graph`` leaves its capture stream current.
        torch.cuda.set_stream(stream)
        error = failure or exc
        if isinstance(error, torch.cuda.OutOfMemoryError):
            raise error from None
        raise NotCapturable(f"not capturable in a CUDA graph: {first_line(error)}"[:300]) from exc
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before

    def replay(_: Any) -> Any:
        graph.replay()
        return outputs[0]

    return Workload(setup=lambda: None, run=replay, known_peak_bytes=int(peak))
