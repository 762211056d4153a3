"""Every public entry point of the loss behind one calling convention, and the float64
judge that the reliability and adversarial tests (CPU and GPU) share.

A ``Problem`` is a set of float64 leaf tensors and a function that builds an entry
point's arguments from them (a view, a transpose, an expansion...): flce runs on the
leaves cast to the problem's dtype, the float64 reference on the leaves themselves, so
gradients are compared with respect to the same leaves whatever layout the arguments
had. Tolerances follow ``flce.testing``: ``err(flce) <= 3 * err(eager PyTorch in the
same dtype) + floor``, errors relative to float64.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import pytest
import torch
import torch.distributed as dist

import flce
from flce.backends.base import HEAD_SLOTS
from flce.compat import liger
from flce.dispatch import BACKEND_NAMES, ENV_VAR, availability, get_backend
from flce.options import LossOptions
from flce.output import CrossEntropyOutput
from flce.parallel import VocabParallelFusedLinearCrossEntropyLoss, vocab_parallel_fused_linear_cross_entropy
from flce.reference import cross_entropy_reference, fused_linear_cross_entropy_reference
from flce.testing import EPS, TOLERANCE_FACTOR, relative_error

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
BACKENDS = [name for name in BACKEND_NAMES if availability(name, DEVICE)[0]]
# Those of them with the logprobs and distillation heads' kernels (CuTe DSL has none).
HEAD_BACKENDS = [name for name in BACKENDS if all(getattr(get_backend(name), slot) for slot in HEAD_SLOTS)]

# The options the float64 reference takes; the others (flags, chunking, backend) change
# what is returned or how it is computed, not the values.
REFERENCE_OPTIONS = ("ignore_index", "lse_square_scale", "label_smoothing", "reduction", "softcap", "use_token_scaling")
LOSS_OPTION_NAMES = frozenset(f.name for f in fields(LossOptions))


# ----------------------------------------------------------------------- entry points


@contextlib.contextmanager
def backend_env(backend: str | None):
    """``FLCE_BACKEND=backend`` for the duration (the Liger shims take no ``backend=``)."""
    saved = os.environ.get(ENV_VAR)
    if backend is not None:
        os.environ[ENV_VAR] = backend
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = saved


def _parameters(fn) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


@dataclass(frozen=True)
class Entry:
    """One public entry point. ``call(tensors, backend, options)`` -> its raw result;
    ``tensors`` holds ``x, w, t, bias, ce_weight`` (fused) or ``z, t, ce_weight`` (logits)."""

    name: str
    kind: str  # "fused" (hidden states and a weight) or "logits"
    call: Callable
    accepts: frozenset  # option names it takes
    needs_group: bool = False  # a torch.distributed process group must exist

    def takes(self, options: dict) -> bool:
        return set(options) <= self.accepts


def _world():
    return dist.group.WORLD


FUSED_ENTRIES = {
    e.name: e
    for e in (
        Entry(
            "fused",
            "fused",
            lambda s, backend, o: flce.fused_linear_cross_entropy(
                s["x"], s["w"], s["t"], bias=s["bias"], ce_weight=s["ce_weight"], backend=backend, **o
            ),
            LOSS_OPTION_NAMES,
        ),
        Entry(
            "module",
            "fused",
            lambda s, backend, o: flce.FusedLinearCrossEntropyLoss(ce_weight=s["ce_weight"], backend=backend, **o)(
                s["x"], s["w"], s["t"], s["bias"]
            ),
            LOSS_OPTION_NAMES,
        ),
        Entry(
            "liger",
            "fused",
            lambda s, backend, o: _with_env(
                backend,
                lambda: liger.liger_fused_linear_cross_entropy(s["x"], s["w"], s["t"], s["bias"], s["ce_weight"], **o),
            ),
            _parameters(liger.liger_fused_linear_cross_entropy),
        ),
        Entry(
            "liger_function",
            "fused",
            lambda s, backend, o: liger.LigerFusedLinearCrossEntropyFunction.apply(
                s["x"], s["w"], s["t"], s["bias"], s["ce_weight"], ce_impl=backend, **o
            ),
            _parameters(liger.LigerFusedLinearCrossEntropyFunction.forward) - {"ce_impl"},
        ),
        Entry(
            "liger_module",
            "fused",
            lambda s, backend, o: _with_env(
                backend,
                lambda: liger.LigerFusedLinearCrossEntropyLoss(ce_weight=s["ce_weight"], **o)(
                    s["w"], s["x"], s["t"], s["bias"]
                ),
            ),
            _parameters(liger.LigerFusedLinearCrossEntropyLoss.__init__),
        ),
        Entry(
            "vocab_parallel",
            "fused",
            lambda s, backend, o: vocab_parallel_fused_linear_cross_entropy(
                s["x"],
                s["w"],
                s["t"],
                process_group=_world(),
                bias_shard=s["bias"],
                ce_weight_shard=s["ce_weight"],
                backend=backend,
                **o,
            ),
            _parameters(vocab_parallel_fused_linear_cross_entropy),
            needs_group=True,
        ),
        Entry(
            "vocab_parallel_module",
            "fused",
            lambda s, backend, o: VocabParallelFusedLinearCrossEntropyLoss(
                s["ce_weight"], process_group=_world(), backend=backend, **o
            )(s["x"], s["w"], s["t"], s["bias"]),
            _parameters(vocab_parallel_fused_linear_cross_entropy),
            needs_group=True,
        ),
    )
}

LOGITS_ENTRIES = {
    e.name: e
    for e in (
        Entry(
            "cross_entropy",
            "logits",
            lambda s, backend, o: flce.cross_entropy(s["z"], s["t"], weight=s["ce_weight"], backend=backend, **o),
            _parameters(flce.cross_entropy),
        ),
        Entry(
            "ce_module",
            "logits",
            lambda s, backend, o: flce.CrossEntropyLoss(weight=s["ce_weight"], backend=backend, **o)(s["z"], s["t"]),
            LOSS_OPTION_NAMES,
        ),
        Entry(
            "liger_ce",
            "logits",
            lambda s, backend, o: _with_env(
                backend, lambda: liger.liger_cross_entropy(s["z"], s["t"], s["ce_weight"], **o)
            ),
            _parameters(liger.liger_cross_entropy),
        ),
        Entry(
            "liger_ce_function",
            "logits",
            lambda s, backend, o: _with_env(
                backend, lambda: liger.LigerCrossEntropyFunction.apply(s["z"], s["t"], s["ce_weight"], **o)
            ),
            _parameters(liger.LigerCrossEntropyFunction.forward),
        ),
    )
}

ENTRIES = {**FUSED_ENTRIES, **LOGITS_ENTRIES}


def _with_env(backend, fn):
    with backend_env(backend):
        return fn()


def unpack(result) -> tuple:
    """(loss, z_loss, token_accuracy, predicted_tokens) of any entry point's result."""
    if isinstance(result, CrossEntropyOutput):
        return result.loss, result.z_loss, result.token_accuracy, result.predicted_tokens
    if isinstance(result, tuple):
        return result
    return result, None, None, None


