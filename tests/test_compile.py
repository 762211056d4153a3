"""torch.compile(fullgraph=True) traces through flce (custom ops, no graph break) and
gives the eager results, for a forward+backward training step."""

import pytest
import torch

import flce
from flce.torch_version import TORCH_VERSION


def _inputs(reduction):
    torch.manual_seed(0)
    x = torch.randn(2, 9, 16, requires_grad=True)
    w = (torch.randn(37, 16) * 0.5).requires_grad_()
    b = torch.randn(37, requires_grad=True)
    t = torch.randint(0, 37, (2, 9))
    t[0, :3] = -100
    return x, w, b, t


# aot_eager for every reduction (fast); one inductor case proves codegen around the op.
@pytest.mark.parametrize(
    "backend,reduction,vocab_chunk_size",
    [
        ("aot_eager", "mean", None),
        ("aot_eager", "sum", None),
        ("aot_eager", "none", None),
        ("aot_eager", "none", 10),
        ("inductor", "mean", None),
    ],
)
def test_compiled_training_step_matches_eager(backend, reduction, vocab_chunk_size):
    def forward(x, w, b, t):
        out = flce.fused_linear_cross_entropy(
            torch.tanh(x),
            w,
            t,
            bias=b,
            reduction=reduction,
            label_smoothing=0.1,
            lse_square_scale=1e-3,
            return_z_loss=True,
            return_token_accuracy=True,
            vocab_chunk_size=vocab_chunk_size,
        )
        loss = (out.loss * torch.linspace(0.5, 2, 9)).sum() if reduction == "none" else out.loss * 1.5
        return loss, out.z_loss, out.token_accuracy

    torch._dynamo.reset()
    compiled = torch.compile(forward, fullgraph=True, backend=backend)
    eager_inputs, compiled_inputs = _inputs(reduction), _inputs(reduction)
    expected = forward(*eager_inputs)
    got = compiled(*compiled_inputs)
    expected[0].backward()
    got[0].backward()
    for e, g in zip(expected, got, strict=False):
        torch.testing.assert_close(g, e)
    for e, g in zip(eager_inputs[:3], compiled_inputs[:3], strict=False):
        torch.testing.assert_close(g.grad, e.grad)


def test_compiled_module_in_a_model():
    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 16)
            self.lm_head = torch.nn.Linear(16, 41, bias=False)
            self.loss = flce.FusedLinearCrossEntropyLoss()

        def forward(self, x, t):
            return self.loss(torch.relu(self.proj(x)), self.lm_head.weight, t)

    torch.manual_seed(0)
    model = Head()
    x, t = torch.randn(12, 16), torch.randint(0, 41, (12,))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss = compiled(x, t)
    loss.backward()
    torch.testing.assert_close(loss, model(x, t))
    assert model.lm_head.weight.grad is not None and model.proj.weight.grad is not None


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compiled_cross_entropy_on_given_logits(reduction):
    def forward(h, proj, t):
        logits = h @ proj.T  # (B, T, V)
        out = flce.cross_entropy(
            logits, t, reduction=reduction, label_smoothing=0.1, softcap=5.0, return_token_accuracy=True
        )
        loss = out.loss.sum() if reduction == "none" else out.loss
        return loss, out.token_accuracy

    torch._dynamo.reset()
    compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")
    grads = []
    for fn in (forward, compiled):
        torch.manual_seed(0)
        h = torch.randn(2, 9, 16, requires_grad=True)
        proj = torch.randn(23, 16, requires_grad=True)
        t = torch.randint(0, 23, (2, 9))
        loss, accuracy = fn(h, proj, t)
        loss.backward()
        grads.append((loss.detach(), accuracy, h.grad, proj.grad))
    for e, g in zip(*grads, strict=False):
        torch.testing.assert_close(g, e)


# A float option that changes from call to call (a smoothing, z-loss, temperature or beta
# schedule) becomes a symbolic float in the compiled function, as every float does under
# dynamic=True: validating the options must trace it, and each value must reach the op.
SCHEDULED_OPTION = {
    "label_smoothing": lambda x, w, t, s: flce.fused_linear_cross_entropy(x, w, t, label_smoothing=s),
    "lse_square_scale": lambda x, w, t, s: flce.fused_linear_cross_entropy(x, w, t, lse_square_scale=s),
    "cross_entropy": lambda x, w, t, s: flce.cross_entropy(x @ w.T, t, label_smoothing=s),
    "temperature": lambda x, w, t, s: flce.fused_linear_logprobs(x, w, t, temperature=1.0 + s).logprobs.sum(),
    "beta": lambda x, w, t, s: flce.fused_linear_distillation(x, w, x.detach(), w.detach().flip(0), t, beta=s),
}


