"""The probe: what one model instance's forward does with its head's output and its labels.

Forwards on a ``PROBE_LENGTH``-token input, in training and eval mode, with the head and
``loss_function`` intercepted (``patch.Interceptor``):

- the head returns ``PLACEHOLDER_POINTS`` per position, requiring grad, and ``loss_function``
  a leaf; autograd then shows that the loss is ``loss_function(...)`` plus terms that never
  touch the logits (the leaf enters with weight 1, the placeholder not at all), that no other
  output field is computed from the logits, and the values ``loss_function`` receives show
  the post-processing (none, a scale, or a soft-cap whose value a config entry or a module
  attribute holds, possibly after a scale: one written as a constant in the code is refused).
  A forward that transforms the logits at all gets its scale read at every call, even one
  that is 1.0 when probed (a learnable scale gets its gradient, a scale set later is followed);
- once more with a placeholder as wide as the vocabulary: a forward that keeps only the first
  columns (a padded vocabulary, e.g. ``config.unpadded_vocab_size``) is scored over those rows
  of the weight; any other change to particular columns is refused;
- once more with an ``attention_mask`` that hides the first positions (left padding), which
  must not change what was found, except for a forward that computes its cross-entropy
  inline and drops the targets the mask hides, which is then followed;
- a forward that never calls ``loss_function`` is given known logits instead and accepted only
  if its loss is exactly (value and gradient) the mean cross-entropy of those logits against
  the labels, shifted or not, and if calling it without labels, as the patched forward does,
  runs and computes the same hidden states (labels that also build decoder inputs do not).

The probe leaves the model as it found it: its training flag, and every random generator it
could draw from (dropout in training mode). It runs under autograd whatever the caller's
grad mode. The config entries and module attributes the result depends on (soft-caps, logit
scales, vocabulary sizes: ``READ_MARKERS``) are recorded; a call that finds one changed probes
again (``patch.interceptor_for``).

Whatever cannot be established raises ``UnsupportedModelError`` with the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from collections.abc import Iterator
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
# Positions the probe's attention mask hides, at the start (left padding). With three, a
# forward that drops the targets at hidden positions, one that drops the positions whose
# logits are hidden and one that ignores the mask give three different losses (the probe's
# labels ignore position 2 already).
PROBE_PADDING = 3
# The dtypes flce's kernels take: a head in another one (float64) is refused at patch time.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

ROUTE_LOSS_FUNCTION = "loss_function"  # the forward calls self.loss_function(logits, labels, ...)
ROUTE_INLINE = "inline"  # the forward computes a plain cross-entropy itself

# Config entries and module attributes whose names contain one of these may steer the
# logits' post-processing or width (a soft-cap, a logit scale or multiplier, a vocabulary
# size); their values are recorded with the recipe and a call that finds one changed probes
# again. So are those equal to the soft-cap the probe found, whatever their names.
READ_MARKERS = ("softcap", "soft_cap", "logit", "vocab", "multiplier")


# --------------------------------------------------------------------------- recipe

ConfigPath = tuple[str, ...]
# (the module's path from the model, its name in ``model.named_modules()`` split at the
# dots, () for the model itself; the attribute)
ModuleAttribute = tuple[tuple[str, ...], str]
_MISSING = object()


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What the probe established about one model instance's forward."""

    route: str  # ROUTE_LOSS_FUNCTION or ROUTE_INLINE
    shift: bool  # position t is scored against labels[t + 1]
    # The forward transforms the head's output by a scale, read at every call from the
    # processed placeholder (the point 1.0; through the soft-cap where there is one), so it
    # may be 1.0 when probed, learnable or changed.
    scale: bool
    softcap: float | None  # then soft-capped: z -> c * tanh(z / c), after the scale
    output_fields: tuple[str, ...]  # the output dataclass's fields, to rebuild it without the logits
    vocab_rows: int | None = None  # the forward keeps the logits of the first vocab_rows tokens only
    mask_drops_targets: bool = False  # inline route: targets at positions attention_mask hides are not scored
    # (path, value) of the config entries the recipe was found with (READ_MARKERS).
    config_reads: tuple[tuple[ConfigPath, Any], ...] = ()
    # The same for the attributes of the model's modules: a soft-cap or scale a forward reads
    # from ``self`` (Mistral Large 4's ``final_logit_softcapping``, Inkling 2's
    # ``logit_softcap.softcap``) is copied from the config at init and may change without it.
    module_reads: tuple[tuple[ModuleAttribute, Any], ...] = ()

    def changed_entry(self, model) -> str | None:
        """What the first recorded config entry or module attribute of ``model`` that changed
        since the probe is (``config.<path>`` or ``the attribute <path>``), or None. Traced by
        torch.compile on every call of a compiled model: only the name comes back, not the
        values (mapping the ``_MISSING`` sentinel to None, ``current is _MISSING`` with a
        float ``current``, failed in torch 2.11's dynamo; the values would be symbols there)."""
        for path, value in self.config_reads:
            current = model.config
            for key in path:
                current = getattr(current, key, _MISSING)
            if not _same_value(current, value):
                return "config." + ".".join(path)
        for (path, attribute), value in self.module_reads:
            module = model
            for key in path:  # the module now at that path (children may be replaced, e.g. by PEFT)
                module = module._modules.get(key) if module is not None else None
            current = _MISSING if module is None else getattr(module, attribute, _MISSING)
            if not _same_value(current, value):
                return f"the attribute {'.'.join((*path, attribute))}"
        return None


