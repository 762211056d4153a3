"""The peers' adapters on the CPU: each row must time the library call its label names."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from flce.bench.cases import BenchCase, BenchLossSettings, Shape, make_inputs
from flce.bench.peers import torch_eager
from flce.bench.registry import all_methods
from flce.bench.timing import call_once


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("fresh_dynamo")
def test_torch_compile_compiles_every_shape_of_a_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past dynamo's recompile limit (8 graphs by default) the compiled function runs
    eagerly, with a log line only: a sweep of more shapes than that must still time
    compiled code on every shape. A limit of 1 stands for the default here."""
    # dynamo's own patch: undoing a monkeypatch of its config module deleted the setting
    # under pytest 9.2 with torch 2.11, and every later compile in the process failed.
    with torch._dynamo.config.patch(recompile_limit=1):
        monkeypatch.setattr(torch_eager, "_compiled_cases", set())
        # The eager backend: dynamo's graphs without inductor's compile time.
        compiled = torch.compile(torch_eager.eager_loss, dynamic=False, backend="eager")
        monkeypatch.setattr(torch_eager, "_compiled_eager", lambda: compiled)
        method = next(m for m in all_methods() if m.name == "torch:compile")
        for vocab in (40, 41, 42):
            case = BenchCase(Shape(8, vocab, 16), torch.float32, "fwd", BenchLossSettings(), torch.device("cpu"))
            graphs = counters["stats"]["unique_graphs"]
            call_once(method.workload(case, make_inputs(case)))
            assert counters["stats"]["unique_graphs"] == graphs + 1, f"V={vocab} ran eagerly"
