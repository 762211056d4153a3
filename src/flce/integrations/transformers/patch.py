"""The patched forward: the model's own forward, with the head and the loss intercepted.

A patched model runs its own ``forward`` (its decoder, vision tower, router, aux losses and
output type are all its own). Two things are intercepted on the instance
(``Interceptor.install``):

- the head (``model.get_output_embeddings()``), by a forward pre-hook that keeps its input
  (the hidden states at the scored positions) and hands the head an empty batch instead, and
  a forward hook that returns a placeholder ``(..., K)`` tensor holding ``PLACEHOLDER_POINTS``
  in place of the ``(..., V)`` logits;
- ``model.loss_function``, whose call receives the placeholder after the model's own logit
  post-processing (a scale such as Cohere's ``logit_scale`` or Granite's
  ``1 / logits_scaling``, Gemma's soft-cap) and the labels exactly as the stock loss would,
  and returns flce's loss on the kept hidden states instead. A scale is read from the
  processed placeholder (the value at the point 1.0), so a learnable scale gets its gradient.

Whether this reproduces a model's loss is established once per instance by ``probe.py``
(``attach`` installs the interceptor and probes; a failure uninstalls it and raises
``UnsupportedModelError``), and again when a config entry or module attribute it depends on
changes
(``interceptor_for``). Models that compute their cross-entropy inline instead (BART-style
decoders, route ``inline``) are called without labels, flce adding the loss with the label
convention the probe found (shifted or not, the targets their ``attention_mask`` hides
dropped or not). A forward that keeps only the first logits (a padded vocabulary) is scored
over those rows of the weight.

Without labels nothing is intercepted (``generate`` is the stock one). With labels the
logits are not computed unless asked for (``skip_logits=False``); then they are the model's
own and the loss is ``flce.cross_entropy`` on them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import torch

from flce.integrations.transformers.errors import UnsupportedModelError
from flce.integrations.transformers.head import (
    UnsupportedHeadError,
    bypassed_hooks,
    head_parts,
    hooked_modules,
    linear_terms,
    loaded_weights,
    per_row_adapter_argument,
)
from flce.integrations.transformers.probe import (
    PLACEHOLDER_POINTS,
    ROUTE_INLINE,
    SUPPORTED_DTYPES,
    Recipe,
    known_loss_functions,
    masked_labels,
    probe,
    scale_before_softcap,
    shifted_labels,
    vocabulary_points,
)
from flce.options import check_class_weight

INTERCEPTOR_ATTRIBUTE = "_flce_interceptor"


# --------------------------------------------------------------------------- options


def _flce():
    import flce  # late: always the current functions (tests replace them)

    return flce


# Options flce's loss takes that the integration decides itself, with the reason.
REJECTED_OPTIONS = {
    "reduction": "the integration uses 'mean', or 'sum' divided by num_items_in_batch when the Trainer passes it",
    "softcap": "the model's own logit soft-capping (final_logit_softcapping) is applied as its forward does",
    "return_z_loss": "the model's output has no field for the extra values",
    "return_token_accuracy": "the model's output has no field for the extra values",
    "return_predicted_tokens": "the model's output has no field for the extra values",
}


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """The user's loss options, validated once (by ``flce.LossOptions``) at patch time."""

    options: Any  # flce.LossOptions
    ce_weight: torch.Tensor | None = None
    # The keyword arguments of the public functions, built here once (not in the traced
    # forward): ``fused_kwargs`` / ``logits_kwargs``.
    fused: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)
    logits: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        targets = (("fused", "fused_linear_cross_entropy", "ce_weight"), ("logits", "cross_entropy", "weight"))
        for name, function, weight in targets:
            keywords = {weight: self.ce_weight, **{n: getattr(self.options, n) for n in _user_option_names(function)}}
            object.__setattr__(self, name, keywords)

    @staticmethod
    def from_kwargs(loss_options: dict[str, Any]) -> LossSettings:
        flce = _flce()
        known = {field.name for field in dataclasses.fields(flce.LossOptions)} | {"ce_weight"}
        for key in loss_options:
            if key in REJECTED_OPTIONS:
                raise ValueError(
                    f"loss option {key!r} is not supported by the transformers integration: {REJECTED_OPTIONS[key]}"
                )
            if key not in known:
                allowed = sorted(known - set(REJECTED_OPTIONS))
                raise TypeError(f"unknown loss option {key!r}; expected one of {allowed}")
        options = dict(loss_options)
        ce_weight = options.pop("ce_weight", None)
        # What can be known before the vocabulary (a dense, floating-point, 1-D tensor of finite,
        # non-negative weights), checked as the loss modules check theirs when built; the
        # shape is checked against the model's logits at the call (``Interceptor.class_weights``).
        check_class_weight("ce_weight", ce_weight)
        return LossSettings(flce.LossOptions(**options), ce_weight)

    def fused_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``flce.fused_linear_cross_entropy`` the user's options
        give (the model decides the others per call: ``PER_CALL_OPTIONS``)."""
        return self.fused

    def logits_kwargs(self) -> dict[str, Any]:
        """The same for ``flce.cross_entropy`` (on logits the model materialized)."""
        return self.logits


# Options the model decides per call (the label shift's ignore_index, the Trainer's
# reduction, its own soft-capping), besides those the integration refuses.
PER_CALL_OPTIONS = ("ignore_index", "reduction", "softcap", *REJECTED_OPTIONS)


@functools.cache
def _user_option_names(function: str) -> tuple[str, ...]:
    """The ``LossOptions`` fields that flce's public ``function`` takes as keywords, less
    ``PER_CALL_OPTIONS``: derived from the signature, not spelled out again."""
    from flce import functional

    flce = _flce()
    parameters = inspect.signature(getattr(functional, function)).parameters
    fields = [f.name for f in dataclasses.fields(flce.LossOptions)]
    return tuple(name for name in fields if name in parameters and name not in PER_CALL_OPTIONS)


# --------------------------------------------------------------------------- interceptor


def _argument(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


class _HeadInputHook:
    """Forward pre-hook of the head: keep its input, hand it an empty batch."""

    def __init__(self, interceptor: Interceptor):
        self.interceptor = interceptor

    def __call__(self, module, args):
        it = self.interceptor
        if not it.intercepts_head():
            return None
        if len(args) != 1 or not isinstance(args[0], torch.Tensor):
            raise RuntimeError(
                f"flce: the head {type(module).__name__} was called with {len(args)} positional arguments; "
                "expected the hidden states alone"
            )
        hidden = args[0]
        it.head_calls += 1
        it.hidden = hidden
        return (hidden.new_empty((0, hidden.shape[-1])),)


class _HeadOutputHook:
    """Forward hook of the head: the placeholder instead of its (empty) output."""

    def __init__(self, interceptor: Interceptor):
        self.interceptor = interceptor

    def __call__(self, module, args, output):
        it = self.interceptor
        if not it.intercepts_head():
            return None
        positions = it.hidden.shape[:-1]
        if it.mode == "probe_logits":  # known logits, for a forward that computes its cross-entropy itself
            generator = torch.Generator().manual_seed(0)
            # On the generator's device, whatever default device the caller set.
            logits = 3.0 * torch.randn((*positions, output.shape[-1]), generator=generator, device="cpu")
            it.placeholder = logits.to(output.device).requires_grad_()
            return it.placeholder
        if it.mode == "probe_vocab":  # as wide as the vocabulary: what the forward does to particular columns shows
            points = vocabulary_points(output.shape[-1]).to(output.device)
        else:
            points = torch.tensor(PLACEHOLDER_POINTS, dtype=torch.float32, device=output.device)
        placeholder = points.expand(*positions, points.shape[0]).contiguous()
        if it.mode == "probe":
            placeholder.requires_grad_()
        it.placeholder = placeholder
        return placeholder


class Interceptor:
    """Installed on one model instance: the head's hooks and the model's ``loss_function``.

    Passive (``mode`` None) outside the patched forward: the hooks do nothing and the loss
    function is the model's own. The patched forward sets ``mode`` for one call:
    ``"fused"`` (placeholder logits, flce's fused loss on the kept hidden states) or
    ``"logits"`` (real logits, ``flce.cross_entropy`` on them); the probe uses ``"probe"``,
    ``"probe_vocab"`` (a placeholder as wide as the vocabulary), ``"probe_logits"`` (known
    logits) and ``"probe_unlabelled"`` (the inline route's call without labels).
    """

    def __init__(self, head: torch.nn.Module, loss_function, settings: LossSettings):
        self.head = head
        self.original_loss_function = loss_function
        self.shift_of_loss_function = known_loss_functions().get(loss_function)  # None: not one flce reproduces
        self.settings = settings
        self.recipe: Recipe | None = None
        self.mode: str | None = None
        self.hidden: torch.Tensor | None = None
        self.placeholder: torch.Tensor | None = None
        self.head_calls = 0
        self.loss_calls: list[tuple[torch.Tensor, torch.Tensor]] = []  # probe: (logits received, result leaf)
        self.handles: list[Any] = []
        self.previous_loss_function = None
        self.loss_type = None  # the model's loss_type when installed: the stock loss_function follows it

    # -- installation

    def install(self, model: torch.nn.Module) -> None:
        self.handles = [
            self.head.register_forward_pre_hook(_HeadInputHook(self)),
            self.head.register_forward_hook(_HeadOutputHook(self)),
        ]
        self.previous_loss_function = model.__dict__.get("_loss_function")
        self.loss_type = getattr(model, "loss_type", None)
        model._loss_function = self  # the `loss_function` property returns it
        setattr(model, INTERCEPTOR_ATTRIBUTE, self)

    def bypassed_hooks(self) -> list[str]:
        """The head's hooks a fused call would skip (``head.bypassed_hooks``)."""
        own = frozenset(handle.id for handle in self.handles)
        return bypassed_hooks(self.head, own, self.handles[0].id)

    def owns_loss_function(self, model: torch.nn.Module) -> bool:
        """Whether the model's ``loss_function`` is still this interceptor over the function
        the model had when it was installed: not replaced since (``model.loss_function = f``),
        nor its ``loss_type`` changed (which picks the stock function)."""
        return model.__dict__.get("_loss_function") is self and getattr(model, "loss_type", None) == self.loss_type

    def uninstall(self, model: torch.nn.Module) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if model.__dict__.get("_loss_function") is self:
            if self.previous_loss_function is None:
                del model._loss_function
            else:
                model._loss_function = self.previous_loss_function
        if model.__dict__.get(INTERCEPTOR_ATTRIBUTE) is self:
            delattr(model, INTERCEPTOR_ATTRIBUTE)

    # -- per call

    def intercepts_head(self) -> bool:
        return self.mode in ("fused", "probe", "probe_vocab", "probe_logits", "probe_unlabelled")

    def begin(self, mode: str) -> None:
        self.mode = mode
        self.hidden = None
        self.placeholder = None
        self.head_calls = 0
        self.loss_calls = []

    def end(self) -> None:
        self.mode = None
        self.hidden = None
        self.placeholder = None

    # -- the loss function the model calls

    def __call__(self, *args, **kwargs):
        """``loss_function(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
        shift_labels=None, **kwargs)``, as transformers' ``ForCausalLMLoss`` / ``ForMaskedLMLoss``."""
        if self.mode is None:
            return self.original_loss_function(*args, **kwargs)
        logits = _argument(args, kwargs, 0, "logits")
        if self.mode in ("probe_logits", "probe_unlabelled"):  # the inline probe: the model should not get here
            self.loss_calls.append((logits, None))
            return self.original_loss_function(*args, **kwargs)
        if self.mode in ("probe", "probe_vocab"):
            result = torch.zeros((), device=logits.device, requires_grad=True)
            self.loss_calls.append((logits, result))
            return result * 1.0  # not a leaf: the model may add to it in place
        labels = _argument(args, kwargs, 1, "labels")
        num_items_in_batch = _argument(args, kwargs, 3, "num_items_in_batch")
        ignore_index = _argument(args, kwargs, 4, "ignore_index", self.settings.options.ignore_index)
        shift_labels = kwargs.get("shift_labels") if self.shift_of_loss_function else None
        if shift_labels is None:
            targets = shifted_labels(labels, ignore_index) if self.shift_of_loss_function else labels
        else:
            targets = shift_labels
        return self.loss(logits, targets, ignore_index, num_items_in_batch)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, num_items_in_batch) -> torch.Tensor:
        """Mean over the non-ignored targets, or the sum divided by ``num_items_in_batch``
        (the Trainer's count over the accumulated micro-batches), as transformers."""
        reduction = "mean" if num_items_in_batch is None else "sum"
        if self.mode == "logits":
            loss = self._logits_loss(logits, targets, ignore_index, reduction)
        else:
            loss = self._fused_loss(logits, targets, ignore_index, reduction)
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss

    def class_weights(self, keywords: dict[str, Any], name: str, classes: int) -> dict[str, Any]:
        """``keywords`` with the user's class weights (``keywords[name]``, given as ``ce_weight``)
        for the ``classes`` logits the loss scores: as given, or cut to the first ``classes``
        where they are one per row of the head and the forward keeps the first ``classes``
        logits (a padded vocabulary). Any other length is refused naming ``ce_weight``: cut
        silently, weights for another vocabulary would score every class with a wrong weight."""
        weights = keywords.get(name)
        if weights is None or weights.shape == (classes,):
            return keywords
        head_rows = head_parts(self.head).linear.out_features
        kept = self.recipe.vocab_rows == classes
        if kept and weights.shape == (head_rows,):
            return {**keywords, name: weights[:classes]}
        padded = f" or ({head_rows},), one per row of its head (its forward keeps the first {classes})" if kept else ""
        raise ValueError(
            f"ce_weight must have shape ({classes},), one weight per class the model's logits score{padded}, "
            f"got {tuple(weights.shape)}"
        )

    def _logits_loss(self, logits, targets, ignore_index, reduction) -> torch.Tensor:
        logits_2d = logits.reshape(-1, logits.shape[-1])
        _check_target_count(targets, logits_2d.shape[0])
        return _flce().cross_entropy(
            logits_2d,
            targets.reshape(-1).to(logits.device),
            ignore_index=ignore_index,
            reduction=reduction,
            **self.class_weights(self.settings.logits_kwargs(), "weight", logits_2d.shape[-1]),
        )

    def _fused_loss(self, placeholder, targets, ignore_index, reduction) -> torch.Tensor:
        hidden = self.hidden
        if hidden is None or self.head_calls != 1:
            raise RuntimeError(
                f"flce: the head was called {self.head_calls} times before the loss (expected once); "
                "the model's forward changed since it was probed"
            )
        if placeholder.shape != (*hidden.shape[:-1], len(PLACEHOLDER_POINTS)):
            raise RuntimeError(
                f"flce: the loss received logits of shape {tuple(placeholder.shape)} for hidden states of shape "
                f"{tuple(hidden.shape)}; the model's forward changed since it was probed"
            )
        parts = head_parts(self.head)
        hooked = hooked_modules(parts)
        if not hooked:
            return self._fused_from_parts(parts, hidden, placeholder, targets, ignore_index, reduction)
        with loaded_weights(hooked):
            return self._fused_from_parts(parts, hidden, placeholder, targets, ignore_index, reduction)

    def _fused_from_parts(self, parts, hidden, placeholder, targets, ignore_index, reduction) -> torch.Tensor:
        device = parts.linear.weight.device
        terms = linear_terms(parts, hidden.to(device))
        features, weight, bias = terms.input, terms.weight, terms.bias
        if weight.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"flce: the head's weight is {weight.dtype} (the model was cast after patching); flce's kernels take "
                "float16, bfloat16 or float32"
            )
        if self.recipe.scale:  # g(z) = a * z: fold a (the processed point 1.0) into the input, differentiably
            # In fp32, rounded once to the input's dtype: a bf16 copy of a (0.3 -> 0.30078125) would
            # bias every logit by the same relative error, which the stock model's rounding does not.
            scale = placeholder[..., :1].to(device=device, dtype=torch.float32)
            if self.recipe.softcap is not None:  # g(z) = c * tanh(a * z / c): a from g(1)
                scale = scale_before_softcap(scale, self.recipe.softcap)
            features = (features.float() * scale).to(features.dtype)
        vocab_rows = self.recipe.vocab_rows
        if vocab_rows is not None:  # the forward keeps the first vocab_rows logits: a padded vocabulary
            weight = weight[:vocab_rows]
            bias = None if bias is None else bias[:vocab_rows]
        rows = features.shape[:-1].numel()
        _check_target_count(targets, rows)
        return _flce().fused_linear_cross_entropy(
            features.reshape(rows, features.shape[-1]),
            weight,
            targets.reshape(-1).to(device),
            bias=bias,
            ignore_index=ignore_index,
            reduction=reduction,
            softcap=self.recipe.softcap,
            **self.class_weights(self.settings.fused_kwargs(), "ce_weight", weight.shape[0]),
        )

    # -- one patched call

    def run(self, call: ForwardCall, model, args: tuple, kwargs: dict, materialize: bool):
        """The model's own forward with the head and loss intercepted; its own output type,
        ``logits`` None unless ``materialize``."""
        recipe = self.recipe
        if not materialize and not torch.compiler.is_compiling():
            adapter_argument = per_row_adapter_argument(self.head)
            if adapter_argument is not None:
                raise ValueError(
                    f"flce: {adapter_argument}= (PEFT's per-row adapters) reaches {type(model).__name__}'s head, whose "
                    "fused loss would apply the head's active adapters to every row; pass skip_logits=False to score "
                    f"the model's own logits, or call without {adapter_argument}"
                )
            bypassed = self.bypassed_hooks()
            if bypassed:
                raise RuntimeError(
                    f"flce: {type(model).__name__}'s head carries hooks that its fused loss would skip "
                    f"({'; '.join(bypassed)}): the loss is computed from the head's weights, not its output. Remove "
                    "them, or pass skip_logits=False to score the model's own logits (tensor-parallel heads: "
                    "flce.parallel.vocab_parallel_fused_linear_cross_entropy)"
                )
        kwargs = dict(kwargs)
        return_dict = kwargs.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(model.config, "return_dict", True) is not False
        if call.accepts_return_dict:
            kwargs["return_dict"] = True
        inline_labels = None
        if recipe.route == ROUTE_INLINE:  # the model would score the labels itself: it gets none
            if kwargs.get("shift_labels") is not None:
                raise ValueError(
                    f"{type(model).__name__} computes its own loss without shift_labels; pass labels instead"
                )
            inline_labels, args, kwargs = _without_labels(args, kwargs, call.labels_index)
            if recipe.mask_drops_targets:
                attention_mask = call.attention_mask(args, kwargs)
                if attention_mask is not None:
                    inline_labels = masked_labels(inline_labels, attention_mask, self.settings.options.ignore_index)
        self.begin("logits" if materialize else "fused")
        try:
            output = call.original(model, *args, **kwargs)
            if isinstance(output, tuple):
                raise RuntimeError(
                    f"flce: {type(model).__name__}.forward returned a {type(output).__name__}, not its output "
                    "dataclass; leave config.return_dict at True"
                )
            if recipe.route == ROUTE_INLINE:
                ignore_index = self.settings.options.ignore_index
                targets = shifted_labels(inline_labels, ignore_index) if recipe.shift else inline_labels
                logits = output.logits if materialize else self.placeholder
                positions = logits.shape[:-1].numel()
                _check_inline_positions(type(model).__name__, positions, inline_labels, kwargs.get("logits_to_keep"))
                inline_loss = self.loss(logits, targets, ignore_index, None)
        finally:
            self.end()
        values = {name: getattr(output, name) for name in recipe.output_fields}
        if recipe.route == ROUTE_INLINE:
            values["loss"] = inline_loss
        if not materialize:
            values["logits"] = None
        output = type(output)(**values)
        if return_dict:
            return output
        # The stock tuple's fields are those that are not None; its logits always are, so a
        # None keeps their slot and every later field where the stock tuple has it.
        return tuple(value for name, value in values.items() if value is not None or name == "logits")


