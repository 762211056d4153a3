"""What the probe has to see for a patched model to keep its own loss, and what patching
has to leave as it was: attention masks in inline losses, padded vocabularies, logit scales
and soft-caps read at call time, encoder-decoders, the caller's random generators and grad
mode, forward wrappers, per-row adapters, dtypes, and the stock output layout. Each case used
to give a different loss or fail at run time. Tiny models, fp32, CPU."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402

from flce.integrations import transformers as flce_hf  # noqa: E402
from tests.integrations import hf_tiny  # noqa: E402
from tests.integrations.hf_tiny import one_thread  # noqa: E402, F401 (an autouse fixture)


def recipe(model):
    return flce_hf.unwrap_model(model)._flce_interceptor.recipe


def build(model_type: str, model_class=None, **config_overrides):
    config = hf_tiny.tiny_config(model_type)
    for key, value in config_overrides.items():
        setattr(config, key, value)
    if model_class is None:
        return hf_tiny.build(config)
    torch.manual_seed(0)
    model = model_class(config).float().eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def padded(batch: dict) -> dict:
    """``batch`` with an attention mask that hides the last positions of its first row, whose
    labels stay as they are (the loss decides what the mask drops)."""
    mask = torch.ones_like(batch["input_ids"])
    mask[0, -4:] = 0
    return {**batch, "attention_mask": mask}


# --------------------------------------------------------------------------- attention masks


@pytest.mark.parametrize(
    "model_type,model_class",
    [
        ("qwen2_audio", "Qwen2AudioForConditionalGeneration"),
        ("granite_speech", "GraniteSpeechForConditionalGeneration"),
    ],
)
def test_inline_loss_that_drops_masked_positions(model_type, model_class):
    """Their forwards compute the cross-entropy inline, over the positions attention_mask keeps."""
    stock = build(model_type, getattr(transformers, model_class))
    patched = flce_hf.apply_flce(hf_tiny.clone(stock))
    assert recipe(patched).route == "inline" and recipe(patched).mask_drops_targets
    batch = padded(hf_tiny.inputs(stock))
    hf_tiny.compare_with_stock(stock, patched, batch)
    # The mask given positionally is followed too.
    names = list(inspect.signature(type(stock).forward).parameters)[1:]
    positional = [batch.get(name) for name in names[: names.index("attention_mask") + 1]]
    out = patched(*positional, **{k: v for k, v in batch.items() if k not in names[: len(positional)]})
    torch.testing.assert_close(out.loss, stock(**batch).loss, rtol=1e-5, atol=1e-6)


class LogitMaskedLlama(transformers.LlamaForCausalLM):
    """An inline loss over the positions whose own logits the mask keeps (not their targets'):
    a convention flce does not follow."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            keep = attention_mask[..., :-1] != 0 if attention_mask is not None else torch.ones_like(labels[..., 1:]) > 0
            loss = F.cross_entropy(logits[..., :-1, :][keep], labels[..., 1:][keep])
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class MaskScaledLlama(transformers.LlamaForCausalLM):
    """Post-processing that depends on attention_mask (the loss_function route)."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.lm_head(hidden)
        if attention_mask is not None:
            logits = logits * (1.0 + attention_mask[..., None])
        loss = self.loss_function(logits, labels, self.vocab_size) if labels is not None else None
        return CausalLMOutputWithPast(loss=loss, logits=logits)


# --------------------------------------------------------------------------- vocabulary width


class PaddedVocabLlama(transformers.LlamaForCausalLM):
    """Keeps logits[..., :config.unpadded_vocab_size] when it is set, as Inkling does (in
    every transformers release flce supports)."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state)
        kept = getattr(self.config, "unpadded_vocab_size", None)
        if kept is not None:
            logits = logits[..., :kept]
        loss = self.loss_function(logits, labels, logits.shape[-1]) if labels is not None else None
        return CausalLMOutputWithPast(loss=loss, logits=logits)


@pytest.mark.parametrize(
    "model_type,model_class", [("inkling_text", None), ("llama", PaddedVocabLlama)], ids=["inkling_text", "llama"]
)
def test_padded_vocabulary_is_scored_over_the_kept_rows(model_type, model_class):
    """Inkling keeps logits[..., :config.unpadded_vocab_size]: the softmax runs over those."""
    hf_tiny.require_model_type(model_type)  # inkling_text came after transformers 4.56
    stock = build(model_type, model_class)
    stock.config.unpadded_vocab_size = hf_tiny.VOCAB - 16
    patched = flce_hf.apply_flce(hf_tiny.clone(stock))
    assert recipe(patched).vocab_rows == hf_tiny.VOCAB - 16
    batch = hf_tiny.inputs(stock)
    batch["input_ids"] = batch["input_ids"] % (hf_tiny.VOCAB - 16)
    batch["labels"] = torch.where(batch["labels"] < 0, batch["labels"], batch["input_ids"])
    hf_tiny.compare_with_stock(stock, patched, batch)
    # Class weights: one per kept logit, or one per row of the head (the first ones used).
    weights = torch.rand(hf_tiny.VOCAB, generator=torch.Generator().manual_seed(3)) + 0.5
    logits = stock(input_ids=batch["input_ids"]).logits
    targets = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[..., 1:].reshape(-1)
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets, weight=weights[: logits.shape[-1]])
    for given in (weights, weights[: logits.shape[-1]]):
        weighted = flce_hf.apply_flce(hf_tiny.clone(stock), ce_weight=given)
        for skip_logits in (True, False):
            torch.testing.assert_close(weighted(**batch, skip_logits=skip_logits).loss, expected)
    weighted = flce_hf.apply_flce(hf_tiny.clone(stock), ce_weight=weights[:-3])
    kept, rows = hf_tiny.VOCAB - 16, hf_tiny.VOCAB
    with pytest.raises(
        ValueError, match=rf"ce_weight must have shape \({kept},\).* or \({rows},\), one per row of its head"
    ):
        weighted(**batch)
    # The width is read from the config again when it changes.
    for model in (stock, patched):
        model.config.unpadded_vocab_size = None
    hf_tiny.compare_with_stock(stock, patched, batch)
    assert recipe(patched).vocab_rows is None


