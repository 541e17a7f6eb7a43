"""A mixture-of-experts training step against a dense model with the same active parameters.

One process, fp32, the `small` preset's shape (hidden 384, 6 layers, seq 256, micro-batch 8):
the dense model's SwiGLU has ffn 1024; the MoE model has `--experts` experts of 1024 / k each
and routes every token to k of them (top-k, dropless), so both multiply each token by the same
number of MLP weights (plus the MoE router's 384 x E). A step is forward + backward of the
model's loss (plain autograd, no optimizer: the update's cost scales with the total parameters
and is not the router's or the experts' compute). Rounds alternate the two models; the best
time of each is compared, so a busy moment on a shared machine does not decide it. Two clocks:
wall time, and this process's CPU time (`time.process_time`), which other processes' load does
not inflate as much; with `--threads 1` (the default) the CPU time is the step's compute.
Target (the issue's): the MoE step within 1.3x of the dense one. `--grouped` adds the MoE model
with its experts forced onto `torch._grouped_mm` (`MoE.grouped`; the layer's own choice on CPU
is the loop), so both expert paths are timed against the same dense step.

    cd bench && ../.venv/bin/python moe_step.py        # ~3 minutes on 2 cores
    cd bench && ../.venv/bin/python moe_step.py --rounds 2 --steps 3 --threads 2
    cd bench && ../.venv/bin/python moe_step.py --grouped
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
from pretrain.model.moe import moe_layers


def step_time(model, ids: torch.Tensor, *, steps: int) -> tuple[float, float]:
    """The best (wall, CPU) seconds of `steps` forward + backward passes (after a warm-up)."""
    best = (float("inf"), float("inf"))
    for i in range(steps + 1):
        wall, cpu = time.perf_counter(), time.process_time()
        model(ids, labels=ids).backward()
        elapsed = (time.perf_counter() - wall, time.process_time() - cpu)
        model.zero_grad(set_to_none=True)
        if i:
            best = (min(best[0], elapsed[0]), min(best[1], elapsed[1]))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--grouped", action="store_true",
                        help="also time the MoE model with its experts as one grouped matmul")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dense = ModelConfig(**MODEL_PRESETS["small"])
    moe = dataclasses.replace(dense, num_experts=args.experts, experts_per_token=args.top_k,
                              ffn_hidden_size=dense.ffn_hidden_size // args.top_k)
    models = {"dense": build_model(dense, seed=0), "moe": build_model(moe, seed=0)}
    for layer in moe_layers(models["moe"]):
        layer.grouped = False  # the loop, as the layer picks on CPU, whatever the device rule
    if args.grouped:
        models["moe_grouped"] = build_model(moe, seed=0)
        for layer in moe_layers(models["moe_grouped"]):
            layer.grouped = True
    ids = torch.randint(0, dense.vocab_size, (args.micro_batch, dense.seq_length),
                        generator=torch.Generator().manual_seed(0))
    print(f"machine: {machine()}, torch threads {torch.get_num_threads()}")
    for name, cfg in (("dense", dense), ("moe", moe)):
        print(f"{name}: {num_parameters(cfg) / 1e6:.1f}M parameters, "
              f"{num_active_parameters(cfg) / 1e6:.1f}M active")
    best = {name: [float("inf"), float("inf")] for name in models}
    for round_ in range(1, args.rounds + 1):
        times = {name: step_time(model, ids, steps=args.steps) for name, model in models.items()}
        for name, seconds in times.items():
            best[name] = [min(b, s) for b, s in zip(best[name], seconds)]
        print(f"round {round_}: {_compare(times)}")
    print(f"best of each: {_compare(best)} (target <= 1.3)")


def _compare(times: dict) -> str:
    """Each MoE model's wall and CPU seconds and their ratios to the dense step's."""
    dense_wall, dense_cpu = times["dense"]
    parts = [f"dense wall {dense_wall:.3f} s CPU {dense_cpu:.3f} s"]
    for name in [n for n in times if n != "dense"]:
        wall, cpu = times[name]
        parts.append(f"{name} wall {wall:.3f} s ({wall / dense_wall:.3f}x) "
                     f"CPU {cpu:.3f} s ({cpu / dense_cpu:.3f}x)")
    return " | ".join(parts)


if __name__ == "__main__":
    main()
