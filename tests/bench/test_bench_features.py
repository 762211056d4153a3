"""``flce bench --features`` beyond the loss's scalar options: the LM-head bias, token
scaling, token accuracy and predicted tokens. Each feature must reach every method that
takes it (checked against a float64 reference, and against the same call without it),
be recorded in the JSON, and make the methods that lack it skip with a reason."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

import flce
from flce.bench import ce_kernel
from flce.bench.cases import FEATURES, BenchCase, BenchLossSettings, Inputs, Shape, make_inputs
from flce.bench.cli import bench_parser, run_bench
from flce.bench.methods import Method, as_loss
from flce.bench.peers import cce, liger
from flce.bench.peers.flce_backends import flce_loss_kwargs
from flce.bench.peers.optional import optional_import
from flce.bench.peers.torch_eager import eager_loss
from flce.bench.registry import all_methods
from flce.bench.timing import call_once
from flce.cli import main
from flce.reference import cross_entropy_reference, fused_linear_cross_entropy_reference

NEW_FEATURES = ("bias", "token_scaling", "accuracy", "predicted")
# Field of the benchmark's BenchLossSettings that each new feature turns on.
FEATURE_FIELDS = {
    "bias": "use_bias",
    "token_scaling": "use_token_scaling",
    "accuracy": "return_token_accuracy",
    "predicted": "return_predicted_tokens",
}
# Key of each in the JSON's loss_options (the bias beside ce_weight, the flags by flce's keyword).
RECORDED_KEYS = {
    "bias": "bias",
    "token_scaling": "use_token_scaling",
    "accuracy": "return_token_accuracy",
    "predicted": "return_predicted_tokens",
}
# The peers that run on the CPU, or skip there with a reason of their own.
PEERS = "flce:torch,torch:eager,torch:lce,liger,cce"
# PyTorch's chunked linear_cross_entropy is newer than some supported releases (2.11 has none):
# there the method is skipped for that reason, whatever the features.
HAS_TORCH_LCE = hasattr(F, "linear_cross_entropy")
requires_torch_lce = pytest.mark.skipif(not HAS_TORCH_LCE, reason="this PyTorch has no F.linear_cross_entropy")


def _torch_lce_skip_reason(unsupported: str) -> str:
    """What the CLI reports for ``torch:lce`` on a case with the ``unsupported`` features."""
    if not HAS_TORCH_LCE:
        return f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy"
    return f"torch linear_cross_entropy (chunked) does not support {unsupported}"


# Tiny, with V and H not powers of two; a quarter of the rows ignored, so accuracy and
# the reductions' denominators are not trivially the row count.
TINY = [
    "--device",
    "cpu",
    "--tokens",
    "64",
    "--vocab",
    "250",
    "--hidden",
    "36",
    "--rounds",
    "1",
    "--warmup",
    "0",
    "--ignore-fraction",
    "0.25",
    "--no-plots",
]
SHAPE = Shape(n=64, v=250, h=36)
# Every feature at once: the scalar options change the rows that token scaling weighs.
ALL = ",".join(FEATURES)


def _fake_module(monkeypatch: pytest.MonkeyPatch, name: str, **attributes) -> None:
    """An importable module ``name`` (and its top-level package) holding ``attributes``,
    so a peer that is not installed here reaches its feature check."""
    module = ModuleType(name)
    for key, value in attributes.items():
        setattr(module, key, value)
    top = name.split(".")[0]
    if top != name:
        monkeypatch.setitem(sys.modules, top, ModuleType(top))
    monkeypatch.setitem(sys.modules, name, module)
    optional_import.cache_clear()


def _fake_liger(monkeypatch: pytest.MonkeyPatch, fused_loss) -> None:
    """A Liger whose ``liger_fused_linear_cross_entropy`` is ``fused_loss``."""
    _fake_module(monkeypatch, liger.LIGER_FUNCTIONAL, liger_fused_linear_cross_entropy=fused_loss)


@pytest.fixture(autouse=True)
def _fresh_imports():
    yield
    optional_import.cache_clear()


def _method(name: str) -> Method:
    return next(m for m in all_methods() if m.name == name)


def _case(features: str, mode: str = "full", reduction: str = "mean", device: str = "cpu") -> BenchCase:
    opts = BenchLossSettings.from_features(features.split(",") if features else (), reduction=reduction)
    return BenchCase(SHAPE, torch.float32, mode, opts, torch.device(device))


def _reference(inputs: Inputs, opts: BenchLossSettings):
    """The float64 reference of the run's loss on the benchmark's inputs."""
    return fused_linear_cross_entropy_reference(
        inputs.x.detach().double(),
        inputs.w.detach().double(),
        inputs.target,
        None if inputs.bias is None else inputs.bias.detach().double(),
        ce_weight=inputs.ce_weight,
        ignore_index=opts.ignore_index,
        lse_square_scale=opts.lse_square_scale,
        label_smoothing=opts.label_smoothing,
        reduction=opts.reduction,
        softcap=opts.softcap,
        use_token_scaling=opts.use_token_scaling,
    )


def _run(tmp_path: Path, *argv: str) -> dict:
    assert run_bench(bench_parser().parse_args([*TINY, *argv, "--out", str(tmp_path)])) == 0
    return json.loads(next(tmp_path.glob("*.json")).read_text())


def _rows(payload: dict) -> dict[str, dict]:
    return {row["method"]: row for row in payload["results"]}


# ----------------------------------------------------------------------------- options


@pytest.mark.parametrize("feature", NEW_FEATURES)
def test_each_new_feature_turns_on_its_option_alone(feature: str) -> None:
    opts = BenchLossSettings.from_features([feature])
    assert opts.enabled() == (feature,)
    for name, field in FEATURE_FIELDS.items():
        assert getattr(opts, field) is (name == feature), field
    assert BenchLossSettings().enabled() == ()


def test_enabled_follows_features_order_whatever_the_order_given() -> None:
    assert FEATURES[-4:] == NEW_FEATURES
    assert BenchLossSettings.from_features(list(reversed(FEATURES))).enabled() == FEATURES


def test_flags_name_flce_keywords_and_only_those_on() -> None:
    opts = BenchLossSettings.from_features(["bias", "accuracy", "predicted"])
    assert opts.flags() == {"return_token_accuracy": True, "return_predicted_tokens": True}
    kwargs = flce_loss_kwargs(BenchLossSettings.from_features(["token_scaling", "accuracy"]), "torch")
    assert kwargs["use_token_scaling"] and kwargs["return_token_accuracy"] and not kwargs["return_predicted_tokens"]
    # The same keywords build the library's options (the CE-kernel benchmark does this).
    library = ce_kernel.flce_options(BenchLossSettings.from_features(list(FEATURES)))
    assert library.use_token_scaling and library.return_token_accuracy and library.return_predicted_tokens


def test_unknown_feature_is_rejected_naming_the_valid_ones(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ValueError, match="unknown feature") as error:
        BenchLossSettings.from_features(["bias", "accuracies"])
    message = str(error.value)
    assert "'accuracies'" in message
    assert all(f"'{name}'" in message for name in FEATURES)

    assert run_bench(bench_parser().parse_args([*TINY, "--features", "bias,logit_bias"])) == 2
    err = capsys.readouterr().err
    assert "logit_bias" in err and all(name in err for name in FEATURES)


# ----------------------------------------------------------------------------- inputs


def test_bias_is_a_parameter_drawn_after_the_other_inputs() -> None:
    plain = make_inputs(_case("weights"), seed=3, ignore_fraction=0.25)
    biased = make_inputs(_case("weights,bias"), seed=3, ignore_fraction=0.25)
    assert plain.bias is None and plain.params() == (plain.x, plain.w)
    # The same inputs otherwise, so a run with the bias differs from one without by it alone.
    for name in ("x", "w", "target", "ce_weight"):
        assert torch.equal(getattr(plain, name), getattr(biased, name)), name
    bias = biased.bias
    assert bias.shape == (SHAPE.v,) and bias.dtype == biased.w.dtype and bias.requires_grad
    assert 0.05 < bias.std().item() < 0.2  # BIAS_STD = 0.1
    assert biased.params() == (biased.x, biased.w, bias)
    assert not make_inputs(_case("bias", mode="fwd")).bias.requires_grad


@pytest.mark.parametrize("mode", ["full", "bwd"])
def test_each_call_gives_the_bias_a_fresh_gradient(mode: str) -> None:
    """The bias's gradient is made by the call and dropped after it, like X's and W's, so
    every timed call allocates (and is charged for) its own."""
    case = _case("bias", mode=mode)
    inputs = make_inputs(case)
    workload = _method("flce:torch").workload(case, inputs)
    workload.run(workload.setup())
    assert all(p.grad is not None for p in inputs.params())
    workload.teardown()
    assert all(p.grad is None for p in inputs.params())
    call_once(workload)
    assert inputs.bias.grad is None


# ----------------------------------------------------------------------------- each method's call


@pytest.mark.parametrize(
    "method",
    ["flce:torch", "flce:torch[vblocks=16]", "torch:eager", pytest.param("torch:lce", marks=requires_torch_lce)],
)
@pytest.mark.parametrize("features", ["bias", "weights,bias"])
def test_methods_add_the_bias_and_give_it_a_gradient(method: str, features: str) -> None:
    case = _case(features)
    inputs = make_inputs(case, ignore_fraction=0.25)
    m = _method(method)
    assert m.check(case) is None
    loss = m.make_loss(case, inputs)()
    expected = _reference(inputs, case.loss).loss
    without_bias = _reference(Inputs(inputs.x, inputs.w, inputs.target, inputs.ce_weight), case.loss)
    assert abs(expected - without_bias.loss).item() > 1e-3  # the bias moves the loss
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)

    loss.backward()
    logits = inputs.x.detach().double() @ inputs.w.detach().double().t() + inputs.bias.detach().double()
    logits.requires_grad_(True)
    cross_entropy_reference(logits, inputs.target, ce_weight=inputs.ce_weight).loss.backward()
    torch.testing.assert_close(inputs.bias.grad.double(), logits.grad.sum(0), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("features", ["token_scaling", "accuracy,predicted", ALL])
def test_eager_matches_the_reference_with_its_outputs(features: str, reduction: str) -> None:
    case = _case(features, reduction=reduction)
    inputs = make_inputs(case, ignore_fraction=0.25)
    opts = case.loss
    out = eager_loss(inputs.x, inputs.w, inputs.target, inputs.ce_weight, opts, inputs.bias)
    ref = _reference(inputs, opts)
    if not opts.returns_extras:
        assert isinstance(out, torch.Tensor)
        torch.testing.assert_close(out.double(), ref.loss, rtol=1e-5, atol=1e-6)
        return
    loss, accuracy, predicted = out
    torch.testing.assert_close(loss.double(), ref.loss, rtol=1e-5, atol=1e-6)
    if opts.return_token_accuracy:
        assert not accuracy.requires_grad
        torch.testing.assert_close(accuracy.double(), ref.token_accuracy)
        assert 0.0 < accuracy.item() < 1.0  # neither trivially all right nor all wrong
    else:
        assert accuracy is None
    assert not predicted.requires_grad and torch.equal(predicted, ref.predicted_tokens)
    assert (predicted[inputs.target == opts.ignore_index] == -1).all()


@pytest.mark.parametrize("features", ["token_scaling", ALL])
def test_eager_token_scaling_gradient_treats_the_scale_as_a_constant(features: str) -> None:
    """The scale ``p(target)`` is detached in the contract: the gradient differs if it is not."""
    case = _case(features)
    inputs = make_inputs(case, ignore_fraction=0.25)
    opts = case.loss
    loss = as_loss(eager_loss(inputs.x, inputs.w, inputs.target, inputs.ce_weight, opts, inputs.bias))
    loss.backward()
    x = inputs.x.detach().double().requires_grad_(True)
    reference = fused_linear_cross_entropy_reference(
        x,
        inputs.w.detach().double(),
        inputs.target,
        None if inputs.bias is None else inputs.bias.detach().double(),
        ce_weight=inputs.ce_weight,
        ignore_index=opts.ignore_index,
        lse_square_scale=opts.lse_square_scale,
        label_smoothing=opts.label_smoothing,
        reduction=opts.reduction,
        softcap=opts.softcap,
        use_token_scaling=True,
    )
    reference.loss.backward()
    torch.testing.assert_close(inputs.x.grad.double(), x.grad, rtol=1e-4, atol=1e-7)


def test_token_scaling_changes_the_loss() -> None:
    plain, scaled = (
        make_inputs(_case(features), ignore_fraction=0.25)
        for features in ("z_loss,weights", "z_loss,weights,token_scaling")
    )
    plain_loss = eager_loss(plain.x, plain.w, plain.target, plain.ce_weight, _case("z_loss,weights").loss)
    scaled_opts = _case("z_loss,weights,token_scaling").loss
    scaled_loss = eager_loss(scaled.x, scaled.w, scaled.target, scaled.ce_weight, scaled_opts)
    assert scaled_loss.item() < plain_loss.item() - 1e-3  # every row weighed by p(target) < 1


def test_flce_method_returns_the_per_token_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """flce's call gets the flags and the bias: the outputs it returned match the reference."""
    returned = []

    public = flce.fused_linear_cross_entropy

    def recording(*args, **kwargs):
        out = public(*args, **kwargs)
        returned.append((out, kwargs))
        return out

    monkeypatch.setattr(flce, "fused_linear_cross_entropy", recording)
    case = _case(ALL)
    inputs = make_inputs(case, ignore_fraction=0.25)
    loss = _method("flce:torch").make_loss(case, inputs)()
    ((out, kwargs),) = returned
    assert kwargs["bias"] is inputs.bias and kwargs["ce_weight"] is inputs.ce_weight
    ref = _reference(inputs, case.loss)
    assert loss is out.loss
    torch.testing.assert_close(out.loss.double(), ref.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.token_accuracy.double(), ref.token_accuracy)
    assert torch.equal(out.predicted_tokens, ref.predicted_tokens)


