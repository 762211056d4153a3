"""Memory budgets that make the chooser run a given scheme, for the tests of that scheme."""

from __future__ import annotations

import torch

from flce.dispatch import get_backend, split_rows_of
from flce.driver.chunks import GradRequest
from flce.driver.schemes import Scheme, block_scheme, choose_scheme, describe_call
from flce.driver.sizing import BLOCK_ALIGNMENT, CallShape, weight_grad_tail_start
from flce.options import LossOptions
from flce.plan import fused_statistics_apply


def inside_dw_budget(call: CallShape) -> tuple[int, Scheme]:
    """(budget, scheme): a budget under which the chooser runs the vocabulary blocks with
    their workspace inside dW, the workspace of that variant at the widest aligned width it
    picks there (the fewest blocks: Triton's interpreter runs each block's kernels slowly)."""
    for width in range(call.vocab // BLOCK_ALIGNMENT * BLOCK_ALIGNMENT, 0, -BLOCK_ALIGNMENT):
        if weight_grad_tail_start(call, call.n_rows, width) is None:
            continue
        budget = block_scheme(call, call.n_rows, width, workspace_in_weight_grad=True).memory.workspace
        scheme = choose_scheme(call, budget)
        if scheme.workspace_in_weight_grad:
            return budget, scheme
    raise AssertionError(f"no budget runs the vocabulary blocks inside dW for {call}")


def call_of(
    x: torch.Tensor,  # (N, H)
    w: torch.Tensor,  # (V, H)
    backend: str,
    bias: torch.Tensor | None = None,
    options: LossOptions | None = None,
    has_ce_weight: bool = False,
) -> CallShape:
    """The ``CallShape`` the plan describes for a fused fwd+bwd of these tensors on
    ``backend`` (dX, dW, and db with a bias), the fused first pass where the plan takes it."""
    spec = get_backend(backend)
    options = options or LossOptions()
    fused = fused_statistics_apply(
        spec,
        options,
        x.dtype,
        x.device,
        x.shape[1],
        w.shape[0],
        has_ce_weight=has_ce_weight,
        weight_tma_ready=True,
        loss_only=False,
    )
    return describe_call(
        x,
        w,
        bias,
        GradRequest(True, True, bias is not None),
        options,
        x.dtype,
        spec,
        split_rows_of(spec),
        whole_row_statistics=spec.loss_only if fused else None,
    )
