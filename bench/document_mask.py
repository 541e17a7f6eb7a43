"""The document-masked training step (`data.document_mask: true`) against the unmasked one on
the CPU, at the quickstart's shape: configs/quickstart.yaml's model (the `small` preset: 6
layers, hidden 384, 6 heads, 2 kv heads, seq 256, vocabulary 8192, tied) and micro-batch 8 in
fp32 (what `train.precision: auto` picks on a CPU without bf16 hardware), on micro-batches of
the bundled corpus (python-stdlib, tokenized once under .build/bench) with their document ids.

A step here is one forward and backward of the model in one process (no DeepSpeed, no
optimizer: the update is the same either way and would only dilute the ratio). The two variants
alternate, `ROUNDS` times each after a warm-up of each; the medians are compared.

    .venv/bin/python bench/document_mask.py        # ~4 minutes on 2 shared, loaded cores

Target: the masked step within 1.15x of the unmasked one. It also prints how many of the
samples pack more than one document (what the mask changes on this corpus).
"""
from __future__ import annotations

import sys
import time

import torch

from common import REPO, machine, median, stdlib_dataset

ROUNDS = 7
MICRO_BATCH = 8
TARGET = 1.15


def batches(data: dict[str, str], *, seq_length: int, count: int) -> list[dict]:
    """`count` micro-batches of the quickstart's training split, with document ids."""
    from pretrain.config import load_config
    from pretrain.data import Tokenizer
    from pretrain.data.build import build_datasets
    from pretrain.data.loader import micro_batches

    cfg = load_config(REPO / "configs/quickstart.yaml",
                      [f"data.tokenizer={data['tokenizer']}", f"data.dataset={data['dataset']}"])
    train, _ = build_datasets(cfg.data, seq_length=seq_length,
                              train_samples=count * MICRO_BATCH, with_valid=False,
                              log=lambda message: None)
    eod = Tokenizer.load(data["tokenizer"]).eos_id
    stream = micro_batches(train, micro_batch_size=MICRO_BATCH, dp_rank=0, dp_size=1,
                           document_eod=eod)
    return [next(stream) for _ in range(count)]


def step_seconds(model, batch: dict, *, masked: bool) -> float:
    ids = batch["document_ids"] if masked else None
    start = time.perf_counter()
    model(batch["input_ids"], batch["labels"], document_ids=ids).backward()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return seconds


def main() -> int:
    from pretrain.config import load_config
    from pretrain.model import build_model

    cfg = load_config(REPO / "configs/quickstart.yaml", ["model.vocab_size=8192"]).model
    model = build_model(cfg, seed=1)
    data = batches(stdlib_dataset(), seq_length=cfg.seq_length, count=ROUNDS + 1)
    packed = torch.cat([b["document_ids"][:, -1] > 0 for b in data])
    times = {True: [], False: []}
    for index, batch in enumerate(data):
        for masked in (False, True):
            seconds = step_seconds(model, batch, masked=masked)
            if index:  # the first batch warms both up
                times[masked].append(seconds)
    plain, masked = median(times[False]), median(times[True])
    ratio = masked / plain
    print(f"machine: {machine()}, torch threads {torch.get_num_threads()}")
    print(f"shape: quickstart (small preset), micro-batch {MICRO_BATCH} x {cfg.seq_length} "
          f"tokens, fp32, forward + backward; {int(packed.sum())} of {packed.numel()} samples "
          f"pack more than one document")
    print(f"unmasked {plain * 1e3:.0f} ms, masked {masked * 1e3:.0f} ms (medians of {ROUNDS}): "
          f"masked / unmasked = {ratio:.3f} (target <= {TARGET})")
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
