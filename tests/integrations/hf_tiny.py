"""Tiny random transformers models of any architecture in the auto mappings, built in code
(fp32, CPU, no downloads), and the stock-vs-flce comparison the architecture tests share.

``tiny_config(model_type)`` shrinks the default config of a model type: every size field it
has (under any of the names architectures use) is set from ``SIZES``, sub-configs (text,
vision, audio...) recursively, special token ids are moved inside the small vocabulary and
per-layer lists are cut to the layer count. Architectures whose default config needs more
than this are not special-cased here: their build fails and the test reports why.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

VOCAB = 192
HIDDEN = 32
LAYERS = 2

# Size fields under the names architectures give them, with tiny values that satisfy the
# usual constraints (hidden = heads * head_dim, kv heads dividing heads, experts >= top-k).
SIZES = {
    "vocab_size": VOCAB,
    "vocab_size_per_layer_input": VOCAB,
    "unpadded_vocab_size": VOCAB,
    "hidden_size_per_layer_input": 8,
    "hidden_size": HIDDEN,
    "n_embd": HIDDEN,
    "d_model": HIDDEN,
    "dim": HIDDEN,
    "embed_dim": HIDDEN,
    "word_embed_proj_dim": HIDDEN,
    "intermediate_size": 64,
    "ffn_dim": 64,
    "n_inner": 64,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "num_hidden_layers": LAYERS,
    "n_layer": LAYERS,
    "n_layers": LAYERS,
    "num_layers": LAYERS,
    "encoder_layers": LAYERS,
    "decoder_layers": LAYERS,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 128,
    "n_positions": 128,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "rotary_dim": 8,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "expert_intermediate_size": 16,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "state_size": 8,
    "ssm_state_size": 8,
    "mamba_d_state": 8,
    "time_step_rank": 8,
    "mamba_n_heads": 4,
    "mamba_head_dim": 16,
    "linear_head_dim": 8,
    "linear_num_heads": 4,
    "encoder_hash_byte_group_vocab": 64,
    "num_experts_per_token": 2,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
}
LAYER_LISTS = ("layer_types", "mlp_layer_types", "attn_layer_indices", "layers_block_type")


def _has_plain(config, name: str) -> bool:
    """``config`` has a settable, scalar ``name`` (not a property, not per layer)."""
    if isinstance(getattr(type(config), name, None), property):
        return False
    try:
        value = getattr(config, name)
    except Exception:  # per-layer attributes raise on global access
        return False
    return not isinstance(value, (list, dict))


def _layer_list(value: list) -> list:
    """One layer of each kind, in order of first appearance (a cut that kept only linear
    attention layers would build a model whose cache cannot work)."""
    kinds = list(dict.fromkeys(value))
    return kinds if len(kinds) >= LAYERS else value[:LAYERS]


def tiny_kwargs(config) -> dict:
    """Keyword arguments that rebuild ``config`` (a default instance) tiny."""
    kwargs = {}
    for name, value in SIZES.items():
        if _has_plain(config, name):
            kwargs[name] = value
    if _has_plain(config, "kv_lora_rank"):  # multi-head latent attention: one kv head per head
        kwargs["num_key_value_heads"] = SIZES["num_attention_heads"]
    if _has_plain(config, "is_decoder"):  # encoder architectures in the causal-LM mapping run as decoders
        kwargs["is_decoder"] = True
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id"):
        if isinstance(getattr(config, name, None), int):
            kwargs[name] = {"pad_token_id": 0, "bos_token_id": 1}.get(name, 2)
    for name, value in vars(config).items():
        if ("token_id" in name or "token_index" in name) and name not in kwargs and isinstance(value, int):
            kwargs[name] = VOCAB - 1 - len([k for k in kwargs if "token" in k])  # images etc.: top of the vocab
        if name in LAYER_LISTS and isinstance(value, list) and value:
            kwargs[name] = _layer_list(value)
            for count in ("num_hidden_layers", "num_layers", "n_layer"):
                if count in kwargs:
                    kwargs[count] = len(kwargs[name])
        if hasattr(value, "to_dict") and hasattr(value, "model_type") and value is not config:
            kwargs[name] = {"model_type": value.model_type, **tiny_kwargs(value)}
    return kwargs


def require_model_type(model_type: str) -> None:
    """Skip the calling test, naming the installed release, where transformers has no
    ``model_type`` (architectures added after the oldest release flce supports)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r} model type")


