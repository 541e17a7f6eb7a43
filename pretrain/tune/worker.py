"""One `pretrain tune` worker: trials until the study has N counted.

Each trial is one `pretrain train` run through a launcher (`pretrain.launchers.local`), in its
own run directory `<study dir>/trials/<study>-trial-<n>` (also its MLflow/wandb run name), with the
sampled values as `--set` overrides. While it runs, the worker follows its `metrics.jsonl`: every
train loss is reported to the pruner at its step (`trial.report`); when the pruner says so, the
run is stopped (every process of it) and the trial is PRUNED. The objective is the last
validation loss (`--objective valid`) or the last train loss (`train`). A run that exits non-zero
is a FAIL trial with its log's tail printed; a non-finite loss stops the run and fails the trial.
On SIGTERM a worker stops its run (SIGTERM, then SIGKILL after the grace) and fails and
re-enqueues its trial itself. On SIGKILL it cannot; the run's launcher still gets SIGTERM
(`launchers.local.die_with_parent`) and stops its ranks, and the next worker fails and retries the
trial (`pretrain.tune.study`).
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.launchers.local import child_env, launcher_command, start_run, stop_run
from pretrain.tune.results import write_results
from pretrain.tune.space import override
from pretrain.tune.study import (Settings, heartbeat_path, load_study, next_trial, params_text,
                                  retry, run_dir_of, study_lock)


POLL_S = 0.5  # how often a worker reads its trial's metrics.jsonl
HEARTBEAT_S = 5.0  # how often a worker touches its trial's heartbeat file
LOG_TAIL_LINES = 15  # lines of a failed trial's log printed


@dataclass
class Outcome:
    state: str  # COMPLETE | PRUNED | FAIL
    value: float | None = None
    step: int | None = None  # the last train step seen
    reason: str = ""


class MetricsFollower:
    """The records appended to a metrics.jsonl since the last call (whole lines only)."""

    def __init__(self, path: Path) -> None:
        self.path, self._offset, self._partial = path, 0, b""

    def new_records(self) -> list[dict[str, Any]]:
        import json

        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()  # "" after a complete last line
        return [json.loads(line) for line in lines if line.strip()]


def trial_command(settings: Settings, trial: Any) -> list[str]:
    args = ["train"] + (["--config", settings.config] if settings.config else [])
    overrides = settings.base_overrides + [override(p.key, trial.params[p.key])
                                           for p in settings.params]
    overrides.append(f"run_dir={run_dir_of(settings, trial.number)}")
    for text in overrides:
        args += ["--set", text]
    return launcher_command(settings.launcher, settings.nprocs) + args


def _log_tail(log: Path) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
    return ""


def run_trial(settings: Settings, trial: Any) -> Outcome:
    """Run the trial's `pretrain train`, reporting its train losses to the pruner."""
    run_dir = run_dir_of(settings, trial.number)
    log = run_dir.with_name(run_dir.name + ".log")
    heartbeat = heartbeat_path(run_dir)
    follower = MetricsFollower(run_dir / "metrics.jsonl")
    started, beat = time.monotonic(), time.monotonic()
    last_train: tuple[int, float] | None = None
    last_eval: float | None = None
    with open(log, "w") as f:
        proc = start_run(trial_command(settings, trial), log=f, env=child_env())
        try:
            while True:
                exited = proc.poll() is not None  # before reading: no record is missed
                for record in follower.new_records():
                    kind, loss = record.get("kind"), record.get("loss")
                    if kind not in ("train", "eval"):
                        continue
                    if loss is None or not math.isfinite(loss):
                        stop_run(proc, grace_s=settings.stop_grace_s)
                        step = record.get("step")
                        return Outcome("FAIL", step=step,
                                       reason=f"non-finite {kind} loss at step {step}")
                    if kind == "eval":
                        last_eval = loss
                        continue
                    last_train = (record["step"], loss)
                    trial.report(loss, record["step"])
                    if trial.should_prune():
                        stop_run(proc, grace_s=settings.stop_grace_s)
                        return Outcome("PRUNED", value=loss, step=record["step"],
                                       reason=f"pruned at step {record['step']}")
                if exited:
                    break
                if time.monotonic() - started > settings.timeout_s:
                    stop_run(proc, grace_s=settings.stop_grace_s)
                    return Outcome("FAIL", step=last_train and last_train[0],
                                   reason=f"timeout after {settings.timeout_s:g}s")
                if time.monotonic() - beat > HEARTBEAT_S:
                    heartbeat.touch()
                    beat = time.monotonic()
                with contextlib.suppress(Exception):  # subprocess.TimeoutExpired: poll again
                    proc.wait(timeout=POLL_S)
        except BaseException:  # the worker is stopping: its run must not outlive it
            print(f"{settings.label} stopping trial {trial.number}'s run (SIGKILL after "
                  f"{settings.stop_grace_s:g}s)", file=sys.stderr, flush=True)
            stop_run(proc, grace_s=settings.stop_grace_s)
            raise
    step = last_train and last_train[0]
    if proc.returncode != 0:
        tail = _log_tail(log)
        return Outcome("FAIL", step=step,
                       reason=f"exit {proc.returncode}, the end of {log}:\n{tail}")
    value = last_eval if settings.objective == "valid" else last_train and last_train[1]
    if value is None:
        return Outcome("FAIL", step=step, reason=f"the run wrote no {settings.objective} loss "
                                                 f"(log {log})")
    return Outcome("COMPLETE", value=value, step=step)


def drop_weights(run_dir: Path) -> None:
    """Delete a finished trial's checkpoints and final weights (a study of N trials would keep N
    models' weights and optimizer states); its config, log and metrics stay."""
    import shutil

    for name in ("checkpoints", "final"):
        shutil.rmtree(run_dir / name, ignore_errors=True)


def work(settings: Settings) -> int:
    """One worker: trials until the study has N counted; the number of trials it ran."""
    from optuna.trial import TrialState

    ran = 0
    while True:
        picked = next_trial(settings)
        if picked is None:
            return ran
        study, trial = picked
        print(f"{settings.label} trial {trial.number} started: {params_text(trial.params)} "
              f"(run {run_dir_of(settings, trial.number)})", flush=True)
        started = time.monotonic()
        try:
            outcome = run_trial(settings, trial)
        except BaseException:
            with study_lock(settings):
                mine = next(t for t in study.get_trials(deepcopy=False)
                            if t.number == trial.number)
                retry(study, mine, "its worker was stopped", settings)
            raise
        state = getattr(TrialState, outcome.state)
        try:
            study.tell(trial, outcome.value if state == TrialState.COMPLETE else None,
                       state=state)
        except Exception as exc:  # noqa: BLE001 - failed as stale by another worker meanwhile
            print(f"{settings.label} trial {trial.number}: {exc}", flush=True)
        ran += 1
        heartbeat_path(run_dir_of(settings, trial.number)).unlink(missing_ok=True)
        if not settings.keep_checkpoints:
            drop_weights(run_dir_of(settings, trial.number))
        value = f"{outcome.value:.4f}" if outcome.value is not None else "-"
        first, _, tail = outcome.reason.partition("\n")  # a failed run's log tail below
        print(f"{settings.label} trial {trial.number} {outcome.state} value {value} step "
              f"{outcome.step} in {time.monotonic() - started:.1f}s: "
              f"{params_text(trial.params)}" + (f" ({first})" if first else "")
              + (f"\n{tail}" if tail else ""), flush=True)
        with study_lock(settings):
            write_results(load_study(settings), settings, plots=False)
