"""Peak memory and time of one forward + backward with the chunked lm_head loss
(`model.loss_chunk_tokens`) against whole logits (0), fp32, vocabulary 32000, micro-batch 1 x
2048 tokens.

Two steps are measured: the loss part alone (hidden (2048, 768) -> lm_head -> cross entropy,
backward into both), and a whole model (hidden 768, 2 layers, 12 heads, ffn 2048; no
optimizer). Each (step, chunk size) runs in a fresh process: build, one warm-up step, then the
resident high-water mark is reset (/proc/self/clear_refs) and 3 steps run; "peak" is the
highest resident size during them minus the resident size before them (the model, its inputs
and whatever the warm-up left), "step" the median time of the 3.

Each is measured twice: with glibc's malloc mapping every buffer above 64 KiB on its own and
unmapping it when freed (a fixed M_MMAP_THRESHOLD), so the resident peak is the tensors' peak;
and with glibc's default adaptive threshold, which may keep freed buffers in its heap (what a
run gets unless it sets MALLOC_MMAP_THRESHOLD_). The times are those of the default.

    .venv/bin/python bench/loss_memory.py           # ~5 minutes on 2 cores
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, machine

VOCAB, TOKENS, HIDDEN = 32000, 2048, 768
MODEL = ["model.preset=125m", f"model.vocab_size={VOCAB}", f"model.hidden_size={HIDDEN}",
         "model.num_layers=2", "model.num_heads=12", "model.num_kv_heads=12",
         "model.ffn_hidden_size=2048", f"model.seq_length={TOKENS}"]
CHUNKS = (0, 4096, 1024, 256)  # 4096 (the default) is one chunk of these 2048 tokens
FIXED_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}
STEPS = 3


def _child(part: str, chunk: int) -> dict:
    """One (part, chunk) measurement in this process."""
    import torch

    from pretrain.config import load_config
    from pretrain.model import build_model
    from pretrain.model.loss import lm_head_loss
    from pretrain.testing.memory import peak_added

    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, VOCAB, (1, TOKENS), generator=generator)
    if part == "loss":
        hidden = torch.randn(1, TOKENS, HIDDEN, generator=generator).requires_grad_()
        weight = (torch.randn(VOCAB, HIDDEN, generator=generator) * 0.02).requires_grad_()
        tensors = [hidden, weight]

        def step():
            lm_head_loss(hidden, weight, labels, vocab_size=VOCAB, chunk_tokens=chunk).backward()
    else:
        cfg = load_config(None, MODEL + [f"model.loss_chunk_tokens={chunk}"]).model
        model = build_model(cfg, seed=0)
        input_ids = torch.randint(0, VOCAB, (1, TOKENS), generator=generator)
        tensors = list(model.parameters())

        def step():
            model(input_ids, labels).backward()

    def run() -> float:
        for t in tensors:
            t.grad = None
        start = time.perf_counter()
        step()
        return time.perf_counter() - start

    run()  # warm-up: kernels, thread pools
    for t in tensors:
        t.grad = None
    times = []
    peak = peak_added(lambda: times.extend(run() for _ in range(STEPS)))
    return {"peak": peak, "step": statistics.median(times), "threads": torch.get_num_threads()}


def _measure(part: str, chunk: int, env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", part, str(chunk)],
                         env={**os.environ, **env, "DS_ACCELERATOR": "cpu"}, cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    load = os.getloadavg()
    print(f"machine: {machine()}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
          "at the start (shared with other jobs)")
    print(f"fp32, vocabulary {VOCAB}, micro-batch 1 x {TOKENS} tokens; whole logits "
          f"{TOKENS * VOCAB * 4 / 2**20:.0f} MiB in fp32")
    print(f"{'step':<6} {'chunk':>6} {'peak MiB':>9} {'ratio':>6} {'peak MiB':>9} {'ratio':>6} "
          f"{'step s':>7} {'ratio':>6}")
    print(f"{'':<6} {'tokens':>6} {'(tensors)':>9} {'':>6} {'(default)':>9} {'':>6} "
          f"{'(default)':>7}")
    for part in ("loss", "model"):
        reference = None
        for chunk in CHUNKS:
            fixed = _measure(part, chunk, FIXED_THRESHOLD)
            default = _measure(part, chunk, {})
            row = (fixed["peak"], default["peak"], default["step"])
            reference = reference or row
            print(f"{part:<6} {chunk:>6} {row[0] / 2**20:>9.0f} {row[0] / reference[0]:>6.2f} "
                  f"{row[1] / 2**20:>9.0f} {row[1] / reference[1]:>6.2f} {row[2]:>7.2f} "
                  f"{row[2] / reference[2]:>6.2f}")
    print(f"torch threads: {default['threads']}; ratios against chunk 0 (whole logits); "
          f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        print(json.dumps(_child(sys.argv[2], int(sys.argv[3]))))
    else:
        main()
