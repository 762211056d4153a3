"""PyTorch as users write the loss without flce: the Hugging Face recipe (materialized
logits upcast to fp32, then ``F.cross_entropy``), eager and under ``torch.compile``.

``eager_loss`` and ``eager_cross_entropy`` are also the baselines of the CE-kernel and
host-overhead benchmarks.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import torch
import torch.nn.functional as F

from flce.bench.cases import BenchCase, BenchLossSettings, Inputs
from flce.bench.methods import LossFn, Method, always, as_loss

# The loss alone, or (loss, token accuracy, predicted tokens) when either of the last two
# is asked for (the one not asked for is None): flce's convention, and a tuple compiles.
EagerResult = torch.Tensor | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def eager_loss(
    x: torch.Tensor,
    w: torch.Tensor,
    target: torch.Tensor,
    ce_weight: torch.Tensor | None,
    settings: BenchLossSettings,
    bias: torch.Tensor | None = None,
) -> EagerResult:
    """The Hugging Face recipe: materialized logits (the bias added by ``F.linear``), upcast
    to fp32, then cross_entropy; softcap and z-loss are applied to the fp32 logits as extra
    elementwise passes."""
    return eager_cross_entropy(F.linear(x, w, bias).float(), target, ce_weight, settings)


def eager_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ce_weight: torch.Tensor | None,
    settings: BenchLossSettings,
) -> EagerResult:
    """``F.cross_entropy`` on given logits in their own dtype, with softcap and z-loss as
    extra elementwise passes (``eager_loss`` passes fp32 logits); token scaling reduces
    per-row losses by hand, and accuracy and predicted tokens come from an argmax."""
    if settings.softcap is not None:
        logits = settings.softcap * torch.tanh(logits / settings.softcap)
    weight = None if ce_weight is None else ce_weight.to(logits.dtype)  # F.cross_entropy wants one dtype
    valid = target != settings.ignore_index
    loss = F.cross_entropy(
        logits,
        target,
        weight=weight,
        ignore_index=settings.ignore_index,
        label_smoothing=settings.label_smoothing,
        # Token scaling weighs the rows before reducing them.
        reduction="none" if settings.use_token_scaling else settings.reduction,
    )
    if settings.use_token_scaling:
        loss = _token_scaled_reduction(loss, logits, target, weight, valid, settings)
    elif settings.lse_square_scale != 0.0:
        z = (torch.logsumexp(logits, dim=-1).square() * valid).sum() * settings.lse_square_scale
        loss = loss + (z / valid.sum().clamp_min(1) if settings.reduction == "mean" else z)
    if not settings.returns_extras:
        return loss
    return loss, *_eager_token_outputs(logits, target, valid, settings)


def _token_scaled_reduction(
    rows: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    valid: torch.Tensor,
    settings: BenchLossSettings,
) -> torch.Tensor:
    """Each row's cross-entropy (``rows``, from ``reduction="none"``: 0 on ignored rows) and
    z-loss times its detached ``p(target)``, reduced as flce reduces: for ``mean`` the
    cross-entropy over the rows' class weights (their count without weights), the z-loss over
    the count of rows. ``F.cross_entropy`` has no such option, so the sums are taken here."""
    lse = torch.logsumexp(logits, dim=-1)
    safe_target = torch.where(valid, target, 0)  # ignore_index may lie outside [0, V)
    target_logit = logits.gather(1, safe_target[:, None]).squeeze(1)
    scale = torch.exp(target_logit - lse).detach() * valid
    z_rows = settings.lse_square_scale * lse.square() * scale
    rows = rows * scale
    if settings.reduction == "none":
        return rows + z_rows
    if settings.reduction == "sum":
        return rows.sum() + z_rows.sum()
    count = valid.sum().clamp_min(1)
    denominator = count if weight is None else (weight[safe_target] * valid).sum()
    return rows.sum() / denominator + z_rows.sum() / count


def _eager_token_outputs(
    logits: torch.Tensor,
    target: torch.Tensor,
    valid: torch.Tensor,
    settings: BenchLossSettings,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Token accuracy and predicted tokens from the argmax of the (softcapped) logits, as flce
    defines them: the first index wins ties, ignored rows count as wrong and predict -1, and
    ``mean``/``sum`` give the fraction right among the non-ignored rows. Neither has a grad."""
    predicted = torch.where(valid, logits.detach().argmax(dim=-1), -1)
    accuracy = None
    if settings.return_token_accuracy:
        correct = ((predicted == target) & valid).float()
        accuracy = correct if settings.reduction == "none" else correct.sum() / valid.sum().clamp_min(1)
    return accuracy, predicted if settings.return_predicted_tokens else None


def _eager_make(case: BenchCase, inputs: Inputs) -> LossFn:
    return lambda: as_loss(eager_loss(inputs.x, inputs.w, inputs.target, inputs.ce_weight, case.loss, inputs.bias))


@lru_cache(maxsize=1)
def _compiled_eager() -> Callable[..., EagerResult]:
    return torch.compile(eager_loss, dynamic=False)


# The cases the compiled loss was made for: one graph each (``dynamic=False`` compiles each
# shape for itself, as a training loop at one shape gets it; dtype, grad mode and the loss
# settings, the class weights and the bias among them, are guards too).
_compiled_cases: set[tuple] = set()


def _allow_a_graph_per_case(case: BenchCase) -> None:
    """Raise dynamo's recompile limit to the number of cases compiled so far. Past the limit
    (8 graphs by default) dynamo runs the function eagerly and says so in a log line only:
    a sweep of more shapes would time eager PyTorch under the torch.compile label."""
    grad = case.mode != "fwd"
    _compiled_cases.add((case.shape, case.dtype, case.device, grad, case.loss))
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.6
    setattr(config, name, max(getattr(config, name), len(_compiled_cases)))


def _compile_check(case: BenchCase) -> str | None:
    return None if hasattr(torch, "compile") else "torch.compile is missing"


def _compile_make(case: BenchCase, inputs: Inputs) -> LossFn:
    fn = _compiled_eager()
    _allow_a_graph_per_case(case)
    return lambda: as_loss(fn(inputs.x, inputs.w, inputs.target, inputs.ce_weight, case.loss, inputs.bias))


def torch_eager_methods() -> list[Method]:
    return [
        Method("torch:eager", "torch eager (fp32 logits)", "torch", always, _eager_make),
        Method("torch:compile", "torch.compile (fp32 logits)", "torch", _compile_check, _compile_make),
    ]
