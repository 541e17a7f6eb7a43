"""Peak memory of one forward and backward under each `model.activation_checkpointing`: none,
selective (matmul and attention outputs kept, the rest recomputed) and full.

The quickstart's shape: the `small` preset (6 layers, hidden 384, vocabulary 8192, seq 256) at
its micro-batch of 8, fp32 (the planner's activations are the same bytes in any precision's
proportions). The peak is the rise of the process's resident high-water mark over the phase
(`pretrain.testing.memory.peak_added`): weights and their gradients are the same in the three,
so the differences are the activations kept for backward. Each mode runs in a process of its
own, with glibc's mmap threshold fixed at 64 KiB (`MALLOC_MMAP_THRESHOLD_`): every tensor larger
than that is mapped when allocated and unmapped when freed, so resident memory follows the live
tensors. (With glibc's default, a threshold that grows to the largest block freed, the warm-up
step's freed activations stay resident and the measured step reuses them: the peak then shows
only what exceeds the warm-up's leftovers.)

    .venv/bin/python bench/recompute_memory.py          # ~1 minute on 2 cores
"""
from __future__ import annotations

import multiprocessing
import os
import sys

from common import machine

MODES = ("none", "selective", "full")


def measure(mode: str, *, preset: str = "small", micro_batch: int = 8,
            seq_length: int = 256, queue=None) -> int:
    """Peak bytes of one forward and backward of `preset` under `mode`, after a warm-up step."""
    import torch

    from pretrain.config import MODEL_PRESETS, ModelConfig
    from pretrain.model import build_model
    from pretrain.testing.memory import peak_added

    torch.set_num_threads(1)
    cfg = ModelConfig(**{**MODEL_PRESETS[preset], "seq_length": seq_length,
                         "activation_checkpointing": mode})
    model = build_model(cfg, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (micro_batch, seq_length + 1),
                        generator=torch.Generator().manual_seed(0))

    def step():
        model(ids[:, :-1], labels=ids[:, 1:]).backward()

    step()  # gradients allocated, kernels warmed: the measured step adds activations only
    peak = peak_added(step)
    if queue is not None:
        queue.put(peak)
    return peak


def measure_apart(mode: str, **shape) -> int:
    """`measure` in a fresh process whose allocator maps every tensor over 64 KiB."""
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # read by glibc as the child starts
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=measure, args=(mode,), kwargs={**shape, "queue": queue})
    proc.start()
    peak = queue.get(timeout=600)
    proc.join()
    return peak


def main() -> None:
    peaks = {mode: measure_apart(mode) for mode in MODES}
    print(f"machine: {machine()}")
    print("small preset (quickstart), micro-batch 8 x 256 tokens, fp32, one forward+backward")
    for mode in MODES:
        saved = 1 - peaks[mode] / peaks["none"]
        print(f"  {mode:9s} peak {peaks[mode] / 2**20:8.1f} MiB   {saved:6.1%} below none")
    ok = peaks["full"] < peaks["selective"] <= 0.7 * peaks["none"]
    print("selective between full and none, >= 30% below none:", "yes" if ok else "NO")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