@pytest.mark.parametrize(
    "option,dynamic",
    [(option, None) for option in SCHEDULED_OPTION] + [("label_smoothing", True), ("temperature", True)],
)
def test_a_float_option_changing_between_compiled_calls(option, dynamic):
    loss_of = SCHEDULED_OPTION[option]
    torch._dynamo.reset()
    compiled = torch.compile(loss_of, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    x, w, _, t = _inputs("mean")
    x = x.reshape(-1, 16)
    for value in (0.1, 0.2, 0.3):
        (grad,) = torch.autograd.grad(compiled(x, w, t.reshape(-1), value), x)
        (expected,) = torch.autograd.grad(loss_of(x, w, t.reshape(-1), value), x)
        torch.testing.assert_close(grad, expected)


@pytest.mark.parametrize("entry", ["fused", "cross_entropy"])
def test_compiled_extra_outputs_have_no_gradient_as_in_eager(entry):
    """The z-loss, accuracy and predictions are reported values: only the loss carries a
    gradient, compiled as eager (never a requires_grad output whose backward gives 0)."""
    x, w, _, t = _inputs("mean")
    extras = dict(lse_square_scale=1e-3, return_z_loss=True, return_token_accuracy=True, return_predicted_tokens=True)

    def call(x, w, t):
        if entry == "fused":
            return flce.fused_linear_cross_entropy(x, w, t, **extras)
        return flce.cross_entropy(x @ w.T, t, **extras)

    torch._dynamo.reset()
    for out in (call(x, w, t), torch.compile(call, backend="aot_eager", fullgraph=True)(x, w, t)):
        assert out.loss.requires_grad
        assert not any(v.requires_grad for v in (out.z_loss, out.token_accuracy, out.predicted_tokens))


def test_a_liger_loss_module_built_inside_the_compiled_function():
    """Older Liger model forwards build the loss module in the forward itself."""
    from flce.compat.liger import LigerFusedLinearCrossEntropyLoss

    x, w, _, t = _inputs("mean")
    x, t = x.reshape(-1, 16), t.reshape(-1)

    def loss_of(x, w, t):
        return LigerFusedLinearCrossEntropyLoss(label_smoothing=0.1)(w, x, t)

    torch._dynamo.reset()
    compiled = torch.compile(loss_of, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, w, t), loss_of(x, w, t))


def _liger_calls():
    from flce.compat import liger

    return {
        "fused_function": lambda x, w, t: liger.LigerFusedLinearCrossEntropyFunction.apply(
            x, w, t, label_smoothing=0.1
        )[0],
        "fused_functional": lambda x, w, t: liger.liger_fused_linear_cross_entropy(x, w, t, label_smoothing=0.1),
        "cross_entropy_function": lambda x, w, t: liger.LigerCrossEntropyFunction.apply(
            x @ w.T, t, None, label_smoothing=0.1
        )[0],
        "cross_entropy_functional": lambda x, w, t: liger.liger_cross_entropy(x @ w.T, t, label_smoothing=0.1),
        "cross_entropy_module": lambda x, w, t: liger.LigerCrossEntropyLoss(label_smoothing=0.1)(x @ w.T, t),
    }


@pytest.mark.parametrize(
    "entry",
    [
        "fused_function",
        "fused_functional",
        "cross_entropy_function",
        "cross_entropy_functional",
        "cross_entropy_module",
    ],
)
def test_every_liger_shim_compiles_in_one_graph(entry):
    """The other Liger shims, compiled whole (torch 2.11's dynamo could not trace the
    ``locals()`` they read their options with)."""
    x, w, _, t = _inputs("mean")
    x, t = x.reshape(-1, 16), t.reshape(-1)
    loss_of = _liger_calls()[entry]
    torch._dynamo.reset()
    compiled = torch.compile(loss_of, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, w, t), loss_of(x, w, t))


