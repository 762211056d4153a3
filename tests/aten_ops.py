"""The PyTorch ops a piece of host code dispatches, in order (for tests of the host work
before a call's first GEMM, and of the ops per call)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

# Ops that launch no kernel: allocations without a fill, and views.
NO_KERNEL_OPS = frozenset(
    {"empty", "empty_strided", "slice", "view", "split", "t", "transpose", "unbind", "as_strided", "select", "alias"}
)
GEMM_OPS = frozenset({"mm", "addmm"})


def op_name(qualified: str) -> str:
    """``aten.addmm.default`` -> ``addmm``."""
    return qualified.split(".")[1]


class AtenOps(TorchDispatchMode):
    """Records every op PyTorch dispatches while active (``names``: qualified names)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))
