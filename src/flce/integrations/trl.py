"""TRL's SFT, GRPO and DPO trainers with flce's kernels behind their fused LM head.

TRL (1.x) gives the models of its trainers a fused LM head (``trl.trainer.utils.
add_fused_lm_head``): ``model(..., labels=labels, fused_lm_head=True)`` runs the backbone,
keeps the hidden states of the labelled positions and hands them, with the head's weight
and bias, to one kernel (``ChunkedLogProbFunction.apply``) that returns per-token
log-probabilities and, as each trainer asks, the entropy, ``log(sum_v p_v^2)``, the mean
logit and whether the label is the top-1 token. The trainers' losses and metrics read only
those (and the ``loss`` TRL forms from them).

``enable_flce(trainer)`` keeps TRL's forward and swaps that kernel for ``FlceLogProbKernel``
on the trainer's model (and its reference model) only: the instance gets a copy of TRL's
forward function whose globals name flce's kernel instead of TRL's. Nothing global is
patched, other models keep TRL's head, and everything around the kernel (label shift, masks,
``num_items_in_batch``, MoE auxiliary losses, PEFT, device placement) stays TRL's own code.
The quantities come from flce's public functions, none materialises the logits:

- ``log_probs`` and ``entropy`` (differentiable): ``flce.fused_linear_logprobs`` with
  ``return_entropy``, TRL's ``temperature`` divided by the model's logit scale;
- ``is_top1`` (a metric): the predicted tokens of the same ``fused_linear_logprobs`` call
  (``return_predicted_tokens``: the first maximum of the scaled logits, from the same pass
  over them; no second GEMM);
- ``mean_logits`` (a metric): the mean over the vocabulary of a linear map is the map of the
  weight's mean row, ``(x . mean_v W_v + mean_v b_v) * scale / T``, exact in fp32;
- ``log_sum_sq_probs`` (DPO's WPO weights, no gradient): ``log sum_v p_v^2 = lse(2z) -
  2 lse(z) = 2 log p_m(T) - log p_m(T / 2)`` for any token m, taken for the top token
  (the predicted tokens of the first call), whose log-probabilities lie in ``[-log V, 0]``
  (from the label they could be hundreds of nats, and their difference would cancel): two
  more logprobs forwards, at the temperature and at half of it.

Logit soft-capping (Gemma 2/3) is refused: flce's logprobs head has none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from typing import Any

import torch

from flce.integrations.forward_wrappers import wrapper_chain

# The trainers whose use of the fused head is checked against TRL's own head
# (tests/integrations/test_trl.py); other TRL trainers are refused.
SUPPORTED_TRAINERS = ("SFTTrainer", "GRPOTrainer", "DPOTrainer")

# The names TRL's fused forward looks up in its module's globals that flce replaces.
KERNEL_NAME = "_ChunkedLogProbFunction"
COMPACT_RULE_NAME = "_use_triton"

# Per-token outputs TRL's kernel can be asked for (``outputs``), all of which flce provides.
KNOWN_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


class UnsupportedTrlSetupError(Exception):
    """The trainer or its model cannot get flce's head; the message says why."""


@dataclasses.dataclass(frozen=True)
class TrlHeadOptions:
    """The options ``enable_flce`` takes for a TRL trainer (the rest is TRL's to decide:
    temperature, which outputs, the loss): flce's ``backend`` and ``chunk_size`` (rows per
    chunk), validated as ``flce.LogprobsOptions`` validates them, and a named backend
    checked to have logprobs kernels (rather than at the first training step)."""

    backend: str | None = None
    chunk_size: int | None = None

    def __post_init__(self) -> None:
        import flce
        from flce.dispatch import AUTO, BACKEND_NAMES, get_backend

        checked = flce.LogprobsOptions(backend=self.backend, chunk_size=self.chunk_size)
        if checked.backend not in (None, AUTO) and get_backend(checked.backend).logprobs is None:
            having = [name for name in BACKEND_NAMES if get_backend(name).logprobs is not None]
            raise ValueError(
                f"backend {checked.backend!r} has no logprobs kernels, which TRL's fused head runs on; pass backend= "
                f"one of {having}, or None for the best one usable"
            )
        object.__setattr__(self, "backend", checked.backend)
        object.__setattr__(self, "chunk_size", checked.chunk_size)

    @classmethod
    def from_kwargs(cls, loss_options: dict[str, Any]) -> TrlHeadOptions:
        accepted = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(loss_options) - accepted)
        if unknown:
            raise TypeError(
                f"enable_flce on a TRL trainer takes only {sorted(accepted)}, got {unknown}: TRL's trainer decides "
                "the loss, the temperature and the per-token outputs"
            )
        return cls(**loss_options)


