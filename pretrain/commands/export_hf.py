"""`pretrain export-hf`: any checkpoint as a Hugging Face `LlamaForCausalLM` directory."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from pretrain.commands.data import TOKENIZER_HELP
from pretrain.config import Precision


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="a run directory, a checkpoints/step<N> directory of any "
                                    "layout, or a final/ directory")
    parser.add_argument("--output", required=True, help="the Hugging Face directory to write")
    parser.add_argument("--dtype", choices=[Precision.BF16.value, Precision.FP32.value],
                        default=Precision.BF16.value, help="default %(default)s")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="largest safetensors file (default %(default)s); larger models "
                             "are sharded with model.safetensors.index.json")
    parser.add_argument("--tokenizer", default=None,
                        help=f"the run's tokenizer, if the checkpoint holds none: {TOKENIZER_HELP}")


def run(args: argparse.Namespace) -> None:
    from pretrain.checkpoint.hf import export_hf
    from pretrain.checkpoint.weights import load_weights, tensor_shape

    weights = load_weights(args.src)
    if args.tokenizer:
        weights.tokenizer = Path(args.tokenizer)
    out = export_hf(weights, Path(args.output), dtype=args.dtype,
                    max_shard_size=args.max_shard_size)
    n = sum(math.prod(tensor_shape(weights.state, name)) for name in weights.state)
    print(f"[export-hf] {n / 1e6:.2f}M parameters ({args.dtype}) from {weights.source} -> {out}")
