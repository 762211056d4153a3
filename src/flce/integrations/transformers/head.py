"""The LM head as one linear map, so that flce can take its weight instead of its output.

flce computes ``cross_entropy(x_eff @ W_eff.T + b_eff)`` without the logits, so every head
must be written, differentiably, as ``head(x) == x_eff @ W_eff.T + b_eff``:

- ``torch.nn.Linear`` (with its own forward): ``(x, weight, bias)``.
- PEFT LoRA on the head (``peft.tuners.lora.Linear``): the base layer plus, for each active
  adapter, ``scaling * B(A(dropout(x)))``. Each adapter's ``scaling * A(dropout(x))``
  (``(..., r)``) is appended to the input features and its ``B`` (``(V, r)``) to the weight's
  columns, so ``lora_A``, ``lora_B`` and the dropout get exactly their stock gradients
  (dropout included) at the cost of one ``(V, H + r)`` copy of the weight per call.
- PEFT ``modules_to_save`` (``ModulesToSaveWrapper``): the active adapter's copy of the
  head, or the original head when adapters are disabled.
- accelerate hooks (``cpu_offload``, ``device_map`` offloading) on any of these modules:
  ``loaded_weights`` runs each hook's ``pre_forward`` before the weights are read (they are
  on the meta device otherwise) and ``post_forward`` after the loss is computed.

Anything else (quantized layers, DoRA and other LoRA variants, heads with their own
forward) raises ``UnsupportedHeadError`` with the reason; the caller refuses the model.
The walk (``head_parts``) runs on every call, so switching or disabling adapters is seen.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch


class UnsupportedHeadError(Exception):
    """The head is not a linear map flce can take the weight of; the message says why."""


class LowRankUpdate(NamedTuple):
    """One LoRA adapter of the head: adds ``scaling * up(down(dropout(x)))``."""

    down: torch.nn.Module  # lora_A: H -> r
    up: torch.nn.Module  # lora_B: r -> V
    dropout: torch.nn.Module
    scaling: float


class HeadParts(NamedTuple):
    """The modules that make up the head's linear map (see the module docstring)."""

    linear: torch.nn.Linear
    updates: tuple[LowRankUpdate, ...]
    modules: tuple[torch.nn.Module, ...]  # every module of the map (their accelerate hooks load weights)


class LinearTerms(NamedTuple):
    """``head(x) == input @ weight.T + bias``."""

    input: torch.Tensor  # (..., H + sum of ranks)
    weight: torch.Tensor  # (V, H + sum of ranks)
    bias: torch.Tensor | None  # (V,)


