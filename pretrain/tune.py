"""A hyper-parameter search over short `pretrain train` runs, with Optuna (`pretrain tune`).

The search space is a YAML mapping of run-config fields (the `--set` paths) to a range or a list::

    train.lr: {low: 1.0e-4, high: 1.0e-1, log: true}   # float, log-uniform
    train.warmup_steps: {choices: [10, 50, 100]}      # categorical
    train.micro_batch_size: {low: 1, high: 8, step: 1}  # int: low, high (and step) are integers

Each trial is one `pretrain train` run through a launcher (`pretrain.child_runs`), in its own
run directory `<study dir>/trials/<study>-trial-<n>` (also its MLflow/wandb run name), with the
sampled values as `--set` overrides. While it runs, the worker follows its `metrics.jsonl`: every
train loss is reported to the pruner at its step (`trial.report`); when the pruner says so, the
run is stopped (every process of it) and the trial is PRUNED. The objective is the last
validation loss (`--objective valid`) or the last train loss (`train`). A run that exits non-zero
is a FAIL trial with its log's tail printed; a non-finite loss stops the run and fails the trial.

Workers. Any number of workers (`--workers K` processes here, or Slurm array tasks) share one
study through its storage: by default an Optuna journal file in the study directory
(`JournalFileBackend`, made for shared file systems, where SQLite's locks are unreliable), or any
RDB URL. A worker asks for a trial only under a file lock in the study directory, and only while
finished (COMPLETE, PRUNED, FAIL) plus running trials are fewer than N: N trials means N.

Resuming. A worker keeps a heartbeat file beside its trial's run directory. A RUNNING trial whose
worker is gone (same host: the process no longer exists; any host: no heartbeat for
`grace_period_s`) is marked FAIL by the next worker that asks for a trial, and its parameters are
enqueued again as a new trial (`retry_of`): a restarted `pretrain tune` on the same study
directory finishes the study, and neither the interrupted trial nor the retry's predecessor is
counted twice; completed trials are not run again. On SIGTERM a worker stops its run (SIGTERM,
then SIGKILL after the grace) and fails and re-enqueues its trial itself. On SIGKILL it cannot;
the run's launcher still gets SIGTERM (`child_runs.die_with_parent`) and stops its ranks, and
the trial is failed and retried as above.
"""
from __future__ import annotations

import contextlib
import csv
import io
import math
import os
import shlex
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pretrain.child_runs import child_env, launcher_command, start_run, stop_run
from pretrain.errors import ConfigError
from pretrain.file_lock import exclusive_lock, pid_alive

POLL_S = 0.5  # how often a worker reads its trial's metrics.jsonl
HEARTBEAT_S = 5.0  # how often a worker touches its trial's heartbeat file
LOG_TAIL_LINES = 15  # lines of a failed trial's log printed
SPEC_KEYS = {"low", "high", "log", "step", "choices"}


# ---- the search space -------------------------------------------------------------------------

@dataclass(frozen=True)
class Param:
    """One dimension of the search space: a run-config field and its distribution."""

    key: str
    kind: str  # float | int | categorical
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: tuple[Any, ...] = ()

    def suggest(self, trial: Any) -> Any:
        if self.kind == "categorical":
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.key, self.low, self.high, step=self.step or 1,
                                     log=self.log)
        return trial.suggest_float(self.key, self.low, self.high, step=self.step, log=self.log)

    def edge_values(self) -> list[Any]:
        """The values a config check tries: every choice, or both ends of the range."""
        return list(self.choices) if self.kind == "categorical" else [self.low, self.high]


def yaml_value(value: Any) -> str:
    """`value` as `--set` parses it back (YAML): 1e-05 as `1.0e-05`, which YAML reads as a float."""
    text = yaml.safe_dump(value, default_flow_style=True).strip()
    return text[:-4].strip() if text.endswith("\n...") else text


