# ruff: noqa: E501 (the case tables keep one case a line, so they read as tables)
"""Adversarial inputs through every public entry point on every backend usable here.

One declarative table of kinds of bad or edge input (shapes, dtypes, strides, devices,
ranges, NaN/Inf, empty, huge values, option values). Each kind names what it expects:
a clear refusal (the exception type and a message naming the argument), the float64 /
eager-PyTorch value (``tests/entry_points.py``'s judge), or a non-finite loss. Each
runs through every entry point of its kind that takes its options (the fused loss, its
module, the Liger shims, the vocab-parallel loss on a process group of size 1;
``cross_entropy``, its module, the Liger CE shims) on every usable backend (on CPU:
torch, and triton through its interpreter). A property test draws random layouts and
options on top.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flce
from flce.dispatch import BackendUnavailableError
from flce.testing import EPS
from tests.entry_points import (
    BACKENDS,
    DEVICE,
    ENTRIES,
    FUSED_ENTRIES,
    Entry,
    Problem,
    assert_close_to_reference,
    assert_matches_reference,
    fused_leaves,
    logits_leaves,
    plain_fused,
    plain_logits,
    process_group_of_one,  # noqa: F401 (a fixture)
    reference,
    run_entry,
    unpack,
)

N, H, V = 6, 4, 7  # small: the triton interpreter's cost grows with the rows and blocks
IGNORED = 1  # the row fused_leaves / logits_leaves ignore


# ----------------------------------------------------------------------- expectations


@dataclass(frozen=True)
class Refused:
    """The call (or its backward, ``at="backward"``) raises ``error`` (a type or a tuple
    of types) whose message matches ``pattern`` (a regular expression naming the argument)."""

    error: type | tuple
    pattern: str
    at: str = "call"


@dataclass(frozen=True)
class Matches:
    """The float64 reference's value and gradients (``assert_matches_reference``)."""


@dataclass(frozen=True)
class NonFinite:
    """A non-finite loss (NaN or Inf in a row that counts): never a finite, wrong number."""


@dataclass(frozen=True)
class IgnoredRowPoisoned:
    """NaN/Inf only in an ignored row: the loss of the same problem with that row's
    values replaced by 0, predicted -1 there and an exactly-zero gradient row."""

    leaf: str  # "x" (hidden states) or "z" (logits)


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "fused" or "logits"
    problem: Callable[[], Problem]
    expect: object
    spell_backend: Callable[[str], str] = str  # how the backend name is written


# ------------------------------------------------------------------------- builders


def _fused(make=None, options=None, leaves=None, differentiable=("x", "w", "b"), dtype=torch.float32, **kw):
    """A problem on ``fused_leaves`` (N x H hidden states, V classes, bias, row 1 ignored);
    ``make`` overrides the plain tensors: ``make(leaves) -> {argument: tensor}``."""

    def build():
        base = fused_leaves(N, H, V, **kw) if leaves is None else leaves()
        return Problem(
            base,
            (lambda L: dict(plain_fused(L), **make(L))) if make else plain_fused,
            dict(options or {}),
            differentiable,
            dtype=dtype,
        )

    return build


def _logits(make=None, options=None, leaves=None, differentiable=("z",), dtype=torch.float32, **kw):
    def build():
        base = logits_leaves(N, V, **kw) if leaves is None else leaves()
        return Problem(
            base,
            (lambda L: dict(plain_logits(L), **make(L))) if make else plain_logits,
            dict(options or {}),
            differentiable,
            dtype=dtype,
        )

    return build


def _poisoned(kind: str, value: float, where):
    """The plain problem with ``value`` written at ``where`` of the x (or z) leaf."""

    def leaves():
        base = fused_leaves(N, H, V) if kind == "fused" else logits_leaves(N, V)
        name = "x" if kind == "fused" else "z"
        poisoned = base[name].clone()
        poisoned[where] = value
        return dict(base, **{name: poisoned})

    return leaves


def _index(leaves: dict, position: int) -> torch.Tensor:
    """An index tensor for ``index_fill`` on the problem's device (the leaves are moved to
    it before ``make`` runs)."""
    return torch.tensor([position], device=leaves["t"].device)


