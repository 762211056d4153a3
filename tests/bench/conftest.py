"""Fixtures shared by the benchmark tests."""

from __future__ import annotations

import sys

import pytest

from flce.bench.peers.optional import optional_import


@pytest.fixture
def no_liger(monkeypatch: pytest.MonkeyPatch):
    """Liger-Kernel made unimportable, whether or not it is installed here."""
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    optional_import.cache_clear()
    yield
    optional_import.cache_clear()
