"""The straggler check's cost: step time with and without it, at the quickstart's shape.

`pretrain train --config configs/quickstart.yaml` (the `small` preset, 2 ranks under torchrun,
ZeRO-2, micro-batch 8, global batch 16, seq 256) on the bundled corpus, fp32, no evaluation, no
checkpoints, `--steps` steps, alternately with `train.straggler_interval=0` (off) and with a
check every `--interval` steps (1, the default here, is the worst case: the collective clock
and one all-gather every step). The median `step_time_s` of metrics.jsonl after `--warmup`
steps is kept per run; the best run of each side is compared, and each round's ratio printed,
so a busy moment on a shared machine does not decide it. Target: under 1% at interval 50; the
interval-1 ratio bounds it from above.

    .venv/bin/python bench/straggler_overhead.py                  # ~8 minutes on 2 cores
    .venv/bin/python bench/straggler_overhead.py --rounds 1 --steps 20
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from common import machine, median, stdlib_dataset
from pretrain.testing.runs import REPO, run_pretrain, train_args


def step_time(data: dict[str, str], work: Path, *, interval: int, steps: int, warmup: int,
              name: str) -> float:
    run_dir = work / name
    overrides = [f"train.steps={steps}", "train.eval_interval=0", "train.precision=fp32",
                 "checkpoint.save_final=false", "checkpoint.save_interval=0",
                 "logging.report_to=[]", "data.num_workers=1",
                 f"train.straggler_interval={interval}", "train.straggler_patience=1000"]
    args = train_args(run_dir, data, overrides=overrides,
                      config=str(REPO / "configs" / "quickstart.yaml"))
    run = run_pretrain(args, run_dir=run_dir, launcher="torchrun", nprocs=2, timeout=3600)
    run.check()
    times = [r["step_time_s"] for r in (json.loads(line) for line in
                                         (run_dir / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "train"]
    return median(times[warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--interval", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    data = stdlib_dataset()
    off, on = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for interval, times in ((0, off), (args.interval, on)):
                times.append(step_time(data, Path(tmp), interval=interval, steps=args.steps,
                                       warmup=args.warmup, name=f"r{round_}_i{interval}"))
            print(f"round {round_ + 1}: off {off[-1]:.3f}s, check every {args.interval} "
                  f"step(s) {on[-1]:.3f}s, ratio {on[-1] / off[-1]:.4f}", flush=True)
    print(f"best step time: off {min(off):.3f}s, on {min(on):.3f}s; overhead "
          f"{100 * (min(on) / min(off) - 1):+.2f}% (check every {args.interval} step(s))")
    print(f"machine: {machine()}")


if __name__ == "__main__":
    main()
