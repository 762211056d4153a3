"""The plan of one loss call, and the one forward/backward pair every entry point runs.

A plan holds everything a call decides before its first kernel: the options, the
backend (``flce.dispatch``), the compute dtype, the batch statistics and the kernel
scalars (``flce.driver.statistics``). ``Plan.run`` picks the scheme for the operands:

- given logits (``LogitsOperands``, ``flce.cross_entropy``): the chunk kernel over them;
- a call without gradients, where the backend has a ``loss_only`` slot that applies and
  its workspace fits the memory budget: whole-row statistics from one fused GEMM, no
  logits buffer (``flce.driver.fused``);
- otherwise token chunks (``flce.driver.chunks``) or token chunks x vocabulary blocks
  (``flce.driver.vocab_blocks``): ``chunk_size``/``vocab_chunk_size`` when given, else
  the fastest that fits the memory budget (``flce.driver.schemes``). Where the same
  ``loss_only`` slot applies, the vocabulary blocks take their first pass (the whole
  rows' statistics) from its one fused GEMM instead of a GEMM and a pass per block, and
  their second (each block's gradient) from the backend's ``block_gradient`` GEMM where
  it has one, instead of a logits GEMM and a gradient pass per block.

For the fused loss the choice (a ``Route``) is made once per layout and kept
(``Plan.route``): a training loop asks the same question every step, before its first GEMM.

``forward`` and ``backward`` are the host functions around ``run``, shared by the
autograd Function below (``LossFunction``), the no-grad path of the public functions,
the ``torch.library`` ops (``flce.ops``), the vocab-parallel loss (whose
``ParallelPlan`` runs the same pair through its own ``run`` and ``finish_gradients``)
and the other loss heads (``flce.heads``: the logprobs and distillation plans). Any
``LossPlan`` runs through them: the cross-entropy's side of the protocol is
``CrossEntropyPlan``.

Backward of ``mean``/``sum``: the gradients are computed during the forward (the logits
exist only there) and scaled by the upstream gradient in backward. The first backward
of the autograd Function owns them and scales them in place (``scale_gradients_``: on
CUDA the pass is skipped on the device when the upstream gradient is exactly 1, with no
host sync); the custom op, which must not modify its saved outputs, scales out of place.
A repeated backward (``retain_graph=True``) and ``reduction="none"`` recompute the
gradients with the upstream gradient folded into each row, so scaling never compounds;
so does every backward of a plan whose gradients depend on per-token upstream gradients
(``defers_gradients``: the logprobs head). In fp16 the forward computes the mean's
gradients at an upstream gradient of ``gradient_prescale`` (a power of two,
``flce.driver.scaling.forward_gradient_prescale``), which keeps the logits' gradient in
fp16's normal range, and the backward scales them by ``grad_loss / gradient_prescale``.

A small fused call whose layout repeats replays its forward from a CUDA graph of its own
(``graphed_forward``, ``flce.driver.graphs``): the outputs are copied out of the graph;
the autograd Function borrows its gradients instead and scales them into new tensors in
its backward, or recomputes them where a later call's replay has overwritten them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from flce.backends.base import (
    BackendSpec,
    BlockGradientGemm,
    LossOnlyStatistics,
    SplitRowKernels,
    softcap_tanh_is_approximate,
)
from flce.dispatch import resolve_backend, split_rows_of
from flce.driver.chunks import NO_GRADIENTS, Gradients, GradRequest, run_chunks, run_logits_chunks
from flce.driver.fused import loss_only_refusal, run_fused_statistics, whole_row_statistics_refusal
from flce.driver.graphs import (
    GRAPHED_CALLS,
    MAX_GRAPHED_WORK,
    Replay,
    copied_key,
    gemm_settings,
    graph_applies,
    tensor_key,
)
from flce.driver.scaling import (
    forward_gradient_prescale,
    prescaled_upstream,
    scale_gradients_,
    scaled_gradients,
    sums_rows_in_fp16,
)
from flce.driver.schemes import (
    Scheme,
    budget_environment,
    describe_call,
    loss_only_fits_budget,
    options_for_scheme,
    scheme_of_call,
)
from flce.driver.statistics import BatchStatistics, batch_statistics, chunk_scalars
from flce.driver.validation import pending_checks, raise_pending
from flce.driver.vocab_blocks import run_vocab_blocks
from flce.options import PLAIN_TENSOR_TYPES, KeptAnswers, LossOptions, refuse_create_graph
from flce.rows.cross_entropy import ChunkScalars, Reduced, RowOutputs, reduce_rows

# ------------------------------------------------------------------ operands


@dataclass(frozen=True)
class LinearOperands:
    """The fused loss's tensors, validated and flattened."""

    entry = "flce.fused_linear_cross_entropy"
    class_weight_name = "ce_weight"  # in the deferred checks' errors

    input: torch.Tensor  # (N, H)
    weight: torch.Tensor  # (V, H)
    bias: torch.Tensor | None  # (V,)
    target: torch.Tensor  # (N,)
    ce_weight: torch.Tensor | None  # (V,) fp32

    @property
    def n_rows(self) -> int:
        return self.input.shape[0]

    def tensors(self) -> tuple:
        """The autograd inputs, differentiable ones first."""
        return self.input, self.weight, self.bias, self.target, self.ce_weight

    def differentiable(self) -> tuple:
        return self.input, self.weight, self.bias

    def request(self, needs_grad: tuple[bool, ...]) -> GradRequest:
        """The gradients to compute, from autograd's ``needs_input_grad`` of ``tensors()``."""
        return GradRequest(input=needs_grad[0], weight=needs_grad[1], bias=self.bias is not None and needs_grad[2])

    @staticmethod
    def gradient_tuple(grads: Gradients) -> tuple:
        return grads.input, grads.weight, grads.bias, None, None