def _meta(t):
    return t.detach().to("meta")


NAN, INF = float("nan"), float("inf")
ALL_FEATURES = dict(
    label_smoothing=0.1,
    lse_square_scale=0.05,
    return_z_loss=True,
    softcap=3.0,
    return_token_accuracy=True,
    return_predicted_tokens=True,
)


def _zero_weight_on_targets(kind):
    def leaves():
        base = fused_leaves(N, H, V, ce_weight=True) if kind == "fused" else logits_leaves(N, V, ce_weight=True)
        valid = base["t"][base["t"] != -100]
        base["cw"] = base["cw"].index_fill(0, valid, 0.0)
        return base

    return leaves


def _ignore_real_class(kind):
    def leaves():
        base = fused_leaves(N, H, V, ignored=()) if kind == "fused" else logits_leaves(N, V, ignored=())
        base["t"][:2] = 3  # class 3 is both a real class and ignore_index
        return base

    return leaves


# ----------------------------------------------------------------------------- table

FUSED_CASES = [
    # shapes
    Case("input-1d", "fused", _fused(lambda L: dict(x=L["x"][0])), Refused(ValueError, r"input must be \(N, H\)")),
    Case("input-4d", "fused", _fused(lambda L: dict(x=L["x"][None, None])), Refused(ValueError, r"input must be \(N, H\)")),
    Case("weight-1d", "fused", _fused(lambda L: dict(w=L["w"][0])), Refused(ValueError, r"weight(_shard)? must be \(V, H\)")),
    Case("hidden-mismatch", "fused", _fused(lambda L: dict(w=L["w"][:, :3])), Refused(ValueError, r"H = input.shape\[-1\] = 4")),
    Case("empty-vocabulary", "fused", _fused(lambda L: dict(w=L["w"][:0], bias=None)), Refused(ValueError, r"at least one row \(V >= 1\)")),
    Case("target-too-short", "fused", _fused(lambda L: dict(t=L["t"][:5])), Refused(ValueError, "one class index per row of input")),
    Case("target-bt-mispaired", "fused", _fused(lambda L: dict(x=L["x"].view(2, 3, H), t=L["t"].view(3, 2))), Refused(ValueError, r"target must be \(B, T\) = \(2, 3\)")),
    Case("target-3d", "fused", _fused(lambda L: dict(t=L["t"].view(2, 3, 1))), Refused(ValueError, r"target must be \(N,\) or \(B, T\)")),
    Case("target-not-a-tensor", "fused", _fused(lambda L: dict(t=L["t"].tolist())), Refused(TypeError, "target must be a torch.Tensor")),
    Case("bias-wrong-shape", "fused", _fused(lambda L: dict(bias=L["b"][:5])), Refused(ValueError, r"must have shape \(7,\)")),
    Case("ce_weight-wrong-shape", "fused", _fused(lambda L: dict(ce_weight=L["cw"][:5]), ce_weight=True), Refused(ValueError, r"must have shape \(7,\)")),
    # dtypes
    Case("input-float64", "fused", _fused(lambda L: dict(x=L["x"].double(), w=L["w"].double(), bias=None)), Refused(TypeError, "must be float16, bfloat16 or float32")),
    Case("input-integer", "fused", _fused(lambda L: dict(x=L["x"].long()), differentiable=()), Refused(TypeError, "input must be float16, bfloat16 or float32")),
    Case("input-complex", "fused", _fused(lambda L: dict(x=L["x"].to(torch.complex64)), differentiable=()), Refused(TypeError, "input must be float16, bfloat16 or float32")),
    Case("target-float", "fused", _fused(lambda L: dict(t=L["t"].float())), Refused(TypeError, "target must be an integer tensor")),
    Case("target-bool", "fused", _fused(lambda L: dict(t=L["t"] > 2)), Refused(TypeError, "target must be an integer tensor")),
    Case("dtype-mismatch", "fused", _fused(lambda L: dict(w=L["w"].bfloat16())), Refused(TypeError, "they must match")),
    Case("ce_weight-integer", "fused", _fused(lambda L: dict(ce_weight=L["cw"].long()), ce_weight=True), Refused(TypeError, "must be a floating-point tensor")),
    Case("target-int16", "fused", _fused(lambda L: dict(t=L["t"].to(torch.int16))), Matches()),
    Case("bfloat16-all-features", "fused", _fused(options=ALL_FEATURES, dtype=torch.bfloat16, ce_weight=True), Matches()),
    # devices
    # (the vocab-parallel loss first checks that its split-row kernels can run on the device)
    Case("everything-on-meta", "fused", _fused(lambda L: {k: None if v is None else _meta(v) for k, v in plain_fused(L).items()}, differentiable=()), Refused((ValueError, BackendUnavailableError), "meta")),
    Case("weight-on-meta", "fused", _fused(lambda L: dict(w=_meta(L["w"]))), Refused(ValueError, "all tensors must share a device")),
    Case("target-on-meta", "fused", _fused(lambda L: dict(t=_meta(L["t"]))), Refused(ValueError, "all tensors must share a device")),
    Case("ce_weight-on-meta", "fused", _fused(lambda L: dict(ce_weight=_meta(L["cw"])), ce_weight=True), Refused(ValueError, "put them on one device")),
    # ranges
    Case("target-equal-to-vocab", "fused", _fused(lambda L: dict(t=L["t"].index_fill(0, _index(L, 0), V))), Refused(ValueError, r"target values must be in \[0, 7\)")),
    Case("target-negative", "fused", _fused(lambda L: dict(t=L["t"].index_fill(0, _index(L, 0), -5))), Refused(ValueError, "found 1 out of range")),
    Case("ignore-index-real-class", "fused", _fused(options=dict(ignore_index=3), leaves=_ignore_real_class("fused")), Matches()),
    Case("ignore-index-beyond-int64", "fused", _fused(options=dict(ignore_index=2**64)), Refused(ValueError, "ignore_index must fit in int64")),
    Case("ce_weight-negative", "fused", _fused(lambda L: dict(ce_weight=-L["cw"]), ce_weight=True), Refused(ValueError, "finite and non-negative")),
    Case("ce_weight-nan", "fused", _fused(lambda L: dict(ce_weight=L["cw"] * NAN), ce_weight=True), Refused(ValueError, "finite and non-negative")),
    Case("ce_weight-inf", "fused", _fused(lambda L: dict(ce_weight=L["cw"] * INF), ce_weight=True), Refused(ValueError, "finite and non-negative")),
    Case("ce_weight-requires-grad", "fused", _fused(ce_weight=True, differentiable=("x", "cw")), Refused(ValueError, r"ce_weight\w* requires grad")),
    Case("ce_weight-zero-on-every-target", "fused", _fused(options=dict(lse_square_scale=0.05), leaves=_zero_weight_on_targets("fused")), Matches()),
    # non-finite values
    Case("nan-in-an-ignored-row", "fused", _fused(leaves=_poisoned("fused", NAN, (IGNORED, 0)), options=ALL_FEATURES), IgnoredRowPoisoned("x")),
    Case("inf-in-an-ignored-row", "fused", _fused(leaves=_poisoned("fused", -INF, (IGNORED, 2))), IgnoredRowPoisoned("x")),
    Case("nan-in-a-valid-row", "fused", _fused(leaves=_poisoned("fused", NAN, (0, 1))), NonFinite()),
    Case("inf-in-the-weight", "fused", _fused(lambda L: dict(w=L["w"].index_fill(1, _index(L, 2), INF))), NonFinite()),
    Case("nan-in-the-bias", "fused", _fused(lambda L: dict(bias=L["b"].index_fill(0, _index(L, 4), NAN))), NonFinite()),
    # empty and degenerate sizes
    Case("empty-batch", "fused", _fused(lambda L: dict(x=L["x"][:0], t=L["t"][:0])), Matches()),
    Case("empty-batch-per-token", "fused", _fused(lambda L: dict(x=L["x"][:0], t=L["t"][:0]), options=dict(reduction="none")), Matches()),
    Case("every-row-ignored", "fused", _fused(lambda L: dict(t=torch.full_like(L["t"], -100)), options=ALL_FEATURES), Matches()),
    Case("zero-hidden-size", "fused", _fused(lambda L: dict(x=L["x"][:, :0], w=L["w"][:, :0])), Matches()),
    Case("single-class", "fused", _fused(lambda L: dict(w=L["w"][:1], bias=L["b"][:1], t=L["t"].clamp(max=0))), Matches()),
    # huge and tiny values
    Case("huge-logits", "fused", _fused(lambda L: dict(x=L["x"] * 2000.0), options=dict(label_smoothing=0.1)), Matches()),
    Case("tiny-logits", "fused", _fused(lambda L: dict(x=L["x"] * 1e-30)), Matches()),
    Case("huge-softcapped-logits", "fused", _fused(lambda L: dict(x=L["x"] * 1e4), options=dict(softcap=30.0)), Matches()),
    # strides
    Case("every-tensor-strided", "fused", _fused(lambda L: dict(x=L["x"].t().contiguous().t(), w=L["w"].repeat(2, 1)[::2], t=L["t"].repeat_interleave(2)[::2], bias=L["b"].expand(2, V)[1], ce_weight=L["cw"].repeat(3)[::3]), ce_weight=True, options=dict(label_smoothing=0.1)), Matches()),
    Case("every-tensor-stride-0", "fused", _fused(lambda L: dict(x=L["x"][:1].expand(N, H), w=L["w"][:, :1].expand(V, H), t=L["t"][2:3].expand(N), ce_weight=L["cw"][:1].expand(V)), ce_weight=True), Matches()),
    Case("input-3d-non-contiguous", "fused", _fused(lambda L: dict(x=L["x"].view(3, 2, H).transpose(0, 1), t=L["t"].view(3, 2).t())), Matches()),
    # option values
    Case("backend-upper-case", "fused", _fused(), Matches(), spell_backend=str.upper),
    Case("backend-unknown", "fused", _fused(), Refused(ValueError, "(backend|FLCE_BACKEND|ce_impl) must be"), spell_backend=lambda b: "cuda"),
    Case("ignore-index-numpy", "fused", _fused(options=dict(ignore_index=np.int64(-100))), Matches()),
    Case("ignore-index-bool", "fused", _fused(options=dict(ignore_index=True)), Refused(TypeError, "ignore_index must be an int")),
    Case("ignore-index-tensor", "fused", _fused(options=dict(ignore_index=torch.tensor(-100))), Refused(TypeError, "ignore_index must be an int")),
    Case("ignore-index-float", "fused", _fused(options=dict(ignore_index=-100.0)), Refused(TypeError, "ignore_index must be an int")),
    Case("label-smoothing-numpy", "fused", _fused(options=dict(label_smoothing=np.float32(0.25))), Matches()),
    Case("label-smoothing-above-one", "fused", _fused(options=dict(label_smoothing=1.5)), Refused(ValueError, r"label_smoothing must be in \[0, 1\]")),
    Case("label-smoothing-nan", "fused", _fused(options=dict(label_smoothing=NAN)), Refused(TypeError, "label_smoothing must be a finite float")),
    Case("softcap-zero", "fused", _fused(options=dict(softcap=0.0)), Refused(ValueError, "softcap must be > 0")),
    Case("softcap-numpy", "fused", _fused(options=dict(softcap=np.float64(2.0))), Matches()),
    Case("z-loss-negative", "fused", _fused(options=dict(lse_square_scale=-1e-3)), Refused(ValueError, "lse_square_scale must be >= 0")),
    Case("reduction-unknown", "fused", _fused(options=dict(reduction="avg")), Refused(ValueError, "reduction must be one of")),
    Case("chunk-size-numpy", "fused", _fused(options=dict(chunk_size=np.int64(4))), Matches()),
    Case("chunk-size-zero", "fused", _fused(options=dict(chunk_size=0)), Refused(ValueError, "chunk_size must be a positive int")),
    Case("chunk-size-bool", "fused", _fused(options=dict(chunk_size=True)), Refused(TypeError, "chunk_size must be an int")),
    Case("vocab-chunk-size-numpy", "fused", _fused(options=dict(vocab_chunk_size=np.int32(3))), Matches()),
    Case("flag-not-a-bool", "fused", _fused(options=dict(return_z_loss=1)), Refused(TypeError, "return_z_loss must be a bool")),
    Case("flag-numpy-bool", "fused", _fused(options=dict(return_token_accuracy=np.bool_(True))), Matches()),
    Case("accum-dtype-float64", "fused", _fused(options=dict(accum_dtype=torch.float64)), Refused(ValueError, "accum_dtype must be None")),
    Case("chunk-mem-const-zero-hidden", "fused", _fused(lambda L: dict(x=L["x"][:, :0], w=L["w"][:, :0]), options=dict(chunk_mem_const=2)), Matches()),
    Case("chunk-mem-const-zero", "fused", _fused(options=dict(chunk_mem_const=0)), Refused(ValueError, "chunk_mem_const must be a positive int")),
    Case("create-graph", "fused", _fused(), Refused(RuntimeError, "create_graph=True", at="backward")),
]  # fmt: skip

