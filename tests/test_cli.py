"""``flce info`` and ``flce check`` on this machine."""

import subprocess
import sys

from flce.cli import main


def test_info_lists_every_backend(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in ("torch", "triton", "cutedsl"):
        assert name in out
    assert "auto dispatch picks" in out


def test_check_passes_for_the_torch_backend(capsys):
    assert main(["check", "--backend", "torch", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "FAIL" not in out


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


def test_console_script_entry_point():
    result = subprocess.run([sys.executable, "-m", "flce.cli", "info"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
