"""The study every worker of `pretrain tune` shares: its settings, its storage (an Optuna journal
file in the study directory, made for shared file systems, or any RDB URL), the file lock a
worker takes to ask for a trial, and which trials count.

A worker asks for a trial only under the lock, and only while finished (COMPLETE, PRUNED, FAIL)
plus running trials are fewer than N: N trials means N. A worker keeps a heartbeat file beside
its trial's run directory; a RUNNING trial whose worker is gone (same host: the process no
longer exists; any host: no heartbeat for `grace_period_s`) is marked FAIL by the next worker
that asks for a trial, and its parameters are enqueued again as a new trial (`retry_of`), so
that neither the interrupted trial nor the retry's predecessor is counted twice.
"""
from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pretrain.file_lock import exclusive_lock, pid_alive
from pretrain.tune.space import Param, yaml_value


@dataclass
class Settings:
    """What every worker of one `pretrain tune` needs: the study and how a trial runs."""

    study_dir: Path
    study_name: str
    storage: str  # an RDB URL, or a journal file path
    params: list[Param]
    trials: int
    config: str | None
    base_overrides: list[str]  # --set of every trial (and --deepspeed-config as deepspeed=...)
    objective: str  # valid | train
    pruner: str  # median | halving | none
    seed: int
    launcher: str
    nprocs: int
    timeout_s: float
    grace_period_s: float
    stop_grace_s: float
    enqueue: list[dict[str, Any]] = field(default_factory=list)
    keep_checkpoints: bool = False  # else a finished trial's checkpoints/ and final/ are deleted
    prune_after: int = 0  # steps a trial runs before the pruner may stop it
    label: str = "[tune]"


def storage_of(settings: Settings) -> Any:
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    if "://" in settings.storage:
        return optuna.storages.RDBStorage(settings.storage)
    return JournalStorage(JournalFileBackend(settings.storage))


def _sampler(seed: int) -> Any:
    import optuna

    return optuna.samplers.TPESampler(seed=seed)


def _pruner(name: str, prune_after: int) -> Any:
    """The pruner; none acts before step `prune_after` + 1 (the first steps' losses say more
    about the init and the warmup than about the learning rate)."""
    import optuna

    if name == "median":  # prune below the median of completed trials, from the second on
        return optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=prune_after)
    if name == "halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=max(1, prune_after))
    return optuna.pruners.NopPruner()


def load_study(settings: Settings, *, seed: int | None = None) -> Any:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # our own lines say what happens
    return optuna.create_study(study_name=settings.study_name, storage=storage_of(settings),
                               sampler=_sampler(settings.seed if seed is None else seed),
                               pruner=_pruner(settings.pruner, settings.prune_after),
                               direction="minimize", load_if_exists=True)


@contextlib.contextmanager
def study_lock(settings: Settings) -> Iterator[None]:
    """The study directory's lock: one worker at a time counts trials and asks for one. On
    every node (`file_lock`: a lock file where the file system's flock is per node or absent)."""
    settings.study_dir.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(settings.study_dir / ".tune.lock"):
        yield


def retried(trials: list[Any]) -> set[int]:
    """Numbers of the trials that were interrupted and enqueued again."""
    return {t.user_attrs["retry_of"] for t in trials if "retry_of" in t.user_attrs}


def counted(trials: list[Any]) -> list[Any]:
    """The finished trials that count towards N: COMPLETE, PRUNED, FAIL, less the retried ones."""
    again = retried(trials)
    return [t for t in trials if t.state.is_finished() and t.number not in again]


def run_dir_of(settings: Settings, number: int) -> Path:
    return settings.study_dir / "trials" / f"{settings.study_name}-trial-{number}"


def heartbeat_path(run_dir: Path) -> Path:
    return run_dir.with_name(run_dir.name + ".heartbeat")


def _stale(trial: Any, settings: Settings) -> str | None:
    """Why a RUNNING trial's worker is gone, or None while it may be alive."""
    host, _, pid = str(trial.user_attrs.get("worker", "")).rpartition(":")
    if host == socket.gethostname() and pid.isdigit() and not pid_alive(int(pid)):
        return f"its worker {host}:{pid} is gone"
    beat = heartbeat_path(Path(trial.user_attrs.get("run_dir", "")))
    try:
        age = time.time() - beat.stat().st_mtime
    except OSError:  # asked but not yet started: the start time stands in for the heartbeat
        start = trial.datetime_start.timestamp() if trial.datetime_start else time.time()
        age = time.time() - start
    if age > settings.grace_period_s:
        return f"no heartbeat from its worker for {age:.0f}s"
    return None


def retry(study: Any, trial: Any, reason: str, settings: Settings) -> None:
    """Fail an interrupted trial and enqueue its parameters again as a new trial."""
    from optuna.trial import TrialState

    try:
        study.tell(trial.number, state=TrialState.FAIL)
    except Exception as exc:  # noqa: BLE001 - finished meanwhile (UpdateFinishedTrialError)
        print(f"{settings.label} trial {trial.number} not retried: {exc}", flush=True)
        return
    study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})
    print(f"{settings.label} trial {trial.number} interrupted ({reason}): FAIL, its parameters "
          "enqueued again", flush=True)


def _fail_stale(study: Any, settings: Settings) -> None:
    from optuna.trial import TrialState

    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        reason = _stale(trial, settings)
        if reason:
            retry(study, trial, reason, settings)


def prepare(settings: Settings) -> None:
    """Create the study (or find it) and enqueue the first trials of a new one."""
    with study_lock(settings):
        study = load_study(settings)
        if not study.get_trials(deepcopy=False):
            for params in settings.enqueue:
                study.enqueue_trial(params)


def next_trial(settings: Settings) -> tuple[Any, Any] | None:
    """(study, trial) with its parameters sampled, or None when the study needs no more."""
    from optuna.trial import TrialState

    with study_lock(settings):
        study = load_study(settings)
        _fail_stale(study, settings)
        trials = study.get_trials(deepcopy=False)
        running = [t for t in trials if t.state == TrialState.RUNNING]
        if len(counted(trials)) + len(running) >= settings.trials:
            return None
        # Seeded by the trial's number: the same sampling whichever worker asks.
        study = load_study(settings, seed=settings.seed + len(trials))
        trial = study.ask()
        for param in settings.params:
            param.suggest(trial)
        run_dir = run_dir_of(settings, trial.number)
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        trial.set_user_attr("run_dir", str(run_dir))
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        heartbeat_path(run_dir).touch()
        return study, trial


def params_text(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={yaml_value(v)}" for k, v in params.items())
