"""The upstream-gradient rescale (flce.backends.triton.scale), in place and into new tensors,
through Triton's interpreter on CPU and natively on CUDA: one launch for every gradient of a call."""

import itertools

import pytest
import torch

from flce.backends.triton import availability
from flce.driver.scaling import scale_gradients_, scaled_gradients

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not availability(DEVICE)[0], reason=availability(DEVICE)[1] or "triton available")


def _scale(tensors, scale):
    from flce.backends.triton.scale import scale_unless_one_

    scale_unless_one_(tensors, torch.tensor(scale, device=DEVICE))


def _assert_scaled_once(actual, before, scale):
    # Rounded to nearest even as PyTorch rounds, under the interpreter too (whose own
    # fp32 -> bf16 cast truncates: the kernel rounds on the bits there).
    expected = (before.float() * scale).to(before.dtype)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=0, atol=0, equal_nan=True)


def _bits(values):
    return values.view({2: torch.int16, 4: torch.int32}[values.element_size()])


def _counted_launches(monkeypatch, kernel_name: str) -> list[int]:
    """The number of launches of ``scale.<kernel_name>`` made while the test runs."""
    from flce.backends.triton import scale

    count = [0]
    kernel = getattr(scale, kernel_name)

    class Counted:
        def __getitem__(self, grid):
            count[0] += 1
            return kernel[grid]

    monkeypatch.setattr(scale, kernel_name, Counted())
    return count


@pytest.fixture
def launches(monkeypatch):
    """The number of in-place scaling launches made while the test runs."""
    return _counted_launches(monkeypatch, "_scale_unless_one_kernel")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("n", [1, 4095, 4096, 10001])
def test_scales_in_fp32_and_rounds_once(dtype, n):
    values = torch.randn(n, device=DEVICE).to(dtype)
    before = values.clone()
    _scale([values], 2.7)
    _assert_scaled_once(values, before, 2.7)


# dX (N, H) and dW (V, H) in the input's dtype, db (V,) in the bias's: sizes that are not
# multiples of the block, one of them smaller than a block and one of several blocks, so
# that the programs of the launch cover tensors of different lengths.
_GRADIENTS = {
    "dx": ((3, 1367), torch.bfloat16),
    "dw": ((7, 1500), torch.bfloat16),
    "db": ((33,), torch.float32),
}
_SUBSETS = [c for r in range(1, 4) for c in itertools.combinations(_GRADIENTS, r)]


@pytest.mark.parametrize("names", _SUBSETS, ids="+".join)
@pytest.mark.parametrize("scale", [2.5, 1.0, float("nan")])
def test_every_subset_of_the_gradients_in_one_launch(names, scale, launches):
    gen = torch.Generator().manual_seed(len(names))
    tensors = [torch.randn(*_GRADIENTS[n][0], generator=gen).to(_GRADIENTS[n][1]).to(DEVICE) for n in names]
    tensors[0].view(-1)[5] = float("nan")  # a NaN gradient stays NaN, even under a scale of 1
    before = [t.clone() for t in tensors]
    _scale(tensors, scale)
    assert launches[0] == 1
    for actual, original in zip(tensors, before, strict=True):
        if scale == 1.0:  # untouched, bit for bit
            assert torch.equal(_bits(actual), _bits(original))
        elif scale != scale:
            assert actual.isnan().all()
        else:
            _assert_scaled_once(actual, original, scale)


def test_more_tensors_than_slots_take_one_launch_per_three(launches):
    tensors = [torch.ones(100 + i, device=DEVICE) for i in range(4)]
    _scale(tensors, 3.0)
    assert launches[0] == 2
    assert all(torch.equal(t, torch.full_like(t, 3.0)) for t in tensors)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -1.0])
def test_special_scales_are_applied(scale):
    values = torch.linspace(-3, 3, 301, device=DEVICE)
    expected = values * scale
    _scale([values], scale)
    torch.testing.assert_close(values, expected, equal_nan=True)


def test_rejects_non_contiguous_values_and_accepts_empty(launches):
    with pytest.raises(ValueError, match="contiguous"):
        _scale([torch.ones(3, device=DEVICE), torch.randn(4, 4, device=DEVICE).t()], 2.0)
    _scale([torch.empty(0, device=DEVICE)], 2.0)
    _scale([], 2.0)
    assert launches[0] == 0


