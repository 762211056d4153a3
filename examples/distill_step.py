#!/usr/bin/env python
"""Knowledge-distillation steps from a tiny Qwen2 teacher into a smaller Qwen2 student
with ``flce.fused_linear_distillation``: the divergence between the two LM heads'
next-token distributions, from their hidden states, without materializing either
(tokens x vocab) logits tensor.

With ``q`` the student's and ``p`` the teacher's softmax at ``--temperature`` and
``M = beta p + (1 - beta) q``, each token's loss is the generalized Jensen-Shannon
divergence ``beta KL(p || M) + (1 - beta) KL(q || M)`` (``--beta 0``: forward KL(p || q),
``--beta 1``: reverse KL(q || p)), averaged over the tokens that are not padding. The
teacher is a constant: only the student learns.

Both models are built from configs (random weights, no download). The teacher's guess is
made to follow mostly the current token (its embeddings scaled up, so that they dominate
its residual stream) and to be confident (its LM head scaled up): the student learns to
match it, and the divergence falls from ~0.64 to ~0.2 within 40 steps at the defaults.

    python examples/distill_step.py --steps 40                  # flce
    python examples/distill_step.py --steps 40 --loss eager     # materialized logits, to compare
    python examples/distill_step.py --device cuda --dtype bfloat16 --vocab-size 151936
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
IGNORE = -100  # the target of padding positions: no loss, no gradient


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--loss", choices=("flce", "eager"), default="flce", help="eager: materialized logits")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="autocast dtype; default bf16 on CUDA")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--student-hidden", type=int, default=32)
    p.add_argument("--teacher-hidden", type=int, default=96, help="may differ from the student's")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--teacher-sharpness", type=float, default=30.0, help="scale of the teacher's LM head")
    p.add_argument("--beta", type=float, default=0.5)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default=None, help="flce backend (torch, triton; default: auto)")
    args = p.parse_args(argv)
    if args.dtype is None:
        args.dtype = "bfloat16" if str(args.device).startswith("cuda") else "float32"
    sizes = (args.steps, args.batch_size, args.vocab_size, args.student_hidden, args.teacher_hidden, args.layers)
    if min(sizes) < 1 or args.seq_len < 4:
        p.error("need positive sizes (steps, batch, vocabulary, hidden sizes, layers) and --seq-len >= 4")
    return args


def _import_flce():
    try:
        import flce
    except ImportError:  # running from a checkout without installing the package
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
        import flce
    return flce


def build_model(vocab: int, hidden: int, layers: int, max_len: int, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    heads = max(1, hidden // 32)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_len,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def batch(args: argparse.Namespace, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token sequences of random lengths, right-padded: (input_ids (B, L), the next
    tokens (B, L - 1) with IGNORE on the padding)."""
    input_ids = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len), generator=generator)
    lengths = torch.randint(args.seq_len // 2, args.seq_len + 1, (args.batch_size,), generator=generator)
    targets = input_ids[:, 1:].clone()
    targets[torch.arange(args.seq_len - 1)[None, :] >= lengths[:, None] - 1] = IGNORE
    return input_ids, targets


def eager_distillation(student_logits, teacher_logits, targets, beta: float, temperature: float) -> torch.Tensor:
    """The same loss from materialized logits (fp32 math), as eager code writes it."""
    log_q = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    log_p = torch.log_softmax(teacher_logits.float() / temperature, dim=-1)

    def kl(log_a, log_b):
        return (log_a.exp() * (log_a - log_b)).sum(dim=-1)

    if beta == 0.0:
        per_token = kl(log_p, log_q)
    elif beta == 1.0:
        per_token = kl(log_q, log_p)
    else:
        log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log(1.0 - beta))
        per_token = beta * kl(log_p, log_m) + (1.0 - beta) * kl(log_q, log_m)
    valid = targets != IGNORE
    return (per_token * valid).sum() / valid.sum().clamp(min=1)


def distillation_loss(flce, student, teacher, input_ids, targets, args) -> torch.Tensor:
    student_hidden = student.model(input_ids=input_ids).last_hidden_state[:, :-1]  # (B, L - 1, H_s)
    with torch.no_grad():
        teacher_hidden = teacher.model(input_ids=input_ids).last_hidden_state[:, :-1]  # (B, L - 1, H_t)
    if args.loss == "flce":
        return flce.fused_linear_distillation(
            student_hidden,
            student.lm_head.weight,
            teacher_hidden,
            teacher.lm_head.weight,
            targets,
            beta=args.beta,
            temperature=args.temperature,
            ignore_index=IGNORE,
            student_bias=student.lm_head.bias,
            teacher_bias=teacher.lm_head.bias,
            backend=args.backend,
        )
    with torch.no_grad():
        teacher_logits = teacher.lm_head(teacher_hidden)
    return eager_distillation(student.lm_head(student_hidden), teacher_logits, targets, args.beta, args.temperature)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    flce = _import_flce()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    teacher = build_model(args.vocab_size, args.teacher_hidden, args.layers, args.seq_len, args.seed).to(device)
    with torch.no_grad():
        teacher.model.embed_tokens.weight.mul_(10.0)  # its guess follows mostly the current token
        teacher.lm_head.weight.mul_(args.teacher_sharpness)  # and is confident
    teacher.eval().requires_grad_(False)
    student = build_model(args.vocab_size, args.student_hidden, args.layers, args.seq_len, args.seed + 1).to(device)
    student.train()
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed + 2)
    autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype != torch.float32 else contextlib.nullcontext
    print(
        f"distillation: teacher hidden {args.teacher_hidden}, student hidden {args.student_hidden}, vocab "
        f"{args.vocab_size} | loss={args.loss} beta={args.beta} T={args.temperature} device={device} "
        f"dtype={args.dtype} | batch {args.batch_size}x{args.seq_len}",
        flush=True,
    )
    losses = []
    for step in range(1, args.steps + 1):
        started = time.perf_counter()
        input_ids, targets = (t.to(device) for t in batch(args, generator))
        with autocast():
            loss = distillation_loss(flce, student, teacher, input_ids, targets, args)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        tokens_per_s = int((targets != IGNORE).sum()) / (time.perf_counter() - started)
        print(f"step {step:4d} | divergence {losses[-1]:.4f} | {tokens_per_s:,.0f} tokens/s", flush=True)
    print(f"done: divergence {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    return {"losses": losses}


if __name__ == "__main__":
    main()