def _check_target_count(targets: torch.Tensor, rows: int) -> None:
    if targets.numel() != rows:
        raise ValueError(
            f"the labels give {targets.numel()} targets but the logits have {rows} positions "
            "(with logits_to_keep the labels must match the kept positions, as for the stock loss)"
        )


def _check_inline_positions(name: str, positions: int, labels: torch.Tensor, logits_to_keep) -> None:
    """A model that computes its loss inline is called without labels, flce scoring them
    itself: its forward must give one position per label."""
    if positions == labels.numel():
        return
    if logits_to_keep is not None and not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        _check_target_count(labels, positions)  # the labels must match the kept positions, as for the stock loss
    raise ValueError(
        f"flce: {name} computes its loss inline, so flce calls it without labels and scores them itself, one "
        f"per position, but its forward gave {positions} positions for labels of shape {tuple(labels.shape)}: "
        "it changed the sequence length and would realign the labels inside (e.g. Qwen2-Audio's legacy input "
        "format, one audio token per audio in input_ids, expanded to the audio's frames in the forward); flce "
        "cannot follow that: expand the audio tokens in input_ids beforehand (as the model's processor does), "
        "or call the model without flce (remove_flce)"
    )


def _without_labels(args: tuple, kwargs: dict, labels_index: int | None):
    if "labels" in kwargs:
        labels = kwargs["labels"]
        return labels, args, {**kwargs, "labels": None}
    labels = args[labels_index]
    return labels, (*args[:labels_index], None, *args[labels_index + 1 :]), kwargs


