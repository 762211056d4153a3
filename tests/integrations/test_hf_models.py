"""Patched models give the stock loss and gradients in the cases that used to go silently
wrong (MoE auxiliary losses, unshifted labels, logit scales, LoRA on the head, offloading,
wrapped models), and the probe refuses what it cannot reproduce. Tiny models, fp32, CPU."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from flce.integrations import transformers as flce_hf  # noqa: E402
from tests.integrations import hf_tiny  # noqa: E402


def stock_and_patched(model_type: str, **config_overrides):
    config = hf_tiny.tiny_config(model_type)
    for key, value in config_overrides.items():
        setattr(config, key, value)
    stock = hf_tiny.build(config)
    return stock, flce_hf.apply_flce(hf_tiny.clone(stock))


def recipe(model):
    return flce_hf.unwrap_model(model)._flce_interceptor.recipe


MOE = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "granitemoe", "phimoe", "jetmoe", "minimax", "gpt_oss"]
MOE += ["ernie4_5_moe", "flex_olmo", "qwen3_next"]


@pytest.mark.parametrize("model_type", MOE)
def test_moe_router_aux_loss_kept(model_type):
    """The stock forward adds router_aux_loss_coef * aux_loss to the loss and returns both.
    Where a transformers release's own forward fails with ``output_router_logits`` (5.17's
    granitemoe collects no router logits) flce refuses the model, saying so; where it
    returns no aux loss (5.17's jetmoe reads only its forward argument) the patched loss is
    still the stock one; either is then skipped with the reason."""
    hf_tiny.require_model_type(model_type)  # flex_olmo and qwen3_next came after transformers 4.56
    config = hf_tiny.tiny_config(model_type)
    config.output_router_logits, config.router_aux_loss_coef = True, 0.5
    stock = hf_tiny.build(config)
    batch = hf_tiny.inputs(stock)
    try:
        out_stock = stock(**batch)
    except Exception as error:
        with pytest.raises(flce_hf.UnsupportedModelError, match="its own forward fails"):
            flce_hf.apply_flce(hf_tiny.clone(stock))
        pytest.skip(
            f"{model_type}'s own forward fails with output_router_logits (transformers {transformers.__version__}): "
            f"{error!r}"
        )
    patched = flce_hf.apply_flce(hf_tiny.clone(stock))
    out_flce = patched(**batch)
    if out_stock.aux_loss is None:  # the case under test is absent: the aux loss is not in the stock loss
        assert out_flce.aux_loss is None
        hf_tiny.compare_with_stock(stock, patched, batch)
        pytest.skip(
            f"{model_type}'s own forward returns no aux loss with output_router_logits in its config "
            f"(transformers {transformers.__version__})"
        )
    torch.testing.assert_close(out_flce.aux_loss, out_stock.aux_loss)
    assert len(out_flce.router_logits) == len(out_stock.router_logits)
    hf_tiny.compare_with_stock(stock, patched, batch)


UNSHIFTED = ["bart", "mbart", "plbart", "mvp", "pegasus", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian"]


@pytest.mark.parametrize("model_type", UNSHIFTED)
def test_unshifted_labels_kept(model_type):
    """These CausalLM heads score position t against labels[t] (no shift)."""
    stock, patched = stock_and_patched(model_type)
    assert recipe(patched).shift is False
    hf_tiny.compare_with_stock(stock, patched, hf_tiny.inputs(stock))


@pytest.mark.parametrize(
    "model_type,overrides",
    [("cohere", {"logit_scale": 0.25}), ("cohere2", {"logit_scale": 3.0}), ("granite", {"logits_scaling": 4.0})],
)
def test_config_logit_scale(model_type, overrides):
    stock, patched = stock_and_patched(model_type, **overrides)
    assert recipe(patched).scale
    hf_tiny.compare_with_stock(stock, patched, hf_tiny.inputs(stock))


def test_learnable_logit_scale_gets_its_gradient():
    """Cohere multiplies the logits by `self.logit_scale`; made a parameter, it is learnable."""
    config = hf_tiny.tiny_config("cohere")
    stock = hf_tiny.build(config)
    stock.logit_scale = torch.nn.Parameter(torch.tensor(0.3))
    patched = flce_hf.apply_flce(hf_tiny.clone(stock))
    hf_tiny.compare_with_stock(stock, patched, hf_tiny.inputs(stock))
    assert patched.logit_scale.grad is not None and patched.logit_scale.grad.abs() > 0


@pytest.mark.parametrize(
    "model_type,overrides,scale",
    [("cohere", {"logit_scale": 0.3}, 0.3), ("granite", {"logits_scaling": 3.7}, 1 / 3.7)],
)
def test_logit_scale_in_bf16_is_as_accurate_as_stock(model_type, overrides, scale):
    """bf16 weights: the scale is folded into the head's input in fp32 and rounded once, so
    the loss is as close to the exact loss of the same hidden states as the stock model's (a
    bf16 copy of 0.3 is 0.30078125: every logit off by the same 0.26%)."""
    import torch.nn.functional as F

    config = hf_tiny.tiny_config(model_type)
    for key, value in overrides.items():
        setattr(config, key, value)
    stock_errors, flce_errors = 0.0, 0.0
    head_inputs = []
    for seed in range(4):
        stock = hf_tiny.build(config, seed=seed).to(torch.bfloat16)
        batch = hf_tiny.inputs(stock, seed=seed, rows=8, length=64)
        hook = stock.get_output_embeddings().register_forward_pre_hook(lambda module, args: head_inputs.append(args[0]))
        with torch.no_grad():
            stock_loss = stock(**batch).loss.item()
        hook.remove()
        logits = head_inputs[-1].double() @ stock.get_output_embeddings().weight.double().T * scale
        targets = batch["labels"][:, 1:].reshape(-1)
        exact = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets).item()
        with torch.no_grad():
            flce_loss = flce_hf.apply_flce(hf_tiny.clone(stock))(**batch).loss.item()
        stock_errors += abs(stock_loss - exact)
        flce_errors += abs(flce_loss - exact)
    assert flce_errors <= 3 * stock_errors, (flce_errors, stock_errors)


def test_softcap_from_config():
    stock, patched = stock_and_patched("gemma2", final_logit_softcapping=2.0)
    assert recipe(patched).softcap == 2.0
    hf_tiny.compare_with_stock(stock, patched, hf_tiny.inputs(stock))


# --------------------------------------------------------------------------- PEFT

peft = pytest.importorskip("peft", reason="peft is not installed")


def peft_pair(**lora_options):
    base = hf_tiny.build(hf_tiny.tiny_config("llama"))
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **lora_options)  # B != 0: it counts
    stock = peft.get_peft_model(base, config)
    patched = hf_tiny.clone(stock)
    assert flce_hf.apply_flce(patched) is patched  # the PEFT model is patched through and returned
    return stock, patched


@pytest.mark.parametrize(
    "lora_options",
    [
        {"target_modules": ["q_proj", "v_proj", "lm_head"]},
        {"target_modules": ["q_proj", "v_proj"]},
        {"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]},
    ],
    ids=["lora_on_head", "lora_on_attention", "modules_to_save"],
)
def test_peft(lora_options):
    stock, patched = peft_pair(**lora_options)
    batch = hf_tiny.inputs(stock)
    hf_tiny.compare_with_stock(stock, patched, batch)
    trained = {n for n, p in patched.named_parameters() if p.grad is not None}
    if "lm_head" in lora_options["target_modules"]:
        assert any("lm_head.lora_A" in n for n in trained) and any("lm_head.lora_B" in n for n in trained)
    if "modules_to_save" in lora_options:
        assert any("lm_head.modules_to_save" in n for n in trained)


def test_lora_on_head_with_dropout_in_training():
    """Dropout on the LoRA path: the same random mask as the stock head draws, same seed."""
    stock, patched = peft_pair(target_modules=["q_proj", "lm_head"], lora_dropout=0.3)
    batch = hf_tiny.inputs(stock)
    losses = []
    for model in (stock, patched):
        model.train()
        torch.manual_seed(7)
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (name, p_stock), (_, p_flce) in zip(stock.named_parameters(), patched.named_parameters(), strict=True):
        if p_stock.grad is not None:
            torch.testing.assert_close(p_flce.grad, p_stock.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_adapter_switches_are_followed():
    """The head's adapters are read at every call: disabling them gives the base model's loss."""
    stock, patched = peft_pair(target_modules=["q_proj", "lm_head"])
    batch = hf_tiny.inputs(stock)
    with stock.disable_adapter(), patched.disable_adapter():
        torch.testing.assert_close(patched(**batch).loss, stock(**batch).loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(patched(**batch).loss, stock(**batch).loss, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- wrappers and hooks


def test_compiled_model_is_patched_through():
    stock = hf_tiny.build(hf_tiny.tiny_config("llama"))
    compiled = torch.compile(hf_tiny.clone(stock), backend="eager")
    assert flce_hf.apply_flce(compiled) is compiled
    batch = hf_tiny.inputs(stock)
    out = compiled(**batch)
    assert out.logits is None
    torch.testing.assert_close(out.loss, stock(**batch).loss, rtol=1e-5, atol=1e-6)


def test_accelerate_cpu_offload():
    """The head's weight is on the meta device between calls; flce loads it through the hook."""
    accelerate = pytest.importorskip("accelerate")
    stock = hf_tiny.build(hf_tiny.tiny_config("llama"))
    batch = hf_tiny.inputs(stock)
    expected = stock(**batch).loss
    offloaded = accelerate.cpu_offload(hf_tiny.clone(stock), execution_device=torch.device("cpu"))
    assert offloaded.lm_head.weight.device.type == "meta"
    flce_hf.apply_flce(offloaded)
    assert flce_hf.is_patched(offloaded)
    out = offloaded(**batch)
    assert out.logits is None
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-6)
    assert offloaded.lm_head.weight.device.type == "meta"  # offloaded again after the loss