class TokenPenaltyLlama(transformers.LlamaForCausalLM):
    """Lowers some tokens' logits before the loss: not the same transform of every column."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state).clone()
        logits[..., 10:20] -= 3.0
        loss = self.loss_function(logits, labels, self.vocab_size) if labels is not None else None
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def test_edits_of_particular_vocabulary_columns_are_refused():
    model = build("llama", TokenPenaltyLlama)
    with pytest.raises(flce_hf.UnsupportedModelError, match="particular vocabulary entries"):
        flce_hf.apply_flce(model)


# --------------------------------------------------------------------------- scales read at call time


def test_learnable_logit_scale_at_one_gets_its_gradient_and_is_followed():
    stock = build("cohere")
    stock.logit_scale = torch.nn.Parameter(torch.tensor(1.0))
    patched = flce_hf.apply_flce(hf_tiny.clone(stock))
    batch = hf_tiny.inputs(stock)
    hf_tiny.compare_with_stock(stock, patched, batch)
    assert patched.logit_scale.grad is not None and patched.logit_scale.grad.abs() > 0
    with torch.no_grad():  # as an optimizer step would move it
        stock.logit_scale.fill_(0.5)
        patched.logit_scale.fill_(0.5)
    hf_tiny.compare_with_stock(stock, patched, batch)


@pytest.mark.parametrize(
    "model_type,key,before,after",
    [
        ("gemma2", "final_logit_softcapping", 30.0, 2.0),
        ("gemma2", "final_logit_softcapping", 2.0, None),
        ("granite", "logits_scaling", 1.0, 4.0),
    ],
)
def test_config_changed_after_patching_is_followed(model_type, key, before, after):
    stock = build(model_type, **{key: before})
    patched = flce_hf.apply_flce(hf_tiny.clone(stock))
    batch = hf_tiny.inputs(stock)
    for model in (stock, patched):
        setattr(model.config, key, after)
    hf_tiny.compare_with_stock(stock, patched, batch)
    assert recipe(patched).softcap == (after if "softcap" in key else None)


class AttributeSoftcapLlama(transformers.LlamaForCausalLM):
    """Soft-caps its logits by an attribute of its own that is not in its config (nor named
    like a soft-cap), as Mistral Large 4 keeps final_logit_softcapping on the model."""

    def __init__(self, config):
        super().__init__(config)
        self.cap = 5.0

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state)
        logits = self.cap * torch.tanh(logits / self.cap)
        loss = self.loss_function(logits, labels, self.vocab_size) if labels is not None else None
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class ConditionalScaleLlama(transformers.LlamaForCausalLM):
    """Scales its logits by an attribute of its own only when it is not 1."""

    def __init__(self, config):
        super().__init__(config)
        self.logit_multiplier = 1.0

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state)
        if self.logit_multiplier != 1.0:
            logits = logits * self.logit_multiplier
        loss = self.loss_function(logits, labels, self.vocab_size) if labels is not None else None
        return CausalLMOutputWithPast(loss=loss, logits=logits)


@pytest.mark.parametrize(
    "model_type,model_class,attribute,value",
    [
        ("mistral_large4", "MistralLarge4ForConditionalGeneration", "final_logit_softcapping", 2.0),
        ("inkling2_text", "Inkling2ForCausalLM", "logit_softcap.softcap", 2.0),
        ("inkling2_text", "Inkling2ForCausalLM", "logit_softcap", "a new Inkling2Softcap(2.0)"),
        ("llama", AttributeSoftcapLlama, "cap", 2.0),
        ("llama", ConditionalScaleLlama, "logit_multiplier", 0.25),
    ],
    ids=["mistral_large4", "inkling2_text", "inkling2_text_module_replaced", "softcap_attribute", "conditional_scale"],
)
def test_logit_transform_kept_on_a_module_is_followed(model_type, model_class, attribute, value):
    """A soft-cap or scale the forward reads from a module attribute (copied from the config
    at init, or not in it at all): followed when probed, and when the attribute changes
    after patching (the config does not)."""
    if isinstance(model_class, str):
        name, model_class = model_class, getattr(transformers, model_class, None)
        if model_class is None:
            pytest.skip(f"transformers {transformers.__version__} has no {name}")
    stock = build(model_type, model_class)
    patched = flce_hf.apply_flce(hf_tiny.clone(stock))
    batch = hf_tiny.inputs(stock)
    hf_tiny.compare_with_stock(stock, patched, batch)
    owner_path, _, name = attribute.rpartition(".")
    for model in (stock, patched):
        owner = model.get_submodule(owner_path)
        setattr(owner, name, type(getattr(owner, name))(2.0) if isinstance(value, str) else value)
    hf_tiny.compare_with_stock(stock, patched, batch)
    # Set before patching, away from the config's value: followed too.
    fresh = flce_hf.apply_flce(hf_tiny.clone(stock))
    hf_tiny.compare_with_stock(stock, fresh, batch)


class ScaledSoftcapLlama(transformers.LlamaForCausalLM):
    """Scales its logits, then soft-caps them (MuseSpark's output_multiplier before its
    final_logit_softcapping: c * tanh(a * z / c))."""

    def __init__(self, config):
        super().__init__(config)
        self.output_multiplier = 0.3
        self.final_logit_softcapping = 2.0

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state) * self.output_multiplier
        logits = self.final_logit_softcapping * torch.tanh(logits / self.final_logit_softcapping)
        loss = self.loss_function(logits, labels, self.vocab_size) if labels is not None else None
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def test_scale_before_a_softcap_is_followed_and_learnable():
    stock = build("llama", ScaledSoftcapLlama)
    patched = flce_hf.apply_flce(hf_tiny.clone(stock))
    assert recipe(patched).scale and recipe(patched).softcap == 2.0
    batch = hf_tiny.inputs(stock)
    hf_tiny.compare_with_stock(stock, patched, batch)
    for model in (stock, patched):  # changed after patching: read again at the call
        model.output_multiplier = 1.0
    hf_tiny.compare_with_stock(stock, patched, batch)
    for model in (stock, patched):  # a learnable one, at 1.0 when probed
        model.output_multiplier = torch.nn.Parameter(torch.tensor(1.0))
    fresh = flce_hf.apply_flce(hf_tiny.clone(stock))
    hf_tiny.compare_with_stock(stock, fresh, batch)
    assert fresh.output_multiplier.grad is not None and fresh.output_multiplier.grad.abs() > 0


class ConstantSoftcapLlama(transformers.LlamaForCausalLM):
    """Soft-caps its logits by a constant written in its code: nothing flce could watch."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state)
        logits = 7.25 * torch.tanh(logits / 7.25)
        loss = self.loss_function(logits, labels, self.vocab_size) if labels is not None else None
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def test_softcap_by_a_constant_in_the_code_is_refused():
    model = build("llama", ConstantSoftcapLlama)
    with pytest.raises(flce_hf.UnsupportedModelError, match="config entry or a module attribute"):
        flce_hf.apply_flce(model)
    assert not flce_hf.is_patched(model)


