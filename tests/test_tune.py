"""`pretrain tune`: the search space checked before anything runs; a study of real tiny runs on two
workers with a pruned trial and its results; a worker stopped (SIGTERM) or killed (SIGKILL) in a
trial, then the study finished by a restart without redoing what was finished.

Pruning is made deterministic by `--enqueue`: the first trials are lr 1e-2 and 3e-3, then lr 1e-5.
A trial is asked for only when a worker is free, so the 1e-5 trial starts after one of the first
two has finished, and the first trial to finish cannot be pruned (MedianPruner with one startup
trial prunes only against completed trials): at step 2 the 1e-5 run (one update of size ~1e-5)
has a higher loss than every completed run at step 2, and is pruned there. Step 1 losses are equal
(same seed, same data, no update yet), so the decision falls at step 2 in every ordering.
"""
from __future__ import annotations

import csv
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from png_check import coloured_pixels
from pretrain.training.engine import warmup_cosine
from pretrain.errors import ConfigError
from pretrain.testing.cli import run_cli
from pretrain.testing.runs import REPO
from pretrain.tune.space import parse_space

SPACE = REPO / "configs" / "tune" / "space.yaml"


def _tune(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pretrain", "tune", *args], cwd=REPO, text=True,
                          capture_output=True, timeout=600, **kwargs)


def _base(tiny_data: dict[str, str], *extra: str) -> list[str]:
    sets = [f"data.tokenizer={tiny_data['tokenizer']}", f"data.dataset={tiny_data['dataset']}",
            "train.min_lr=1.0e-6", "train.eval_interval=4", "train.eval_batches=2", *extra]
    return ["--config", "configs/tiny.yaml", *(a for s in sets for a in ("--set", s)),
            "--launcher", "single"]


def _study(study_dir: Path):
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = JournalStorage(JournalFileBackend(str(study_dir / "study.journal")))
    return optuna.load_study(study_name=study_dir.name, storage=storage)


# ---- the space, checked without running anything ------------------------------------------------

def test_space_parses_floats_ints_logs_and_choices():
    params = {p.key: p for p in parse_space(yaml.safe_load(SPACE.read_text()))}
    assert params["train.lr"].kind == "float" and params["train.lr"].log
    assert params["train.warmup_steps"].choices == (0, 2, 5)
    more = parse_space({"train.micro_batch_size": {"low": 1, "high": 8, "step": 1},
                        "train.grad_clip": {"low": 0.5, "high": 2.0, "step": 0.5}})
    assert [(p.kind, p.step) for p in more] == [("int", 1), ("float", 0.5)]


@pytest.mark.parametrize("space, message", [
    ({"train.lr": {"low": 1e-2, "high": 1e-4}}, "train.lr: needs numbers low < high"),
    ({"train.lr": {"low": 0, "high": 1e-2, "log": True}}, "a log range needs low > 0"),
    ({"train.lr": {"low": 1e-4, "hgih": 1e-2}}, "unknown entry 'hgih'"),
    ({"train.lr": {"choices": []}}, "choices must be a non-empty list"),
    ({"train.micro_batch_size": {"low": 1, "high": 8, "step": 3}}, "is not a multiple of step"),
    ({"train.lr": 3e-4}, "expected {low: .., high: ..} or {choices: [..]}"),
    ([], "expected a mapping of config fields"),
])
def test_space_refuses_bad_ranges(space, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_space(space)


def test_unknown_space_key_is_one_error_line_before_any_trial(tmp_path, tiny_data):
    space = tmp_path / "space.yaml"
    space.write_text("train.lr: {low: 1.0e-4, high: 1.0e-2, log: true}\n"
                     "train.learning_rate: {choices: [1, 2]}\n")
    # refused before any trial starts: an in-process CLI call (the fork server's) stands in for
    # the subprocess, the error path being the same
    proc = run_cli(["tune", *_base(tiny_data), "--space", str(space), "--study-dir",
                    str(tmp_path / "s")], cwd=REPO)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: search space train.learning_rate=1 (1 ranks): unknown config key "
        "train.learning_rate (did you mean train.lr?)"), proc.stderr
    assert not (tmp_path / "s").exists()
    # a range end that the config refuses (min_lr above lr) is found the same way
    space.write_text("train.lr: {low: 1.0e-5, high: 1.0e-2, log: true}\n")
    low = run_cli(["tune", *_base(tiny_data, "train.min_lr=1.0e-4"), "--space", str(space),
                   "--study-dir", str(tmp_path / "s")], cwd=REPO)
    assert low.returncode == 2 and low.stderr.startswith(
        "error: search space train.lr=1.0e-05 (1 ranks): train.min_lr=0.0001"), low.stderr
    assert not (tmp_path / "s").exists()



