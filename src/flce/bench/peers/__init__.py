"""Adapters of the libraries ``flce bench`` calls: one module per library.

Each module turns a ``BenchCase`` and the shared ``Inputs`` into that library's call and
says, in a ``check``, why it cannot run a case. Optional libraries are imported lazily
through ``optional.optional_import``, so a missing one is a skip reason, never an import
error. ``flce_backends`` adapts flce's own backends the same way; ``flce.bench.registry``
puts them all in table order.
"""
