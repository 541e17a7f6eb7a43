"""A mixture-of-experts training step against a dense model with the same active parameters.

One process, fp32, the `small` preset's shape (hidden 384, 6 layers, seq 256, micro-batch 8):
the dense model's SwiGLU has ffn 1024; the MoE model has `--experts` experts of 1024 / k each
and routes every token to k of them (top-k, dropless), so both multiply each token by the same
number of MLP weights (plus the MoE router's 384 x E). A step is forward + backward of the
model's loss (plain autograd, no optimizer: the update's cost scales with the total parameters
and is not the router's or the experts' compute). Rounds alternate the two models; the best
time of each is compared, so a busy moment on a shared machine does not decide it.
Target (the issue's): the MoE step within 1.3x of the dense one.

    .venv/bin/python bench/moe_step.py                  # ~2 minutes on 2 cores
    .venv/bin/python bench/moe_step.py --rounds 2 --steps 3
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from common import machine
from pretrain.arithmetic import num_active_parameters, num_parameters
from pretrain.config import MODEL_PRESETS, ModelConfig
from pretrain.model.build import build_model


def step_time(model, ids: torch.Tensor, *, steps: int) -> float:
    """The best of `steps` forward + backward passes, in seconds (after one warm-up)."""
    best = float("inf")
    for i in range(steps + 1):
        start = time.perf_counter()
        model(ids, labels=ids).backward()
        elapsed = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        if i:
            best = min(best, elapsed)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    dense = ModelConfig(**MODEL_PRESETS["small"])
    moe = dataclasses.replace(dense, num_experts=args.experts, experts_per_token=args.top_k,
                              ffn_hidden_size=dense.ffn_hidden_size // args.top_k)
    models = {"dense": build_model(dense, seed=0), "moe": build_model(moe, seed=0)}
    ids = torch.randint(0, dense.vocab_size, (args.micro_batch, dense.seq_length),
                        generator=torch.Generator().manual_seed(0))
    print(f"machine: {machine()}, torch threads {torch.get_num_threads()}")
    for name, cfg in (("dense", dense), ("moe", moe)):
        print(f"{name}: {num_parameters(cfg) / 1e6:.1f}M parameters, "
              f"{num_active_parameters(cfg) / 1e6:.1f}M active")
    best = {"dense": float("inf"), "moe": float("inf")}
    for round_ in range(1, args.rounds + 1):
        times = {name: step_time(model, ids, steps=args.steps) for name, model in models.items()}
        for name, seconds in times.items():
            best[name] = min(best[name], seconds)
        print(f"round {round_}: dense {times['dense']:.3f} s | moe {times['moe']:.3f} s | "
              f"ratio {times['moe'] / times['dense']:.3f}")
    print(f"best of each: dense {best['dense']:.3f} s | moe {best['moe']:.3f} s | "
          f"ratio {best['moe'] / best['dense']:.3f} (target <= 1.3)")


if __name__ == "__main__":
    main()
