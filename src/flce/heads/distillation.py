"""The distillation head's plan: Liger's generalized Jensen-Shannon divergence between a
teacher's and a student's next-token distributions, from both LM heads' hidden states,
without materializing either logits tensor (row math: ``flce.rows.distillation``).

Per token chunk, two GEMMs: the student's logits into the loop's reused buffer and the
teacher's into a second one (``flce.driver.chunks.run_token_chunks``'s constant head);
then the backend's ``distillation_chunk`` (per-row loss and, with gradients, dL/dlogits
of the student written over its logits), dX and dW/db of the student. The teacher is a
constant: its tensors are detached and get no gradient.

Both heads' logits are fp32 even from bf16/fp16 operands (``divergence_dtypes``): a
divergence between nearly equal distributions (self-distillation, a KL term against a
reference model) is a difference of nearly equal logits, which 16-bit logits' rounding
would swamp. In bf16, with the teacher's weights the student's plus 1e-3 noise, the loss
was 8% and dX 43% off float64 (as eager PyTorch's bf16 logits give), against 2e-5 and
1.6e-3 to 2.4e-3, about dX's own rounding, with fp32 logits of the same operands
(Liger-Kernel 0.8.5 computes them in fp32 too). The cost on CUDA: 4 bytes per logit
instead of 2 for each head, and the student's gradient cast back to the operands' dtype
for dX and dW (2 more); on a CPU the heads run in fp32.

The reduction is folded into a per-row gradient scale held on the device (no host
sync): ``1 / count`` of the rows not ignored for ``"mean"`` (every row without a
target; 0 when there is none), 1 for ``"sum"``; so ``mean``/``sum`` compute the gradients
in the forward and scale them by the upstream scalar in backward, as the cross-entropy
does, and ``"none"`` recomputes them in backward with each row's upstream gradient.

Targets only mark the ignored rows, but a target outside ``[0, V)`` (and not
``ignore_index``) is refused as everywhere in flce (``flce.driver.validation``): NaN
loss and gradients, and ``ValueError``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from flce.backends.base import BackendSpec
from flce.dispatch import resolve_backend
from flce.driver.chunks import Gradients, GradRequest, LinearHead, row_range, run_token_chunks
from flce.driver.gemm import fp32_output_gemm_supported
from flce.driver.scaling import forward_gradient_prescale
from flce.driver.statistics import BatchStatistics, batch_statistics
from flce.options import DistillationOptions


def divergence_dtypes(operand_dtype: torch.dtype, device: torch.device) -> tuple[torch.dtype, torch.dtype]:
    """(the GEMMs' operand dtype, the logits' dtype) of a head whose operands are
    ``operand_dtype``: fp32 logits (module docstring). On CUDA from the 16-bit operands
    (``fp32_output_gemm_supported``: the GEMM writes its fp32 sums); on a CPU by running the
    head in fp32, its weight cast once per call as autocast's is (the chunk sizing counts
    it). A CUDA torch older than 2.8 keeps 16-bit logits: fp32 ones would need an fp32
    copy of the weight on the GPU (2 GiB at V = 128256, H = 4096)."""
    if operand_dtype not in (torch.bfloat16, torch.float16):
        return operand_dtype, operand_dtype
    if fp32_output_gemm_supported(device):
        return operand_dtype, torch.float32
    if device.type == "cpu":
        return torch.float32, torch.float32
    return operand_dtype, operand_dtype


@dataclass(frozen=True)
class DistillationOperands:
    """``flce.fused_linear_distillation``'s tensors, validated and flattened; the
    teacher's detached."""

    entry = "flce.fused_linear_distillation"

    input: torch.Tensor  # (N, H) the student's
    weight: torch.Tensor  # (V, H)
    bias: torch.Tensor | None  # (V,)
    teacher_input: torch.Tensor  # (N, H_t)
    teacher_weight: torch.Tensor  # (V, H_t)
    teacher_bias: torch.Tensor | None  # (V,)
    target: torch.Tensor | None  # (N,) int32/int64; None: no row ignored

    @property
    def n_rows(self) -> int:
        return self.input.shape[0]

    def tensors(self) -> tuple:
        """The autograd inputs, differentiable ones (the student's) first."""
        return (
            self.input,
            self.weight,
            self.bias,
            self.teacher_input,
            self.teacher_weight,
            self.teacher_bias,
            self.target,
        )

    def differentiable(self) -> tuple:
        return self.input, self.weight, self.bias

    def request(self, needs_grad: tuple[bool, ...]) -> GradRequest:
        return GradRequest(input=needs_grad[0], weight=needs_grad[1], bias=self.bias is not None and needs_grad[2])

    @staticmethod
    def gradient_tuple(grads: Gradients) -> tuple:
        return grads.input, grads.weight, grads.bias, None, None, None, None


@dataclass
class DistillationOutputs:
    loss: torch.Tensor  # () fp32 for mean/sum, (N,) for "none"

    def as_tuple(self) -> tuple:
        return (self.loss,)

    def non_differentiable(self) -> list[torch.Tensor]:
        return []


