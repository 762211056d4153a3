"""Every bad input is refused at the boundary with the argument's name and what was
expected, before any kernel runs (one test per class of mistake)."""

import pytest
import torch

import flce
from flce.dispatch import BackendUnavailableError


def _ok():
    x = torch.randn(6, 8)
    w = torch.randn(11, 8)
    t = torch.randint(0, 11, (6,))
    return x, w, t


CASES = [
    # (description, call, exception type, message fragment)
    ("input rank", lambda x, w, t: flce.fused_linear_cross_entropy(x[0], w, t), ValueError, "input must be (N, H)"),
    ("weight rank", lambda x, w, t: flce.fused_linear_cross_entropy(x, w[0], t), ValueError, "weight must be (V, H)"),
    (
        "H mismatch",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w[:, :5], t),
        ValueError,
        "H = input.shape[-1] = 8",
    ),
    (
        "target length",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t[:4]),
        ValueError,
        "one class index per row",
    ),
    (
        "target rank",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t.view(2, 3, 1)),
        ValueError,
        "target must be (N,)",
    ),
    ("float target", lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t.float()), TypeError, "integer tensor"),
    (
        "target above V",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t.clone().fill_(11)),
        ValueError,
        "[0, 11)",
    ),
    (
        "negative target",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t.clone().fill_(-1)),
        ValueError,
        "out of range",
    ),
    (
        "dtype mismatch",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w.double(), t),
        TypeError,
        "float16, bfloat16 or float32",
    ),
    (
        "dtype mismatch low",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w.bfloat16(), t),
        TypeError,
        "must match",
    ),
    (
        "integer input",
        lambda x, w, t: flce.fused_linear_cross_entropy(x.long(), w, t),
        TypeError,
        "input must be float16",
    ),
    (
        "bias shape",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t, bias=torch.randn(10)),
        ValueError,
        "bias must have shape (11,)",
    ),
    (
        "label_smoothing > 1",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t, label_smoothing=1.5),
        ValueError,
        "label_smoothing must be in [0, 1]",
    ),
    (
        "label_smoothing < 0",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t, label_smoothing=-0.1),
        ValueError,
        "label_smoothing",
    ),
    (
        "softcap 0",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t, softcap=0.0),
        ValueError,
        "softcap must be > 0",
    ),
    (
        "softcap negative",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t, softcap=-2.0),
        ValueError,
        "softcap must be > 0",
    ),
    (
        "softcap nan",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t, softcap=float("nan")),
        TypeError,
        "softcap must be a finite float",
    ),
    (
        # Its reciprocal, which the kernels multiply by in float32, is subnormal here.
        "softcap beyond float32",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t, softcap=1e38),
        ValueError,
        "softcap must be in [1.18e-38, 8.51e+37]",
    ),
    (
        "softcap below float32",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t, softcap=1e-300),
        ValueError,
        "softcap must be in [1.18e-38, 8.51e+37]",
    ),
    (
        "z-loss scale beyond float32",
        lambda x, w, t: flce.cross_entropy(x @ w.T, t, lse_square_scale=1e39),
        ValueError,
        "lse_square_scale must be <= 3.4e+38",
    ),
    (
        "negative z-loss scale",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t, lse_square_scale=-1.0),
        ValueError,
        "lse_square_scale must be >= 0",
    ),
    (
        "unknown reduction",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t, reduction="avg"),
        ValueError,
        "reduction must be one of",
    ),
    (
        "unknown backend",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t, backend="cuda"),
        ValueError,
        "backend must be one of",
    ),
    (
        "ce_weight shape",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t, ce_weight=torch.ones(5)),
        ValueError,
        "ce_weight must have shape (11,)",
    ),
    (
        "ce_weight integer",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t, ce_weight=torch.ones(11, dtype=torch.long)),
        TypeError,
        "ce_weight must be a floating-point",
    ),
    (
        "ce_weight negative",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t, ce_weight=-torch.ones(11)),
        ValueError,
        "non-negative",
    ),
    (
        "ce_weight nan",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t, ce_weight=torch.full((11,), float("nan"))),
        ValueError,
        "finite",
    ),
    (
        "accum_dtype",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t, accum_dtype=torch.float16),
        ValueError,
        "accum_dtype must be None, torch.float32 or the weight's dtype",
    ),
    (
        "accum_dtype int",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t, accum_dtype=torch.int32),
        ValueError,
        "accum_dtype",
    ),
    (
        "chunk_size 0",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t, chunk_size=0),
        ValueError,
        "chunk_size must be a positive int",
    ),
    (
        "vocab_chunk_size 0",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t, vocab_chunk_size=0),
        ValueError,
        "vocab_chunk_size must be a positive int",
    ),
    (
        "ce vocab_chunk_size",
        lambda x, w, t: flce.CrossEntropyLoss(vocab_chunk_size=4)(x, t % 8),
        ValueError,
        "vocab_chunk_size applies to the fused linear loss only",
    ),
    (
        "chunk_size float",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t, chunk_size=2.5),
        TypeError,
        "chunk_size must be an int",
    ),
    (
        "flag not bool",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t, return_z_loss=1),
        TypeError,
        "return_z_loss must be a bool",
    ),
    (
        "ignore_index float",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t, ignore_index=-100.0),
        TypeError,
        "ignore_index must be an int",
    ),
    (
        "B,T target mismatch",
        lambda x, w, t: flce.fused_linear_cross_entropy(x.view(2, 3, 8), w, t.view(3, 2)),
        ValueError,
        "target must be (B, T) = (2, 3)",
    ),
    (
        "weight on meta device",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w.to("meta"), t),
        ValueError,
        "all tensors must share a device",
    ),
    ("ce logits rank", lambda x, w, t: flce.cross_entropy(x[0], t), ValueError, "logits must be (N, V)"),
    ("ce target range", lambda x, w, t: flce.cross_entropy(x, t.clone().fill_(8)), ValueError, "[0, 8)"),
    (
        "ce weight shape",
        lambda x, w, t: flce.cross_entropy(x, t % 8, weight=torch.ones(3)),
        ValueError,
        "weight must have shape (8,)",
    ),
    (
        "module options",
        lambda x, w, t: flce.FusedLinearCrossEntropyLoss(reduction="mean!"),
        ValueError,
        "reduction must be one of",
    ),
]