# --------------------------------------------------------------------------- encoder-decoders, labels


def test_inline_loss_whose_forward_expands_the_sequence_says_why():
    """Qwen2-Audio's legacy input format (one audio token per audio) expands the sequence and
    realigns the labels inside its forward, which flce calls without labels: a clear error.
    Its current format (the audio tokens expanded in input_ids) matches stock."""
    config = hf_tiny.tiny_config("qwen2_audio")
    config.audio_config.max_source_positions = 8
    config.ignore_index = -100  # read by the legacy path of transformers 5.25
    torch.manual_seed(0)
    stock = transformers.Qwen2AudioForConditionalGeneration(config).float().eval()
    patched = flce_hf.apply_flce(hf_tiny.clone(stock))
    frames = 2 * config.audio_config.max_source_positions
    audio = {
        "input_features": torch.randn(
            2, config.audio_config.num_mel_bins, frames, generator=torch.Generator().manual_seed(0)
        ),
        "feature_attention_mask": torch.ones(2, frames, dtype=torch.long),
    }
    audio_tower = getattr(stock, "model", stock).audio_tower  # transformers 4.56: on the model itself
    _, tokens = audio_tower._get_feat_extract_output_lengths(audio["feature_attention_mask"].sum(-1))
    for audio_tokens in (1, int(tokens[0])):  # legacy, then expanded
        batch = hf_tiny.inputs(stock, length=audio_tokens + 8)
        batch["input_ids"][:, 2 : 2 + audio_tokens] = config.audio_token_id
        batch["labels"][:, 2 : 2 + audio_tokens] = -100
        batch = {**batch, **audio, "attention_mask": torch.ones_like(batch["input_ids"])}
        if audio_tokens == 1:
            assert stock(**batch).loss.isfinite()
            with pytest.raises(ValueError, match="Qwen2AudioForConditionalGeneration computes its loss inline.*legacy"):
                patched(**batch)
        else:
            hf_tiny.compare_with_stock(stock, patched, batch)


