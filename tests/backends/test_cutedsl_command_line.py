"""The CuTe DSL reads the process's command line at every compile (its ``-diagnostic``
option, through argparse, which takes abbreviations): a user's own options must never
reach it, or a script run with ``--h 4096`` exits at flce's first compile.

The command-line filter runs everywhere; the compile under such a command line needs
nvidia-cutlass-dsl (no GPU: it compiles for sm_90a)."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from flce.backends.cutedsl import command_line_for_dsl, dsl_command_line
from tests.backends.cutedsl_gpu import HAS_DSL, needs_dsl


@pytest.mark.parametrize(
    ("argv", "seen"),
    [
        (["train.py"], ["train.py"]),
        (["train.py", "--h", "4096", "--help-me"], ["train.py"]),
        (["train.py", "--he", "-d", "x", "--lr=3e-4"], ["train.py"]),
        (["train.py", "--h", "1", "-diagnostic", "fail", "--v", "2"], ["train.py", "-diagnostic", "fail"]),
        (["train.py", "-diagnostic", "--epochs", "3"], ["train.py", "-diagnostic"]),
        (["train.py", "-diagnostic=info", "--x"], ["train.py", "-diagnostic=info"]),
        ([], []),
    ],
)
def test_the_dsl_sees_only_its_own_option(argv, seen):
    assert dsl_command_line(argv) == seen


def test_the_command_line_is_restored_after_a_compile_even_one_that_raises(monkeypatch):
    argv = ["train.py", "--h", "4096"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(RuntimeError, match="compile failed"):
        with command_line_for_dsl():
            assert sys.argv == ["train.py"]
            raise RuntimeError("compile failed")
    assert sys.argv is argv


@needs_dsl
def test_a_kernel_compiles_under_a_command_line_the_dsl_would_exit_on(monkeypatch):
    # A key no other test compiles, so that this compile really runs.
    assert HAS_DSL
    from flce.backends.cutedsl import fused_forward as ff
    from flce.backends.cutedsl import fused_gradient as fg

    argv = ["train.py", "--h", "4096", "--he"]
    monkeypatch.setattr(sys, "argv", argv)
    key = fg.FusedGradientKey(torch.bfloat16, 520, 192, False, False, False, False, False)
    assert fg.compile_fused_gradient(key, ff.COOPERATIVE_CONFIG) is not None  # before: the DSL's usage, then SystemExit
    assert sys.argv is argv


def test_threads_compiling_at_once_leave_the_command_line_as_it_was(monkeypatch):
    argv = ["train.py", "--h", "4096"]
    monkeypatch.setattr(sys, "argv", argv)
    inside = threading.Barrier(2, timeout=1.0)
    seen = []

    def compile_like():
        with command_line_for_dsl():
            seen.append(list(sys.argv))
            try:  # both inside at once only if the swap is not serialised
                inside.wait()
            except threading.BrokenBarrierError:
                pass
            time.sleep(0.01)

    threads = [threading.Thread(target=compile_like) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sys.argv is argv
    assert seen == [["train.py"], ["train.py"]]


def test_an_interpreter_without_a_command_line_gets_none_back(monkeypatch):
    monkeypatch.delattr(sys, "argv")
    with command_line_for_dsl():
        assert sys.argv == [""]  # what argparse needs to find no option
    assert not hasattr(sys, "argv")
