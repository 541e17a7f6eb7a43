"""Start-up cost of initialising one rank of the 70B model at TP 8: blocked draws against whole ones.

Each tensor-parallel rank of `configs/llama_70b.yaml`'s model at TP 8 (the recipe's layout when
this was measured; it now ships TP 4) holds 1/8 of each decoder layer.
`shard_init` draws only the 128-row blocks its shard overlaps; the baseline draws each whole
tensor (`full_parameter_init`) and cuts the rank's shard from it (`shard_of`), as every rank did
before. Both give bitwise the same shard (checked here). Times one decoder layer of rank 3 of 8,
best of 3 rounds each, alternating, and prints the ratio; a 70B stage of 4 holds 20 such layers.

    .venv/bin/python bench/init_draws.py            # ~1 minute on 2 cores
"""
from __future__ import annotations

import time

import torch

from common import REPO, machine
from pretrain.config import load_config
from pretrain.model.llama import full_parameter_init, shard_init, shard_of

TP, RANK = 8, 3
LAYER = [f"model.layers.0.{n}.weight" for n in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm")]


def _ours(cfg) -> list[torch.Tensor]:
    return [shard_init(n, cfg, seed=1, tp_rank=RANK, tp_size=TP) for n in LAYER]


def _whole_then_cut(cfg) -> list[torch.Tensor]:
    return [shard_of(full_parameter_init(n, cfg, seed=1), n, cfg=cfg, tp_rank=RANK,
                     tp_size=TP).clone() for n in LAYER]


def main() -> None:
    torch.set_num_threads(1)
    cfg = load_config(REPO / "configs" / "llama_70b.yaml").model
    best = {"blocked shard draws": float("inf"), "whole tensors, then cut": float("inf")}
    for _ in range(3):
        for label, fn in (("blocked shard draws", _ours), ("whole tensors, then cut", _whole_then_cut)):
            start = time.perf_counter()
            shards = fn(cfg)
            best[label] = min(best[label], time.perf_counter() - start)
            if label.startswith("whole"):
                assert all(torch.equal(a, b) for a, b in zip(_ours(cfg), shards))
            del shards
    ours, baseline = best["blocked shard draws"], best["whole tensors, then cut"]
    print(f"machine: {machine()}")
    print(f"one 70B decoder layer, tensor rank {RANK} of {TP}, one thread, best of 3:")
    for label, seconds in best.items():
        print(f"  {label:<26}{seconds:8.2f} s")
    print(f"ratio whole / blocked: {baseline / ours:.1f}x (a 70B stage: 20 layers)")


if __name__ == "__main__":
    main()