@pytest.mark.parametrize("call,exc,fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_refused_with_a_clear_message(call, exc, fragment):
    x, w, t = _ok()
    with pytest.raises(exc) as info:
        call(x, w, t)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "call,name",
    [
        (lambda x, w, t, cw: flce.fused_linear_cross_entropy(x, w, t, ce_weight=cw), "ce_weight"),
        (lambda x, w, t, cw: flce.cross_entropy(x @ w.T, t, weight=cw), "weight"),
    ],
    ids=["fused", "cross_entropy"],
)
def test_bad_class_weights_are_named_as_the_caller_passed_them(call, name):
    """The values' check (negative, NaN, Inf) names the entry point's own argument:
    ``flce.cross_entropy`` takes them as ``weight=``, as torch's does."""
    x, w, t = _ok()
    with pytest.raises(ValueError) as info:
        call(x, w, t, -torch.ones(11))
    assert str(info.value).startswith(f"{name} must be finite and non-negative")


SPARSE_CASES = [
    # (description, call); each operand sparse or nested in turn, after a dense call of the
    # same shapes (its checked layout must not let the sparse one through)
    ("sparse input", lambda x, w, t: flce.fused_linear_cross_entropy(x.to_sparse(), w, t), "input"),
    ("sparse weight", lambda x, w, t: flce.fused_linear_cross_entropy(x, w.to_sparse_csr(), t), "weight"),
    ("sparse bias", lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t, bias=w[:, 0].to_sparse()), "bias"),
    ("sparse target", lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t.to_sparse()), "target"),
    (
        "sparse ce_weight",
        lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t, ce_weight=torch.ones(11).to_sparse()),
        "ce_weight",
    ),
    ("sparse logits", lambda x, w, t: flce.cross_entropy((x @ w.T).to_sparse(), t), "logits"),
    (
        "sparse class weight",
        lambda x, w, t: flce.cross_entropy(x @ w.T, t, weight=torch.ones(11).to_sparse()),
        "weight",
    ),
]