def test_muons_settings_are_refused_for_trials_that_train_with_adamw(tmp_path, tiny_data):
    """train.muon_lr searched for trials of train.optimizer=adamw would tune nothing: one error
    line before any trial; with the space searching train.optimizer too (muon among its
    choices) the same setting is accepted."""
    from pretrain.config import load_config
    from pretrain.tune.space import unread_settings

    space = tmp_path / "space.yaml"
    space.write_text("train.muon_lr: {low: 1.0e-3, high: 5.0e-2, log: true}\n")
    proc = run_cli(["tune", *_base(tiny_data), "--space", str(space), "--study-dir",
                    str(tmp_path / "s")], cwd=REPO)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: search space train.muon_lr: the trials train with train.optimizer=adamw"), lines
    assert not (tmp_path / "s").exists()
    both = parse_space({"train.muon_lr": {"low": 1e-3, "high": 5e-2, "log": True},
                        "train.optimizer": {"choices": ["adamw", "muon"]}})
    assert unread_settings(both, optimizer="adamw") is None
    assert unread_settings(both[:1], optimizer="muon") is None
    assert load_config(None, ["train.optimizer=muon", "train.muon_lr=1.0e-03"]).train.muon_lr \
        == 1e-3


@pytest.mark.slow
def test_a_study_searches_muons_rate(tmp_path, tiny_data):
    """`pretrain tune` over train.muon_lr (train.optimizer=muon): each trial runs with the rate
    Optuna recorded (its saved config), and the rate reaches Muon's update: the trials' first
    losses are equal (same weights, same data), the second is lower under the larger rate
    (AdamW's rate, for the rest, is all but zero). best.yaml names that rate."""
    study_dir = tmp_path / "muon"
    enqueue = tmp_path / "enqueue.yaml"
    enqueue.write_text("- {train.muon_lr: 5.0e-2}\n- {train.muon_lr: 1.0e-4}\n")
    space = tmp_path / "space.yaml"
    space.write_text("train.muon_lr: {low: 1.0e-4, high: 5.0e-2, log: true}\n")
    proc = _tune(*_base(tiny_data, "train.steps=2", "train.eval_interval=0",
                        "train.optimizer=muon", "train.warmup_steps=0",
                        "train.lr=1.0e-6"),  # AdamW's rest barely moves: Muon's rate shows
                 "--space", str(space), "--trials", "2", "--enqueue", str(enqueue),
                 "--prune-after", "3",  # past the last step: both trials finish, to compare
                 "--study-dir", str(study_dir))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    trials = sorted(_study(study_dir).get_trials(), key=lambda t: t.number)
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"], proc.stdout
    losses = {}
    for t in trials:
        run_dir = study_dir / "trials" / f"muon-trial-{t.number}"
        train = yaml.safe_load((run_dir / "config.yaml").read_text())["train"]
        assert (train["optimizer"], train["muon_lr"]) == ("muon", pytest.approx(
            t.params["train.muon_lr"])), t.number
        losses[t.params["train.muon_lr"]] = [
            r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text()
                                   .splitlines()) if r["kind"] == "train"]
    fast, slow = losses[5e-2], losses[1e-4]
    assert fast[0] == slow[0] and fast[1] < slow[1], losses
    record = yaml.safe_load((study_dir / "best.yaml").read_text())
    assert record["overrides"] == {"train.muon_lr": 5e-2}, record


