"""Helpers shared by the benchmarks: a cached tokenized corpus, the machine's description.

The benchmarks run `pretrain` and spawn ranks with the test suite's helpers
(`pretrain.testing`): one way to do each.
"""
from __future__ import annotations

import os
import platform
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".build" / "bench"


def stdlib_dataset(vocab_size: int = 8192) -> dict[str, str]:
    """Tokenizer + .bin/.idx of the bundled corpus (python-stdlib), made once under .build/bench."""
    from pretrain.data import preprocess, resolve_corpus, train_tokenizer

    CACHE.mkdir(parents=True, exist_ok=True)
    model = CACHE / f"stdlib_bpe{vocab_size}.model"
    prefix = CACHE / f"stdlib_bpe{vocab_size}"
    files = resolve_corpus(["python-stdlib"])
    if not model.exists():
        train_tokenizer(files, model_prefix=model.with_suffix(""), vocab_size=vocab_size)
    if not prefix.with_suffix(".idx").exists():
        preprocess(files, tokenizer_path=model, output_prefix=prefix, workers=2, show_progress=False)
    return {"tokenizer": str(model), "dataset": str(prefix)}


def batches(dataset: str, *, split: str, seq: int, batch: int, count: int, seed: int = 1234):
    """`count` (input_ids, labels) batches of the split, in the dataset's fixed sample order."""
    import torch

    from pretrain.data.samples import PackedSamples

    samples = PackedSamples(dataset, seq_length=seq, split=split, valid_fraction=0.01, seed=seed)
    out = []
    for b in range(count):
        items = [samples[(b * batch + i) % len(samples)] for i in range(batch)]
        out.append((torch.stack([s["input_ids"] for s in items]),
                    torch.stack([s["labels"] for s in items])))
    return out


def median(values: list[float]) -> float:
    return statistics.median(values)


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"


def tiny_zero1_engine(overrides: list[str], *, out_dir: str, world_size: int):
    """(engine, config) of configs/tiny.yaml with `overrides`, run_dir `out_dir`, on this rank
    of `world_size` (one process group already up), built as `pretrain train` builds it."""
    import deepspeed

    from pretrain.config import load_config
    from pretrain.training.engine import param_groups
    from pretrain.model import build_model
    from pretrain.resolve.run import resolve_ds_config

    cfg = load_config("configs/tiny.yaml", overrides + [f"run_dir={out_dir}"])
    ds_config = resolve_ds_config(cfg, world_size=world_size, accelerator="cpu")
    model = build_model(cfg.model, seed=1, tp_group=None, sequence_parallel=False)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config,
                                      model_parameters=param_groups(model, 0.1))
    return engine, cfg


def train_step(engine, cfg) -> None:
    """One forward, backward and optimizer step on random tokens (Adam's moments then exist:
    a checkpoint has its full size)."""
    import torch

    ids = torch.randint(0, cfg.model.vocab_size, (1, cfg.model.seq_length))
    engine.backward(engine(ids, labels=ids))
    engine.step()


def zero1_layout(world_size: int) -> dict:
    """The checkpoint meta's layout of a flat fp32 ZeRO-1 run of `world_size` ranks."""
    return {"tensor": 1, "pipeline": 1, "data": world_size, "world_size": world_size,
            "zero_stage": 1, "offload": "none", "precision": "fp32"}