def test_liger_triton_gets_bias_and_flags_when_it_takes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fused_loss_085(
        input,
        weight,
        target,
        bias=None,
        ce_weight=None,
        ignore_index=-100,
        lse_square_scale=0.0,
        label_smoothing=0.0,
        reduction="mean",
        softcap=None,
        return_z_loss=False,
        accum_dtype=None,
        use_token_scaling=False,
        return_token_accuracy=False,
        return_predicted_tokens=False,
    ):
        calls.append(
            {
                "bias": bias,
                "use_token_scaling": use_token_scaling,
                "accuracy": return_token_accuracy,
                "predicted": return_predicted_tokens,
            }
        )
        return (input.sum() * 0, None, None, None)

    _fake_liger(monkeypatch, fused_loss_085)
    case = _case(ALL, device="cuda")  # the check reads the device type only
    assert _method("liger:triton").check(case) is None
    cpu_case = _case(ALL)
    inputs = make_inputs(cpu_case)
    _method("liger:triton").make_loss(cpu_case, inputs)()
    assert calls == [{"bias": inputs.bias, "use_token_scaling": True, "accuracy": True, "predicted": True}]


def test_older_liger_triton_is_skipped_for_the_flags_it_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fused_loss_old(
        input,
        weight,
        target,
        bias=None,
        ce_weight=None,
        ignore_index=-100,
        lse_square_scale=0.0,
        label_smoothing=0.0,
        reduction="mean",
        softcap=None,
        return_z_loss=False,
    ):
        calls.append(bias)
        return input.sum() * 0

    _fake_liger(monkeypatch, fused_loss_old)
    liger = _method("liger:triton")
    why = liger.check(_case(ALL, device="cuda"))
    assert why == "Liger Triton FLCE does not support token_scaling, accuracy, predicted"
    assert liger.check(_case("softcap,weights,bias", device="cuda")) is None
    # Features off: called exactly as before, no keyword it does not know.
    case = _case("bias")
    inputs = make_inputs(case)
    liger.make_loss(case, inputs)()
    assert calls == [inputs.bias]


