"""dX beside dW and db on two streams (``flce.driver.gemm.run_beside``) gives the same bits
as one stream, on every backend and scheme: one chunk, token chunks with the fp32 dW
accumulator, vocabulary blocks, a bias, and a small call replayed from flce's own CUDA
graph (captured with the side stream forked from and joined to the capturing one)."""

import pytest
import torch

import flce
from flce.driver import gemm
from tests.gpu.common import CUDA, skip_unless_usable

if not torch.cuda.is_available():
    pytest.skip("gradient-stream tests: need a CUDA GPU", allow_module_level=True)

pytestmark = pytest.mark.gpu

N, H, V = 512, 256, 4000
SCHEMES = {
    "one-chunk": {},
    "token-chunks": dict(chunk_size=128),
    "vocabulary-blocks": dict(vocab_chunk_size=1024),
}


def _fwd_bwd(backend, dtype, options, with_bias, calls=1):
    gen = torch.Generator(device=CUDA).manual_seed(0)
    x0 = torch.randn(N, H, generator=gen, device=CUDA).to(dtype)
    w = (torch.randn(V, H, generator=gen, device=CUDA) / H**0.5).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=gen, device=CUDA) * 0.1).to(dtype).requires_grad_() if with_bias else None
    t = torch.randint(0, V, (N,), generator=gen, device=CUDA)
    t[::9] = -100
    for _ in range(calls):  # the second call of a layout is captured, the third replayed
        x = x0.clone().requires_grad_()
        w.grad = None
        if b is not None:
            b.grad = None
        loss = flce.fused_linear_cross_entropy(x, w, t, bias=b, backend=backend, **options)
        loss.backward()
    return [loss.detach(), x.grad, w.grad] + ([b.grad] if b is not None else [])


@pytest.mark.parametrize("backend", ["torch", "triton", "cutedsl"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_two_streams_give_the_same_bits(backend, dtype, scheme, with_bias, monkeypatch):
    skip_unless_usable(backend)
    monkeypatch.setattr(gemm, "GRADIENT_GEMMS_BESIDE", False)
    one_stream = _fwd_bwd(backend, dtype, SCHEMES[scheme], with_bias)
    monkeypatch.setattr(gemm, "GRADIENT_GEMMS_BESIDE", True)
    assert gemm.gradient_gemms_beside(CUDA)
    two_streams = _fwd_bwd(backend, dtype, SCHEMES[scheme], with_bias)
    for a, b in zip(one_stream, two_streams, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["triton", "cutedsl"])
def test_a_graph_replay_with_two_streams_gives_the_same_bits(backend, monkeypatch):
    skip_unless_usable(backend)
    monkeypatch.setattr(gemm, "GRADIENT_GEMMS_BESIDE", False)
    one_stream = _fwd_bwd(backend, torch.bfloat16, {}, True)
    monkeypatch.setattr(gemm, "GRADIENT_GEMMS_BESIDE", True)
    replayed = _fwd_bwd(backend, torch.bfloat16, {}, True, calls=3)
    for a, b in zip(one_stream, replayed, strict=True):
        assert torch.equal(a, b)
