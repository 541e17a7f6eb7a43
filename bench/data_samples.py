"""Sample index build time for 100M tokens, and sample fetch rate against training consumption.

1. A synthetic 100M-token dataset (uint16, documents of 1-2,000 tokens, written once under
   .build/bench): time to build the packed-sample index of the train split (cold), to load it
   from its cache (warm), and to build the blend schedule of two such datasets for a run of
   as many samples.
2. Fetch rate: samples/s that a rank's loader delivers (the trainer's `micro_batches`, with 0
   and 1 DataLoader workers, prefetch 4, the tiny model's micro-batch and sequence length;
   configs/tiny.yaml uses 0 workers) against the samples/s that the tiny model consumes in a
   plain training loop (forward, backward, AdamW; no DeepSpeed, whose engine only adds time
   per step, so the ratio is a lower bound). The two alternate in `--rounds` rounds, each
   round's ratio is printed, and the median is the result: this shared machine's speed drifts
   by several times within minutes. Target: fetch / consumption >= 100.

    .venv/bin/python bench/data_samples.py            # ~1-2 minutes on 2 cores
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from common import CACHE, machine  # noqa: E402

from pretrain.config import load_config  # noqa: E402
from pretrain.data import IndexedDataset, PackedSamples, blend_schedule  # noqa: E402
from pretrain.data.indexed import encode_index  # noqa: E402
from pretrain.data.loader import micro_batches  # noqa: E402
from pretrain.files import atomic_file  # noqa: E402


def synthetic_dataset(prefix: Path, *, tokens: int, vocab_size: int = 512) -> IndexedDataset:
    """Random documents of 1-2,000 tokens (mean ~1,000) ending with eos (id 2), written once."""
    if not Path(f"{prefix}.idx").exists():
        rng = np.random.default_rng(0)
        lengths = rng.integers(1, 2001, size=tokens // 1000 * 2)
        lengths = lengths[:np.searchsorted(np.cumsum(lengths), tokens)]
        data = rng.integers(3, vocab_size, size=int(lengths.sum()), dtype=np.uint16)
        data[np.cumsum(lengths) - 1] = 2
        with atomic_file(f"{prefix}.bin") as out:
            out.write(data.tobytes())
        with atomic_file(f"{prefix}.idx") as out:
            out.write(encode_index(dtype=np.uint16, sequence_lengths=lengths,
                                   document_indices=np.arange(len(lengths) + 1)))
    return IndexedDataset(prefix)


def index_build_times(dataset: IndexedDataset, *, seq_length: int) -> None:
    for path in Path(dataset.prefix).parent.glob(f"{Path(dataset.prefix).name}.train_*.npy"):
        path.unlink()  # cold start
    start = time.perf_counter()
    samples = PackedSamples(dataset, seq_length=seq_length, split="train", valid_fraction=0.01,
                            seed=1234)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    PackedSamples(dataset, seq_length=seq_length, split="train", valid_fraction=0.01, seed=1234)
    warm = time.perf_counter() - start
    start = time.perf_counter()
    blend_schedule([0.7, 0.3], len(samples))
    blend = time.perf_counter() - start
    print(f"dataset: {dataset.num_tokens / 1e6:.0f}M tokens, {len(dataset):,} documents; "
          f"seq_length {seq_length}: {len(samples):,} train samples")
    print(f"sample index: build {cold:.2f} s (cold), load {warm:.2f} s (cached); blend schedule "
          f"of {len(samples):,} samples: {blend:.2f} s")


def fetch_rate(dataset: IndexedDataset, *, seq_length: int, micro_batch_size: int,
               batches: int, workers: int) -> float:
    """Samples/s out of the trainer's loader (`micro_batches`) with `workers` processes."""
    samples = PackedSamples(dataset, seq_length=seq_length, split="train", valid_fraction=0.01,
                            seed=1234)
    loader = micro_batches(samples, micro_batch_size=micro_batch_size, dp_rank=0, dp_size=1,
                           workers=workers)
    next(loader)  # worker start-up is paid once per run, not per batch
    start = time.perf_counter()
    for _ in range(batches):
        next(loader)
    return batches * micro_batch_size / (time.perf_counter() - start)


def training_step_seconds(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                          batches, *, micro_steps: int) -> float:
    """Seconds per micro-batch of forward + backward + AdamW step on real batches."""
    start = time.perf_counter()
    for _ in range(micro_steps):
        batch = next(batches)
        model(batch["input_ids"], labels=batch["labels"]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / micro_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=100_000_000)
    parser.add_argument("--batches", type=int, default=2000, help="fetched per round")
    parser.add_argument("--micro-steps", type=int, default=40, help="trained per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from pretrain.model import build_model

    tiny = load_config("configs/tiny.yaml")
    seq_length, micro = tiny.model.seq_length, tiny.train.micro_batch_size
    print(f"machine: {machine()}")
    CACHE.mkdir(parents=True, exist_ok=True)
    dataset = synthetic_dataset(CACHE / f"synthetic_{args.tokens // 1_000_000}M",
                                tokens=args.tokens)
    index_build_times(dataset, seq_length=seq_length)

    # One thread, as each rank of `pretrain train` on this 2-core machine (pretrain.testing.runs):
    # two threads under the load of other jobs made a step 10x slower and the ratio meaningless.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(tiny.model, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    samples = PackedSamples(dataset, seq_length=seq_length, split="train", valid_fraction=0.01,
                            seed=1234)
    train_batches = micro_batches(samples, micro_batch_size=micro, dp_rank=0, dp_size=1)
    training_step_seconds(model, optimizer, train_batches, micro_steps=5)  # warm-up
    ratios: dict[int, list[float]] = {0: [], 1: []}
    for round_number in range(1, args.rounds + 1):
        consumed = micro / training_step_seconds(model, optimizer, train_batches,
                                                 micro_steps=args.micro_steps)
        line = f"round {round_number}: training consumes {consumed:,.0f} samples/s"
        for workers in ratios:
            fetched = fetch_rate(dataset, seq_length=seq_length, micro_batch_size=micro,
                                 batches=args.batches, workers=workers)
            ratios[workers].append(fetched / consumed)
            line += (f"; fetch, {workers} workers: {fetched:,.0f} samples/s "
                     f"({ratios[workers][-1]:,.0f}x)")
        print(line)
    for workers, values in ratios.items():
        print(f"ratio fetch / consumption with {workers} DataLoader workers (median of "
              f"{args.rounds} rounds): {statistics.median(values):,.0f}x  (target >= 100x)")


if __name__ == "__main__":
    main()
