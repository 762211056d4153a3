"""``benchmarks/device_validate.sh``'s record of the code it ran: a copy of a checkout on a GPU
machine may carry older git metadata than its files, so ``gpu.txt`` names the tree of
``src/`` as it stands on disk."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs a git checkout")
def test_info_step_names_the_tree_of_src_as_it_stands(tmp_path):
    subprocess.run(
        ["bash", str(REPO / "benchmarks" / "device_validate.sh"), str(tmp_path), "info"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    recorded = (tmp_path / "gpu.txt").read_text()
    tree = next(line.split(": ", 1)[1] for line in recorded.splitlines() if line.startswith("src tree: "))
    if _git("status", "--porcelain", "--", "src"):
        pytest.skip("src/ has uncommitted changes: no commit to compare the tree with")
    assert tree == _git("rev-parse", "HEAD:src")
    assert _git("status", "--porcelain", "--", "src") == ""  # the checkout's own index untouched