LOGITS_CASES = [
    Case("logits-1d", "logits", _logits(lambda L: dict(z=L["z"][0])), Refused(ValueError, r"logits must be \(N, V\)")),
    Case("logits-4d", "logits", _logits(lambda L: dict(z=L["z"][None, None])), Refused(ValueError, r"logits must be \(N, V\)")),
    Case("logits-no-class", "logits", _logits(lambda L: dict(z=L["z"][:, :0])), Refused(ValueError, r"at least one class \(V >= 1\)")),
    Case("target-bt-mispaired", "logits", _logits(lambda L: dict(z=L["z"].view(2, 3, V), t=L["t"].view(3, 2))), Refused(ValueError, r"target must be \(B, T\) = \(2, 3\)")),
    Case("target-too-long", "logits", _logits(lambda L: dict(t=torch.cat([L["t"], L["t"][:1]]))), Refused(ValueError, "one class index per row of logits")),
    Case("logits-float64", "logits", _logits(lambda L: dict(z=L["z"].double())), Refused(TypeError, "logits must be float16, bfloat16 or float32")),
    Case("logits-integer", "logits", _logits(lambda L: dict(z=L["z"].long()), differentiable=()), Refused(TypeError, "logits must be float16, bfloat16 or float32")),
    Case("target-float", "logits", _logits(lambda L: dict(t=L["t"].float())), Refused(TypeError, "target must be an integer tensor")),
    Case("logits-on-meta", "logits", _logits(lambda L: dict(z=_meta(L["z"]), t=_meta(L["t"])), differentiable=()), Refused(ValueError, "meta device")),
    Case("target-on-meta", "logits", _logits(lambda L: dict(t=_meta(L["t"]))), Refused(ValueError, "put them on one device")),
    Case("weight-on-meta", "logits", _logits(lambda L: dict(ce_weight=_meta(L["cw"])), ce_weight=True), Refused(ValueError, "put them on one device")),
    Case("weight-requires-grad", "logits", _logits(ce_weight=True, differentiable=("z", "cw")), Refused(ValueError, "weight requires grad")),
    Case("target-equal-to-vocab", "logits", _logits(lambda L: dict(t=L["t"].index_fill(0, _index(L, 0), V))), Refused(ValueError, r"target values must be in \[0, 7\)")),
    Case("weight-zero-on-every-target", "logits", _logits(options=dict(lse_square_scale=0.05), leaves=_zero_weight_on_targets("logits")), Matches()),
    Case("ignore-index-real-class", "logits", _logits(options=dict(ignore_index=3), leaves=_ignore_real_class("logits")), Matches()),
    Case("nan-row-ignored", "logits", _logits(leaves=_poisoned("logits", NAN, IGNORED), options=dict(label_smoothing=0.1, return_predicted_tokens=True)), IgnoredRowPoisoned("z")),
    Case("inf-logit-ignored", "logits", _logits(leaves=_poisoned("logits", INF, (IGNORED, 2))), IgnoredRowPoisoned("z")),
    Case("nan-logit-valid", "logits", _logits(leaves=_poisoned("logits", NAN, (0, 2))), NonFinite()),
    Case("every-row-ignored", "logits", _logits(lambda L: dict(t=torch.full_like(L["t"], -100))), Matches()),
    Case("empty-batch", "logits", _logits(lambda L: dict(z=L["z"][:0], t=L["t"][:0])), Matches()),
    Case("single-class", "logits", _logits(lambda L: dict(z=L["z"][:, :1], t=L["t"].clamp(max=0))), Matches()),
    Case("huge-logits", "logits", _logits(lambda L: dict(z=L["z"] * 3000.0), options=dict(lse_square_scale=1e-6)), Matches()),
    Case("logits-transposed", "logits", _logits(lambda L: dict(z=L["z"].t().contiguous().t())), Matches()),
    Case("logits-sliced-classes", "logits", _logits(lambda L: dict(z=L["z"].repeat_interleave(2, dim=1)[:, ::2])), Matches()),
    Case("logits-stride-0-rows", "logits", _logits(lambda L: dict(z=L["z"][:1].expand(N, V), t=L["t"][2:3].expand(N))), Matches()),
    Case("logits-3d-non-contiguous", "logits", _logits(lambda L: dict(z=L["z"].view(3, 2, V).transpose(0, 1), t=L["t"].view(3, 2).t())), Matches()),
    Case("bfloat16-logits", "logits", _logits(options=dict(label_smoothing=0.1, softcap=5.0), dtype=torch.bfloat16), Matches()),
    Case("backend-upper-case", "logits", _logits(), Matches(), spell_backend=str.upper),
    Case("vocab-chunk-size-given", "logits", _logits(options=dict(vocab_chunk_size=4)), Refused(ValueError, "applies to the fused linear loss only")),
    Case("create-graph", "logits", _logits(options=dict(reduction="none")), Refused(RuntimeError, "create_graph=True", at="backward")),
]  # fmt: skip

