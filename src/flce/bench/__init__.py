"""Benchmarks of the LM-head loss: ``flce bench`` (see ``flce.bench.cli``).

Modules: ``methods`` (the competitors and their inputs), ``timing`` (events,
host clock, peak memory), ``runner`` (the interleaved sweep), ``report``
(terminal table, JSON, CSV, plots, README Markdown); ``ce_kernel`` and
``host_overhead`` (``flce bench --kernel ce``: the CE kernel's bandwidth, the
host time per call).
"""

from typing import Any

__all__ = ["add_bench_arguments", "run_bench"]


def __getattr__(name: str) -> Any:
    # Lazy, so that ``python -m flce.bench.cli`` does not import the module twice.
    if name in __all__:
        from flce.bench import cli

        return getattr(cli, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