def test_torch_lce_without_linear_bias_is_skipped_for_bias(monkeypatch: pytest.MonkeyPatch) -> None:
    def old_linear_cross_entropy(
        input,
        linear_weight,
        target,
        *,
        weight=None,
        reduction="mean",
        ignore_index=None,
        label_smoothing=0.0,
        options=None,
    ):
        raise AssertionError("not called")

    monkeypatch.setattr(F, "linear_cross_entropy", old_linear_cross_entropy, raising=False)
    if not hasattr(torch.nn, "LinearCrossEntropyOptions"):  # a PyTorch older than the chunked loss
        monkeypatch.setattr(
            torch.nn, "LinearCrossEntropyOptions", type("LinearCrossEntropyOptions", (), {}), raising=False
        )
    check = _method("torch:lce").check
    assert check(_case("bias")) == "torch linear_cross_entropy (chunked) does not support bias"
    assert check(_case("weights")) is None


# ----------------------------------------------------------------------------- end to end


@pytest.mark.usefixtures("no_peers")
@pytest.mark.parametrize("feature", NEW_FEATURES)
def test_cli_runs_each_new_feature_and_skips_peers_that_lack_it(tmp_path: Path, feature: str) -> None:
    payload = _run(tmp_path, "--features", feature, "--methods", PEERS)
    assert payload["config"]["features"] == [feature]
    recorded = payload["config"]["loss_options"]
    for name, key in RECORDED_KEYS.items():
        assert recorded[key] is (name == feature), name
    rows = _rows(payload)
    for method in ("floor:gemm", "flce:torch", "torch:eager"):
        assert rows[method]["status"] == "ok", rows[method]
    assert rows["flce:torch"]["loss"] == pytest.approx(rows["torch:eager"]["loss"], rel=1e-5)
    # torch's chunked loss takes a bias and nothing else of these; CCE none of them.
    lce = rows["torch:lce"]
    if feature == "bias" and HAS_TORCH_LCE:
        assert lce["status"] == "ok" and lce["loss"] == pytest.approx(rows["torch:eager"]["loss"], rel=1e-5)
    else:
        assert lce["status"] == "skipped"
        assert lce["reason"] == _torch_lce_skip_reason(feature)
    assert rows["cce"]["status"] == "skipped" and "cut-cross-entropy is not installed" in rows["cce"]["reason"]
    assert (
        rows["liger:triton"]["status"] == "skipped"
        and "liger-kernel is not installed" in rows["liger:triton"]["reason"]
    )


