"""`pretrain generate`: load a checkpoint and continue a prompt.

Any checkpoint `pretrain.convert.load_weights` reads: a run directory, an engine step directory
of any layout (consolidated offline), final/, an `import-hf` or `convert-checkpoint` directory, or
a Hugging Face Llama directory (e.g. written by `export-hf`). Decoding is greedy (temperature 0)
or sampled with temperature and top-k, on one process, in fp32.
"""
from __future__ import annotations

import argparse
import sys

import torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True,
                        help="a run directory, checkpoints/step<N>, final/, or a Hugging Face "
                             "Llama directory")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer (.model file or Hugging Face directory) if the "
                             "checkpoint's has moved")
    parser.add_argument("--prompt", default="def ", help="text to continue (default: %(default)r)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=None, help="sample from the k likeliest tokens")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--print-ids", action="store_true",
                        help="also print the generated token ids (for exact comparisons)")


def generate(checkpoint: str, prompt: str, *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, seed: int = 0,
             tokenizer: str | None = None) -> tuple[str, list[int]]:
    """(completion text, completion token ids) for `prompt` from any checkpoint."""
    from pretrain.convert import load_weights
    from pretrain.data import Tokenizer
    from pretrain.errors import CheckpointError
    from pretrain.model import LlamaModel
    from pretrain.model.hf import from_hf_state_dict

    weights = load_weights(checkpoint)
    tokenizer_path = tokenizer or weights.tokenizer
    if tokenizer_path is None:
        raise CheckpointError(f"no tokenizer found with {weights.source}: pass --tokenizer")
    tok = Tokenizer.load(tokenizer_path)
    model = LlamaModel(weights.model)
    state = {k: v.float() for k, v in weights.state.items()}
    model.load_state_dict(from_hf_state_dict(state, weights.model))
    model.eval()
    ids = tok.encode(prompt)
    prompt_ids = torch.tensor([ids or [tok.bos_id]], dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        out = model.generate(prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                             top_k=top_k, generator=generator,
                             eos_id=tok.eos_id if tok.eos_id >= 0 else None)
    new_ids = out[0, prompt_ids.shape[1]:].tolist()
    return tok.decode(new_ids), new_ids


def run(args: argparse.Namespace) -> None:
    text, ids = generate(args.checkpoint, args.prompt, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                         tokenizer=args.tokenizer)
    sys.stdout.write(args.prompt + text + "\n")
    if args.print_ids:
        sys.stdout.write("ids: " + " ".join(map(str, ids)) + "\n")
