"""Input checks that need the data (target range, class weights), without a host sync.

A loss call must never read out of bounds and never return a silently finite loss for
bad targets, and it must not wait for the GPU (no host sync: CUDA-graph capture, and
the CPU free to queue the next layers' kernels). The rule (README, "What flce
guarantees"):

- the kernels never read a bad target's logit (they clamp the index) and the batch
  statistics turn the call's scales into NaN when a target is out of range or a class
  weight is negative or non-finite, so the loss and every gradient of that call are NaN;
- ``ValueError`` names the problem: at once on the CPU (where reading a count costs no
  GPU sync) and with ``FLCE_VALIDATE=sync`` (one host read per call, before any kernel);
  else, on CUDA, at the start of the next flce call (or at ``flce.check_errors()``),
  from a flag copied to pinned memory in the background.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

VALIDATE_ENV_VAR = "FLCE_VALIDATE"
_MODES = ("async", "sync")


def validates_synchronously(device: torch.device) -> bool:
    """Whether the checks of a call on ``device`` read their counts on the host at once."""
    mode = (os.environ.get(VALIDATE_ENV_VAR) or "async").strip().lower()
    if mode not in _MODES:
        raise ValueError(f"{VALIDATE_ENV_VAR} must be one of {_MODES}, got {mode!r}")
    return device.type != "cuda" or mode == "sync"


@dataclass
class _Pending:
    counts: torch.Tensor  # (k,) int64 in pinned host memory, filled by a non-blocking copy
    done: torch.cuda.Event
    describe: Callable[[list[int]], str | None]  # the counts -> the error message, or None


_pending: deque[_Pending] = deque()


def defer(counts: torch.Tensor, describe: Callable[[list[int]], str | None]) -> None:
    """Copies the device ``counts`` (k,) to pinned host memory in the background; the next
    ``raise_pending`` raises ``describe(counts)`` once the copy has landed. Skipped during
    CUDA-graph capture (a replay cannot report; the NaN poisoning still applies)."""
    if torch.cuda.is_current_stream_capturing():
        return
    host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
    host.copy_(counts, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    _pending.append(_Pending(host, done, describe))


def raise_pending(wait: bool = False) -> None:
    """Raises the first problem an earlier call reported (``ValueError``); ``wait`` blocks
    until every earlier call's counts have landed, else only those already landed are read."""
    # Only CUDA calls defer checks: with some pending, CUDA is there to ask about capture.
    if not _pending or torch.cuda.is_current_stream_capturing():
        return
    while _pending:
        head = _pending[0]
        if wait:
            head.done.synchronize()
        elif not head.done.query():
            return
        _pending.popleft()
        message = head.describe(head.counts.tolist())
        if message is not None:
            _pending.clear()
            raise ValueError(message)


def discard_pending() -> None:
    """Forgets the checks still pending (their calls' outputs stay NaN)."""
    _pending.clear()


def check_errors() -> None:
    """Waits for the checks of every earlier flce call on CUDA and raises a ``ValueError``
    for the first bad input found (their losses and gradients were NaN). Call it where a
    training loop may block, e.g. after the optimizer step, or before reading the loss."""
    raise_pending(wait=True)