@dataclass(frozen=True)
class LogitsOperands:
    """``flce.cross_entropy``'s tensors, validated and flattened; the gradient is dL/dlogits."""

    entry = "flce.cross_entropy"
    class_weight_name = "weight"

    logits: torch.Tensor  # (N, V)
    target: torch.Tensor  # (N,)
    ce_weight: torch.Tensor | None  # (V,) fp32

    @property
    def n_rows(self) -> int:
        return self.logits.shape[0]

    def tensors(self) -> tuple:
        return self.logits, self.target, self.ce_weight

    def differentiable(self) -> tuple:
        return (self.logits,)

    def request(self, needs_grad: tuple[bool, ...]) -> GradRequest:
        return GradRequest(input=needs_grad[0])

    @staticmethod
    def gradient_tuple(grads: Gradients) -> tuple:
        return grads.input, None, None


Operands = LinearOperands | LogitsOperands


# --------------------------------------------------------------------- plans


class Outputs(Protocol):
    """A plan's public outputs of a call (``Reduced`` for the cross-entropy)."""

    def as_tuple(self) -> tuple: ...

    def non_differentiable(self) -> list[torch.Tensor]: ...


class LossPlan(Protocol):
    """What ``forward``/``backward`` run a call through: ``Plan`` and ``flce.parallel``'s
    plan for the cross-entropy, ``flce.heads``' plans for the other loss heads.

    ``defers_gradients``: whether the gradients wait for the upstream gradients of the
    outputs (``reduction="none"``, the logprobs) instead of being computed in the
    forward and scaled by the upstream scalar. ``gradient_prescale``: the upstream
    gradient (a power of two, 1 but for an fp16 mean) at which the forward computes
    them; the backward scales them by ``grad_loss / gradient_prescale``. ``upstream``
    turns the outputs' upstream gradients and the forward's ``residuals`` into what
    ``run`` folds into each row (the CE's per-row upstream gradient); None when no
    gradient flows.
    """

    @property
    def defers_gradients(self) -> bool: ...

    @property
    def gradient_prescale(self) -> float: ...

    def run(self, operands, request: GradRequest, upstream=None) -> tuple[object, Gradients]: ...

    def reduce(self, rows) -> Outputs: ...

    def residuals(self, rows) -> tuple: ...

    def upstream(self, grad_outputs: tuple, residuals: tuple, n_rows: int): ...

    def finish_gradients(self, grads: Gradients) -> None: ...

    def prepare_backward(self, operands, request: GradRequest) -> None:
        """With deferred gradients, the forward makes the backward's decisions that can
        fail (a scheme that fits the memory budget): raised at the call, before any kernel."""


