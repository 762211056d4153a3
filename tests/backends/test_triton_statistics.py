"""The one-launch batch statistics (``flce.backends.triton.statistics``) against the
PyTorch ops of ``flce.driver.statistics`` (through Triton's interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from flce.backends.triton import availability  # noqa: E402
from flce.driver.statistics import _statistics_buffer  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if not availability(DEVICE)[0]:
    pytest.skip(f"triton cannot run here: {availability(DEVICE)[1]}", allow_module_level=True)

from flce.backends.triton.statistics import batch_statistics_values  # noqa: E402


@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize(
    "case",
    ["plain", "all_ignored", "empty", "bad_target", "bad_weight", "zero_weight_sum", "int8", "many_blocks"],
)
def test_matches_the_pytorch_ops(case, weights):
    gen = torch.Generator().manual_seed(len(case))
    n, vocab, ignore_index = (3000, 2500, -100) if case == "many_blocks" else (37, 29, 5)
    target = torch.randint(0, vocab, (n,), generator=gen)
    target[::4] = ignore_index
    ce_weight = torch.rand(vocab, generator=gen) + 0.5 if weights else None
    if case == "all_ignored":
        target[:] = ignore_index
    elif case == "empty":
        target = target[:0]
    elif case == "bad_target":
        target[3] = vocab + 7
        target[6] = -3
    elif case == "bad_weight" and weights:
        ce_weight[2] = float("nan")
        ce_weight[4] = -1.0
    elif case == "zero_weight_sum" and weights:
        ce_weight[target[target != ignore_index]] = 0.0
    elif case == "int8":
        target = target.clamp(max=127).to(torch.int8)
    target = target.to(DEVICE)
    ce_weight = None if ce_weight is None else ce_weight.to(DEVICE)
    values = batch_statistics_values(target, ce_weight, vocab, ignore_index)
    expected = _statistics_buffer(target, ce_weight, vocab, ignore_index)
    assert torch.equal(values[-2:].cpu(), expected[-2:].cpu())  # the checks' counts, exactly
    torch.testing.assert_close(values.cpu(), expected.cpu(), rtol=1e-6, atol=0, equal_nan=True)
