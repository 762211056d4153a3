"""Spawned gloo ranks on CPU: one port picker and one rank lifetime for every test that
starts processes (``tests/parallel``, ``tests/integrations/test_fsdp.py``)."""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys

import torch.distributed as dist


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, port: int, timeout_s: float = 60.0):
    """One spawned rank's process group, from start to process exit.

    A body that finishes meets its peers at a barrier (no rank destroys the group while
    another still uses it), destroys the group and leaves the process at once with exit
    code 0. Skipping interpreter finalization is the point: gloo's worker threads can
    still hold work whose tensors are freed while the interpreter is torn down, and the
    C++ runtime then aborts the process ("terminate called without an active
    exception", SIGABRT) after its results were saved, about once a CI run under load.
    A body that raises destroys the group and lets the exception reach ``mp.spawn``,
    which reports it to the parent.
    """
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
