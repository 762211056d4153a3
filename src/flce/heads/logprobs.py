"""The logprobs head's plan: per-token log-probabilities of the target class and the
entropy of ``softmax((x W^T + b) / temperature)``, differentiable with any upstream
gradients, without materializing the logits (row math: ``flce.rows.logprobs``).

Forward: per token chunk, the logits GEMM and the backend's ``logprobs_forward_chunk``,
which stores each row's logprob, entropy (when asked for) and lse. The lse is kept in
float64 (8 bytes a row): the backward's ``p_i = exp(z_i - lse)`` then carries no rounding
of it (``flce.rows.logprobs``, numerics). Nothing else survives the forward.

Backward: the gradient depends on every token's upstream gradients (a GRPO loss weighs
each logprob by its advantage), so it cannot be formed in the forward as the
cross-entropy's is; each chunk's logits are recomputed (one GEMM), and
``logprobs_backward_chunk`` writes dL/dlogits over them (one read and one write of the
chunk) with the upstream gradients of the logprob and the entropy folded into each row;
dX and dW/db follow as for the cross-entropy. A forward and backward costs four GEMMs
(8NVH) where the cross-entropy costs three.

Bad targets follow the cross-entropy's rule (``flce.driver.validation``): a target
outside ``[0, V)`` (and not ``ignore_index``) makes the call's logprobs, entropies and
gradients NaN and raises ``ValueError`` (at once on the CPU, else at the next flce call),
with no host sync and no read outside a row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flce.backends.base import BackendSpec
from flce.dispatch import resolve_backend
from flce.driver.chunks import NO_GRADIENTS, Gradients, GradRequest, LinearHead, run_token_chunks
from flce.driver.statistics import batch_statistics
from flce.options import LogprobsOptions


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


@dataclass
class LogprobsRows:
    """The forward's per-row results."""

    logprob: torch.Tensor  # (N,) fp32, 0 on ignored rows
    entropy: torch.Tensor | None  # (N,) fp32, with return_entropy
    lse: torch.Tensor  # (N,) float64, what the backward needs

    @staticmethod
    def allocate(n_rows: int, device: torch.device, with_entropy: bool) -> LogprobsRows:
        return LogprobsRows(
            logprob=torch.empty(n_rows, dtype=torch.float32, device=device),
            entropy=torch.empty(n_rows, dtype=torch.float32, device=device) if with_entropy else None,
            lse=torch.empty(n_rows, dtype=torch.float64, device=device),
        )


@dataclass
class LogprobsOutputs:
    """The public outputs, both differentiable."""

    logprobs: torch.Tensor  # (N,) fp32
    entropy: torch.Tensor | None  # (N,) fp32

    def as_tuple(self) -> tuple:
        return self.logprobs, self.entropy

    def non_differentiable(self) -> list[torch.Tensor]:
        return []


@dataclass(frozen=True)
class LogprobsUpstream:
    """What the backward folds into each row: the outputs' upstream gradients (None where
    none flows) and the forward's residuals."""

    grad_logprob: torch.Tensor | None  # (N,) fp32
    grad_entropy: torch.Tensor | None  # (N,) fp32
    lse: torch.Tensor  # (N,) float64
    entropy: torch.Tensor | None  # (N,) fp32


@dataclass(frozen=True)
class LogprobsPlan:
    """Everything one ``fused_linear_logprobs`` call decided before its first kernel."""

    options: LogprobsOptions
    backend: BackendSpec  # one with a ``logprobs`` slot
    compute_dtype: torch.dtype
    poison: torch.Tensor  # () fp32 on the device: 1, or NaN for a call with bad targets

    @property
    def defers_gradients(self) -> bool:
        return True  # per-token upstream gradients: known only in backward

    def run(
        self, operands: LogprobsOperands, request: GradRequest, upstream: LogprobsUpstream | None = None
    ) -> tuple[LogprobsRows | None, Gradients]:
        """The forward's rows (``upstream`` None), or the backward's gradients."""
        o, options, kernels = operands, self.options, self.backend.logprobs
        head = LinearHead(o.input, o.weight, o.bias, self.compute_dtype)
        sizing = dict(
            chunk_size=options.chunk_size, accum_dtype=None, extra_bytes_per_logit=kernels.extra_bytes_per_logit
        )
        if upstream is None:
            rows = LogprobsRows.allocate(o.n_rows, o.input.device, options.return_entropy)

            def forward_kernel(logits, start, end, compute_grad, constant_logits) -> None:
                kernels.forward(
                    logits,
                    o.target[start:end],
                    inv_temperature=options.inv_temperature,
                    ignore_index=options.ignore_index,
                    logprob_out=rows.logprob[start:end],
                    entropy_out=None if rows.entropy is None else rows.entropy[start:end],
                    lse_out=rows.lse[start:end],
                )

            run_token_chunks(head, forward_kernel, NO_GRADIENTS, **sizing)
            return rows, Gradients(None, None, None)

        def part(vector: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
            return None if vector is None else vector[start:end]

        u = upstream

        def backward_kernel(logits, start, end, compute_grad, constant_logits) -> None:
            kernels.backward(
                logits,
                o.target[start:end],
                u.lse[start:end],
                part(u.entropy, start, end),
                part(u.grad_logprob, start, end),
                part(u.grad_entropy, start, end),
                inv_temperature=options.inv_temperature,
                ignore_index=options.ignore_index,
            )

        return None, run_token_chunks(head, backward_kernel, request, **sizing)

    def reduce(self, rows: LogprobsRows) -> LogprobsOutputs:
        # The poison (1, or NaN for bad targets) reaches every output, as the CE's scales do.
        entropy = None if rows.entropy is None else rows.entropy * self.poison
        return LogprobsOutputs(rows.logprob * self.poison, entropy)

    def residuals(self, rows: LogprobsRows) -> tuple:
        return rows.lse, rows.entropy

    def upstream(self, grad_outputs: tuple, residuals: tuple, n_rows: int) -> LogprobsUpstream | None:
        grad_logprob, grad_entropy = grad_outputs
        lse, entropy = residuals
        if entropy is None:
            grad_entropy = None  # not returned: nothing flows into it
        if grad_logprob is None and grad_entropy is None:
            return None

        def per_row(grad: torch.Tensor | None) -> torch.Tensor | None:
            return None if grad is None else grad.float().reshape(n_rows) * self.poison

        return LogprobsUpstream(per_row(grad_logprob), per_row(grad_entropy), lse, entropy)

    def finish_gradients(self, grads: Gradients) -> None:
        """Nothing to finish on one device."""


def make_logprobs_plan(
    options: LogprobsOptions,
    device: torch.device,
    target: torch.Tensor,  # (N,)
    vocab: int,
    compute_dtype: torch.dtype,
) -> LogprobsPlan:
    """The backend (the best one with logprobs kernels, or the requested one) and the
    target check (``flce.driver.statistics``: on the device, no host sync)."""
    backend = resolve_backend(options.backend, device, needs="logprobs")
    stats = batch_statistics(target, None, vocab, options.ignore_index)
    return LogprobsPlan(options, backend, compute_dtype, stats.poison)