def _flce():
    import flce  # late: always the current functions

    return flce


def _head_operands(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, contextlib.AbstractContextManager]:
    """The weight and bias flce takes with ``hidden`` and the context to call it in. TRL's
    kernel projects in the hidden states' dtype (the autocast dtype under autocast) whatever
    the head's dtypes, and accumulates the head's gradients in fp32; flce takes one dtype
    outside autocast:

    - under autocast, or with every dtype the hidden states': as they are;
    - 16-bit hidden states under a head kept in another dtype (an fp32 head, or bias, on a
      bf16 backbone): under autocast to the hidden states' dtype, which computes in it and
      gives each parameter its gradient in its own dtype (a cast of an fp32 weight to bf16
      would round its gradient to bf16);
    - fp32 hidden states under a 16-bit head (``cast_lm_head_to_fp32`` projects in fp32):
      the head cast to fp32, differentiably, so the head gets its gradient."""
    same_dtype = weight.dtype == hidden.dtype and (bias is None or bias.dtype == hidden.dtype)
    if torch.is_autocast_enabled(hidden.device.type) or same_dtype:
        return weight, bias, contextlib.nullcontext()
    if hidden.dtype in (torch.float16, torch.bfloat16):
        return weight, bias, torch.autocast(hidden.device.type, dtype=hidden.dtype)
    return weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype), contextlib.nullcontext()


class FlceLogProbKernel:
    """Stands in for TRL's ``ChunkedLogProbFunction`` inside TRL's fused forward: the same
    ``apply`` arguments and the same five results, computed by flce."""

    def __init__(self, options: TrlHeadOptions):
        self.options = options

    def apply(
        self,
        hidden: torch.Tensor,  # (N, H): the labelled positions only
        weight: torch.Tensor,  # (V, H)
        bias: torch.Tensor | None,  # (V,)
        targets: torch.Tensor,  # (N,) in [0, V)
        temperature: float,
        chunk_size: int,  # TRL's vocabulary tile width; flce sizes its own chunks
        final_logit_softcapping: float | None,
        logit_scale: float,
        outputs: tuple[str, ...],
    ) -> tuple[torch.Tensor, ...]:
        _check_head_transform(final_logit_softcapping, logit_scale)
        _check_outputs(outputs)
        flce = _flce()
        weight, bias, precision = _head_operands(hidden, weight, bias)
        # z * scale / T == z / (T / scale): the model's logit scale folds into the temperature.
        effective_temperature = temperature / logit_scale
        head = {"backend": self.options.backend, "chunk_size": self.options.chunk_size}
        with precision:
            result = flce.fused_linear_logprobs(
                hidden,
                weight,
                targets,
                bias=bias,
                temperature=effective_temperature,
                return_entropy="entropy" in outputs,
                return_predicted_tokens="is_top1" in outputs or "log_sum_sq_probs" in outputs,
                **head,
            )
            with torch.no_grad():
                hidden, weight = hidden.detach(), weight.detach()
                bias = None if bias is None else bias.detach()
                log_sum_sq_probs = mean_logits = is_top1 = None
                if "log_sum_sq_probs" in outputs:
                    # From the top token, whose log-probabilities lie in [-log V, 0] at both
                    # temperatures: from the label they can be hundreds of nats, and their
                    # difference would keep only the digits their rounding left.
                    top = result.predicted_tokens
                    at_temperature, at_half = (
                        flce.fused_linear_logprobs(hidden, weight, top, bias=bias, temperature=t, **head).logprobs
                        for t in (effective_temperature, effective_temperature / 2)
                    )
                    log_sum_sq_probs = 2 * at_temperature - at_half
                if "mean_logits" in outputs:
                    with torch.autocast(hidden.device.type, enabled=False):  # an fp32 matrix-vector product
                        mean_row = weight.mean(0, dtype=torch.float32)  # (H,), no fp32 copy of W
                        mean_logits = hidden.float() @ mean_row
                    if bias is not None:
                        mean_logits = mean_logits + bias.mean(dtype=torch.float32)
                    mean_logits = mean_logits / effective_temperature
                if "is_top1" in outputs:
                    # The first maximum of the scaled logits, as TRL's is_top1 takes it.
                    is_top1 = result.predicted_tokens == targets
        return result.logprobs, result.entropy, log_sum_sq_probs, mean_logits, is_top1