@pytest.mark.parametrize("call,name", [c[1:] for c in SPARSE_CASES], ids=[c[0] for c in SPARSE_CASES])
def test_a_sparse_operand_is_refused_by_name(call, name):
    x, w, t = _ok()
    dense = {"input": x, "weight": w, "bias": w[:, 0], "target": t, "ce_weight": torch.ones(11), "logits": x @ w.T}
    flce.fused_linear_cross_entropy(x, w, t, bias=dense["bias"], ce_weight=dense["ce_weight"])
    flce.cross_entropy(dense["logits"], t, weight=dense["ce_weight"])
    with pytest.raises(TypeError, match=rf"^{name} must be a dense \(strided\) tensor, got layout torch\.sparse"):
        call(x, w, t)


def test_a_nested_input_is_refused_by_name():
    from flce.compat.liger import liger_fused_linear_cross_entropy

    x, w, t = _ok()
    nested = torch.nested.nested_tensor([x, x[:2]])
    for call in (flce.fused_linear_cross_entropy, liger_fused_linear_cross_entropy):
        with pytest.raises(TypeError, match="input is a nested tensor"):
            call(nested, w, t)


def test_env_var_backend_is_validated(monkeypatch):
    monkeypatch.setenv("FLCE_BACKEND", "nope")
    with pytest.raises(ValueError, match="FLCE_BACKEND must be one of"):
        flce.fused_linear_cross_entropy(*_ok())


def test_explicit_unusable_backend_raises_with_reason(monkeypatch):
    from flce import dispatch
    from flce.backends.base import BackendSpec

    torch_spec = dispatch.get_backend("torch")
    broken = BackendSpec(
        "triton", torch_spec.cross_entropy_chunk, lambda device: (False, "not on this test device"), 0, 10, "stand-in"
    )
    monkeypatch.setattr(dispatch, "get_backend", lambda name: broken if name == "triton" else torch_spec)
    with pytest.raises(BackendUnavailableError, match="not on this test device"):
        flce.fused_linear_cross_entropy(*_ok(), backend="triton")