@dataclass(frozen=True)
class DistillationPlan:
    """Everything one ``fused_linear_distillation`` call decided before its first kernel."""

    options: DistillationOptions
    backend: BackendSpec  # one with a ``distillation`` slot
    compute_dtype: torch.dtype  # the student's GEMMs
    teacher_dtype: torch.dtype  # the teacher's GEMM
    device: torch.device
    n_rows: int
    stats: BatchStatistics | None  # the target check, computed on first use; None without a target
    fp16_row_sums: bool = False  # flce.driver.scaling.sums_rows_in_fp16 of the call's request

    @functools.cached_property
    def row_scale(self) -> torch.Tensor:
        """() fp32 on the device: the reduction's scale of each row, NaN for bad targets.
        Computed when the first kernel needs it, after the first logits GEMM is queued (as
        the cross-entropy's statistics are): the GPU starts sooner, and a call's own bad
        target is raised by the next call, never by itself."""
        device = self.device
        if self.stats is None:
            count_scale = torch.full((), 1.0 / self.n_rows if self.n_rows else 0.0, dtype=torch.float32, device=device)
            poison = torch.ones((), dtype=torch.float32, device=device)
        else:
            count_scale, poison = self.stats.accuracy_scale, self.stats.poison  # 1 / n_valid (0 when none is valid)
        return count_scale * poison if self.options.reduction == "mean" else poison

    @property
    def defers_gradients(self) -> bool:
        return self.options.reduction == "none"

    @functools.cached_property
    def gradient_prescale(self) -> float:
        """The upstream gradient of the forward's gradients (``forward_gradient_prescale``:
        an fp16 mean's keeps dX, rounded to fp16, in fp16's normal range)."""
        return forward_gradient_prescale(self.options.reduction, self.compute_dtype, self.n_rows, self.fp16_row_sums)

    @functools.cached_property
    def forward_row_scale(self) -> torch.Tensor:
        """() fp32: each row's factor of the forward's gradients, ``row_scale`` times
        ``gradient_prescale`` (exact: a power of two)."""
        prescale = self.gradient_prescale
        return self.row_scale if prescale == 1.0 else self.row_scale * prescale

    def run(
        self, operands: DistillationOperands, request: GradRequest, upstream: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Gradients]:
        """Per-row losses (N,) fp32, and the requested gradients with ``upstream`` (N,)
        (the per-row upstream gradient times the reduction's scale) or, without it, the
        reduction's scale folded into each row."""
        o, options, kernels = operands, self.options, self.backend.distillation
        losses = None

        def allocate() -> None:  # once the first logits GEMMs are queued (run_token_chunks)
            nonlocal losses
            losses = torch.empty(o.n_rows, dtype=torch.float32, device=o.input.device)

        def kernel(logits, start, end, compute_grad, constant_logits) -> None:
            (teacher_logits,) = constant_logits
            kernels.chunk(
                logits,
                teacher_logits,
                row_range(o.target, start, end),
                beta=options.beta,
                inv_temperature=options.inv_temperature,
                ignore_index=options.ignore_index,
                loss_out=row_range(losses, start, end),
                row_grad_scale=row_range(
                    self.forward_row_scale.expand(o.n_rows) if upstream is None else upstream, start, end
                ),
                compute_grad=compute_grad,
            )

        grads = run_token_chunks(
            LinearHead(o.input, o.weight, o.bias, *divergence_dtypes(self.compute_dtype, self.device)),
            kernel,
            request,
            chunk_size=options.chunk_size,
            accum_dtype=None,
            extra_bytes_per_logit=kernels.extra_bytes_per_logit,
            constant_heads=(
                LinearHead(
                    o.teacher_input,
                    o.teacher_weight,
                    o.teacher_bias,
                    *divergence_dtypes(self.teacher_dtype, self.device),
                ),
            ),
            after_first_gemm=allocate,
        )
        return losses, grads

    def reduce(self, losses: torch.Tensor) -> DistillationOutputs:
        if self.options.reduction == "none":
            return DistillationOutputs(losses * self.row_scale)  # the scale is 1, or NaN for bad targets
        return DistillationOutputs(losses.sum() * self.row_scale)

    def residuals(self, losses: torch.Tensor) -> tuple:
        return ()

    def upstream(self, grad_outputs: tuple, residuals: tuple, n_rows: int) -> torch.Tensor | None:
        """The loss's upstream gradient (() or (N,)) times the reduction's scale, per row."""
        grad_loss = grad_outputs[0]
        return None if grad_loss is None else (grad_loss.float() * self.row_scale).expand(n_rows).contiguous()

    def finish_gradients(self, grads: Gradients) -> None:
        """Nothing to finish on one device."""

    def prepare_backward(self, operands, request: GradRequest) -> None:
        """Nothing to decide ahead: the backward sizes its chunks as the forward did."""


def make_distillation_plan(
    options: DistillationOptions,
    device: torch.device,
    target: torch.Tensor | None,  # (N,)
    n_rows: int,
    vocab: int,
    compute_dtype: torch.dtype,
    teacher_dtype: torch.dtype,
    fp16_row_sums: bool = False,
) -> DistillationPlan:
    """The backend (the best one with a distillation kernel, or the requested one) and
    the target check (on the device, computed on first use, with the reduction's per-row
    scale: ``DistillationPlan.row_scale``)."""
    backend = resolve_backend(options.backend, device, needs="distillation")
    stats = None if target is None else batch_statistics(target, None, vocab, options.ignore_index)
    return DistillationPlan(options, backend, compute_dtype, teacher_dtype, device, n_rows, stats, fp16_row_sums)