@pytest.mark.usefixtures("no_peers")
@pytest.mark.parametrize("mode", ["full", "fwd", "bwd"])
def test_cli_runs_all_features_together(tmp_path: Path, mode: str) -> None:
    payload = _run(
        tmp_path,
        "--mode",
        mode,
        "--features",
        "bias,token_scaling,accuracy,predicted,label_smoothing,z_loss,softcap,weights",
        "--methods",
        PEERS,
    )
    assert payload["config"]["features"] == list(FEATURES)
    assert payload["config"]["loss_options"] == {
        "reduction": "mean",
        "ignore_index": -100,
        "label_smoothing": 0.1,
        "lse_square_scale": 1e-4,
        "softcap": 30.0,
        "ce_weight": True,
        "bias": True,
        "use_token_scaling": True,
        "return_token_accuracy": True,
        "return_predicted_tokens": True,
    }
    rows = _rows(payload)
    for method in ("floor:gemm", "flce:torch", "torch:eager"):
        assert rows[method]["status"] == "ok" and rows[method]["median_ms"] > 0, rows[method]
    assert rows["flce:torch"]["loss"] == pytest.approx(rows["torch:eager"]["loss"], rel=1e-5)
    assert rows["torch:lce"]["reason"] == _torch_lce_skip_reason(
        "label_smoothing, z_loss, softcap, token_scaling, accuracy, predicted"
    )
    for method in ("cce", "liger:triton", "liger:cute-sm90"):
        assert rows[method]["status"] == "skipped" and rows[method]["reason"], method


