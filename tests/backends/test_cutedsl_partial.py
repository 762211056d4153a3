"""The cutedsl split-row kernels (``flce.backends.cutedsl.partial``) against the torch
split-row kernels (``flce.backends.torch.partial.TorchSplitRowKernels``) and float64 math.

A block of ``V_r`` columns is cut out of a longer row (so the whole row's max and sum,
which the gradient takes, differ from the block's own). Each fp32 output and the gradient
pass when ``err(cutedsl) <= 3 * err(torch kernels, same dtype) + eps``, ``err`` being the
relative norm error against float64 and ``eps`` a floor of a few roundings (as in
``test_cutedsl_ce.py``), so that outputs the torch kernels get (nearly) exact still leave
room for a different summation order. The argmax must match float64 exactly (first index
among ties); ignored rows must get an exactly zero gradient.
"""

from __future__ import annotations

import math

import pytest
import torch

from flce.backends.base import ChunkScalars
from flce.backends.torch.partial import TorchSplitRowKernels
from flce.dispatch import get_backend, split_row_kernels
from flce.driver.sizing import logits_row_stride
from tests.backends.cutedsl_gpu import DEVICE, DTYPES, EPS_FP32, EPS_GRAD, K, skip_module_without_cutedsl

skip_module_without_cutedsl("cutedsl split-row kernel tests")

from flce.backends.cutedsl import common as cutedsl_common  # noqa: E402
from flce.backends.cutedsl import partial as cute_partial  # noqa: E402  (imports cutlass)

pytestmark = pytest.mark.gpu

SOFTCAP = 5.0
# Past a padded block's columns: finite, never a gradient's value, and it would win every
# max and argmax (and dominate every sum) of a row that read it.
PADDING = 1000.0
LS = 0.2
Z_SCALE = 1e-3

FEATURES = {
    "plain": {},
    "smoothing": {"smoothing": True},
    "softcap": {"softcap": True},
    "weight_smoothing": {"weight": True, "smoothing": True},
    "weight": {"weight": True},  # weights without smoothing: only w_y, no weighted sum
    "z_loss": {"z_loss": True},
    "argmax": {"argmax": True},
    "all": {"weight": True, "smoothing": True, "softcap": True, "z_loss": True, "argmax": True},
}


def abs_err(value: torch.Tensor, truth: torch.Tensor) -> float:
    """Norm of the error (inf if anything is not finite)."""
    value = value.double()
    if not torch.isfinite(value).all():
        return math.inf
    return (value - truth.double()).norm().item()


def rel_err(value: torch.Tensor, truth: torch.Tensor) -> float:
    """Norm of the error relative to the norm of the truth (absolute where that is 0)."""
    scale = truth.double().norm().item()
    diff = abs_err(value, truth)
    return diff / scale if scale > 0 else diff