class CrossEntropyPlan:
    """The cross-entropy's side of ``LossPlan``, shared by ``Plan`` and ``flce.parallel``'s
    plan (each holds ``options``, ``scalars`` and ``stats``)."""

    @property
    def defers_gradients(self) -> bool:
        return self.options.reduction == "none"

    def prepare_backward(self, operands, request: GradRequest) -> None:
        """Nothing to decide ahead (``Plan`` overrides it)."""

    def prescaled_rows(self, operands: Operands) -> torch.Tensor:
        """(N,) fp32 ``gradient_prescale`` in every row: ``run``'s per-row upstream gradient
        (the kernels' per-row scale, which every scheme takes) for the forward's gradients
        of an fp16 mean. (The caller tests whether it applies: host time on every call.)"""
        rows, device = operands.n_rows, operands.target.device
        return torch.full((rows,), self.gradient_prescale, dtype=torch.float32, device=device)

    def reduce(self, rows: RowOutputs) -> Reduced:
        self.stats.ensure_computed()  # a call's checks run even where no kernel needed its statistics
        o = self.options
        accuracy_scale = None if rows.correct is None else self.stats.accuracy_scale  # a view: only when used
        return reduce_rows(rows, o.reduction, o.lse_square_scale > 0, o.return_z_loss, self.scalars, accuracy_scale)

    def residuals(self, rows: RowOutputs) -> tuple:
        return ()  # backward recomputes from the operands alone

    def upstream(self, grad_outputs: tuple, residuals: tuple, n_rows: int) -> torch.Tensor | None:
        """The loss's upstream gradient folded into each row: ``row_grad_scale`` (N,) fp32."""
        grad_loss = grad_outputs[0]  # () for mean/sum, (N,) for "none"; the other outputs have none
        return None if grad_loss is None else grad_loss.float().expand(n_rows).contiguous()

    def finish_gradients(self, grads: Gradients) -> None:
        """Nothing to finish on one device (the parallel plan all-reduces dX here)."""


