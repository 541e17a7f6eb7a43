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