# A torch.func transform or forward-mode AD traced by torch.compile: the custom ops carry
# no tangent (PyTorch gives them none, silently), so every entry point refuses by name
# under compilation as it does eagerly, instead of a compiled jvp whose tangent is 0.
TRANSFORMED_CALLS = {
    "fused": lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t),
    "cross_entropy": lambda x, w, t: flce.cross_entropy(x @ w.T, t),
    "logprobs": lambda x, w, t: flce.fused_linear_logprobs(x, w, t).logprobs.sum(),
    "distillation": lambda x, w, t: flce.fused_linear_distillation(x, w, x.detach(), w.detach(), t),
}


def _under_transform(transform, loss_of, x):
    tangent = torch.ones_like(x)
    if transform == "jvp":
        return torch.func.jvp(loss_of, (x,), (tangent,))
    if transform == "grad":
        return torch.func.grad(loss_of)(x)
    with torch.autograd.forward_ad.dual_level():
        loss = loss_of(torch.autograd.forward_ad.make_dual(x, tangent))
        return torch.autograd.forward_ad.unpack_dual(loss).tangent


@pytest.mark.parametrize("transform", ["jvp", "dual", "grad"])
@pytest.mark.parametrize("entry", list(TRANSFORMED_CALLS))
def test_function_transforms_are_refused_under_compile(entry, transform):
    x, w, _, t = _inputs("mean")
    x, w, t = x.detach().reshape(-1, 16), w.detach(), t.reshape(-1)
    loss_of = TRANSFORMED_CALLS[entry]
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda x: _under_transform(transform, lambda v: loss_of(v, w, t), x), backend="aot_eager", fullgraph=True
    )
    with pytest.raises(RuntimeError) as raised:
        compiled(x)
    if TORCH_VERSION < (2, 11):
        # Dynamo in torch 2.6-2.8 (seen there; 2.11 carries the refusal out) does not re-raise an
        # exception raised in traced code out of a fullgraph compile: it fails the compile with
        # its own error instead (a refusal still).
        assert isinstance(raised.value, torch._dynamo.exc.TorchDynamoException), raised.value
    else:
        assert "does not support torch.func transforms" in str(raised.value)


# ------------------------------------------------------------------ the custom ops

# Hidden states as a compiled model may hand them over: contiguous, transposed (a
# sequence-first activation seen batch-first), a column slice of a wider tensor.
LAYOUTS = {
    "contiguous": lambda x: x,
    "transposed": lambda x: x.t().contiguous().t(),
    "column_slice": lambda x: torch.cat([x, x], dim=1)[:, 3 : 3 + x.shape[1]],
}


def _op_calls(layout):
    """(name, op, arguments) of every flce custom op, on inputs laid out by ``layout``."""
    from flce import ops
    from flce.options import DistillationOptions, LogprobsOptions, LossOptions, option_values

    torch.manual_seed(0)
    n, v, h = 6, 11, 8
    x = LAYOUTS[layout](torch.randn(n, h)).requires_grad_()
    w = LAYOUTS[layout](torch.randn(v, h)).requires_grad_()
    b = torch.randn(v, requires_grad=True)
    logits = LAYOUTS[layout](torch.randn(n, v)).requires_grad_()
    consts = (x.detach(), w.detach())  # the backward ops' inputs
    t = torch.randint(0, v, (n,))
    t[0] = -100
    weights = torch.rand(v) + 0.1
    calls = []
    for reduction in ("mean", "none"):
        values = option_values(LossOptions(reduction=reduction, label_smoothing=0.1, return_token_accuracy=True))
        upstream = torch.randn(n) if reduction == "none" else torch.tensor(1.5)
        flags = (torch.float32, True, True, True)
        calls += [
            (f"fused_fwd_{reduction}", ops.fused_linear_cross_entropy_fwd, (x, w, t, b, weights, *values, *flags)),
            (
                f"fused_bwd_{reduction}",
                ops.fused_linear_cross_entropy_bwd,
                (upstream, *consts, t, b.detach(), weights, *values, *flags),
            ),
            (f"ce_fwd_{reduction}", ops.cross_entropy_fwd, (logits, t, weights, *values, True)),
            (f"ce_bwd_{reduction}", ops.cross_entropy_bwd, (upstream, logits.detach(), t, weights, *values)),
        ]
    values = option_values(LogprobsOptions(return_entropy=True, return_predicted_tokens=True))
    kept = t.clamp(min=0)
    lse = torch.logsumexp((x @ w.T + b).double(), dim=1).detach()
    upstreams = (torch.randn(n), torch.randn(n))
    calls += [
        ("logprobs_fwd", ops.fused_linear_logprobs_fwd, (x, w, b, kept, *values, torch.float32)),
        (
            "logprobs_bwd",
            ops.fused_linear_logprobs_bwd,
            (*upstreams, *consts, b.detach(), kept, lse, torch.rand(n), *values, torch.float32, True, True, True),
        ),
    ]
    teacher = (x.detach().flip(0), w.detach().flip(0), None)
    for reduction in ("mean", "none"):
        values = option_values(DistillationOptions(reduction=reduction, beta=0.3))
        flags = (torch.float32, torch.float32, True, True, True)
        upstream = torch.randn(n) if reduction == "none" else torch.tensor(0.5)
        calls += [
            (
                f"distillation_fwd_{reduction}",
                ops.fused_linear_distillation_fwd,
                (x, w, b, *teacher, t, *values, *flags),
            ),
            (
                f"distillation_bwd_{reduction}",
                ops.fused_linear_distillation_bwd,
                (upstream, *consts, b.detach(), *teacher, t, *values, *flags),
            ),
        ]
    return calls


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_custom_ops_pass_opcheck(layout):
    """Schema, registered autograd, and fake implementations whose outputs have the real
    ones' shapes, dtypes and strides (what the compiled graph is built from), whatever
    the inputs' strides."""
    failures = {}
    for name, op, arguments in _op_calls(layout):
        report = torch.library.opcheck(op, arguments, raise_exception=False)
        bad = {test: str(result)[:300] for test, result in report.items() if result != "SUCCESS"}
        if bad:
            failures[name] = bad
    assert not failures, failures


