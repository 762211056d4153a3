"""The installed torch's release, and the oldest one flce runs on.

``import flce`` refuses an older torch (``check_torch_version``) rather than fail later:
under torch 2.4 ``torch.compile`` cannot trace flce's calls (Dynamo stops on a union type
and on the functorch-transform query that guards the custom ops), and the vocab-parallel
loss fails on its DTensor inputs; torch 2.5's compiled CPU code sets flush-to-zero for the
whole process. torch 2.6 is the oldest release the test suite passes on."""

from __future__ import annotations

import torch

MIN_TORCH_VERSION = (2, 6)


def release(version: str) -> tuple[int, int]:
    """``"2.6.0+cpu"`` -> ``(2, 6)``; a development build (``"2.8.0a0+git..."``) counts
    as its release."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


TORCH_VERSION = release(torch.__version__)


def check_torch_version(version: str = torch.__version__) -> None:
    """Raise ImportError naming the installed and the required torch when ``version`` is
    older than ``MIN_TORCH_VERSION``."""
    if release(version) < MIN_TORCH_VERSION:
        need = ".".join(map(str, MIN_TORCH_VERSION))
        raise ImportError(f"flce needs torch>={need}; torch {version} is installed (pip install 'torch>={need}')")