def test_inline_loss_with_logits_to_keep_names_it():
    """Labels that do not match the kept positions: the stock loss's rule, said as such."""
    stock = build("bart")
    patched = flce_hf.apply_flce(hf_tiny.clone(stock))
    batch = hf_tiny.inputs(stock)
    if "logits_to_keep" not in inspect.signature(type(stock).forward).parameters:
        # transformers 4.56's BartForCausalLM has no logits_to_keep: refused as the stock forward refuses it.
        for model in (stock, patched):
            with pytest.raises(TypeError, match="logits_to_keep"):
                model(**batch, logits_to_keep=4)
        pytest.skip(f"BartForCausalLM takes no logits_to_keep in transformers {transformers.__version__}")
    with pytest.raises(ValueError, match="with logits_to_keep the labels must match the kept positions"):
        patched(**batch, logits_to_keep=4)
    kept = batch["labels"][:, -4:]
    out = patched(**{**batch, "labels": kept}, logits_to_keep=4)
    # The stock forward's own .view fails on the kept logits: its cross-entropy (unshifted) by hand.
    logits = stock(input_ids=batch["input_ids"], logits_to_keep=4).logits
    expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), kept.reshape(-1))
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_type", ["bart", "t5"])
def test_encoder_decoders_with_an_inline_loss_are_refused(model_type):
    """flce calls inline-loss models without labels, from which these build the decoder's inputs."""
    config = hf_tiny.tiny_config(model_type)
    config.decoder_start_token_id = 0
    model = transformers.AutoModelForSeq2SeqLM.from_config(config)
    with pytest.raises(flce_hf.UnsupportedModelError, match="encoder-decoder"):
        flce_hf.apply_flce(model)
    assert not flce_hf.is_patched(model)


