"""The Triton chunk CE kernel against the float64 reference and the PyTorch twin.

Runs on CPU through Triton's interpreter (set below, before Triton is imported, when
there is no GPU); the tests marked ``gpu`` need CUDA. Tolerances are tied to the error
of the PyTorch backend on the same inputs: ``err(triton) <= 3 * err(torch) + eps``,
both measured against float64, with ``eps`` a few fp32 ulps of the largest value.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must precede the first import of the kernel module: @triton.jit picks the
    # interpreter when the module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

if importlib.util.find_spec("numpy") is None:
    pytest.skip("numpy is not installed (Triton's interpreter needs it)", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed (pip install 'flce[triton]')")

if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not 1", allow_module_level=True)

import flce.backends.triton as triton_backend  # noqa: E402
from flce.backends.base import ChunkScalars  # noqa: E402
from flce.backends.torch.ce import cross_entropy_chunk as torch_chunk  # noqa: E402
from flce.backends.triton.ce import cross_entropy_chunk as triton_chunk  # noqa: E402
from flce.backends.triton.heuristics import CEKernelConfig, ce_kernel_config  # noqa: E402
from flce.reference import cross_entropy_reference  # noqa: E402

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
FP32_EPS = torch.finfo(torch.float32).eps

gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")

# Each entry turns on one feature of the contract, or several together. "scaled" uses
# mean-reduction-like grad scales that differ between the CE and the z-loss terms.
FEATURES = {
    "plain": {},
    "smoothing": dict(label_smoothing=0.1),
    "z_loss": dict(lse_square_scale=1e-2),
    # a cap of 5 on logits of scale ~4 puts z / c on both sides of the kernel's
    # tanh branch point (0.625) and well into saturation
    "softcap": dict(softcap=5.0),
    "weights": dict(weights=True),
    "token_scaling": dict(use_token_scaling=True),
    "row_grad_scale": dict(row_grad_scale=True),
    "weights+smoothing": dict(weights=True, label_smoothing=0.2),
    "scaled": dict(lse_square_scale=1e-3, ce_grad_scale=1 / 7, z_grad_scale=1 / 5),
    "all": dict(
        label_smoothing=0.1,
        lse_square_scale=1e-3,
        softcap=8.0,
        weights=True,
        use_token_scaling=True,
        row_grad_scale=True,
        ce_grad_scale=1 / 7,
        z_grad_scale=1 / 5,
    ),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Odd sizes, none a multiple of a block: 7 is one ragged block, 123 one block on CPU
# (several with the forced small blocks below), 1031 (prime) five blocks of 256 on CPU.
VOCABS = [7, 123, 1031]


def make_inputs(num_rows, vocab, dtype, *, seed, ignore_index=-100, ties=False, target_dtype=torch.int64):
    """Peaked logits (scale 4, or small integers with many exact ties), targets that
    hit the argmax on every other row, and two ignored rows."""
    g = torch.Generator().manual_seed(seed)
    if ties:
        logits = torch.randint(-3, 4, (num_rows, vocab), generator=g).float() * 2.0
    else:
        logits = torch.randn(num_rows, vocab, generator=g) * 4.0
    logits = logits.to(dtype)
    target = torch.randint(0, vocab, (num_rows,), generator=g)
    target[::2] = logits.float().argmax(dim=-1)[::2]
    target[1] = ignore_index
    target[num_rows - 2] = ignore_index
    weight = torch.rand(vocab, generator=g) + 0.5
    rgs = torch.rand(num_rows, generator=g) * 2.0 - 0.5  # signed, like an upstream gradient
    return logits.to(DEVICE), target.to(target_dtype).to(DEVICE), weight.to(DEVICE), rgs.to(DEVICE)


def make_scalars(vocab, weight, opts, ignore_index=-100):
    return ChunkScalars.from_numbers(
        device=DEVICE,
        ignore_index=ignore_index,
        label_smoothing=opts.get("label_smoothing", 0.0),
        lse_square_scale=opts.get("lse_square_scale", 0.0),
        softcap=opts.get("softcap"),
        use_token_scaling=opts.get("use_token_scaling", False),
        ce_grad_scale=opts.get("ce_grad_scale", 1.0),
        z_grad_scale=opts.get("z_grad_scale", 1.0),
        weight_sum=float(weight.double().sum()) if weight is not None else float(vocab),
    )


def run_chunk(kernel, logits, target, weight, scalars, rgs, *, compute_grad=True, **kwargs):
    """Runs one chunk kernel on a copy of ``logits``; outputs start as NaN / a sentinel
    so a row the kernel forgets to write cannot pass."""
    num_rows = logits.shape[0]
    buf = logits.clone()
    out = dict(
        loss=torch.full((num_rows,), float("nan"), device=DEVICE),
        z_loss=torch.full((num_rows,), float("nan"), device=DEVICE),
        correct=torch.full((num_rows,), float("nan"), device=DEVICE),
        predicted=torch.full((num_rows,), -7, dtype=torch.int64, device=DEVICE),
    )
    kernel(
        buf,
        target,
        weight,
        scalars,
        loss_out=out["loss"],
        z_loss_out=out["z_loss"],
        correct_out=out["correct"],
        predicted_out=out["predicted"],
        row_grad_scale=rgs,
        compute_grad=compute_grad,
        **kwargs,
    )
    out["grad"] = buf
    return out


def reference(logits, target, weight, scalars, rgs):
    """float64 loss, z-loss, accuracy, prediction, and the gradient of
    sum(rgs * (ce_grad_scale * ce + z_grad_scale * zl)) by autograd."""
    z = logits.double().detach().requires_grad_(True)
    ref = cross_entropy_reference(
        z,
        target,
        ce_weight=weight,
        ignore_index=scalars.ignore_index,
        lse_square_scale=scalars.lse_square_scale,
        label_smoothing=scalars.label_smoothing,
        reduction="none",
        softcap=scalars.softcap,
        use_token_scaling=scalars.use_token_scaling,
    )
    ce = ref.loss - ref.z_loss  # reduction="none" returns ce + zl
    upstream = rgs.double() if rgs is not None else torch.ones_like(ce)
    ((scalars.ce_grad_scale * ce + scalars.z_grad_scale * ref.z_loss) * upstream).sum().backward()
    return dict(
        loss=ce.detach(),
        z_loss=ref.z_loss.detach(),
        correct=ref.token_accuracy,
        predicted=ref.predicted_tokens,
        grad=z.grad,
    )


def max_err(x, ref):
    return (x.double() - ref.double()).abs().max().item()


def assert_matches(ours, twin, ref, name):
    """err(ours) <= 3 * err(torch) + eps against float64; eps is 4 fp32 ulps of the
    largest reference value (both kernels compute in fp32)."""
    eps = 4 * FP32_EPS * max(1.0, ref.double().abs().max().item())
    err_ours, err_torch = max_err(ours, ref), max_err(twin, ref)
    assert err_ours <= 3 * err_torch + eps, (
        f"{name}: triton err {err_ours:.3g} vs torch err {err_torch:.3g} (eps {eps:.3g})"
    )


def check_against_reference_and_twin(logits, target, weight, scalars, rgs, **kwargs):
    ours = run_chunk(triton_chunk, logits, target, weight, scalars, rgs, **kwargs)
    twin = run_chunk(torch_chunk, logits, target, weight, scalars, rgs)
    ref = reference(logits, target, weight, scalars, rgs)
    for name in ("loss", "z_loss", "grad"):
        assert not ours[name].isnan().any(), f"{name} has NaN (unwritten rows?)"
        assert_matches(ours[name], twin[name], ref[name], name)
    assert ours["grad"].dtype == logits.dtype
    # argmax is exact: the twin and the reference see the same z' order
    assert torch.equal(ours["predicted"].cpu(), ref["predicted"].cpu())
    assert torch.equal(ours["predicted"], twin["predicted"])
    assert torch.equal(ours["correct"].cpu().double(), ref["correct"].cpu())
    assert torch.equal(ours["correct"], twin["correct"])
    return ours


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_matches_reference_and_torch_backend(dtype, feature, vocab):
    opts = FEATURES[feature]
    logits, target, weight, rgs = make_inputs(12, vocab, dtype, seed=vocab * 31 + len(feature))
    weight = weight if opts.get("weights") else None
    rgs = rgs if opts.get("row_grad_scale") else None
    scalars = make_scalars(vocab, weight, opts)
    ours = check_against_reference_and_twin(logits, target, weight, scalars, rgs)
    ignored = target == scalars.ignore_index
    assert torch.all(ours["grad"][ignored] == 0)
    assert torch.all(ours["loss"][ignored] == 0) and torch.all(ours["predicted"][ignored] == -1)


@pytest.mark.parametrize("feature", ["plain", "all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_many_small_blocks(dtype, feature):
    """Forced blocks of 16 make the online softmax (and argmax) span eight steps."""
    opts = FEATURES[feature]
    logits, target, weight, rgs = make_inputs(10, 123, dtype, seed=5)
    weight = weight if opts.get("weights") else None
    rgs = rgs if opts.get("row_grad_scale") else None
    scalars = make_scalars(123, weight, opts)
    check_against_reference_and_twin(logits, target, weight, scalars, rgs, config=CEKernelConfig(16, 1))


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("block_v", [8, 256])
def test_argmax_ties_first_index_wins(block_v, softcap):
    """Small even integers give many exact ties for the max, within a block and (with
    blocks of 8) across blocks; the first index must win, as in torch.argmax."""
    logits, target, weight, rgs = make_inputs(16, 123, torch.bfloat16, seed=11, ties=True)
    scalars = make_scalars(123, None, dict(softcap=softcap))
    ours = check_against_reference_and_twin(logits, target, None, scalars, None, config=CEKernelConfig(block_v, 1))
    z = logits.float()
    n_max = (z == z.max(dim=-1, keepdim=True).values).sum(dim=-1)
    assert (n_max > 1).all(), "inputs should tie at the max on every row"
    assert ours["correct"][target != scalars.ignore_index].sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_ignore_index_is_a_real_class(dtype):
    """ignore_index = 3 is a valid class id: rows with target 3 are ignored, and 3 can
    still be predicted on other rows."""
    logits, target, weight, rgs = make_inputs(14, 7, dtype, seed=3, ignore_index=3)
    logits[4, 3] = 40.0  # row 4 predicts class 3 (its target is the argmax, so also 3 ...
    target[4] = 5  # ... unless overridden: a kept row whose prediction is the ignored id)
    scalars = make_scalars(7, weight, dict(label_smoothing=0.1, lse_square_scale=1e-3), ignore_index=3)
    ours = check_against_reference_and_twin(logits, target, weight, scalars, rgs)
    assert ours["predicted"][4].item() == 3
    ignored = target == 3
    assert ignored.sum() >= 2
    assert torch.all(ours["grad"][ignored] == 0) and torch.all(ours["predicted"][ignored] == -1)


@pytest.mark.parametrize("feature", ["plain", "all"])
def test_all_rows_ignored(feature):
    opts = FEATURES[feature]
    logits, target, weight, rgs = make_inputs(6, 123, torch.bfloat16, seed=2)
    target.fill_(-100)
    weight = weight if opts.get("weights") else None
    rgs = rgs if opts.get("row_grad_scale") else None
    # the driver passes zero grad scales when every row is ignored
    scalars = make_scalars(123, weight, {**opts, "ce_grad_scale": 0.0, "z_grad_scale": 0.0})
    ours = run_chunk(triton_chunk, logits, target, weight, scalars, rgs)
    assert torch.all(ours["grad"] == 0)
    assert torch.all(ours["loss"] == 0) and torch.all(ours["z_loss"] == 0) and torch.all(ours["correct"] == 0)
    assert torch.all(ours["predicted"] == -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_int32_targets(dtype):
    logits, target, weight, rgs = make_inputs(12, 123, dtype, seed=8, target_dtype=torch.int32)
    assert target.dtype == torch.int32
    scalars = make_scalars(123, weight, FEATURES["all"])
    check_against_reference_and_twin(logits, target, weight, scalars, rgs)


def test_row_stride_larger_than_vocab():
    """A (M, V) view into a wider buffer: the kernel uses stride(0) and leaves the
    columns beyond V alone."""
    logits, target, weight, rgs = make_inputs(9, 123, torch.bfloat16, seed=4)
    wide = torch.full((9, 131), 7.0, dtype=torch.bfloat16, device=DEVICE)
    wide[:, :123] = logits
    view = wide[:, :123]
    assert view.stride(0) == 131
    scalars = make_scalars(123, weight, dict(label_smoothing=0.1))
    loss = torch.empty(9, device=DEVICE)
    triton_chunk(
        view,
        target,
        weight,
        scalars,
        loss_out=loss,
        z_loss_out=None,
        correct_out=None,
        predicted_out=None,
        row_grad_scale=None,
        compute_grad=True,
    )
    twin = run_chunk(torch_chunk, logits, target, weight, scalars, None)
    torch.testing.assert_close(loss, twin["loss"])
    torch.testing.assert_close(view, twin["grad"])
    assert torch.all(wide[:, 123:] == 7.0)


def test_forward_only_leaves_logits_untouched_and_optional_outputs_absent():
    logits, target, weight, rgs = make_inputs(8, 123, torch.bfloat16, seed=6)
    scalars = make_scalars(123, None, dict(lse_square_scale=1e-2))
    buf = logits.clone()
    loss = torch.empty(8, device=DEVICE)
    triton_chunk(
        buf,
        target,
        None,
        scalars,
        loss_out=loss,
        z_loss_out=None,
        correct_out=None,
        predicted_out=None,
        row_grad_scale=None,
        compute_grad=False,
    )
    assert torch.equal(buf, logits)
    twin = run_chunk(torch_chunk, logits, target, None, scalars, None, compute_grad=False)
    torch.testing.assert_close(loss, twin["loss"])


def test_zero_rows_is_a_no_op():
    logits = torch.empty(0, 123, dtype=torch.bfloat16, device=DEVICE)
    target = torch.empty(0, dtype=torch.int64, device=DEVICE)
    loss = torch.empty(0, device=DEVICE)
    triton_chunk(
        logits,
        target,
        None,
        make_scalars(123, None, {}),
        loss_out=loss,
        z_loss_out=None,
        correct_out=None,
        predicted_out=None,
        row_grad_scale=None,
        compute_grad=True,
    )


def test_backend_spec_and_lazy_wrapper():
    spec = triton_backend.BACKEND
    assert spec.name == "triton" and spec.extra_bytes_per_logit == 0 and spec.auto_priority == 10
    logits, target, weight, rgs = make_inputs(6, 7, torch.float32, seed=9)
    scalars = make_scalars(7, None, {})
    via_spec = run_chunk(spec.cross_entropy_chunk, logits, target, None, scalars, None)
    direct = run_chunk(triton_chunk, logits, target, None, scalars, None)
    for name in ("loss", "grad", "predicted"):
        assert torch.equal(via_spec[name], direct[name])


def test_availability(monkeypatch):
    ok, why = triton_backend.availability(DEVICE)
    assert ok and why == ""
    ok, why = triton_backend.availability(torch.device("meta"))
    assert not ok and "meta" in why
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ok, why = triton_backend.availability(torch.device("cpu"))
    assert not ok and "TRITON_INTERPRET=1" in why


def test_availability_without_triton(monkeypatch):
    """A missing Triton makes the backend unavailable with an install hint; it never raises."""
    triton_backend._triton_import_error.cache_clear()
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    try:
        ok, why = triton_backend.availability(torch.device("cuda"))
        assert not ok and "triton is not installed" in why and "flce[triton]" in why
    finally:
        triton_backend._triton_import_error.cache_clear()


def test_heuristic_configs():
    for vocab in (1, 7, 1031, 32000, 128256, 262144):
        for device_type in ("cpu", "cuda"):
            cfg = ce_kernel_config(vocab, torch.bfloat16, device_type)
            assert cfg.block_v & (cfg.block_v - 1) == 0 and cfg.block_v >= 1
            assert cfg.block_v <= max(1, 2 * vocab)
    assert ce_kernel_config(128256, torch.bfloat16, "cuda") == CEKernelConfig(16384, 32)
    with pytest.raises(ValueError):
        CEKernelConfig(100, 4)


@gpu
@requires_cuda
@pytest.mark.parametrize("vocab", [32000, 128256, 151936])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_gpu_large_vocab(dtype, vocab):
    logits, target, weight, rgs = make_inputs(64, vocab, dtype, seed=vocab)
    scalars = make_scalars(vocab, weight, FEATURES["all"])
    check_against_reference_and_twin(logits, target, weight, scalars, rgs)
    scalars = make_scalars(vocab, None, FEATURES["plain"])
    check_against_reference_and_twin(logits, target, None, scalars, None)


@gpu
@requires_cuda
def test_gpu_row_offsets_beyond_int32():
    """M * V > 2^31: rows past the 32-bit range must be read and written correctly."""
    num_rows, vocab = 16400, 131072
    assert num_rows * vocab > 2**31
    g = torch.Generator(device=DEVICE).manual_seed(0)
    logits = (torch.randn(num_rows, vocab, device=DEVICE, generator=g) * 4.0).to(torch.bfloat16)
    target = torch.randint(0, vocab, (num_rows,), device=DEVICE, generator=g)
    tail = slice(num_rows - 8, num_rows)
    tail_logits = logits[tail].clone()
    scalars = make_scalars(vocab, None, {})
    loss = torch.empty(num_rows, device=DEVICE)
    triton_chunk(
        logits,
        target,
        None,
        scalars,
        loss_out=loss,
        z_loss_out=None,
        correct_out=None,
        predicted_out=None,
        row_grad_scale=None,
        compute_grad=True,
    )
    twin = run_chunk(torch_chunk, tail_logits, target[tail], None, scalars, None)
    torch.testing.assert_close(loss[tail], twin["loss"])
    torch.testing.assert_close(logits[tail], twin["grad"])


@pytest.mark.parametrize("feature", ["plain", "all"])
def test_gradient_into_grad_out_leaves_logits_untouched(feature):
    """With ``grad_out`` the kernel only reads the logits and writes the same gradient
    (bit for bit) that the in-place call leaves in them, into a buffer of its own stride."""
    opts = dict(label_smoothing=0.1, lse_square_scale=1e-2, softcap=20.0) if feature == "all" else {}
    logits, target, weight, rgs = make_inputs(9, 123, torch.bfloat16, seed=8)
    scalars = make_scalars(123, weight if feature == "all" else None, opts)
    ce_weight = weight if feature == "all" else None
    in_place = run_chunk(triton_chunk, logits, target, ce_weight, scalars, rgs)
    source = logits.clone()
    wide = torch.full((9, 131), 7.0, dtype=torch.bfloat16, device=DEVICE)
    out = run_chunk(triton_chunk, source, target, ce_weight, scalars, rgs, grad_out=wide[:, :123])
    assert torch.equal(out["grad"], source), "run_chunk's copy of the logits must stay unchanged"
    assert torch.equal(wide[:, :123], in_place["grad"])
    assert torch.all(wide[:, 123:] == 7.0)
    torch.testing.assert_close(out["loss"], in_place["loss"])
    with pytest.raises(ValueError, match="grad_out must match logits"):
        run_chunk(triton_chunk, source, target, None, scalars, None, grad_out=wide[:, :122])


# ------------------------------------------------------------------ layouts, ignored rows


def _interleaved(t: torch.Tensor, junk) -> torch.Tensor:
    """``t`` with ``junk`` after each element: ``[::2]`` gives ``t`` back as a strided view
    (a kernel reading ``ptr + row`` instead would pick the junk up)."""
    return torch.stack([t, torch.full_like(t, junk)], dim=1).flatten()


@pytest.mark.parametrize(
    "layout",
    ["target-sliced", "target-expanded", "target-int16", "weight-sliced", "row-scale-sliced", "row-scale-expanded"],
)
def test_strided_and_expanded_row_vectors_read_as_their_values(layout):
    """The kernel loads ``target_ptr + row``, ``weight_ptr + class`` and
    ``row_grad_scale_ptr + row``: the wrapper hands it contiguous copies of these small
    vectors, whatever their strides (a sliced target used to read the wrong rows, an
    expanded one past its storage)."""
    logits, target, weight, rgs = make_inputs(12, 37, torch.float32, seed=11)
    if layout == "target-expanded":
        target = target[:1].expand(12)
    scalars = make_scalars(37, weight, FEATURES["all"])
    strided = dict(target=target, weight=weight, rgs=rgs)
    if layout == "target-sliced":
        strided["target"] = _interleaved(target, 10**6)[::2]
    elif layout == "target-int16":
        strided["target"] = _interleaved(target.to(torch.int16), 30000)[::2]
    elif layout == "weight-sliced":
        strided["weight"] = _interleaved(weight, float("nan"))[::2]
    elif layout == "row-scale-sliced":
        strided["rgs"] = _interleaved(rgs, float("nan"))[::2]
    elif layout == "row-scale-expanded":
        rgs = rgs[:1].expand(12)
        strided["rgs"] = rgs
    ours = run_chunk(triton_chunk, logits, strided["target"], strided["weight"], scalars, strided["rgs"])
    contiguous = run_chunk(triton_chunk, logits, target.contiguous(), weight, scalars, rgs.contiguous())
    for name in ("loss", "z_loss", "correct", "predicted", "grad"):
        assert torch.equal(ours[name], contiguous[name]), name


@pytest.mark.parametrize("kernel", [triton_chunk, torch_chunk], ids=["triton", "torch"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_ignored_row_with_non_finite_logits_gets_an_exactly_zero_gradient(kernel, bad):
    """An ignored row contributes nothing its logits could poison: loss 0, predicted -1 and
    a gradient row of exact zeros (selected, never ``0 * NaN``), with token scaling and a
    per-row upstream gradient that are themselves non-finite on that row."""
    logits, target, weight, rgs = make_inputs(8, 37, torch.float32, seed=12)
    assert target[1] == -100
    logits[1] = bad
    logits[1, 5] = 1.0
    scalars = make_scalars(37, weight, FEATURES["all"])
    out = run_chunk(kernel, logits, target, weight, scalars, rgs)
    assert out["loss"][1] == 0 and out["z_loss"][1] == 0 and out["correct"][1] == 0 and out["predicted"][1] == -1
    assert torch.equal(out["grad"][1], torch.zeros_like(out["grad"][1]))
    clean = logits.clone()
    clean[1] = 0.0
    expected = run_chunk(kernel, clean, target, weight, scalars, rgs)
    for name in ("loss", "z_loss", "grad"):
        assert torch.equal(out[name], expected[name]), name


@pytest.mark.parametrize("kernel", [triton_chunk, torch_chunk], ids=["triton", "torch"])
def test_in_place_gradient_over_repeated_rows_is_refused(kernel):
    logits, target, weight, _ = make_inputs(6, 37, torch.float32, seed=13)
    repeated = logits[:1].expand(6, 37)  # six rows, one row of memory
    loss = torch.empty(6, device=DEVICE)
    kwargs = dict(loss_out=loss, z_loss_out=None, correct_out=None, predicted_out=None, row_grad_scale=None)
    scalars = make_scalars(37, None, {})
    with pytest.raises(ValueError, match="repeats one row"):
        kernel(repeated, target, None, scalars, compute_grad=True, **kwargs)
    # Read only (the gradient into a buffer of its own, or none), repeated rows are fine.
    grad = torch.empty(6, 37, device=DEVICE)
    kernel(repeated, target, None, scalars, compute_grad=True, grad_out=grad, **kwargs)
    twin = run_chunk(torch_chunk, repeated.contiguous(), target, None, scalars, None)
    torch.testing.assert_close(loss, twin["loss"])
    torch.testing.assert_close(grad, twin["grad"])


def test_strided_row_outputs_are_refused():
    logits, target, weight, _ = make_inputs(6, 37, torch.float32, seed=14)
    loss = torch.empty(12, device=DEVICE)[::2]
    with pytest.raises(ValueError, match="loss_out must be a contiguous"):
        triton_chunk(
            logits.clone(),
            target,
            None,
            make_scalars(37, None, {}),
            loss_out=loss,
            z_loss_out=None,
            correct_out=None,
            predicted_out=None,
            row_grad_scale=None,
            compute_grad=False,
        )


def test_split_row_kernels_read_strided_row_vectors_as_their_values():
    """``flce.backends.triton.partial``: the local target and the per-row statistics and
    coefficients, strided, give what their contiguous copies give."""
    from flce.backends.triton.partial import partial_gradient, partial_statistics

    logits, target, weight, rgs = make_inputs(10, 37, torch.float32, seed=15)
    local = torch.where(target >= 0, target, 37)
    stats = partial_statistics(logits, local, weight, 5.0, True, True)
    strided_stats = partial_statistics(logits, _interleaved(local, 10**6)[::2], weight, 5.0, True, True)
    for a, b in zip(stats, strided_stats, strict=True):
        assert torch.equal(a, b)
    row_max, row_sum = stats[0], stats[1]
    coefficients = (row_max, 1.0 / row_sum, rgs, rgs * 0.1, rgs * 0.01)
    grad_target = torch.where(target >= 0, target, -1)
    expected = logits.clone()
    partial_gradient(expected, grad_target, weight, *coefficients, weight.sum(), 5.0)
    ours = logits.clone()
    partial_gradient(
        ours,
        _interleaved(grad_target, 10**6)[::2],
        _interleaved(weight, float("nan"))[::2],
        *(_interleaved(c, float("nan"))[::2] for c in coefficients),
        weight.sum(),
        5.0,
    )
    assert torch.equal(ours, expected)