@dataclass(frozen=True)
class Plan(CrossEntropyPlan):
    """Everything one single-device cross-entropy call decided before its first kernel."""

    options: LossOptions
    backend: BackendSpec
    split_kernels: SplitRowKernels | None  # the backend's (None: it has none)
    compute_dtype: torch.dtype
    stats: BatchStatistics
    scalars: ChunkScalars  # for logits the caller gives (LogitsOperands)
    # For the logits this plan's GEMMs compute (LinearOperands): the scalars, with the
    # softcap's approximate tanh where softcap_tanh_is_approximate allows it.
    product_scalars: ChunkScalars
    gradient_prescale: float = 1.0  # flce.driver.scaling.forward_gradient_prescale

    def run(
        self, operands: Operands, request: GradRequest, row_grad_scale: torch.Tensor | None = None
    ) -> tuple[RowOutputs, Gradients]:
        """The scheme for these operands (module docstring) -> (RowOutputs, Gradients)."""
        o = operands
        if row_grad_scale is None and self.gradient_prescale != 1.0 and request.any:
            row_grad_scale = self.prescaled_rows(o)
        if isinstance(o, LogitsOperands):
            return run_logits_chunks(
                o.logits, o.target, o.ce_weight, self.options, self.backend, self.scalars, request, row_grad_scale
            )
        route = self.route(o, request)
        if route.loss_only:
            rows = run_fused_statistics(
                self.backend.loss_only,
                o.input,
                o.weight,
                o.target,
                o.bias,
                o.ce_weight,
                self.options,
                self.compute_dtype,
                self.product_scalars,
            )
            return rows, Gradients(None, None, None)
        scheme = route.scheme
        if scheme.block is not None:
            return run_vocab_blocks(
                o.input,
                o.weight,
                o.target,
                o.bias,
                o.ce_weight,
                route.options,
                self.split_kernels,
                self.compute_dtype,
                self.product_scalars,
                request,
                row_grad_scale,
                fused_statistics=route.whole_rows,
                fused_gradient=route.block_gradient,
                weight_grad_tail_start=scheme.weight_grad_tail_start,
            )
        return run_chunks(
            o.input,
            o.weight,
            o.target,
            o.bias,
            o.ce_weight,
            route.options,
            self.backend,
            self.compute_dtype,
            self.product_scalars,
            request,
            row_grad_scale,
        )

    def prepare_backward(self, operands: Operands, request: GradRequest) -> None:
        """The backward's route, decided (and kept) now: a memory budget that its gradient
        pass cannot run in raises ``MemoryBudgetError`` at the call, as it does for the
        mean and sum, instead of inside ``backward()``."""
        if isinstance(operands, LinearOperands):
            self.route(operands, request)

    def route(self, o: LinearOperands, request: GradRequest) -> Route:
        """How ``run`` runs these operands (``Route``). A training loop asks with the same
        layout call after call, and deciding costs host time before the first GEMM (the
        cost model, the fused GEMM's applicability): the answer is kept per what decides
        it, the budget variables' values included (``flce.driver.schemes``)."""
        weight = o.weight
        # Only the fused statistics GEMM reads the weight through TMA: only a backend with
        # that slot asks for its address. A dtype cast keeps the strides (preserve_format)
        # but allocates afresh (aligned).
        weight_tma_ready = self.backend.loss_only is not None and (
            weight.is_contiguous() and (weight.dtype != self.compute_dtype or weight.data_ptr() % 16 == 0)
        )
        key = (
            self.options,
            self.backend,
            self.compute_dtype,
            o.input.device,
            o.input.shape,
            o.input.dtype,
            weight.shape,
            weight.dtype,
            None if o.bias is None else o.bias.dtype,
            o.ce_weight is not None,
            weight_tma_ready,
            request,
            budget_environment(),
        )
        return _ROUTES.get(key, lambda: self._decide_route(o, request, weight_tma_ready))

    def _decide_route(self, o: LinearOperands, request: GradRequest, weight_tma_ready: bool) -> Route:
        def fused_applies(loss_only: bool) -> bool:
            return fused_statistics_apply(
                self.backend,
                self.options,
                self.compute_dtype,
                o.input.device,
                o.input.shape[1],
                o.weight.shape[0],
                has_ce_weight=o.ce_weight is not None,
                weight_tma_ready=weight_tma_ready,
                loss_only=loss_only,
            )

        describes = (
            o.input,
            o.weight,
            o.bias,
            request,
            self.options,
            self.compute_dtype,
            self.backend,
            self.split_kernels,
        )
        if not request.any and fused_applies(loss_only=True):
            # The fused statistics alone where their workspace fits the memory budget; below
            # it, the chooser's scheme that fits (or its MemoryBudgetError).
            call = describe_call(*describes, whole_row_statistics=self.backend.loss_only)
            if loss_only_fits_budget(call, self.options, o.input.device):
                return Route(loss_only=True)
        # The vocabulary blocks' first pass from the fused statistics, where they apply.
        whole_rows = self.backend.loss_only if fused_applies(loss_only=False) else None
        scheme = scheme_of_call(*describes, whole_row_statistics=whole_rows)
        # The second pass from the block-gradient GEMM where the first is fused (same operands).
        block_gradient = self.backend.block_gradient if whole_rows is not None else None
        return Route(
            False, scheme, options_for_scheme(self.options, scheme.rows, scheme.block), whole_rows, block_gradient
        )


@dataclass(frozen=True)
class Route:
    """How ``Plan.run`` runs a fused call: on the backend's fused statistics alone
    (``loss_only``: a call without gradients), else by ``scheme`` (``flce.driver.schemes``)
    with ``options`` as the drivers read them (its rows per chunk and block filled in), the
    vocabulary blocks' first pass from ``whole_rows`` (the fused statistics; None: a pass
    per block) and their second from ``block_gradient`` (None: a logits GEMM and a
    gradient pass per block)."""

    loss_only: bool
    scheme: Scheme | None = None
    options: LossOptions | None = None
    whole_rows: LossOnlyStatistics | None = None
    block_gradient: BlockGradientGemm | None = None