@pytest.mark.parametrize(
    "model_type,auto_class", [("t5gemma2", "AutoModelForImageTextToText"), ("t5gemma", "AutoModelForSeq2SeqLM")]
)
def test_encoder_decoder_through_loss_function_keeps_its_labels(model_type, auto_class):
    """T5Gemma (2) calls loss_function: flce calls it with its labels, its decoder inputs are its own."""
    hf_tiny.require_model_type(model_type)  # t5gemma2 came after transformers 4.56
    config = hf_tiny.tiny_config(model_type)
    torch.manual_seed(0)
    stock = getattr(transformers, auto_class).from_config(config, attn_implementation="eager").eval()
    assert stock.config.is_encoder_decoder
    patched = flce_hf.apply_flce(hf_tiny.clone(stock))
    hf_tiny.compare_with_stock(stock, patched, hf_tiny.inputs(stock))


class LabelsAsInputsLlama(transformers.LlamaForCausalLM):
    """Feeds the labels to the decoder (teacher forcing from the labels) and computes its
    cross-entropy inline: called without labels, as flce calls such models, it computes
    other hidden states."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        if labels is not None:
            input_ids = labels.clamp(min=3)
        logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, self.config.vocab_size), labels[:, 1:].reshape(-1))
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class BiasedInlineLlama(transformers.LlamaForCausalLM):
    """Adds a (vocabulary,) bias to the head's output and computes its cross-entropy inline
    (as BART's final_logits_bias): the head's placeholder cannot take the bias."""

    def __init__(self, config):
        super().__init__(config)
        self.register_buffer("final_logits_bias", torch.zeros((1, config.vocab_size)))

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state) + self.final_logits_bias
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, self.config.vocab_size), labels[:, 1:].reshape(-1))
        return CausalLMOutputWithPast(loss=loss, logits=logits)


# Uses of the attention mask flce cannot follow, and inline losses it cannot call without
# labels: refused at patch time, the model left as it was.
@pytest.mark.parametrize(
    "model_class,reason",
    [
        (LogitMaskedLlama, "dropped or not"),
        (MaskScaledLlama, "differs between positions"),
        (LabelsAsInputsLlama, "uses the labels for more than that loss"),
        (BiasedInlineLlama, "that call fails"),
    ],
    ids=["inline_logit_positions", "mask_dependent_post_processing", "labels_build_inputs", "fails_as_flce_calls_it"],
)
def test_models_flce_cannot_follow_are_refused(model_class, reason):
    model = build("llama", model_class)
    with pytest.raises(flce_hf.UnsupportedModelError, match=reason):
        flce_hf.apply_flce(model)
    assert not flce_hf.is_patched(model)


# --------------------------------------------------------------------------- the caller's state


def test_probe_leaves_the_random_generators_as_they_were():
    """With dropout, a seeded run draws the same masks patched or not."""
    stock = build("gpt2", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1).train()
    stock.transformer.h[0].eval()  # e.g. a frozen block: its flag is the caller's
    batch = hf_tiny.inputs(stock)
    torch.manual_seed(0)
    expected = stock(**batch).loss
    patched = hf_tiny.clone(stock)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    flce_hf.apply_flce(patched)
    assert torch.equal(torch.get_rng_state(), state)
    assert [m.training for m in patched.modules()] == [m.training for m in stock.modules()]
    torch.testing.assert_close(patched(**batch).loss, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_probe_under_no_grad(mode):
    """apply_flce, or a class-patched model's first call with labels (an evaluation loop),
    under no_grad or inference_mode."""
    stock = build("llama")
    batch = hf_tiny.inputs(stock)
    with torch.no_grad():
        expected = stock(**batch).loss
    patched = hf_tiny.clone(stock)
    with mode():
        flce_hf.apply_flce(patched)
        torch.testing.assert_close(patched(**batch).loss, expected, rtol=1e-5, atol=1e-6)
    fresh = hf_tiny.clone(stock)
    flce_hf.patch_model_type(transformers.LlamaForCausalLM)
    try:
        with mode():
            out = fresh(**batch)
        assert out.logits is None
        torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-6)
    finally:
        flce_hf.unpatch_model_type(transformers.LlamaForCausalLM)


# --------------------------------------------------------------------------- forward wrappers


@pytest.fixture
def bf16_accelerator():
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    try:
        yield accelerate.Accelerator(mixed_precision="bf16", cpu=True)
    finally:
        AcceleratorState._reset_state(True)


def _decoder_output_dtypes(**models) -> dict:
    """A dict that each call of a model in ``models`` (by name) fills with the dtype its first
    decoder layer's MLP put out: bf16 where accelerate's autocast wrapper runs it."""
    dtypes = {}
    for name, model in models.items():
        layer = model.model.layers[0].mlp.down_proj
        layer.register_forward_hook(lambda module, args, output, name=name: dtypes.update({name: output.dtype}))
    return dtypes


def test_accelerate_mixed_precision_wrapper_is_kept(bf16_accelerator):
    """apply_flce after accelerator.prepare: the decoder still runs under its autocast."""
    stock = bf16_accelerator.prepare(build("llama"))
    patched = bf16_accelerator.prepare(hf_tiny.clone(flce_hf.unwrap_model(stock)))
    wrapped = patched.forward
    flce_hf.apply_flce(patched)
    assert flce_hf.is_patched(patched)
    dtypes = _decoder_output_dtypes(stock=stock, flce=patched)
    batch = hf_tiny.inputs(stock)
    out = patched(**batch)
    assert out.logits is None
    torch.testing.assert_close(out.loss, stock(**batch).loss, rtol=1e-5, atol=1e-6)
    assert dtypes == {"stock": torch.bfloat16, "flce": torch.bfloat16}
    # Patching again keeps them, accelerate's unwrap keeps the patch, remove_flce gives them back.
    flce_hf.apply_flce(patched, label_smoothing=0.0)
    assert patched(**batch).logits is None and dtypes["flce"] == torch.bfloat16
    flce_hf.remove_flce(patched)
    assert patched.forward == wrapped and not flce_hf.is_patched(patched)
    flce_hf.apply_flce(patched)
    unwrapped = bf16_accelerator.unwrap_model(patched, keep_fp32_wrapper=False)
    assert flce_hf.is_patched(unwrapped) and unwrapped(**batch).logits is None


def test_accelerate_wrapper_put_on_after_patching_is_kept(bf16_accelerator):
    """accelerator.prepare after apply_flce wraps flce's forward (its wrappers copy the
    forward's attributes, flce's mark included): patching again (new options) and remove_flce
    keep those wrappers; they were dropped, the model running in fp32 without a word."""
    stock = bf16_accelerator.prepare(build("llama"))
    patched = bf16_accelerator.prepare(flce_hf.apply_flce(build("llama")))  # the same weights as stock's
    dtypes = _decoder_output_dtypes(stock=stock, flce=patched)
    batch = hf_tiny.inputs(stock)
    expected = stock(**batch)
    assert patched(**batch).logits is None and dtypes == {"stock": torch.bfloat16, "flce": torch.bfloat16}
    flce_hf.apply_flce(patched, label_smoothing=0.1)
    dtypes.clear()
    smoothed = patched(**batch)
    assert smoothed.logits is None and dtypes["flce"] == torch.bfloat16
    assert not torch.allclose(smoothed.loss, expected.loss)  # the new options are in effect
    flce_hf.remove_flce(patched)
    dtypes.clear()
    out = patched(**batch)
    assert not flce_hf.is_patched(patched) and dtypes["flce"] == torch.bfloat16
    assert out.logits.dtype == torch.float32  # accelerate's conversion of the outputs is kept too
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=1e-6)


def test_instance_patch_of_a_class_patched_prepared_model_keeps_its_wrappers(bf16_accelerator):
    """A class-patched model prepared by accelerate, then patched on the instance: flce's
    instance forward goes inside accelerate's wrappers (the first of them, which copied the
    class forward's attributes, was taken for it and replaced: no autocast any more)."""
    flce_hf.patch_model_type(transformers.LlamaForCausalLM)
    try:
        model = bf16_accelerator.prepare(build("llama"))
        dtypes = []
        model.model.layers[0].mlp.down_proj.register_forward_hook(
            lambda module, args, output: dtypes.append(output.dtype)
        )
        flce_hf.apply_flce(model, label_smoothing=0.1)
        dtypes.clear()  # the probe's calls
        assert model(**hf_tiny.inputs(model)).logits is None and dtypes == [torch.bfloat16]
    finally:
        flce_hf.unpatch_model_type(transformers.LlamaForCausalLM)


