"""Smoke test of examples/train_tiny_llama.py: a few CPU steps, in-process and as a script."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is not installed")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_tiny_llama.py"
TINY = [
    "--device",
    "cpu",
    "--batch-size",
    "2",
    "--seq-len",
    "16",
    "--vocab-size",
    "64",
    "--hidden-size",
    "32",
    "--log-every",
    "2",
]


def load_example():
    spec = importlib.util.spec_from_file_location("train_tiny_llama", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("loss", ["flce", "hf"])
def test_main_runs_a_few_steps(loss, capsys):
    example = load_example()
    result = example.main(["--steps", "5", "--loss", loss, *TINY])
    out = capsys.readouterr().out
    assert result["loss"] == loss and len(result["losses"]) == 5
    assert all(math.isfinite(x) for x in result["losses"])
    assert result["first_loss"] == pytest.approx(math.log(64), rel=0.2)  # untrained: ~log(vocab)
    assert "tokens/s" in out and "peak mem" in out and out.count("step ") == 3
    assert "peak RSS" in result["peak_memory"] or result["peak_memory"] == "n/a"


@pytest.mark.parametrize("flag", ["--log-every", "--hidden-size", "--layers", "--chunk-size"])
def test_a_nonpositive_size_is_a_usage_error(flag, capsys):
    """Not a ZeroDivisionError at the first step (--log-every 0), nor an error from deep
    inside the model or the loss."""
    with pytest.raises(SystemExit) as exited:
        load_example().main(["--steps", "2", *TINY, flag, "0"])
    assert exited.value.code == 2 and flag in capsys.readouterr().err


def test_flce_and_hf_losses_agree():
    example = load_example()
    flce_run = example.main(["--steps", "4", "--loss", "flce", *TINY])
    hf_run = example.main(["--steps", "4", "--no-flce", *TINY])
    assert flce_run["losses"] == pytest.approx(hf_run["losses"], rel=1e-4)


def test_synthetic_language_is_learnable_structure():
    example = load_example()
    language = example.SyntheticLanguage(vocab=50, noise=0.0, seed=3)
    batch = language.batch(4, 10)
    assert batch.shape == (4, 10)
    assert (batch[:, 1:] == language.successor[batch[:, :-1]]).all()
    assert language.entropy() == 0.0


def test_script_runs_from_the_command_line():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "2", "--loss", "flce", *TINY],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "done: loss" in proc.stdout and "tokens/s" in proc.stdout
