"""``benchmarks/block_gemm_kernels.py``: the tile waves it reports, and a clean refusal
without a CUDA GPU (CPU)."""

from __future__ import annotations

import pytest
import torch

from tests.bench.scripts import load_benchmark_script


def _tool():
    return load_benchmark_script("block_gemm_kernels")


@pytest.mark.parametrize(
    ("width", "tiles", "waves"),
    [(8016, 4096, 4096 / 132), (8192, 4096, 4096 / 132), (8448, 4224, 32.0), (7936, 3968, 3968 / 132)],
)
def test_tile_waves_count_the_partial_last_tile_of_a_block(width, tiles, waves):
    assert _tool().tile_waves(8192, width, 132) == (tiles, pytest.approx(waves))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_it_refuses_with_exit_code_2(tmp_path, capsys):
    assert _tool().main([str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
