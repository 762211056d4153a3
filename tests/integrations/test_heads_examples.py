"""Smoke tests of examples/grpo_step.py and examples/distill_step.py: a couple of CPU
steps each, flce's losses equal to the materialized-logits path's."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is not installed")

ROOT = Path(__file__).resolve().parents[2]
GRPO_TINY = [
    "--device", "cpu", "--num-prompts", "2", "--group-size", "3", "--prompt-len", "4",
    "--completion-len", "5", "--vocab-size", "97", "--hidden-size", "32", "--layers", "1",
]  # fmt: skip
DISTILL_TINY = [
    "--device", "cpu", "--batch-size", "2", "--seq-len", "9", "--vocab-size", "97",
    "--student-hidden", "32", "--teacher-hidden", "48", "--layers", "1",
]  # fmt: skip


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grpo_steps_match_the_materialized_logits(capsys):
    example = load_example("grpo_step")
    fused = example.main(["--steps", "2", *GRPO_TINY])
    eager = example.main(["--steps", "2", "--logprobs", "eager", *GRPO_TINY])
    assert all(math.isfinite(x) for x in fused["losses"]) and len(fused["rewards"]) == 2
    # The same samples (same seeds), and the same loss up to fp32 rounding.
    assert fused["rewards"] == eager["rewards"]
    assert fused["losses"] == pytest.approx(eager["losses"], rel=1e-4, abs=1e-6)
    assert "done: mean reward" in capsys.readouterr().out


def test_group_advantages_are_relative_to_the_group():
    example = load_example("grpo_step")
    import torch

    advantages = example.group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), group_size=2)
    assert advantages[0] > 0 > advantages[1] and advantages[2] == advantages[3] == 0


def test_distillation_steps_match_the_materialized_logits(capsys):
    example = load_example("distill_step")
    fused = example.main(["--steps", "2", *DISTILL_TINY])
    eager = example.main(["--steps", "2", "--loss", "eager", *DISTILL_TINY])
    assert all(0 < x < math.log(2) for x in fused["losses"])  # the JSD at beta 0.5 is below log 2
    assert fused["losses"] == pytest.approx(eager["losses"], rel=1e-4)
    assert "done: divergence" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("name", "tiny", "flag"),
    [
        ("grpo_step", GRPO_TINY, "--vocab-size"),
        ("grpo_step", GRPO_TINY, "--hidden-size"),
        ("grpo_step", GRPO_TINY, "--layers"),
        ("distill_step", DISTILL_TINY, "--vocab-size"),
        ("distill_step", DISTILL_TINY, "--teacher-hidden"),
        ("distill_step", DISTILL_TINY, "--layers"),
    ],
)
def test_a_nonpositive_size_is_a_usage_error(name, tiny, flag, capsys):
    """Refused with the usage message, not by an error from inside the model."""
    with pytest.raises(SystemExit) as exited:
        load_example(name).parse_args([*tiny, flag, "0"])
    assert exited.value.code == 2 and "positive sizes" in capsys.readouterr().err
