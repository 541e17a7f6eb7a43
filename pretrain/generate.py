"""`pretrain generate`: load a final checkpoint and continue a prompt.

Decoding is greedy (temperature 0) or sampled with temperature and top-k, on one process.
"""
from __future__ import annotations

import argparse
import sys

import torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True,
                        help="a run directory or its final/ directory (written by pretrain train)")
    parser.add_argument("--prompt", default="def ", help="text to continue (default: %(default)r)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=None, help="sample from the k likeliest tokens")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--print-ids", action="store_true",
                        help="also print the generated token ids (for exact comparisons)")


def generate(checkpoint: str, prompt: str, *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, seed: int = 0) -> tuple[str, list[int]]:
    """(completion text, completion token ids) for `prompt` from a final checkpoint."""
    from pretrain.checkpoint import load_final
    from pretrain.data import Tokenizer
    from pretrain.model import LlamaModel
    from pretrain.model.hf import from_hf_state_dict

    cfg, state, tokenizer_path = load_final(checkpoint)
    tokenizer = Tokenizer.load(tokenizer_path)
    model = LlamaModel(cfg.model)
    model.load_state_dict(from_hf_state_dict(state, cfg.model))
    model.eval()
    ids = tokenizer.encode(prompt)
    prompt_ids = torch.tensor([ids or [tokenizer.bos_id]], dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        out = model.generate(prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                             top_k=top_k, generator=generator, eos_id=tokenizer.eos_id)
    new_ids = out[0, prompt_ids.shape[1]:].tolist()
    return tokenizer.decode(new_ids), new_ids


def run(args: argparse.Namespace) -> None:
    text, ids = generate(args.checkpoint, args.prompt, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    sys.stdout.write(args.prompt + text + "\n")
    if args.print_ids:
        sys.stdout.write("ids: " + " ".join(map(str, ids)) + "\n")
