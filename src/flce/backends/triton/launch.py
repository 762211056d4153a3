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
tensor's dtype and whether its address is 16-byte aligned; an integer's type (i32, i64
or u64 by its range), whether it is 1 and whether it is a multiple of 16; floats are
fp32; the constexpr values exactly. A fingerprint finer than Triton's only costs an extra
``JITFunction.run`` (which returns the same compiled kernel). The direct path is taken
on Triton >= 3.3 (whose launchers take every bound argument, constexprs included), on
CUDA, when no launch hook is installed (profilers such as Proton install them), for a
kernel whose runtime parameters all come before its constexprs and are passed in order
(the constexprs by name), and unless ``FLCE_TRITON_DIRECT_LAUNCH=0``. Triton's
interpreter (CPU) always goes through ``JITFunction.run``.

The direct path's own host time still counts in small calls. On the H200's host (Triton
3.6, torch 2.11, Python 3.12) one measurement of a launch of the CE kernel (19 runtime
arguments, 14 constexprs) put 16-19 us on a key built by one ``fingerprint`` call per
argument, 4-5 us on ``triton.runtime.driver.active.get_current_stream`` and 21-29 us on
the compiled kernel's launcher; timed in a loop (host time only), a launch took 25-27 us
through ``JITFunction.run``, 20-21 us through that direct path and 13-14 us through this
one, whose key takes 3.9 us (7.9 before) and whose launcher 5.8 us (7.2 given tensors).
Hence:

- the key is built in one pass over the runtime arguments that tests the common types
  with ``type(value) is`` and leaves the rest to ``fingerprint``; the constexprs' values
  enter it as they are. Its entries are ``fingerprint``'s, so it separates exactly what
  ``fingerprint`` does;
- a tensor goes to the launcher as the address the key has read: the C launcher Triton
  generates (``getPointer`` in triton/backends/nvidia/driver.py, 3.3 to 3.6;
  ``extractPointer`` in its driver.c by 3.9) uses a Python int as the device pointer as
  it is, while of any other object it calls ``data_ptr()`` and checks the address with
  ``cuPointerGetAttribute``, a driver call per tensor. That check only catches a host
  tensor, and this backend's callers pass tensors on the launch device (a fingerprint's
  first launch still goes through Triton and its check);
- the stream lookup, the active driver's ``get_current_stream`` (on CUDA torch's
  ``_cuda_getCurrentRawStream``, 0.1 us where ``torch.cuda.current_stream(index)``
  takes 1.9 us), is resolved at the kernel's first launch instead of through the
  ``driver.active`` property on every launch;
- the compiled kernel's ``run`` (a property), ``function`` and ``packed_metadata`` are
  read once: its first launch sets them (loading it) and nothing changes them after.

The launcher itself (in 3.6 ``CudaLauncher.__call__``: the global and profile scratch
allocations, then the C ``launch``) is called whole: its calling convention changes
between Triton releases.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton

from flce.backends.base import device_guard

_I32_MIN, _I32_END = -(2**31), 2**31
_FLOAT = (float,)


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


# Triton >= 3.3: CompiledKernel.run takes every bound argument (constexprs too) after the hooks.
DIRECT_LAUNCH = _version(triton.__version__) >= (3, 3) and os.environ.get("FLCE_TRITON_DIRECT_LAUNCH", "1") != "0"


def _int_type(value: int) -> str:
    """Triton's type of an integer argument (from 2**63 on it is unsigned)."""
    if _I32_MIN <= value < _I32_END:
        return "i32"
    return "i64" if value < 2**63 else "u64"


