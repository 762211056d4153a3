"""Every method of ``flce bench``, in table order: the floor, flce's backends, then the
peers (PyTorch, Liger-Kernel, Apple CCE)."""

from __future__ import annotations

from collections.abc import Sequence

from flce.bench.methods import Method, floor_method
from flce.bench.peers.cce import cce_methods
from flce.bench.peers.flce_backends import flce_methods
from flce.bench.peers.liger import liger_methods
from flce.bench.peers.torch_eager import torch_eager_methods
from flce.bench.peers.torch_lce import torch_lce_methods


def peer_methods() -> list[Method]:
    """The non-flce competitors, in table order."""
    return [*torch_eager_methods(), *torch_lce_methods(), *liger_methods(), *cce_methods()]


def all_methods(chunk_sizes: Sequence[int | None] = (None,)) -> list[Method]:
    """Every known method: the floor first, then flce backends (one per chunk size), then peers."""
    return [floor_method(), *flce_methods(chunk_sizes), *peer_methods()]
