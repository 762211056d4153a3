"""Launching this backend's Triton kernels: on the tensors' device, and past Triton's
per-launch Python once a kernel is compiled.

``kernel[grid](...)`` runs ``JITFunction.run`` on every launch: it binds the arguments,
specializes each one, hashes the specialization into a cache key, looks the compiled
kernel up and only then calls its launcher. On the H200's host a launch cost 30-60 us
that way (benchmarks/results/host-overhead-h200), several times the launch itself, and a
fused fwd+bwd call makes three of them. ``launch`` keys the compiled kernel on a
fingerprint of the arguments that is at least as fine as Triton's specialization and,
once it has one, calls its launcher directly, as Triton's own ``run`` would.

What Triton specializes on, and the fingerprint therefore holds (``fingerprint``): a
tensor's dtype and whether its address is 16-byte aligned; an integer's type range
(i32/i64), whether it is 1 and whether it is a multiple of 16; floats are fp32; the
constexpr values exactly. A fingerprint finer than Triton's only costs an extra
``JITFunction.run`` (which returns the same compiled kernel). The direct path is taken
on Triton >= 3.3 (whose launchers take every bound argument, constexprs included), on
CUDA, when no launch hook is installed (profilers such as Proton install them) and
unless ``FLCE_TRITON_DIRECT_LAUNCH=0``. Triton's interpreter (CPU) always goes through
``JITFunction.run``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import triton

_INT32 = (-(2**31), 2**31)


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


# Triton >= 3.3: CompiledKernel.run takes every bound argument (constexprs too) after the hooks.
DIRECT_LAUNCH = _version(triton.__version__) >= (3, 3) and os.environ.get("FLCE_TRITON_DIRECT_LAUNCH", "1") != "0"


def fingerprint(value: Any) -> tuple:
    """What Triton's specialization of a runtime argument depends on (module docstring)."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, bool):  # before int: bool is an int
        return (bool, value)
    if isinstance(value, int):
        return (int, _INT32[0] <= value < _INT32[1], value == 1, value % 16 == 0)
    if isinstance(value, float):
        return (float,)
    return (type(value), value)


def _hook_installed(hook) -> bool:
    """A launch hook is set: a function, or a non-empty ``HookChain`` (Triton >= 3.5 always
    holds a chain, empty unless a profiler adds to it)."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else True


def _launch_hooks_installed() -> bool:
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None:
        return False
    return _hook_installed(runtime.launch_enter_hook) or _hook_installed(runtime.launch_exit_hook)


class Launcher:
    """``launch`` for one ``@triton.jit`` kernel: its compiled kernels by fingerprint."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        params = kernel.params
        self.names = tuple(p.name for p in params)
        self.is_constexpr = tuple(p.is_constexpr for p in params)
        self.compiled: dict[tuple, Any] = {}

    def key(self, values: Sequence[Any], device_index: int, num_warps: int) -> tuple:
        """The compiled kernel's key: the device, the options and each argument's fingerprint
        (a constexpr's exact value)."""
        return (
            device_index,
            num_warps,
            *(
                (value,) if constexpr else fingerprint(value)
                for value, constexpr in zip(values, self.is_constexpr, strict=True)
            ),
        )

    def __call__(self, grid: tuple[int, ...], args: Sequence[Any], constexprs: dict[str, Any], num_warps: int, device):
        """``kernel[grid](*args, **constexprs, num_warps=num_warps)`` on the CUDA ``device``:
        ``args`` are the leading parameters in order, ``constexprs`` the rest by name."""
        current = torch.cuda.current_device()
        index = current if device.index is None else device.index
        if index != current:
            with torch.cuda.device(index):  # Triton launches on the current device
                self._launch_cuda(grid, args, constexprs, num_warps, index)
        else:
            self._launch_cuda(grid, args, constexprs, num_warps, index)

    def _launch_cuda(self, grid, args, constexprs, num_warps: int, index: int) -> None:
        if not DIRECT_LAUNCH or _launch_hooks_installed():
            self.kernel[grid](*args, **constexprs, num_warps=num_warps)
            return
        if len(args) + len(constexprs) != len(self.names):  # a default left out: Triton binds it
            self.kernel[grid](*args, **constexprs, num_warps=num_warps)
            return
        values = (*args, *(constexprs[name] for name in self.names[len(args) :]))
        key = self.key(values, index, num_warps)
        compiled = self.compiled.get(key)
        if compiled is None:
            # Triton compiles (or finds) and launches it; later launches go straight to it.
            self.compiled[key] = self.kernel[grid](*args, **constexprs, num_warps=num_warps)
            return
        stream = triton.runtime.driver.active.get_current_stream(index)
        grid_y = grid[1] if len(grid) > 1 else 1
        grid_z = grid[2] if len(grid) > 2 else 1
        compiled.run(
            grid[0], grid_y, grid_z, stream, compiled.function, compiled.packed_metadata, None, None, None, *values
        )


_LAUNCHERS: dict[Any, Launcher] = {}


def launch(
    kernel, grid: tuple[int, ...], args: Sequence[Any], constexprs: dict[str, Any], *, num_warps: int, device
) -> None:
    """Launches ``kernel`` over ``grid`` on ``device`` (module docstring)."""
    if device.type != "cuda":  # Triton's interpreter
        kernel[grid](*args, **constexprs, num_warps=num_warps)
        return
    launcher = _LAUNCHERS.get(kernel)
    if launcher is None:
        if not hasattr(kernel, "params"):  # not a JITFunction (a wrapper around one): Triton's path
            kernel[grid](*args, **constexprs, num_warps=num_warps)
            return
        launcher = _LAUNCHERS[kernel] = Launcher(kernel)
    launcher(grid, args, constexprs, num_warps, device)
