"""``flce``, ``flce info`` and ``flce check`` on this machine: what they print, and that a
request this machine cannot serve is one line and a non-zero exit code, not a traceback."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import flce
from flce.cli import main

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")


def _one_line_error(capsys: pytest.CaptureFixture, command: str) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"flce {command}: error: ")
    assert "Traceback" not in captured.err + captured.out
    return lines[0]


def test_info_lists_every_backend(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in ("torch", "triton", "cutedsl"):
        assert name in out
    assert "auto dispatch picks" in out


def test_no_command_prints_the_help(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: flce")
    for command in ("info", "check", "bench"):
        assert f"    {command} " in out, command


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"flce {flce.__version__} ")


def test_check_passes_for_the_torch_backend_and_reports_progress(monkeypatch, capsys):
    from contextlib import contextmanager

    from flce import cli
    from flce.testing import check_cases, check_cases_vocabulary_blocks

    ticks = []

    @contextmanager
    def recording(total, enabled=True):
        ticks.append(total)
        yield lambda n, what: ticks.append((n, what))

    monkeypatch.setattr(cli, "progress_reporter", recording)
    assert main(["check", "--backend", "torch", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "FAIL" not in out
    cases = len(check_cases(torch.device("cpu"))) + len(check_cases_vocabulary_blocks())
    total, *steps = ticks
    assert total == cases and sum(n for n, _ in steps) == cases
    assert steps[-1][1] == f"torch case {cases}/{cases}"


def test_check_fails_loudly_on_a_wrong_kernel(monkeypatch, capsys):
    import dataclasses

    from flce import dispatch

    good = dispatch.get_backend("torch")

    def off_by_a_bit(logits, *args, **kwargs):
        good.cross_entropy_chunk(logits, *args, **kwargs)
        kwargs["loss_out"].mul_(1.001)  # a 0.1% loss error must not pass

    broken = dataclasses.replace(good, cross_entropy_chunk=off_by_a_bit, description="broken")
    monkeypatch.setattr(dispatch, "get_backend", lambda name: broken)
    monkeypatch.setattr("flce.plan.resolve_backend", lambda name, device: broken)
    assert main(["check", "--backend", "torch", "--device", "cpu"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_check_of_a_backend_that_cannot_run_here_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # triton then cannot run on CPU tensors
    assert main(["check", "--backend", "triton", "--device", "cpu"]) == 2
    line = _one_line_error(capsys, "check")
    assert "backend 'triton' cannot run on cpu" in line and "TRITON_INTERPRET=1" in line


@NO_CUDA
@pytest.mark.parametrize("command", ["check", "bench"])
def test_cuda_device_without_a_gpu_is_one_line(command, capsys):
    assert main([command, "--device", "cuda"]) == 2
    line = _one_line_error(capsys, command)
    assert "--device cuda: no CUDA device here" in line and "--device cpu" in line


@pytest.mark.parametrize("command", ["check", "bench"])
def test_a_device_that_is_not_one_is_one_line(command, capsys):
    assert main([command, "--device", "gpu0"]) == 2
    assert "--device 'gpu0' is not a torch device" in _one_line_error(capsys, command)


@pytest.mark.parametrize("command", ["check", "bench"])
def test_the_meta_device_is_one_line(command, capsys):
    assert main([command, "--device", "meta"]) == 2
    assert "--device meta: the meta device holds no data" in _one_line_error(capsys, command)


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="checks the message of a machine without MPS")
@pytest.mark.parametrize("command", ["check", "bench"])
def test_a_device_type_this_machine_lacks_is_one_line(command, capsys):
    assert main([command, "--device", "mps"]) == 2
    assert "--device mps: no mps device here" in _one_line_error(capsys, command)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton installed")
def test_info_names_a_missing_dependency_of_triton_not_triton():
    """With numpy unimportable, Triton's interpreter does not import: ``flce info`` must say
    numpy is missing, not that Triton is."""
    hide_numpy = "import sys; sys.modules['numpy'] = None; from flce.cli import main; main(['info'])"
    result = subprocess.run(
        [sys.executable, "-c", hide_numpy],
        capture_output=True,
        text=True,
        env={**os.environ, "TRITON_INTERPRET": "1", "COLUMNS": "200"},
    )
    assert result.returncode == 0, result.stderr
    assert "numpy is missing" in result.stdout
    assert "triton is not installed" not in result.stdout


def test_console_script_entry_point():
    result = subprocess.run([sys.executable, "-m", "flce.cli", "info"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