@pytest.fixture(scope="module")
def process_group_of_one():
    """A gloo process group of size 1 (the default group) for the vocab-parallel entries."""
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- problems


@dataclass
class Problem:
    """Float64 leaves, and how an entry point's tensors are made from them.

    ``make(leaves)`` returns ``x, w, t, bias, ce_weight`` (fused) or ``z, t, ce_weight``
    (logits); the leaves named in ``differentiable`` require grad on flce's side and the
    reference's. ``upstream``, if given, is the gradient handed to backward (any layout).
    """

    leaves: dict[str, torch.Tensor]
    make: Callable[[dict], dict]
    options: dict = field(default_factory=dict)
    differentiable: tuple = ()
    upstream: Callable[[torch.Tensor], torch.Tensor] | None = None  # loss -> gradient of it
    dtype: torch.dtype = torch.float32

    def tensors(self, dtype: torch.dtype, device: torch.device, requires_grad: bool):
        """(leaves in ``dtype`` on ``device``, the entry point's tensors made from them)."""
        leaves = {}
        for name, leaf in self.leaves.items():
            value = leaf.to(device=device, dtype=dtype if leaf.is_floating_point() else leaf.dtype, copy=True)
            leaves[name] = value.requires_grad_(requires_grad and name in self.differentiable)
        return leaves, self.make(leaves)