def test_patch_model_type_by_class_gpt_neox():
    """A class outside the old fixed `.model` layout: every instance works, with and without labels."""
    stock = hf_tiny.build(hf_tiny.tiny_config("gpt_neox"))
    batch = hf_tiny.inputs(stock)
    expected = stock(**batch).loss
    expected_logits = stock(input_ids=batch["input_ids"]).logits
    patched = hf_tiny.clone(stock)
    classes = flce_hf.patch_model_type(transformers.GPTNeoXForCausalLM)
    try:
        assert classes == (transformers.GPTNeoXForCausalLM,)
        out = patched(**batch)
        assert out.logits is None
        torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(patched(input_ids=batch["input_ids"]).logits, expected_logits)
    finally:
        flce_hf.unpatch_model_type(transformers.GPTNeoXForCausalLM)


# --------------------------------------------------------------------------- refusals


class ZLossLlama(transformers.LlamaForCausalLM):
    """Adds a z-loss computed from the returned logits: flce does not materialise them."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, labels=labels, **kwargs)
        if labels is not None:
            out.loss = out.loss + 1e-2 * out.logits.logsumexp(-1).pow(2).mean()
        return out


class ShiftedLogitsLlama(transformers.LlamaForCausalLM):
    """Adds a constant to the logits before the loss: neither a scale nor a soft-cap."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids).last_hidden_state
        logits = self.lm_head(hidden) + 1.0
        loss = self.loss_function(logits, labels, self.vocab_size) if labels is not None else None
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


