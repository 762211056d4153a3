"""The in-place upstream-gradient rescale (flce.backends.triton.scale), through Triton's
interpreter on CPU and natively on CUDA."""

import pytest
import torch

from flce.backends.triton import availability
from flce.driver.scaling import scale_gradients_

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not availability(DEVICE)[0], reason=availability(DEVICE)[1] or "triton available")


def _scale(values, scale):
    from flce.backends.triton.scale import scale_unless_one_

    return scale_unless_one_(values, torch.tensor(scale, device=values.device))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("n", [1, 4095, 4096, 10001])
def test_scales_in_fp32_and_rounds_once(dtype, n):
    values = torch.randn(n, device=DEVICE).to(dtype)
    expected = (values.float() * 2.7).to(dtype)
    _scale(values, 2.7)
    if DEVICE.type == "cuda":
        assert torch.equal(values, expected)
    else:  # the interpreter rounds fp32 -> bf16/fp16 toward zero: at most one ulp off
        ulp = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 0.0}[dtype]
        torch.testing.assert_close(values.float(), expected.float(), rtol=ulp, atol=0)


def test_scale_of_one_leaves_the_values_untouched():
    values = torch.randn(5000, device=DEVICE, dtype=torch.bfloat16)
    values[7] = float("nan")
    before = values.clone()
    _scale(values, 1.0)
    assert torch.equal(values[:7], before[:7]) and torch.equal(values[8:], before[8:])
    assert values[7].isnan()


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -1.0])
def test_special_scales_are_applied(scale):
    values = torch.linspace(-3, 3, 301, device=DEVICE)
    expected = values * scale
    _scale(values, scale)
    torch.testing.assert_close(values, expected, equal_nan=True)


def test_rejects_non_contiguous_values_and_accepts_empty():
    from flce.backends.triton.scale import scale_unless_one_

    with pytest.raises(ValueError, match="contiguous"):
        scale_unless_one_(torch.randn(4, 4, device=DEVICE).t(), torch.tensor(2.0))
    scale_unless_one_(torch.empty(0, device=DEVICE), torch.tensor(2.0))


def test_scale_gradients_skips_missing_ones_and_takes_a_device_scalar():
    a = torch.ones(3, 4, device=DEVICE, dtype=torch.bfloat16)
    b = torch.ones(6, device=DEVICE)
    scale_gradients_((a, None, b), torch.tensor(0.5, device=DEVICE))
    assert torch.equal(a, torch.full_like(a, 0.5)) and torch.equal(b, torch.full_like(b, 0.5))
    strided = torch.ones(4, 4, device=DEVICE).t()  # not contiguous: the plain multiply
    scale_gradients_((strided,), torch.tensor(3.0, device=DEVICE))
    assert torch.equal(strided, torch.full_like(strided, 3.0))
