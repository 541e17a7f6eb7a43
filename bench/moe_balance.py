"""Expert-load balance with and without the load-balancing auxiliary loss.

`configs/tiny_moe.yaml` (hidden 64, 2 layers, 4 experts top-2, seq 32, fp32, one process) trains
`--steps` steps on the bundled corpus (python-stdlib, the quickstart's 8k tokenizer, made once
under .build/bench) twice through `pretrain train`: `model.moe_aux_loss_coeff` 0 and `--coeff`
(the default, 0.01). Each step's per-layer tokens per expert come from metrics.jsonl
(`moe_load_max_mean`: the most loaded expert's assignments over the mean; 1.0 is perfectly
balanced, 2.0 here means one expert takes every token's first or second choice). Printed: the
mean over the last 50 steps of the worst layer's and of the layers' mean max/mean, per run, and
their ratio. The z-loss is off in both runs so that only the balance loss differs.

    cd bench && ../.venv/bin/python moe_balance.py              # ~4 minutes on 2 cores
    cd bench && ../.venv/bin/python moe_balance.py --steps 60   # a quick look
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from common import machine, stdlib_dataset
from pretrain.testing.runs import run_pretrain, train_args

WINDOW = 50


def train(data: dict[str, str], out: Path, *, coeff: float, steps: int, micro_batch: int) -> list:
    """The train records of one run with balance-loss coefficient `coeff`."""
    run_dir = out / f"coeff_{coeff:g}"
    run = run_pretrain(train_args(run_dir, data, config="configs/tiny_moe.yaml", overrides=[
        f"train.steps={steps}", f"model.moe_aux_loss_coeff={coeff}", "model.moe_z_loss_coeff=0",
        "model.vocab_size=auto", f"train.micro_batch_size={micro_batch}",
        f"train.global_batch_size={micro_batch}", "train.warmup_steps=10",
        "logging.log_interval=50"]), run_dir=run_dir, timeout=1800)
    if run.returncode:
        raise SystemExit(f"pretrain train failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [r for r in records if r.get("kind") == "train"]


def summary(records: list) -> tuple[float, float, float]:
    """(worst layer's max/mean, the layers' mean max/mean, loss), means over the last steps."""
    last = records[-WINDOW:]
    worst = statistics.mean(r["moe_load_max_mean_worst"] for r in last)
    mean = statistics.mean(statistics.mean(r["moe_load_max_mean"]) for r in last)
    return worst, mean, statistics.mean(r["loss"] for r in last)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--coeff", type=float, default=0.01, help="the balanced run's coefficient")
    parser.add_argument("--micro-batch", type=int, default=8)
    args = parser.parse_args()
    data = stdlib_dataset(8192)
    print(f"machine: {machine()}")
    results = {}
    with tempfile.TemporaryDirectory() as out:
        for coeff in (0.0, args.coeff):
            start = time.perf_counter()
            records = train(data, Path(out), coeff=coeff, steps=args.steps,
                            micro_batch=args.micro_batch)
            results[coeff] = summary(records)
            worst, mean, loss = results[coeff]
            print(f"moe_aux_loss_coeff {coeff:g}: expert load max/mean over the last "
                  f"{min(WINDOW, len(records))} steps: worst layer {worst:.3f}, layer mean "
                  f"{mean:.3f} | loss {loss:.3f} | {time.perf_counter() - start:.0f} s")
    (w0, m0, _), (w1, m1, _) = results[0.0], results[args.coeff]
    print(f"without / with the balance loss: worst layer {w0:.3f} / {w1:.3f} = {w0 / w1:.2f}x, "
          f"layer mean {m0:.3f} / {m1:.3f} = {m0 / m1:.2f}x")


if __name__ == "__main__":
    main()