def run_entry(entry: Entry, problem: Problem, backend: str | None, device: torch.device = DEVICE):
    """flce through ``entry``: (outputs tuple, {leaf: grad}) with backward when any leaf
    requires grad."""
    leaves, tensors = problem.tensors(problem.dtype, device, requires_grad=True)
    outputs = unpack(entry.call(tensors, backend, problem.options))
    grads = _backward(outputs[0], leaves, problem)
    return outputs, grads


def _backward(loss, leaves, problem) -> dict:
    wanted = [name for name in problem.differentiable if leaves[name].requires_grad]
    if not wanted:
        return {}
    upstream = problem.upstream(loss) if problem.upstream is not None else torch.full_like(loss, 1.5)
    found = torch.autograd.grad(loss, [leaves[n] for n in wanted], grad_outputs=upstream, allow_unused=True)
    return dict(zip(wanted, found, strict=True))


def reference(entry_kind: str, problem: Problem, math_dtype=torch.float64, logits_dtype=torch.float64):
    """The dense reference of ``problem``: (outputs tuple, {leaf: grad}); float64 by default,
    or eager PyTorch's way in a low precision (``logits_dtype``, fp32 math)."""
    leaves, tensors = problem.tensors(logits_dtype, torch.device("cpu"), requires_grad=True)
    options = {k: v for k, v in problem.options.items() if k in REFERENCE_OPTIONS}
    ce_weight = tensors["ce_weight"]
    ce_weight = None if ce_weight is None else ce_weight.detach().double()
    target = tensors["t"].reshape(-1)
    if entry_kind == "fused":
        x = tensors["x"]
        result = fused_linear_cross_entropy_reference(
            x.reshape(x.shape[:-1].numel(), x.shape[-1]),  # explicit N: H may be 0
            tensors["w"],
            target,
            tensors["bias"],
            logits_dtype=logits_dtype,
            ce_weight=ce_weight,
            math_dtype=math_dtype,
            **options,
        )
    else:
        z = tensors["z"]
        result = cross_entropy_reference(
            z.reshape(-1, z.shape[-1]), target, ce_weight=ce_weight, math_dtype=math_dtype, **options
        )
    loss, z_loss = result.loss, result.z_loss
    if options.get("reduction") == "none":  # per token, shaped like the target (as flce returns it)
        loss, z_loss = loss.reshape(tensors["t"].shape), z_loss.reshape(tensors["t"].shape)
    outputs = (loss, z_loss, result.token_accuracy, result.predicted_tokens)
    return outputs, _backward(loss, leaves, problem)


# ------------------------------------------------------------------------------ judge


def assert_close_to_reference(name: str, ours, truth, eager, floor: float) -> None:
    """``err(ours) <= 3 * err(eager) + floor``, errors relative to ``truth`` (float64)."""
    assert ours is not None, f"{name} is missing"
    assert tuple(ours.shape) == tuple(truth.shape), f"{name}: shape {tuple(ours.shape)} != {tuple(truth.shape)}"
    err, err_torch = relative_error(ours, truth), relative_error(eager, truth)
    allowed = TOLERANCE_FACTOR * err_torch + floor
    assert err <= allowed, f"{name}: error {err:.3g} > {allowed:.3g} (eager torch {err_torch:.3g})"


def assert_matches_reference(entry: Entry, problem: Problem, outputs, grads, what: str = "") -> None:
    """Loss (and z-loss, accuracy, predictions when returned) and every leaf's gradient
    against float64, within 3x eager PyTorch's own error in the problem's dtype + floor."""
    truth, truth_grads = reference(entry.kind, problem)
    eager, eager_grads = reference(entry.kind, problem, torch.float32, problem.dtype)
    floor = EPS[problem.dtype]
    loss, z_loss = outputs[:2]
    pairs = [("loss", loss, truth[0], eager[0])]
    if z_loss is not None and problem.options.get("return_z_loss"):
        pairs.append(("z_loss", z_loss, truth[1], eager[1]))
    pairs += [(f"grad {n}", grads.get(n), truth_grads[n], eager_grads[n]) for n in truth_grads]
    for name, ours, ref, same_dtype in pairs:
        assert_close_to_reference(f"{what}{name}", ours, ref, same_dtype, floor)
    assert_predictions(entry.kind, problem, outputs, truth, what)