CASES = FUSED_CASES + LOGITS_CASES
assert len({(c.kind, c.name) for c in CASES}) == len(CASES), "case names must be unique per kind"


def _runs():
    """(case, entry, backend) for every entry of the case's kind that takes its options."""
    runs = []
    for case in CASES:
        options = case.problem().options
        for entry in ENTRIES.values():
            if entry.kind != case.kind or not entry.takes(options):
                continue
            for backend in BACKENDS:
                runs.append(pytest.param(case, entry, backend, id=f"{case.kind}-{case.name}-{entry.name}-{backend}"))
    return runs


# ------------------------------------------------------------------------------ tests


def _judge_poisoned(entry: Entry, problem: Problem, leaf: str, outputs, grads) -> None:
    clean_leaves = dict(
        problem.leaves, **{leaf: torch.nan_to_num(problem.leaves[leaf], nan=0.0, posinf=0.0, neginf=0.0)}
    )
    clean = Problem(clean_leaves, problem.make, problem.options, problem.differentiable, problem.upstream)
    truth, truth_grads = reference(entry.kind, clean)
    eager, eager_grads = reference(entry.kind, clean, torch.float32, problem.dtype)
    floor = EPS[problem.dtype]
    assert_close_to_reference("loss", outputs[0], truth[0], eager[0], floor)
    if outputs[3] is not None:
        assert outputs[3][IGNORED].item() == -1
    assert torch.equal(grads[leaf][IGNORED], torch.zeros_like(grads[leaf][IGNORED]))
    assert_close_to_reference(f"grad {leaf}", grads[leaf], truth_grads[leaf], eager_grads[leaf], floor)


