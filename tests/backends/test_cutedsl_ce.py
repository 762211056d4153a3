"""The cutedsl chunk CE kernel against the float64 reference and the torch twin.

Each output passes when ``err(cutedsl) <= 3 * err(torch backend, same dtype) + eps``,
``err`` being the relative norm error against float64 (``flce.reference``), ``eps`` a
floor of a few fp32 roundings, so that outputs the torch twin computes (nearly)
exactly still leave room for a different summation order. Argmax outputs must match
the reference exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from flce.backends.base import ChunkScalars
from flce.backends.torch.ce import cross_entropy_chunk as torch_chunk
from flce.driver.sizing import logits_row_stride
from flce.reference import cross_entropy_reference
from flce.testing import relative_error
from tests.backends.cutedsl_gpu import DEVICE, DTYPES, EPS_FP32, EPS_GRAD, K, skip_module_without_cutedsl

skip_module_without_cutedsl("cutedsl kernel tests")

from flce.backends.cutedsl import ce as cute_ce  # noqa: E402  (imports cutlass)
from flce.backends.cutedsl import common as cutedsl_common  # noqa: E402

pytestmark = pytest.mark.gpu

FEATURES = {
    "plain": {},
    "smoothing": {"label_smoothing": 0.1},
    "z_loss": {"lse_square_scale": 1e-3, "z_loss_out": True},
    "softcap": {"softcap": 5.0},
    "weight": {"ce_weight": True},
    "weight_smoothing": {"ce_weight": True, "label_smoothing": 0.2},
    "token_scaling": {"use_token_scaling": True},
    "accuracy": {"correct_out": True, "predicted_out": True},
    "row_scale": {"row_grad_scale": True},
    "all": {
        "label_smoothing": 0.2,
        "lse_square_scale": 1e-3,
        "z_loss_out": True,
        "softcap": 5.0,
        "ce_weight": True,
        "use_token_scaling": True,
        "correct_out": True,
        "predicted_out": True,
        "row_grad_scale": True,
    },
    "no_grad": {
        "lse_square_scale": 1e-3,
        "z_loss_out": True,
        "correct_out": True,
        "predicted_out": True,
        "compute_grad": False,
    },
}


def make_logits(rows: int, vocab: int, dtype: torch.dtype, seed: int, ties: bool = False) -> torch.Tensor:
    """Logits of O(3) with one peak of +8 per row (a peaked softmax), never zeros; with
    ``ties`` the peak value is repeated at two or three columns."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 3.0
    peak = torch.randint(0, vocab, (rows,), generator=gen)
    z[torch.arange(rows), peak] += 8.0
    if ties and vocab > 1:
        top = z.max(dim=1).values + 1.0
        for r in range(rows):
            cols = torch.randperm(vocab, generator=gen)[: min(3, vocab) if r % 2 else 2]
            z[r, cols] = top[r]
    return z.to(dtype).to(DEVICE)


def make_target(
    logits: torch.Tensor, ignore_index: int, ignored_fraction: float, seed: int, dtype=torch.int64
) -> torch.Tensor:
    rows, vocab = logits.shape
    gen = torch.Generator().manual_seed(seed + 1)
    target = torch.randint(0, vocab, (rows,), generator=gen)
    # Some rows aim at their argmax, so "correct" is not always 0.
    hit = torch.rand(rows, generator=gen) < 0.3
    target[hit] = logits.float().argmax(dim=1).cpu()[hit]
    ignored = torch.rand(rows, generator=gen) < ignored_fraction
    target[ignored] = ignore_index
    return target.to(dtype).to(DEVICE)


