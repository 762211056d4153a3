"""Parity harness shared by the test suite and ``flce check``.

A case runs one flce call (forward, and backward with an upstream gradient) and the
same loss twice through the dense reference: in float64 (the truth) and in the
inputs' own dtype the way eager PyTorch code computes it (logits in the dtype, softmax
math in fp32). Each output passes when

    err(flce) <= k * err(eager torch, same dtype) + eps        (k = 3)

with ``err`` the relative norm error against float64: a tolerance tied to what
PyTorch itself achieves in that dtype, so it can fail.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flce.functional import fused_linear_cross_entropy
from flce.output import CrossEntropyOutput
from flce.reference import cross_entropy_reference, fused_linear_cross_entropy_reference

TOLERANCE_FACTOR = 3.0
# Floors for outputs that eager PyTorch happens to get (nearly) exact in a dtype, where a
# relative error of ~0 would demand bit-exactness. Low-precision dtypes: two units in
# the last place. A gradient element leaves flce rounded up to three times (the kernel's
# dL/dlogits, the dX/dW GEMM output, the upstream-gradient scaling done in backward
# because the gradients are computed in the forward) against eager's two, each up to
# half an ulp, so a single tiny output (H = 1) may land two ulps away. fp32: 1e-5.
EPS = {
    torch.float32: 1e-5,
    torch.bfloat16: 2 * torch.finfo(torch.bfloat16).eps,
    torch.float16: 2 * torch.finfo(torch.float16).eps,
}

FEATURES = {
    "plain": {},
    "label_smoothing": {"label_smoothing": 0.1},
    "z_loss": {"lse_square_scale": 1e-3, "return_z_loss": True},
    "softcap": {"softcap": 4.0},
    "ce_weight": {"ce_weight": True},
    "token_scaling": {"use_token_scaling": True},
    "accuracy": {"return_token_accuracy": True, "return_predicted_tokens": True},
    "all": {
        "label_smoothing": 0.2,
        "lse_square_scale": 1e-3,
        "return_z_loss": True,
        "softcap": 4.0,
        "ce_weight": True,
        "use_token_scaling": True,
        "return_token_accuracy": True,
        "return_predicted_tokens": True,
    },
}


@dataclass(frozen=True)
class Case:
    n_rows: int = 47
    hidden: int = 33
    vocab: int = 123
    dtype: torch.dtype = torch.float32
    reduction: str = "mean"
    feature: str = "plain"
    bias: bool = False
    grads: tuple[str, ...] = ("input", "weight", "bias")  # (): nothing requires grad, the loss-only path
    ignore_index: int = -100
    ignored_fraction: float = 0.2
    chunk_size: int | None = None
    vocab_chunk_size: int | None = None
    seed: int = 0
    # Explicit options (name, value) pairs; when given they replace FEATURES[feature].
    options: tuple = ()

    @property
    def feature_options(self) -> dict:
        return dict(self.options) if self.options else dict(FEATURES[self.feature])

    @property
    def name(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        return f"{self.feature}-{self.reduction}-{dt}-N{self.n_rows}H{self.hidden}V{self.vocab}" + (
            "-bias" if self.bias else ""
        )


@dataclass
class Tensors:
    input: torch.Tensor  # (N, H)
    weight: torch.Tensor  # (V, H)
    target: torch.Tensor  # (N,)
    bias: torch.Tensor | None  # (V,)
    ce_weight: torch.Tensor | None  # (V,)
    upstream: torch.Tensor  # () or (N,) upstream gradient


def make_tensors(case: Case, device: torch.device) -> Tensors:
    """Inputs whose softmax is peaked (logits of O(5)), never zeros; about
    ``ignored_fraction`` of the rows ignored; upstream gradient != 1."""
    # Drawn on the CPU (the generator's device, whatever default device the caller set),
    # then moved: the same values on every device.
    gen = torch.Generator().manual_seed(case.seed)
    cpu = dict(generator=gen, device="cpu")
    x = torch.randn(case.n_rows, case.hidden, **cpu)
    w = torch.randn(case.vocab, case.hidden, **cpu) * (5.0 / max(case.hidden, 1) ** 0.5)
    target = torch.randint(0, case.vocab, (case.n_rows,), **cpu)
    ignored = torch.rand(case.n_rows, **cpu) < case.ignored_fraction
    target[ignored] = case.ignore_index
    bias = torch.randn(case.vocab, **cpu) if case.bias else None
    ce_weight = torch.rand(case.vocab, **cpu) + 0.5 if case.feature_options.get("ce_weight") else None
    if case.reduction == "none":
        upstream = torch.randn(case.n_rows, **cpu)
    else:
        upstream = torch.tensor(1.5, device="cpu")

    def put(t, dtype):
        return None if t is None else t.to(device=device, dtype=dtype)

    return Tensors(
        put(x, case.dtype),
        put(w, case.dtype),
        target.to(device),
        put(bias, case.dtype),
        put(ce_weight, torch.float32),
        upstream.to(device),
    )


def _options(case: Case) -> dict:
    opts = {k: v for k, v in case.feature_options.items() if k != "ce_weight"}
    return dict(opts, reduction=case.reduction, ignore_index=case.ignore_index)


def relative_error(value: torch.Tensor | None, truth: torch.Tensor | None) -> float:
    """``|value - truth| / |truth|`` (Frobenius norms, in float64): absolute where the truth
    is 0, infinite where ``value`` is not finite, 0 where either is missing. The error
    measure of every tolerance here, of the test suite's and of the benchmarks' checks."""
    if value is None or truth is None:
        return 0.0
    value, truth = value.detach().double().cpu().reshape(-1), truth.detach().double().cpu().reshape(-1)
    if not torch.isfinite(value).all():
        return float("inf")
    scale = truth.norm().item()
    diff = (value - truth).norm().item()
    return diff / scale if scale > 0 else diff


@dataclass
class Outcome:
    case: Case
    backend: str
    errors: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (ours, torch same dtype)
    allowed: dict[str, float] = field(default_factory=dict)  # name -> the tolerance it was judged by
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures


def _run_reference(t: Tensors, case: Case, logits_dtype, math_dtype, grad_names):
    leaves = {
        "input": t.input.detach().to(logits_dtype).requires_grad_("input" in grad_names),
        "weight": t.weight.detach().to(logits_dtype).requires_grad_("weight" in grad_names),
        "bias": None if t.bias is None else t.bias.detach().to(logits_dtype).requires_grad_("bias" in grad_names),
    }
    opts = _options(case)
    opts.pop("return_z_loss", None), opts.pop("return_token_accuracy", None), opts.pop("return_predicted_tokens", None)
    result = fused_linear_cross_entropy_reference(
        leaves["input"],
        leaves["weight"],
        t.target,
        leaves["bias"],
        logits_dtype=logits_dtype,
        ce_weight=t.ce_weight,
        math_dtype=math_dtype,
        **opts,
    )
    if grad_names:  # none for a loss-only case (nothing requires grad)
        (result.loss * t.upstream.to(result.loss.dtype)).sum().backward()
    grads = {name: leaves[name].grad for name in grad_names if leaves[name] is not None}
    return result, grads


def run_case(case: Case, backend: str | None, device: torch.device) -> Outcome:
    """Runs ``case`` through flce and judges every output against float64."""
    t = make_tensors(case, device)
    grad_names = tuple(g for g in case.grads if g != "bias" or case.bias)
    leaves = {
        "input": t.input.detach().clone().requires_grad_("input" in grad_names),
        "weight": t.weight.detach().clone().requires_grad_("weight" in grad_names),
        "bias": None if t.bias is None else t.bias.detach().clone().requires_grad_("bias" in grad_names),
    }
    out = fused_linear_cross_entropy(
        leaves["input"],
        leaves["weight"],
        t.target,
        bias=leaves["bias"],
        ce_weight=t.ce_weight,
        backend=backend,
        chunk_size=case.chunk_size,
        vocab_chunk_size=case.vocab_chunk_size,
        **_options(case),
    )
    result = out if isinstance(out, CrossEntropyOutput) else CrossEntropyOutput(out)
    if grad_names:
        (result.loss * t.upstream).sum().backward()
    truth, truth_grads = _run_reference(t, case, torch.float64, torch.float64, grad_names)
    eager, eager_grads = _run_reference(t, case, case.dtype, torch.float32, grad_names)

    outcome = Outcome(case, backend or "auto")
    eps = EPS[case.dtype]
    conditioning = _gradient_conditioning(t, case, grad_names, truth_grads)

    def judge(name, ours, ref, torch_same_dtype, conditioning=1.0):
        err_ours, err_torch = relative_error(ours, ref), relative_error(torch_same_dtype, ref)
        outcome.errors[name] = (err_ours, err_torch)
        floor = eps * max(1.0, conditioning)
        outcome.allowed[name] = TOLERANCE_FACTOR * err_torch + floor
        if not err_ours <= TOLERANCE_FACTOR * err_torch + floor:
            outcome.failures.append(
                f"{name}: err {err_ours:.3g} > {TOLERANCE_FACTOR:g} x torch {err_torch:.3g} + {floor:.3g}"
            )

    judge("loss", result.loss, truth.loss, eager.loss)
    if result.loss.dtype != torch.float32:
        outcome.failures.append(f"loss dtype {result.loss.dtype}, expected float32")
    if case.feature_options.get("return_z_loss"):
        judge("z_loss", result.z_loss, truth.z_loss, eager.z_loss)
    for name in grad_names:
        got = leaves[name].grad
        if got is None:
            outcome.failures.append(f"{name}.grad is None")
            continue
        if got.dtype != leaves[name].dtype:
            outcome.failures.append(f"{name}.grad dtype {got.dtype}, expected {leaves[name].dtype}")
        judge(f"grad_{name}", got, truth_grads[name], eager_grads[name], conditioning.get(name, 1.0))
    if result.predicted_tokens is not None:
        _judge_predictions(outcome, case, t, result)
    return outcome


def _gradient_conditioning(t: Tensors, case: Case, grad_names, truth_grads) -> dict[str, float]:
    """Condition number of each gradient GEMM: ||(|G| |W|)|| / ||G W|| for dX (likewise
    |G|^T |X| for dW, sum |G| for db), with G = dL/dlogits in float64. A GEMM's rounding
    error is bounded relative to the product of magnitudes, not to the result, which
    cancels when a softmax gradient (rows summing to ~0) meets few terms (tiny H or V);
    the eps floor is scaled by it so it stays a rounding floor and never a free pass."""
    x = t.input.detach().double().cpu()
    w = t.weight.detach().double().cpu()
    z = x @ w.T
    if t.bias is not None:
        z = z + t.bias.detach().double().cpu()
    z.requires_grad_()
    opts = _options(case)
    for flag in ("return_z_loss", "return_token_accuracy", "return_predicted_tokens"):
        opts.pop(flag, None)
    ce_weight = None if t.ce_weight is None else t.ce_weight.cpu()
    loss = cross_entropy_reference(z, t.target.cpu(), ce_weight=ce_weight, **opts).loss
    (loss * t.upstream.cpu().double()).sum().backward()
    g = z.grad.abs()
    magnitude = {"input": g @ w.abs(), "weight": g.T @ x.abs(), "bias": g.sum(dim=0)}
    result = {}
    for name in grad_names:
        ref_norm = truth_grads[name].double().norm().item()
        result[name] = magnitude[name].norm().item() / ref_norm if ref_norm > 0 else 1.0
    return result


def _judge_predictions(outcome: Outcome, case: Case, t: Tensors, result: CrossEntropyOutput) -> None:
    """Predicted tokens must be the float64 argmax, except where a rival class is within
    the dtype's rounding of the logits (a near-tie any low-precision GEMM may flip);
    token accuracy must agree exactly with the predicted tokens."""
    z = t.input.double().cpu() @ t.weight.double().cpu().T
    if t.bias is not None:
        z = z + t.bias.double().cpu()
    softcap = case.feature_options.get("softcap")
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    target = t.target.cpu()
    valid = target != case.ignore_index
    predicted = result.predicted_tokens.cpu()
    if (predicted[~valid] != -1).any():
        outcome.failures.append("predicted_tokens: ignored rows must be -1")
    rows = valid.nonzero().squeeze(1)
    chosen = z[rows, predicted[rows].clamp(min=0)]
    best = z[rows].max(dim=1).values
    rounding = 4 * torch.finfo(case.dtype).eps * z[rows].abs().max(dim=1).values
    wrong = (predicted[rows] < 0) | (chosen < best - rounding)
    if wrong.any():
        outcome.failures.append(f"predicted_tokens: {int(wrong.sum())} rows are not (near-)argmax")
    correct = (predicted == target) & valid
    if case.reduction == "none":
        expected = correct.double()
    else:
        expected = correct.sum().double() / max(int(valid.sum()), 1)
    if not torch.allclose(result.token_accuracy.double().cpu(), expected, rtol=1e-6, atol=0):
        outcome.failures.append("token_accuracy disagrees with predicted_tokens")


def check_cases(device: torch.device) -> list[Case]:
    """The matrix ``flce check`` runs: every feature x reduction x dtype on an odd shape,
    with a ragged last chunk."""
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    cases = []
    for feature in FEATURES:
        for reduction in ("mean", "sum", "none"):
            for dtype in dtypes:
                cases.append(
                    Case(
                        feature=feature,
                        reduction=reduction,
                        dtype=dtype,
                        bias=feature == "all",
                        chunk_size=16,
                        seed=len(cases),
                    )
                )
    return cases


def check_cases_vocabulary_blocks() -> list[Case]:
    """Extra ``flce check`` cases for backends with split-row kernels (``vocab_chunk_size``):
    V = 123 in blocks of 40 (ragged) x token chunks of 16."""
    return [
        Case(
            feature=feature,
            reduction=reduction,
            dtype=dtype,
            bias=True,
            chunk_size=16,
            vocab_chunk_size=40,
            seed=1000 + i,
        )
        for i, (feature, reduction, dtype) in enumerate(
            (f, r, d) for f in ("plain", "all") for r in ("mean", "none") for d in (torch.float32, torch.bfloat16)
        )
    ]
