"""Learning-rate transfer across widths: standard parametrization against muP.

For each parametrization (`model.parametrization: standard | mup`), each width (default 64, 128,
256; head dim 32, 2 decoder layers, SwiGLU ffn 8/3 x width, untied embeddings, 8 x 64 tokens a step)
and each learning rate of a grid of factors of 2, one fp32 model is trained in this process
with `torch.optim.AdamW` over the parameter groups `pretrain.model.mup.optimizer_groups` makes
(the groups the engine gives DeepSpeed: under muP the hidden matrices learn at lr / m, m =
width / model.mup_base_width), on the bundled corpus (python-stdlib, 2048-token BPE), the same
samples in the same order for every run; linear warmup over the first 10% of the steps, then a
constant lr. The score is the loss on a fixed set of validation samples after the last step (a
run whose loss is not finite scores infinity).

The claim muP makes: its best learning rate is the same grid point for every width (or a
neighbour); under standard parametrization it moves to smaller rates as the width grows.

    .venv/bin/python bench/mup_transfer.py                      # ~13 minutes on 2 cores
    .venv/bin/python bench/mup_transfer.py --steps 100 --lr-exponents=-10,-9,-8   # quicker

Writes the table to stdout, the losses to .build/bench/mup_transfer.json (rerun with --plot-only
to redraw) and the curves (validation loss against lr, one line per width, one panel per
parametrization) to docs/mup_transfer.png.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from common import CACHE, REPO, batches, machine, stdlib_dataset

RESULTS = CACHE / "mup_transfer.json"
PLOT = REPO / "docs" / "mup_transfer.png"


def model_config(width: int, parametrization: str, *, base_width: int, head_dim: int,
                 layers: int, seq: int, vocab: int):
    from pretrain.config import load_config

    heads = width // head_dim
    ffn = 64 * math.ceil(8 * width / 3 / 64)
    return load_config(None, [
        "model.preset=tiny", f"model.hidden_size={width}", f"model.num_layers={layers}",
        f"model.num_heads={heads}", f"model.num_kv_heads={heads}", f"model.ffn_hidden_size={ffn}",
        f"model.seq_length={seq}", f"model.vocab_size={vocab}", "model.tie_embeddings=false",
        f"model.parametrization={parametrization}", f"model.mup_base_width={base_width}",
        f"model.mup_base_head_dim={head_dim}", "model.loss_chunk_tokens=0"]).model


def train_one(cfg, lr: float, *, train, valid, seed: int) -> float:
    from pretrain.model import build_model
    from pretrain.model.mup import optimizer_groups

    torch.manual_seed(seed)
    model = build_model(cfg, seed=seed)
    optimizer = torch.optim.AdamW(optimizer_groups(model, lr=lr, weight_decay=0.0, cfg=cfg),
                                  betas=(0.9, 0.95), eps=1e-8)
    warmup = max(1, len(train) // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / warmup))
    model.train()
    for input_ids, labels in train:
        loss = model(input_ids, labels)
        if not torch.isfinite(loss):
            return math.inf
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    model.eval()
    with torch.no_grad():
        losses = [float(model(i, l)) for i, l in valid]
    value = sum(losses) / len(losses)
    return value if math.isfinite(value) else math.inf


def best_index(losses: list[float]) -> int:
    return min(range(len(losses)), key=lambda i: losses[i])


def table(results: dict) -> str:
    exps = results["lr_exponents"]
    lines = ["| parametrization | width | " + " | ".join(f"2^{e}" for e in exps) + " | best lr |",
             "|---|---|" + "---|" * len(exps) + "---|"]
    for param in results["parametrizations"]:
        for width in results["widths"]:
            losses = results["loss"][param][str(width)]
            best = best_index(losses)
            cells = [("**%.3f**" if i == best else "%.3f") % v if math.isfinite(v) else "diverged"
                     for i, v in enumerate(losses)]
            lines.append(f"| {param} | {width} | " + " | ".join(cells) + f" | 2^{exps[best]} |")
    return "\n".join(lines)


def shifts(results: dict) -> dict[str, int]:
    """How many grid points the best lr moves between the narrowest and the widest model."""
    exps = results["lr_exponents"]
    out = {}
    for param in results["parametrizations"]:
        bests = [exps[best_index(results["loss"][param][str(w)])] for w in results["widths"]]
        out[param] = max(bests) - min(bests)
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    exps = results["lr_exponents"]
    params = results["parametrizations"]
    fig, axes = plt.subplots(1, len(params), figsize=(5.5 * len(params), 4.2), sharey=True)
    axes = [axes] if len(params) == 1 else list(axes)
    finite = [v for p in params for w in results["widths"] for v in results["loss"][p][str(w)]
              if math.isfinite(v)]
    top = min(max(finite), min(finite) + 3.0)
    for ax, param in zip(axes, params):
        for width in results["widths"]:
            losses = results["loss"][param][str(width)]
            ax.plot(exps, [v if math.isfinite(v) else float("nan") for v in losses], marker="o",
                    label=f"width {width}")
            best = best_index(losses)
            ax.plot([exps[best]], [losses[best]], marker="*", markersize=14, color="black")
        ax.set_title(f"{param} parametrization")
        ax.set_xlabel("log2 learning rate")
        ax.set_ylim(min(finite) - 0.1, top)
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel(f"validation loss after {results['steps']} steps")
    fig.suptitle("Best learning rate per width (star): muP keeps it, standard moves it")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", default="64,128,256")
    parser.add_argument("--lr-exponents", default="-11,-10,-9,-8,-7,-6,-5,-4",
                        help="log2 of the learning rates (comma separated)")
    parser.add_argument("--parametrizations", default="standard,mup")
    parser.add_argument("--base-width", type=int, default=64)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048, help="BPE vocabulary of the corpus")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--valid-batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: no fight with "
                        "other work for the cores; other counts change the losses only by rounding)")
    parser.add_argument("--plot-only", action="store_true", help="redraw from the saved losses")
    args = parser.parse_args()
    if args.plot_only:
        results = json.loads(RESULTS.read_text())
    else:
        torch.set_num_threads(args.threads)
        data = stdlib_dataset(args.vocab)
        vocab = args.vocab
        train = batches(data["dataset"], split="train", seq=args.seq, batch=args.batch,
                        count=args.steps)
        valid = batches(data["dataset"], split="valid", seq=args.seq, batch=args.batch,
                        count=args.valid_batches)
        widths = [int(w) for w in args.widths.split(",")]
        exps = [int(e) for e in args.lr_exponents.split(",")]
        params = args.parametrizations.split(",")
        results = {"machine": machine(), "widths": widths, "lr_exponents": exps,
                   "parametrizations": params, "steps": args.steps, "batch": args.batch,
                   "seq": args.seq, "layers": args.layers, "base_width": args.base_width,
                   "head_dim": args.head_dim, "loss": {p: {} for p in params}, "seconds": {}}
        start = time.perf_counter()
        for param in params:
            for width in widths:
                cfg = model_config(width, param, base_width=args.base_width,
                                   head_dim=args.head_dim, layers=args.layers, seq=args.seq,
                                   vocab=vocab)
                losses = []
                for e in exps:
                    t0 = time.perf_counter()
                    losses.append(train_one(cfg, 2.0 ** e, train=train, valid=valid,
                                            seed=args.seed))
                    print(f"{param:8s} width {width:4d} lr 2^{e:<3d} valid loss {losses[-1]:.4f}"
                          f" ({time.perf_counter() - t0:.0f} s)", flush=True)
                results["loss"][param][str(width)] = losses
        results["seconds"] = round(time.perf_counter() - start)
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(results, indent=1))
    print(f"\n{results['machine']}; {results['steps']} steps of {results['batch']} x "
          f"{results['seq']} tokens, {results['layers']} layers, head dim {results['head_dim']}, "
          f"muP base width {results['base_width']}; {results.get('seconds', '?')} s\n")
    print(table(results))
    moved = shifts(results)
    print("\nbest lr moves by (grid points, narrowest to widest): "
          + ", ".join(f"{p} {n}" for p, n in moved.items()))
    try:
        plot(results, PLOT)
        print(f"curves: {PLOT.relative_to(REPO)}")
    except ImportError as e:
        print(f"no plot ({e})")


if __name__ == "__main__":
    main()
