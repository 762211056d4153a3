"""enable_flce on TRL's SFT, GRPO and DPO trainers: flce's kernels behind TRL's fused LM head.

Three copies of each trainer see the same batch: TRL's own head (fp32, "stock"), flce's
(fp32) and an exact one (the model in float64, TRL's kernel swapped for ``ExactKernel``,
which materialises the float64 logits). The trainer's loss, the per-token log-probabilities
and entropies, every parameter gradient and the logged metrics of flce must be as close to
the exact run as stock's are (``hf_tiny._within``: ``err(flce) <= 3 err(stock) + floor``).
"""

from __future__ import annotations

import types

import pytest
import torch

trl = pytest.importorskip("trl", reason="trl is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
datasets = pytest.importorskip("datasets", reason="datasets is not installed (trl needs it)")

from flce.integrations.transformers import enable_flce  # noqa: E402
from flce.integrations.trl import (  # noqa: E402
    KNOWN_OUTPUTS,
    UnsupportedTrlSetupError,
    fused_head_owner,
    swap_fused_head_kernel,
    uses_flce_kernel,
)
from tests.integrations import hf_tiny  # noqa: E402

TEMPERATURE = 0.7  # GRPO's sampling temperature, so that the head divides by it


class ExactKernel:
    """TRL's kernel in float64 from the materialised logits: the reference."""

    def apply(self, hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs):
        assert softcap is None
        logits = torch.nn.functional.linear(hidden.double(), weight.double(), None if bias is None else bias.double())
        z = logits * logit_scale / temperature  # (N, V)
        log_p = z.log_softmax(-1)
        logprobs = log_p.gather(1, targets[:, None]).squeeze(1)
        entropy = -(log_p.exp() * log_p).sum(-1) if "entropy" in outputs else None
        with torch.no_grad():
            log_sum_sq = torch.logsumexp(2 * log_p, -1) if "log_sum_sq_probs" in outputs else None
            mean_logits = z.mean(-1) if "mean_logits" in outputs else None
            is_top1 = z.argmax(-1) == targets if "is_top1" in outputs else None
        return logprobs, entropy, log_sum_sq, mean_logits, is_top1


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(hf_tiny.VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1", unk_token="t0")


def tiny_model(model_type: str = "qwen2"):
    return hf_tiny.build(hf_tiny.tiny_config(model_type))


def token_ids(rows: int, length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, hf_tiny.VOCAB, (rows, length), generator=generator)


def common_args(tmp_path) -> dict:
    # bf16=False: TRL turns mixed precision on by default; the comparisons run in fp32.
    return {"output_dir": str(tmp_path), "report_to": [], "use_cpu": True, "save_strategy": "no", "bf16": False}


def make_exact(trainer):
    """The trainer's models in float64 with the exact kernel behind TRL's head."""
    for model in (trainer.model, getattr(trainer, "ref_model", None)):
        if model is not None:
            model.double()
            swap_fused_head_kernel(fused_head_owner(model), ExactKernel())
    return trainer


def three(make_trainer):
    """stock, flce, exact: the same trainer three times."""
    stock = make_trainer()
    flce = enable_flce(make_trainer())
    assert uses_flce_kernel(flce.model)
    assert not uses_flce_kernel(stock.model)
    trainers = {"stock": stock, "flce": flce, "exact": make_exact(make_trainer())}
    for trainer in trainers.values():
        trainer.model.train()  # the trainers log their metrics under "train" (the tiny models have no dropout)
    return trainers


def loss_and_grads(trainer, run) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = trainer.model
    model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    loss = run(trainer)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def compare(results: dict[str, tuple[torch.Tensor, dict]]) -> None:
    (loss_stock, grads_stock), (loss_flce, grads_flce), (loss_exact, grads_exact) = (
        results[name] for name in ("stock", "flce", "exact")
    )
    hf_tiny._within("loss", loss_flce, loss_stock, loss_exact)
    assert grads_stock.keys() == grads_flce.keys() == grads_exact.keys() and grads_stock
    for name, grad in grads_stock.items():
        hf_tiny._within(name, grads_flce[name], grad, grads_exact[name])


def compare_metrics(trainers, names, exact_equal=()) -> None:
    metrics = {run: {k: v[0] for k, v in t._metrics["train"].items()} for run, t in trainers.items()}
    for name in names:
        values = {run: torch.tensor(metrics[run][name], dtype=torch.float64) for run in metrics}
        if name in exact_equal:
            assert values["flce"] == values["exact"], name
        else:
            hf_tiny._within(name, values["flce"], values["stock"], values["exact"])


def compare_per_token(trainers, model_inputs: dict, fields: tuple[str, ...]) -> None:
    with torch.no_grad():
        outputs = {run: t.model(**model_inputs, fused_lm_head=True) for run, t in trainers.items()}
    for field in fields:
        stock, flce, exact = (getattr(outputs[run], field) for run in ("stock", "flce", "exact"))
        if field == "is_top1":
            assert torch.equal(flce, exact)
        else:
            assert flce.dtype == stock.dtype
            hf_tiny._within(field, flce, stock, exact)
    assert torch.equal(outputs["flce"].label_mask, outputs["exact"].label_mask)


# --------------------------------------------------------------------------- the head alone


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("model_type", ["qwen2", "cohere"])  # cohere: a logit scale folded into the temperature
def test_fused_head_outputs_and_gradients(model_type, backend):
    """Every output TRL's head can be asked for, with upstream gradients on both
    differentiable ones, at a temperature, the compact (labelled rows only) path."""
    stock = tiny_model(model_type)
    models = {"stock": stock, "flce": hf_tiny.clone(stock), "exact": hf_tiny.clone(stock).double()}
    for model in models.values():
        trl.trainer.utils.add_fused_lm_head(model, temperature=TEMPERATURE, outputs=KNOWN_OUTPUTS)
    swap_fused_head_kernel(fused_head_owner(models["exact"]), ExactKernel())
    from flce.integrations.trl import FlceLogProbKernel, TrlHeadOptions

    swap_fused_head_kernel(fused_head_owner(models["flce"]), FlceLogProbKernel(TrlHeadOptions(backend=backend)))
    input_ids = token_ids(2, 9, seed=3)
    labels = input_ids.clone()
    with torch.no_grad():  # every other label the top-1 token, so is_top1 holds both values
        labels[:, 1::2] = models["stock"](input_ids=input_ids).logits.argmax(-1)[:, 0::2][:, : labels[:, 1::2].size(1)]
    labels[0, :4] = -100
    labels[1, -3:] = -100
    upstream = torch.randn(2, 8, 2, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    results, outputs = {}, {}
    for run, model in models.items():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=input_ids, labels=labels, fused_lm_head=True)
        weights = upstream.to(out.log_probs.dtype)
        objective = (out.log_probs * weights[..., 0] + out.entropy * weights[..., 1]).sum() + out.loss
        objective.backward()
        outputs[run] = out
        results[run] = (objective.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    compare(results)
    for field in ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits"):
        hf_tiny._within(field, *(getattr(outputs[run], field) for run in ("flce", "stock", "exact")))
    assert torch.equal(outputs["flce"].is_top1, outputs["exact"].is_top1)
    assert outputs["flce"].is_top1.any() and not outputs["flce"].is_top1.all()
    # Generation and calls without fused_lm_head are the model's own.
    plain = {run: models[run](input_ids=input_ids).logits for run in ("stock", "flce")}
    torch.testing.assert_close(plain["flce"], plain["stock"], rtol=0, atol=0)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_bf16_hidden_states_under_a_head_of_another_dtype(weight_dtype):
    """A bf16 backbone under a head whose weight or bias is kept in fp32, without autocast:
    TRL's kernel projects in the hidden states' dtype and accumulates the head's gradients
    in fp32, so an fp32 weight or bias gets its gradient unrounded, as exact as TRL's."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    from flce.integrations.trl import FlceLogProbKernel, TrlHeadOptions

    generator = torch.Generator().manual_seed(15)
    hidden = torch.randn(1, hf_tiny.HIDDEN, generator=generator).bfloat16()  # one token: the head's gradient is
    # one outer product, not a sum in which the bf16 rounding of the logits would average out
    weight = (torch.randn(hf_tiny.VOCAB, hf_tiny.HIDDEN, generator=generator) / 50).to(weight_dtype)
    bias = torch.randn(hf_tiny.VOCAB, generator=generator) / 50
    targets = torch.randint(0, hf_tiny.VOCAB, (1,), generator=generator)
    upstream = torch.randn(2, 1, generator=generator, dtype=torch.float64)
    names = ("hidden", "weight", "bias")
    kernels = {"stock": ChunkedLogProbFunction, "flce": FlceLogProbKernel(TrlHeadOptions()), "exact": ExactKernel()}
    results, outputs = {}, {}
    for run, kernel in kernels.items():
        leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
        outputs[run] = kernel.apply(*leaves, targets, TEMPERATURE, 64, None, 1.0, KNOWN_OUTPUTS)
        objective = (outputs[run][0].double() * upstream[0] + outputs[run][1].double() * upstream[1]).sum()
        objective.backward()
        results[run] = (objective.detach(), {name: t.grad for name, t in zip(names, leaves, strict=True)})
    for name, tensor in zip(names, (hidden, weight, bias), strict=True):
        assert results["flce"][1][name].dtype == tensor.dtype
    compare(results)
    for index, field in enumerate(KNOWN_OUTPUTS[:4]):
        hf_tiny._within(field, *(outputs[run][index] for run in ("flce", "stock", "exact")))


def test_log_sum_sq_probs_of_unlikely_labels():
    """WPO's ``log(sum_v p_v^2)`` lies in ``[-log V, 0]`` whatever the label; from a label
    hundreds of nats below the top token (a peaked distribution at a low temperature) it
    must not be the difference of two such magnitudes."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    from flce.integrations.trl import FlceLogProbKernel, TrlHeadOptions

    generator = torch.Generator().manual_seed(17)
    hidden = torch.randn(6, hf_tiny.HIDDEN, generator=generator) * 8
    weight = torch.randn(hf_tiny.VOCAB, hf_tiny.HIDDEN, generator=generator)
    targets = (hidden @ weight.T).argmin(-1)  # the least likely token of each row
    kernels = {"stock": ChunkedLogProbFunction, "flce": FlceLogProbKernel(TrlHeadOptions()), "exact": ExactKernel()}
    outputs = {
        run: kernel.apply(hidden, weight, None, targets, 0.5, 64, None, 1.0, KNOWN_OUTPUTS)
        for run, kernel in kernels.items()
    }
    assert (outputs["exact"][0] < -100).all()
    hf_tiny._within("log_sum_sq_probs", *(outputs[run][2] for run in ("flce", "stock", "exact")))


def test_all_labels_ignored_gives_a_differentiable_zero():
    stock = tiny_model()
    trl.trainer.utils.add_fused_lm_head(stock, outputs=("log_probs", "entropy"))
    from flce.integrations.trl import FlceLogProbKernel, TrlHeadOptions

    swap_fused_head_kernel(fused_head_owner(stock), FlceLogProbKernel(TrlHeadOptions()))
    input_ids = token_ids(2, 6, seed=5)
    out = stock(input_ids=input_ids, labels=torch.full_like(input_ids, -100), fused_lm_head=True)
    assert out.loss.item() == 0 and not out.log_probs.any() and not out.entropy.any()
    out.loss.backward()
    assert all(p.grad is None or not p.grad.any() for p in stock.parameters())


def test_compiled_models_with_and_without_flce_in_one_process():
    """torch.compile caches per code object and puts its compiled functions in the frame's
    globals: models given flce's kernel must not share TRL's forward code with each other
    or with TRL's own head, or the second compiled model runs code compiled for another's
    globals."""
    from flce.integrations.trl import FlceLogProbKernel, TrlHeadOptions

    base = tiny_model()
    input_ids = token_ids(2, 7, seed=18)
    logprobs = []
    torch._dynamo.reset()
    for with_flce in (True, True, False):
        model = hf_tiny.clone(base)
        trl.trainer.utils.add_fused_lm_head(model, outputs=KNOWN_OUTPUTS)
        if with_flce:
            swap_fused_head_kernel(fused_head_owner(model), FlceLogProbKernel(TrlHeadOptions()))
        assert uses_flce_kernel(model) == with_flce
        compiled = torch.compile(model, backend="eager")
        logprobs.append(compiled(input_ids=input_ids, labels=input_ids, fused_lm_head=True).log_probs)
    for other in logprobs[1:]:
        torch.testing.assert_close(other, logprobs[0])


# --------------------------------------------------------------------------- the trainers


def test_sft_trainer(tmp_path):
    dataset = datasets.Dataset.from_dict({"input_ids": token_ids(2, 8, seed=6).tolist()})
    args = trl.SFTConfig(**common_args(tmp_path), per_device_train_batch_size=2)
    stock_model = tiny_model()

    def make():
        model = hf_tiny.clone(stock_model)
        return trl.SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer())

    trainers = three(make)
    input_ids = token_ids(2, 10, seed=7)
    labels = input_ids.clone()
    labels[0, :3] = -100  # a prompt
    labels[1, -2:] = -100  # padding
    attention_mask = (labels != -100).long()
    attention_mask[0] = 1
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    results = {run: loss_and_grads(t, lambda t: t.compute_loss(t.model, dict(batch))) for run, t in trainers.items()}
    compare(results)
    compare_metrics(trainers, ("entropy", "mean_token_accuracy"), exact_equal=("mean_token_accuracy",))
    compare_per_token(trainers, batch, ("log_probs", "entropy", "is_top1"))


def test_grpo_trainer(tmp_path):
    model_dir = tmp_path / "model"
    tiny_model().save_pretrained(model_dir)  # GRPO loads its reference model from the model's path
    args = trl.GRPOConfig(
        **common_args(tmp_path),
        beta=0.1,  # a KL term, so the reference model's head runs too
        temperature=TEMPERATURE,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
    )
    dataset = datasets.Dataset.from_dict({"prompt": ["t5 t6 t7", "t8 t9"]})

    def make():
        trainer = trl.GRPOTrainer(
            model=str(model_dir),
            reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer(),
        )
        trainer.current_gradient_accumulation_steps = 1  # train() sets it; the loss is called directly here
        return trainer

    trainers = three(make)
    assert uses_flce_kernel(trainers["flce"].ref_model)
    prompt_ids, completion_ids = token_ids(3, 4, seed=8), token_ids(3, 5, seed=9)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[2, :2] = 0  # left padding
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, -2:] = 0  # an early end
    input_ids, attention_mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    batch = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.0, -0.5, 0.25]),
        "num_items_in_batch": completion_mask.sum(),
    }

    def grpo_loss(trainer):
        with torch.no_grad():  # as _generate_and_score_completions, from each trainer's own reference model
            ref_logps = trainer._get_per_token_logps_and_entropies(
                trainer.ref_model, input_ids, attention_mask, completion_ids.size(1)
            )[0]
        old_logps = ref_logps + 0.05  # off-policy, so the ratios differ from 1 (clipping included)
        return trainer.compute_loss(
            trainer.model, {**batch, "ref_per_token_logps": ref_logps, "old_per_token_logps": old_logps}
        )

    results = {run: loss_and_grads(t, grpo_loss) for run, t in trainers.items()}
    compare(results)
    compare_metrics(trainers, ("entropy", "kl"))
    per_token = {
        run: t._get_per_token_logps_and_entropies(
            t.model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True
        )
        for run, t in trainers.items()
    }
    for index, field in enumerate(("per-token logps", "entropy")):
        hf_tiny._within(field, *(per_token[run][index].detach() for run in ("flce", "stock", "exact")))


