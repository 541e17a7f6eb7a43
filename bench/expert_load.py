"""Expert load over the steps of a quickstart-sized mixture: no balancing, the auxiliary loss,
DeepSeek-V3's bias balancing.

The quickstart's widths (`configs/quickstart.yaml`, preset small: hidden 384, 6 layers, 6 heads,
seq 256, vocabulary 8192, tied) with every MLP a mixture of 8 experts (inner 256), top-2, trains
`--steps` steps on the bundled corpus (python-stdlib, the quickstart's 8k tokenizer, made once
under .build/bench) four times through `pretrain train`, one process, fp32, the z-loss off. The
softmax router is Qwen3-MoE's (family qwen3), the sigmoid one DeepSeek-V3's (family
deepseek_v3, latent attention: the family routes by sigmoid only), so each balancing has its
router's unbalanced run beside it:

- `softmax`: `model.moe_aux_loss_coeff=0`
- `aux`: `model.moe_aux_loss_coeff=0.01` (the default)
- `sigmoid`: no auxiliary loss, `model.moe_bias_update_rate=0` (the bias stays 0)
- `bias`: no auxiliary loss, `model.moe_bias_update_rate=--rate` (each step, each expert's bias
  steps up when the expert was chosen less than the layer's mean, down when more)

Expert load is each layer's busiest expert's assignments over the mean (`moe_load_max_mean` in
metrics.jsonl; 1.0 is balanced, 4.0 = one expert is every token's first or second choice).
Printed: the mean over the last 50 steps of the worst layer's and the layers' mean, and the
loss, per run. Drawn (`--plot`, default docs/expert_load.png): the worst layer's load per step,
the layers' mean, the loss, and the bias run's biases (`moe_expert_bias`) of one layer. The
runs' metrics.jsonl stay under `--out`; `--plot-only` redraws from them.

    cd bench && nice -n 19 ../.venv/bin/python expert_load.py   # 200 steps x 4
    cd bench && ../.venv/bin/python expert_load.py --steps 10   # a quick look
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from common import REPO, machine, stdlib_dataset

WINDOW = 50
# the two routers' families at the quickstart's widths, each MLP a mixture of 8 experts (inner
# 256), top-2: Qwen3-MoE's softmax router (renormalised top-k) with GQA attention as the
# quickstart's (2 kv heads); DeepSeek-V3's sigmoid one (renormalised, no groups, no shared
# experts) with latent attention (kv rank 128, queries through one projection, heads of 32 + 32
# query/key and 64 value dims)
EXPERTS = ["model.num_experts=8", "model.experts_per_token=2", "model.moe_ffn_hidden_size=256",
           "model.moe_z_loss_coeff=0"]
SOFTMAX = ["model.family=qwen3", "model.head_dim=64", "model.moe_norm_topk_prob=true", *EXPERTS]
SIGMOID = ["model.family=deepseek_v3", "model.num_kv_heads=6", "model.q_lora_rank=0",
           "model.kv_lora_rank=128", "model.qk_nope_head_dim=32", "model.qk_rope_head_dim=32",
           "model.v_head_dim=64", "model.moe_router=sigmoid", *EXPERTS]
RUNS = {  # name: (label, overrides); the bias run's rate is --rate
    "softmax": ("softmax, no balancing", [*SOFTMAX, "model.moe_aux_loss_coeff=0"]),
    "aux": ("softmax, auxiliary loss 0.01", [*SOFTMAX, "model.moe_aux_loss_coeff=0.01"]),
    "sigmoid": ("sigmoid, no balancing", [*SIGMOID, "model.moe_aux_loss_coeff=0"]),
    "bias": ("sigmoid, bias balancing", [*SIGMOID, "model.moe_aux_loss_coeff=0"]),
}


def train(data: dict[str, str], run_dir: Path, overrides: list[str], *, steps: int,
          micro_batch: int) -> list[dict]:
    """The train records of one run of the quickstart config with `overrides`."""
    from pretrain.testing.runs import run_pretrain, train_args

    run = run_pretrain(train_args(run_dir, data, config="configs/quickstart.yaml", overrides=[
        *overrides, "model.vocab_size=auto", "deepspeed=ds_configs/zero1.json",
        "train.precision=fp32", f"train.steps={steps}", f"train.micro_batch_size={micro_batch}",
        f"train.global_batch_size={micro_batch}", "train.eval_interval=0",
        "data.num_workers=0", "checkpoint.save_interval=0", "checkpoint.save_final=false",
        "logging.report_to=[]", "logging.curves=false", "logging.progress_bar=false",
        "logging.log_interval=50", "logging.peak_tflops=1.0"]),
        run_dir=run_dir, timeout=3600)
    if run.returncode:
        raise SystemExit(f"pretrain train failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
    return records_of(run_dir)


def records_of(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [r for r in records if r.get("kind") == "train"]


def summary(records: list[dict]) -> tuple[float, float, float]:
    """(worst layer's max/mean, the layers' mean max/mean, loss), means over the last steps."""
    last = records[-WINDOW:]
    worst = statistics.mean(r["moe_load_max_mean_worst"] for r in last)
    mean = statistics.mean(statistics.mean(r["moe_load_max_mean"]) for r in last)
    return worst, mean, statistics.mean(r["loss"] for r in last)


def plot(runs: dict[str, list[dict]], path: Path, *, rate: float) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 8.5))
    FigureCanvasAgg(figure)
    (worst_ax, mean_ax), (loss_ax, bias_ax) = figure.subplots(2, 2)
    for name, records in runs.items():
        steps = [r["step"] for r in records]
        label = RUNS[name][0] + (f" (rate {rate:g})" if name == "bias" else "")
        worst_ax.plot(steps, [r["moe_load_max_mean_worst"] for r in records], label=label,
                      linewidth=1)
        mean_ax.plot(steps, [statistics.mean(r["moe_load_max_mean"]) for r in records],
                     label=label, linewidth=1)
        loss_ax.plot(steps, [r["loss"] for r in records], label=label, linewidth=1)
    worst_ax.set_title("worst layer: busiest expert's assignments / mean")
    mean_ax.set_title("mean over the 6 layers of busiest / mean")
    loss_ax.set_title("training loss")
    later = [r["loss"] for records in runs.values() for r in records[len(records) // 20:]]
    loss_ax.set_ylim(top=max(later))  # the first steps' (~9) flatten the rest
    for ax in (worst_ax, mean_ax):
        ax.axhline(1.0, color="grey", linewidth=0.6)
        ax.set_ylim(bottom=0.9)
    if "bias" in runs:
        records = runs["bias"]
        layer = max(range(len(records[-1]["moe_load_max_mean"])),  # the worst at the start
                    key=lambda i: statistics.mean(r["moe_load_max_mean"][i] for r in records[:20]))
        for expert in range(len(records[0]["moe_expert_bias"][layer])):
            bias_ax.plot([r["step"] for r in records],
                         [r["moe_expert_bias"][layer][expert] for r in records], linewidth=1,
                         label=f"expert {expert}")
        bias_ax.set_title(f"bias run: layer {layer}'s expert biases (moe_expert_bias)\n"
                          "(the layer most loaded over the first 20 steps)", fontsize=10)
        bias_ax.legend(fontsize=7, ncol=2)
    for ax in (worst_ax, mean_ax, loss_ax, bias_ax):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in (worst_ax, mean_ax, loss_ax):
        ax.legend(fontsize=8)
    figure.suptitle("Expert load: the quickstart's widths, every MLP 8 experts top-2 (softmax: "
                    "qwen3, sigmoid: deepseek_v3; one process, fp32)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--micro-batch", type=int, default=8, help="= the global batch")
    parser.add_argument("--rate", type=float, default=0.01,
                        help="the bias run's model.moe_bias_update_rate")
    parser.add_argument("--out", type=Path, default=REPO / ".build" / "bench" / "expert_load")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "expert_load.png")
    parser.add_argument("--plot-only", action="store_true",
                        help="redraw from the metrics.jsonl under --out")
    args = parser.parse_args()
    runs = {}
    if args.plot_only:
        runs = {name: records_of(args.out / name) for name in RUNS}
    else:
        import torch

        data = stdlib_dataset(8192)
        print(f"machine: {machine()}, torch CPU capability "
              f"{torch.backends.cpu.get_cpu_capability()}, load average "
              f"{os.getloadavg()[0]:.1f} at the start")
        for name, (label, overrides) in RUNS.items():
            if name == "bias":
                overrides = [*overrides, f"model.moe_bias_update_rate={args.rate}"]
            start = time.perf_counter()
            runs[name] = train(data, args.out / name, overrides, steps=args.steps,
                               micro_batch=args.micro_batch)
            print(f"{name} ({label}): {time.perf_counter() - start:.0f} s, load average "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
    print(f"| run | worst layer max/mean | mean over layers | loss (last {WINDOW}) |")
    print("|---|---|---|---|")
    for name, records in runs.items():
        worst, mean, loss = summary(records)
        print(f"| {RUNS[name][0]} | {worst:.3f} | {mean:.3f} | {loss:.3f} |")
    plot(runs, args.plot, rate=args.rate)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