def assert_predictions(kind: str, problem: Problem, outputs, truth, what: str = "") -> None:
    """Predicted tokens near the float64 argmax (``_assert_near_argmax``); token accuracy
    equal to the reference's, or, with predictions returned, to what they imply."""
    _, _, accuracy, predicted = outputs
    if predicted is not None and problem.options.get("return_predicted_tokens"):
        _assert_near_argmax(kind, problem, predicted.cpu().reshape(-1), what)
    if accuracy is not None and problem.options.get("return_token_accuracy"):
        expected = truth[2]
        if predicted is not None:  # judged above: accuracy must agree with those predictions
            target = problem.tensors(torch.float64, torch.device("cpu"), False)[1]["t"].reshape(-1)
            valid = target != problem.options.get("ignore_index", -100)
            correct = ((predicted.cpu().reshape(-1) == target) & valid).double()
            expected = correct if problem.options.get("reduction") == "none" else correct.sum() / max(valid.sum(), 1)
        torch.testing.assert_close(accuracy.double().cpu().reshape(-1), expected.reshape(-1), rtol=1e-6, atol=0)


def _assert_near_argmax(kind: str, problem: Problem, predicted: torch.Tensor, what: str) -> None:
    """Each valid row's prediction is the float64 argmax of z', or a class within the
    dtype's rounding of it (a near-tie any low-precision GEMM may flip); -1 on ignored rows."""
    _, tensors = problem.tensors(torch.float64, torch.device("cpu"), False)
    if kind == "fused":
        x = tensors["x"]
        z = x.reshape(x.shape[:-1].numel(), x.shape[-1]) @ tensors["w"].T
        z = z if tensors["bias"] is None else z + tensors["bias"]
    else:
        z = tensors["z"].reshape(-1, tensors["z"].shape[-1])
    softcap = problem.options.get("softcap")
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    valid = tensors["t"].reshape(-1) != problem.options.get("ignore_index", -100)
    assert (predicted[~valid] == -1).all(), f"{what}predicted tokens of ignored rows must be -1"
    rows = valid.nonzero().squeeze(1)
    chosen = z[rows, predicted[rows].clamp(min=0)]
    best = z[rows].max(dim=1).values
    rounding = 4 * torch.finfo(problem.dtype).eps * z[rows].abs().max(dim=1).values
    assert ((predicted[rows] >= 0) & (chosen >= best - rounding)).all(), f"{what}predicted tokens are not the argmax"


# ------------------------------------------------------------------ problem builders


def fused_leaves(n=8, h=5, v=11, seed=0, bias=True, ce_weight=False, ignored=(1,), ignore_index=-100):
    """Float64 leaves of a small fused problem with a peaked softmax: x (N, H), w (V, H),
    b (V,), targets with the rows ``ignored`` set to ``ignore_index``, class weights."""
    gen = torch.Generator().manual_seed(seed)
    leaves = {
        "x": torch.randn(n, h, generator=gen, dtype=torch.float64),
        "w": torch.randn(v, h, generator=gen, dtype=torch.float64) * (3.0 / max(h, 1) ** 0.5),
    }
    if bias:
        leaves["b"] = torch.randn(v, generator=gen, dtype=torch.float64)
    target = torch.randint(0, v, (n,), generator=gen)
    target[list(ignored)] = ignore_index
    leaves["t"] = target
    if ce_weight:
        leaves["cw"] = torch.rand(v, generator=gen, dtype=torch.float64) + 0.5
    return leaves


def plain_fused(leaves: dict) -> dict:
    return dict(x=leaves["x"], w=leaves["w"], t=leaves["t"], bias=leaves.get("b"), ce_weight=leaves.get("cw"))


def logits_leaves(n=8, v=11, seed=0, ce_weight=False, ignored=(1,), ignore_index=-100):
    gen = torch.Generator().manual_seed(seed)
    leaves = {"z": torch.randn(n, v, generator=gen, dtype=torch.float64) * 3.0}
    target = torch.randint(0, v, (n,), generator=gen)
    target[list(ignored)] = ignore_index
    leaves["t"] = target
    if ce_weight:
        leaves["cw"] = torch.rand(v, generator=gen, dtype=torch.float64) + 0.5
    return leaves


def plain_logits(leaves: dict) -> dict:
    return dict(z=leaves["z"], t=leaves["t"], ce_weight=leaves.get("cw"))