@pytest.mark.parametrize("feature", NEW_FEATURES)
def test_installed_peers_without_a_feature_give_it_as_the_reason(monkeypatch: pytest.MonkeyPatch, feature) -> None:
    """CCE and Liger's SM90 kernel take none of the new features: on a CUDA case (the
    checks read the device type only) the reason names the feature."""
    _fake_module(monkeypatch, cce.CCE, linear_cross_entropy=None)
    _fake_module(monkeypatch, liger.LIGER_SM90, liger_fused_linear_cross_entropy_sm90=None)
    case = _case(f"softcap,{feature}", device="cuda")
    assert _method("cce").check(case) == f"CCE does not support {feature}"
    assert _method("liger:cute-sm90").check(case) == f"Liger CuTe SM90 FLCE does not support softcap, {feature}"


# ----------------------------------------------------------------------------- --kernel ce


@pytest.mark.usefixtures("no_peers")
def test_kernel_bench_takes_the_per_token_features_but_no_bias(tmp_path: Path, capsys) -> None:
    base = [
        "bench",
        "--kernel",
        "ce",
        "--device",
        "cpu",
        "--tokens",
        "12",
        "--vocab",
        "250",
        "--rounds",
        "1",
        "--warmup",
        "0",
        "--overhead-calls",
        "0",
        "--methods",
        "flce:torch,torch:eager",
    ]
    assert main([*base, "--features", "weights,bias"]) == 2
    assert "--kernel ce does not take --features bias" in capsys.readouterr().err

    assert main([*base, "--features", "token_scaling,accuracy,predicted,weights", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "bench-kernel-ce.json").read_text())
    assert payload["config"]["features"] == ["weights", "token_scaling", "accuracy", "predicted"]
    rows = _rows(payload)
    reference = rows["torch:eager"]["loss"]
    for method in ("flce:torch:kernel", "flce:torch"):
        assert rows[method]["status"] == "ok" and rows[method]["loss"] == pytest.approx(reference, rel=1e-5)


def test_liger_ce_kernels_are_skipped_for_token_scaling() -> None:
    case = ce_kernel.KernelCase(
        12, 256, torch.bfloat16, BenchLossSettings.from_features(["token_scaling", "accuracy"]), torch.device("cuda")
    )
    assert ce_kernel._liger_features(case) == "Liger CE does not support token_scaling"
    on_request = ce_kernel.KernelCase(
        12, 256, torch.bfloat16, BenchLossSettings.from_features(["accuracy", "predicted"]), torch.device("cuda")
    )
    assert ce_kernel._liger_features(on_request) is None