def override(key: str, value: Any) -> str:
    return f"{key}={yaml_value(value)}"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_space(raw: Any, *, source: str = "search space") -> list[Param]:
    """The parameters of a search-space mapping; a ConfigError naming the key for a bad entry."""
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{source}: expected a mapping of config fields to ranges, e.g. "
                          "train.lr: {low: 1.0e-4, high: 1.0e-2, log: true}")
    params = []
    for key, spec in raw.items():
        where = f"{source}: {key}"
        if not isinstance(key, str) or "." not in key and key not in ("run_dir", "deepspeed"):
            raise ConfigError(f"{where}: keys are config fields like train.lr")
        if not isinstance(spec, dict):
            raise ConfigError(f"{where}: expected {{low: .., high: ..}} or {{choices: [..]}}, "
                              f"got {spec!r}")
        unknown = sorted(set(spec) - SPEC_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown entry {unknown[0]!r}: use low/high (with log or "
                              "step) or choices")
        if "choices" in spec:
            choices = spec["choices"]
            if set(spec) != {"choices"}:
                raise ConfigError(f"{where}: choices cannot be combined with low/high/log/step")
            if not isinstance(choices, list) or not choices or not all(
                    c is None or isinstance(c, (str, int, float, bool)) for c in choices):
                raise ConfigError(f"{where}: choices must be a non-empty list of plain values, got "
                                  f"{choices!r}")
            params.append(Param(key, "categorical", choices=tuple(choices)))
            continue
        if "low" not in spec or "high" not in spec:
            raise ConfigError(f"{where}: needs low and high (or choices)")
        low, high, log, step = spec["low"], spec["high"], spec.get("log", False), spec.get("step")
        if not (_number(low) and _number(high)) or not low < high:
            raise ConfigError(f"{where}: needs numbers low < high, got low={low!r} high={high!r}")
        if not isinstance(log, bool):
            raise ConfigError(f"{where}: log must be true or false, got {log!r}")
        if log and low <= 0:
            raise ConfigError(f"{where}: a log range needs low > 0, got low={low!r}")
        if step is not None and (not _number(step) or step <= 0):
            raise ConfigError(f"{where}: step must be a positive number, got {step!r}")
        integer = all(isinstance(v, int) for v in (low, high) + ((step,) if step else ()))
        if log and step is not None and not (integer and step == 1):
            raise ConfigError(f"{where}: log and step cannot be combined (except step 1 of an "
                              "int range)")
        if step is not None and not math.isclose((high - low) / step, round((high - low) / step)):
            raise ConfigError(f"{where}: high - low = {high - low!r} is not a multiple of "
                              f"step {step!r}")
        params.append(Param(key, "int" if integer else "float", low=low, high=high, log=log,
                            step=step))
    return params


def load_space(path: str | Path) -> list[Param]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--space {str(path)!r} does not exist: pass a YAML file like "
                          "configs/tune/space.yaml")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"--space {str(path)!r} is not valid YAML: "
                          f"{str(exc).splitlines()[0]}") from None
    return parse_space(raw, source=f"search space {path}")


def parse_enqueued(raw: Any, params: list[Param], *, source: str) -> list[dict[str, Any]]:
    """A list of {field: value} mappings to try first, each field a key of the space."""
    keys = [p.key for p in params]
    if not isinstance(raw, list) or not all(isinstance(e, dict) and e for e in raw):
        raise ConfigError(f"{source}: expected a list of mappings like - {{{keys[0]}: ...}}")
    for entry in raw:
        unknown = sorted(set(entry) - set(keys))
        if unknown:
            raise ConfigError(f"{source}: {unknown[0]} is not a key of the search space "
                              f"({', '.join(keys)})")
    return raw


# ---- the study --------------------------------------------------------------------------------

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
                               pruner=_pruner(settings.pruner, settings.prune_after), direction="minimize",
                               load_if_exists=True)


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


def _heartbeat_path(run_dir: Path) -> Path:
    return run_dir.with_name(run_dir.name + ".heartbeat")


def _stale(trial: Any, settings: Settings) -> str | None:
    """Why a RUNNING trial's worker is gone, or None while it may be alive."""
    host, _, pid = str(trial.user_attrs.get("worker", "")).rpartition(":")
    if host == socket.gethostname() and pid.isdigit() and not pid_alive(int(pid)):
        return f"its worker {host}:{pid} is gone"
    beat = _heartbeat_path(Path(trial.user_attrs.get("run_dir", "")))
    try:
        age = time.time() - beat.stat().st_mtime
    except OSError:  # asked but not yet started: the start time stands in for the heartbeat
        start = trial.datetime_start.timestamp() if trial.datetime_start else time.time()
        age = time.time() - start
    if age > settings.grace_period_s:
        return f"no heartbeat from its worker for {age:.0f}s"
    return None


def _retry(study: Any, trial: Any, reason: str, settings: Settings) -> None:
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
            _retry(study, trial, reason, settings)


def prepare(settings: Settings) -> None:
    """Create the study (or find it) and enqueue the first trials of a new one."""
    with study_lock(settings):
        study = load_study(settings)
        if not study.get_trials(deepcopy=False):
            for params in settings.enqueue:
                study.enqueue_trial(params)


def _next_trial(settings: Settings) -> tuple[Any, Any] | None:
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
        _heartbeat_path(run_dir).touch()
        return study, trial


# ---- one trial --------------------------------------------------------------------------------

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
    heartbeat = _heartbeat_path(run_dir)
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