def test_deep_copy_of_a_patched_prepared_model_restores_its_own_forward(bf16_accelerator):
    """apply_flce after accelerator.prepare keeps accelerate's forward to restore it; a deep
    copy of the model shares flce's forward function, and what remove_flce (or patching again)
    gave the copy back was the original model's bound forward: the copy ran the original."""
    original = flce_hf.apply_flce(bf16_accelerator.prepare(build("llama")))
    copied = copy.deepcopy(original)
    with torch.no_grad():
        for parameter in copied.parameters():
            parameter.mul_(0.5)
    batch = hf_tiny.inputs(original)
    expected = bf16_accelerator.prepare(build("llama"))
    with torch.no_grad():
        for parameter in expected.parameters():
            parameter.mul_(0.5)
    expected_loss = expected(**batch).loss
    flce_hf.apply_flce(copied, label_smoothing=0.0)
    torch.testing.assert_close(copied(**batch).loss, expected_loss, rtol=1e-5, atol=1e-6)
    flce_hf.remove_flce(copied)
    out = copied(**batch)
    assert out.logits is not None and copied.forward.__self__ is copied
    torch.testing.assert_close(out.loss, expected_loss, rtol=1e-5, atol=1e-6)


def test_instance_forward_flce_cannot_see_through_is_refused():
    model = build("llama")
    own_forward = model.forward
    model.forward = lambda *args, **kwargs: own_forward(*args, **kwargs)  # no __wrapped__ link
    with pytest.raises(flce_hf.UnsupportedModelError, match="__wrapped__"):
        flce_hf.apply_flce(model)
    assert "_flce_interceptor" not in model.__dict__


