"""Pipeline bubble of DeepSpeed's 1F1B schedule at pp = 2, measured against the theory.

Two gloo ranks (one core each) run a 2-stage pipeline of the Llama model for m = 1, 2, 4, 8
micro-batches per step (the same micro-batch size, `engine.set_train_batch_size`). A step
should take (m + p - 1) micro-batch slots; the busy part is m slots, so the bubble is
(p - 1) / (m + p - 1). The slot time is the slope of step time against m (a least-squares
line through all m), and the measured bubble fraction of m is 1 - m * slope / step_time(m).

    .venv/bin/python bench/pipeline_bubble.py          # ~2 minutes on 2 cores
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from common import machine
from pretrain.testing.ranks import run_on_ranks

MICRO = 4


def _rank(rank: int, world_size: int, micro_counts: list[int], steps: int, layers: int) -> dict:
    import logging

    import deepspeed
    import torch

    from pretrain.config import load_config
    from pretrain.model import build_pipeline_model

    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    cfg = load_config(None, ["model.preset=small", f"model.num_layers={layers}",
                             "model.seq_length=128", "model.tie_embeddings=false"]).model
    module = build_pipeline_model(cfg, seed=0, num_stages=2, partition_method="uniform")
    config = {"train_batch_size": MICRO, "train_micro_batch_size_per_gpu": MICRO,
              "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": {"stage": 0}}
    engine, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                      config=config)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (MICRO, cfg.seq_length + 1), generator=gen)
    batch = (tokens[:, :-1], tokens[:, 1:])

    def forever():
        while True:
            yield batch

    step_times = {}
    for m in micro_counts:
        engine.set_train_batch_size(MICRO * m)
        data = forever()
        for _ in range(2):  # warm-up
            engine.train_batch(data)
        times = []
        for _ in range(steps):
            torch.distributed.barrier()
            start = time.perf_counter()
            engine.train_batch(data)
            times.append(time.perf_counter() - start)
        step_times[m] = statistics.median(times)
    return step_times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = run_on_ranks(_rank, world_size=2, tmp_path=Path(tmp), timeout_s=1200,
                               args=(args.micro_batches, args.steps, args.layers))
    times = {m: max(r[m] for r in results) for m in args.micro_batches}  # the slower stage
    ms = list(times)
    mean_m, mean_t = statistics.fmean(ms), statistics.fmean(times.values())
    slope = sum((m - mean_m) * (times[m] - mean_t) for m in ms) / sum((m - mean_m) ** 2 for m in ms)
    p = 2
    print(f"machine: {machine()}; 2 ranks x 1 thread, gloo")
    print(f"model: preset small with {args.layers} layers, seq 128, micro-batch {MICRO}, fp32, "
          f"pp=2 (uniform split), ZeRO-0; slot time (slope) {slope * 1e3:.0f} ms")
    print(f"{'m':>3} {'step time':>10} {'measured bubble':>16} {'1F1B theory':>12}")
    for m in ms:
        measured = 1.0 - m * slope / times[m]
        print(f"{m:>3} {times[m] * 1e3:>8.0f}ms {measured:>16.3f} {(p - 1) / (m + p - 1):>12.3f}")


if __name__ == "__main__":
    main()