def _is_plain_linear(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward


def _is_lora_linear(module: torch.nn.Module) -> bool:
    cls = type(module)
    return cls.__module__.startswith("peft.tuners.lora") and hasattr(module, "lora_A") and hasattr(module, "base_layer")


def _is_modules_to_save(module: torch.nn.Module) -> bool:
    return type(module).__name__ == "ModulesToSaveWrapper" and hasattr(module, "modules_to_save")


def head_parts(head: torch.nn.Module) -> HeadParts:
    """The head as a linear layer plus low-rank updates; raises ``UnsupportedHeadError``."""
    if _is_plain_linear(head):
        if not head.weight.is_floating_point():
            raise UnsupportedHeadError(f"the head's weight has dtype {head.weight.dtype}, not a float dtype")
        return HeadParts(head, (), (head,))
    if _is_modules_to_save(head):
        adapters = list(head.active_adapters)
        if head.disable_adapters or not adapters or any(name not in head.modules_to_save for name in adapters):
            inner = head_parts(head.original_module)
        else:
            inner = head_parts(head.modules_to_save[adapters[0]])
        return HeadParts(inner.linear, inner.updates, (head, *inner.modules))
    if _is_lora_linear(head):
        base = head_parts(head.base_layer)
        if head.disable_adapters or head.merged:  # merged adapters live in the base weight
            return HeadParts(base.linear, base.updates, (head, *base.modules))
        updates, modules = list(base.updates), [head, *base.modules]
        for name in head.active_adapters:
            if name not in head.lora_A:
                continue
            if name in getattr(head, "lora_variant", {}) or getattr(head, "use_dora", {}).get(name, False):
                raise UnsupportedHeadError(
                    f"LoRA adapter {name!r} on the head is a variant (e.g. DoRA) whose output is not "
                    "base + scaling * B(A(x)); only plain LoRA on the head is supported"
                )
            down, up = head.lora_A[name], head.lora_B[name]
            if not (_is_plain_linear(down) and _is_plain_linear(up)) or down.bias is not None or up.bias is not None:
                raise UnsupportedHeadError(f"LoRA adapter {name!r} on the head is not two bias-free linear layers")
            updates.append(LowRankUpdate(down, up, head.lora_dropout[name], float(head.scaling[name])))
            modules += [down, up]
        return HeadParts(base.linear, tuple(updates), tuple(modules))
    raise UnsupportedHeadError(
        f"the head is a {type(head).__module__}.{type(head).__qualname__}, not a torch.nn.Linear (with its own "
        "forward), a PEFT LoRA Linear or a PEFT modules_to_save wrapper; flce needs the head as weight and bias"
    )


def linear_terms(parts: HeadParts, x: torch.Tensor) -> LinearTerms:
    """``(x_eff, W_eff, b_eff)`` with ``head(x) == x_eff @ W_eff.T + b_eff`` (read the
    weights inside ``loaded_weights`` when the head is offloaded)."""
    weight, bias = parts.linear.weight, parts.linear.bias
    if not parts.updates:
        return LinearTerms(x, weight, bias)
    inputs, weights = [x], [weight]
    for update in parts.updates:
        down_input = update.dropout(x.to(update.down.weight.dtype))  # as PEFT casts the input to lora_A's dtype
        inputs.append((update.down(down_input) * update.scaling).to(x.dtype))
        weights.append(update.up.weight.to(weight.dtype))
    return LinearTerms(torch.cat(inputs, dim=-1), torch.cat(weights, dim=1), bias)


# Per-call arguments with which PEFT applies different adapters to different rows of a batch
# (mixed-adapter batches, activated LoRA), injected into the head's forward by pre-hooks.
PER_ROW_ADAPTER_ARGUMENTS = ("adapter_names", "alora_offsets")


def per_row_adapter_argument(head: torch.nn.Module) -> str | None:
    """The name of a per-row adapter argument PEFT injects into the head's modules for the
    current call (``model(..., adapter_names=[...])``), or None. flce's linear map applies the
    head's active adapters to every row, so such a call cannot go through it."""
    for module in head.modules():
        for hook in module._forward_pre_hooks.values():
            keywords = getattr(hook, "keywords", None)  # PEFT registers functools.partial(..., adapter_names=...)
            if isinstance(keywords, dict):
                for name in PER_ROW_ADAPTER_ARGUMENTS:
                    if keywords.get(name) is not None:
                        return name
    return None


# A module's hook tables and what each holds, for the errors that name a hook.
HOOK_TABLES = (
    ("_forward_pre_hooks", "forward pre-hook"),
    ("_forward_hooks", "forward hook"),
    ("_backward_pre_hooks", "backward pre-hook"),
    ("_backward_hooks", "backward hook"),
)


def _is_per_row_adapter_hook(hook) -> bool:
    keywords = getattr(hook, "keywords", None)
    return isinstance(keywords, dict) and any(name in keywords for name in PER_ROW_ADAPTER_ARGUMENTS)


def bypassed_hooks(head: torch.nn.Module, own_hook_ids: frozenset[int], input_hook_id: int) -> list[str]:
    """The hooks on the head and its submodules that its fused loss would skip, described.

    The fused loss takes the head's input from flce's forward pre-hook (``input_hook_id``)
    and its weights directly: the head itself runs on an empty batch. So the head's forward
    pre-hooks registered before flce's still shape that input (hook ids grow with each
    registration), and every other hook (a forward hook that changes the logits, such as a
    tensor-parallel gather, a pre-hook after flce's, a backward hook, any hook of a
    submodule) would not act on the loss. PEFT's per-row adapter pre-hooks are refused on
    their own (``per_row_adapter_argument``)."""
    found = []
    for path, module in head.named_modules():
        for table, kind in HOOK_TABLES:
            for hook_id, hook in getattr(module, table, {}).items():
                shapes_the_input = table == "_forward_pre_hooks" and hook_id < input_hook_id
                if (module is head and (hook_id in own_hook_ids or shapes_the_input)) or _is_per_row_adapter_hook(hook):
                    continue
                name = getattr(hook, "__qualname__", type(hook).__qualname__)
                found.append(f"{kind} {name} on {'the head' if not path else 'the head.' + path}")
    return found


def hooked_modules(parts: HeadParts) -> tuple[torch.nn.Module, ...]:
    """The head's modules that carry an accelerate hook (offloading, device maps)."""
    return tuple(m for m in parts.modules if getattr(m, "_hf_hook", None) is not None)


@contextmanager
def loaded_weights(modules: tuple[torch.nn.Module, ...]) -> Iterator[None]:
    """Run the accelerate hooks of ``modules`` as their forward would: their weights are on
    the execution device inside, and offloaded again after (tensors taken inside stay alive
    for backward, as in the stock forward)."""
    for module in modules:
        module._hf_hook.pre_forward(module)
    try:
        yield
    finally:
        for module in reversed(modules):
            module._hf_hook.post_forward(module, None)