def _llama(cls=transformers.LlamaForCausalLM):
    torch.manual_seed(0)
    return cls(hf_tiny.tiny_config("llama")).eval()


@pytest.mark.parametrize(
    "make,reason",
    [
        (lambda: _llama(ZLossLlama), "uses the logits outside loss_function"),
        (lambda: _llama(ShiftedLogitsLlama), "neither a scale nor a soft-cap"),
    ],
    ids=["z_loss_on_logits", "unknown_logit_transform"],
)
def test_probe_refuses_what_it_cannot_reproduce(make, reason):
    model = make()
    with pytest.raises(flce_hf.UnsupportedModelError, match=reason):
        flce_hf.apply_flce(model)
    assert not flce_hf.is_patched(model) and "_loss_function" not in model.__dict__
    assert model(**hf_tiny.inputs(model)).logits is not None  # left as it was


def test_refuses_heads_and_losses_it_cannot_take():
    model = _llama()
    model.loss_function = lambda logits, labels, vocab_size, **kwargs: logits.sum() * 0
    with pytest.raises(flce_hf.UnsupportedModelError, match="loss_function is"):
        flce_hf.apply_flce(model)
    model = _llama()
    model.lm_head = torch.nn.Sequential(model.lm_head)
    model.get_output_embeddings = lambda: model.lm_head
    with pytest.raises(flce_hf.UnsupportedModelError, match="not a torch.nn.Linear"):
        flce_hf.apply_flce(model)