def _check_outputs(outputs: tuple[str, ...]) -> None:
    unknown = sorted(set(outputs) - set(KNOWN_OUTPUTS))
    if unknown:
        raise UnsupportedTrlSetupError(
            f"TRL asks its fused head for {unknown}, which flce does not compute (it computes {list(KNOWN_OUTPUTS)}): "
            "use the trainer without enable_flce"
        )


def _check_head_transform(final_logit_softcapping: float | None, logit_scale: float | None) -> None:
    if final_logit_softcapping is not None:
        raise UnsupportedTrlSetupError(
            f"the model soft-caps its logits (final_logit_softcapping={final_logit_softcapping}); flce's logprobs "
            "head has no soft-cap: use the trainer without enable_flce"
        )
    if logit_scale is not None and not logit_scale > 0:
        raise UnsupportedTrlSetupError(
            f"the model scales its logits by {logit_scale}; flce folds the scale into the temperature, which needs "
            "a positive scale"
        )


def _compact_rows(device: torch.device) -> bool:
    """TRL's rule for scoring only the labelled rows (its Triton devices; every row elsewhere,
    to keep shapes static for compilers such as Neuron's). flce's kernels take any number of
    rows, so the labelled rows only, on every device."""
    return True


@functools.cache
def _fused_forward_code() -> types.CodeType:
    """The code of the forward ``add_fused_lm_head`` gives a model, checked to look its kernel up by name."""
    from trl.trainer import utils

    codes = [
        const
        for const in utils.add_fused_lm_head.__code__.co_consts
        if isinstance(const, types.CodeType) and const.co_name == "_fused_forward"
    ]
    if len(codes) != 1 or not {KERNEL_NAME, COMPACT_RULE_NAME} <= set(codes[0].co_names):
        import trl

        raise UnsupportedTrlSetupError(
            f"TRL {trl.__version__}'s add_fused_lm_head no longer calls {KERNEL_NAME} from a _fused_forward; flce "
            "swaps that kernel and was checked with TRL 1.16"
        )
    return codes[0]


def _is_fused_forward(function) -> bool:
    """TRL's fused forward, or a copy ``swap_fused_head_kernel`` made (equal code, its own object)."""
    return isinstance(function, types.FunctionType) and function.__code__ == _fused_forward_code()


def _wrapper_chain(forward) -> list:
    """``forward`` and what it wraps, outermost first, down to TRL's fused forward function
    when there is one: accelerate's mixed-precision wrappers (which ``prepare_model`` puts on
    a reference model while the trainer is built) leave ``__wrapped__`` links, as
    ``functools.wraps`` does."""
    return wrapper_chain(forward, _is_fused_forward)


def _fused_forward_function(owner: torch.nn.Module) -> types.FunctionType | None:
    chain = _wrapper_chain(owner.__dict__.get("forward"))
    return chain[-1] if chain and _is_fused_forward(chain[-1]) else None


def fused_head_owner(model: torch.nn.Module, label: str = "model") -> torch.nn.Module:
    """The transformers model inside ``model`` (PEFT, compiled, DDP) that carries TRL's fused
    head, checked to be one flce can run."""
    from flce.integrations.transformers.install import unwrap_model

    owner = unwrap_model(model)
    fused = _fused_forward_function(owner)
    if fused is None:
        raise UnsupportedTrlSetupError(
            f"the trainer's {label} ({type(owner).__name__}) has no TRL fused LM head (add_fused_lm_head): "
            "call enable_flce on the trainer TRL built, before training"
        )
    # The head's transform, as TRL read it from the config when it added the head, and the
    # outputs the trainer asked of it: checked now rather than at the first forward.
    settings = dict(zip(fused.__code__.co_freevars, (cell.cell_contents for cell in fused.__closure__), strict=True))
    _check_head_transform(settings.get("final_logit_softcapping"), settings.get("logit_scale"))
    _check_outputs(tuple(settings.get("outputs", ())))
    return owner


def _replace_references(wrapper, old, new) -> None:
    """Point ``wrapper``'s closure cells and attributes that hold ``old`` at ``new``."""
    for cell in getattr(wrapper, "__closure__", None) or ():
        if cell.cell_contents is old:
            cell.cell_contents = new
    for name, value in list(getattr(wrapper, "__dict__", {}).items()):
        if value is old:
            setattr(wrapper, name, new)