_ROUTES = KeptAnswers()  # Plan.route's answers, by what decides them


def fused_statistics_apply(
    backend: BackendSpec,
    options: LossOptions,
    compute_dtype: torch.dtype,
    device: torch.device,
    hidden: int,
    vocab: int,
    *,
    has_ce_weight: bool,
    weight_tma_ready: bool,
    loss_only: bool,
) -> bool:
    """Whether the backend's ``loss_only`` slot (whole-row statistics from one fused GEMM)
    gives a call's loss rows: with ``loss_only``, for a call without gradients, which then
    runs on them alone (unless ``vocab_chunk_size`` keeps the blocks:
    ``loss_only_refusal``); else for the vocabulary blocks' first pass."""
    hook = backend.loss_only
    refusal = loss_only_refusal if loss_only else whole_row_statistics_refusal
    if hook is None or refusal(options, has_ce_weight) is not None:
        return False
    applicable, _ = hook.applicable(device, compute_dtype, hidden, vocab, weight_tma_ready)
    return applicable


def split_kernels_for(options: LossOptions, backend: BackendSpec) -> SplitRowKernels | None:
    """The backend's split-row kernels where the call may run vocabulary blocks: when
    ``vocab_chunk_size`` asks for them, or the memory budget may choose them (the backend
    has them); None otherwise."""
    if options.vocab_chunk_size is None and backend.split_rows is None:
        return None
    return split_rows_of(backend)


def make_plan(
    options: LossOptions,
    device: torch.device,
    target: torch.Tensor,  # (N,)
    ce_weight: torch.Tensor | None,  # (V,) fp32
    vocab: int,
    compute_dtype: torch.dtype,
    class_weight_name: str = "ce_weight",  # the caller's argument, in the deferred checks' errors
    fp16_row_sums: bool = False,  # flce.driver.scaling.sums_rows_in_fp16 of the call's request
) -> Plan:
    """Backend (and its split-row kernels, for vocabulary blocks), the batch statistics
    (launched on first use with asynchronous validation: ``BatchStatistics``) and the
    kernel scalars: everything decided before the first kernel. Logits given by the caller
    are exact inputs and keep the softcap's accurate tanh (``scalars``); those the plan's
    GEMMs compute in ``compute_dtype`` may take the approximate one (``product_scalars``)."""
    backend = resolve_backend(options.backend, device)
    split_kernels = split_kernels_for(options, backend)
    stats = batch_statistics(target, ce_weight, vocab, options.ignore_index, class_weight_name)
    scalars = chunk_scalars(options, stats)
    fp16 = compute_dtype == torch.float16
    approximate = options.softcap is not None and softcap_tanh_is_approximate(compute_dtype, device)
    product_scalars = chunk_scalars(options, stats, approximate_tanh=True) if approximate else scalars
    # (The rule's first test inline: no call on the host path of every bf16/fp32 call.)
    rows = target.numel()
    prescale = forward_gradient_prescale(options.reduction, compute_dtype, rows, fp16_row_sums) if fp16 else 1.0
    return Plan(options, backend, split_kernels, compute_dtype, stats, scalars, product_scalars, prescale)


# ------------------------------------------------------- forward / backward


def _no_autocast(device: torch.device):
    # The drivers pick their dtypes themselves; autocast must not re-cast the kernels' fp32 math.
    # Outside autocast there is nothing to turn off (and torch.autocast's setup is costly per call).
    if device.type in ("cpu", "cuda") and not torch.is_autocast_enabled(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, enabled=False)


def _device(operands) -> torch.device:
    return operands.tensors()[0].device