def test_inductor_step_on_transposed_hidden_states():
    """A 2-D input with transposed strides: inductor checks each custom op's outputs
    against the fake's strides (it raised here when dX came back transposed)."""

    def step(x, w, t):
        return flce.fused_linear_cross_entropy(x, w, t, label_smoothing=0.1)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    grads = []
    for fn in (step, compiled):
        torch.manual_seed(0)
        x = torch.randn(16, 9).t().requires_grad_()
        w = torch.randn(23, 16, requires_grad=True)
        t = torch.randint(0, 23, (9,))
        loss = fn(x, w, t)
        loss.backward()
        grads.append((loss.detach(), x.grad, w.grad))
    for e, g in zip(*grads, strict=True):
        torch.testing.assert_close(g, e)


def test_a_backend_argument_compiles_without_warnings(monkeypatch):
    """backend= is spelled out inside the compiled function (LossOptions): no Dynamo
    warning about tracing a cached function (Dynamo warns once per process: its record
    of warnings given is emptied first)."""
    import warnings

    monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set())
    x, w, _, t = _inputs("mean")

    def loss_of(x, w, t):
        return flce.fused_linear_cross_entropy(x, w, t, backend="Torch")

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = torch.compile(loss_of, backend="aot_eager", fullgraph=True)(x, w, t)
    torch.testing.assert_close(loss, loss_of(x, w, t))
    assert not [str(warning.message) for warning in caught if "lru_cache" in str(warning.message)]


class _ExportedHead(torch.nn.Module):
    """A model's loss head as ``torch.export`` sees it: hidden states and targets in, the
    fused loss (or a head's output) out."""

    def __init__(self, head: str) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        self.head = head
        self.weight = torch.nn.Parameter(torch.randn(37, 16, generator=gen) * 0.5)
        self.register_buffer("teacher_weight", torch.randn(37, 16, generator=gen) * 0.5)

    def forward(self, x, t):
        if self.head == "cross_entropy":
            return flce.fused_linear_cross_entropy(x, self.weight, t, reduction="none", label_smoothing=0.1)
        if self.head == "logits":
            return flce.cross_entropy(x @ self.weight.T, t, reduction="none")
        if self.head == "logprobs":
            return flce.fused_linear_logprobs(x, self.weight, t).logprobs
        if self.head == "liger":
            from flce.compat.liger import liger_fused_linear_cross_entropy

            return liger_fused_linear_cross_entropy(x, self.weight, t, reduction="none")
        return flce.fused_linear_distillation(x, self.weight, x, self.teacher_weight, t, reduction="none")