class Block:
    """Rows of ``v0 + V_r + tail`` columns, the block ``[v0, v0 + V_r)`` of which the
    kernels see, with targets anywhere in the row (owned by the block or not) or ignored."""

    def __init__(
        self,
        rows: int,
        vocab: int,
        dtype: torch.dtype,
        feature: str,
        *,
        seed: int = 0,
        ties: bool = False,
        view: bool = False,
        padded: bool = False,
        ignored_fraction: float = 0.2,
        target_dtype=torch.int64,
    ):
        opts = FEATURES[feature]
        gen = torch.Generator().manual_seed(seed)
        self.dtype, self.vocab, self.opts = dtype, vocab, opts
        self.v0 = 3
        self.total = self.v0 + vocab + 5
        # Logits of O(3) with one peak of +8 per row, never zeros; with ``ties`` the row's
        # max is repeated at two or three columns of the block.
        z = torch.randn(rows, self.total, generator=gen, dtype=torch.float64) * 3.0
        z[torch.arange(rows), torch.randint(0, self.total, (rows,), generator=gen)] += 8.0
        if ties:
            top = z.max(dim=1).values + 1.0
            for r in range(rows):
                cols = self.v0 + torch.randperm(vocab, generator=gen)[: min(3, vocab) if r % 2 else min(2, vocab)]
                z[r, cols] = top[r]
        full = z.to(dtype).to(DEVICE)  # (rows, total)
        self.full = full
        self._view = view
        self._padded = padded
        self.buffers: list[torch.Tensor] = []  # the padded buffers handed out, in order
        # Targets: a third inside the block, the rest anywhere in the row; some ignored.
        target = torch.randint(0, self.total, (rows,), generator=gen)
        inside = torch.rand(rows, generator=gen) < 0.35
        target[inside] = self.v0 + torch.randint(0, vocab, (int(inside.sum()),), generator=gen)
        valid = torch.rand(rows, generator=gen) >= ignored_fraction
        self.valid = valid.to(DEVICE)
        self.target = target.to(DEVICE)  # (rows,) global; meaningful where valid
        local = self.target - self.v0
        self.owned = self.valid & (local >= 0) & (local < vocab)
        # Statistics: the caller's "not owned" is V_r, but any value outside [0, V_r) must do:
        # odd rows keep their raw (possibly negative) local index instead.
        odd = (torch.arange(rows, device=DEVICE) % 2) == 1
        not_owned = torch.where(odd & self.valid, local, torch.full_like(local, vocab))
        self.stats_target = torch.where(self.owned, local, not_owned).to(target_dtype)
        self.grad_target = torch.where(self.owned, local, torch.where(self.valid, vocab, -1)).to(target_dtype)
        self.ce_full = (torch.rand(self.total, generator=gen) + 0.5).to(DEVICE) if opts.get("weight") else None
        self.row_scale = (torch.randn(rows, generator=gen).to(DEVICE) * self.valid).float()

    def block(self) -> torch.Tensor:
        """A fresh (rows, V_r) block: a strided, unaligned view of the full rows, a view of
        rows ``logits_row_stride(V_r)`` apart, ``PADDING`` past V_r (the driver's buffers; kept
        in ``buffers``), or a contiguous copy."""
        sl = self.full.clone()[:, self.v0 : self.v0 + self.vocab]
        if self._padded:
            buffer = torch.full((sl.shape[0], logits_row_stride(self.vocab)), PADDING, dtype=self.dtype, device=DEVICE)
            buffer[:, : self.vocab] = sl
            self.buffers.append(buffer)
            return buffer[:, : self.vocab]
        return sl if self._view else sl.contiguous()

    def padding_is_untouched(self, buffer: torch.Tensor) -> bool:
        return bool((buffer[:, self.vocab :] == PADDING).all())

    @property
    def ce_local(self) -> torch.Tensor | None:
        return None if self.ce_full is None else self.ce_full[self.v0 : self.v0 + self.vocab]

    @property
    def softcap(self) -> float | None:
        return SOFTCAP if self.opts.get("softcap") else None

    def z64(self, logits: torch.Tensor) -> torch.Tensor:
        """z' in float64."""
        z = logits.double()
        return SOFTCAP * torch.tanh(z / SOFTCAP) if self.softcap else z


# ------------------------------------------------------------------------------ statistics


def check_statistics(b: Block) -> None:
    smoothing, argmax = bool(b.opts.get("smoothing")), bool(b.opts.get("argmax"))
    outs = {}
    for name, kernels in (("ours", get_backend("cutedsl").split_rows()), ("torch", TorchSplitRowKernels())):
        logits = b.block()
        before = logits.clone()
        target = b.stats_target if name == "ours" else b.stats_target.long()  # torch gathers need int64
        outs[name] = kernels.statistics(
            logits, target, b.ce_local, b.softcap, with_smoothing=smoothing, with_argmax=argmax
        )
        assert torch.equal(logits, before), f"{name}: the statistics changed the logits"
    torch.cuda.synchronize()
    ours, twin = outs["ours"], outs["torch"]

    z = b.z64(b.block())  # (rows, V_r) float64
    m = z.max(dim=1).values
    shifted = z - m[:, None]
    local = b.stats_target.long()
    owned = (local >= 0) & (local < b.vocab)
    truth = {
        "row_max": m,
        "row_sum": shifted.exp().sum(dim=1),
        # The torch kernels leave unowned rows unspecified; compare where owned only.
        "target_shifted": torch.where(owned, shifted.gather(1, torch.where(owned, local, 0)[:, None]).squeeze(1), 0.0),
    }
    # Relative errors are taken against the size of the terms each output is formed from:
    # the smoothing sum, sum_i w_i z'_i - m sum_i w_i, cancels (to exactly 0 for V_r = 1),
    # so its rounding floor scales with |sum_i w_i z'_i| + |m| sum_i w_i, not with the result.
    scales = {name: want.norm().item() for name, want in truth.items()}
    if smoothing:
        w = b.ce_local.double() if b.ce_local is not None else torch.ones(b.vocab, dtype=torch.float64, device=DEVICE)
        truth["smooth_shifted"] = shifted @ w
        scales["smooth_shifted"] = ((z.abs() @ w) + m.abs() * w.sum()).norm().item()
    failures = []
    for name, want in truth.items():
        got, ref = getattr(ours, name), getattr(twin, name)
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        if name == "target_shifted":
            # The contract: 0 where the block does not own the target.
            if not (got[~owned] == 0).all():
                failures.append("target_shifted is not 0 where the target is not owned")
            got, ref = got * owned, ref * owned
        e_ours, e_twin = abs_err(got, want), abs_err(ref, want)
        allowed = K * e_twin + EPS_FP32 * scales[name]
        if not e_ours <= allowed:
            failures.append(
                f"{name}: err {e_ours:.3g} > {K:g} x torch {e_twin:.3g} + {EPS_FP32:g} x {scales[name]:.3g}"
            )
    if not smoothing:
        assert ours.smooth_shifted is None
    if argmax:
        assert ours.argmax.dtype == torch.int64
        want = z.argmax(dim=1)  # first index of the max of z'
        bad = ours.argmax != want
        if b.softcap:
            # fp32 z' may round an earlier column within an ulp of the max onto the max
            # itself: a tie in the kernel's arithmetic, whose first index is then correct.
            got = ours.argmax.clamp(0, b.vocab - 1)
            gap = m - z.gather(1, got[:, None]).squeeze(1)
            bad &= ~((ours.argmax < want) & (gap <= 4 * 2.0**-24 * m.abs()))
        if bad.any():
            failures.append(f"argmax differs from float64 at rows {bad.nonzero().flatten()[:5].tolist()}")
    else:
        assert ours.argmax is None
    assert not failures, "; ".join(failures)


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("vocab", [1, 7, 1000, 32000, 50257])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_statistics(dtype, vocab, feature):
    check_statistics(Block(8 if vocab > 10000 else 48, vocab, dtype, feature, seed=vocab))


