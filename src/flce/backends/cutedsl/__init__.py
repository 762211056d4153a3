"""The ``cutedsl`` backend: chunk CE as a CuTe DSL kernel (nvidia-cutlass-dsl), sm_90+.

Importing this package never imports ``cutlass``: the kernel module is loaded on the
first call, so a missing optional dependency only shows up in ``availability``.
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from functools import cache

import torch

from flce.backends.base import (
    BackendSpec,
    InPlaceSplitRowKernels,
    LossOnlyStatistics,
    lazy_chunk_kernel,
    lazy_function,
)

MIN_CAPABILITY = (9, 0)
INSTALL_HINT = "pip install 'flce[cutedsl]'"
FUSED_FORWARD_BLOCK_K = 64  # fused_forward.BLOCK_K, without importing cutlass
FUSED_FORWARD_MAX_VOCAB = (2**31 - 1) // 2  # the kernel's int32 column indices
# The fused kernel's launch shapes (fused_forward.default_config: 256-column tiles, in
# clusters of two along M of 64-row ping-pong or 128-row cooperative tiles: 128 or 256 rows;
# a launch covers a multiple of 256 rows on both) and the budget of its per-tile statistics
# (its DEFAULT_WORKSPACE_BYTES), for the memory model without importing cutlass.
FUSED_FORWARD_TILE_N = 256
FUSED_FORWARD_LAUNCH_ROWS_MULTIPLE = 256
FUSED_FORWARD_WORKSPACE_BYTES = 48 * 1024 * 1024


def fused_forward_applicable(
    device: torch.device,
    compute_dtype: torch.dtype,
    hidden: int,
    vocab: int,
    weight_tma_ready: bool,
) -> tuple[bool, str]:
    """Whether ``fused_forward.fused_forward_statistics`` (one GEMM whose epilogue keeps a
    few numbers per row; no logits buffer at all) can compute a call's whole-row
    statistics: ``(True, "")``, or ``(False, reason)``, and the caller runs the chunked
    driver, which supports everything. ``weight_tma_ready``: whether the weight, once in
    ``compute_dtype``, is contiguous and 16-byte aligned. The backend is usable on
    ``device`` (the registry checked), so the kernel's dependencies are present."""
    capability = _capability(device.type, device.index)
    # WGMMA and TMA multicast are sm_90a instructions: Hopper only, not later architectures.
    if capability is None or capability[0] != 9:
        return False, f"the fused kernel is built for sm_90a (Hopper), device has {capability}"
    # WGMMA operands are bf16/fp16; fp32 inputs would run as tf32, less exact than the
    # driver's fp32 GEMM.
    if compute_dtype not in (torch.bfloat16, torch.float16):
        return False, f"compute dtype {compute_dtype} is not bfloat16/float16"
    # The main loop has no K remainder: H must be whole 64-element (128-byte) TMA tiles.
    if hidden <= 0 or hidden % FUSED_FORWARD_BLOCK_K:
        return False, f"H={hidden} is not a positive multiple of {FUSED_FORWARD_BLOCK_K}"
    if vocab > FUSED_FORWARD_MAX_VOCAB:
        return False, f"V={vocab} exceeds the kernel's int32 column indices"
    # TMA reads the weight in place, which needs it row-major and aligned; the chunked
    # driver takes any layout without copying the V x H weight.
    if not weight_tma_ready:
        return False, "the weight is not contiguous and 16-byte aligned"
    return True, ""


def _tile_statistics_bytes(with_logit_sum: bool) -> int:
    """Per row and vocabulary tile: max, sum of exp and argmax (and the logit sum)."""
    return 16 if with_logit_sum else 12


