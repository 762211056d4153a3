"""Direct launches of compiled Triton kernels (``flce.backends.triton.launch``): the key of
a compiled kernel separates every argument Triton specializes on, a direct launch hands
the compiled kernel's launcher tensors as their addresses, and on a GPU it gives bit for
bit what ``JITFunction.run`` gives, through alignment and size changes."""

from __future__ import annotations

import contextlib
import enum
import importlib.util
import itertools
import os
from types import SimpleNamespace

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if importlib.util.find_spec("numpy") is None:
    pytest.skip("numpy is not installed (Triton's interpreter needs it)", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed (pip install 'flce[triton]')")

import numpy as np  # noqa: E402
import triton  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from flce.backends.base import ChunkScalars  # noqa: E402
from flce.backends.triton import launch as launch_module  # noqa: E402
from flce.backends.triton.ce import _ce_chunk_kernel, cross_entropy_chunk  # noqa: E402
from flce.backends.triton.launch import Launcher, fingerprint  # noqa: E402


class _Size(enum.IntEnum):
    BLOCK = 16


_BUFFER = torch.zeros(64)
# Runtime arguments that differ in what Triton specializes on, and some that only look different.
_TENSORS = (
    _BUFFER,
    _BUFFER[4:],  # 16 bytes further: still aligned
    _BUFFER[1:],  # 4 bytes: not aligned
    _BUFFER.double(),
    _BUFFER.bfloat16()[1:],
    _BUFFER.long(),
    _BUFFER.bool(),
    torch.zeros(0),
    torch.nn.Parameter(_BUFFER[8:]),  # a Tensor subclass
    torch.nn.Parameter(_BUFFER[3:]),
)
_INTS = (0, 1, 2, 8, 15, 16, 24, 32, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -(2**31), -(2**31) - 1)
_WIDE_INTS = (2**62, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 1, -(2**63))
_OTHERS = (True, False, 0.5, 1.0, 3.0, np.float64(2.0), _Size.BLOCK, np.int64(16), None)
_VALUES = (*_TENSORS, *_INTS, *_WIDE_INTS, *_OTHERS)


def test_the_fingerprint_separates_what_triton_specializes_on():
    buffer = torch.zeros(64)
    assert fingerprint(buffer) == fingerprint(buffer[4:])  # 16 bytes further: still aligned
    assert fingerprint(buffer) != fingerprint(buffer[1:])  # 4 bytes: not 16-byte aligned
    assert fingerprint(buffer) != fingerprint(buffer.double())
    assert fingerprint(1) != fingerprint(2)  # 1 is specialized
    assert fingerprint(2) != fingerprint(16)  # divisibility by 16
    assert fingerprint(16) == fingerprint(32)
    assert fingerprint(2) != fingerprint(2**31 + 2)  # i32 against i64
    assert fingerprint(2**62) != fingerprint(2**63)  # i64 against u64
    assert fingerprint(True) != fingerprint(1)
    assert fingerprint(0.5) == fingerprint(3.0)
    assert fingerprint(None) == fingerprint(None)


def test_the_fingerprint_is_at_least_as_fine_as_triton_s_specialization():
    """Arguments with equal fingerprints get the same specialization from the installed Triton."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:
        pytest.skip("this Triton specializes in Python (native_specialize_impl is from 3.6 on)")

    def specialization(value):  # a runtime argument's, as JITFunction.run makes it
        return native_specialize_impl(BaseBackend, value, False, True, True)

    values = [v for v in _VALUES if not isinstance(v, np.integer) and not (isinstance(v, int) and v >= 2**64)]
    for a, b in itertools.combinations(values, 2):
        if fingerprint(a) == fingerprint(b):
            assert specialization(a) == specialization(b), (a, b)


class _FakeKernel:
    """A ``@triton.jit`` kernel's parameters, and its launches: ``kernel[grid](...)`` records one
    through Triton and returns a compiled kernel whose launcher records the direct ones."""

    def __init__(self, *names: str, constexprs: tuple[str, ...] = ()):
        self.params = [SimpleNamespace(name=name, is_constexpr=name in constexprs) for name in names]
        self.launches = []
        self.compiled = SimpleNamespace(
            run=lambda *args: self.launches.append(("direct", args)), function=0xF00, packed_metadata=(4, 1, 0)
        )

    def __getitem__(self, grid):
        def through_triton(*args, **kwargs):
            self.launches.append(("triton", grid, args, kwargs))
            return self.compiled

        return through_triton


def _key(launcher: Launcher, args) -> tuple:
    return launcher.key_and_launch_args(args, (64, True), 0, 4)[0]


@pytest.mark.parametrize("width", [1, 2])
def test_the_key_separates_exactly_what_the_fingerprint_separates(width):
    names = [f"arg{i}" for i in range(width)]
    launcher = Launcher(_FakeKernel(*names, "BLOCK", "FLAG", constexprs=("BLOCK", "FLAG")))
    pool = _VALUES if width == 1 else _VALUES[::3]
    argument_tuples = list(itertools.product(pool, repeat=width))
    keys = [_key(launcher, args) for args in argument_tuples]
    fingerprints = [tuple(map(fingerprint, args)) for args in argument_tuples]
    for args, key, prints in zip(argument_tuples, keys, fingerprints, strict=True):
        assert key == (0, 4, 64, True, *prints), args  # the fingerprint's entries, as they are
    for (a, key_a, prints_a), (b, key_b, prints_b) in itertools.combinations(
        zip(argument_tuples, keys, fingerprints, strict=True), 2
    ):
        assert (key_a == key_b) == (prints_a == prints_b), (a, b)


_ARGUMENT = st.one_of(
    st.integers(-(2**64), 2**64),
    st.sampled_from(_INTS + _WIDE_INTS).flatmap(lambda v: st.integers(v - 17, v + 17)),
    st.booleans(),
    st.floats(allow_nan=False),
    st.none(),
    st.sampled_from(_TENSORS),
)


@given(st.lists(_ARGUMENT, min_size=3, max_size=3), st.lists(_ARGUMENT, min_size=3, max_size=3))
def test_random_keys_are_equal_iff_the_fingerprints_are(a, b):
    launcher = Launcher(_FakeKernel("x", "y", "z", "BLOCK", "FLAG", constexprs=("BLOCK", "FLAG")))
    prints_a, prints_b = tuple(map(fingerprint, a)), tuple(map(fingerprint, b))
    assert _key(launcher, a) == (0, 4, 64, True, *prints_a)
    assert (_key(launcher, a) == _key(launcher, b)) == (prints_a == prints_b)


def test_constexprs_enter_the_key_exactly():
    launcher = Launcher(_jit_function(_ce_chunk_kernel))
    runtime = [0] * launcher.runtime_count
    names = launcher.constexpr_names
    assert names and launcher.launches_directly
    flags = dict.fromkeys(names, False)
    block = {**flags, "BLOCK_V": 1024}

    def key(constexprs, device_index=0, num_warps=4):
        values = launcher.constexpr_values(constexprs)
        return launcher.key_and_launch_args(runtime, values, device_index, num_warps)[0]

    assert key(block) != key({**block, "BLOCK_V": 2048})
    assert key(block) != key({**block, "HAS_SOFTCAP": True})
    assert key(block) == key(dict(reversed(block.items())))  # by name, not by the dict's order
    assert key(block) != key(block, device_index=1)  # another device
    assert key(block) != key(block, num_warps=8)  # other options


def _jit_function(kernel):
    """The ``JITFunction`` of a kernel (under Triton's interpreter, built from its Python function)."""
    return kernel if hasattr(kernel, "params") else triton.runtime.jit.JITFunction(kernel.fn)


@pytest.fixture
def direct_launches(monkeypatch):
    """``Launcher._launch_cuda`` on the direct path without a GPU: streams are 1000 + the device."""
    monkeypatch.setattr(launch_module, "DIRECT_LAUNCH", True)
    monkeypatch.setattr(launch_module, "_launch_hooks_installed", lambda: False)
    driver = SimpleNamespace(active=SimpleNamespace(get_current_stream=lambda index: 1000 + index))
    monkeypatch.setattr(triton.runtime, "driver", driver)


@pytest.mark.parametrize("constexprs", [(), ("BLOCK",), ("BLOCK", "FLAG")])
def test_direct_launches_pass_tensors_as_addresses(direct_launches, constexprs):
    kernel = _FakeKernel("x", "n", "scale", "out", *constexprs, constexprs=constexprs)
    launcher = Launcher(kernel)
    given_constexprs = dict(reversed({"BLOCK": 64, "FLAG": True}.items()))  # not in parameter order
    given_constexprs = {name: value for name, value in given_constexprs.items() if name in constexprs}
    constexpr_values = tuple({"BLOCK": 64, "FLAG": True}[name] for name in constexprs)
    x, out = torch.zeros(8), torch.zeros(8)

    def launch(x, out, grid=(4,)):
        kernel.launches.clear()
        launcher._launch_cuda(grid, (x, 7, 0.5, out), given_constexprs, 4, 1)
        return kernel.launches

    first = launch(x, out)
    assert [entry[0] for entry in first] == ["triton"]  # the first one compiles through Triton
    assert first[0][2] == (x, 7, 0.5, out) and first[0][3] == {**given_constexprs, "num_warps": 4}
    for args in ((x, out), (torch.nn.Parameter(x), out), (torch.zeros(8), torch.zeros(8)[4:])):
        (entry,) = launch(*args, grid=(4, 2))
        assert entry[0] == "direct", args
        launched = entry[1]
        assert launched[:9] == (4, 2, 1, 1001, 0xF00, (4, 1, 0), None, None, None)
        assert launched[9:] == (args[0].data_ptr(), 7, 0.5, args[1].data_ptr(), *constexpr_values)
        assert type(launched[9]) is int and type(launched[12]) is int
    # Another specialization: an address not 16-byte aligned goes through Triton again.
    assert [entry[0] for entry in launch(torch.zeros(8)[1:], out)] == ["triton"]
    assert [entry[0] for entry in launch(torch.zeros(8)[1:], out)] == ["direct"]


def test_what_the_direct_path_leaves_to_triton(direct_launches, monkeypatch):
    kernel = _FakeKernel("x", "BLOCK", "n", constexprs=("BLOCK",))  # a runtime parameter after a constexpr
    launcher = Launcher(kernel)
    assert not launcher.launches_directly
    for _ in range(2):
        launcher._launch_cuda((4,), (torch.zeros(8),), {"BLOCK": 64, "n": 3}, 4, 0)
    assert [entry[0] for entry in kernel.launches] == ["triton", "triton"]

    kernel = _FakeKernel("x", "BLOCK", "FLAG", constexprs=("BLOCK", "FLAG"))
    launcher = Launcher(kernel)
    for _ in range(2):  # a constexpr left to its default
        launcher._launch_cuda((4,), (torch.zeros(8),), {"BLOCK": 64}, 4, 0)
    monkeypatch.setattr(launch_module, "_launch_hooks_installed", lambda: True)
    for _ in range(2):  # a profiler's launch hooks
        launcher._launch_cuda((4,), (torch.zeros(8),), {"BLOCK": 64, "FLAG": True}, 4, 0)
    assert [entry[0] for entry in kernel.launches] == ["triton"] * 4


@pytest.mark.parametrize("index", [None, 0, 1])
def test_a_launch_guards_the_device_only_off_the_current_one(direct_launches, monkeypatch, index):
    """The launch's device becomes the current one for the launch (Triton launches on the
    current device), and only when it is another (a guard is host time on every launch);
    the stream is the launch device's."""
    guarded = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda i: guarded.append(i) or contextlib.nullcontext())
    kernel = _FakeKernel("x", "n")
    launcher = Launcher(kernel)
    for _ in range(2):  # through Triton, then directly
        launcher((4,), (torch.zeros(8), 3), {}, 4, torch.device("cuda", index))
    assert guarded == ([] if index in (None, 0) else [1, 1])
    assert kernel.launches[-1][0] == "direct" and kernel.launches[-1][1][3] == 1000 + (index or 0)


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