@dataclass
class ForwardResult:
    outputs: Outputs
    residuals: tuple  # what backward needs besides the operands (the logprobs' lse)
    gradients: Gradients | None  # computed in the forward (mean/sum); None: recomputed in backward
    # None: the gradients are the caller's own. Else they are a CUDA graph's outputs, still
    # this call's while ``borrowed()`` is true, and must not be modified (``forward``).
    borrowed: Callable[[], bool] | None = None

    def copied(self, borrow_gradients: bool = False) -> ForwardResult:
        """The same values in tensors of their own (a graph's outputs are overwritten by
        its next replay); with ``borrow_gradients`` the gradients stay the graph's."""
        gradients = self.gradients
        if gradients is not None and not borrow_gradients:
            gradients = _copied_fields(gradients)
        return ForwardResult(_copied_fields(self.outputs), tuple(_copied(t) for t in self.residuals), gradients)


def _copied(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.clone()


def _copied_fields(outputs):
    """A dataclass of tensors (``Reduced``, ``Gradients``) with each tensor copied."""
    return dataclasses.replace(
        outputs, **{f.name: _copied(getattr(outputs, f.name)) for f in dataclasses.fields(outputs)}
    )


def graphed_forward(plan: LossPlan, operands, request: GradRequest) -> Replay | None:
    """``launched_forward`` replayed from a CUDA graph (``flce.driver.graphs``), for the
    fused loss of a single-device ``Plan`` where one applies (its result is the graph's
    outputs); None where none does (the caller launches the call). The hidden states,
    targets and class weights are copied into the graph's inputs; the weight and bias are
    read in place (keyed by address). A call that states a memory bound is launched
    (``_states_memory_bound``)."""
    if type(plan) is not Plan or type(operands) is not LinearOperands:
        return None
    o = operands
    device = o.input.device
    n_rows, hidden = o.input.shape
    vocab = o.weight.shape[0]
    # The cheapest refusals first: a large call (most of a large model's) pays for the
    # question before its first GEMM.
    if n_rows * vocab * hidden > MAX_GRAPHED_WORK or device.type != "cuda" or _states_memory_bound(plan.options):
        return None
    held_bytes = _graph_held_bytes(plan, o, request)
    if not graph_applies(device, n_rows, vocab, hidden, held_bytes):
        return None
    if any(type(t) not in PLAIN_TENSOR_TYPES for t in o.tensors() if t is not None):
        return None  # a subclass (DTensor, ...) may not be read through its address
    key = (
        plan.options,
        plan.backend.name,
        plan.compute_dtype,
        request,
        device,
        torch.cuda.current_stream(device).cuda_stream,
        threading.get_ident(),  # a graph's inputs and outputs serve one thread's calls
        copied_key(o.input),
        copied_key(o.target),
        copied_key(o.ce_weight),
        tensor_key(o.weight),
        tensor_key(o.bias),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_inference_mode_enabled(),
        gemm_settings(),  # cuBLAS's math settings: a captured GEMM keeps those of its capture
    )

    def run(copied: tuple) -> ForwardResult:
        input, target, ce_weight = copied
        fp16_sums = sums_rows_in_fp16(o.weight, o.bias, request.weight, request.bias)
        captured = make_plan(
            plan.options, device, target, ce_weight, vocab, plan.compute_dtype, fp16_row_sums=fp16_sums
        )
        return launched_forward(captured, LinearOperands(input, o.weight, o.bias, target, ce_weight), request)

    return GRAPHED_CALLS.forward(key, (o.input, o.target, o.ce_weight), run, held_bytes)


def _states_memory_bound(options: LossOptions) -> bool:
    """Whether a call states a memory bound: a budget (the option or the variables) or
    chunk sizes. Such a call is never graphed: a graph holds its memory between calls and
    its dW is copied out (two at once)."""
    explicit = (options.memory_budget, options.chunk_size, options.vocab_chunk_size)
    # An empty variable is unset, as the sizing reads it (``flce.driver.sizing``).
    return explicit != (None, None, None) or any(budget_environment())


def _graph_held_bytes(plan: Plan, o: LinearOperands, request: GradRequest) -> int:
    """An upper bound of the device memory a graph of this call holds: its copies of the
    per-call tensors, one chunk of logits as large as the whole batch's (in the compute
    dtype; the gradient is written over them), and the gradients (dW counted in fp32, as
    the widest accumulator)."""
    n_rows, hidden = o.input.shape
    vocab = o.weight.shape[0]
    x_bytes = n_rows * hidden * o.input.element_size()
    copied = x_bytes + n_rows * o.target.element_size() + (0 if o.ce_weight is None else vocab * 4)
    logits = n_rows * vocab * plan.compute_dtype.itemsize
    gradients = (x_bytes if request.input else 0) + (vocab * hidden * 4 if request.weight else 0)
    rows = n_rows * 4 * 4  # the per-row outputs
    return copied + logits + gradients + (vocab * 4 if request.bias else 0) + rows


def forward(plan: LossPlan, operands, request: GradRequest, borrow_gradients: bool = False) -> ForwardResult:
    """The outputs of a call, and the gradients of ``request`` where the forward computes
    them (``defers_gradients`` false: the CE's and the distillation's ``mean``/``sum``):
    replayed from a CUDA graph where one applies (``graphed_forward``), else launched.
    A replay's outputs are copied out; with ``borrow_gradients`` its gradients are not:
    they are the graph's, valid while ``ForwardResult.borrowed()`` (the autograd Function
    scales them into new tensors in its backward, the copy being the scaling's pass)."""
    replay = graphed_forward(plan, operands, request)
    if replay is None:
        return launched_forward(plan, operands, request)
    result = replay.result.copied(borrow_gradients)
    if borrow_gradients and result.gradients is not None:
        result.borrowed = replay.current
    return result


def launched_forward(plan: LossPlan, operands, request: GradRequest) -> ForwardResult:
    """``forward`` with every kernel launched from the host."""
    deferred = plan.defers_gradients
    if deferred and request.any:
        plan.prepare_backward(operands, request)
    with _no_autocast(_device(operands)):
        rows, grads = plan.run(operands, NO_GRADIENTS if deferred else request)
    gradients = None if deferred or not request.any else grads
    return ForwardResult(plan.reduce(rows), plan.residuals(rows), gradients)


def backward(
    plan: LossPlan,
    operands,  # the call's operands; None will do when ``saved`` is given
    request: GradRequest,
    grad_outputs: tuple,  # the outputs' upstream gradients (None where none flows)
    residuals: tuple,  # the forward's ForwardResult.residuals
    saved: Gradients | None,  # forward's gradients, or None to recompute
    owned: bool,  # whether ``saved`` may be scaled in place
) -> Gradients | None:
    """The gradients of ``request`` times the upstream gradients; None when none flows."""
    if saved is not None:
        grad_loss = grad_outputs[0]  # () the loss's: gradients are computed in the forward of scalar losses only
        if grad_loss is None:
            return None
        if plan.gradient_prescale != 1.0:
            grad_loss = prescaled_upstream(grad_loss, plan.gradient_prescale)
        if owned:
            scale_gradients_((saved.input, saved.weight, saved.bias), grad_loss)
            grads = saved
        else:
            grads = Gradients(*scaled_gradients((saved.input, saved.weight, saved.bias), grad_loss))
    else:
        # Deferred gradients, or a repeated backward: recompute with the upstream
        # gradients folded into each row before the dW/db sums.
        upstream = plan.upstream(grad_outputs, residuals, operands.n_rows)
        if upstream is None:
            return None
        with _no_autocast(_device(operands)):
            _, grads = plan.run(operands, request, upstream)
    plan.finish_gradients(grads)
    return grads


class LossFunction(torch.autograd.Function):
    """The autograd of every loss call: ``apply(plan, operands_type, *operands.tensors())``
    -> the plan's outputs (``Outputs.as_tuple()``: for the cross-entropy ``(loss, z_loss,
    token_accuracy, predicted_tokens)``, the unused ones None)."""

    @staticmethod
    def forward(ctx, plan: LossPlan, operands_type: type, *tensors):
        operands = operands_type(*tensors)
        request = operands.request(ctx.needs_input_grad[2:])
        result = forward(plan, operands, request, borrow_gradients=True)
        ctx.plan, ctx.operands_type, ctx.request = plan, operands_type, request
        ctx.gradients, ctx.gradients_borrowed = result.gradients, result.borrowed
        ctx.n_tensors = len(tensors)
        # An operand made under torch.inference_mode() (a teacher's hidden states, a target,
        # class weights: constants here) cannot go through save_for_backward, which refuses
        # inference tensors; it is kept on ctx instead. Its version check would watch
        # nothing: an inference tensor cannot be modified in place outside inference mode.
        # (A loop, not a comprehension, and only the tensors that need no gradient: host
        # time on every training step; an inference tensor requiring grad fails in eager too.)
        ctx.inference_operands = None
        for index, t in enumerate(tensors):
            if t is not None and not t.requires_grad and t.is_inference():
                if ctx.inference_operands is None:
                    ctx.inference_operands, tensors = [None] * len(tensors), list(tensors)
                ctx.inference_operands[index], tensors[index] = t, None
        ctx.save_for_backward(*tensors, *result.residuals)
        extras = result.outputs.non_differentiable()
        if extras:
            ctx.mark_non_differentiable(*extras)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no work for it
        return result.outputs.as_tuple()

    @staticmethod
    def backward(ctx, *grad_outputs):
        refuse_create_graph(ctx.operands_type.entry)
        saved, ctx.gradients = ctx.gradients, None
        borrowed, ctx.gradients_borrowed = ctx.gradients_borrowed, None
        if saved is not None and borrowed is not None and not borrowed():
            saved = None  # a CUDA graph's, overwritten by a later call's replay: recomputed below
        if saved is not None:
            # The forward's gradients, scaled here: the operands are not needed (unpacking
            # the saved tensors is host time on every training step). A graph's are
            # scaled into new tensors.
            grads = backward(ctx.plan, None, ctx.request, grad_outputs, (), saved, owned=borrowed is None)
        else:
            saved_tensors = ctx.saved_tensors
            tensors, residuals = saved_tensors[: ctx.n_tensors], saved_tensors[ctx.n_tensors :]
            if ctx.inference_operands is not None:
                tensors = [t if kept is None else kept for t, kept in zip(tensors, ctx.inference_operands, strict=True)]
            operands = ctx.operands_type(*tensors)
            grads = backward(ctx.plan, operands, ctx.request, grad_outputs, residuals, None, owned=True)
        if grads is None:
            return (None, None) + (None,) * ctx.n_tensors
        return (None, None) + ctx.operands_type.gradient_tuple(grads)


def op_forward(plan: LossPlan, operands, request: GradRequest) -> ForwardResult:
    """``forward`` for the custom ops of ``flce.ops``, which replace ``run_loss`` under
    ``torch.compile``: then, as ``run_loss`` does, an earlier call's bad input that the
    device found is raised (without it a compiled loop would never report one, and the
    pending checks' host slots would pile up one per call)."""
    earlier_checks = pending_checks()
    result = forward(plan, operands, request)
    if earlier_checks:
        raise_pending(earlier=earlier_checks)
    return result


def run_loss(plan: LossPlan, operands) -> tuple:
    """A call through autograd when a differentiable operand requires grad (and grad mode
    is on), else the forward alone with no gradient work: the outputs as a tuple.

    Then an earlier call's bad input that the device found since is raised
    (``flce.driver.validation``): read once this call's kernels are queued, so that the
    host work of reading the checks does not delay its first GEMM, and only the checks of
    the calls before it (this call's own stays pending: its outputs are NaN, the next call
    raises)."""
    earlier_checks = pending_checks()
    # (A list of at most three, not a generator: no frame resumed per operand.)
    if torch.is_grad_enabled() and any([t.requires_grad for t in operands.differentiable() if t is not None]):
        outputs = LossFunction.apply(plan, type(operands), *operands.tensors())
    else:
        outputs = forward(plan, operands, NO_GRADIENTS).outputs.as_tuple()
    if earlier_checks:
        raise_pending(earlier=earlier_checks)
    return outputs