def tiny_config(model_type: str):
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    config = type(default)(**tiny_kwargs(default))
    config._attn_implementation = "eager"
    for value in vars(config).values():
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            value._attn_implementation = "eager"
    return config


def build(config, seed: int = 0):
    """What ``AutoModelForCausalLM`` builds for ``config``, in fp32 and eval mode (no
    dropout: stock and flce runs must match), its head weights scaled up so that the loss
    is not ~log(V)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is not None:
        with torch.no_grad():
            head.weight.mul_(8.0)
    return model


def inputs(model, seed: int = 1, rows: int = 2, length: int = 10) -> dict:
    """input_ids avoiding special tokens; labels with a prompt and padding ignored; no cache
    (some stateful models cannot backpropagate through their cache update)."""
    import inspect

    from flce.integrations.transformers.probe import special_token_ids

    head = model.get_output_embeddings()
    vocab = head.weight.shape[0] if head is not None else VOCAB
    special = special_token_ids(model.config)
    allowed = torch.tensor([t for t in range(3, vocab) if t not in special])
    generator = torch.Generator().manual_seed(seed)
    input_ids = allowed[torch.randint(0, len(allowed), (rows, length), generator=generator)]
    labels = input_ids.clone()
    labels[0, :3] = -100
    labels[-1, -2:] = -100
    batch = {"input_ids": input_ids, "labels": labels}
    if "use_cache" in inspect.signature(type(model).forward).parameters:
        batch["use_cache"] = False
    return batch


def parameter_grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _loss_and_grads(model, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), parameter_grads(model)


# fp32 rounding of sums whose terms are larger than the result: a gradient of 1e-5 summed
# from terms of 1e-1 carries ~1e-8 of noise whichever order the sum is taken in.
ABSOLUTE_FLOOR = 1e-8


def _within(name: str, ours: torch.Tensor, stock: torch.Tensor, exact: torch.Tensor | None, k: float = 3.0) -> None:
    """``|ours - exact| <= k * |stock - exact| + floor`` in the max norm, the floor a millionth
    of the value's scale plus ``ABSOLUTE_FLOOR``. Without a float64 run (some
    kernels have no float64 version) ``|ours - stock|`` within 1e-5 of the scale."""
    if exact is None:
        scale = stock.abs().max().item()
        err = (ours - stock).abs().max().item()
        assert err <= 1e-5 * scale + ABSOLUTE_FLOOR, f"{name}: flce differs from stock by {err:.3g} (scale {scale:.3g})"
        return
    exact = exact.to(ours.dtype)
    err_ours = (ours - exact).abs().max().item()
    err_stock = (stock - exact).abs().max().item()
    floor = 1e-6 * exact.abs().max().item() + ABSOLUTE_FLOOR
    assert err_ours <= k * err_stock + floor, (
        f"{name}: flce's error {err_ours:.3g} against float64 exceeds {k} x stock's {err_stock:.3g} + {floor:.3g}"
    )


def _float64_run(stock, batch: dict):
    try:
        return _loss_and_grads(clone(stock).double(), batch)
    except RuntimeError:  # e.g. grouped expert GEMMs exist for fp32/bf16/fp16 only
        return None, {}


def compare_with_stock(stock, patched, batch: dict) -> None:
    """Loss and every parameter gradient of ``patched`` are as close to the float64 stock
    model's as the fp32 stock model's are (``_within``); the output type is the model's own,
    without logits."""
    out = patched(**batch)
    assert type(out) is type(stock(**batch)) and out.logits is None
    loss_exact, grads_exact = _float64_run(stock, batch)
    loss_stock, grads_stock = _loss_and_grads(stock, batch)
    loss_flce, grads_flce = _loss_and_grads(patched, batch)
    assert math.isfinite(float(loss_stock))
    _within("loss", loss_flce, loss_stock, loss_exact)
    assert grads_stock.keys() == grads_flce.keys() and grads_stock
    for name, grad in grads_stock.items():
        _within(name, grads_flce[name], grad, grads_exact.get(name))


def clone(model):
    """An independent copy with the same weights (the stock model stays as it is)."""
    try:
        return copy.deepcopy(model)
    except RuntimeError:  # modules holding non-leaf tensors: rebuild and load the weights
        copied = type(model)(model.config).to(next(model.parameters()).dtype)
        copied.load_state_dict(model.state_dict())
        return copied.train(model.training)


# --------------------------------------------------------------------------- the README's list

SUPPORTED, REFUSED, UNBUILDABLE = "checked against stock", "refused at patch time", "not buildable here"
README = Path(__file__).resolve().parents[2] / "README.md"
BEGIN = "<!-- hf-architectures: generated by `python -m tests.integrations.hf_tiny`"
END = "<!-- hf-architectures: end -->"


def outcome(model_type: str) -> tuple[str, str]:
    """(category, detail) of one model type: checked against stock (the comparison raises if
    flce's loss or a gradient differ), refused with the reason, or not buildable here."""
    from flce.integrations import transformers as flce_hf

    try:
        stock = build(tiny_config(model_type))
        batch = inputs(stock)
        # Two steps, as training takes: transformers 4.56's recurrent_gemma keeps its
        # recurrent state (and its graph) from one forward to the next, so its second
        # backward fails, stock and patched alike.
        for _ in range(2):
            loss = stock(**batch).loss
            if loss is None:
                raise ValueError("the stock model computes no loss from labels")
            loss.backward()
            stock.zero_grad(set_to_none=True)
    except Exception as exc:  # the stock model itself cannot run from a tiny default config
        return UNBUILDABLE, f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    patched = clone(stock)
    try:
        flce_hf.apply_flce(patched)
    except flce_hf.UnsupportedModelError as exc:
        assert exc.reason and exc.model_name == type(stock).__name__
        assert not flce_hf.is_patched(patched)  # refused means left as it was
        return REFUSED, exc.reason
    compare_with_stock(stock, patched, batch)
    return SUPPORTED, type(stock).__name__


def model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def readme_block(outcomes: dict[str, tuple[str, str]]) -> str:
    import transformers

    lines = [f"{BEGIN} with transformers {transformers.__version__} -->"]
    for category in (SUPPORTED, REFUSED, UNBUILDABLE):
        names = [m for m, (c, _) in sorted(outcomes.items()) if c == category]
        if category == REFUSED:
            lines.append(f"- {category} ({len(names)}):")
            lines += [f"  - `{m}`: " + outcomes[m][1].replace("`", "'") for m in names]
        else:
            lines.append(f"- {category} ({len(names)}): " + ", ".join(f"`{m}`" for m in names))
    lines.append(END)
    return "\n".join(lines)


def recorded_outcomes() -> dict[str, str] | None:
    """model_type -> category from the README's generated list, if it was generated with the
    installed transformers (another version has other architectures)."""
    import re

    import transformers

    text = README.read_text()
    if BEGIN not in text:
        return None
    block = text[text.index(BEGIN) : text.index(END)]
    if f"with transformers {transformers.__version__} -->" not in block:
        return None
    recorded, category = {}, None
    for line in block.splitlines()[1:]:
        if line.startswith("- "):
            category = next(c for c in (SUPPORTED, REFUSED, UNBUILDABLE) if line.startswith(f"- {c} ("))
            names = re.findall(r"`([^`]+)`", line)
        else:  # a refused model: "  - `name`: reason"
            names = re.findall(r"^  - `([^`]+)`:", line)
        recorded.update(dict.fromkeys(names, category))
    return recorded


def write_readme() -> None:
    torch.set_num_threads(1)
    outcomes = {m: outcome(m) for m in model_types()}
    text = README.read_text()
    block = readme_block(outcomes)
    if BEGIN in text:
        text = text[: text.index(BEGIN)] + block + text[text.index(END) + len(END) :]
    else:
        raise SystemExit(f"{README} has no {BEGIN!r} marker")
    README.write_text(text)
    print(block)


if __name__ == "__main__":
    write_readme()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: threads cost more than they give (a module imports it to use it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
