"""The logprobs head's plan: per-token log-probabilities of the target class and the
entropy of ``softmax((x W^T + b) / temperature)``, differentiable with any upstream
gradients (row math: ``flce.rows.logprobs``).

Forward: per token chunk, the logits GEMM and the backend's ``logprobs_forward_chunk``,
which stores each row's logprob, entropy (when asked for) and lse. The lse is kept in
float64 (8 bytes a row): the backward's ``p_i = exp(z_i - lse)`` then carries no rounding
of it (``flce.rows.logprobs``, numerics).

Backward: the gradient depends on every token's upstream gradients (a GRPO loss weighs
each logprob by its advantage), so it cannot be formed in the forward as the
cross-entropy's is. ``logprobs_backward_chunk`` writes dL/dlogits over the chunk's
logits (one read and one write) with the upstream gradients of the logprob and the
entropy folded into each row; dX and dW/db follow as for the cross-entropy. Where do
the logits come from? Two schemes, chosen once per call from its shapes, options and
the memory budget (``choose_logprobs_scheme``; no host sync):

- **kept logits** (three GEMMs, 6NVH, as the cross-entropy): when one chunk of every
  row fits the call's memory budget (``memory_budget``, ``FLCE_MEMORY_BUDGET_MIB`` or the
  default rule: ``flce.driver.schemes``, as the cross-entropy's one-chunk scheme), the
  forward runs one chunk and keeps its ``(N, V)`` logits buffer (compute dtype; no
  copy), and the backward forms dL/dlogits in place over it, then dX and dW, each one
  GEMM (dW written in the weight's dtype: no fp32 accumulator). The kept logits are
  the very tensor the forward's kernel read, so the backward sees the same bits as a
  recompute of the same GEMM would give. They live from the forward to the first
  backward, which consumes them; a repeated backward (``retain_graph=True``) recomputes.
  The plan holds them (autograd keeps it with the graph), as the cross-entropy's forward
  gradients are held: they are not saved through ``save_for_backward``, whose version
  check would refuse the in-place gradient, so saved-tensor hooks (activation offloading,
  non-reentrant checkpointing) do not see them; a ``chunk_size`` below the number of
  tokens recomputes instead.
  The default budget, ``max(512 MiB, V'*H*4)`` with dW of a bf16 weight (``V'``: V
  rounded up to the logits' row stride, ``flce.driver.sizing``), keeps them
  while ``N <= 2H`` in bf16: the batch's logits are then no larger than the fp32 dW
  accumulator the recompute would need.
- **recompute** (four GEMMs, 8NVH): otherwise, or with ``chunk_size < N``, or with no
  gradient to come (no-grad calls; the compiled custom ops, whose forward and backward
  are planned apart): the forward keeps nothing, and the backward recomputes each
  chunk's logits with the forward's chunking (the same GEMMs: the same bits).

Bad targets follow the cross-entropy's rule (``flce.driver.validation``): a target
outside ``[0, V)`` (and not ``ignore_index``) makes the call's logprobs, entropies and
gradients NaN and raises ``ValueError`` (at once on the CPU, else at the next flce call),
with no host sync and no read outside a row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flce.backends.base import BackendSpec
from flce.dispatch import resolve_backend
from flce.driver.chunks import NO_GRADIENTS, Gradients, GradRequest, LinearHead, row_range, run_token_chunks
from flce.driver.gemm import fp32_output_gemm_supported, weight_accumulator_dtype
from flce.driver.schemes import MemoryBudgetError, scheme_for_call
from flce.driver.sizing import CallShape
from flce.driver.statistics import BatchStatistics, batch_statistics
from flce.options import LogprobsOptions, LossOptions, cached_options


@dataclass(frozen=True)
class LogprobsOperands:
    """``flce.fused_linear_logprobs``'s tensors, validated and flattened."""

    entry = "flce.fused_linear_logprobs"

    input: torch.Tensor  # (N, H)
    weight: torch.Tensor  # (V, H)
    bias: torch.Tensor | None  # (V,)
    target: torch.Tensor  # (N,) int32/int64

    @property
    def n_rows(self) -> int:
        return self.input.shape[0]

    def tensors(self) -> tuple:
        """The autograd inputs, differentiable ones first."""
        return self.input, self.weight, self.bias, self.target

    def differentiable(self) -> tuple:
        return self.input, self.weight, self.bias

    def request(self, needs_grad: tuple[bool, ...]) -> GradRequest:
        return GradRequest(input=needs_grad[0], weight=needs_grad[1], bias=self.bias is not None and needs_grad[2])

    @staticmethod
    def gradient_tuple(grads: Gradients) -> tuple:
        return grads.input, grads.weight, grads.bias, None