def test_contour_interpolates_the_complete_trials_without_scipy(tmp_path):
    """The lr x warmup contour (our own: Optuna's needs scipy, which is not installed) is drawn
    from the complete trials only: its colour range is theirs, the pruned trial's value is not
    in it, and the best trial is starred; 2 complete trials (no triangle) still draw points."""
    import optuna
    from optuna.distributions import CategoricalDistribution, FloatDistribution
    from optuna.trial import TrialState, create_trial

    from pretrain.tune.results import write_plots
    from pretrain.tune.study import Settings

    params = [p for p in parse_space(yaml.safe_load(SPACE.read_text()))
              if p.key in ("train.lr", "train.warmup_steps")]
    dists = {"train.lr": FloatDistribution(1e-4, 1e-1, log=True),
             "train.warmup_steps": CategoricalDistribution((0, 2, 5))}
    settings = Settings(study_dir=tmp_path, study_name="s", storage="", params=params, trials=6,
                        config=None, base_overrides=[], objective="valid", pruner="median",
                        seed=0, launcher="single", nprocs=1, timeout_s=1, grace_period_s=1,
                        stop_grace_s=1)
    study = optuna.create_study()
    for lr, warmup, value in [(1e-3, 0, 4.0), (1e-2, 2, 3.0), (3e-2, 5, 3.5), (3e-4, 2, 5.0)]:
        study.add_trial(create_trial(params={"train.lr": lr, "train.warmup_steps": warmup},
                                     distributions=dists, value=value))
    study.add_trial(create_trial(params={"train.lr": 1e-4, "train.warmup_steps": 0},
                                 distributions=dists, state=TrialState.PRUNED))
    written = write_plots(study, settings)
    assert set(written) == {"history", "importances", "contour"}
    for name, path in written.items():
        assert coloured_pixels(path) > 200, name  # drawn, not an empty frame

    import matplotlib.pyplot as plt
    from pretrain.tune.results import contour
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    ax = contour(complete, "train.lr", "train.warmup_steps", settings)
    filled = [c for c in ax.collections if hasattr(c, "levels")]
    assert filled and filled[0].levels[0] <= 3.0 and filled[0].levels[-1] >= 5.0
    assert ax.get_xlabel() == "log10 train.lr" and "trial 1, 3.0000" in ax.get_legend_handles_labels()[1][0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "2", "5"]
    plt.close("all")
    ax = contour(complete[:2], "train.lr", "train.warmup_steps", settings)  # no triangle
    assert not [c for c in ax.collections if hasattr(c, "levels")] and len(ax.collections) == 2
    plt.close("all")

