"""Direct launches of compiled Triton kernels (``flce.backends.triton.launch``): the key of
a compiled kernel separates every argument Triton specializes on, and on a GPU the direct
launch gives bit for bit what ``JITFunction.run`` gives, through alignment and size changes."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if importlib.util.find_spec("numpy") is None:
    pytest.skip("numpy is not installed (Triton's interpreter needs it)", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed (pip install 'flce[triton]')")

from flce.backends.base import ChunkScalars  # noqa: E402
from flce.backends.triton import launch as launch_module  # noqa: E402
from flce.backends.triton.ce import _ce_chunk_kernel, cross_entropy_chunk  # noqa: E402
from flce.backends.triton.launch import Launcher, fingerprint  # noqa: E402


def test_the_fingerprint_separates_what_triton_specializes_on():
    buffer = torch.zeros(64)
    assert fingerprint(buffer) == fingerprint(buffer[4:])  # 16 bytes further: still aligned
    assert fingerprint(buffer) != fingerprint(buffer[1:])  # 4 bytes: not 16-byte aligned
    assert fingerprint(buffer) != fingerprint(buffer.double())
    assert fingerprint(1) != fingerprint(2)  # 1 is specialized
    assert fingerprint(2) != fingerprint(16)  # divisibility by 16
    assert fingerprint(16) == fingerprint(32)
    assert fingerprint(2) != fingerprint(2**31 + 2)  # i32 against i64
    assert fingerprint(True) != fingerprint(1)
    assert fingerprint(0.5) == fingerprint(3.0)
    assert fingerprint(None) == fingerprint(None)


def _jit_function(kernel):
    """The ``JITFunction`` of a kernel (under Triton's interpreter, built from its Python function)."""
    import triton

    return kernel if hasattr(kernel, "params") else triton.runtime.jit.JITFunction(kernel.fn)


def test_constexprs_enter_the_key_exactly():
    launcher = Launcher(_jit_function(_ce_chunk_kernel))
    names = launcher.names
    first_constexpr = launcher.is_constexpr.index(True)
    assert not any(launcher.is_constexpr[:first_constexpr]) and all(launcher.is_constexpr[first_constexpr:])
    runtime = [0] * first_constexpr
    flags = dict.fromkeys(names[first_constexpr:], False)
    block = {**flags, "BLOCK_V": 1024}
    key = launcher.key((*runtime, *block.values()), 0, 4)
    assert key != launcher.key((*runtime, *{**block, "BLOCK_V": 2048}.values()), 0, 4)
    assert key != launcher.key((*runtime, *{**block, "HAS_SOFTCAP": True}.values()), 0, 4)
    assert key != launcher.key((*runtime, *block.values()), 1, 4)  # another device
    assert key != launcher.key((*runtime, *block.values()), 0, 8)  # other options


def _chunk_call(logits, target):
    scalars = ChunkScalars.from_numbers(
        ignore_index=-100,
        label_smoothing=0.0,
        lse_square_scale=0.0,
        softcap=None,
        use_token_scaling=False,
        ce_grad_scale=1.0 / target.numel(),
        z_grad_scale=1.0,
        weight_sum=float(logits.shape[1]),
        device=logits.device,
    )
    loss = torch.empty(logits.shape[0], device=logits.device)
    grad = torch.empty_like(logits)
    cross_entropy_chunk(
        logits,
        target,
        None,
        scalars,
        loss_out=loss,
        z_loss_out=None,
        correct_out=None,
        predicted_out=None,
        row_grad_scale=None,
        compute_grad=True,
        grad_out=grad,
    )
    return loss, grad


@pytest.mark.gpu
def test_gpu_direct_launches_match_triton_s_own(monkeypatch):
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    storage = torch.randn(40 * 1001 + 1, generator=gen, device="cuda").bfloat16()
    target = torch.randint(0, 1000, (40,), generator=gen, device="cuda")
    aligned = storage[: 40 * 1000].view(40, 1000)  # row stride 1000: rows 16-byte aligned
    shifted = storage[1 : 1 + 40 * 1001].view(40, 1001)[:, :1000]  # base 2 bytes off, odd stride
    results = {}
    for direct in (False, True):
        monkeypatch.setattr(launch_module, "DIRECT_LAUNCH", direct)
        monkeypatch.setattr(launch_module, "_LAUNCHERS", {})
        for name, logits in (("aligned", aligned), ("shifted", shifted), ("aligned again", aligned)):
            for repeat in range(2):  # the second one launches directly (when enabled)
                results[(direct, name, repeat)] = _chunk_call(logits, target)
        if direct:
            # One compiled kernel per specialization: the aligned and the shifted logits.
            compiled = launch_module._LAUNCHERS[_ce_chunk_kernel].compiled
            assert len(compiled) == 2, (list(compiled), launch_module._launch_hooks_installed())
    for (direct, name, repeat), (loss, grad) in results.items():
        ref_loss, ref_grad = results[(False, name, 0)]
        assert torch.equal(loss, ref_loss) and torch.equal(grad, ref_grad), (direct, name, repeat)
