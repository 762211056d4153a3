#!/usr/bin/env python
"""GRPO-style policy steps on a tiny Qwen2 with ``flce.fused_linear_logprobs``: the
completions' log-probabilities and entropies come from the LM head's hidden states
without materializing the (tokens x vocab) logits.

Each step samples ``--group-size`` completions per prompt from the policy, scores them
with a verifiable synthetic reward (the fraction of completion tokens in the lowest
quarter of the vocabulary), normalizes the rewards within each group (the advantages),
and takes ``--epochs`` clipped policy-gradient updates on the batch:

    ratio  = exp(logprobs - old_logprobs)                      per completion token
    loss   = -mean(min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)) - entropy_coef * mean(entropy)

The model is built from a config (random weights, no download); the mean reward rises
within a few dozen steps.

    python examples/grpo_step.py --steps 30                     # flce logprobs
    python examples/grpo_step.py --steps 30 --logprobs eager    # materialized logits, to compare
    python examples/grpo_step.py --device cuda --dtype bfloat16 --vocab-size 151936
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
IGNORE = -100  # target of the prompt positions: they get no logprob and no gradient


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--logprobs", choices=("flce", "eager"), default="flce", help="eager: materialized logits")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="autocast dtype; default bf16 on CUDA")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8, help="completions sampled per prompt")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--completion-len", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (the logprobs use it too)")
    p.add_argument("--epochs", type=int, default=2, help="updates per sampled batch")
    p.add_argument("--clip-eps", type=float, default=0.2)
    p.add_argument("--entropy-coef", type=float, default=0.01)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default=None, help="flce backend (torch, triton; default: auto)")
    args = p.parse_args(argv)
    if args.dtype is None:
        args.dtype = "bfloat16" if str(args.device).startswith("cuda") else "float32"
    sizes = (args.steps, args.num_prompts, args.epochs, args.prompt_len, args.completion_len)
    if min(*sizes, args.vocab_size, args.hidden_size, args.layers) < 1 or args.group_size < 2:
        p.error("need positive sizes and --group-size >= 2 (advantages are relative to the group)")
    return args


def _import_flce():
    try:
        import flce
    except ImportError:  # running from a checkout without installing the package
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
        import flce
    return flce


def build_policy(args: argparse.Namespace):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    heads = max(1, args.hidden_size // 32)
    config = Qwen2Config(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=4 * args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=args.prompt_len + args.completion_len,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    return Qwen2ForCausalLM(config)


@torch.no_grad()
def sample(policy, prompts: torch.Tensor, length: int, temperature: float, generator: torch.Generator):
    """``length`` tokens per prompt from ``softmax(logits / temperature)`` (only the last
    position's logits exist: a (batch, V) tensor per token)."""
    sequences = prompts
    for _ in range(length):
        logits = policy(input_ids=sequences).logits[:, -1].float() / temperature
        probabilities = torch.softmax(logits, dim=-1)
        next_token = torch.multinomial(probabilities.cpu(), 1, generator=generator).to(sequences.device)
        sequences = torch.cat([sequences, next_token], dim=1)
    return sequences


def reward(completions: torch.Tensor, vocab: int) -> torch.Tensor:
    """A verifiable reward in [0, 1]: the fraction of tokens in the lowest quarter of the vocabulary."""
    return (completions < vocab // 4).float().mean(dim=1)


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each reward relative to its prompt's group: (r - mean) / (std + 1e-4)."""
    grouped = rewards.view(-1, group_size)
    normalized = (grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + 1e-4)
    return normalized.reshape(-1)


def token_logprobs(flce, policy, sequences, targets, args):
    """(logprobs, entropy), each (B, L - 1), of ``targets`` (the next tokens, IGNORE on the
    prompt) under the policy at ``args.temperature``."""
    hidden = policy.model(input_ids=sequences).last_hidden_state[:, :-1]  # (B, L - 1, H)
    head = policy.lm_head
    if args.logprobs == "flce":
        out = flce.fused_linear_logprobs(
            hidden,
            head.weight,
            targets,
            bias=head.bias,
            temperature=args.temperature,
            return_entropy=True,
            ignore_index=IGNORE,
            backend=args.backend,
        )
        return out.logprobs, out.entropy
    log_p = torch.log_softmax(head(hidden).float() / args.temperature, dim=-1)  # (B, L - 1, V)
    valid = targets != IGNORE
    logprobs = log_p.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1) * valid
    entropy = -(log_p.exp() * log_p).sum(dim=-1) * valid
    return logprobs, entropy


def grpo_loss(logprobs, old_logprobs, advantages, entropy, mask, clip_eps: float, entropy_coef: float):
    """The clipped surrogate with an entropy bonus, averaged over the completion tokens."""
    ratio = torch.exp(logprobs - old_logprobs)
    advantage = advantages[:, None]
    surrogate = torch.minimum(ratio * advantage, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantage)
    per_token = -surrogate - entropy_coef * entropy
    return (per_token * mask).sum() / mask.sum()


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    flce = _import_flce()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    policy = build_policy(args).to(device)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed + 1)
    autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype != torch.float32 else contextlib.nullcontext
    batch = args.num_prompts * args.group_size
    print(
        f"tiny qwen2 policy: {sum(p.numel() for p in policy.parameters()) / 1e6:.2f}M params, vocab "
        f"{args.vocab_size} | logprobs={args.logprobs} device={device} dtype={args.dtype} | "
        f"{args.num_prompts} prompts x {args.group_size} completions of {args.completion_len} tokens",
        flush=True,
    )
    rewards_history, losses = [], []
    for step in range(1, args.steps + 1):
        started = time.perf_counter()
        prompts = torch.randint(0, args.vocab_size, (args.num_prompts, args.prompt_len), generator=generator)
        prompts = prompts.repeat_interleave(args.group_size, dim=0).to(device)  # (B, P)
        policy.eval()
        with autocast():
            sequences = sample(policy, prompts, args.completion_len, args.temperature, generator)  # (B, P + C)
        policy.train()
        rewards = reward(sequences[:, args.prompt_len :], args.vocab_size)
        advantages = group_advantages(rewards, args.group_size)
        targets = sequences[:, 1:].clone()  # (B, L - 1): position t predicts token t + 1
        targets[:, : args.prompt_len - 1] = IGNORE  # the prompt is given, not sampled
        mask = (targets != IGNORE).float()
        with torch.no_grad(), autocast():
            old_logprobs, _ = token_logprobs(flce, policy, sequences, targets, args)
        for _ in range(args.epochs):
            with autocast():
                logprobs, entropy = token_logprobs(flce, policy, sequences, targets, args)
                loss = grpo_loss(logprobs, old_logprobs, advantages, entropy, mask, args.clip_eps, args.entropy_coef)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        rewards_history.append(rewards.mean().item())
        mean_entropy = ((entropy.detach() * mask).sum() / mask.sum()).item()
        tokens_per_s = batch * args.completion_len * args.epochs / (time.perf_counter() - started)
        print(
            f"step {step:4d} | reward {rewards_history[-1]:.3f} | loss {losses[-1]:+.4f} | entropy "
            f"{mean_entropy:.3f} | {tokens_per_s:,.0f} trained tokens/s",
            flush=True,
        )
    print(f"done: mean reward {rewards_history[0]:.3f} -> {rewards_history[-1]:.3f}", flush=True)
    return {"rewards": rewards_history, "losses": losses}


if __name__ == "__main__":
    main()
