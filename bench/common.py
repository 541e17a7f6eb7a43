"""Helpers shared by the benchmarks: a cached tokenized corpus and the real `pretrain` command."""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
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


def run_pretrain_train(overrides: list[str], *, run_dir: Path, threads: int | None = None) -> list[dict]:
    """`python -m pretrain train` as one process; returns its metrics.jsonl train records."""
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".build" / "torch_extensions"))
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(var, None)
    args = [sys.executable, "-m", "pretrain", "train", "--set", f"run_dir={run_dir}"]
    for o in overrides:
        args += ["--set", o]
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"pretrain train failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


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