@pytest.mark.parametrize("head", ["cross_entropy", "logits", "logprobs", "distillation", "liger"])
@pytest.mark.parametrize("leading", [(9,), (3, 5)], ids=["N", "B,T"])
def test_non_strict_export_keeps_a_dynamic_batch(head, leading):
    """torch.export(strict=False) with dynamic leading sizes: the boundary checks must not
    fix a symbolic size (``torch.Size.numel()`` did: "specialized it to be a constant (9)"),
    and the exported program gives the eager result at other sizes."""
    model = _ExportedHead(head)
    dims = [torch.export.Dim(f"d{i}", min=2, max=64) for i in range(len(leading))]
    dynamic = dict(enumerate(dims))
    x, t = torch.randn(*leading, 16), torch.randint(0, 37, leading)
    exported = torch.export.export(model, (x, t), strict=False, dynamic_shapes=(dynamic, dynamic))
    other = tuple(size + 2 for size in leading)
    x, t = torch.randn(*other, 16), torch.randint(0, 37, other)
    t.view(-1)[0] = -100
    torch.testing.assert_close(exported.module()(x, t), model(x, t))


STRUCTURED_OUTPUTS = {
    "cross_entropy": lambda m, x, t: flce.fused_linear_cross_entropy(
        x, m.weight, t, lse_square_scale=1e-3, return_z_loss=True, return_predicted_tokens=True
    ),
    "logprobs": lambda m, x, t: flce.fused_linear_logprobs(x, m.weight, t, return_entropy=True),
}


@pytest.mark.parametrize("head", list(STRUCTURED_OUTPUTS))
def test_a_model_returning_a_structured_output_exports(head):
    """``CrossEntropyOutput`` and ``LogprobsOutput`` are pytree nodes: a model returning one
    exports (torch.export refused it as an unknown output type) and its program returns
    the same object, its None fields included."""

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(37, 16, generator=torch.Generator().manual_seed(3)))

        def forward(self, x, t):
            return STRUCTURED_OUTPUTS[head](self, x, t)

    model, x, t = Head(), torch.randn(9, 16), torch.randint(0, 37, (9,))
    got, expected = torch.export.export(model, (x, t)).module()(x, t), model(x, t)
    assert type(got) is type(expected)
    for name, value in vars(expected).items():
        if value is None:
            assert getattr(got, name) is None, name
        else:
            torch.testing.assert_close(getattr(got, name), value)


EXPORTED_LOSSES = {
    "fused-mean": lambda m, x, t: flce.fused_linear_cross_entropy(x, m.weight, t, bias=m.bias, label_smoothing=0.1),
    "fused-none": lambda m, x, t: flce.fused_linear_cross_entropy(x, m.weight, t, bias=m.bias, reduction="none"),
    "cross_entropy": lambda m, x, t: flce.cross_entropy(x @ m.weight.T + m.bias, t, reduction="sum"),
    "distillation": lambda m, x, t: flce.fused_linear_distillation(
        x, m.weight, x, m.weight.detach().flip(0), t, student_bias=m.bias
    ),
}


class _TrainedHead(torch.nn.Module):
    def __init__(self, loss: str) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(2)
        self.loss = loss
        self.weight = torch.nn.Parameter(torch.randn(37, 16, generator=gen) * 0.5)
        self.bias = torch.nn.Parameter(torch.randn(37, generator=gen))

    def forward(self, x, t):
        loss = EXPORTED_LOSSES[self.loss](self, torch.tanh(x), t)
        return loss if loss.dim() == 0 else (loss * torch.linspace(0.5, 2, loss.numel())).sum()


@pytest.mark.parametrize("traced", ["no_grad", "input_without_grad"])
@pytest.mark.parametrize("loss", list(EXPORTED_LOSSES))
def test_an_exported_program_gives_the_gradients_its_run_needs(loss, traced):
    """An exported program keeps which gradients its custom ops compute in the forward as
    traced (none under torch.no_grad(); no dX for an input that did not require grad); run
    with autograd where more are needed, it must still give them, as eager (it gave None)."""
    model = _TrainedHead(loss)
    x, t = torch.randn(9, 16, requires_grad=traced == "no_grad"), torch.randint(0, 37, (9,))
    with torch.set_grad_enabled(traced != "no_grad"):
        exported = torch.export.export(model, (x, t), strict=False).module()
    x = torch.randn(9, 16, requires_grad=True)
    params = dict(exported.named_parameters())
    got = torch.autograd.grad(exported(x, t), (x, params["weight"], params["bias"]), allow_unused=True)
    expected = torch.autograd.grad(model(x, t), (x, model.weight, model.bias))
    for g, e in zip(got, expected, strict=True):
        assert g is not None
        torch.testing.assert_close(g, e)
