"""Fixtures shared by the benchmark tests."""

from __future__ import annotations

import sys

import pytest

from flce.bench import methods as bench_methods


@pytest.fixture
def no_liger(monkeypatch: pytest.MonkeyPatch):
    """Liger-Kernel made unimportable, whether or not it is installed here."""
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    bench_methods._import.cache_clear()
    yield
    bench_methods._import.cache_clear()