def _params_text(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={yaml_value(v)}" for k, v in params.items())


def work(settings: Settings) -> int:
    """One worker: trials until the study has N counted; the number of trials it ran."""
    from optuna.trial import TrialState

    ran = 0
    while True:
        picked = _next_trial(settings)
        if picked is None:
            return ran
        study, trial = picked
        print(f"{settings.label} trial {trial.number} started: {_params_text(trial.params)} "
              f"(run {run_dir_of(settings, trial.number)})", flush=True)
        started = time.monotonic()
        try:
            outcome = run_trial(settings, trial)
        except BaseException:
            with study_lock(settings):
                mine = next(t for t in study.get_trials(deepcopy=False)
                            if t.number == trial.number)
                _retry(study, mine, "its worker was stopped", settings)
            raise
        state = getattr(TrialState, outcome.state)
        try:
            study.tell(trial, outcome.value if state == TrialState.COMPLETE else None,
                       state=state)
        except Exception as exc:  # noqa: BLE001 - failed as stale by another worker meanwhile
            print(f"{settings.label} trial {trial.number}: {exc}", flush=True)
        ran += 1
        _heartbeat_path(run_dir_of(settings, trial.number)).unlink(missing_ok=True)
        if not settings.keep_checkpoints:
            drop_weights(run_dir_of(settings, trial.number))
        value = f"{outcome.value:.4f}" if outcome.value is not None else "-"
        first, _, tail = outcome.reason.partition("\n")  # a failed run's log tail below
        print(f"{settings.label} trial {trial.number} {outcome.state} value {value} step "
              f"{outcome.step} in {time.monotonic() - started:.1f}s: "
              f"{_params_text(trial.params)}" + (f" ({first})" if first else "")
              + (f"\n{tail}" if tail else ""), flush=True)
        with study_lock(settings):
            write_results(load_study(settings), settings, plots=False)


# ---- results ----------------------------------------------------------------------------------

def best_trial(study: Any) -> Any | None:
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return min(complete, key=lambda t: t.value) if complete else None


def best_command(settings: Settings, trial: Any) -> str:
    """`pretrain train` with the best trial's overrides: the line to train with."""
    args = ["pretrain", "train"] + (["--config", settings.config] if settings.config else [])
    for text in settings.base_overrides + [override(p.key, trial.params[p.key])
                                           for p in settings.params]:
        args += ["--set", text]
    return shlex.join(args)


def _trials_csv(study: Any) -> str:
    """The text of trials.csv: Optuna's trials dataframe, or without pandas its few columns."""
    try:
        frame = study.trials_dataframe()
    except ImportError:  # pandas: the few columns that matter, by hand
        rows = [{"number": t.number, "state": t.state.name, "value": t.value,
                 **{f"params_{k}": v for k, v in t.params.items()}}
                for t in study.get_trials(deepcopy=False)]
        names = sorted({k for r in rows for k in r}, key=lambda k: (k != "number", k))
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=names)
        writer.writeheader()
        writer.writerows(rows)
        return text.getvalue()
    return frame.to_csv(index=False)


def write_results(study: Any, settings: Settings, *, plots: bool) -> dict[str, Path]:
    """trials.csv and best.yaml (and with `plots`, the PNGs) in the study directory."""
    from pretrain.files import write_text_atomic

    out = settings.study_dir
    paths = {"csv": out / "trials.csv"}
    write_text_atomic(paths["csv"], _trials_csv(study))
    best = best_trial(study)
    if best is not None:
        paths["best"] = out / "best.yaml"
        record = {"study": settings.study_name, "trial": best.number, "value": best.value,
                  "objective": f"{settings.objective} loss",
                  "overrides": {p.key: best.params[p.key] for p in settings.params},
                  "command": best_command(settings, best)}
        write_text_atomic(paths["best"], yaml.safe_dump(record, sort_keys=False))
    if plots:
        paths.update(write_plots(study, settings))
    return paths