# A finite padding that no gradient takes and that would win every max and argmax (and
# dominate every sum) of a row that read it.
PADDING = 1000.0


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor (NaN payloads included), to compare exactly."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def run_kernel(fn, logits, target, weight, scalars, opts, row_scale):
    """Runs one chunk kernel on a copy of ``logits``; outputs are poisoned first so an
    unwritten element fails the comparison."""
    rows = logits.shape[0]
    z = logits  # a fresh copy: overwritten in place
    out = {
        "loss": torch.full((rows,), math.nan, device=DEVICE),
        "z_loss": torch.full((rows,), math.nan, device=DEVICE) if opts.get("z_loss_out") else None,
        "correct": torch.full((rows,), math.nan, device=DEVICE) if opts.get("correct_out") else None,
        "predicted": torch.full((rows,), -7, dtype=torch.int64, device=DEVICE) if opts.get("predicted_out") else None,
    }
    fn(
        z,
        target,
        weight,
        scalars,
        loss_out=out["loss"],
        z_loss_out=out["z_loss"],
        correct_out=out["correct"],
        predicted_out=out["predicted"],
        row_grad_scale=row_scale,
        compute_grad=opts.get("compute_grad", True),
    )
    out["grad"] = z
    return out


def reference(logits, target, weight, scalars, row_scale):
    """float64 per-row outputs and the gradient of
    sum_r rgs_r * (ce_grad_scale * ce_r + z_grad_scale * zl_r) (token scale detached)."""
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
    ce = ref.loss - ref.z_loss
    rgs = torch.ones_like(ce) if row_scale is None else row_scale.double()
    total = (rgs * (scalars.ce_grad_scale * ce + scalars.z_grad_scale * ref.z_loss)).sum()
    (grad,) = torch.autograd.grad(total, z)
    return {
        "loss": ce.detach(),
        "z_loss": ref.z_loss.detach(),
        "correct": ref.token_accuracy,
        "predicted": ref.predicted_tokens,
        "grad": grad,
    }


def make_scalars(target, weight, vocab, opts, ignore_index) -> ChunkScalars:
    valid = target != ignore_index
    n_valid = int(valid.sum())
    if weight is not None:
        wsum_valid = float(weight[target[valid].long()].sum()) if n_valid else 0.0
        weight_sum = float(weight.sum())
    else:
        wsum_valid, weight_sum = float(n_valid), float(vocab)
    return ChunkScalars.from_numbers(
        device=DEVICE,
        ignore_index=ignore_index,
        label_smoothing=opts.get("label_smoothing", 0.0),
        lse_square_scale=opts.get("lse_square_scale", 0.0),
        softcap=opts.get("softcap"),
        use_token_scaling=opts.get("use_token_scaling", False),
        ce_grad_scale=1.0 / wsum_valid if wsum_valid > 0 else 0.0,  # reduction="mean"
        z_grad_scale=1.0 / n_valid if n_valid > 0 else 0.0,
        weight_sum=weight_sum,
    )


def check(
    rows: int,
    vocab: int,
    dtype: torch.dtype,
    feature: str,
    *,
    ignore_index: int = -100,
    ignored_fraction: float = 0.2,
    ties: bool = False,
    target_dtype=torch.int64,
    seed: int = 0,
    logits_view=None,
    config: cute_ce.KernelConfig | None = None,
    padding: float | None = None,
) -> None:
    """``padding``: the logits are rows ``logits_row_stride(V)`` elements apart (the driver's
    buffers), the columns past V holding this value; the kernel must neither use them (a
    NaN, an Inf or ``PADDING`` there would show in the outputs) nor write them (their bits
    must stay those of ``padding``)."""
    opts = FEATURES[feature]
    base = make_logits(rows, vocab, dtype, seed, ties=ties)
    view = logits_view or (lambda z: z)
    buffers = []
    if padding is not None:

        def view(z):
            buffer = torch.full((rows, logits_row_stride(vocab)), padding, dtype=dtype, device=DEVICE)
            buffer[:, :vocab] = z
            buffers.append(buffer)
            return buffer[:, :vocab]

    def fresh_logits():  # a new copy with the layout under test (strides, offset)
        return view(base.clone())

    logits = fresh_logits()
    target = make_target(logits, ignore_index, ignored_fraction, seed, dtype=target_dtype)
    gen = torch.Generator().manual_seed(seed + 2)
    weight = (torch.rand(vocab, generator=gen) + 0.5).to(DEVICE) if opts.get("ce_weight") else None
    row_scale = torch.randn(rows, generator=gen).to(DEVICE) if opts.get("row_grad_scale") else None
    scalars = make_scalars(target, weight, vocab, opts, ignore_index)

    def ours_fn(*args, **kwargs):
        cute_ce.cross_entropy_chunk(*args, config=config, **kwargs)

    ours = run_kernel(ours_fn, fresh_logits(), target, weight, scalars, opts, row_scale)
    if padding is not None:
        past_v = buffers[-1][:, vocab:]
        assert torch.equal(bits(past_v), bits(torch.full_like(past_v, padding))), "wrote past V"
    twin = run_kernel(torch_chunk, fresh_logits(), target, weight, scalars, opts, row_scale)
    truth = reference(logits, target, weight, scalars, row_scale)
    torch.cuda.synchronize()

    failures = []

    def judge(name, eps):
        e_ours, e_twin = relative_error(ours[name], truth[name]), relative_error(twin[name], truth[name])
        if not e_ours <= K * e_twin + eps:
            failures.append(f"{name}: err {e_ours:.3g} > {K:g} x torch {e_twin:.3g} + {eps:g}")

    judge("loss", EPS_FP32)
    if opts.get("z_loss_out"):
        judge("z_loss", EPS_FP32)
    if opts.get("correct_out"):
        if not torch.equal(ours["correct"].double(), truth["correct"]):
            failures.append("correct differs from the reference")
    if opts.get("predicted_out"):
        if not torch.equal(ours["predicted"], truth["predicted"]):
            bad = (ours["predicted"] != truth["predicted"]).nonzero().flatten()[:5].tolist()
            failures.append(f"predicted differs from the reference at rows {bad}")
    if opts.get("compute_grad", True):
        assert ours["grad"].dtype == dtype
        judge("grad", EPS_GRAD[dtype])
        valid = target != ignore_index
        if (~valid).any() and not (ours["grad"][~valid] == 0).all():
            failures.append("ignored rows have a non-zero gradient")
    elif not torch.equal(ours["grad"], logits):
        failures.append("logits changed although compute_grad=False")
    assert not failures, "; ".join(failures)