# --------------------------------------------------------------------------- adapters, dtypes, outputs


def test_peft_per_row_adapters_on_the_head_are_refused_at_the_call():
    peft = pytest.importorskip("peft", reason="peft is not installed")
    base = build("llama")

    def config():
        return peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "lm_head"])

    torch.manual_seed(5)
    stock = peft.get_peft_model(base, config())
    torch.manual_seed(9)
    stock.add_adapter("other", config())
    stock.eval()  # PEFT takes adapter_names in eval mode only
    patched = flce_hf.apply_flce(hf_tiny.clone(stock))
    batch = {**hf_tiny.inputs(base), "adapter_names": ["default", "other"]}
    with pytest.raises(ValueError, match="adapter_names= \\(PEFT's per-row adapters\\) reaches"):
        patched(**batch)
    out = patched(**batch, skip_logits=False)  # the model's own logits, one adapter per row
    torch.testing.assert_close(out.loss, stock(**batch).loss, rtol=1e-5, atol=1e-6)


def test_loss_function_replaced_after_patching_is_probed_again():
    """model.loss_type picks the stock loss function at every call, model.loss_function = f
    replaces it: either is probed again (followed or refused), not scored by the function
    found when patched, nor handed the head's placeholder."""
    stock = build("llama")
    patched = flce_hf.apply_flce(hf_tiny.clone(stock))
    batch = hf_tiny.inputs(stock)
    for model in (stock, patched):
        model.loss_type = "ForMaskedLM"  # unshifted labels
    hf_tiny.compare_with_stock(stock, patched, batch)
    assert recipe(patched).shift is False

    def own_loss(logits, labels, vocab_size, **kwargs):
        return F.cross_entropy(logits.flatten(0, -2), labels.flatten().clamp(min=0, max=3))

    patched.loss_function = own_loss
    with pytest.raises(flce_hf.UnsupportedModelError, match="its loss_function is '.*own_loss'"):
        patched(**batch)


