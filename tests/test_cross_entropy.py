"""``flce.cross_entropy`` on given logits against the float64 reference."""

import pytest
import torch

import flce
from flce.reference import cross_entropy_reference

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _case(dtype, shape=(5, 7), vocab=31, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=gen) * 4).to(dtype)
    target = torch.randint(0, vocab, shape, generator=gen)
    target.view(-1)[::3] = -100
    return logits, target


OPTIONS = {
    "plain": {},
    "all": dict(label_smoothing=0.1, lse_square_scale=1e-3, softcap=5.0, use_token_scaling=True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("features", list(OPTIONS))
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_reference(dtype, reduction, features, weighted):
    logits, target = _case(dtype)
    weight = torch.rand(31) + 0.5 if weighted else None
    opts = dict(OPTIONS[features], reduction=reduction)
    ours_in = logits.clone().requires_grad_()
    before = ours_in.detach().clone()
    out = flce.cross_entropy(ours_in, target, weight=weight, return_z_loss=True, **opts)
    ref_in = logits.double().requires_grad_()
    ref = cross_entropy_reference(ref_in.view(-1, 31), target.view(-1), ce_weight=weight, **opts)
    ref_loss = ref.loss.view(target.shape) if reduction == "none" else ref.loss
    upstream = torch.randn(target.shape) if reduction == "none" else torch.tensor(0.7)
    (out.loss * upstream).sum().backward()
    (ref_loss * upstream.double()).sum().backward()
    assert out.loss.shape == ref_loss.shape
    torch.testing.assert_close(out.loss.double(), ref_loss, rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(ours_in.grad.double(), ref_in.grad, rtol=TOL[dtype], atol=TOL[dtype])
    assert ours_in.grad.dtype == dtype
    assert torch.equal(ours_in.detach(), before), "the caller's logits must not change"


def test_module_and_loss_only_path():
    logits, target = _case(torch.float32)
    module = flce.CrossEntropyLoss(label_smoothing=0.2)
    torch.testing.assert_close(module(logits, target), flce.cross_entropy(logits, target, label_smoothing=0.2))
    with pytest.raises(ValueError, match="accum_dtype"):
        flce.CrossEntropyLoss(accum_dtype=torch.float32)


def test_repeated_backward():
    logits, target = _case(torch.float32)
    logits.requires_grad_()
    loss = flce.cross_entropy(logits, target)
    loss.backward(torch.tensor(2.0), retain_graph=True)
    first = logits.grad.clone()
    loss.backward(torch.tensor(2.0))
    torch.testing.assert_close(logits.grad, 2 * first)


def test_first_index_wins_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0]])
    out = flce.cross_entropy(
        logits, torch.tensor([2, 0]), return_predicted_tokens=True, return_token_accuracy=True, reduction="none"
    )
    assert out.predicted_tokens.tolist() == [1, 0]
    assert out.token_accuracy.tolist() == [0.0, 1.0]