@pytest.mark.parametrize("vocab", [7, 1000, 32000])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_statistics_argmax_ties_first_index(dtype, vocab):
    check_statistics(Block(32, vocab, dtype, "argmax", ties=True, ignored_fraction=0.0, seed=1))
    check_statistics(Block(32, vocab, dtype, "all", ties=True, ignored_fraction=0.0, seed=2))


@pytest.mark.parametrize("softcap", [None, SOFTCAP], ids=["plain", "softcap"])
@pytest.mark.parametrize("vocab", [7, 1000, 32000])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_statistics_argmax_of_rows_with_a_nan_follows_torch_argmax(dtype, vocab, softcap):
    """torch.argmax ranks a NaN above every number: a block holding a NaN gives its first
    NaN's column and a NaN max (what the combination of blocks looks for:
    flce.rows.cross_entropy.combine_blocks), as the torch twin does, whichever vector,
    thread or warp holds it (V = 32000: 8 warps); a row of +inf ties without a NaN keeps
    the first +inf."""
    gen = torch.Generator().manual_seed(vocab)
    rows = 24
    z = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 3.0
    z[0, vocab - 1] = math.nan  # the last column (the ragged vector's, with V = 7)
    z[1, [(2 * vocab) // 3, vocab // 3]] = math.nan  # two NaNs: the first one wins
    z[2, 0] = math.inf
    z[2, vocab - 1] = math.nan  # a NaN beats +inf
    z[3] = math.nan
    z[4, [vocab // 2, vocab - 1]] = math.inf  # +inf ties, no NaN
    z[5, 0] = math.nan
    some = torch.arange(6, rows, 2)
    z[some, torch.randint(0, vocab, (len(some),), generator=gen)] = math.nan  # one NaN anywhere
    logits = z.to(dtype).to(DEVICE)
    has_nan = logits.isnan().any(dim=1)
    decided = has_nan.clone()
    decided[4] = True  # rows whose argmax no rounding can change
    target = torch.full((rows,), vocab, dtype=torch.int64, device=DEVICE)  # owned by no block
    outs = {}
    for name, kernels in (("ours", get_backend("cutedsl").split_rows()), ("torch", TorchSplitRowKernels())):
        outs[name] = kernels.statistics(logits.clone(), target, None, softcap, with_smoothing=False, with_argmax=True)
    ours, twin = outs["ours"], outs["torch"]
    assert ours.row_max.isnan().tolist() == has_nan.tolist()
    assert ours.argmax[decided].tolist() == logits.float().argmax(dim=1)[decided].tolist()
    assert ours.argmax[decided].tolist() == twin.argmax[decided].tolist()
    assert twin.row_max.isnan().tolist() == has_nan.tolist()


# -------------------------------------------------------------------------------- gradient


def scalars_for(b: Block) -> tuple[ChunkScalars, float]:
    n_valid = int(b.valid.sum())
    if b.ce_full is not None:
        wsum_valid = float(b.ce_full[b.target[b.valid]].sum()) if n_valid else 0.0
        weight_sum = float(b.ce_full.sum())
    else:
        wsum_valid, weight_sum = float(n_valid), float(b.total)
    ls = LS if b.opts.get("smoothing") else 0.0
    scalars = ChunkScalars.from_numbers(
        device=DEVICE,
        ignore_index=-100,
        label_smoothing=ls,
        lse_square_scale=Z_SCALE if b.opts.get("z_loss") else 0.0,
        softcap=b.softcap,
        use_token_scaling=False,
        ce_grad_scale=1.0 / wsum_valid if wsum_valid > 0 else 0.0,
        z_grad_scale=1.0 / n_valid if n_valid > 0 else 0.0,
        weight_sum=weight_sum,
    )
    return scalars, ls / b.total


def check_gradient(b: Block) -> None:
    scalars, eps = scalars_for(b)
    # The whole row's statistics (over all `total` columns), as fp32 inputs of both kernels.
    z_full = b.z64(b.full)
    row_max = z_full.max(dim=1).values.float()
    row_sum = (z_full - row_max.double()[:, None]).exp().sum(dim=1)
    inv_sum = (1.0 / row_sum).float()
    lse = (row_max.double() + row_sum.log()).float()
    safe_target = torch.where(b.valid, b.target, 0)
    w_y = b.ce_full[safe_target] if b.ce_full is not None else torch.ones_like(lse)

    grads = {}
    for name, kernels in (("ours", get_backend("cutedsl").split_rows()), ("torch", TorchSplitRowKernels())):
        logits = b.block()
        target = b.grad_target if name == "ours" else b.grad_target.long()
        kernels.gradient(logits, target, b.ce_local, row_max, inv_sum, w_y, lse, b.row_scale, scalars, eps)
        grads[name] = logits
        if name == "ours" and b.buffers:
            assert b.padding_is_untouched(b.buffers[-1]), "the gradient was written past the block's columns"
    torch.cuda.synchronize()

    # float64, with the same fp32 row inputs: the grouped form of flce.backends.base.
    z = b.z64(b.block())
    p = (z - row_max.double()[:, None]).exp() * inv_sum.double()[:, None]
    local = b.grad_target.long()
    owned = (local >= 0) & (local < b.vocab)
    rs = b.row_scale.double()
    onehot = torch.zeros_like(p)
    onehot[owned, local[owned]] = 1.0
    g = (rs * scalars.ce_grad_scale * (1.0 - scalars.label_smoothing) * w_y.double())[:, None] * (p - onehot)
    if eps > 0:
        w = b.ce_local.double()[None, :] if b.ce_local is not None else 1.0
        g = g + (rs * scalars.ce_grad_scale * eps)[:, None] * (scalars.weight_sum * p - w)
    if scalars.lse_square_scale > 0:
        g = g + (rs * scalars.z_grad_scale * 2.0 * scalars.lse_square_scale * lse.double())[:, None] * p
    if b.softcap:
        g = g * (1.0 - torch.tanh(b.block().double() / SOFTCAP) ** 2)
    g = g * (local >= 0)[:, None]

    ours = grads["ours"]
    assert ours.dtype == b.dtype and ours.shape == (b.full.shape[0], b.vocab)
    failures = []
    e_ours, e_twin = rel_err(ours, g), rel_err(grads["torch"], g)
    if not e_ours <= K * e_twin + EPS_GRAD[b.dtype]:
        failures.append(f"grad: err {e_ours:.3g} > {K:g} x torch {e_twin:.3g} + {EPS_GRAD[b.dtype]:g}")
    ignored = local < 0
    if ignored.any() and not (ours[ignored] == 0).all():
        failures.append("ignored rows have a non-zero gradient")
    assert not failures, "; ".join(failures)


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("vocab", [1, 7, 1000, 32000, 50257])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gradient(dtype, vocab, feature):
    check_gradient(Block(8 if vocab > 10000 else 48, vocab, dtype, feature, seed=vocab + 1))


# ----------------------------------------------------------------------- layouts and edges


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", [1000, 32000])
def test_strided_unaligned_block(dtype, vocab):
    # The block as a view of the full rows: row stride V_r + 8, base address 3 elements in.
    b = Block(16, vocab, dtype, "all", view=True, seed=5)
    check_statistics(b)
    check_gradient(b)


# Rows padded to a multiple of 64 columns (``PADDING`` past V_r), as the driver allocates
# them: an odd V_r is read in 16-byte vectors, the last one ragged, and nothing past V_r is
# used or written.
@pytest.mark.parametrize("feature", ["plain", "all", "weight_smoothing", "argmax"])
@pytest.mark.parametrize("vocab", [1, 7, 1001, 50257])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_padded_rows_with_a_ragged_last_vector(dtype, vocab, feature):
    b = Block(8 if vocab > 10000 else 40, vocab, dtype, feature, padded=True, seed=vocab + 9)
    check_statistics(b)
    check_gradient(b)
    padded = b.block()
    assert cute_partial.row_vector_width(padded) == 16 // padded.element_size()


@pytest.mark.parametrize("feature", ["plain", "all"])
def test_int32_targets(feature):
    b = Block(32, 1000, torch.bfloat16, feature, target_dtype=torch.int32, seed=6)
    check_statistics(b)
    check_gradient(b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_all_rows_ignored_or_unowned(dtype):
    check_gradient(Block(16, 1000, dtype, "all", ignored_fraction=1.0, seed=7))
    b = Block(16, 1000, dtype, "all", ignored_fraction=0.0, seed=8)
    b.owned[:] = False
    b.stats_target = torch.full_like(b.stats_target, b.vocab)
    b.grad_target = torch.full_like(b.grad_target, b.vocab)
    check_statistics(b)
    check_gradient(b)


def test_empty_rows_and_the_returned_tensors():
    logits = torch.empty(0, 100, device=DEVICE, dtype=torch.bfloat16)
    target = torch.empty(0, dtype=torch.int64, device=DEVICE)
    out = cute_partial.partial_statistics(logits, target, None, None, True, True)
    assert [t.shape for t in out] == [(0,)] * 5
    empty = torch.empty(0, device=DEVICE)
    cute_partial.partial_gradient(
        logits, target, None, empty, empty, empty, None, None, torch.tensor(100.0, device=DEVICE), None
    )
    b = Block(4, 100, torch.bfloat16, "plain", seed=9)
    m, s, t, smooth, argmax = cute_partial.partial_statistics(b.block(), b.stats_target, None, None, False, False)
    assert smooth is None and argmax is None and m.dtype == s.dtype == t.dtype == torch.float32


def test_compile_cache_is_reused_across_row_counts():
    check_statistics(Block(5, 32000, torch.bfloat16, "plain", seed=10))
    check_gradient(Block(5, 32000, torch.bfloat16, "plain", seed=10))
    n = len(cutedsl_common._COMPILED)
    check_statistics(Block(77, 32000, torch.bfloat16, "plain", seed=11))
    check_gradient(Block(77, 32000, torch.bfloat16, "plain", seed=11))
    assert len(cutedsl_common._COMPILED) == n


def test_bad_inputs_are_refused():
    z = torch.randn(4, 10, device=DEVICE)
    t = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="unit stride"):
        cute_partial.partial_statistics(z.t().contiguous().t(), t, None, None, False, False)
    with pytest.raises(TypeError, match="fp16/bf16/fp32"):
        cute_partial.partial_statistics(z.double(), t, None, None, False, False)
    with pytest.raises(ValueError, match="CUDA"):
        cute_partial.partial_statistics(z.cpu(), t.cpu(), None, None, False, False)
    with pytest.raises(TypeError, match="int64 or int32"):
        cute_partial.partial_statistics(z, t.float(), None, None, False, False)
    with pytest.raises(ValueError, match="V_r = 0"):
        cute_partial.partial_statistics(z[:, :0], t, None, None, False, False)
    with pytest.raises(ValueError, match=r"ce_weight must have shape \(10,\)"):
        cute_partial.partial_statistics(z, t, torch.ones(9, device=DEVICE), None, True, False)
    f = torch.zeros(4, device=DEVICE)
    with pytest.raises(TypeError, match="row_max must be float32"):
        cute_partial.partial_gradient(z, t, None, f.double(), f, f, None, None, torch.tensor(10.0, device=DEVICE), None)


def test_split_row_kernels_picks_cutedsl():
    kernels = split_row_kernels("cutedsl", DEVICE)
    assert kernels.name == "cutedsl" and kernels.extra_bytes_per_logit == 0


# ---------------------------------------------------------------- through the blocked driver


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("feature", ["plain", "label_smoothing", "softcap", "ce_weight", "accuracy", "all"])
def test_vocabulary_blocks_driver(feature, reduction, dtype):
    # V = 123 in blocks of 40 (40 + 40 + 40 + 3) x token chunks of 16, as on the CPU.
    from flce.testing import Case, run_case

    case = Case(feature=feature, reduction=reduction, dtype=dtype, bias=True, chunk_size=16, vocab_chunk_size=40)
    outcome = run_case(case, "cutedsl", DEVICE)
    assert outcome.passed, f"{case.name}: {outcome.failures} errors={outcome.errors}"
