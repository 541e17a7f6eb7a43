"""Peak activation memory per rank of one forward + backward at context parallelism 2 against 1,
beside the planner's prediction (`pretrain.plan.memory.stage_memory`).

fp32, a long sequence (8192 tokens, micro-batch 1), hidden 256, 2 layers, 8 query heads, 4 kv
heads (grouped-query attention), no recomputation, no optimizer. Context 1 is one gloo rank;
context 2 is two, each holding half of the sequence (`parallel.context`, DeepSpeed-Ulysses
all-to-all around attention). Each rank builds the model, runs one warm-up step, then "peak" is
the highest resident size during one more forward + backward minus the resident size before it
(`pretrain.testing.memory.peak_added`: the activations saved for backward, the attention
workspace, the all-to-all buffers and the gradients' first allocation are all in it; the
warm-up already allocated the gradients, which are set to None before the measured step).
glibc's malloc maps every buffer above 64 KiB on its own (a fixed M_MMAP_THRESHOLD), so the
resident peak follows the tensors.

    .venv/bin/python bench/context_memory.py        # ~1 minute on 2 cores
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SEQ = 8192
MODEL = ["model.preset=tiny", f"model.seq_length={SEQ}", "model.hidden_size=256",
         "model.num_layers=2", "model.num_heads=8", "model.num_kv_heads=4",
         "model.ffn_hidden_size=704", "train.precision=fp32"]


def _rank(rank: int, world_size: int) -> dict:
    import torch

    from pretrain.config import load_config
    from pretrain.model import build_model
    from pretrain.testing.memory import peak_added
    from pretrain.resolve.topology import Topology

    cfg = load_config(None, MODEL).model
    topo = Topology(tensor=1, pipeline=1, world_size=world_size, rank=rank, context=world_size)
    groups = topo.create_groups() if world_size > 1 else None
    model = build_model(cfg, seed=0, cp_group=groups.context if groups else None)
    tokens = torch.randint(0, cfg.vocab_size, (1, SEQ + 1),
                           generator=torch.Generator().manual_seed(0))
    chunk = SEQ // world_size
    inputs = tokens[:, rank * chunk:(rank + 1) * chunk]
    labels = tokens[:, rank * chunk + 1:(rank + 1) * chunk + 1]

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        model(inputs, labels).backward()

    step()  # warm-up: kernels, thread pools, the allocator
    grads = sum(p.numel() * 4 for p in model.parameters())
    return {"peak": peak_added(step), "grads": grads}


def main() -> None:
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # inherited by the spawned ranks
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from pretrain.config import load_config
    from pretrain.resolve.layout import Layout
    from pretrain.plan.memory import stage_memory
    from pretrain.arithmetic import stage_items
    from pretrain.config import Precision
    from pretrain.testing.ranks import run_on_ranks

    from common import machine

    cfg = load_config(None, MODEL).model
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.2f} at the start")
    predicted, measured = {}, {}
    for context in (1, 2):
        layout = Layout(context=context, global_batch=1, micro_batch=1, precision=Precision.FP32)
        items = stage_items(cfg, layout)[0]
        predicted[context] = stage_memory(cfg, layout, 0, items).activations
        with tempfile.TemporaryDirectory() as tmp:
            results = run_on_ranks(_rank, world_size=context, tmp_path=Path(tmp))
        measured[context] = max(r["peak"] for r in results)
    print(f"fp32, 1 x {SEQ} tokens, hidden {cfg.hidden_size}, {cfg.num_layers} layers, "
          f"{cfg.num_heads} heads / {cfg.num_kv_heads} kv heads; per rank, MiB")
    print(f"{'context':>8} {'measured peak':>14} {'planner activations':>20}")
    for context in (1, 2):
        print(f"{context:>8} {measured[context] / 2**20:>14.1f} "
              f"{predicted[context] / 2**20:>20.1f}")
    print(f"ratio context 2 / 1: measured {measured[2] / measured[1]:.3f}, planner "
          f"{predicted[2] / predicted[1]:.3f}")


if __name__ == "__main__":
    main()