def test_reference_model_wrapped_for_mixed_precision(tmp_path, monkeypatch):
    """With mixed precision (TRL's default) the trainer's accelerator wraps the reference
    model's forward while the trainer is built; flce's kernel goes inside the wrappers (and
    into the forward accelerate keeps as the original)."""
    from flce.integrations import trl as flce_trl

    model_dir = tmp_path / "model"
    tiny_model().save_pretrained(model_dir)
    args = trl.GRPOConfig(**{**common_args(tmp_path), "bf16": True}, beta=0.1, num_generations=2)
    trainer = trl.GRPOTrainer(
        model=str(model_dir),
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": ["t5 t6"] * 2}),
        processing_class=tokenizer(),
    )
    ref_model = trainer.ref_model
    assert len(flce_trl._wrapper_chain(ref_model.forward)) > 1  # accelerate's wrappers are there
    enable_flce(trainer)
    assert uses_flce_kernel(ref_model) and uses_flce_kernel(trainer.model)
    import flce

    calls, logprobs = [], flce.fused_linear_logprobs
    monkeypatch.setattr(flce, "fused_linear_logprobs", lambda *a, **k: calls.append(1) or logprobs(*a, **k))
    input_ids = token_ids(2, 6, seed=13)
    with torch.no_grad():
        out = ref_model(input_ids=input_ids, labels=input_ids, fused_lm_head=True)
    assert calls and out.log_probs.dtype == torch.float32 and torch.isfinite(out.log_probs).all()
    original = ref_model._original_forward.__func__  # what accelerate keeps of the unwrapped forward
    assert isinstance(original.__globals__[flce_trl.KERNEL_NAME], flce_trl.FlceLogProbKernel)


