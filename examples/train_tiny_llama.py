#!/usr/bin/env python
"""Train a tiny Llama from scratch with the flce loss (or the stock HF loss, to compare).

The data is a synthetic language generated here: a fixed random successor table
(each token is followed by "its" token, except for 10% random noise), so the loss
visibly drops from ~log(vocab) towards the data's entropy (~1.0 nats at the default
vocab) within a few hundred steps. No downloads.

    python examples/train_tiny_llama.py --steps 300                  # flce loss
    python examples/train_tiny_llama.py --steps 300 --loss hf        # stock HF loss
    python examples/train_tiny_llama.py --device cuda --dtype bfloat16 --vocab-size 32768

Prints the loss, tokens/s and peak memory (CUDA peak allocated on a GPU, peak RSS of
the process on CPU) every --log-every steps and a summary at the end.
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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument(
        "--loss", choices=("flce", "hf"), default="flce", help="flce: patched model; hf: the model's own loss"
    )
    p.add_argument("--flce", dest="loss", action="store_const", const="flce", help="same as --loss flce")
    p.add_argument("--no-flce", dest="loss", action="store_const", const="hf", help="same as --loss hf")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default=None,
        help="autocast compute dtype (weights stay fp32); default bfloat16 on CUDA, float32 elsewhere",
    )
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--noise", type=float, default=0.1, help="probability of a random token in the synthetic language")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--backend", default=None, help="flce backend (torch, triton, cutedsl; default: auto)")
    p.add_argument("--chunk-size", type=int, default=None, help="flce rows per chunk (default: from its memory budget)")
    args = p.parse_args(argv)
    if args.dtype is None:
        args.dtype = "bfloat16" if str(args.device).startswith("cuda") else "float32"
    chunk_size = 1 if args.chunk_size is None else args.chunk_size
    sizes = (args.steps, args.batch_size, args.hidden_size, args.layers, args.log_every, chunk_size)
    if min(sizes) < 1 or args.seq_len < 4 or args.vocab_size < 16:
        p.error(
            "need --steps, --batch-size, --hidden-size, --layers, --log-every (and --chunk-size if given) >= 1, "
            "--seq-len >= 4, --vocab-size >= 16"
        )
    if not 0.0 <= args.noise < 1.0:
        p.error("--noise must be in [0, 1)")
    return args


class SyntheticLanguage:
    """A fixed random "grammar": token ``t`` is followed by ``successor[t]``, except that
    with probability ``noise`` a uniformly random token comes instead. The best
    possible loss is about ``-(1 - noise) * log(1 - noise) - noise * log(noise / vocab)``
    (about 1.0 for noise 0.1 and vocab 1024), far below the ``log(vocab)`` of the start."""

    def __init__(self, vocab: int, noise: float = 0.1, seed: int = 0):
        self.vocab, self.noise = vocab, noise
        self.generator = torch.Generator().manual_seed(seed)
        self.successor = torch.randperm(vocab, generator=self.generator)

    def entropy(self) -> float:
        keep = 1.0 - self.noise
        return -keep * math.log(keep) - self.noise * math.log(self.noise / self.vocab) if self.noise > 0 else 0.0

    def batch(self, batch: int, seq_len: int) -> torch.Tensor:
        tokens = torch.empty(batch, seq_len, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab, (batch,), generator=self.generator)
        noise = torch.rand(batch, seq_len, generator=self.generator) < self.noise
        random_tokens = torch.randint(0, self.vocab, (batch, seq_len), generator=self.generator)
        for t in range(1, seq_len):
            tokens[:, t] = torch.where(noise[:, t], random_tokens[:, t], self.successor[tokens[:, t - 1]])
        return tokens


def build_model(args: argparse.Namespace):
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(1, args.hidden_size // 32)
    config = LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=4 * args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max(args.seq_len, 128),
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config)


def _import_flce_integration():
    try:
        from flce.integrations.transformers import apply_flce
    except ImportError:  # running from a checkout without installing the package
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
        from flce.integrations.transformers import apply_flce
    return apply_flce


def peak_memory(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**20:.1f} MiB (CUDA peak allocated)"
    try:
        import resource

        return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f} MiB (peak RSS)"
    except (ImportError, AttributeError):
        return "n/a"


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]

    model = build_model(args).to(device)
    if args.loss == "flce":
        apply_flce = _import_flce_integration()
        options = {k: v for k, v in (("backend", args.backend), ("chunk_size", args.chunk_size)) if v is not None}
        apply_flce(model, **options)
    model.train()
    language = SyntheticLanguage(args.vocab_size, noise=args.noise, seed=args.seed + 1)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"tiny llama: {n_params / 1e6:.2f}M params, vocab {args.vocab_size}, hidden {args.hidden_size}, "
        f"{args.layers} layers | loss={args.loss} device={device} dtype={args.dtype} "
        f"batch={args.batch_size}x{args.seq_len} | data entropy {language.entropy():.3f} nats/token",
        flush=True,
    )

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(step, args.steps) / args.steps)),
    )
    use_autocast = dtype != torch.float32
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    losses: list[float] = []
    tokens_per_step = args.batch_size * args.seq_len
    window_start, window_tokens = time.perf_counter(), 0
    total_time, total_tokens, first_window = 0.0, 0, True
    tokens_per_s = float("nan")
    for step in range(1, args.steps + 1):
        input_ids = language.batch(args.batch_size, args.seq_len).to(device)
        autocast = torch.autocast(device.type, dtype=dtype) if use_autocast else contextlib.nullcontext()
        with autocast:
            loss = model(input_ids=input_ids, labels=input_ids).loss
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(loss.item())  # syncs the device, so the timing below is real
        window_tokens += tokens_per_step
        if step % args.log_every == 0 or step == args.steps:
            elapsed = time.perf_counter() - window_start
            tokens_per_s = window_tokens / elapsed if elapsed > 0 else float("nan")
            if not first_window:  # the first window includes the warm-up
                total_time, total_tokens = total_time + elapsed, total_tokens + window_tokens
            first_window = False
            print(
                f"step {step:5d} | loss {losses[-1]:.4f} | {tokens_per_s:,.0f} tokens/s "
                f"| peak mem {peak_memory(device)}",
                flush=True,
            )
            window_start, window_tokens = time.perf_counter(), 0

    mean_tokens_per_s = total_tokens / total_time if total_time > 0 else tokens_per_s
    result = {
        "loss": args.loss,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "losses": losses,
        "tokens_per_s": mean_tokens_per_s,
        "peak_memory": peak_memory(device),
    }
    print(
        f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f} | {mean_tokens_per_s:,.0f} tokens/s | "
        f"peak mem {result['peak_memory']}",
        flush=True,
    )
    return result


if __name__ == "__main__":
    main()