def write_plots(study: Any, settings: Settings) -> dict[str, Path]:
    """history.png, importances.png, contour.png where they can be drawn; a one-line warning
    for each that cannot (matplotlib missing, too few trials): a plot never fails the study."""
    from optuna.trial import TrialState

    out = settings.study_dir
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from optuna.visualization import matplotlib as ovm
    except ImportError as exc:
        print(f"warning: tune plots skipped: matplotlib cannot be imported ({exc}); "
              "pip install matplotlib", file=sys.stderr)
        return {}
    import warnings

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    keys = [p.key for p in settings.params]
    lr = next((k for k in keys if k.endswith(".lr")), None)
    other = next((k for k in keys if k != lr), None)
    wanted: dict[str, tuple[Any, str | None]] = {
        "history": (lambda: ovm.plot_optimization_history(study),
                    None if complete else "no complete trial"),
        "importances": (lambda: ovm.plot_param_importances(study),
                        "fewer than 2 parameters" if len(keys) < 2 else
                        "fewer than 2 complete trials" if len(complete) < 2 else None),
        "contour": (lambda: contour(complete, lr, other, settings),
                    "the space has no *.lr and second parameter" if not (lr and other) else
                    "fewer than 2 complete trials" if len(complete) < 2 else None),
    }
    written = {}
    for name, (draw, missing) in wanted.items():
        path = out / f"{name}.png"
        if missing:
            print(f"{settings.label} {path.name} skipped: {missing}", flush=True)
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Optuna's "experimental" notes
                axes = draw()
            figure = (axes.flat[0] if hasattr(axes, "flat") else axes).get_figure()
            figure.savefig(path, dpi=100, bbox_inches="tight")
            plt.close(figure)
            written[name] = path
        except Exception as exc:  # noqa: BLE001 - a plot never costs the study its results
            print(f"warning: {path.name} skipped: {type(exc).__name__}: {exc}", file=sys.stderr,
                  flush=True)
            plt.close("all")
    return written


def contour(complete: list[Any], x_key: str, y_key: str, settings: Settings) -> Any:
    """The objective over (x, y) of the complete trials: filled contours of a linear
    interpolation over their Delaunay triangulation (matplotlib's; Optuna's own contour plot
    needs scipy), each trial a point, the best a star. Log axes for log-scaled parameters; a
    categorical parameter is drawn at the index of its choice."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.tri import Triangulation

    def coordinate(key: str) -> tuple[np.ndarray, bool, list[Any] | None]:
        param = next(p for p in settings.params if p.key == key)
        values = [t.params[key] for t in complete]
        if param.kind == "categorical":
            return np.array([param.choices.index(v) for v in values], float), False, \
                list(param.choices)
        return np.array(values, float), param.log, None

    (x, x_log, x_ticks), (y, y_log, y_ticks) = coordinate(x_key), coordinate(y_key)
    z = np.array([t.value for t in complete], float)
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    # interpolate in the space the sampler searched (log10 for log-scaled parameters)
    tx, ty = (np.log10(x) if x_log else x), (np.log10(y) if y_log else y)
    filled = None
    if len(z) >= 3 and z.max() > z.min():
        with contextlib.suppress(RuntimeError, ValueError):  # collinear points: no triangle
            filled = ax.tricontourf(Triangulation(tx, ty), z, cmap="viridis_r",
                                    levels=np.linspace(z.min(), z.max(), 13))
    points = ax.scatter(tx, ty, c=z, cmap="viridis_r", edgecolors="black", zorder=3)
    best = int(np.argmin(z))
    ax.scatter([tx[best]], [ty[best]], marker="*", s=300, c="red", edgecolors="black", zorder=4,
               label=f"best: trial {complete[best].number}, {z[best]:.4f}")
    fig.colorbar(filled if filled is not None else points, ax=ax,
                 label=f"{settings.objective} loss")
    for axis, key, log, ticks in (("x", x_key, x_log, x_ticks), ("y", y_key, y_log, y_ticks)):
        getattr(ax, f"set_{axis}label")(f"log10 {key}" if log else key)
        if ticks is not None:
            getattr(ax, f"set_{axis}ticks")(range(len(ticks)), [str(c) for c in ticks])
    ax.margins(0.06)  # points on the hull stay whole
    ax.set_title(f"study {settings.study_name}: {len(z)} complete trials")
    ax.legend(loc="best")
    return ax


def summary(study: Any, settings: Settings) -> list[str]:
    """The closing lines: counts by state, the best trial and its `pretrain train` line."""
    trials = study.get_trials(deepcopy=False)
    finished = counted(trials)
    by_state: dict[str, int] = {}
    for t in finished:
        by_state[t.state.name] = by_state.get(t.state.name, 0) + 1
    states = ", ".join(f"{by_state.get(s, 0)} {s.lower()}" for s in ("COMPLETE", "PRUNED", "FAIL"))
    lines = [f"{settings.label} study {settings.study_name}: {len(finished)}/{settings.trials} "
             f"trials finished ({states}; {len(retried(trials))} interrupted and retried)"]
    best = best_trial(study)
    if best is None:
        lines.append(f"{settings.label} no complete trial: no best parameters")
        return lines
    lines.append(f"{settings.label} best trial {best.number}: {settings.objective} loss "
                 f"{best.value:.4f} with {_params_text(best.params)}")
    lines.append(best_command(settings, best))
    return lines