def backward_request(operands: LogprobsOperands) -> GradRequest:
    """The gradients a backward of this call would compute: those of the differentiable
    operands that require grad, with grad mode on (``flce.plan.run_loss`` runs autograd
    exactly then, and autograd asks for exactly these)."""
    enabled = torch.is_grad_enabled()
    return operands.request(tuple(enabled and t is not None and t.requires_grad for t in operands.differentiable()))


@dataclass(frozen=True)
class LogprobsScheme:
    """How a call runs (module docstring)."""

    rows: int  # rows per chunk, of the forward and of a recomputing backward
    keeps_logits: bool  # one chunk of every row, its logits kept for the backward


def choose_logprobs_scheme(
    operands: LogprobsOperands,
    options: LogprobsOptions,
    compute_dtype: torch.dtype,
    extra_bytes_per_logit: int,  # the logprobs kernels' workspace per logit
    backward: GradRequest | None,  # what a backward will compute; None: not known here
) -> LogprobsScheme:
    """The module docstring's choice. The budget and the chunks are those of the
    cross-entropy's token-chunk scheme for the gradients of ``backward`` (of every
    differentiable operand when it is None): one chunk of every row fits exactly when the
    logits can be kept at the workspace the cross-entropy's one chunk would take. An
    explicit ``chunk_size`` names the rows per chunk; the logits are kept only if it
    holds every row and the budget allows (a budget too small to size chunks then does
    not raise, as for the cross-entropy)."""
    o = operands
    n_rows = o.n_rows
    may_keep = backward is not None and backward.any and n_rows > 0
    chunk_size = options.chunk_size
    if chunk_size is not None and (chunk_size < n_rows or not may_keep):
        return LogprobsScheme(chunk_size, keeps_logits=False)
    gradients = GradRequest(True, True, o.bias is not None) if backward is None else backward
    call = CallShape(
        n_rows=n_rows,
        vocab=o.weight.shape[0],
        hidden=o.input.shape[1],
        input_dtype=o.input.dtype,
        weight_dtype=o.weight.dtype,
        compute_dtype=compute_dtype,
        accumulator_dtype=weight_accumulator_dtype(None, o.weight.dtype),
        grad_input=gradients.input,
        grad_weight=gradients.weight,
        bias_dtype=o.bias.dtype if gradients.bias else None,
        chunk_extra_bytes_per_logit=extra_bytes_per_logit,
        block_extra_bytes_per_logit=None,  # no vocabulary-block kernels for this head
        upcast_operands=not fp32_output_gemm_supported(o.input.device),
    )
    try:
        budget = cached_options(LossOptions, memory_budget=options.memory_budget)
        budget_rows = scheme_for_call(call, budget, o.input.device).rows
    except MemoryBudgetError:
        if chunk_size is None:
            raise
        budget_rows = 0  # the rows are named; only keeping needed the budget
    if may_keep and budget_rows >= n_rows:
        return LogprobsScheme(n_rows, keeps_logits=True)
    return LogprobsScheme(chunk_size or budget_rows, keeps_logits=False)


