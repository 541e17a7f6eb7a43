"""`pretrain sweep`: short runs over DeepSpeed configs x micro-batch sizes, as a table and a plot.

Each (DeepSpeed JSON, micro-batch) pair is one `pretrain train` run of the same run config,
launched as a subprocess through a launcher (torchrun by default), in `<out>/<json>_mbs<M>/`.
From each run's `metrics.jsonl` the sweep takes the median tokens/s and step time (the first
step, which pays for warm-up, is left out when there are more), the peak memory of every rank,
and the final loss, and writes::

    <out>/sweep.csv   one row per run
    <out>/sweep.md    the same as a Markdown table
    <out>/sweep.png   tokens/s and peak memory per run (matplotlib)

On a Slurm cluster the runs are an array job (`slurm/zero_sweep.sh`, one task per run);
`pretrain sweep --aggregate DIR` then builds the same table and plot from a directory of finished
runs, and `--list` prints the runs (name and `pretrain train` arguments, one per line)::

    pretrain sweep --config configs/tiny.yaml --set data.dataset=... --nprocs 2 --steps 5 \
        --deepspeed-configs ds_configs/zero1.json ds_configs/zero3.json --micro-batches 1 2
    pretrain sweep --aggregate runs/zero_sweep-1234

The result rows, table and plot are built by `pretrain.sweep_results`.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from pretrain.errors import ConfigError
from pretrain.sweep_results import summarize_run, write_results

DEFAULT_DS_CONFIGS = ["ds_configs/zero0.json", "ds_configs/zero1.json", "ds_configs/zero2.json",
                      "ds_configs/zero3.json"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="run config YAML every run starts from")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config field of every run (repeatable)")
    parser.add_argument("--deepspeed-configs", nargs="+", default=DEFAULT_DS_CONFIGS,
                        metavar="JSON", help="DeepSpeed JSONs to sweep (default: ZeRO 0-3)")
    parser.add_argument("--micro-batches", nargs="+", type=int, metavar="N",
                        help="micro-batch sizes to sweep (default: the config's)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    parser.add_argument("--nprocs", type=int, default=2, help="ranks per run (one node)")
    parser.add_argument("--launcher", default="torchrun", choices=["torchrun", "deepspeed", "single"])
    parser.add_argument("--out", default="runs/sweep", help="directory of the runs and results")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    parser.add_argument("--list", action="store_true",
                        help="print the runs (name, then `pretrain train` arguments) and exit")
    parser.add_argument("--aggregate", metavar="DIR",
                        help="only build sweep.csv/.md/.png from the finished runs under DIR")


def planned_runs(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(run name, `pretrain train` arguments) for every DeepSpeed config x micro-batch."""
    micro_batches = args.micro_batches or [None]
    runs = []
    for ds in args.deepspeed_configs:
        if not Path(ds).is_file():
            raise ConfigError(f"--deepspeed-configs: {ds!r} does not exist; choose from "
                              "ds_configs/*.json")
        for mbs in micro_batches:
            name = Path(ds).stem + (f"_mbs{mbs}" if mbs is not None else "")
            train_args = (["--config", args.config] if args.config else [])
            for override in args.set:
                train_args += ["--set", override]
            train_args += ["--deepspeed-config", ds, "--set", f"train.steps={args.steps}",
                           "--set", f"run_dir={Path(args.out) / name}"]
            if mbs is not None:
                train_args += ["--set", f"train.micro_batch_size={mbs}"]
            runs.append((name, train_args))
    return runs


def launcher_command(launcher: str, nprocs: int) -> list[str]:
    """The command that starts `pretrain` on `nprocs` ranks of this machine."""
    from pretrain.dist import free_port

    if launcher == "single":
        if nprocs != 1:
            raise ConfigError(f"--launcher single runs one process, got --nprocs {nprocs}: "
                              "use torchrun or deepspeed")
        return [sys.executable, "-m", "pretrain"]
    port = str(free_port())  # concurrent sweeps must not share the default port 29500
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nprocs),
                "--master_port", port, "-m", "pretrain"]
    return [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(nprocs),
            "--master_port", port, "--no_local_rank", "--module", "pretrain"]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.aggregate:
        root = Path(args.aggregate)
        runs = sorted(d for d in root.iterdir() if (d / "metrics.jsonl").is_file()) \
            if root.is_dir() else []
        if not runs:
            raise ConfigError(f"--aggregate {str(root)!r}: no run directories with metrics.jsonl "
                              "under it")
        rows = [summarize_run(d) for d in runs]
        paths = write_results(rows, root)
        print(paths["md"].read_text(), end="")
        print(f"[sweep] {len(rows)} runs -> {', '.join(str(p) for p in paths.values())}")
        return rows
    runs = planned_runs(args)
    if args.list:
        for name, train_args in runs:
            print(f"{name}\t{shlex.join(train_args)}")
        return []
    prefix = launcher_command(args.launcher, args.nprocs)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # each run is its own job, not a rank of ours
    rows = []
    for i, (name, train_args) in enumerate(runs, 1):
        print(f"[sweep] {i}/{len(runs)} {name}", flush=True)
        run_dir = Path(args.out) / name
        log = run_dir.parent / f"{name}.log"
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            proc = subprocess.run(prefix + ["train", *train_args], stdout=f,
                                  stderr=subprocess.STDOUT, env=env, timeout=args.timeout)
        row = summarize_run(run_dir)
        if proc.returncode != 0:
            errors = [ln for ln in log.read_text().splitlines() if ln.startswith("error:")]
            row["status"] = f"exit {proc.returncode}" + (f": {errors[0][7:]}" if errors else "")
        rows.append(row)
        print(f"[sweep]   {row['status']}: {row['tokens_per_s']} tokens/s, peak "
              f"{row['peak_mem_gb_max']} GB/rank, loss {row['final_loss']} (log {log})", flush=True)
    paths = write_results(rows, Path(args.out))
    print(paths["md"].read_text(), end="")
    print(f"[sweep] {len(rows)} runs -> {', '.join(str(p) for p in paths.values())}")
    return rows
