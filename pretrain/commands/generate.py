"""`pretrain generate`: load a checkpoint and continue a prompt (`pretrain.checkpoint.generate`)."""
from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True,
                        help="a run directory, checkpoints/step<N>, final/, or a Hugging Face "
                             "Llama directory")
    parser.add_argument("--prompt", default="def ", help="text to continue (default: %(default)r)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=None, help="sample from the k likeliest tokens")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    add_loading_arguments(parser)
    parser.add_argument("--print-ids", action="store_true",
                        help="also print the generated token ids (for exact comparisons)")


def add_loading_arguments(parser: argparse.ArgumentParser) -> None:
    """--tokenizer, --device and --dtype of `checkpoint.generate.load_for_inference` (also
    `pretrain eval`'s)."""
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer (.model file or Hugging Face directory) if the "
                             "checkpoint's has moved")
    parser.add_argument("--device", default="auto",
                        help="cuda, cpu, or auto: the GPU when there is one (default)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                        help="auto: bf16 on a GPU, fp32 on the CPU (bf16 matmuls are much "
                             "slower than fp32 on CPUs without bf16 instructions)")


def run(args: argparse.Namespace) -> None:
    from pretrain.checkpoint.generate import generate

    text, ids = generate(args.checkpoint, args.prompt, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                         tokenizer=args.tokenizer, device=args.device, dtype=args.dtype)
    sys.stdout.write(args.prompt + text + "\n")
    if args.print_ids:
        sys.stdout.write("ids: " + " ".join(map(str, ids)) + "\n")
