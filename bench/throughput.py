"""Training throughput of `pretrain train` against a plain PyTorch loop over `transformers`.

Ours: the real `pretrain train` command, 1 rank, ZeRO-0 (`ds_configs/zero0.json`), fp32, on the
bundled corpus. Baseline: `transformers.LlamaForCausalLM` of the identical shape (built from
`pretrain.model.hf.to_hf_config`), SDPA attention, the same batch and sequence length, torch's
AdamW and gradient clipping, in a plain loop. Both use all cores. The two are measured
alternately, `--rounds` times each, and the median step time of each round's steady state
(after `--warmup` steps) is kept; the best round of each side is compared, so a busy moment on
the machine does not decide the ratio; the ratio of each round (both sides measured within the
same minute) is printed too, with their median, since this machine's speed drifts between
rounds by more than the difference being measured. Target: ratio >= 1.0.

    .venv/bin/python bench/throughput.py            # ~3 minutes on 2 cores
    .venv/bin/python bench/throughput.py --preset tiny --steps 30
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from common import machine, median, stdlib_dataset
from pretrain.testing.runs import run_pretrain


def hf_tokens_per_s(cfg, *, micro_batch: int, steps: int, warmup: int, lr: float) -> float:
    import transformers

    from pretrain.model.hf import to_hf_config

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(to_hf_config(cfg, attn_implementation="sdpa"))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_length + 1))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        out = model(input_ids=tokens[:, :-1], labels=tokens[:, :-1])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return micro_batch * cfg.seq_length / median(times[warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    from pretrain.arithmetic import model_flops_per_token, num_parameters
    from pretrain.config import load_config
    from pretrain.hardware import measure_matmul_tflops

    data = stdlib_dataset()
    cfg = load_config(None, [f"model.preset={args.preset}", "model.vocab_size=8192"]).model
    overrides = [f"model.preset={args.preset}", "model.vocab_size=8192",
                 f"data.tokenizer={data['tokenizer']}", f"data.dataset={data['dataset']}",
                 "deepspeed=ds_configs/zero0.json", "train.precision=fp32",
                 f"train.steps={args.steps}", f"train.micro_batch_size={args.micro_batch}",
                 "train.eval_interval=0", "train.warmup_steps=2", "train.lr=3e-4",
                 "checkpoint.save_final=false", "logging.report_to=[]",
                 "logging.progress_bar=false",
                 "data.num_workers=0"]
    ours, theirs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            run_dir = Path(tmp) / f"run{r}"
            args_ = ["train"] + [a for o in overrides for a in ("--set", o)] + \
                ["--set", f"run_dir={run_dir}"]
            # all cores, as the baseline has (the test helper defaults to one thread per rank)
            run = run_pretrain(args_, run_dir=run_dir,
                               env={"OMP_NUM_THREADS": str(os.cpu_count())}).check()
            records = [x for x in run.records if x["kind"] == "train"]
            ours.append(median([x["tokens_per_s"] for x in records[args.warmup:]]))
            theirs.append(hf_tokens_per_s(cfg, micro_batch=args.micro_batch, steps=args.steps,
                                          warmup=args.warmup, lr=3e-4))
            print(f"round {r + 1}: pretrain train {ours[-1]:,.0f} tok/s | transformers loop "
                  f"{theirs[-1]:,.0f} tok/s", flush=True)
    peak = measure_matmul_tflops(torch.float32, n=1024)
    flops = model_flops_per_token(cfg)
    best_ours, best_theirs = max(ours), max(theirs)
    print(f"\nmachine: {machine()}")
    print(f"model: preset {args.preset}, {num_parameters(cfg) / 1e6:.1f}M parameters, "
          f"micro-batch {args.micro_batch} x seq {cfg.seq_length}, fp32, 1 rank, ZeRO-0")
    print(f"pretrain train      : {best_ours:10,.0f} tok/s  MFU {flops * best_ours / peak / 1e12:6.1%}")
    print(f"transformers + AdamW: {best_theirs:10,.0f} tok/s  MFU {flops * best_theirs / peak / 1e12:6.1%}")
    print(f"fp32 matmul peak (measured, 1024^2, all threads): {peak * 1e3:.0f} GFLOP/s")
    paired = sorted(o / t for o, t in zip(ours, theirs))
    print(f"ratio per round (same minutes): {', '.join(f'{r:.3f}' for r in paired)}")
    print(f"ratio pretrain / transformers: median of rounds {statistics.median(paired):.3f}, "
          f"best vs best {best_ours / best_theirs:.3f}  (target >= 1.0)")


if __name__ == "__main__":
    main()
