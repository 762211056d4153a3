"""Every Triton kernel of the backend compiles for Hopper (sm_90), on a machine without a GPU.

Triton's interpreter, which CI runs the kernels' math on, skips the compiler's checks: a
kernel can pass every interpreted test and fail to compile on a GPU (a global that is not
a ``tl.constexpr`` object did). Here each kernel is compiled from the arguments a real
call launches it with (recorded under the interpreter), specialized as Triton would
specialize them on a GPU, down to a cubin. The PTX of the row loops then shows whether
their loads and stores are vectorized at an odd vocabulary.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("the GPU runs these kernels itself (tests/gpu)", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")
if importlib.util.find_spec("numpy") is None:
    pytest.skip("numpy is not installed (Triton's interpreter needs it)", allow_module_level=True)
triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'flce[triton]')")
if importlib.util.find_spec("triton.backends.compiler") is None:  # pragma: no cover - an older Triton
    pytest.skip("this Triton cannot compile ahead of time for a GPU target", allow_module_level=True)

import flce  # noqa: E402
from flce.backends.triton import launch as launch_module  # noqa: E402
from flce.backends.triton import scale, statistics  # noqa: E402

KERNEL_MODULES = ("ce", "partial", "logprobs", "distillation", "scale", "statistics")
N, H, ODD_V = 16, 32, 1031  # V = 1031: the row loops' tail is 7 columns
_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "i1",
    torch.uint8: "u8",
}


def _record_launches(monkeypatch, call) -> dict:
    """The first launch of each kernel in ``call``: kernel -> (args, constexprs, num_warps)."""
    launches: dict = {}
    original = launch_module.launch

    def recording_launch(kernel, grid, args, constexprs, *, num_warps, device):
        launches.setdefault(kernel, (tuple(args), dict(constexprs), num_warps))
        original(kernel, grid, args, constexprs, num_warps=num_warps, device=device)

    for name in KERNEL_MODULES:  # imported first: the loss heads' kernels load on first use
        module = importlib.import_module(f"flce.backends.triton.{name}")
        if getattr(module, "launch", None) is original:
            monkeypatch.setattr(module, "launch", recording_launch)
    call()
    return launches


def _spec(kernel, args: tuple, constexprs: dict, num_warps: int) -> dict:
    """The kernel as Triton specializes it on a GPU for these arguments: tensors by dtype,
    16-byte aligned (a CUDA allocation is); integers i32/i64, divisible by 16 or not,
    1 as a constant; constexprs and None as constants."""
    names = [p.name for p in kernel.params] if hasattr(kernel, "params") else list(kernel.arg_names)
    signature, constants, attrs = {}, {}, []
    for index, (name, value) in enumerate(zip(names, (*args, *constexprs.values()), strict=True)):
        if name in constexprs or value is None or (type(value) is int and value == 1):
            signature[name], constants[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
            attrs.append([[index], [["tt.divisibility", 16]]])
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs.append([[index], [["tt.divisibility", 16]]])
        else:
            signature[name] = "fp32"
    function = getattr(kernel, "fn", kernel)
    return dict(module=function.__module__, kernel=function.__name__, signature=signature, constants=constants,
                attrs=attrs, num_warps=num_warps)  # fmt: skip


def _compile(launches: dict, tmp_path) -> dict:
    """kernel name -> {"error", "ptx"}, compiled for Hopper in a process without the interpreter."""
    specs, out = tmp_path / "specs.json", tmp_path / "compiled.json"
    specs.write_text(json.dumps([_spec(k, *recorded) for k, recorded in launches.items()]))
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "tests.backends.triton_compile_worker", str(specs), str(out)],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


def _calls():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, H, generator=gen, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(ODD_V, H, generator=gen) * 0.3).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, ODD_V, (N,), generator=gen)
    # The argmax too (return_predicted_tokens): its NaN handling is compiled code of its own.
    features = dict(
        label_smoothing=0.1, lse_square_scale=1e-4, softcap=20.0, return_z_loss=True, return_predicted_tokens=True
    )

    def cross_entropy():
        out = flce.fused_linear_cross_entropy(x, w, t, backend="triton", **features)
        out.loss.backward()

    def vocabulary_blocks():
        # Blocks of 520 and 511 columns: neither a multiple of 16.
        out = flce.fused_linear_cross_entropy(
            x, w, t, backend="triton", vocab_chunk_size=520, return_token_accuracy=True
        )
        out.loss.backward()

    def logprobs():
        out = flce.fused_linear_logprobs(x, w, t, backend="triton", return_entropy=True, return_predicted_tokens=True)
        (out.logprobs.sum() + out.entropy.sum()).backward()

    def distillation():
        flce.fused_linear_distillation(x, w, x.detach(), w.detach().flip(0), t, backend="triton").backward()

    def batch_helpers():  # the CUDA-only launches of a call: the batch statistics, the upstream scale
        statistics.batch_statistics_values(t, torch.rand(ODD_V, generator=gen), ODD_V, -100)
        scale.scale_unless_one_([x.detach().clone(), w.detach().clone()], torch.tensor(0.5))
        scale.scaled_copies([x.detach(), w.detach()], torch.tensor(0.5))  # a CUDA graph's gradients

    return {"cross_entropy": cross_entropy, "vocabulary_blocks": vocabulary_blocks, "logprobs": logprobs,
            "distillation": distillation, "batch_helpers": batch_helpers}  # fmt: skip


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    """Every kernel the calls of ``_calls`` launch, compiled for Hopper in one process:
    kernel name -> {"error", "ptx"}."""
    launches = {}
    for call in _calls().values():
        with pytest.MonkeyPatch.context() as monkeypatch:  # each call patches the unpatched launch
            for kernel, recorded in _record_launches(monkeypatch, call).items():
                launches.setdefault(kernel, recorded)
    results = _compile(launches, tmp_path_factory.mktemp("triton-compile"))
    assert len(results) == len(launches)
    return results


EXPECTED_KERNELS = (
    "_ce_chunk_kernel",
    "_partial_statistics_kernel",
    "_partial_gradient_kernel",
    "_logprobs_forward_kernel",
    "_logprobs_backward_kernel",
    "_distillation_kernel",
    "_batch_statistics_kernel",
    "_scale_unless_one_kernel",
    "_scaled_copies_kernel",
)


def test_every_kernel_compiles_for_hopper(compiled):
    assert set(EXPECTED_KERNELS) <= set(compiled), sorted(compiled)
    failures = {name: result["error"] for name, result in compiled.items() if result["error"]}
    assert not failures, failures


@pytest.mark.parametrize(
    "kernel_name",
    ["_ce_chunk_kernel", "_partial_gradient_kernel", "_logprobs_backward_kernel", "_distillation_kernel"],
)
def test_row_loops_are_vectorized_at_an_odd_vocabulary(compiled, kernel_name):
    """At V = 1031 (blocks of 520: not multiples of 16) the row loops' loads and stores of
    the bf16 logits are 16 bytes wide (``v4.b32``) in the gradient kernels of the CE, the
    split rows, the logprobs and the distillation: the loops run to a multiple of 16
    columns, and only the last few go through masked scalar accesses
    (flce.backends.triton.common.aligned_extent). Each fails with loops masked by
    ``offs < V``."""
    ptx = compiled[kernel_name]["ptx"]
    assert "ld.global.v4.b32" in ptx
    assert "st.global.v4.b32" in ptx