@functools.cache
def _can_return_tuple_code():
    """The code of transformers' ``can_return_tuple`` wrapper, which takes ``return_dict`` off the kwargs."""
    from transformers.utils.generic import can_return_tuple

    return can_return_tuple(lambda self: None).__code__


# --------------------------------------------------------------------------- attaching


def attach(model, settings: LossSettings, call: ForwardCall) -> Interceptor:
    """Install (or re-install) the interceptor on ``model`` and probe it."""
    name = type(model).__name__
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError) as exc:
        raise UnsupportedModelError(name, f"get_output_embeddings() fails: {exc!r}") from exc
    if not isinstance(head, torch.nn.Module):
        raise UnsupportedModelError(name, "it has no output embeddings (get_output_embeddings() is None)")
    try:
        head_parts(head)
    except UnsupportedHeadError as exc:
        raise UnsupportedModelError(name, str(exc)) from exc
    existing = model.__dict__.get(INTERCEPTOR_ATTRIBUTE)
    if existing is not None:
        existing.uninstall(model)
    interceptor = Interceptor(head, model.loss_function, settings)
    interceptor.install(model)
    try:
        interceptor.recipe = probe(interceptor, call.original, model)
    except BaseException:
        interceptor.uninstall(model)
        raise
    return interceptor


