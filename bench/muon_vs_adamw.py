"""Muon against AdamW on the quickstart model: training loss against tokens.

The quickstart's model (`configs/quickstart.yaml`: preset small, 6 layers, hidden 384, tied
embeddings, 8k BPE of the bundled python-stdlib corpus) is trained in this process, fp32, twice
from the same initial weights on the same batches in the same order: once with AdamW over every
parameter (`mup.optimizer_groups`, the groups the engine gives DeepSpeed), once with
`train.optimizer: muon` (`pretrain.training.muon.build_optimizer`: Muon for the decoder
projections, AdamW for the rest), both under the quickstart's warmup-cosine schedule, gradients
clipped at 1.0.

    .venv/bin/python bench/muon_vs_adamw.py --steps 60     # ~5 minutes on 2 cores

Writes the losses to .build/bench/muon_vs_adamw.json and the curves to docs/muon_vs_adamw.png.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from common import CACHE, REPO, batches, machine, stdlib_dataset

RESULTS = CACHE / "muon_vs_adamw.json"
PLOT = REPO / "docs" / "muon_vs_adamw.png"


def train(cfg, optimizer_name: str, data) -> list[float]:
    from pretrain.model import build_model
    from pretrain.model.mup import optimizer_groups
    from pretrain.training.engine import lr_factor
    from pretrain.training.muon import build_optimizer

    t = cfg.train
    model = build_model(cfg.model, seed=t.seed)
    groups = optimizer_groups(model, lr=t.lr, weight_decay=t.weight_decay, cfg=cfg.model)
    if optimizer_name == "muon":
        optimizer = build_optimizer(model.named_parameters(), groups, t)
    else:
        optimizer = torch.optim.AdamW(groups, betas=(t.beta1, t.beta2), eps=t.eps)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(t))
    losses = []
    for step, (ids, labels) in enumerate(data, 1):
        loss = model(ids, labels=labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        print(f"{optimizer_name} step {step} loss {loss.item():.4f}", flush=True)
    return losses


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    tokens = results["tokens_per_step"]
    for name, losses in results["losses"].items():
        ax.plot([tokens * (i + 1) for i in range(len(losses))], losses, label=name)
    ax.set_xlabel("tokens")
    ax.set_ylabel("training loss")
    ax.set_title(f"quickstart model, {results['steps']} steps: Muon vs AdamW")
    ax.legend()
    fig.tight_layout()
    fig.savefig(PLOT, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=8, help="samples per step")
    parser.add_argument("--muon-lr", type=float, default=0.02)
    parser.add_argument("--plot-only", action="store_true")
    args = parser.parse_args()
    if not args.plot_only:
        from pretrain.config import load_config

        data = stdlib_dataset(8192)
        cfg = load_config(REPO / "configs" / "quickstart.yaml",
                          ["model.vocab_size=8192", "train.precision=fp32",
                           f"train.steps={args.steps}", f"train.muon_lr={args.muon_lr}",
                           "train.warmup_steps=" + str(max(1, args.steps // 8))])
        torch.manual_seed(0)
        train_data = batches(data["dataset"], split="train", seq=cfg.model.seq_length,
                             batch=args.batch, count=args.steps)
        results = {"steps": args.steps, "tokens_per_step": args.batch * cfg.model.seq_length,
                   "machine": machine(), "lr": cfg.train.lr, "muon_lr": args.muon_lr,
                   "losses": {}, "seconds": {}}
        for name in ("adamw", "muon"):
            start = time.perf_counter()
            results["losses"][name] = train(cfg, name, train_data)
            results["seconds"][name] = time.perf_counter() - start
        CACHE.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(results, indent=1))
    results = json.loads(RESULTS.read_text())
    plot(results)
    for name, losses in results["losses"].items():
        tail = sum(losses[-10:]) / len(losses[-10:])
        print(f"{name}: first {losses[0]:.3f}, mean of the last 10 steps {tail:.3f}, "
              f"{results['seconds'][name]:.0f} s")
    print(results["machine"])


if __name__ == "__main__":
    main()