def swap_fused_head_kernel(owner: torch.nn.Module, kernel) -> None:
    """Give ``owner`` (a model with TRL's fused head) TRL's forward with ``kernel`` (an object
    with ``ChunkedLogProbFunction.apply``'s signature, e.g. ``FlceLogProbKernel``) in place of
    TRL's kernel: a copy of TRL's forward function whose globals name ``kernel``, put where
    the instance's forward (or the wrappers around it) held TRL's. Calling it again replaces
    the kernel."""
    chain = _wrapper_chain(owner.__dict__.get("forward"))
    fused = chain[-1]
    names = {**fused.__globals__, KERNEL_NAME: kernel, COMPACT_RULE_NAME: _compact_rows}
    # A code object of its own: torch.compile caches what it compiles per code object and
    # puts the compiled functions in the frame's globals, so a copy sharing TRL's code would
    # run, on another model, code compiled against these globals (or the reverse).
    code = fused.__code__.replace()
    forward = types.FunctionType(code, names, fused.__name__, fused.__defaults__, fused.__closure__)
    forward.__kwdefaults__ = fused.__kwdefaults__
    forward.__dict__.update(fused.__dict__)  # __wrapped__: generate validates kwargs against the model's signature
    forward.__qualname__, forward.__doc__ = fused.__qualname__, fused.__doc__
    if len(chain) == 1:
        owner.forward = types.MethodType(forward, owner)
        return
    for wrapper in chain[:-1]:
        _replace_references(wrapper, fused, forward)
    original = owner.__dict__.get("_original_forward")  # what accelerate restores when it unwraps the model
    if getattr(original, "__func__", None) is fused:
        owner._original_forward = types.MethodType(forward, owner)
    if _fused_forward_function(owner) is not forward:
        raise UnsupportedTrlSetupError(
            f"the forward of {type(owner).__name__} wraps TRL's fused head in a way flce cannot see through"
        )


def uses_flce_kernel(model: torch.nn.Module) -> bool:
    """Whether ``model``'s TRL fused head runs flce's kernel."""
    from flce.integrations.transformers.install import unwrap_model

    fused = _fused_forward_function(unwrap_model(model))
    return fused is not None and isinstance(fused.__globals__.get(KERNEL_NAME), FlceLogProbKernel)


def refusal_reason(trl_class: type) -> str | None:
    """Why a trainer whose most derived TRL class is ``trl_class`` is refused, or None."""
    try:
        import trl
    except ImportError:
        return f"it is built on TRL's {trl_class.__name__}, but TRL cannot be imported"
    supported = tuple(getattr(trl, name) for name in SUPPORTED_TRAINERS)
    if trl_class in supported:
        return None
    return (
        f"it is built on TRL's {trl_class.__name__}, whose use of TRL's fused LM head (model(..., "
        f"fused_lm_head=True)) flce has not been checked against; enable_flce swaps flce into that head for "
        f"{', '.join(SUPPORTED_TRAINERS)} only: use the trainer without enable_flce"
    )


def _partitions_the_head(trainer, owners) -> bool:
    """DeepSpeed ZeRO-3: configured on the trainer's accelerator, or already partitioning a
    head's weight (a ZeRO-3 parameter carries ``ds_id``)."""
    state = getattr(getattr(trainer, "accelerator", None), "state", None)
    if getattr(getattr(state, "deepspeed_plugin", None), "zero_stage", None) == 3:
        return True
    heads = (owner.get_output_embeddings() for owner in owners)
    return any(head is not None and hasattr(head.weight, "ds_id") for head in heads)


def enable_on_trl_trainer(trainer, trl_class: type, loss_options: dict[str, Any]):
    """``enable_flce`` for a trainer built on TRL (``trl_class``: its most derived TRL class)."""
    reason = refusal_reason(trl_class)
    if reason is not None:
        raise NotImplementedError(f"{type(trainer).__name__}: {reason}")
    options = TrlHeadOptions.from_kwargs(loss_options)
    if getattr(trainer, "model", None) is None:
        raise ValueError("the trainer has no model yet (model_init); call enable_flce after the model exists")
    models = {"model": trainer.model}
    if getattr(trainer, "ref_model", None) is not None:
        models["ref_model"] = trainer.ref_model
    owners = [fused_head_owner(model, label) for label, model in models.items()]  # all checked before any swap
    if _partitions_the_head(trainer, owners):
        raise UnsupportedTrlSetupError(
            f"{type(trainer).__name__}: DeepSpeed ZeRO-3 partitions the LM head's weight outside TRL's gather "
            "context, and flce's backward reads the whole weight (dX = G W, and the logits it recomputes), which "
            "would give the backbone wrong gradients; use ZeRO-1/2 or FSDP, or TRL's own kernel"
        )
    for owner in owners:
        swap_fused_head_kernel(owner, FlceLogProbKernel(options))
    return trainer