def interceptor_for(model, settings: LossSettings, call: ForwardCall) -> Interceptor:
    """The instance's interceptor, attached (and probed) on first use or when its head was
    replaced (``resize_token_embeddings``, PEFT wrapping the head after patching) or its loss
    function (``model.loss_function = f``, ``model.loss_type = ...``)."""
    interceptor = model.__dict__.get(INTERCEPTOR_ATTRIBUTE)
    changed = None
    if (
        interceptor is not None
        and interceptor.head is model.get_output_embeddings()
        and interceptor.owns_loss_function(model)
    ):
        changed = interceptor.recipe.changed_entry(model)
        if changed is None:
            if interceptor.settings is not settings:
                interceptor.settings = settings
            return interceptor
    if torch.compiler.is_compiling():
        if changed is not None:
            raise RuntimeError(
                f"flce: {changed} of {type(model).__name__} changed since it was probed; call it once with labels "
                "outside torch.compile (or apply_flce(model) again) to probe it"
            )
        raise RuntimeError(
            f"flce: {type(model).__name__} has not been probed yet (or its head or loss_function was replaced); call "
            "it once with labels outside torch.compile, or patch the instance with apply_flce(model) before compiling"
        )
    return attach(model, settings, call)


# --------------------------------------------------------------------------- forward