def fingerprint(value: Any) -> tuple:
    """What Triton's specialization of a runtime argument depends on (module docstring)."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, bool):  # before int: bool is an int
        return (bool, value)
    if isinstance(value, int):
        return (int, _int_type(value), value == 1, value % 16 == 0)
    if isinstance(value, float):
        return _FLOAT
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


def _values_getter(names: tuple[str, ...]) -> Callable[[dict[str, Any]], tuple]:
    """A dict's values at ``names``, as a tuple: one ``itemgetter`` call, except where that
    would return a bare value (a single name) or cannot be built (none)."""
    if len(names) > 1:
        return operator.itemgetter(*names)
    if names:
        (name,) = names
        return lambda mapping: (mapping[name],)
    return lambda mapping: ()


class Launcher:
    """``launch`` for one ``@triton.jit`` kernel: its compiled kernels' launchers by key."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        params = kernel.params
        self.names = tuple(p.name for p in params)
        is_constexpr = [p.is_constexpr for p in params]
        self.runtime_count = is_constexpr.index(True) if True in is_constexpr else len(params)
        self.constexpr_names = self.names[self.runtime_count :]
        # The key takes the constexprs by value and fingerprints the rest: a kernel with a
        # runtime parameter after a constexpr always goes through Triton.
        self.launches_directly = all(is_constexpr[self.runtime_count :])
        self.constexpr_values = _values_getter(self.constexpr_names)
        # key -> (compiled.run, compiled.function, compiled.packed_metadata)
        self.compiled: dict[tuple, tuple] = {}
        self.current_stream = None  # the active driver's lookup, from the first launch on

    def key_and_launch_args(
        self, args: Sequence[Any], constexpr_values: tuple, device_index: int, num_warps: int
    ) -> tuple[tuple, list]:
        """The compiled kernel's key (the device, the options, the constexprs' values and each
        runtime argument's ``fingerprint``) and the runtime arguments for its launcher, a tensor
        as its address."""
        key = [device_index, num_warps, *constexpr_values]
        launch_args = []
        for value in args:
            kind = type(value)
            if kind is int and _I32_MIN <= value < _I32_END:
                key.append((int, "i32", value == 1, value % 16 == 0))
            elif kind is float:
                key.append(_FLOAT)
            elif kind is torch.Tensor or isinstance(value, torch.Tensor):  # a Parameter too
                address = value.data_ptr()
                key.append((value.dtype, address % 16 == 0))
                value = address
            else:  # bool, a wide int, None, ...
                key.append(fingerprint(value))
            launch_args.append(value)
        return tuple(key), launch_args

    def __call__(self, grid: tuple[int, ...], args: Sequence[Any], constexprs: dict[str, Any], num_warps: int, device):
        """``kernel[grid](*args, **constexprs, num_warps=num_warps)`` on the CUDA ``device``:
        ``args`` are the leading parameters in order, ``constexprs`` the rest by name."""
        index = torch.cuda.current_device() if device.index is None else device.index
        with device_guard(device):  # Triton launches on the current device
            self._launch_cuda(grid, args, constexprs, num_warps, index)

    def _launch_cuda(self, grid, args, constexprs, num_warps: int, index: int) -> None:
        if (
            not DIRECT_LAUNCH
            or not self.launches_directly
            or len(args) != self.runtime_count  # not the runtime arguments in order: Triton binds them
            or len(constexprs) != len(self.constexpr_names)  # a default left out: Triton binds it
            or _launch_hooks_installed()
        ):
            self.kernel[grid](*args, **constexprs, num_warps=num_warps)
            return
        constexpr_values = self.constexpr_values(constexprs)
        key, launch_args = self.key_and_launch_args(args, constexpr_values, index, num_warps)
        compiled = self.compiled.get(key)
        if compiled is None:
            # Triton compiles (or finds) and launches it; later launches go straight to it.
            kernel = self.kernel[grid](*args, **constexprs, num_warps=num_warps)
            self.current_stream = triton.runtime.driver.active.get_current_stream  # before any key
            self.compiled[key] = (kernel.run, kernel.function, kernel.packed_metadata)
            return
        run, function, packed_metadata = compiled
        grid_y = grid[1] if len(grid) > 1 else 1
        grid_z = grid[2] if len(grid) > 2 else 1
        run(
            grid[0],
            grid_y,
            grid_z,
            self.current_stream(index),
            function,
            packed_metadata,
            None,  # launch metadata, for the hooks
            None,  # launch_enter_hook
            None,  # launch_exit_hook
            *launch_args,
            *constexpr_values,
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