@dataclass
class KeptLogits:
    """The forward's logits of every row, held for the call's first backward, which
    overwrites them with dL/dlogits: ``take`` hands them over once (a repeated backward
    recomputes), and frees them from the plan, which autograd keeps alive with the graph."""

    logits: torch.Tensor | None = None  # (N, V) compute dtype

    def take(self) -> torch.Tensor | None:
        logits, self.logits = self.logits, None
        return logits


@dataclass
class LogprobsRows:
    """The forward's per-row results."""

    logprob: torch.Tensor  # (N,) fp32, 0 on ignored rows
    entropy: torch.Tensor | None  # (N,) fp32, with return_entropy
    lse: torch.Tensor  # (N,) float64, what the backward needs
    predicted: torch.Tensor | None  # (N,) int64 first argmax of z, -1 on ignored rows; with return_predicted_tokens

    @staticmethod
    def allocate(n_rows: int, device: torch.device, options: LogprobsOptions) -> LogprobsRows:
        return LogprobsRows(
            logprob=torch.empty(n_rows, dtype=torch.float32, device=device),
            entropy=torch.empty(n_rows, dtype=torch.float32, device=device) if options.return_entropy else None,
            lse=torch.empty(n_rows, dtype=torch.float64, device=device),
            predicted=torch.empty(n_rows, dtype=torch.int64, device=device)
            if options.return_predicted_tokens
            else None,
        )


@dataclass
class LogprobsOutputs:
    """The public outputs: the logprobs and the entropy (differentiable), the predicted
    tokens (not)."""

    logprobs: torch.Tensor  # (N,) fp32
    entropy: torch.Tensor | None  # (N,) fp32
    predicted: torch.Tensor | None  # (N,) int64

    def as_tuple(self) -> tuple:
        return self.logprobs, self.entropy, self.predicted

    def non_differentiable(self) -> list[torch.Tensor]:
        return [] if self.predicted is None else [self.predicted]


@dataclass(frozen=True)
class LogprobsUpstream:
    """What the backward folds into each row: the outputs' upstream gradients (None where
    none flows) and the forward's residuals."""

    grad_logprob: torch.Tensor | None  # (N,) fp32
    grad_entropy: torch.Tensor | None  # (N,) fp32
    lse: torch.Tensor  # (N,) float64
    entropy: torch.Tensor | None  # (N,) fp32
    kept_logits: torch.Tensor | None  # (N, V) the forward's logits, or None: recompute them


