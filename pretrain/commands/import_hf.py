"""`pretrain import-hf`: a Hugging Face Llama directory as the initial weights of a run."""
from __future__ import annotations

import argparse
from pathlib import Path

from pretrain.arithmetic import num_parameters

# The model fields a run must set to train from imported weights, printed as --set options.
_MODEL_FIELDS = ("family", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "ffn_hidden_size", "tie_embeddings", "rope_theta", "rope_scaling",
                 "norm_eps")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="a local Hugging Face Llama directory (config.json + "
                                    "safetensors)")
    parser.add_argument("--output", required=True,
                        help="directory to write; train from it with --set model.init_from=DIR")


def run(args: argparse.Namespace) -> None:
    from pretrain.checkpoint.hf import import_hf

    src, out = Path(args.src), Path(args.output)
    m = import_hf(src, out).model
    from pretrain.config import ModelConfig
    from pretrain.families import family_of

    # the shape every run names, and what else the weights and a run must agree on (the rotary
    # scaling's settings, the experts') where it is not the default
    default = ModelConfig()
    names = _MODEL_FIELDS + tuple(k for k in family_of(m).fields_to_agree(m)
                                  if k not in _MODEL_FIELDS and getattr(m, k) != getattr(default, k))
    fields = " ".join(f"--set model.{k}={getattr(m, k)}" for k in names)
    print(f"[import-hf] {num_parameters(m) / 1e6:.2f}M parameters from {src} -> {out}\n"
          f"train from them with: pretrain train --config <yours> --set model.init_from={out} "
          f"{fields}")