def test_validation_runs_before_any_kernel(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a kernel ran before validation finished")

    monkeypatch.setattr("flce.plan.run_chunks", fail)
    x, w, t = _ok()
    with pytest.raises(ValueError):
        flce.fused_linear_cross_entropy(x, w, t.clone().fill_(99))


def _not_tensor_calls():
    """(entry, argument name, call(value)) for every tensor argument of every public
    single-process entry point (the vocab-parallel ones: tests/parallel)."""
    from flce.compat import liger

    x, w, t = _ok()
    z, tx, tw = x @ w.T, torch.randn(6, 5), torch.randn(11, 5)
    F, C, L = flce.fused_linear_cross_entropy, flce.cross_entropy, flce.fused_linear_logprobs
    D = flce.fused_linear_distillation
    jsd = liger.liger_fused_linear_jsd
    return [
        ("fused", "input", False, lambda v: F(v, w, t)),
        ("fused", "weight", False, lambda v: F(x, v, t)),
        ("fused", "target", False, lambda v: F(x, w, v)),
        ("fused", "bias", True, lambda v: F(x, w, t, bias=v)),
        ("fused", "ce_weight", True, lambda v: F(x, w, t, ce_weight=v)),
        ("module", "input", False, lambda v: flce.FusedLinearCrossEntropyLoss()(v, w, t)),
        ("module", "weight", False, lambda v: flce.FusedLinearCrossEntropyLoss()(x, v, t)),
        ("module", "target", False, lambda v: flce.FusedLinearCrossEntropyLoss()(x, w, v)),
        ("module", "bias", True, lambda v: flce.FusedLinearCrossEntropyLoss()(x, w, t, v)),
        ("module", "ce_weight", True, lambda v: flce.FusedLinearCrossEntropyLoss(ce_weight=v)(x, w, t)),
        ("cross_entropy", "logits", False, lambda v: C(v, t)),
        ("cross_entropy", "target", False, lambda v: C(z, v)),
        ("cross_entropy", "weight", True, lambda v: C(z, t, weight=v)),
        ("ce_module", "logits", False, lambda v: flce.CrossEntropyLoss()(v, t)),
        ("ce_module", "target", False, lambda v: flce.CrossEntropyLoss()(z, v)),
        ("ce_module", "weight", True, lambda v: flce.CrossEntropyLoss(weight=v)(z, t)),
        ("logprobs", "input", False, lambda v: L(v, w, t)),
        ("logprobs", "weight", False, lambda v: L(x, v, t)),
        ("logprobs", "target", False, lambda v: L(x, w, v)),
        ("logprobs", "bias", True, lambda v: L(x, w, t, bias=v)),
        ("distillation", "student_input", False, lambda v: D(v, w, tx, tw)),
        ("distillation", "student_weight", False, lambda v: D(x, v, tx, tw)),
        ("distillation", "teacher_input", False, lambda v: D(x, w, v, tw)),
        ("distillation", "teacher_weight", False, lambda v: D(x, w, tx, v)),
        ("distillation", "target", True, lambda v: D(x, w, tx, tw, v)),
        ("distillation", "student_bias", True, lambda v: D(x, w, tx, tw, student_bias=v)),
        ("distillation", "teacher_bias", True, lambda v: D(x, w, tx, tw, teacher_bias=v)),
        ("liger", "input", False, lambda v: liger.liger_fused_linear_cross_entropy(v, w, t)),
        ("liger", "weight", False, lambda v: liger.liger_fused_linear_cross_entropy(x, v, t)),
        ("liger", "target", False, lambda v: liger.liger_fused_linear_cross_entropy(x, w, v)),
        ("liger", "bias", True, lambda v: liger.liger_fused_linear_cross_entropy(x, w, t, v)),
        ("liger", "ce_weight", True, lambda v: liger.liger_fused_linear_cross_entropy(x, w, t, None, v)),
        ("liger_function", "input", False, lambda v: liger.LigerFusedLinearCrossEntropyFunction.apply(v, w, t)),
        ("liger_module", "input", False, lambda v: liger.LigerFusedLinearCrossEntropyLoss()(w, v, t)),
        ("liger_module", "weight", False, lambda v: liger.LigerFusedLinearCrossEntropyLoss()(v, x, t)),
        ("liger_module", "target", False, lambda v: liger.LigerFusedLinearCrossEntropyLoss()(w, x, v)),
        ("liger_ce", "input", False, lambda v: liger.liger_cross_entropy(v, t)),
        ("liger_ce", "target", False, lambda v: liger.liger_cross_entropy(z, v)),
        ("liger_ce", "weight", True, lambda v: liger.liger_cross_entropy(z, t, v)),
        ("liger_ce_function", "input", False, lambda v: liger.LigerCrossEntropyFunction.apply(v, t, None)),
        ("liger_jsd", "student_input", False, lambda v: jsd(v, w, tx, tw)),
        ("liger_jsd", "student_weight", False, lambda v: jsd(x, v, tx, tw)),
        ("liger_jsd", "teacher_input", False, lambda v: jsd(x, w, v, tw)),
        ("liger_jsd", "teacher_weight", False, lambda v: jsd(x, w, tx, v)),
        ("liger_jsd", "target", True, lambda v: jsd(x, w, tx, tw, v)),
        ("liger_jsd_module", "teacher_input", False, lambda v: liger.LigerFusedLinearJSD()(x, w, v, tw, None)),
    ]


NOT_TENSORS = {"None": None, "list": [[1.0, 2.0]], "numpy": "numpy", "float": 1.5}
NOT_TENSOR_CASES = [
    (index, kind)
    for index, (_, _, optional, _) in enumerate(_not_tensor_calls())
    for kind in NOT_TENSORS
    if not (optional and kind == "None")  # None is an optional tensor's default
]


@pytest.mark.parametrize(
    "index,kind", NOT_TENSOR_CASES, ids=["-".join((*_not_tensor_calls()[i][:2], k)) for i, k in NOT_TENSOR_CASES]
)
def test_a_tensor_argument_given_as_something_else_is_refused_by_name(index, kind):
    """None, a list, a NumPy array or a number where a tensor belongs: a TypeError naming
    the argument (not an AttributeError from the layout cache, which read None.device)."""
    entry, name, optional, call = _not_tensor_calls()[index]
    value = NOT_TENSORS[kind]
    if value == "numpy":
        value = pytest.importorskip("numpy").zeros((6, 8), dtype="float32")
    x, w, t = _ok()
    flce.fused_linear_cross_entropy(x, w, t)  # a checked layout must not let the bad call through
    with pytest.raises(TypeError, match=rf"\b{name} must be a (torch\.Tensor|tensor)"):
        call(value)