# On a patched forward: the function itself. Wrappers built with functools.wraps (accelerate's
# mixed-precision ones, put around flce's forward by accelerator.prepare) copy its attributes,
# this one included, so a wrapper holding it is told from flce's forward by identity.
FLCE_MARK = "_flce_patched"


@dataclasses.dataclass(frozen=True)
class ForwardCall:
    """The model's own forward and what the patched one needs to know about its signature
    (found once at patch time, so the per-call code is plain attribute reads)."""

    original: Any
    labels_index: int | None  # position of `labels` among the positional arguments after self
    accepts_return_dict: bool
    attention_mask_index: int | None = None  # position of `attention_mask` likewise

    @staticmethod
    def of(original) -> ForwardCall:
        parameters = inspect.signature(original).parameters
        if "labels" not in parameters:
            raise TypeError(f"{original.__qualname__} takes no labels argument")
        positional = [
            name
            for name, p in parameters.items()
            if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        ][1:]  # without self
        labels_index = positional.index("labels") if "labels" in positional else None
        mask_index = positional.index("attention_mask") if "attention_mask" in positional else None
        accepts_return_dict = "return_dict" in parameters or original.__code__ is _can_return_tuple_code()
        return ForwardCall(original, labels_index, accepts_return_dict, mask_index)

    def labels(self, args: tuple, kwargs: dict):
        return _named_argument(args, kwargs, "labels", self.labels_index)

    def attention_mask(self, args: tuple, kwargs: dict):
        return _named_argument(args, kwargs, "attention_mask", self.attention_mask_index)


