"""The vocab-parallel loss on one GPU (a process group of size 1, so no collective runs):
the Triton, CuTe DSL and PyTorch split-row kernels against the single-device loss."""

import datetime
import socket

import pytest
import torch
import torch.distributed as dist

if not torch.cuda.is_available():
    pytest.skip("GPU vocab-parallel: needs a CUDA GPU", allow_module_level=True)

import flce
from flce.dispatch import availability
from flce.parallel import vocab_parallel_fused_linear_cross_entropy

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def group():
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["triton", "cutedsl", "torch"])
@pytest.mark.parametrize(
    "features",
    [{}, dict(label_smoothing=0.1, lse_square_scale=1e-3, softcap=20.0, use_token_scaling=True)],
    ids=["plain", "all"],
)
def test_single_gpu_group_equals_single_device_loss(group, backend, features):
    if not availability(backend, torch.device("cuda"))[0]:
        pytest.skip(f"{backend} not usable here")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(512, 256, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(32000, 256, device="cuda", generator=gen) * 0.3).bfloat16()
    t = torch.randint(0, 32000, (512,), device="cuda", generator=gen)
    results = []
    for fn in (vocab_parallel_fused_linear_cross_entropy, flce.fused_linear_cross_entropy):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        kwargs = dict(features, backend=backend)
        if fn is vocab_parallel_fused_linear_cross_entropy:
            kwargs["process_group"] = group
        loss = fn(xx, ww, t, **kwargs)
        loss.backward()
        results.append((loss.detach(), xx.grad, ww.grad))
    for got, want in zip(*results, strict=False):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-3)
