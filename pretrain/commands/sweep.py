"""`pretrain sweep`: short runs over DeepSpeed configs x micro-batch sizes (x engines), as a table
and a plot.

Each (DeepSpeed JSON, micro-batch) pair is one `pretrain train` run of the same run config,
launched as a subprocess through a launcher (torchrun by default), in `<out>/<json>_mbs<M>/`.
`--engines deepspeed fsdp2` runs each pair once per `train.engine`, in
`<out>/<engine>_<json>_mbs<M>/`: the same model and data sharded by DeepSpeed's ZeRO and by
FSDP2 as that JSON asks, side by side in the table (its `engine` column) and the plot (a bar per
engine).
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
    pretrain sweep --config configs/tiny.yaml --set data.dataset=... --nprocs 2 --steps 5 \
        --deepspeed-configs ds_configs/zero3.json --engines deepspeed fsdp2
    pretrain sweep --aggregate runs/zero_sweep-1234

Every run's config is loaded and its DeepSpeed JSON resolved for `--nprocs` ranks before the
first run starts (and before `--list` prints), as `pretrain train` would: a bad field or layout is
one `error:` line and exit 2, not N failed runs. A run that exceeds `--timeout` is stopped
(SIGTERM to its processes, SIGKILL after STOP_GRACE_S: `pretrain.launchers.local`) and gets a
`timeout after Ns` row; the sweep goes on.

The result rows, table and plot are built by `pretrain.sweep.results`.
"""
from __future__ import annotations

import argparse
import itertools
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from pretrain.config import Engine, resolve_input_path
from pretrain.errors import ConfigError
from pretrain.launchers.local import (LAUNCHERS, STOP_GRACE_S, child_env, launcher_command,
                                      sigterm_raises, start_run, stop_run)
from pretrain.sweep.results import summarize_run, write_results

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
    parser.add_argument("--engines", nargs="+", choices=[e.value for e in Engine],
                        metavar="ENGINE", help="train.engine values to sweep, each run of every "
                        "JSON x micro-batch once per engine (deepspeed, fsdp2; default: the "
                        "config's engine, runs named without it)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    parser.add_argument("--nprocs", type=int, default=2, help="ranks per run (one node)")
    parser.add_argument("--launcher", default="torchrun", choices=LAUNCHERS)
    parser.add_argument("--out", default="runs/sweep", help="directory of the runs and results")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    parser.add_argument("--list", action="store_true",
                        help="print the runs (name, then `pretrain train` arguments) and exit")
    parser.add_argument("--aggregate", metavar="DIR",
                        help="only build sweep.csv/.md/.png from the finished runs under DIR")


def planned_runs(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(run name, `pretrain train` arguments) for every DeepSpeed config x micro-batch (x
    engine, when `--engines` names them)."""
    micro_batches = args.micro_batches or [None]
    engines = getattr(args, "engines", None) or [None]
    if len(set(engines)) < len(engines):
        raise ConfigError(f"--engines {' '.join(engines)}: each engine once")
    runs = []
    for ds in args.deepspeed_configs:
        if not Path(resolve_input_path(ds, base=Path.cwd())).is_file():  # as train will read it
            raise ConfigError(f"--deepspeed-configs: {ds!r} does not exist; choose from "
                              "ds_configs/*.json")
        for mbs, engine in itertools.product(micro_batches, engines):
            name = (f"{engine}_" if engine else "") + Path(ds).stem \
                + (f"_mbs{mbs}" if mbs is not None else "")
            train_args = (["--config", args.config] if args.config else [])
            for override in args.set:
                train_args += ["--set", override]
            train_args += ["--deepspeed-config", ds, "--set", f"train.steps={args.steps}",
                           "--set", f"run_dir={Path(args.out) / name}"]
            if mbs is not None:
                train_args += ["--set", f"train.micro_batch_size={mbs}"]
            if engine is not None:
                train_args += ["--set", f"train.engine={engine}"]
            runs.append((name, train_args))
    return runs


def check_runs(runs: list[tuple[str, list[str]]], *, world_size: int) -> None:
    """Load every run's config and resolve its DeepSpeed JSON for `world_size` ranks, as
    `pretrain train` would: a bad field or layout fails the sweep before any run starts."""
    from pretrain.commands import train
    from pretrain.config import config_overrides, load_config
    from pretrain.resolve.run import lay_out_as_loaded

    parser = argparse.ArgumentParser(prog="pretrain train")
    train.add_arguments(parser)
    for name, train_args in runs:
        args = parser.parse_args(train_args)
        try:
            cfg = load_config(args.config, config_overrides(args))
            lay_out_as_loaded(cfg, world_size=world_size)
        except ConfigError as exc:
            raise ConfigError(f"sweep run {name} ({world_size} ranks): {exc}") from None


def _run_one(label: str, command: list[str], *, run_dir: Path, env: dict[str, str],
             timeout: float) -> dict[str, Any]:
    """One run in a session of its own, stopped after `timeout` seconds or when the sweep is
    interrupted (Ctrl-C or SIGTERM no longer reach it through the terminal); its result row."""
    log = run_dir.parent / f"{run_dir.name}.log"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    timed_out = False
    with open(log, "w") as f:
        proc = start_run(command, log=f, env=env)
        try:
            print(f"[sweep] {label} (process group {proc.pid})", flush=True)
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            stop_run(proc, grace_s=STOP_GRACE_S)
        except BaseException:  # the sweep is stopping: its run must not outlive it
            print(f"[sweep] stopping {label} (SIGKILL after {STOP_GRACE_S:g}s)", file=sys.stderr,
                  flush=True)
            stop_run(proc, grace_s=STOP_GRACE_S)
            raise
    row = summarize_run(run_dir)
    if timed_out:
        row["status"] = f"timeout after {timeout:g}s"
    elif proc.returncode != 0:
        errors = [ln for ln in log.read_text().splitlines() if ln.startswith("error:")]
        row["status"] = f"exit {proc.returncode}" + (f": {errors[0][7:]}" if errors else "")
    print(f"[sweep]   {row['status']}: {row['tokens_per_s']} tokens/s, peak "
          f"{row['peak_mem_gb_max']} GB/rank, loss {row['final_loss']} (log {log})", flush=True)
    return row


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
    check_runs(runs, world_size=1 if args.launcher == "single" else args.nprocs)
    if args.list:
        for name, train_args in runs:
            print(f"{name}\t{shlex.join(train_args)}")
        return []
    prefix = launcher_command(args.launcher, args.nprocs)
    env = child_env()
    rows = []
    with sigterm_raises():
        for i, (name, train_args) in enumerate(runs, 1):
            rows.append(_run_one(f"{i}/{len(runs)} {name}", prefix + ["train", *train_args],
                                 run_dir=Path(args.out) / name, env=env, timeout=args.timeout))
    paths = write_results(rows, Path(args.out))
    print(paths["md"].read_text(), end="")
    print(f"[sweep] {len(rows)} runs -> {', '.join(str(p) for p in paths.values())}")
    return rows