def test_float64_model_is_refused_at_patch_time():
    model = build("llama").double()
    with pytest.raises(flce_hf.UnsupportedModelError, match="float64"):
        flce_hf.apply_flce(model)
    assert not flce_hf.is_patched(model)
    patched = flce_hf.apply_flce(build("llama"))
    patched.double()  # cast after patching: a clear error at the call
    with pytest.raises(TypeError, match="cast after patching"):
        patched(**hf_tiny.inputs(patched))


def test_shift_labels_without_labels_is_the_stock_forward():
    stock = build("llama")
    patched = flce_hf.apply_flce(hf_tiny.clone(stock))
    batch = hf_tiny.inputs(stock)
    shift_labels = F.pad(batch.pop("labels"), (0, 1), value=-100)[..., 1:]
    out, expected = patched(**batch, shift_labels=shift_labels), stock(**batch, shift_labels=shift_labels)
    assert out.loss is None and expected.loss is None
    torch.testing.assert_close(out.logits, expected.logits)
    with pytest.raises(ValueError, match="skip_logits=True needs labels"):
        patched(**batch, shift_labels=shift_labels, skip_logits=True)


def test_deep_copies_of_a_patched_model_are_independent():
    """Copies (the tests' clones, a Trainer's) carry their own probe result."""
    patched = flce_hf.apply_flce(build("gemma2", final_logit_softcapping=2.0))
    copied = copy.deepcopy(patched)
    copied.config.final_logit_softcapping = 4.0
    batch = hf_tiny.inputs(patched)
    copied(**batch)
    assert recipe(copied).softcap == 4.0 and recipe(patched).softcap == 2.0