@pytest.mark.usefixtures("process_group_of_one")
@pytest.mark.parametrize("case,entry,backend", _runs())
def test_adversarial_input(case: Case, entry: Entry, backend: str):
    problem = case.problem()
    backend = case.spell_backend(backend)
    expect = case.expect
    if isinstance(expect, Refused) and expect.at == "call":
        with pytest.raises(expect.error, match=expect.pattern):
            _, tensors = problem.tensors(problem.dtype, DEVICE, requires_grad=True)
            outputs = unpack(entry.call(tensors, backend, problem.options))
            # On CUDA a check that needs the data reports without a host sync: the call's
            # loss is NaN and the error comes from the next call or ``check_errors``.
            assert DEVICE.type == "cuda", "the CPU refuses at the call"
            assert torch.isnan(outputs[0]).all(), f"a refused input gave the loss {outputs[0]}"
            flce.check_errors()
        return
    if isinstance(expect, Refused):  # at backward
        leaves, tensors = problem.tensors(problem.dtype, DEVICE, requires_grad=True)
        loss = unpack(entry.call(tensors, backend, problem.options))[0].sum()
        with pytest.raises(expect.error, match=expect.pattern):
            torch.autograd.grad(loss, [leaves[n] for n in problem.differentiable], create_graph=True)
        return
    outputs, grads = run_entry(entry, problem, backend)
    if isinstance(expect, Matches):
        assert_matches_reference(entry, problem, outputs, grads)
    elif isinstance(expect, NonFinite):
        assert not torch.isfinite(outputs[0]).all(), f"a non-finite input gave a finite loss {outputs[0]}"
    elif isinstance(expect, IgnoredRowPoisoned):
        _judge_poisoned(entry, problem, expect.leaf, outputs, grads)
    else:
        raise AssertionError(f"unknown expectation {expect!r}")


