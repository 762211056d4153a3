"""Fixtures shared by the benchmark tests."""

from __future__ import annotations

import sys

import pytest

from flce.bench.peers.cce import CCE
from flce.bench.peers.optional import optional_import


@pytest.fixture
def no_peers(monkeypatch: pytest.MonkeyPatch):
    """The peers (Liger-Kernel, Apple's CCE) made unimportable, whether or not they are
    installed here: the tests' expected rows name them as missing (a GPU machine has both)."""
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    monkeypatch.setitem(sys.modules, CCE, None)
    optional_import.cache_clear()
    yield
    optional_import.cache_clear()