@dataclass(frozen=True)
class LogprobsPlan:
    """Everything one ``fused_linear_logprobs`` call decided before its first kernel."""

    options: LogprobsOptions
    backend: BackendSpec  # one with a ``logprobs`` slot
    compute_dtype: torch.dtype
    stats: BatchStatistics  # the target check, computed on first use (after the first GEMM)
    scheme: LogprobsScheme
    kept: KeptLogits = field(default_factory=KeptLogits)  # this call's, filled by the forward

    @property
    def poison(self) -> torch.Tensor:
        """() fp32 on the device: 1, or NaN for a call with bad targets."""
        return self.stats.poison

    @property
    def defers_gradients(self) -> bool:
        return True  # per-token upstream gradients: known only in backward

    @property
    def gradient_prescale(self) -> float:
        return 1.0  # no gradient is computed in the forward

    def run(
        self, operands: LogprobsOperands, request: GradRequest, upstream: LogprobsUpstream | None = None
    ) -> tuple[LogprobsRows | None, Gradients]:
        """The forward's rows (``upstream`` None), or the backward's gradients."""
        o, options, kernels = operands, self.options, self.backend.logprobs
        head = LinearHead(o.input, o.weight, o.bias, self.compute_dtype)
        sizing = dict(
            chunk_size=self.scheme.rows, accum_dtype=None, extra_bytes_per_logit=kernels.extra_bytes_per_logit
        )
        if upstream is None:
            rows = None

            def allocate() -> None:  # once the first logits GEMM is queued (run_token_chunks)
                nonlocal rows
                rows = LogprobsRows.allocate(o.n_rows, o.input.device, options)

            def forward_kernel(logits, start, end, compute_grad, constant_logits) -> None:
                if self.scheme.keeps_logits:  # one chunk: ``logits`` is the whole (N, V) buffer
                    self.kept.logits = logits
                kernels.forward(
                    logits,
                    row_range(o.target, start, end),
                    inv_temperature=options.inv_temperature,
                    ignore_index=options.ignore_index,
                    logprob_out=row_range(rows.logprob, start, end),
                    entropy_out=row_range(rows.entropy, start, end),
                    lse_out=row_range(rows.lse, start, end),
                    predicted_out=row_range(rows.predicted, start, end),
                )

            run_token_chunks(head, forward_kernel, NO_GRADIENTS, **sizing, after_first_gemm=allocate)
            return rows, Gradients(None, None, None)

        u = upstream

        def backward_kernel(logits, start, end, compute_grad, constant_logits) -> None:
            kernels.backward(
                logits,
                row_range(o.target, start, end),
                row_range(u.lse, start, end),
                row_range(u.entropy, start, end),
                row_range(u.grad_logprob, start, end),
                row_range(u.grad_entropy, start, end),
                inv_temperature=options.inv_temperature,
                ignore_index=options.ignore_index,
            )

        return None, run_token_chunks(head, backward_kernel, request, **sizing, kept_logits=u.kept_logits)

    def reduce(self, rows: LogprobsRows) -> LogprobsOutputs:
        # The poison (1, or NaN for bad targets) reaches every output, as the CE's scales do.
        # The predicted tokens are indices: not poisoned, as the cross-entropy's are not.
        entropy = None if rows.entropy is None else rows.entropy * self.poison
        return LogprobsOutputs(rows.logprob * self.poison, entropy, rows.predicted)

    def residuals(self, rows: LogprobsRows) -> tuple:
        return rows.lse, rows.entropy

    def upstream(self, grad_outputs: tuple, residuals: tuple, n_rows: int) -> LogprobsUpstream | None:
        kept_logits = self.kept.take()  # this backward's alone, used or not
        grad_logprob, grad_entropy = grad_outputs[:2]  # the predicted tokens take none
        lse, entropy = residuals
        if entropy is None:
            grad_entropy = None  # not returned: nothing flows into it
        if grad_logprob is None and grad_entropy is None:
            return None

        def per_row(grad: torch.Tensor | None) -> torch.Tensor | None:
            return None if grad is None else grad.float().reshape(n_rows) * self.poison

        return LogprobsUpstream(per_row(grad_logprob), per_row(grad_entropy), lse, entropy, kept_logits)

    def finish_gradients(self, grads: Gradients) -> None:
        """Nothing to finish on one device."""

    def prepare_backward(self, operands, request: GradRequest) -> None:
        """Nothing to decide ahead: the scheme was chosen for the backward too."""


def make_logprobs_plan(
    options: LogprobsOptions,
    operands: LogprobsOperands,
    compute_dtype: torch.dtype,
    backward: GradRequest | None = None,
) -> LogprobsPlan:
    """The backend (the best one with logprobs kernels, or the requested one), the target
    check (``flce.driver.statistics``: on the device, no host sync) and the scheme.
    ``backward``: the gradients a backward of this call will compute
    (``backward_request``), or None where the forward and the backward are planned
    apart (the compiled custom ops): then the logits are never kept, and both plans
    size the chunks alike."""
    device = operands.input.device
    backend = resolve_backend(options.backend, device, needs="logprobs")
    vocab = operands.weight.shape[0]
    stats = batch_statistics(operands.target, None, vocab, options.ignore_index)
    scheme = choose_logprobs_scheme(operands, options, compute_dtype, backend.logprobs.extra_bytes_per_logit, backward)
    return LogprobsPlan(options, backend, compute_dtype, stats, scheme)