def test_dpo_trainer(tmp_path):
    args = trl.DPOConfig(**common_args(tmp_path), per_device_train_batch_size=2, use_weighting=True)  # + WPO weights
    dataset = datasets.Dataset.from_dict({"prompt": ["t5 t6"], "chosen": ["t7"], "rejected": ["t8"]})
    stock_model = tiny_model()

    def make():
        return trl.DPOTrainer(
            model=hf_tiny.clone(stock_model),
            ref_model=hf_tiny.clone(stock_model),
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer(),
        )

    trainers = three(make)
    assert uses_flce_kernel(trainers["flce"].ref_model)
    # Two pairs: rows [chosen_0, chosen_1, rejected_0, rejected_1], prompts then completions.
    input_ids = token_ids(4, 9, seed=10)
    completion_mask = torch.zeros_like(input_ids)
    completion_mask[[0, 2], 3:] = 1
    completion_mask[[1, 3], 4:8] = 1
    attention_mask = torch.ones_like(input_ids)
    attention_mask[[1, 3], 8:] = 0
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "completion_mask": completion_mask}
    with torch.no_grad():  # the reference model differs from the policy, so the log-ratios are not 0
        for t in trainers.values():
            for p in t.ref_model.parameters():
                p.mul_(0.9)
    results = {run: loss_and_grads(t, lambda t: t.compute_loss(t.model, dict(batch))) for run, t in trainers.items()}
    compare(results)
    metric_names = [name for name in trainers["stock"]._metrics["train"] if name.startswith(("logits/", "logps/"))]
    assert metric_names
    compare_metrics(trainers, (*metric_names, "entropy", "mean_token_accuracy"), exact_equal=("mean_token_accuracy",))
    labels = input_ids.masked_fill(completion_mask == 0, -100)
    compare_per_token(
        trainers,
        {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels},
        ("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs"),
    )