def test_the_table_covers_at_least_forty_kinds_and_every_entry_point():
    assert len(CASES) >= 40
    covered = {run.values[1].name for run in _runs()}
    assert covered == set(ENTRIES), f"entry points without a case: {set(ENTRIES) - covered}"


# ------------------------------------------------------------ random layouts, options

LAYOUTS = {
    "x": {
        "contiguous": lambda x: x,
        "transposed": lambda x: x.t().contiguous().t(),
        "sliced": lambda x: x.repeat_interleave(2, dim=1)[:, ::2],
        "3d": lambda x: x.view(3, 2, H).transpose(0, 1),
    },
    "w": {
        "contiguous": lambda w: w,
        "transposed": lambda w: w.t().contiguous().t(),
        "row-sliced": lambda w: w.repeat(2, 1)[::2],
    },
    "t": {
        "contiguous": lambda t: t,
        "sliced": lambda t: t.repeat_interleave(2)[::2],
        "int32": lambda t: t.int(),
    },
}


@dataclass(frozen=True)
class Drawn:
    layouts: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)


@st.composite
def _drawn(draw) -> Drawn:
    layouts = {name: draw(st.sampled_from(sorted(choices))) for name, choices in LAYOUTS.items()}
    options = dict(
        reduction=draw(st.sampled_from(["mean", "sum", "none"])),
        label_smoothing=draw(st.sampled_from([0.0, 0.1])),
        lse_square_scale=draw(st.sampled_from([0.0, 1e-2])),
        softcap=draw(st.sampled_from([None, 2.5])),
        chunk_size=draw(st.sampled_from([None, 1, 4])),
    )
    return Drawn(layouts, options)


@pytest.mark.usefixtures("process_group_of_one")
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn=_drawn(), entry=st.sampled_from(sorted(FUSED_ENTRIES)), backend=st.sampled_from(BACKENDS))
def test_random_layouts_and_options_match_the_reference(drawn: Drawn, entry: str, backend: str):
    entry = FUSED_ENTRIES[entry]
    options = {k: v for k, v in drawn.options.items() if k in entry.accepts}
    x_view, w_view, t_view = (LAYOUTS[n][drawn.layouts[n]] for n in ("x", "w", "t"))
    problem = Problem(
        fused_leaves(N, H, V, seed=3),
        lambda L: dict(plain_fused(L), x=x_view(L["x"]), w=w_view(L["w"]), t=t_view(L["t"])),
        options,
        ("x", "w", "b"),
    )
    outputs, grads = run_entry(entry, problem, backend)
    assert_matches_reference(entry, problem, outputs, grads)
