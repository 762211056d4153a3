"""``benchmarks/overlap_probe.py``: its pipeline (the backward in vocabulary blocks of the
stored logits) against float64 on the CPU's torch kernels and Triton's through the
interpreter, and a clean refusal to time without a CUDA GPU."""

from __future__ import annotations

import pytest
import torch

from flce.dispatch import availability
from tests.bench.scripts import load_benchmark_script

CPU = torch.device("cpu")


def _tool():
    return load_benchmark_script("overlap_probe")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_pipeline_gives_the_loss_and_gradients_of_float64(backend, capsys):
    usable, reason = availability(backend, CPU)
    if not usable:
        pytest.skip(reason)
    assert _tool().check(backend, CPU, torch.float32) == 0
    assert "FAILED" not in capsys.readouterr().out


def test_blocks_are_aligned_and_cover_the_vocabulary_with_each_target_in_one_block():
    target = torch.tensor([0, 255, 256, 999, 1000, 1299])
    blocks = _tool().Blocks.of(target, 1300, 3)
    assert blocks.bounds == ((0, 512), (512, 1024), (1024, 1300))
    assert blocks.owned_by.sum(dim=0).tolist() == [1] * len(target)
    assert blocks.widths.tolist() == [512, 512, 276]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_it_refuses_to_time_with_exit_code_2(tmp_path, capsys):
    assert _tool().main([str(tmp_path)]) == 2
    assert "needs OUTDIR and a CUDA GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
