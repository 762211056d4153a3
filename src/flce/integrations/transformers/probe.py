"""The probe: what one model instance's forward does with its head's output and its labels.

A few forwards on a ``PROBE_LENGTH``-token input, in training and eval mode, with the head
and ``loss_function`` intercepted (``patch.Interceptor``):

- the head returns ``PLACEHOLDER_POINTS`` per position, requiring grad, and ``loss_function``
  a leaf; autograd then shows that the loss is ``loss_function(...)`` plus terms that never
  touch the logits (the leaf enters with weight 1, the placeholder not at all), that no other
  output field is computed from the logits, and the values ``loss_function`` receives show
  the post-processing (none, a scale, or a soft-cap of the config);
- a forward that never calls ``loss_function`` is given known logits instead and accepted only
  if its loss is exactly (value and gradient) the mean cross-entropy of those logits against
  the labels, shifted or not.

Whatever cannot be established raises ``UnsupportedModelError`` with the reason.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from flce.integrations.transformers.errors import UnsupportedModelError
from flce.integrations.transformers.head import head_parts

if TYPE_CHECKING:
    from flce.integrations.transformers.patch import Interceptor

# What the head returns per position while intercepted: the model's post-processing g turns
# them into g(points). g(1.0) is the scale; the others tell a scale from a soft-cap at probe
# time (64 and 1024 bend under any soft-cap in use, -4 checks the sign is kept).
PLACEHOLDER_POINTS = (1.0, -4.0, 64.0, 1024.0)
PROBE_LENGTH = 6  # tokens in the probe's input: short, and enough to tell shifted labels from unshifted

ROUTE_LOSS_FUNCTION = "loss_function"  # the forward calls self.loss_function(logits, labels, ...)
ROUTE_INLINE = "inline"  # the forward computes a plain cross-entropy itself


# --------------------------------------------------------------------------- recipe


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What the probe established about one model instance's forward."""

    route: str  # ROUTE_LOSS_FUNCTION or ROUTE_INLINE
    shift: bool  # position t is scored against labels[t + 1]
    scale: bool  # the head's output is multiplied by a factor (read from the placeholder at run time)
    softcap: float | None  # then soft-capped: z -> c * tanh(z / c)
    output_fields: tuple[str, ...]  # the output dataclass's fields, to rebuild it without the logits


def known_loss_functions() -> dict[Any, bool]:
    """transformers' loss functions flce reproduces -> whether they shift the labels."""
    from transformers.loss import loss_utils

    return {loss_utils.ForCausalLMLoss: True, loss_utils.ForMaskedLMLoss: False}