# ---- a study ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_two_workers_prune_and_agree_with_the_storage(tmp_path, tiny_data):
    study_dir = tmp_path / "proxy"
    enqueue = tmp_path / "enqueue.yaml"
    enqueue.write_text("- {train.lr: 1.0e-2, train.warmup_steps: 0}\n"
                       "- {train.lr: 3.0e-3, train.warmup_steps: 0}\n"
                       "- {train.lr: 1.0e-5, train.warmup_steps: 0}\n")
    space = tmp_path / "space.yaml"
    space.write_text("train.lr: {low: 1.0e-5, high: 3.0e-2, log: true}\n"
                     "train.warmup_steps: {choices: [0, 2]}\n")
    proc = _tune(*_base(tiny_data, "train.steps=4"), "--space", str(space), "--trials", "6",
                 "--workers", "2", "--enqueue", str(enqueue), "--study-dir", str(study_dir))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # both workers ran trials, one line per finished trial
    finished = re.findall(r"^\[tune w(\d)\] trial (\d+) (COMPLETE|PRUNED|FAIL) value", proc.stdout,
                          re.M)
    assert sorted(int(n) for _, n, _ in finished) == list(range(6)), proc.stdout
    assert {w for w, _, _ in finished} == {"0", "1"}, proc.stdout

    study = _study(study_dir)
    trials = study.get_trials()
    states = {t.number: t.state.name for t in trials}
    assert len(trials) == 6 and "FAIL" not in states.values(), states
    assert states[2] == "PRUNED", proc.stdout  # lr 1e-5, at step 2
    assert max(trials[2].intermediate_values) == 2
    assert trials[2].params["train.lr"] == pytest.approx(1e-5)
    # each trial a run of its own, named after the study; a pruned one stopped early
    for t in trials:
        run_dir = study_dir / "trials" / f"proxy-trial-{t.number}"
        steps = [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text()
                                        .splitlines()) if r["kind"] == "train"]
        assert steps == list(range(1, len(steps) + 1)) and len(steps) <= 4
        if t.state.name == "COMPLETE":
            evals = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text()
                                    .splitlines()) if r["kind"] == "eval"]
            assert len(steps) == 4 and t.value == pytest.approx(evals[-1]["loss"])
            assert t.intermediate_values[4] == pytest.approx(
                [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text()
                 .splitlines() if '"train"' in line][-1]["loss"])
    # results agree with the storage
    rows = list(csv.DictReader(open(study_dir / "trials.csv")))
    assert {int(r["number"]): r["state"] for r in rows} == states
    best = min((t for t in trials if t.state.name == "COMPLETE"), key=lambda t: t.value)
    record = yaml.safe_load((study_dir / "best.yaml").read_text())
    assert (record["trial"], record["value"]) == (best.number, best.value)
    assert record["overrides"] == best.params
    last = proc.stdout.strip().splitlines()[-1]
    assert last == record["command"]
    assert last.startswith("pretrain train --config configs/tiny.yaml")
    assert f"--set train.warmup_steps={best.params['train.warmup_steps']}" in last
    assert re.search(r"--set train\.lr=[0-9.e-]+", last)
    assert f"[tune] best trial {best.number}: valid loss {best.value:.4f}" in proc.stdout
    # the plots the study promises for what completed: which trials complete depends on the
    # workers' timing (trial 1 is pruned when trial 0 completed before its step 2 was judged)
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    pngs = ["history.png"] + (["importances.png", "contour.png"] if len(complete) >= 2 else [])
    for png in {"importances.png", "contour.png"} - set(pngs):
        assert re.search(rf"^\[tune[ w\d]*\] {png} skipped: fewer than 2 complete trials$",
                         proc.stdout, re.M), proc.stdout
        assert not (study_dir / png).exists()
    for png in pngs:
        assert coloured_pixels(study_dir / png) > 200, (png, proc.stdout, proc.stderr)
    # each trial ran with the values Optuna recorded: its saved config, and the lr its first
    # update used (the schedule's value for this trial's peak lr and warmup over 4 steps)
    for t in trials:
        run_dir = study_dir / "trials" / f"proxy-trial-{t.number}"
        train = yaml.safe_load((run_dir / "config.yaml").read_text())["train"]
        lr, warmup = t.params["train.lr"], t.params["train.warmup_steps"]
        assert (train["lr"], train["warmup_steps"]) == (pytest.approx(lr), warmup), t.number
        first = next(r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text()
                                    .splitlines()) if r["kind"] == "train")
        expected = warmup_cosine(1, lr=lr, min_lr=1.0e-6, warmup=warmup, total=4)
        assert first["lr"] == pytest.approx(expected, rel=1e-4), (t.number, first, expected)
    # finished trials keep their metrics and log, not their weights (no --keep-checkpoints)
    for t in trials:
        run = study_dir / "trials" / f"{study_dir.name}-trial-{t.number}"
        assert (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists(), run


# ---- a worker stopped in a trial, and the restart -----------------------------------------------

def _alive_naming(text: str) -> list[str]:
    """Processes (not zombies) whose command line contains `text`."""
    alive = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if proc.name.isdigit() and text in cmdline and state != "Z":
            alive.append(f"{proc.name}: {cmdline}")
    return alive


def _wait_for(condition, what: str, *, timeout: float = 240, poll=None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {timeout}s"
        if poll is not None:
            assert poll() is None, f"the tuner exited ({poll()}) before {what}"
        time.sleep(0.2)  # polling a condition, not synchronising on time


def _training(run_dir: Path) -> bool:
    path = run_dir / "metrics.jsonl"
    return path.exists() and '"kind": "train"' in path.read_text()


@pytest.mark.slow
def test_a_stopped_or_killed_worker_leaves_no_run_and_a_restart_finishes_the_study(tmp_path,
                                                                                   tiny_data):
    """Trial 0 finishes (4 steps). Then a tuner whose trials would run 100000 steps is stopped
    with SIGTERM in trial 1, another with SIGKILL in trial 2 (trial 1's retry): neither leaves a
    training process, and each interrupted trial is enqueued again. The last start (4 steps again:
    `--set` is per start, not part of the study) fails the killed worker's trial as stale, runs
    its retry and one new trial: 3 trials counted, trial 0 not run again."""
    study_dir = tmp_path / "resume"
    space = tmp_path / "space.yaml"
    space.write_text("train.lr: {low: 1.0e-3, high: 1.0e-2, log: true}\n")
    common = ["--space", str(space), "--study-dir", str(study_dir), "--pruner", "none"]
    first = _tune(*_base(tiny_data, "train.steps=4"), *common, "--trials", "1")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    trial0 = study_dir / "trials" / "resume-trial-0"
    metrics0 = (trial0 / "metrics.jsonl").read_text()

    for number, sig in ((1, signal.SIGTERM), (2, signal.SIGKILL)):
        tuner = subprocess.Popen([sys.executable, "-m", "pretrain", "tune",
                                  *_base(tiny_data, "train.steps=100000"), *common,
                                  "--trials", "3"], cwd=REPO, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        run_dir = study_dir / "trials" / f"resume-trial-{number}"
        try:
            _wait_for(lambda: _training(run_dir), f"training in trial {number}", poll=tuner.poll)
            assert _alive_naming(str(run_dir)), "the trial's run is not running"
            tuner.send_signal(sig)
            out, _ = tuner.communicate(timeout=120)
        finally:
            if tuner.poll() is None:
                tuner.kill()
                tuner.wait()
        if sig == signal.SIGTERM:
            assert tuner.returncode == 143, out[-3000:]
            assert f"trial {number} interrupted (its worker was stopped)" in out, out[-3000:]
            assert _alive_naming(str(study_dir)) == []  # stopped before the tuner exited
        else:
            assert tuner.returncode == -signal.SIGKILL
            # the run's launcher got SIGTERM when its parent died, and ends (saving a checkpoint)
            _wait_for(lambda: _alive_naming(str(study_dir)) == [], "end of the orphaned run",
                      timeout=120)
        assert _study(study_dir).get_trials()[number].state.name == (
            "FAIL" if sig == signal.SIGTERM else "RUNNING")

    last = _tune(*_base(tiny_data, "train.steps=4"), *common, "--trials", "3")
    assert last.returncode == 0, last.stdout[-3000:] + last.stderr[-3000:]
    assert "trial 2 interrupted (its worker" in last.stdout and " is gone)" in last.stdout
    trials = _study(study_dir).get_trials()
    summary = [(t.number, t.state.name, t.user_attrs.get("retry_of")) for t in trials]
    # 2 was the retry of 1 (a retry is a new trial, enqueued), 3 the retry of 2, 4 sampled
    assert summary == [(0, "COMPLETE", None), (1, "FAIL", None), (2, "FAIL", 1),
                       (3, "COMPLETE", 2), (4, "COMPLETE", None)], summary
    assert trials[1].params == trials[2].params == trials[3].params
    assert (trial0 / "metrics.jsonl").read_text() == metrics0  # trial 0 was not run again
    assert "study resume: 3/3 trials finished (3 complete, 0 pruned, 0 fail; 2 interrupted and " \
           "retried)" in last.stdout
    assert _alive_naming(str(study_dir)) == []


@pytest.mark.slow
def test_a_failing_run_is_a_fail_trial_with_its_log_tail(tmp_path, tiny_data):
    """A value that passes the config check but breaks the run (an MLflow store URI no MLflow
    knows, found when the run opens its sink): a FAIL trial, the log's last lines printed, and
    the tuner goes on to its summary with exit 0."""
    space = tmp_path / "space.yaml"
    space.write_text("logging.mlflow_tracking_uri: {choices: ['nosuchscheme://x']}\n")
    study_dir = tmp_path / "broken"
    proc = _tune(*_base(tiny_data, "train.steps=2", "logging.report_to=[mlflow]"), "--space",
                 str(space), "--trials", "1", "--study-dir", str(study_dir))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = re.search(r"^\[tune\] trial 0 FAIL value - step None in [\d.]+s: "
                     r"logging.mlflow_tracking_uri=nosuchscheme://x \(exit 1, the end of (\S+):\)$",
                     proc.stdout, re.M)
    assert line, proc.stdout
    tail = proc.stdout[line.end():].split("[tune] ", 1)[0]
    assert "UnsupportedModelRegistryStoreURIException" in tail, proc.stdout
    assert tail.strip().splitlines() == Path(line.group(1)).read_text().strip().splitlines()[-15:]
    assert "[tune] no complete trial: no best parameters" in proc.stdout
    assert "1/1 trials finished (0 complete, 0 pruned, 1 fail;" in proc.stdout
    assert [r["state"] for r in csv.DictReader(open(study_dir / "trials.csv"))] == ["FAIL"]
    assert not (study_dir / "best.yaml").exists()