# --------------------------------------------------------------------------- refusals


def test_other_trl_trainers_are_refused_by_name():
    for trainer_class in (trl.RLOOTrainer, trl.KTOTrainer):
        with pytest.raises(NotImplementedError, match=trainer_class.__name__):
            enable_flce(object.__new__(trainer_class))
    # A TRL trainer derived from a supported one is not the supported one.
    derived = type("ExperimentalGRPOTrainer", (trl.GRPOTrainer,), {"__module__": "trl.experimental.example"})
    with pytest.raises(NotImplementedError, match="ExperimentalGRPOTrainer"):
        enable_flce(object.__new__(derived))


def test_options_user_subclass_and_softcap(tmp_path):
    args = trl.SFTConfig(**common_args(tmp_path))
    dataset = datasets.Dataset.from_dict({"input_ids": token_ids(2, 8, seed=11).tolist()})
    user_class = type("MySFTTrainer", (trl.SFTTrainer,), {})  # a user's subclass is covered
    trainer = user_class(model=tiny_model(), args=args, train_dataset=dataset, processing_class=tokenizer())
    with pytest.raises(TypeError, match="label_smoothing"):
        enable_flce(trainer, label_smoothing=0.1)
    with pytest.raises(ValueError, match="backend"):
        enable_flce(trainer, backend="no-such-backend")
    with pytest.raises(ValueError, match="cutedsl.*logprobs"):  # a backend without logprobs kernels, refused now
        enable_flce(trainer, backend="cutedsl")
    assert not uses_flce_kernel(trainer.model)
    enable_flce(trainer, backend="torch", chunk_size=4)
    assert uses_flce_kernel(trainer.model)

    # DeepSpeed ZeRO-3 gathers the head's weight for TRL's forward only: flce's backward would
    # read a partitioned weight. Refused whether configured or already partitioning.
    zero3 = user_class(model=tiny_model(), args=args, train_dataset=dataset, processing_class=tokenizer())
    zero3.accelerator = types.SimpleNamespace(
        state=types.SimpleNamespace(deepspeed_plugin=types.SimpleNamespace(zero_stage=3))
    )
    with pytest.raises(UnsupportedTrlSetupError, match="ZeRO-3"):
        enable_flce(zero3)
    partitioned = user_class(model=tiny_model(), args=args, train_dataset=dataset, processing_class=tokenizer())
    partitioned.model.get_output_embeddings().weight.ds_id = 0
    with pytest.raises(UnsupportedTrlSetupError, match="ZeRO-3"):
        enable_flce(partitioned)
    assert not uses_flce_kernel(zero3.model) and not uses_flce_kernel(partitioned.model)

    # Outputs flce does not compute (a later TRL's), refused when enabling, not at the first forward.
    unknown_output = user_class(model=tiny_model(), args=args, train_dataset=dataset, processing_class=tokenizer())
    trl.trainer.utils.add_fused_lm_head(unknown_output.model, outputs=("log_probs", "top_k_logprobs"))
    with pytest.raises(UnsupportedTrlSetupError, match="top_k_logprobs"):
        enable_flce(unknown_output)
    assert not uses_flce_kernel(unknown_output.model)

    gemma = trl.SFTTrainer(model=tiny_model("gemma2"), args=args, train_dataset=dataset, processing_class=tokenizer())
    with pytest.raises(UnsupportedTrlSetupError, match="soft-caps"):
        enable_flce(gemma)
    assert not uses_flce_kernel(gemma.model)


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, "torch", "triton"])
def test_fused_head_bf16_on_gpu(backend):
    """On CUDA TRL's own head runs its Triton kernel; flce's (bf16 model, every backend) must
    be as close to the float64 head as TRL's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from flce.integrations.trl import FlceLogProbKernel, TrlHeadOptions

    stock = tiny_model().cuda()
    models = {"stock": stock.bfloat16(), "flce": hf_tiny.clone(stock), "exact": hf_tiny.clone(stock).double()}
    for model in models.values():
        trl.trainer.utils.add_fused_lm_head(model, temperature=TEMPERATURE, outputs=KNOWN_OUTPUTS)
    swap_fused_head_kernel(fused_head_owner(models["exact"]), ExactKernel())
    swap_fused_head_kernel(fused_head_owner(models["flce"]), FlceLogProbKernel(TrlHeadOptions(backend=backend)))
    input_ids = token_ids(4, 33, seed=12).cuda()
    labels = input_ids.clone()
    labels[:, :5] = -100
    results = {}
    for run, model in models.items():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=input_ids, labels=labels, fused_lm_head=True)
        (out.loss + out.entropy.sum()).backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        results[run] = (out.loss.detach().float(), grads)
    compare(results)
