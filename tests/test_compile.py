"""torch.compile(fullgraph=True) traces through flce (custom ops, no graph break) and
gives the eager results, for a forward+backward training step."""

import pytest
import torch

import flce


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
