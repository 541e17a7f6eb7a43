"""Training throughput of `pretrain train` against a plain PyTorch loop over `transformers`.

Ours: the real `pretrain train` command, 1 rank, ZeRO-0 (`ds_configs/zero0.json`), fp32, on the
bundled corpus, in four variants that add one lever at a time: `eager` (three q/k/v and two
gate/up matmuls, whole logits: `model.fused_projections=false model.loss_chunk_tokens=0`),
`fused` (one matmul each), `fused+chunked` (the loss over 4096-token chunks: the defaults) and
`compiled` (the defaults and `model.compile=true`: every decoder layer through torch.compile;
its inductor cache is warmed by a first short run, so the rounds time training, not compiling). Baseline: `transformers.LlamaForCausalLM` of the identical shape (built from
`pretrain.model.hf.to_hf_config`), SDPA attention, the same batch and sequence length, torch's
AdamW and gradient clipping, in a plain loop. Both use all cores. The two are measured
alternately, `--rounds` times each, and the median step time of each round's steady state
(after `--warmup` steps) is kept; the best round of each side is compared, so a busy moment on
the machine does not decide the ratio; the ratio of each round (both sides measured within the
same minute) is printed too, with their median, since this machine's speed drifts between
rounds by more than the difference being measured. Targets: compiled >= 1.3x transformers, and
an MFU (model FLOPs per second against the fp32 matmul peak measured here on the same threads)
>= 50% for the hidden-768 model.

Models: `small` (the quickstart's preset) and `h768` (hidden 768, 4 layers, 12 heads, ffn 2048,
the 8k vocabulary, seq 256).

    .venv/bin/python bench/throughput.py                      # ~15 minutes on 2 cores
    .venv/bin/python bench/throughput.py --models small --variants eager,compiled --rounds 1
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


MODELS = {
    "small": ["model.preset=small", "model.vocab_size=8192"],
    "h768": ["model.preset=125m", "model.vocab_size=8192", "model.num_layers=4",
             "model.seq_length=256"],
}
VARIANTS = {
    "eager": ["model.fused_projections=false", "model.loss_chunk_tokens=0"],
    "fused": ["model.fused_projections=true", "model.loss_chunk_tokens=0"],
    "fused+chunked": ["model.fused_projections=true", "model.loss_chunk_tokens=4096"],
    "compiled": ["model.fused_projections=true", "model.loss_chunk_tokens=4096",
                 "model.compile=true"],
}


def ours_tokens_per_s(model: list[str], variant: str, *, data, steps: int, warmup: int,
                      micro_batch: int, run_dir: Path, cache: Path) -> float:
    overrides = [*model, *VARIANTS[variant],
                 f"data.tokenizer={data['tokenizer']}", f"data.dataset={data['dataset']}",
                 "deepspeed=ds_configs/zero0.json", "train.precision=fp32",
                 f"train.steps={steps}", f"train.micro_batch_size={micro_batch}",
                 "train.eval_interval=0", "train.warmup_steps=2", "train.lr=3e-4",
                 "checkpoint.save_final=false", "logging.report_to=[]",
                 "logging.progress_bar=false", "data.num_workers=0", f"run_dir={run_dir}"]
    args = ["train"] + [a for o in overrides for a in ("--set", o)]
    # all cores, as the baseline has (the test helper defaults to one thread per rank)
    run = run_pretrain(args, run_dir=run_dir, env={"OMP_NUM_THREADS": str(os.cpu_count()),
                                                   "TORCHINDUCTOR_CACHE_DIR": str(cache)}).check()
    records = [x for x in run.records if x["kind"] == "train"]
    return median([x["tokens_per_s"] for x in records[warmup:]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="small,h768")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    from pretrain.arithmetic import model_flops_per_token, num_parameters
    from pretrain.config import load_config
    from pretrain.hardware import measure_matmul_tflops

    data = stdlib_dataset()
    variants = args.variants.split(",")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "inductor"
        for name in args.models.split(","):
            cfg = load_config(None, MODELS[name]).model
            if "compiled" in variants:  # build the kernels once: the rounds reuse them
                ours_tokens_per_s(MODELS[name], "compiled", data=data, steps=2, warmup=0,
                                  micro_batch=args.micro_batch, run_dir=Path(tmp) / f"warm-{name}",
                                  cache=cache)
            runs = {v: [] for v in [*variants, "transformers"]}
            for r in range(args.rounds):
                for v in variants:
                    runs[v].append(ours_tokens_per_s(
                        MODELS[name], v, data=data, steps=args.steps, warmup=args.warmup,
                        micro_batch=args.micro_batch, run_dir=Path(tmp) / f"{name}-{v}-{r}",
                        cache=cache))
                runs["transformers"].append(hf_tokens_per_s(
                    cfg, micro_batch=args.micro_batch, steps=args.steps, warmup=args.warmup,
                    lr=3e-4))
                print(f"{name} round {r + 1}: " + " | ".join(
                    f"{v} {runs[v][-1]:,.0f}" for v in runs) + " tok/s", flush=True)
            results[name] = cfg, runs
    peak = measure_matmul_tflops(torch.float32, n=1024)
    print(f"\nmachine: {machine()}")
    print(f"fp32 matmul peak (measured, 1024^2, {torch.get_num_threads()} threads): "
          f"{peak * 1e3:.0f} GFLOP/s; fp32, 1 rank, ZeRO-0, micro-batch {args.micro_batch}")
    for name, (cfg, runs) in results.items():
        flops = model_flops_per_token(cfg)
        base = runs["transformers"]
        print(f"\n{name}: {num_parameters(cfg) / 1e6:.1f}M parameters, hidden "
              f"{cfg.hidden_size}, {cfg.num_layers} layers, seq {cfg.seq_length}")
        print(f"{'':16} {'best tok/s':>11} {'MFU':>7} {'/ transformers':>15} "
              f"{'(median of rounds)':>19}")
        for v, values in runs.items():
            paired = statistics.median(o / t for o, t in zip(values, base))
            print(f"{v:16} {max(values):11,.0f} {flops * max(values) / peak / 1e12:7.1%} "
                  f"{max(values) / max(base):15.3f} {paired:19.3f}")


if __name__ == "__main__":
    main()
