"""`pretrain convert-checkpoint`: consolidated fp32 weights, or DeepSpeed's universal checkpoint.

`--to fp32` reads any checkpoint with `pretrain.checkpoint.weights.load_weights` (offline, on one
CPU machine) and writes it as a final/ directory; `--to universal` converts an engine checkpoint
with `pretrain.checkpoint.engine.to_universal`, to resume on another data-parallel size.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="a run directory, a checkpoints/step<N> directory or final/")
    parser.add_argument("--to", choices=["fp32", "universal"], required=True,
                        help="fp32: one consolidated state dict (safetensors, Hugging Face names); "
                             "universal: DeepSpeed's universal checkpoint, to resume on another "
                             "layout")
    parser.add_argument("--output", required=True, help="directory to write")


def run(args: argparse.Namespace) -> None:
    from pretrain.checkpoint.engine import to_universal
    from pretrain.checkpoint.weights import load_weights, tensor_shape, write_final

    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.to == "universal":
        step_dir = to_universal(Path(args.src), out)  # ZeRO >= 1 checkpoints only (DeepSpeed)
        print(f"[convert] universal checkpoint in {step_dir}; resume with --resume-from {out}")
        return
    weights = load_weights(args.src)
    write_final(weights, out)
    n = sum(math.prod(tensor_shape(weights.state, name)) for name in weights.state)
    print(f"[convert] {n / 1e6:.2f}M fp32 parameters from {weights.source} -> {out}")
