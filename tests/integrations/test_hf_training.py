"""Patched models in the ways they are trained and evaluated: torch.compile(fullgraph=True),
gradient checkpointing, evaluation without logits, the HF Trainer through enable_flce, and
vision-language models as AutoModelForCausalLM / AutoModelForImageTextToText load them."""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from flce.integrations import transformers as flce_hf  # noqa: E402
from tests.integrations import hf_tiny  # noqa: E402


def llama():
    stock = hf_tiny.build(hf_tiny.tiny_config("llama"))
    return stock, flce_hf.apply_flce(hf_tiny.clone(stock))


def test_compile_fullgraph_without_graph_breaks():
    stock, patched = llama()
    batch = hf_tiny.inputs(stock)
    assert torch._dynamo.explain(patched)(**batch).graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(patched, fullgraph=True, backend="aot_eager")
    out = compiled(**batch)
    assert out.logits is None
    expected = stock(**batch).loss
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    expected.backward()
    for (name, p_stock), (_, p_flce) in zip(stock.named_parameters(), patched.named_parameters(), strict=True):
        torch.testing.assert_close(p_flce.grad, p_stock.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_compile_of_class_patched_model_says_to_probe_first():
    stock = hf_tiny.build(hf_tiny.tiny_config("llama"))
    batch = hf_tiny.inputs(stock)
    flce_hf.patch_model_type(transformers.LlamaForCausalLM)
    try:
        torch._dynamo.reset()
        compiled = torch.compile(stock, fullgraph=True, backend="eager")
        with pytest.raises(Exception, match="has not been probed yet"):
            compiled(**batch)
        stock(**batch)  # one eager call with labels probes the instance
        torch._dynamo.reset()
        assert torch.compile(stock, fullgraph=True, backend="eager")(**batch).logits is None
    finally:
        flce_hf.unpatch_model_type(transformers.LlamaForCausalLM)


class AttributeSoftcapLlama(transformers.LlamaForCausalLM):
    """Soft-caps its logits by an attribute of its own, not in its config."""

    def __init__(self, config):
        super().__init__(config)
        self.cap = 5.0

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state)
        logits = self.cap * torch.tanh(logits / self.cap)
        loss = self.loss_function(logits, labels, self.vocab_size) if labels is not None else None
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


@pytest.mark.parametrize("where", ["config", "module attribute"])
def test_compiled_model_whose_softcap_changes_says_to_probe_again(where):
    """A soft-cap changed after compiling: a clear error naming it (not a trace failure on
    the new value), then one eager call with labels probes again and compiling matches stock."""
    if where == "config":
        stock = hf_tiny.build(hf_tiny.tiny_config("gemma2"))
        owner, name, expected = stock.config, "final_logit_softcapping", "config.final_logit_softcapping"
    else:
        torch.manual_seed(0)
        stock = AttributeSoftcapLlama(hf_tiny.tiny_config("llama")).eval()
        owner, name, expected = stock, "cap", "the attribute cap"
    patched = flce_hf.apply_flce(hf_tiny.clone(stock))
    batch = hf_tiny.inputs(stock)
    torch._dynamo.reset()
    compiled = torch.compile(patched, fullgraph=True, backend="eager")
    compiled(**batch)
    for model_owner in (owner, patched.config if where == "config" else patched):
        setattr(model_owner, name, 2.0)
    # The check traced on every compiled call gives the name alone (torch 2.11's dynamo
    # failed on handling the values and the missing-value sentinel, before flce's message).
    assert flce_hf.unwrap_model(patched)._flce_interceptor.recipe.changed_entry(patched) == expected
    with pytest.raises(Exception, match=f"{expected} of {type(stock).__name__} changed since it was probed"):
        compiled(**batch)
    patched(**batch)  # one eager call with labels probes again
    torch._dynamo.reset()
    compiled = torch.compile(patched, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(**batch).loss, stock(**batch).loss, rtol=1e-5, atol=1e-6)


def test_gradient_checkpointing():
    stock, patched = llama()
    for model in (stock, patched):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    hf_tiny.compare_with_stock(stock, patched, hf_tiny.inputs(stock))


VISION_LANGUAGE = ["gemma3", "llava", "mllama", "mistral3", "paligemma"]