def _same_value(current, recorded) -> bool:
    if current is recorded:
        return True
    if type(current) is not type(recorded):
        return False
    # NaN is the one value unequal to itself (not math.isnan: torch.compile traces this, per call)
    return current == recorded or (current != current and recorded != recorded)


def known_loss_functions() -> dict[Any, bool]:
    """transformers' loss functions flce reproduces -> whether they shift the labels."""
    from transformers.loss import loss_utils

    return {loss_utils.ForCausalLMLoss: True, loss_utils.ForMaskedLMLoss: False}


def shifted_labels(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``labels[..., t + 1]`` at position t, ``ignore_index`` at the last (as transformers)."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def masked_labels(labels: torch.Tensor, attention_mask: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``labels`` with ``ignore_index`` where ``attention_mask`` (its last positions, as many as
    the labels have) is 0: the targets a forward that drops hidden positions never scores."""
    if attention_mask.dim() != 2 or attention_mask.shape[-1] < labels.shape[-1]:
        raise ValueError(
            f"this model drops the targets its attention_mask hides; flce needs a (batch, sequence) attention_mask "
            f"covering the labels' {labels.shape[-1]} positions, got shape {tuple(attention_mask.shape)}"
        )
    hidden = attention_mask[..., -labels.shape[-1] :].to(labels.device) == 0
    return labels.masked_fill(hidden, ignore_index)


def vocabulary_points(vocab: int) -> torch.Tensor:
    """The probe's placeholder row as wide as the vocabulary: ``PLACEHOLDER_POINTS`` then a
    ramp, distinct values in order, so a slice or an edit of some columns shows."""
    points = torch.tensor(PLACEHOLDER_POINTS, dtype=torch.float32, device="cpu")
    ramp = torch.linspace(-6.0, 6.0, max(vocab - len(PLACEHOLDER_POINTS), 0), dtype=torch.float32, device="cpu")
    return torch.cat([points, ramp])[:vocab]


# --------------------------------------------------------------------------- config


def _config_entries(config) -> Iterator[tuple[ConfigPath, Any]]:
    """``(path, value)`` of every attribute of ``config`` and of its sub-configs (each
    visited once), sub-configs themselves excepted."""
    seen: set[int] = set()

    def walk(cfg, prefix: ConfigPath):
        if id(cfg) in seen:
            return
        seen.add(id(cfg))
        for key, value in vars(cfg).items():
            if hasattr(value, "to_dict") and hasattr(value, "model_type"):
                yield from walk(value, (*prefix, key))
            else:
                yield (*prefix, key), value

    yield from walk(config, ())


def _config_items(config):
    """``(key, value)`` of every attribute of ``config`` and of its sub-configs."""
    for path, value in _config_entries(config):
        yield path[-1], value


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


def _module_attributes(model) -> Iterator[tuple[ModuleAttribute, Any]]:
    """``((module name, attribute), value)`` of the public attributes of the model's modules
    (the model's own included) that hold a number or None: where a forward may keep a
    soft-cap or a scale instead of reading its config."""
    for module_name, module in model.named_modules():
        path = tuple(module_name.split(".")) if module_name else ()
        for attribute, value in vars(module).items():
            if not attribute.startswith("_") and (value is None or _is_number(value)):
                yield (path, attribute), value


def _softcap_candidates(model) -> list[float]:
    """The positive numbers of the config and of the modules' attributes, whatever their
    names: the soft-cap a forward applies must be one of them for flce to follow it (a
    change of where it is read from then probes again; a constant in the code is refused)."""
    values = (value for _, value in (*_config_items(model.config), *_module_attributes(model)))
    return sorted({float(value) for value in values if _is_number(value) and value > 0})


def _is_read(name: str, value, recipe: Recipe) -> bool:
    """Whether a config entry or module attribute called ``name`` holding ``value`` may change
    the recipe: named like a soft-cap, a logit scale or a vocabulary size (READ_MARKERS), or
    equal to the kept vocabulary width or to the soft-cap."""
    if value is not None and not _is_number(value):
        return False
    if any(marker in name.lower() for marker in READ_MARKERS):
        return True
    return value is not None and value in (recipe.vocab_rows, recipe.softcap)


def _config_reads(config, recipe: Recipe) -> tuple[tuple[ConfigPath, Any], ...]:
    """The config entries a later change of which may change the recipe (``_is_read``)."""
    return tuple((path, value) for path, value in _config_entries(config) if _is_read(path[-1], value, recipe))


def _module_reads(model, recipe: Recipe) -> tuple[tuple[ModuleAttribute, Any], ...]:
    """The module attributes a later change of which may change the recipe (``_is_read``)."""
    return tuple((where, value) for where, value in _module_attributes(model) if _is_read(where[1], value, recipe))


# --------------------------------------------------------------------------- inputs


@dataclasses.dataclass(frozen=True)
class ProbeBatch:
    """One probe call's inputs."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor | None = None

    def left_padded(self) -> ProbeBatch:
        mask = torch.ones_like(self.input_ids)
        mask[:, :PROBE_PADDING] = 0
        return dataclasses.replace(self, attention_mask=mask)


def _probe_inputs(model, vocab: int) -> ProbeBatch:
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
    return ProbeBatch(input_ids, labels)


# --------------------------------------------------------------------------- autograd


def _grad(output: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor | None]:
    if not output.requires_grad:
        return [None] * len(inputs)
    return list(torch.autograd.grad(output.sum(), inputs, allow_unused=True, retain_graph=True))


def _depends(grad: torch.Tensor | None) -> bool:
    return grad is not None and bool((grad != 0).any())


def _other_leaves(tensor: torch.Tensor, known: torch.Tensor, limit: int = 10_000) -> bool:
    """Whether ``tensor``'s autograd graph reaches a leaf other than ``known`` (a parameter
    the post-processing reads, e.g. a learnable logit scale)."""
    stack, seen = [tensor.grad_fn], set()
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad: the leaf it accumulates into
        if variable is not None and variable is not known:
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return len(seen) >= limit


# --------------------------------------------------------------------------- transforms


def _fit_transform(
    name: str, received: torch.Tensor, model, transformed: bool, learnable: bool
) -> tuple[bool, float | None]:
    """(scale, softcap) such that the model's post-processing g is ``softcap(a * z)``, ``a``
    read at every call where ``scale``. ``transformed``: the forward handed ``loss_function``
    another tensor than the head's output, so its scale is read at every call even where it
    is 1.0 now; ``learnable``: that tensor reads a parameter (a learnable scale). A soft-cap
    must be the value of a config entry or module attribute (``_softcap_candidates``); a scale
    before it (MuseSpark's ``output_multiplier``) is read back at every call through the
    soft-cap (``scale_before_softcap``)."""
    rows = received.detach().double().reshape(-1, len(PLACEHOLDER_POINTS))
    if not bool((rows == rows[:1]).all()):
        raise UnsupportedModelError(name, "its post-processing of the logits differs between positions")
    observed = rows[0].cpu()
    points = torch.tensor(PLACEHOLDER_POINTS, dtype=torch.float64, device="cpu")
    rtol = 8 * torch.finfo(received.dtype).eps
    scale = observed[0]
    if scale != 0 and torch.allclose(observed, scale * points, rtol=rtol, atol=0):
        # Identity included: a transform that gives 1.0 now (a learnable scale at its initial
        # value, a config scale of 1) may not later.
        return transformed or bool(scale != 1), None
    for cap in _softcap_candidates(model):
        if not abs(float(scale)) < cap:
            continue
        before = scale_before_softcap(scale, cap)
        if torch.allclose(observed, cap * torch.tanh(before * points / cap), rtol=max(rtol, 1e-6), atol=0):
            return learnable or not math.isclose(float(before), 1.0, rel_tol=max(rtol, 1e-6)), cap
    seen = ", ".join(f"{p:g} -> {v:.6g}" for p, v in zip(PLACEHOLDER_POINTS, observed.tolist(), strict=True))
    raise UnsupportedModelError(
        name,
        f"its forward transforms the head's output by a function that is neither a scale nor a soft-cap "
        f"c * tanh(a * z / c) whose c is a config entry or a module attribute ({seen}); flce cannot fold it into "
        "the loss (nor follow a soft-cap written as a constant in the code)",
    )


def scale_before_softcap(processed_one, softcap: float):
    """``a`` of a post-processing ``softcap * tanh(a * z / softcap)``, from its value at z = 1
    (a float, or a tensor: differentiably, so a learnable ``a`` gets its gradient)."""
    if isinstance(processed_one, torch.Tensor):
        return softcap * torch.atanh(processed_one / softcap)
    return softcap * math.atanh(processed_one / softcap)


def _expected_transform(recipe: Recipe, points: torch.Tensor, processed_one: float) -> torch.Tensor:
    """The recipe's post-processing of ``points`` (float64), ``processed_one`` its value at 1.0."""
    if recipe.softcap is not None:
        before = scale_before_softcap(processed_one, recipe.softcap) if recipe.scale else 1.0
        return recipe.softcap * torch.tanh(before * points / recipe.softcap)
    return processed_one * points if recipe.scale else points


# --------------------------------------------------------------------------- checks


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


def check_model(name: str, model, head: torch.nn.Module) -> None:
    """What refuses a model before any probe: a head dtype flce's kernels do not take."""
    dtype = head_parts(head).linear.weight.dtype
    if dtype not in SUPPORTED_DTYPES:
        raise UnsupportedModelError(
            name,
            f"its head's weight is {dtype}; flce's kernels take float16, bfloat16 or float32 (cast the model, "
            "e.g. model.float(), before patching)",
        )


# --------------------------------------------------------------------------- the calls


def _call_for_probe(interceptor: Interceptor, mode: str | None, original, model, batch: ProbeBatch, labelled=True):
    interceptor.begin(mode)
    parameters = inspect.signature(original).parameters
    extra = {"use_cache": False} if "use_cache" in parameters else {}  # as in training
    if batch.attention_mask is not None:
        extra["attention_mask"] = batch.attention_mask
    labels = batch.labels if labelled else None
    try:
        output = original(model, input_ids=batch.input_ids, labels=labels, **extra)
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
    learnable = received.requires_grad and _other_leaves(received, placeholder)
    scale, softcap = _fit_transform(name, received, model, transformed=received is not placeholder, learnable=learnable)
    if learnable and not scale:
        raise UnsupportedModelError(
            name, "its post-processing of the logits reads a learnable tensor in a way that is not a plain scale"
        )
    if scale and head_parts(interceptor.head).linear.bias is not None:
        raise UnsupportedModelError(name, "its head has a bias and its logits are scaled after it")
    return Recipe(ROUTE_LOSS_FUNCTION, interceptor.shift_of_loss_function, scale, softcap, fields)


def _cross_entropy64(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.double().reshape(-1, logits.shape[-1]), targets.reshape(-1).to(logits.device))


def _inline_candidates(batch: ProbeBatch) -> Iterator[tuple[bool, bool, torch.Tensor]]:
    """``(shift, mask_drops_targets, targets)`` of each label convention flce can follow."""
    for shift in (True, False):
        for drops in (False, True) if batch.attention_mask is not None else (False,):
            labels = masked_labels(batch.labels, batch.attention_mask, -100) if drops else batch.labels
            yield shift, drops, shifted_labels(labels, -100) if shift else labels


def _probe_inline(name, interceptor, model, output, error, batch: ProbeBatch, first_error) -> Recipe:
    """The forward did not call ``loss_function``: accept it only if its loss is exactly the
    mean cross-entropy of its logits (given known ones) against the labels, shifted or not,
    with the targets its attention mask hides dropped or not."""
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
    for shift, drops, targets in _inline_candidates(batch):
        reference_logits = logits.detach().double().requires_grad_()
        reference = _cross_entropy64(reference_logits, targets)
        (reference_grad,) = torch.autograd.grad(reference, [reference_logits])
        same_value = math.isclose(float(output.loss.detach()), float(reference.detach()), rel_tol=1e-5, abs_tol=1e-6)
        if same_value and stock_grad is not None and torch.allclose(stock_grad.double(), reference_grad, atol=1e-6):
            matches.append((shift, drops))
    if len(matches) != 1:
        masked = (
            " (with its attention_mask's hidden positions dropped or not)" if batch.attention_mask is not None else ""
        )
        raise UnsupportedModelError(
            name,
            "its forward computes its loss without loss_function, and that loss is not the mean cross-entropy "
            f"of the logits against the labels (shifted or not){masked}",
        )
    ((shift, drops),) = matches
    return Recipe(ROUTE_INLINE, shift, False, None, fields, mask_drops_targets=drops)


def _check_inline_runs_without_labels(name: str, interceptor: Interceptor, original, model, batch) -> None:
    """The patched forward calls an inline-loss model without labels (with the head's
    placeholder) and adds the loss itself: that call must run, and compute the hidden states
    it computes with labels (a forward that builds decoder inputs from the labels does not)."""
    with_labels = interceptor.hidden.detach()
    output, error = _call_for_probe(interceptor, "probe_unlabelled", original, model, batch, labelled=False)
    if error is not None:
        raise UnsupportedModelError(
            name,
            "its forward computes its loss without loss_function, so flce calls it without labels and adds the "
            f"loss itself, but that call fails with the head intercepted: {error!r}",
        ) from error
    if interceptor.head_calls != 1 or getattr(output, "loss", None) is not None:
        raise UnsupportedModelError(
            name, "without labels its forward calls the head more than once or still computes a loss"
        )
    without_labels = interceptor.hidden.detach()
    same = with_labels.shape == without_labels.shape and (
        model.training or torch.allclose(with_labels, without_labels, rtol=1e-5, atol=1e-6)
    )
    if not same:
        raise UnsupportedModelError(
            name,
            "its forward computes its loss without loss_function and uses the labels for more than that loss "
            "(the head's input changes without them, e.g. decoder inputs built from the labels); flce calls it "
            "without labels",
        )


class _StockForwardFails(UnsupportedModelError):
    """The model's own forward fails on the probe's input (not only under interception)."""


def _check_stock_runs(name: str, interceptor: Interceptor, original, model, batch: ProbeBatch) -> None:
    """A forward that fails under interception may fail without it too: say which."""
    _, error = _call_for_probe(interceptor, None, original, model, batch)
    if error is not None:
        padded = " with left padding (attention_mask)" if batch.attention_mask is not None else ""
        mode = "training" if model.training else "eval"  # the probe runs both: a forward may fail in one only
        raise _StockForwardFails(
            name,
            f"its own forward fails in {mode} mode on a {PROBE_LENGTH}-token text input with labels{padded}: {error!r}",
        ) from error


def _probe_once(name: str, interceptor: Interceptor, original, model, batch: ProbeBatch) -> Recipe:
    try:
        output, error = _call_for_probe(interceptor, "probe", original, model, batch)
        if error is not None:
            _check_stock_runs(name, interceptor, original, model, batch)
        if interceptor.loss_calls:
            return _probe_loss_function(name, interceptor, model, output, error)
        if error is None and output is not None and getattr(output, "loss", None) is None:
            raise UnsupportedModelError(name, "its forward computes no loss from labels")
        if getattr(model.config, "is_encoder_decoder", False):
            raise UnsupportedModelError(
                name,
                "it is an encoder-decoder model (config.is_encoder_decoder) that computes its loss without "
                "loss_function: flce would call it without labels, and its forward builds the decoder's inputs "
                "from them; flce supports its decoder-only causal LM (e.g. BartForCausalLM, not "
                "BartForConditionalGeneration)",
            )
        # The placeholder pass may fail where an inline loss reshapes logits to the vocabulary
        # (`.view(-1, vocab_size)`); the call the patched forward makes is checked below.
        first_error = error
        output, error = _call_for_probe(interceptor, "probe_logits", original, model, batch)
        recipe = _probe_inline(name, interceptor, model, output, error, batch, first_error)
        _check_inline_runs_without_labels(name, interceptor, original, model, batch)
        return recipe
    finally:
        interceptor.end()


def _probe_vocabulary(
    name: str, interceptor: Interceptor, original, model, batch: ProbeBatch, recipe: Recipe
) -> Recipe:
    """The loss_function route with a placeholder as wide as the vocabulary: the logits must
    reach loss_function as the recipe's transform of every column, or of the first ones only
    (a padded vocabulary: then the loss is over those rows of the weight)."""
    try:
        output, error = _call_for_probe(interceptor, "probe_vocab", original, model, batch)
        if error is not None or len(interceptor.loss_calls) != 1:
            reason = repr(error) if error is not None else f"loss_function called {len(interceptor.loss_calls)} times"
            raise UnsupportedModelError(name, f"its forward fails with vocabulary-wide logits intercepted: {reason}")
        received = interceptor.loss_calls[0][0].detach()
        placeholder = interceptor.placeholder
        vocab = placeholder.shape[-1]
        width = received.shape[-1]
        if received.shape[:-1] != placeholder.shape[:-1] or width > vocab:
            raise UnsupportedModelError(
                name,
                f"its forward reshapes the logits between the head and loss_function "
                f"({tuple(placeholder.shape)} -> {tuple(received.shape)})",
            )
        observed = received.double().reshape(-1, width)
        scale = float(observed[0, 0])  # the point 1.0
        expected = _expected_transform(recipe, placeholder.detach().double().reshape(-1, vocab)[:, :width], scale)
        rtol = max(8 * torch.finfo(received.dtype).eps, 1e-6)
        if not torch.allclose(observed, expected, rtol=rtol, atol=1e-6):
            kept = f"the first {width} of {vocab} columns, " if width < vocab else ""
            raise UnsupportedModelError(
                name,
                f"its forward changes the logits of particular vocabulary entries ({kept}not the same scale or "
                "soft-cap of every column); flce cannot fold that into the loss",
            )
    finally:
        interceptor.end()
    return dataclasses.replace(recipe, vocab_rows=width if width < vocab else None)


def _probe_attention_mask(
    name: str, interceptor: Interceptor, original, model, batch: ProbeBatch, recipe: Recipe
) -> Recipe:
    """The same probe with left padding: the recipe must not change, except that an inline
    loss may drop the targets the mask hides (then followed at every call)."""
    if "attention_mask" not in inspect.signature(original).parameters:
        return recipe
    try:
        padded = _probe_once(name, interceptor, original, model, batch.left_padded())
    except _StockForwardFails:
        if recipe.route == ROUTE_INLINE:  # which targets its mask drops cannot be established
            raise
        # Its own forward cannot take such a mask at all; loss_function receives the labels,
        # and a reshape of the logits by the mask would show at the call.
        return recipe
    if dataclasses.replace(padded, mask_drops_targets=False) != recipe:
        raise UnsupportedModelError(
            name, f"its forward scores labels differently with an attention_mask: {recipe} vs {padded}"
        )
    return padded


@contextlib.contextmanager
def _isolated(model) -> Iterator[None]:
    """Run the probe under autograd (whatever the caller's grad or inference mode), leaving
    the training flags of the model's modules and every random generator it may draw from
    (the CPU's, and those of the devices its tensors are on) as they were."""
    devices: dict[str, set[int]] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        device = tensor.device
        if device.type not in ("cpu", "meta"):
            module = torch.get_device_module(device.type)
            devices.setdefault(device.type, set()).add(
                device.index if device.index is not None else module.current_device()
            )
    training_flags = [(module, module.training) for module in model.modules()]  # a frozen tower may be in eval
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[]))  # the CPU generator
        for device_type, indices in devices.items():
            stack.enter_context(torch.random.fork_rng(devices=sorted(indices), device_type=device_type))
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad())
        try:
            yield
        finally:
            for module, training in training_flags:
                module.training = training


def probe(interceptor: Interceptor, original, model) -> Recipe:
    """How this instance's forward scores labels, in training and in eval mode (a forward
    may add terms in one only); raises ``UnsupportedModelError``."""
    name = type(model).__name__
    check_model(name, model, interceptor.head)
    with _isolated(model):
        batch = _probe_inputs(model, head_parts(interceptor.head).linear.out_features)
        recipes = []
        for training in (True, False):
            model.train(training)
            recipes.append(_probe_once(name, interceptor, original, model, batch))
        if recipes[0] != recipes[1]:
            raise UnsupportedModelError(name, f"its forward scores labels differently in training and eval: {recipes}")
        recipe = recipes[0]  # the model is in eval mode for the rest
        recipe = _probe_attention_mask(name, interceptor, original, model, batch, recipe)
        if recipe.route == ROUTE_LOSS_FUNCTION:
            recipe = _probe_vocabulary(name, interceptor, original, model, batch, recipe)
    return dataclasses.replace(
        recipe, config_reads=_config_reads(model.config, recipe), module_reads=_module_reads(model, recipe)
    )
