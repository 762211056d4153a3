"""Benchmarks of the LM-head loss: ``flce bench`` (see ``flce.bench.cli``).

Modules: ``cases`` (shapes, loss settings, the shared inputs), ``methods`` (what
a competitor is, its timed workload, the floor), ``peers/`` (one adapter module per
library: flce's backends, PyTorch, Liger-Kernel, Apple CCE), ``registry`` (all of
them in table order), ``timing`` (events, host clock, peak memory, host syncs, host time
with the GPU kept busy), ``graph`` (``--graph``: a call captured in a CUDA graph),
``runner`` (the interleaved sweep), ``report`` (terminal table, JSON, CSV, plots, README Markdown);
``ce_kernel`` and ``host_overhead`` (``flce bench --kernel ce``: the CE kernel's
bandwidth, the host time per call); ``tensor_parallel`` (``flce bench --tp``).
"""
