"""The transformers integration against the models' own (HF) loss, on tiny random
models built in code (CPU, fp32, no downloads)."""

from __future__ import annotations

import copy
import inspect
import math

import pytest
import torch
import torch.nn.functional as F

import flce

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from flce.integrations import transformers as flce_hf  # noqa: E402  (needs transformers)
from flce.integrations.transformers.patch import is_flce_forward  # noqa: E402

VOCAB = 160
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
GEMMA = {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 8}
# name -> (config class, model class, extra config)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    # A soft-cap small enough that it changes the loss visibly at random init.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {**GEMMA, "final_logit_softcapping": 1.0}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {**GEMMA, "final_logit_softcapping": 1.0}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
}
SOFTCAPPED = ("gemma2", "gemma3")

# fp32 on CPU: the chunked GEMMs reassociate sums, nothing more.
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-6}
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-6}


def make_model(arch: str, seed: int = 0, **config_overrides):
    config_name, model_name, extra = ARCHS[arch]
    config = getattr(transformers, config_name)(**{**COMMON, **extra, **config_overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():  # larger logits than the default init, so the loss is not ~log(V)
        model.lm_head.weight.mul_(8.0)
    return model


def make_batch(seed: int = 1, batch: int = 3, seq: int = 12):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (batch, seq), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -3:] = 0  # right padding
    labels = input_ids.clone()
    labels[1, -3:] = -100
    labels[0, :4] = -100  # e.g. a prompt
    return input_ids, attention_mask, labels


def pair(arch: str, **options):
    """(stock model, flce-patched copy) with identical weights."""
    ref = make_model(arch)
    patched = flce_hf.apply_flce(copy.deepcopy(ref), **options)
    return ref, patched


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(ref, patched):
    g_ref, g_flce = grads(ref), grads(patched)
    assert g_ref.keys() == g_flce.keys() and g_ref
    for name in g_ref:
        torch.testing.assert_close(g_flce[name], g_ref[name], **GRAD_TOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("use_num_items", [False, True], ids=["mean", "num_items_in_batch"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_loss_and_grads_match_hf(arch, use_num_items):
    ref, patched = pair(arch)
    input_ids, attention_mask, labels = make_batch()
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    if use_num_items:  # as the Trainer passes it: the count over all micro-batches
        kwargs["num_items_in_batch"] = torch.tensor(int((labels[:, 1:] != -100).sum()) + 7)
    out_ref, out_flce = ref(**kwargs), patched(**kwargs)
    assert out_flce.loss.dtype == torch.float32
    torch.testing.assert_close(out_flce.loss, out_ref.loss, **LOSS_TOL)
    out_ref.loss.backward()
    out_flce.loss.backward()
    assert_grads_close(ref, patched)


@pytest.mark.parametrize("arch", ["llama", "bart"])
def test_every_target_ignored_gives_zero_loss_and_gradients(arch):
    """flce's rule (CONTRACT: no NaN) where the stock mean is 0/0 = NaN; with num_items_in_batch
    both are 0. bart: the inline route."""
    if arch == "bart":
        from tests.integrations import hf_tiny

        ref = hf_tiny.build(hf_tiny.tiny_config("bart"))
        patched = flce_hf.apply_flce(copy.deepcopy(ref))
    else:
        ref, patched = pair(arch)
    input_ids, attention_mask, labels = make_batch()
    ignored = torch.full_like(labels, -100)
    assert ref(input_ids=input_ids, labels=ignored).loss.isnan()
    out = patched(input_ids=input_ids, labels=ignored)
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert all(bool((g == 0).all()) for g in grads(patched).values())
    if not _takes_keyword(ref, "num_items_in_batch"):
        # transformers 4.56's BartForCausalLM.forward takes no **kwargs (the Trainer then
        # passes no count): the patched forward refuses the argument as the stock one does.
        for model in (ref, patched):
            with pytest.raises(TypeError, match="num_items_in_batch"):
                model(input_ids=input_ids, labels=ignored, num_items_in_batch=torch.tensor(5))
        return
    out = patched(input_ids=input_ids, labels=ignored, num_items_in_batch=torch.tensor(5))
    assert out.loss.item() == 0.0


def _takes_keyword(model, name: str) -> bool:
    """Whether the model's own forward accepts the keyword ``name`` (by name or **kwargs)."""
    parameters = inspect.signature(type(model).forward).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_shift_labels_kwarg(arch):
    ref, patched = pair(arch)
    input_ids, attention_mask, labels = make_batch()
    shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    shift_labels[2, 5] = -100
    out_ref = ref(input_ids=input_ids, attention_mask=attention_mask, labels=labels, shift_labels=shift_labels)
    out_flce = patched(input_ids=input_ids, attention_mask=attention_mask, labels=labels, shift_labels=shift_labels)
    torch.testing.assert_close(out_flce.loss, out_ref.loss, **LOSS_TOL)


@pytest.mark.parametrize("arch,optimizer", [("llama", "adamw"), ("qwen3", "sgd"), ("gemma2", "adamw"), ("phi3", "sgd")])
def test_training_steps_track_hf(arch, optimizer):
    ref, patched = pair(arch)
    input_ids, attention_mask, labels = make_batch(seq=16)

    def run(model):
        opt = (
            torch.optim.AdamW(model.parameters(), lr=3e-3)
            if optimizer == "adamw"
            else torch.optim.SGD(model.parameters(), lr=0.5)
        )
        model.train()
        losses = []
        for _ in range(6):
            opt.zero_grad()
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    losses_ref, losses_flce = run(ref), run(patched)
    assert losses_ref[-1] < losses_ref[0]  # it does train
    assert losses_flce == pytest.approx(losses_ref, rel=1e-4)
    for (name, p_ref), (_, p_flce) in zip(ref.named_parameters(), patched.named_parameters(), strict=False):
        torch.testing.assert_close(p_flce, p_ref, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_gradient_accumulation_with_num_items_in_batch():
    """Two micro-batches, each divided by the total count, give the full batch's mean."""
    ref, patched = pair("llama")
    input_ids, attention_mask, labels = make_batch(batch=4)
    patched(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
    full = grads(patched)
    patched.zero_grad()
    num_items = (labels[:, 1:] != -100).sum()
    total = 0.0
    for part in (slice(0, 1), slice(1, 4)):
        loss = patched(
            input_ids=input_ids[part],
            attention_mask=attention_mask[part],
            labels=labels[part],
            num_items_in_batch=num_items,
        ).loss
        loss.backward()
        total += loss.item()
    mean = ref(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss.item()
    assert total == pytest.approx(mean, rel=1e-5)
    accumulated = grads(patched)
    for name in full:
        torch.testing.assert_close(accumulated[name], full[name], **GRAD_TOL)


@pytest.mark.parametrize("arch", SOFTCAPPED)
def test_softcap_is_applied(arch):
    ref, patched = pair(arch)
    assert ref.config.final_logit_softcapping == 1.0
    input_ids, attention_mask, labels = make_batch()
    loss_ref = ref(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    loss_flce = patched(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    torch.testing.assert_close(loss_flce, loss_ref, **LOSS_TOL)

    hidden = ref.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    raw_logits = ref.lm_head(hidden).float()
    targets = F.pad(labels, (0, 1), value=-100)[..., 1:]
    uncapped = F.cross_entropy(raw_logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)
    capped = F.cross_entropy((torch.tanh(raw_logits)).reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(loss_flce, capped, **LOSS_TOL)
    assert abs(loss_flce.item() - uncapped.item()) > 0.1

    # The model's own soft-cap is applied as its forward does: the option is refused.
    with pytest.raises(ValueError, match="softcap"):
        flce_hf.apply_flce(copy.deepcopy(ref), softcap=None)

    # Logits asked for are the capped ones, as HF returns them.
    ref.eval()
    patched.eval()
    torch.testing.assert_close(patched(input_ids=input_ids).logits, ref(input_ids=input_ids).logits, **LOSS_TOL)
    out = patched(input_ids=input_ids, labels=labels, skip_logits=False)
    torch.testing.assert_close(out.logits, ref(input_ids=input_ids).logits, **LOSS_TOL)
    torch.testing.assert_close(out.loss, loss_ref, **LOSS_TOL)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_logits_materialised_only_when_needed(arch):
    ref, patched = pair(arch)
    input_ids, attention_mask, labels = make_batch()
    for training in (True, False):  # with labels, no logits in training or in eval
        patched.train(training)
        out = patched(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        assert out.logits is None and out.loss is not None
    # Asked for explicitly, or no labels: logits as HF computes them.
    ref.eval()
    out_ref = ref(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    out = patched(input_ids=input_ids, attention_mask=attention_mask, labels=labels, skip_logits=False)
    torch.testing.assert_close(out.logits, out_ref.logits, **LOSS_TOL)
    torch.testing.assert_close(out.loss, out_ref.loss, **LOSS_TOL)
    out = patched(input_ids=input_ids, attention_mask=attention_mask)
    assert out.loss is None and out.logits.shape == (*input_ids.shape, VOCAB)
    torch.testing.assert_close(out.logits, out_ref.logits, **LOSS_TOL)
    with pytest.raises(ValueError, match="skip_logits"):
        patched(input_ids=input_ids, skip_logits=True)


def test_output_types_logits_to_keep_and_tuples():
    ref, patched = pair("llama")
    ref.eval()
    patched.eval()
    input_ids, attention_mask, labels = make_batch()
    out = patched(input_ids=input_ids, attention_mask=attention_mask, use_cache=True)
    assert isinstance(out, transformers.modeling_outputs.CausalLMOutputWithPast)
    assert out[1] is not None  # the cache comes through
    out = patched(input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=True)
    assert type(out) is transformers.modeling_outputs.CausalLMOutputWithPast and out.logits is None
    # The logits are gone from the dict too; the cache stays, under the release's own key
    # (past_key_values in transformers 5.17, cache later).
    stock_keys = list(ref(input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=True).keys())
    assert stock_keys[:2] == ["loss", "logits"] and len(stock_keys) == 3
    assert list(out.keys()) == [stock_keys[0], stock_keys[2]]
    last = patched(input_ids=input_ids, logits_to_keep=2).logits
    torch.testing.assert_close(last, ref(input_ids=input_ids, logits_to_keep=2).logits, **LOSS_TOL)
    assert last.shape == (input_ids.shape[0], 2, VOCAB)
    # With logits_to_keep the labels cover the kept positions, as for the stock loss.
    kept = labels[:, -4:]
    out_ref = ref(input_ids=input_ids, labels=kept, logits_to_keep=4)
    out = patched(input_ids=input_ids, labels=kept, logits_to_keep=4)
    torch.testing.assert_close(out.loss, out_ref.loss, **LOSS_TOL)
    with pytest.raises(ValueError, match="logits_to_keep"):
        patched(input_ids=input_ids, labels=labels, logits_to_keep=4)
    # return_dict=False: the stock tuple's layout, loss first, None in the logits' slot so later
    # fields keep their positions; positional input_ids work.
    for use_cache in (False, True):
        as_tuple = patched(input_ids, labels=labels, return_dict=False, use_cache=use_cache)
        stock_tuple = ref(input_ids, labels=labels, return_dict=False, use_cache=use_cache)
        assert isinstance(as_tuple, tuple) and len(as_tuple) == len(stock_tuple) == 2 + use_cache
        assert as_tuple[1] is None
        assert [type(x) for x in as_tuple[2:]] == [type(x) for x in stock_tuple[2:]]
        torch.testing.assert_close(as_tuple[0], stock_tuple[0], **LOSS_TOL)
    # hidden states requested from the decoder are returned.
    out = patched(input_ids=input_ids, labels=labels, output_hidden_states=True)
    assert out.hidden_states is not None and len(out.hidden_states) == ref.config.num_hidden_layers + 1


def test_generate_unchanged():
    ref, patched = pair("llama")
    ref.eval()
    patched.eval()
    prompt = make_batch()[0][:, :5]
    kwargs = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(patched.generate(prompt, **kwargs), ref.generate(prompt, **kwargs))


def test_loss_options_are_passed_through():
    ref, patched = pair("qwen2", label_smoothing=0.1)
    input_ids, attention_mask, labels = make_batch()
    loss = patched(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    logits = ref(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    targets = F.pad(labels, (0, 1), value=-100)[..., 1:]
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100, label_smoothing=0.1)
    torch.testing.assert_close(loss, expected, **LOSS_TOL)


def test_class_weights_are_the_models_vocabulary():
    """ce_weight weighs each class as F.cross_entropy's weight; weights of another length are
    refused naming ce_weight (more of them were cut to the vocabulary, silently), with the
    fused loss and with the model's logits; what is wrong whatever the vocabulary, at patch time."""
    weights = torch.rand(VOCAB, generator=torch.Generator().manual_seed(3)) + 0.5
    ref, patched = pair("llama", ce_weight=weights)
    input_ids, attention_mask, labels = make_batch()
    logits = ref(input_ids=input_ids, attention_mask=attention_mask).logits
    targets = F.pad(labels, (0, 1), value=-100)[..., 1:]
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), weight=weights)
    for skip_logits in (True, False):
        out = patched(input_ids=input_ids, attention_mask=attention_mask, labels=labels, skip_logits=skip_logits)
        torch.testing.assert_close(out.loss, expected, **LOSS_TOL)
    for length in (VOCAB - 1, VOCAB + 5):
        patched = flce_hf.apply_flce(copy.deepcopy(ref), ce_weight=torch.ones(length))
        for skip_logits in (True, False):
            with pytest.raises(ValueError, match=rf"ce_weight must have shape \({VOCAB},\).*got \({length},\)"):
                patched(input_ids=input_ids, labels=labels, skip_logits=skip_logits)
    with pytest.raises(TypeError, match="ce_weight must be a floating-point tensor"):
        flce_hf.apply_flce(copy.deepcopy(ref), ce_weight=torch.ones(VOCAB, dtype=torch.long))
    with pytest.raises(ValueError, match="ce_weight must be finite and non-negative"):
        flce_hf.apply_flce(copy.deepcopy(ref), ce_weight=-torch.ones(VOCAB))
    with pytest.raises(ValueError, match=r"ce_weight must have shape \(V,\)"):
        flce_hf.apply_flce(copy.deepcopy(ref), ce_weight=torch.ones(2, VOCAB))


def test_flce_computes_the_loss(monkeypatch):
    calls = []
    real = flce.fused_linear_cross_entropy

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(flce, "fused_linear_cross_entropy", spy)
    _, patched = pair("gemma2", chunk_size=7)
    input_ids, attention_mask, labels = make_batch()
    calls.clear()  # the probe at patch time does not call flce
    patched(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    assert len(calls) == 1
    assert calls[0]["softcap"] == 1.0 and calls[0]["chunk_size"] == 7 and calls[0]["reduction"] == "mean"
    patched(input_ids=input_ids, labels=labels, num_items_in_batch=5)
    assert calls[1]["reduction"] == "sum"


def test_patch_model_type_and_undo():
    input_ids, attention_mask, labels = make_batch()
    ref = make_model("llama")
    loss_ref = ref(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    (cls,) = flce_hf.patch_model_type("llama")
    try:
        assert cls is transformers.LlamaForCausalLM and flce_hf.is_patched(cls)
        existing = ref  # class-level: existing instances are patched too
        out = existing(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        assert out.logits is None
        torch.testing.assert_close(out.loss, loss_ref, **LOSS_TOL)
        fresh = make_model("llama")
        assert flce_hf.is_patched(fresh)
        assert fresh(input_ids=input_ids, labels=labels).logits is None
        # Patching again replaces the options instead of stacking wrappers.
        flce_hf.patch_model_type(transformers.LlamaForCausalLM, label_smoothing=0.2)
        assert not is_flce_forward(cls.forward.flce_original_forward)
        # The Trainer reads the signature: columns and **kwargs (for num_items_in_batch).
        params = inspect.signature(fresh.forward).parameters
        assert "input_ids" in params and "labels" in params
        assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    finally:
        flce_hf.unpatch_model_type("llama")
    assert not flce_hf.is_patched(transformers.LlamaForCausalLM)
    assert "forward" in transformers.LlamaForCausalLM.__dict__
    assert ref(input_ids=input_ids, labels=labels).logits is not None
    # A model_type resolves to what the auto classes load for it (multimodal Gemma 3 for "gemma3").
    assert flce_hf.model_classes("gemma3") == (transformers.Gemma3ForConditionalGeneration,)
    assert flce_hf.model_classes("gemma3_text") == (transformers.Gemma3ForCausalLM,)
    llama4 = (transformers.Llama4ForCausalLM, transformers.Llama4ForConditionalGeneration)
    assert flce_hf.model_classes("llama4") == llama4


def test_remove_flce_restores_instance():
    ref, patched = pair("mistral")
    input_ids, _, labels = make_batch()
    assert flce_hf.is_patched(patched) and not flce_hf.is_patched(ref)
    flce_hf.apply_flce(patched, label_smoothing=0.1)  # re-patching replaces
    assert not is_flce_forward(patched.forward.__func__.flce_original_forward)
    flce_hf.remove_flce(patched)
    assert not flce_hf.is_patched(patched)
    assert patched(input_ids=input_ids, labels=labels).logits is not None


def test_invalid_options_and_models():
    model = make_model("llama")
    with pytest.raises(ValueError, match="reduction"):
        flce_hf.apply_flce(model, reduction="sum")
    with pytest.raises(ValueError, match="return_z_loss"):
        flce_hf.apply_flce(model, return_z_loss=True)
    with pytest.raises(TypeError, match="unknown loss option"):
        flce_hf.apply_flce(model, label_smothing=0.1)
    with pytest.raises(ValueError, match="label_smoothing"):  # flce's own option checks, at patch time
        flce_hf.apply_flce(model, label_smoothing=2.0)
    with pytest.raises(ValueError, match="unknown model_type"):
        flce_hf.patch_model_type("not_a_model")
    with pytest.raises(TypeError, match="PreTrainedModel"):
        flce_hf.apply_flce(torch.nn.Linear(2, 2))
    assert not flce_hf.is_patched(model)


def test_hf_trainer_gradient_accumulation(tmp_path, monkeypatch):
    """The HF Trainer passes num_items_in_batch to the patched model; training tracks the stock model."""
    pytest.importorskip("accelerate", reason="the HF Trainer needs accelerate")
    from torch.utils.data import Dataset

    class Rows(Dataset):
        def __init__(self):
            input_ids, _, labels = make_batch(seed=5, batch=8, seq=10)
            labels[::3, :6] = -100  # uneven counts per micro-batch: the normalisation matters
            self.rows = [{"input_ids": i, "labels": lab} for i, lab in zip(input_ids, labels, strict=False)]

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return self.rows[i]

    reductions = []
    real = flce.fused_linear_cross_entropy

    def spy(*args, **kwargs):
        reductions.append(kwargs["reduction"])
        return real(*args, **kwargs)

    monkeypatch.setattr(flce, "fused_linear_cross_entropy", spy)

    def train(model, name):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / name),
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_steps=2,
            learning_rate=1e-2,
            lr_scheduler_type="constant",
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=0,
        )
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows())
        trainer.train()
        return [log["loss"] for log in trainer.state.log_history if "loss" in log]

    ref, patched = pair("llama")
    losses_ref = train(ref, "ref")
    losses_flce = train(patched, "flce")
    assert len(losses_ref) == 2 and all(math.isfinite(x) for x in losses_ref)
    assert reductions and set(reductions) == {"sum"}  # num_items_in_batch reached the loss
    assert losses_flce == pytest.approx(losses_ref, rel=1e-4)
    for (name, p_ref), (_, p_flce) in zip(ref.named_parameters(), patched.named_parameters(), strict=False):
        torch.testing.assert_close(p_flce, p_ref, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def _double_output(module, args, output):
    return output * 2.0


def _double_input(module, args):
    return (args[0] * 2.0,)


def _hook_on_submodule(model):
    # A head whose weight lives in a submodule is the PEFT case; a hook on any submodule of
    # the head is skipped the same way, as the head runs on an empty batch.
    model.lm_head.register_module("inner", torch.nn.Identity())
    return model.lm_head.inner.register_forward_hook(lambda module, args, output: output)


@pytest.mark.parametrize(
    "register,kind",
    [
        (lambda m: m.lm_head.register_forward_hook(_double_output), "forward hook _double_output"),
        (lambda m: m.lm_head.register_forward_pre_hook(_double_input), "forward pre-hook _double_input"),
        (lambda m: m.lm_head.register_full_backward_hook(lambda *a: None), "backward hook"),
        (_hook_on_submodule, "on the head.inner"),
    ],
    ids=["forward-hook", "pre-hook-after-patching", "backward-hook", "submodule-hook"],
)
def test_a_hook_the_fused_loss_would_skip_is_refused_at_the_call(register, kind):
    """The fused loss reads the head's weights, not its output: a hook that changes the
    logits (a tensor-parallel gather, a user's scale), a pre-hook added after patching, a
    backward hook or a submodule's hook would not act on it. Refused naming the hook, with
    the model's own logits still a way (skip_logits=False)."""
    ref, patched = pair("llama")
    input_ids, attention_mask, labels = make_batch()
    handle = register(patched)
    with pytest.raises(RuntimeError, match=rf"head carries hooks that its fused loss would skip \(.*{kind}"):
        patched(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    if "backward" not in kind and "inner" not in kind:
        register(ref)
        expected = ref(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        got = patched(input_ids=input_ids, attention_mask=attention_mask, labels=labels, skip_logits=False).loss
        torch.testing.assert_close(got, expected, **LOSS_TOL)
    handle.remove()
    patched(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def test_a_pre_hook_registered_before_patching_shapes_the_fused_loss_input():
    """A forward pre-hook on the head that runs before flce's keeps what it does to the
    hidden states: the fused loss equals stock's, gradients included."""
    ref = make_model("llama")
    ref.lm_head.register_forward_pre_hook(_double_input)
    patched = flce_hf.apply_flce(copy.deepcopy(ref))
    input_ids, attention_mask, labels = make_batch()
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    out_ref, out_flce = ref(**kwargs), patched(**kwargs)
    assert out_flce.logits is None
    torch.testing.assert_close(out_flce.loss, out_ref.loss, **LOSS_TOL)
    out_ref.loss.backward()
    out_flce.loss.backward()
    assert_grads_close(ref, patched)
