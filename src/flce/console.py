"""What the command-line tools share (``flce`` and ``flce bench``): the one-line
``CommandError``, the ``--device`` argument and a progress display."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

Progress = Callable[[int, str], None]


class CommandError(Exception):
    """A mistake in the command line or a request this machine cannot serve; the message
    is the whole report (one line, what is wrong and what to do)."""


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def resolve_device(text: str | None) -> torch.device:
    """The ``--device`` argument as a device this machine has (the default device when
    None); ``CommandError`` otherwise, before anything is allocated on it."""
    if text is None:
        return default_device()
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise CommandError(f"--device {text!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = (
                f"this torch ({torch.__version__}) is built without CUDA"
                if torch.version.cuda is None
                else "torch.cuda.is_available() is False (no GPU visible, or a driver problem)"
            )
            raise CommandError(f"--device {text}: no CUDA device here: {why}; run on a GPU machine or use --device cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise CommandError(f"--device {text}: this machine has {count} CUDA device(s) (cuda:0 to cuda:{count - 1})")
    elif device.type == "meta":
        raise CommandError(f"--device {text}: the meta device holds no data; the commands compute real values")
    elif device.type != "cpu" and not _device_type_available(device.type):
        raise CommandError(f"--device {text}: no {device.type} device here; use --device {default_device()}")
    return device


def _device_type_available(device_type: str) -> bool:
    """Whether this machine has a device of an accelerator type other than CUDA (mps,
    xpu, ...): its ``torch.<type>.is_available()`` where torch has one."""
    module = getattr(torch, device_type, None)
    is_available = getattr(module, "is_available", None)
    return callable(is_available) and bool(is_available())


@contextmanager
def progress_reporter(total: int, enabled: bool = True) -> Iterator[Progress]:
    """A rich progress bar over ``total`` steps, advanced by ``tick(steps, what)``; without
    rich, one line per new ``what`` prefix (up to the first of " probe", " warm", " round",
    " memory", " case", the parts of a step that repeat)."""
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        seen: set[str] = set()

        def plain(n: int, what: str) -> None:
            head = what
            for part in (" probe", " warm", " round", " memory", " case"):
                head = head.split(part)[0]
            if enabled and head not in seen:
                seen.add(head)
                print(f"{head} ...", flush=True)

        yield plain
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=True, disable=not enabled) as bar:
        task = bar.add_task("", total=total)

        def tick(n: int, what: str) -> None:
            bar.update(task, advance=n, description=what[:60])

        yield tick