def fused_forward_rows_per_launch(
    num_rows: int,
    vocab: int,
    with_logit_sum: bool,
    *,
    tile_n: int = FUSED_FORWARD_TILE_N,
    rows_multiple: int = FUSED_FORWARD_LAUNCH_ROWS_MULTIPLE,
    workspace_bytes: int = FUSED_FORWARD_WORKSPACE_BYTES,
) -> int:
    """Rows one launch of the fused kernel covers: as many as keep its (T, rows) tile
    statistics (T = ceil(V / tile_n)) within ``workspace_bytes``, a multiple of
    ``rows_multiple`` (whole cluster row blocks), at least one multiple."""
    per_row = -(-vocab // tile_n) * _tile_statistics_bytes(with_logit_sum)
    rows = max(rows_multiple, workspace_bytes // per_row // rows_multiple * rows_multiple)
    return min(rows, num_rows)


def fused_forward_workspace_bytes(num_rows: int, vocab: int, with_logit_sum: bool, has_bias: bool) -> int:
    """The bytes ``fused_forward.fused_forward_statistics`` allocates at its default launch
    shape: the (N,) outputs (lse, target logit and argmax: 16 bytes a row, 20 with the
    logit sum), the fp32 copy of a bias, and one launch's (T, rows) tile statistics."""
    tiles = -(-vocab // FUSED_FORWARD_TILE_N)
    rows = fused_forward_rows_per_launch(num_rows, vocab, with_logit_sum)
    outputs = num_rows * (20 if with_logit_sum else 16)
    return outputs + (vocab * 4 if has_bias else 0) + tiles * rows * _tile_statistics_bytes(with_logit_sum)


# The DSL's ``-diagnostic`` option and its values: what of the process's command line the
# DSL reads at each compile (``dsl_command_line``).
DSL_DIAGNOSTIC_OPTION = "-diagnostic"
DSL_DIAGNOSTIC_VALUES = ("all", "fail", "success", "info", "suggestion")


def dsl_command_line(argv: list[str]) -> list[str]:
    """What of ``argv`` (``sys.argv``) the CuTe DSL may see while it compiles a kernel: the
    program name and the DSL's own ``-diagnostic`` option (with its value), nothing else.

    nvidia-cutlass-dsl (4.8) parses ``sys.argv`` with ``argparse`` at every compile to find
    that option, and argparse takes abbreviations: a training script run with ``--h 4096``
    (or ``--he``, ``--hel``) printed the DSL's usage and exited at flce's first compile,
    and a typo of the option exited with an argparse error. The user's own options are
    never the DSL's, so they are hidden from it."""
    kept = argv[:1]
    rest = argv[1:]
    for i, arg in enumerate(rest):
        if arg == DSL_DIAGNOSTIC_OPTION or arg.startswith(DSL_DIAGNOSTIC_OPTION + "="):
            kept.append(arg)
            if arg == DSL_DIAGNOSTIC_OPTION and i + 1 < len(rest) and rest[i + 1] in DSL_DIAGNOSTIC_VALUES:
                kept.append(rest[i + 1])
    return kept


# Held while sys.argv is swapped: two threads compiling at once would otherwise each save
# what the other set, and the user's command line could stay reduced for good.
_COMMAND_LINE_LOCK = threading.RLock()


@contextmanager
def command_line_for_dsl():
    """``sys.argv`` reduced to ``dsl_command_line(sys.argv)`` for the duration of a compile
    (one thread's compile at a time)."""
    with _COMMAND_LINE_LOCK:
        saved = getattr(sys, "argv", None)  # an embedded interpreter may have none
        sys.argv = dsl_command_line(list(saved)) if saved is not None else [""]
        try:
            yield
        finally:
            if saved is None:
                del sys.argv
            else:
                sys.argv = saved


@cache
def _capability(device_type: str, index: int | None) -> tuple[int, int] | None:
    if device_type != "cuda":
        return None
    return torch.cuda.get_device_capability(index if index is not None else torch.cuda.current_device())


@cache
def _dsl_installed() -> tuple[bool, str]:
    """Whether nvidia-cutlass-dsl is installed (package metadata only, no import)."""
    try:
        from importlib import metadata

        version = metadata.version("nvidia-cutlass-dsl")
    except Exception:  # PackageNotFoundError, or broken metadata
        return False, f"nvidia-cutlass-dsl is not installed ({INSTALL_HINT})"
    try:
        import importlib.util

        if importlib.util.find_spec("cutlass") is None:
            return False, f"nvidia-cutlass-dsl {version} is installed but 'cutlass' is not importable ({INSTALL_HINT})"
    except Exception as exc:  # a broken installation must not break dispatch
        return False, f"nvidia-cutlass-dsl {version} looks broken: {exc}"
    return True, ""


@cache
def _device_ok(device_type: str, index: int | None) -> tuple[bool, str]:
    if device_type != "cuda":
        return False, f"needs a CUDA device, got {device_type}"
    try:
        if not torch.cuda.is_available():
            return False, "CUDA is not available"
        major, minor = torch.cuda.get_device_capability(index)
    except Exception as exc:
        return False, f"cannot query the CUDA device: {exc}"
    if (major, minor) < MIN_CAPABILITY:
        return False, f"needs compute capability >= 9.0 (Hopper), device has {major}.{minor}"
    return True, ""


def availability(device: torch.device) -> tuple[bool, str]:
    """``(True, "")`` on a CUDA device of compute capability >= 9.0 with nvidia-cutlass-dsl
    installed, else ``(False, reason)``. Cheap (cached), never raises."""
    try:
        device = torch.device(device)
        ok, why = _dsl_installed()
        if not ok:
            return ok, why
        return _device_ok(device.type, device.index)
    except Exception as exc:
        return False, f"cutedsl availability check failed: {exc}"


BACKEND = BackendSpec(
    name="cutedsl",
    cross_entropy_chunk=lazy_chunk_kernel("flce.backends.cutedsl.ce"),
    split_rows=lambda: InPlaceSplitRowKernels("cutedsl", "flce.backends.cutedsl.partial"),
    availability=availability,
    extra_bytes_per_logit=0,
    auto_priority=20,
    description="CuTe DSL chunk CE kernel (sm_90+): one pass of online softmax, gradient in place",
    loss_only=LossOnlyStatistics(
        applicable=fused_forward_applicable,
        statistics=lazy_function("flce.backends.cutedsl.fused_forward", "prechecked_fused_forward_statistics"),
        workspace_bytes=fused_forward_workspace_bytes,
    ),
    block_gradient=lazy_function("flce.backends.cutedsl.fused_gradient", "fused_block_gradient"),
)
