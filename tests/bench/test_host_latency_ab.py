"""``benchmarks/host_latency_ab.py``: the other tree, imported beside this one as
``flce_base``, is a working copy of flce under the new name (CPU)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import torch

import flce
from tests.bench.scripts import load_benchmark_script

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    return load_benchmark_script("host_latency_ab")


def test_renamed_source_renames_imports_module_names_and_the_op_namespace():
    tool = _tool()
    text = (
        "import flce\nfrom flce import ops\nfrom flce.plan import run_loss\n"
        'lazy("flce.backends.triton.ce")\nop = custom_op(f"flce::{name}")\nlib = "flce"\n'
        "# flce's own words stay\n"
    )
    renamed = tool.renamed_source(text)
    assert renamed == (
        "import flce_base\nfrom flce_base import ops\nfrom flce_base.plan import run_loss\n"
        'lazy("flce_base.backends.triton.ce")\nop = custom_op(f"flce_base::{name}")\nlib = "flce_base"\n'
        "# flce's own words stay\n"
    )


def test_the_copy_runs_beside_flce_and_agrees_with_it(tmp_path, monkeypatch):
    tool = _tool()
    tool.copy_as_package(ROOT / "src", tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        base = importlib.import_module("flce_base")
        assert Path(base.__file__).is_relative_to(tmp_path)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(6, 16, generator=gen)
        w = torch.randn(40, 16, generator=gen)
        t = torch.randint(0, 40, (6,), generator=gen)
        ours = flce.fused_linear_cross_entropy(x, w, t, backend="torch")
        theirs = base.fused_linear_cross_entropy(x, w, t, backend="torch")
        assert torch.equal(ours, theirs)
    finally:
        for name in [n for n in sys.modules if n == "flce_base" or n.startswith("flce_base.")]:
            del sys.modules[name]


def test_paired_ratios_take_the_median_of_the_sample_by_sample_ratios():
    tool = _tool()
    samples = {"new:a": {"ms": [1.0, 2.0, 9.0]}, "base:a": {"ms": [2.0, 2.0, 3.0]}}
    assert tool.paired_ratios(samples, "new:a", "base:a") == {"ms": 1.0}