def _named_argument(args: tuple, kwargs: dict, name: str, index: int | None):
    if name in kwargs or index is None:
        return kwargs.get(name)
    return args[index] if len(args) > index else None


def make_forward(original, settings: LossSettings):
    """The patched forward around the model's own ``original`` forward."""
    call = ForwardCall.of(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        skip_logits = kwargs.pop("skip_logits", None)
        # shift_labels alone: transformers' forwards compute no loss without labels (logits only).
        has_labels = call.labels(args, kwargs) is not None
        if skip_logits is None:
            skip_logits = has_labels
        elif skip_logits and not has_labels:
            raise ValueError("skip_logits=True needs labels")
        if not has_labels:
            return original(self, *args, **kwargs)
        interceptor = interceptor_for(self, settings, call)
        return interceptor.run(call, self, args, kwargs, materialize=not skip_logits)

    # The signature is the model's (the Trainer reads its columns, generate its arguments), but
    # no __wrapped__ link: wrappers that unwrap a forward by those links (accelerate's
    # unwrap_model) stop here instead of dropping the patch.
    del forward.__wrapped__
    forward.__signature__ = inspect.signature(original)
    setattr(forward, FLCE_MARK, forward)
    forward.flce_original_forward = original
    forward.flce_settings = settings
    return forward


def is_flce_forward(fn) -> bool:
    """Whether ``fn`` (or the function of a bound method) is a forward ``make_forward`` made,
    not a wrapper that copied its attributes."""
    function = getattr(fn, "__func__", fn)
    return getattr(function, FLCE_MARK, None) is function


def unwrap_forward(fn):
    """The model's own forward under (possibly several) flce-patched ones."""
    fn = getattr(fn, "__func__", fn)
    while is_flce_forward(fn):
        fn = fn.flce_original_forward
    return fn