# Every feature on a prime vocabulary (no 16-byte vectors: the narrow paths) and on
# 32000 (16-byte cp.async; a 16-bit row held whole by one CTA, an fp32 row split over a
# cluster of CTAs).
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("vocab", [123, 32000])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_features(dtype, vocab, feature):
    check(64, vocab, dtype, feature)


# 7: fewer columns than a warp; 1031: prime, several tiles through the narrow path;
# 128256 (Llama 3) and 151936 (Qwen, whose slices do not fill their last 256-thread
# tile): rows split over 8-CTA clusters; without the gradient, one CTA streams the row.
@pytest.mark.parametrize("feature", ["plain", "all", "no_grad"])
@pytest.mark.parametrize("vocab", [7, 1031, 128256, 151936])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_vocab_sizes(dtype, vocab, feature):
    check(8 if vocab > 100000 else 48, vocab, dtype, feature)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ignore_index_is_a_real_class(dtype):
    check(64, 1031, dtype, "all", ignore_index=3, ignored_fraction=0.3)
    check(64, 32000, dtype, "all", ignore_index=0, ignored_fraction=0.3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", [123, 32000])
def test_all_rows_ignored(dtype, vocab):
    check(16, vocab, dtype, "all", ignored_fraction=1.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", [7, 123, 32000])
def test_argmax_ties_first_index(dtype, vocab):
    check(32, vocab, dtype, "accuracy", ties=True, ignored_fraction=0.0)


# torch.argmax's order with NaN: in one CTA of 8 warps (no gradient), on the default
# clusters with the gradient (8 CTAs in fp32, 4 in 16-bit) and on clusters of 2.
@pytest.mark.parametrize(
    "compute_grad, config",
    [(False, None), (True, None), (True, cute_ce.KernelConfig(threads=256, stages=4, resident=3, cluster=2))],
    ids=["one-cta", "default-cluster", "cluster-2"],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_predicted_tokens_of_rows_with_a_nan_follow_torch_argmax(dtype, compute_grad, config):
    """A NaN ranks above every number and the first NaN's column wins, whichever thread,
    warp or CTA of the cluster holds it; +inf ties keep the first column."""
    rows, vocab = 24, 40008
    logits = make_logits(rows, vocab, dtype, seed=3)
    logits[0, vocab - 1] = math.nan
    logits[1, [30011, 12345]] = math.nan
    logits[2, 3] = math.inf
    logits[2, 25000] = math.nan  # a NaN beats +inf in an earlier slice
    logits[3] = math.nan
    logits[4, [20000, 39000]] = math.inf
    logits[5, 0] = math.nan
    gen = torch.Generator().manual_seed(4)
    some = torch.arange(6, rows, 2)
    logits[some, torch.randint(0, vocab, (len(some),), generator=gen)] = math.nan
    target = make_target(logits, -100, 0.0, seed=3)
    opts = {"correct_out": True, "predicted_out": True, "compute_grad": compute_grad}
    scalars = make_scalars(target, None, vocab, opts, -100)

    def ours_fn(*args, **kwargs):
        cute_ce.cross_entropy_chunk(*args, config=config, **kwargs)

    out = run_kernel(ours_fn, logits.clone(), target, None, scalars, opts, None)
    want = logits.float().argmax(dim=1)  # the raw logits: their argmax has no rounding
    assert out["predicted"].tolist() == want.tolist()
    assert want[:6].tolist() == [vocab - 1, 12345, 25000, 0, 20000, 0]
    assert out["correct"].tolist() == (want == target).float().tolist()


@pytest.mark.parametrize("feature", ["plain", "all"])
def test_int32_target(feature):
    check(64, 32000, torch.bfloat16, feature, target_dtype=torch.int32)
    check(64, 123, torch.float32, feature, target_dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_and_misaligned_rows(dtype):
    # Row stride larger than V (a column slice of a wider buffer; +8 keeps 16-byte rows,
    # +3 does not), and a base address that is not 16-byte aligned.
    check(32, 32000, dtype, "all", logits_view=lambda z: torch.cat([z, z[:, :8]], dim=1)[:, :32000])
    check(32, 32000, dtype, "all", logits_view=lambda z: torch.cat([z, z[:, :3]], dim=1)[:, :32000])
    check(32, 32000, dtype, "all", logits_view=lambda z: torch.cat([z[:, :1], z], dim=1)[:, 1:])


# Rows padded to a multiple of 64 elements, as the driver allocates them: an odd V is read
# in 16-byte vectors whose last one is ragged (GPT-2's 50257 on clusters of CTAs in bf16,
# 32001 in fp32; 7 and 123 inside one vector or tile). What lies past V must change nothing
# and stay unwritten.
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("vocab", [7, 123, 32001, 50257])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_padded_rows_with_a_ragged_last_vector(dtype, vocab, feature):
    rows = 8 if vocab > 10000 else 40
    check(rows, vocab, dtype, feature, padding=PADDING)
    logits = make_logits(rows, logits_row_stride(vocab), dtype, 0)[:, :vocab]
    assert cute_ce.row_vector_width(logits) == 16 // logits.element_size()  # the ragged path ran


@pytest.mark.parametrize("padding", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("vocab", [123, 50257])
@pytest.mark.parametrize("feature", ["plain", "all"])
def test_non_finite_padding_is_never_used(feature, vocab, padding):
    check(8, vocab, torch.bfloat16, feature, padding=padding)


@pytest.mark.parametrize(
    "config",
    [
        cute_ce.KernelConfig(threads=256, stages=8, resident=0),
        cute_ce.KernelConfig(threads=128, stages=2, resident=5),
        cute_ce.KernelConfig(threads=256, stages=4, resident=3, cluster=2),
        cute_ce.KernelConfig(threads=128, stages=8, resident=0, cluster=8),
    ],
    ids=str,
)
def test_ragged_last_vector_in_every_launch_shape(config):
    """The ragged vector in the ring, in resident tiles and in re-read ones, and in the
    last CTA of a cluster."""
    check(8, 50257, torch.bfloat16, "all", config=config, padding=PADDING)


def test_one_row_and_empty_chunk():
    check(1, 32000, torch.bfloat16, "all", ignored_fraction=0.0)
    z = torch.empty(0, 100, device=DEVICE, dtype=torch.bfloat16)
    scalars = make_scalars(torch.empty(0, dtype=torch.int64), None, 100, {}, -100)
    cute_ce.cross_entropy_chunk(
        z,
        torch.empty(0, dtype=torch.int64, device=DEVICE),
        None,
        scalars,
        loss_out=torch.empty(0, device=DEVICE),
        z_loss_out=None,
        correct_out=None,
        predicted_out=None,
        row_grad_scale=None,
        compute_grad=True,
    )


# Launch shapes other than the heuristic's: one CTA per row with no resident tiles
# (every tile re-read), with many, a 2-stage ring, 128/512 threads; clusters of 2/4/8
# CTAs per row with the slice partly resident (ring inside the slice) or not at all.
@pytest.mark.parametrize(
    "config",
    [
        cute_ce.KernelConfig(threads=256, stages=8, resident=0),
        cute_ce.KernelConfig(threads=256, stages=4, resident=40),
        cute_ce.KernelConfig(threads=128, stages=2, resident=5),
        cute_ce.KernelConfig(threads=512, stages=8, resident=3),
        cute_ce.KernelConfig(threads=256, stages=8, resident=19, cluster=1),
        cute_ce.KernelConfig(threads=256, stages=4, resident=3, cluster=2),
        cute_ce.KernelConfig(threads=256, stages=8, resident=16, cluster=4),
        cute_ce.KernelConfig(threads=128, stages=8, resident=0, cluster=8),
    ],
    ids=str,
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_launch_configs(dtype, config):
    check(8, 128256, dtype, "all", config=config)


# Row slices of unequal length (the vector count does not divide by the cluster), and
# more cluster CTAs than the row has tiles (some slices empty).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cluster_uneven_and_empty_slices(dtype):
    check(16, 40008, dtype, "all", config=cute_ce.KernelConfig(threads=128, stages=4, resident=4, cluster=4))
    check(16, 40008, dtype, "all", config=cute_ce.KernelConfig(threads=256, stages=2, resident=40, cluster=2))
    check(16, 48, dtype, "all", config=cute_ce.KernelConfig(threads=32, stages=2, resident=1, cluster=8))


def test_compile_cache_is_reused_across_row_counts():
    check(5, 32000, torch.bfloat16, "plain")
    n = len(cutedsl_common._COMPILED)
    check(77, 32000, torch.bfloat16, "plain", seed=1)
    assert len(cutedsl_common._COMPILED) == n


def test_backend_registration():
    from flce.backends.cutedsl import BACKEND

    assert BACKEND.name == "cutedsl" and BACKEND.extra_bytes_per_logit == 0
    assert BACKEND.availability(torch.device("cpu"))[0] is False
    assert BACKEND.availability(DEVICE) == (True, "")


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("feature", ["plain", "all"])
def test_gradient_into_grad_out_leaves_logits_untouched(dtype, feature, offset):
    """With ``grad_out`` (a view of a wider buffer) the logits are only read. Aligned, the
    gradient is bit for bit the one the in-place call leaves in the logits; misaligned by
    one element, the vector width drops to the narrower layout's (another compiled
    variant, whose sums may round differently in the last place)."""
    opts = FEATURES[feature]
    vocab, rows = 32000, 16
    logits = make_logits(rows, vocab, dtype, 3)
    target = make_target(logits, -100, 0.2, 3)
    gen = torch.Generator().manual_seed(5)
    weight = (torch.rand(vocab, generator=gen) + 0.5).to(DEVICE) if opts.get("ce_weight") else None
    scalars = make_scalars(target, weight, vocab, opts, -100)
    kwargs = dict(z_loss_out=None, correct_out=None, predicted_out=None, row_grad_scale=None, compute_grad=True)
    in_place = logits.clone()
    loss_in_place = torch.empty(rows, device=DEVICE)
    cute_ce.cross_entropy_chunk(in_place, target, weight, scalars, loss_out=loss_in_place, **kwargs)
    source = logits.clone()
    # Rows of vocab + 8 elements keep every 16-byte vector aligned at offset 0.
    wide = torch.full((rows, vocab + 8), 7.0, dtype=dtype, device=DEVICE)
    grad_out = wide[:, offset : vocab + offset]
    loss = torch.empty(rows, device=DEVICE)
    cute_ce.cross_entropy_chunk(source, target, weight, scalars, loss_out=loss, grad_out=grad_out, **kwargs)
    torch.cuda.synchronize()
    assert torch.equal(source, logits), "the logits must only be read"
    assert torch.all(wide[:, :offset] == 7.0) and torch.all(wide[:, vocab + offset :] == 7.0)
    if offset == 0:
        assert torch.equal(grad_out, in_place)
        assert torch.equal(loss, loss_in_place)
    else:
        torch.testing.assert_close(grad_out, in_place)
        torch.testing.assert_close(loss, loss_in_place)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ragged_gradient_into_grad_out(dtype):
    """Padded rows of an odd V with ``grad_out`` in another padded buffer: the same
    gradient as in place, bit for bit, and neither buffer touched past V."""
    vocab, rows, stride = 50257, 8, 50304
    logits = make_logits(rows, vocab, dtype, 4)
    target = make_target(logits, -100, 0.2, 4)
    scalars = make_scalars(target, None, vocab, FEATURES["all"], -100)
    kwargs = dict(z_loss_out=None, correct_out=None, predicted_out=None, row_grad_scale=None, compute_grad=True)

    def padded(fill):
        buffer = torch.full((rows, stride), fill, dtype=dtype, device=DEVICE)
        buffer[:, :vocab] = logits
        return buffer

    in_place = padded(math.nan)
    loss_in_place = torch.empty(rows, device=DEVICE)
    cute_ce.cross_entropy_chunk(in_place[:, :vocab], target, None, scalars, loss_out=loss_in_place, **kwargs)
    source, destination = padded(math.nan), torch.full((rows, stride), 7.0, dtype=dtype, device=DEVICE)
    loss = torch.empty(rows, device=DEVICE)
    cute_ce.cross_entropy_chunk(
        source[:, :vocab], target, None, scalars, loss_out=loss, grad_out=destination[:, :vocab], **kwargs
    )
    torch.cuda.synchronize()
    assert cute_ce.row_vector_width(source[:, :vocab]) == 16 // source.element_size()
    assert torch.equal(source[:, :vocab], logits), "the logits must only be read"
    assert torch.isnan(source[:, vocab:]).all() and torch.isnan(in_place[:, vocab:]).all()
    assert torch.all(destination[:, vocab:] == 7.0)
    assert torch.equal(destination[:, :vocab], in_place[:, :vocab]) and torch.equal(loss, loss_in_place)


_LAUNCH_MODE_SCRIPT = """
import sys, torch, flce
from flce.backends.cutedsl import common
gen = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(64, 128, generator=gen, device="cuda").bfloat16().requires_grad_()
w = torch.randn(1000, 128, generator=gen, device="cuda").bfloat16().requires_grad_()
y = torch.randint(0, 1000, (64,), generator=gen, device="cuda")
loss = flce.fused_linear_cross_entropy(x, w, y, backend="cutedsl", label_smoothing=0.1, softcap=20.0)
loss.backward()
with torch.no_grad():
    loss_only = flce.fused_linear_cross_entropy(x, w, y, backend="cutedsl")
torch.save({"tvm_ffi": common.TVM_FFI_CALLS, "loss": loss.detach().cpu(), "loss_only": loss_only.cpu(),
            "dx": x.grad.cpu(), "dw": w.grad.cpu()}, sys.argv[1])
"""


def test_launch_entry_points_agree(tmp_path):
    """The DSL's own entry point (``FLCE_CUTEDSL_TVM_FFI=0``) and the default one (TVM FFI
    where it is installed) launch the same kernels with the same arguments: bit-identical
    losses and gradients, on the chunked route and the fused loss-only GEMM. Each mode runs
    in its own process (the mode is decided at import)."""
    import os
    import subprocess
    import sys

    results = {}
    for mode in ("0", "1"):
        path = tmp_path / f"mode{mode}.pt"
        env = {**os.environ, cutedsl_common.TVM_FFI_ENV_VAR: mode}
        subprocess.run([sys.executable, "-c", _LAUNCH_MODE_SCRIPT, str(path)], env=env, check=True)
        results[mode] = torch.load(path)
    assert results["0"]["tvm_ffi"] is False
    assert results["1"]["tvm_ffi"] is cutedsl_common.TVM_FFI_CALLS
    for name in ("loss", "loss_only", "dx", "dw"):
        assert torch.equal(results["0"][name], results["1"][name]), name
