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
  else, on CUDA, by the next flce call (or ``flce.check_errors()``), from a flag copied to
  pinned memory in the background. A call reads the earlier calls' flags once its own
  kernels are queued (``pending_checks``, ``raise_pending(earlier=...)``): the host work
  of reading them does not delay its first GEMM. The checks are the process's: with
  several threads calling flce, the next call of any of them reads them, each once.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from flce.options import environment_mode

VALIDATE_ENV_VAR = "FLCE_VALIDATE"
_MODES = ("async", "sync")


def validates_synchronously(device: torch.device) -> bool:
    """Whether the checks of a call on ``device`` read their counts on the host at once."""
    return environment_mode(VALIDATE_ENV_VAR, _MODES) == "sync" or device.type != "cuda"


@dataclass(frozen=True)
class _Slot:
    """Where one call's counts land on the host, reused by later calls: pinned memory
    and an event cost host time to create (more than the copy itself)."""

    key: tuple  # (device, shape, dtype) of the counts it takes
    host: torch.Tensor  # the counts' shape and dtype, in pinned host memory
    landed: torch.cuda.Event  # recorded after the copy, on the counts' device


@dataclass(frozen=True)
class _Pending:
    slot: _Slot  # holding a non-blocking copy of the counts (in flight until ``landed``)
    describe: Callable[[list], str | None]  # the counts -> the error message, or None


_pending: deque[_Pending] = deque()
# Slots whose counts have been read, by ``_Slot.key``: a call takes one instead of
# allocating. Their number is the most calls ever pending at once (a few: each flce call
# reads the counts that have landed first).
_free_slots: dict[tuple, deque[_Slot]] = {}
# Guards both: threads (DataParallel's replicas, a loss per device) defer and read checks at
# once, and a check read by two of them, or a slot freed twice, would lose another call's.
_lock = threading.Lock()


def _new_slot(key: tuple) -> _Slot:
    _, shape, dtype = key
    # A slot outlives the call that made it: made under torch.inference_mode its buffer
    # would be an inference tensor, which refuses the copies of later calls outside it.
    # Host memory whatever default device the caller set (a CUDA tensor cannot be pinned).
    with torch.inference_mode(False):
        host = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)
    return _Slot(key, host, torch.cuda.Event())


class _Recording(threading.local):
    """Where ``defer`` records the checks of this thread's calls instead of copying their
    counts, while ``recording_checks`` is active (None: not recording). Per thread: a
    capture in one thread must not take another thread's checks."""

    checks: list | None = None


_recording = _Recording()


@contextlib.contextmanager
def recording_checks(checks: list) -> Iterator[None]:
    """While active, ``defer`` appends ``(counts, describe)`` to ``checks`` instead of
    copying the counts, for this thread's calls: the checks of a call captured into a CUDA
    graph, which the caller defers after each replay (``flce.driver.graphs``)."""
    outer, _recording.checks = _recording.checks, checks
    try:
        yield
    finally:
        _recording.checks = outer


def defer(counts: torch.Tensor, describe: Callable[[list], str | None]) -> None:
    """Copies the device ``counts`` to pinned host memory in the background; the next
    ``raise_pending`` raises ``describe(counts.tolist())`` once the copy has landed.
    Recorded instead while ``recording_checks`` is active; skipped during the caller's
    own CUDA-graph capture (its replays cannot report; the NaN poisoning still applies)."""
    recording = _recording.checks
    if recording is not None:
        recording.append((counts, describe))
        return
    if torch.cuda.is_current_stream_capturing():
        return
    key = (counts.device, counts.shape, counts.dtype)
    with _lock:
        free = _free_slots.get(key)
        slot = free.pop() if free else None
    if slot is None:  # none free for these counts (yet)
        slot = _new_slot(key)
    slot.host.copy_(counts, non_blocking=True)  # on the current stream of the counts' device
    slot.landed.record(torch.cuda.current_stream(counts.device))
    with _lock:
        _pending.append(_Pending(slot, describe))


def pending_checks() -> int:
    """How many calls' checks are pending: what a call counts at its start, to read those
    of the calls before it (``raise_pending(earlier=...)``) once its own kernels are queued."""
    return len(_pending)


def raise_pending(wait: bool = False, earlier: int | None = None) -> None:
    """Raises the first problem an earlier call reported (``ValueError``); ``wait`` blocks
    until every earlier call's counts have landed, else only those already landed are read.
    ``earlier``: read at most that many of the oldest checks (``pending_checks()`` at the
    start of the current call: never the current call's own, whose outputs are NaN and
    whose error the next call raises, however fast the GPU was)."""
    message = take_pending_error(wait, earlier)
    if message is not None:
        raise ValueError(message)


def take_pending_error(wait: bool = False, earlier: int | None = None) -> str | None:
    """``raise_pending``'s message instead of raising it (None: no problem read), for a
    caller that must raise it on several processes at once (``flce.parallel``)."""
    # Only CUDA calls defer checks: with some pending, CUDA is there to ask about capture.
    if earlier == 0 or not _pending or torch.cuda.is_current_stream_capturing():
        return None
    message = None
    with _lock:  # each check read once, whichever thread reads it
        remaining = len(_pending) if earlier is None else earlier
        while _pending and remaining > 0:
            remaining -= 1
            head = _pending[0]
            if wait:
                head.slot.landed.synchronize()
            elif not head.slot.landed.query():
                break
            _pending.popleft()
            message = head.describe(head.slot.host.tolist())
            _free_slots.setdefault(head.slot.key, deque()).append(head.slot)  # read: free to reuse
            if message is not None:
                _pending.clear()  # as discard_pending
                break
    return message


def discard_pending() -> None:
    """Forgets the checks still pending (their calls' outputs stay NaN). Their slots are
    dropped, not reused: a copy into one may still be in flight (PyTorch's pinned-memory
    allocator keeps the memory until it has landed)."""
    with _lock:
        _pending.clear()


def check_errors() -> None:
    """Waits for the checks of every earlier flce call on CUDA and raises a ``ValueError``
    for the first bad input found (their losses and gradients were NaN). Call it where a
    training loop may block, e.g. after the optimizer step, or before reading the loss."""
    raise_pending(wait=True)