def shifted_labels(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``labels[..., t + 1]`` at position t, ``ignore_index`` at the last (as transformers)."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


# --------------------------------------------------------------------------- probe


def _config_items(config):
    """``(key, value)`` of every attribute of ``config`` and of its sub-configs (each
    visited once), sub-configs themselves excepted."""
    seen: set[int] = set()

    def walk(cfg):
        if id(cfg) in seen:
            return
        seen.add(id(cfg))
        for key, value in vars(cfg).items():
            if hasattr(value, "to_dict") and hasattr(value, "model_type"):
                yield from walk(value)
            else:
                yield key, value

    yield from walk(config)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def special_token_ids(config) -> set[int]:
    """Every ``*_token_id`` / ``*_token_index`` of the config and its sub-configs (image
    tokens among them: the probe's text must not ask for pixels)."""
    found: set[int] = set()
    for key, value in _config_items(config):
        if "token" in key and ("id" in key or "index" in key):
            values = value if isinstance(value, (list, tuple)) else [value]
            found.update(v for v in values if isinstance(v, int) and not isinstance(v, bool))
    return found


def _softcap_candidates(config) -> list[float]:
    return [
        float(value)
        for key, value in _config_items(config)
        if ("softcap" in key or "soft_cap" in key) and _is_number(value) and value > 0
    ]


def _probe_inputs(model, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    embeddings = model.get_input_embeddings()
    rows = getattr(embeddings, "num_embeddings", vocab)
    special = special_token_ids(model.config)
    tokens = [t for t in range(3, min(rows, vocab)) if t not in special][:PROBE_LENGTH]
    if len(tokens) < PROBE_LENGTH:
        raise UnsupportedModelError(type(model).__name__, f"its vocabulary ({vocab}) is too small to probe")
    weight = getattr(embeddings, "weight", None)
    device = weight.device if isinstance(weight, torch.Tensor) and weight.device.type != "meta" else model.device
    if device.type == "meta":
        device = torch.device("cpu")
    input_ids = torch.tensor([tokens[::-1]], device=device)  # not sorted: labels and shifted labels differ
    labels = input_ids.clone()
    labels[0, 2] = -100  # an ignored target must stay ignored
    return input_ids, labels


def _grad(output: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor | None]:
    if not output.requires_grad:
        return [None] * len(inputs)
    return list(torch.autograd.grad(output.sum(), inputs, allow_unused=True, retain_graph=True))


def _depends(grad: torch.Tensor | None) -> bool:
    return grad is not None and bool((grad != 0).any())


def _fit_transform(name: str, received: torch.Tensor, config) -> tuple[bool, float | None]:
    """(scale, softcap) such that the model's post-processing g is ``softcap(scale * z)``."""
    rows = received.detach().double().reshape(-1, len(PLACEHOLDER_POINTS))
    if not bool((rows == rows[:1]).all()):
        raise UnsupportedModelError(name, "its post-processing of the logits differs between positions")
    observed = rows[0].cpu()
    points = torch.tensor(PLACEHOLDER_POINTS, dtype=torch.float64, device="cpu")
    rtol = 8 * torch.finfo(received.dtype).eps
    if torch.allclose(observed, points, rtol=rtol, atol=0):
        return False, None
    scale = observed[0]
    if scale != 0 and torch.allclose(observed, scale * points, rtol=rtol, atol=0):
        return True, None
    for cap in _softcap_candidates(config):
        if torch.allclose(observed, cap * torch.tanh(points / cap), rtol=max(rtol, 1e-6), atol=0):
            return False, cap
    seen = ", ".join(f"{p:g} -> {v:.6g}" for p, v in zip(PLACEHOLDER_POINTS, observed.tolist(), strict=True))
    raise UnsupportedModelError(
        name,
        f"its forward transforms the head's output by a function that is neither a scale nor the config's "
        f"soft-cap ({seen}); flce cannot fold it into the loss",
    )


def _output_fields(name: str, output) -> tuple[str, ...]:
    if not dataclasses.is_dataclass(output) or not hasattr(output, "to_tuple"):
        raise UnsupportedModelError(name, f"its forward returns a {type(output).__name__}, not a ModelOutput")
    fields = tuple(f.name for f in dataclasses.fields(output))
    missing = {"loss", "logits"} - set(fields)
    if missing:
        raise UnsupportedModelError(name, f"its output {type(output).__name__} has no {sorted(missing)} field")
    return fields


def _check_outputs_independent(name: str, output, placeholder: torch.Tensor, fields: tuple[str, ...]) -> None:
    for field in fields:
        if field in ("loss", "logits"):
            continue
        value = getattr(output, field)
        tensors = [value] if isinstance(value, torch.Tensor) else []
        if isinstance(value, (tuple, list)):
            tensors = [v for v in value if isinstance(v, torch.Tensor)]
        for tensor in tensors:
            if tensor.is_floating_point() and _depends(_grad(tensor, [placeholder])[0]):
                raise UnsupportedModelError(
                    name, f"its output field {field!r} is computed from the logits, which flce does not materialise"
                )


def _call_for_probe(interceptor: Interceptor, mode: str | None, original, model, input_ids, labels):
    interceptor.begin(mode)
    extra = {"use_cache": False} if "use_cache" in inspect.signature(original).parameters else {}  # as in training
    try:
        with torch.enable_grad():
            output = original(model, input_ids=input_ids, labels=labels, **extra)
        return output, None
    except Exception as exc:  # the reason is reported if no route works
        return None, exc


def _probe_loss_function(name, interceptor, model, output, error) -> Recipe:
    """The forward called ``loss_function``: check the loss is that result plus terms that
    never touch the logits, and find the logits' post-processing."""
    if error is not None:
        raise UnsupportedModelError(name, f"its forward fails with the head intercepted: {error!r}") from error
    if len(interceptor.loss_calls) != 1 or interceptor.head_calls != 1:
        raise UnsupportedModelError(
            name,
            f"its forward calls the head {interceptor.head_calls} times and loss_function "
            f"{len(interceptor.loss_calls)} times per call (flce needs one of each)",
        )
    received, result = interceptor.loss_calls[0]
    placeholder = interceptor.placeholder
    if received.shape != placeholder.shape:
        raise UnsupportedModelError(
            name,
            f"its forward reshapes the logits between the head and loss_function "
            f"({tuple(placeholder.shape)} -> {tuple(received.shape)})",
        )
    if interceptor.shift_of_loss_function is None:
        function = interceptor.original_loss_function
        raise UnsupportedModelError(
            name,
            f"its loss_function is {getattr(function, '__qualname__', function)!r}, not transformers' "
            "ForCausalLMLoss or ForMaskedLMLoss",
        )
    fields = _output_fields(name, output)
    if output.loss is None:
        raise UnsupportedModelError(name, "its forward drops the loss_function result")
    _check_outputs_independent(name, output, placeholder, fields)
    weight_of_result, weight_of_logits = _grad(output.loss, [result, placeholder])
    if weight_of_result is None or float(weight_of_result) != 1.0:
        raise UnsupportedModelError(
            name, "its loss is not loss_function(...) plus terms of their own (it rescales or drops the result)"
        )
    if _depends(weight_of_logits):
        raise UnsupportedModelError(name, "its loss uses the logits outside loss_function (e.g. a z-loss on them)")
    scale, softcap = _fit_transform(name, received, model.config)
    if scale and head_parts(interceptor.head).linear.bias is not None:
        raise UnsupportedModelError(name, "its head has a bias and its logits are scaled after it")
    return Recipe(ROUTE_LOSS_FUNCTION, interceptor.shift_of_loss_function, scale, softcap, fields)


def _cross_entropy64(logits: torch.Tensor, labels: torch.Tensor, shift: bool) -> torch.Tensor:
    targets = shifted_labels(labels, -100) if shift else labels
    return F.cross_entropy(logits.double().reshape(-1, logits.shape[-1]), targets.reshape(-1).to(logits.device))


def _probe_inline(name, interceptor, model, output, error, input_ids, labels, first_error) -> Recipe:
    """The forward did not call ``loss_function``: accept it only if its loss is exactly the
    mean cross-entropy of its logits (given known ones) against the labels, shifted or not."""
    if error is not None:
        cause = first_error or error
        raise UnsupportedModelError(name, f"its forward fails with the head intercepted: {cause!r}") from cause
    if interceptor.head_calls != 1:
        raise UnsupportedModelError(name, f"its forward calls the head {interceptor.head_calls} times per call")
    fields = _output_fields(name, output)
    if output.loss is None:
        raise UnsupportedModelError(name, "its forward computes no loss from labels")
    logits = interceptor.placeholder
    returned = output.logits
    if returned is None or returned.shape != logits.shape or not torch.equal(returned.double(), logits.double()):
        raise UnsupportedModelError(
            name, "its forward computes its loss without loss_function and transforms the logits before it"
        )
    _check_outputs_independent(name, output, logits, tuple(f for f in fields if f != "logits"))
    (stock_grad,) = _grad(output.loss, [logits])
    matches = []
    for shift in (True, False):
        reference_logits = logits.detach().double().requires_grad_()
        reference = _cross_entropy64(reference_logits, labels, shift)
        (reference_grad,) = torch.autograd.grad(reference, [reference_logits])
        same_value = math.isclose(float(output.loss.detach()), float(reference.detach()), rel_tol=1e-5, abs_tol=1e-6)
        if same_value and stock_grad is not None and torch.allclose(stock_grad.double(), reference_grad, atol=1e-6):
            matches.append(shift)
    if len(matches) != 1:
        raise UnsupportedModelError(
            name,
            "its forward computes its loss without loss_function, and that loss is not the mean cross-entropy "
            "of the logits against the labels (shifted or not)",
        )
    return Recipe(ROUTE_INLINE, matches[0], False, None, fields)


def _check_stock_runs(name: str, interceptor: Interceptor, original, model, input_ids, labels) -> None:
    """A forward that fails under interception may fail without it too: say which."""
    _, error = _call_for_probe(interceptor, None, original, model, input_ids, labels)
    if error is not None:
        raise UnsupportedModelError(
            name, f"its own forward fails on a {PROBE_LENGTH}-token text input with labels: {error!r}"
        ) from error


def _probe_once(name: str, interceptor: Interceptor, original, model) -> Recipe:
    input_ids, labels = _probe_inputs(model, head_parts(interceptor.head).linear.out_features)
    try:
        output, error = _call_for_probe(interceptor, "probe", original, model, input_ids, labels)
        if error is not None:
            _check_stock_runs(name, interceptor, original, model, input_ids, labels)
        if interceptor.loss_calls:
            return _probe_loss_function(name, interceptor, model, output, error)
        if error is None and output is not None and getattr(output, "loss", None) is None:
            raise UnsupportedModelError(name, "its forward computes no loss from labels")
        first_error = error
        output, error = _call_for_probe(interceptor, "probe_logits", original, model, input_ids, labels)
        return _probe_inline(name, interceptor, model, output, error, input_ids, labels, first_error)
    finally:
        interceptor.end()


def probe(interceptor: Interceptor, original, model) -> Recipe:
    """How this instance's forward scores labels, in training and in eval mode (a forward
    may add terms in one only); raises ``UnsupportedModelError``."""
    name = type(model).__name__
    was_training = model.training
    try:
        recipes = []
        for training in (True, False):
            model.train(training)
            recipes.append(_probe_once(name, interceptor, original, model))
    finally:
        model.train(was_training)
    if recipes[0] != recipes[1]:
        raise UnsupportedModelError(name, f"its forward scores labels differently in training and eval: {recipes}")
    return recipes[0]