def test_scale_gradients_skips_missing_ones_and_takes_a_device_scalar(launches):
    a = torch.ones(3, 4, device=DEVICE, dtype=torch.bfloat16)
    b = torch.ones(6, device=DEVICE)
    scale_gradients_((a, None, b), torch.tensor(0.5, device=DEVICE))
    assert torch.equal(a, torch.full_like(a, 0.5)) and torch.equal(b, torch.full_like(b, 0.5))
    assert launches[0] == 1
    strided = torch.ones(4, 4, device=DEVICE).t()  # not contiguous: the plain multiply
    c = torch.ones(5, device=DEVICE)
    scale_gradients_((strided, c), torch.tensor(3.0, device=DEVICE))
    assert torch.equal(strided, torch.full_like(strided, 3.0)) and torch.equal(c, torch.full_like(c, 3.0))
    assert launches[0] == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_fused_backward_scales_dx_dw_and_db_in_one_launch(dtype, launches):
    """Upstream gradient 1.5 (``flce.testing``): every gradient against float64."""
    from flce.testing import Case, run_case

    outcome = run_case(Case(dtype=dtype, bias=True), "triton", DEVICE)
    assert outcome.passed, outcome.failures
    assert launches[0] == 1


@pytest.fixture
def copy_launches(monkeypatch):
    """The number of out-of-place scaling launches made while the test runs."""
    return _counted_launches(monkeypatch, "_scaled_copies_kernel")


@pytest.mark.parametrize("names", _SUBSETS, ids="+".join)
@pytest.mark.parametrize("scale", [2.5, 1.0, float("nan")])
def test_scaled_copies_of_every_subset_in_one_launch(names, scale, copy_launches):
    """New tensors (the sources untouched), the product in fp32 rounded once, a scale of 1
    included (the copy is the pass), NaN kept."""
    from flce.backends.triton.scale import scaled_copies

    gen = torch.Generator().manual_seed(len(names))
    tensors = [torch.randn(*_GRADIENTS[n][0], generator=gen).to(_GRADIENTS[n][1]).to(DEVICE) for n in names]
    tensors[0].view(-1)[5] = float("nan")
    before = [t.clone() for t in tensors]
    copies = scaled_copies(tensors, torch.tensor(scale, device=DEVICE))
    assert copy_launches[0] == 1
    for copy, source, original in zip(copies, tensors, before, strict=True):
        assert torch.equal(_bits(source), _bits(original))
        assert copy.data_ptr() != source.data_ptr() and copy.shape == source.shape and copy.dtype == source.dtype
        if scale == 1.0:  # the same values (a NaN's payload may change: it is multiplied)
            torch.testing.assert_close(copy, original, rtol=0, atol=0, equal_nan=True)
        elif scale != scale:
            assert copy.isnan().all()
        else:
            _assert_scaled_once(copy, original, scale)


def test_scaled_copies_reject_non_contiguous_and_accept_empty(copy_launches):
    from flce.backends.triton.scale import scaled_copies

    with pytest.raises(ValueError, match="contiguous"):
        scaled_copies([torch.randn(4, 4, device=DEVICE).t()], torch.tensor(2.0))
    assert [t.shape for t in scaled_copies([torch.empty(0, 3, device=DEVICE)], torch.tensor(2.0))] == [(0, 3)]
    assert scaled_copies([], torch.tensor(2.0)) == []
    assert copy_launches[0] == 0


def test_scaled_gradients_in_one_launch_and_a_plain_product_for_the_rest(copy_launches):
    """The out-of-place scaling of ``flce.driver.scaling``: the contiguous gradients in one
    launch, a strided one by a plain product, None kept, nothing modified."""
    a = torch.ones(3, 4, device=DEVICE, dtype=torch.bfloat16)
    b = torch.ones(6, device=DEVICE)
    strided = torch.ones(4, 4, device=DEVICE).t()
    out = scaled_gradients((a, None, strided, b), torch.tensor(0.5, device=DEVICE))
    assert out[1] is None and copy_launches[0] == 1
    for scaled, source in zip((out[0], out[2], out[3]), (a, strided, b), strict=True):
        assert torch.equal(scaled, torch.full_like(source, 0.5)) and torch.equal(source, torch.ones_like(source))