@pytest.mark.parametrize("model_type", VISION_LANGUAGE)
def test_vision_language_models(model_type):
    """Text-only batches through the multimodal class AutoModelForImageTextToText loads."""
    config = hf_tiny.tiny_config(model_type)
    if model_type == "mllama" and config.text_config.rope_scaling is None:
        # transformers 4.56's default MllamaTextConfig has no rope_scaling, which its rotary
        # embedding indexes (released checkpoints carry one; 5.x defaults to this one).
        config.text_config.rope_scaling = {"rope_type": "default"}
    torch.manual_seed(0)
    stock = transformers.AutoModelForImageTextToText.from_config(config, attn_implementation="eager").eval()
    patched = flce_hf.apply_flce(hf_tiny.clone(stock))
    hf_tiny.compare_with_stock(stock, patched, hf_tiny.inputs(stock))


def test_patch_model_type_gemma3_patches_what_auto_loads():
    config = hf_tiny.tiny_config("gemma3")
    stock = hf_tiny.build(config)
    assert type(stock) is transformers.Gemma3ForConditionalGeneration
    batch = hf_tiny.inputs(stock)
    expected = stock(**batch).loss
    (cls,) = flce_hf.patch_model_type("gemma3")
    try:
        assert cls is transformers.Gemma3ForConditionalGeneration and flce_hf.is_patched(stock)
        loaded = hf_tiny.build(config)  # a fresh AutoModelForCausalLM model of the patched class
        out = loaded(**batch)
        assert out.logits is None
        torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-6)
    finally:
        flce_hf.unpatch_model_type("gemma3")


# --------------------------------------------------------------------------- Trainer


class Rows(torch.utils.data.Dataset):
    def __init__(self, model, rows=8):
        batch = hf_tiny.inputs(model, rows=rows, length=12)
        self.rows = [
            {"input_ids": i, "labels": lab} for i, lab in zip(batch["input_ids"], batch["labels"], strict=True)
        ]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def make_trainer(model, tmp_path, name, **arguments):
    pytest.importorskip("accelerate", reason="the HF Trainer needs accelerate")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
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
        **arguments,
    )
    rows = Rows(model)
    return transformers.Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows)


def token_accuracy(prediction):
    logits, labels = prediction
    predicted = logits[:, :-1].argmax(-1)
    targets = labels[:, 1:]
    mask = targets != -100
    return {"accuracy": float((predicted == targets)[mask].mean())}


def test_enable_flce_trains_and_evaluates_like_stock(tmp_path):
    stock, _ = llama()
    flce_model = hf_tiny.clone(stock)
    reference = make_trainer(stock, tmp_path, "stock")
    trainer = flce_hf.enable_flce(make_trainer(flce_model, tmp_path, "flce"))
    assert flce_hf.is_patched(trainer.model)

    # Evaluation with the loss only (prediction_loss_only): no logits computed, the stock loss.
    eval_stock = reference.evaluate()
    trainer.args.prediction_loss_only = True
    loss_only = trainer.evaluate()
    assert loss_only["eval_loss"] == pytest.approx(eval_stock["eval_loss"], rel=1e-5)

    # Metrics from the logits: the trainer asks for them, and gets the model's own.
    reference.args.prediction_loss_only = trainer.args.prediction_loss_only = False
    reference.compute_metrics = trainer.compute_metrics = token_accuracy
    with_metrics, with_metrics_stock = trainer.evaluate(), reference.evaluate()
    assert with_metrics["eval_accuracy"] == with_metrics_stock["eval_accuracy"]
    assert with_metrics["eval_loss"] == pytest.approx(with_metrics_stock["eval_loss"], rel=1e-5)

    reference.train()
    trainer.train()
    losses = [[log["loss"] for log in t.state.log_history if "loss" in log] for t in (reference, trainer)]
    assert len(losses[0]) == 2 and all(math.isfinite(x) for x in losses[0])
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)


def test_enable_flce_refuses_trl_trainers(tmp_path):
    """TRL's trainers run their own fused LM head; flce must not replace it (TRL is not
    imported): a class of TRL's that flce does not know is refused for its fused head where
    TRL is installed, and any TRL class for TRL being absent where it is not."""
    import importlib.util

    SFTTrainer = type("SFTTrainer", (transformers.Trainer,), {"__module__": "trl.trainer.sft_trainer"})
    stock, _ = llama()
    trainer = make_trainer(stock, tmp_path, "sft")
    trainer.__class__ = SFTTrainer
    reason = (
        "fused_lm_head" if importlib.util.find_spec("trl") else "built on TRL's SFTTrainer, but TRL cannot be imported"
    )
    with pytest.raises(NotImplementedError, match=reason):
        flce_hf.enable_flce(trainer)
    assert not flce_hf.is_patched(stock)
