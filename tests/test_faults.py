"""Faults through the real launchers: preemption signals, a killed rank, NaN steps, time limits.

Signalled runs train a long schedule; the test polls metrics.jsonl until steps are being made,
sends the signal, and then checks the checkpoint, the exit status and that a restarted run
continues at the next step. What each launcher does with a signal (read from their sources and
checked here) is in docs/checkpoints-and-faults.md.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from pretrain.testing.faults import nan_loss_environment
from pretrain.launchers.local import launcher_command
from pretrain.testing.runs import REPO, run_pretrain, train

pytestmark = pytest.mark.slow  # training runs through the launchers (quick tier: not slow)

EXIT_FAULT, EXIT_REQUEUE = 3, 75
LONG = ["train.steps=100000", "train.warmup_steps=2"]


def _args(run_dir: Path, data: dict[str, str], overrides: list[str]) -> list[str]:
    args = ["train", "--config", "configs/tiny.yaml", "--set", f"run_dir={run_dir}",
            "--set", f"data.tokenizer={data['tokenizer']}", "--set", f"data.dataset={data['dataset']}"]
    for o in overrides:
        args += ["--set", o]
    return args


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def _train_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines()
            if '"kind": "train"' in line]


def _wait_for_step(run_dir: Path, step: int, procs: list[subprocess.Popen], *,
                   timeout: float = 300) -> None:
    """Poll metrics.jsonl until `step` was logged (fails if a process exits first)."""
    deadline = time.monotonic() + timeout
    while not (_train_steps(run_dir) and _train_steps(run_dir)[-1] >= step):
        for p in procs:
            assert p.poll() is None, f"exited {p.returncode} before step {step}: {p.stderr and p.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, f"no step {step} within {timeout}s"
        time.sleep(0.2)


def _wait_for_checkpoint(run_dir: Path, step: int, procs: list[subprocess.Popen], *,
                         timeout: float = 300) -> None:
    """Poll checkpoints/latest until it names `step` or a later one: saves finish in the
    background, so a logged step does not yet mean its checkpoint is complete."""
    latest, deadline = run_dir / "checkpoints" / "latest", time.monotonic() + timeout
    while not (latest.exists() and int(latest.read_text()[4:]) >= step):
        for p in procs:
            assert p.poll() is None, f"exited {p.returncode} before checkpoint {step}: {p.stderr and p.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, f"no checkpoint {step} within {timeout}s"
        time.sleep(0.2)


def _ranks(launcher: subprocess.Popen) -> list[psutil.Process]:
    """The training processes under a launcher, by rank (their RANK variable)."""
    ranks = []
    for child in psutil.Process(launcher.pid).children(recursive=True):
        env = child.environ()
        if "RANK" in env and "pretrain" in child.cmdline():
            ranks.append((int(env["RANK"]), child))
    return [p for _, p in sorted(ranks, key=lambda rank_proc: rank_proc[0])]


def _check_resumes_at_next_step(tmp_path, tiny_data, run_dir: Path, *, nprocs: int) -> int:
    """The stop left a complete checkpoint at step k; a restart trains step k + 1 first."""
    stopped = json.loads((run_dir / "stopped.json").read_text())
    assert stopped["exit_code"] == EXIT_REQUEUE, stopped
    k = stopped["step"]
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step{k}"
    assert (run_dir / "checkpoints" / f"step{k}" / "manifest.json").is_file()
    before = len(_train_steps(run_dir))
    again = train(tmp_path, tiny_data, nprocs=nprocs, name=run_dir.name,
                  overrides=[f"train.steps={k + 1}"])
    assert _train_steps(run_dir)[before:] == [k + 1], _train_steps(run_dir)
    assert not (run_dir / "stopped.json").exists()  # a finished run clears the marker
    return again.returncode


@pytest.mark.parametrize("launcher, sig, target", [
    # The signal reaches one rank only: the others learn of it through the per-step all-reduce.
    pytest.param("deepspeed", signal.SIGUSR1, "rank1", id="deepspeed-SIGUSR1-one-rank"),
    # The deepspeed launcher's per-node process forwards SIGTERM to every rank.
    pytest.param("deepspeed", signal.SIGTERM, "launcher", id="deepspeed-SIGTERM-launcher"),
    pytest.param("torchrun", signal.SIGTERM, "launcher", id="torchrun-SIGTERM-launcher"),
    # torchrun forwards SIGUSR1 only when asked to handle it.
    pytest.param("torchrun", signal.SIGUSR1, "launcher", id="torchrun-SIGUSR1-launcher"),
])
def test_signal_saves_and_exits_for_requeue(launcher, sig, target, tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    prefix = launcher_command(launcher, 2)
    if launcher == "torchrun" and sig == signal.SIGUSR1:
        at = prefix.index("--nproc_per_node")
        prefix[at:at] = ["--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"]
    proc = subprocess.Popen(prefix + _args(run_dir, tiny_data, LONG), cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_step(run_dir, 3, [proc])
        ranks = _ranks(proc)
        assert len(ranks) == 2, ranks
        if target == "rank1":
            ranks[1].send_signal(sig)
        elif launcher == "deepspeed":  # the runner has no handler; launch.py forwards
            launch = [c for c in psutil.Process(proc.pid).children()
                      if "deepspeed.launcher.launch" in " ".join(c.cmdline())]
            launch[0].send_signal(sig)
        else:
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    stopped = json.loads((run_dir / "stopped.json").read_text())
    assert stopped["reason"].startswith("signal"), stopped
    assert "[stop] signal" in out and "then exiting to be requeued" in out, out[-3000:]
    if target == "rank1":  # the launcher passes the ranks' status on
        assert proc.returncode == EXIT_REQUEUE, (proc.returncode, err[-3000:])
    else:  # it reports its own signal handling (1) after the ranks saved and exited 75
        assert proc.returncode == 1, (proc.returncode, err[-3000:])
    _check_resumes_at_next_step(tmp_path, tiny_data, run_dir, nprocs=2)


def test_exit_after_minutes_saves_and_exits_75(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    # a bound far above the 6 s limit plus start-up: a run that ignores the limit fails here
    # instead of training its 100,000 steps
    run = run_pretrain(_args(run_dir, tiny_data, LONG) + ["--exit-after-minutes", "0.1"],
                       run_dir=run_dir, timeout=240)
    assert run.returncode == EXIT_REQUEUE, run.stderr[-3000:]
    assert "[stop] --exit-after-minutes reached" in run.stdout
    _check_resumes_at_next_step(tmp_path, tiny_data, run_dir, nprocs=1)


def test_run_control_wall_clock_cadence_and_signals(monkeypatch):
    """One process (no collective): the clock is faked, the signal is real."""
    from pretrain.training import faults

    now = [1000.0]
    monkeypatch.setattr(faults.time, "monotonic", lambda: now[0])
    control = faults.RunControl(save_interval_minutes=1.0, exit_after_minutes=10.0)
    try:
        assert control.poll(device="cpu") == (None, False, False)
        now[0] += 61
        assert control.poll(device="cpu") == (None, True, False)  # a save is due
        control.mark_saved()
        now[0] += 30
        assert control.poll(device="cpu", writing=True) == (None, False, True)
        os.kill(os.getpid(), signal.SIGUSR1)  # handled: only sets the flag
        assert control.poll(device="cpu") == ("signal SIGUSR1", True, False)
        control.received = None
        now[0] += 600
        assert control.poll(device="cpu") == ("--exit-after-minutes reached", True, False)
    finally:
        control.restore_handlers()


def test_run_control_owns_both_save_cadences(monkeypatch):
    """Steps and minutes: a save is due at every save_interval-th step and after
    save_interval_minutes, whichever comes first; the minutes count from the last save."""
    from pretrain.training import faults

    now = [1000.0]
    monkeypatch.setattr(faults.time, "monotonic", lambda: now[0])
    control = faults.RunControl()
    try:
        control.schedule(save_interval_steps=3, save_interval_minutes=2.0, exit_after_minutes=0)
        due = [control.poll(device="cpu", step=step).save_due for step in range(1, 8)]
        assert due == [False, False, True, False, False, True, False]
        now[0] += 121
        assert control.poll(device="cpu", step=7).save_due  # the minutes, between the steps
        control.mark_saved()
        assert not control.poll(device="cpu", step=8).save_due
        assert control.deadline is None
        control.schedule(save_interval_steps=0, save_interval_minutes=0, exit_after_minutes=1)
        assert control.deadline == 1000.0 + 60  # from when the process started its clock
        assert control.poll(device="cpu", step=9) == ("--exit-after-minutes reached", True, False)
    finally:
        control.restore_handlers()


def test_killed_rank_makes_the_others_exit_then_restart_resumes(tiny_data, tmp_path):
    """srun-style ranks (no launcher to clean up): rank 1 is SIGKILLed; rank 0 must notice in a
    collective, print one line and exit 3 (within the 1-minute collective timeout)."""
    from pretrain.dist import free_port

    run_dir, port = tmp_path / "run", free_port()
    args = _args(run_dir, tiny_data, [*LONG, "checkpoint.save_interval=2",
                                      "train.collective_timeout_minutes=1"])
    procs = []
    for rank in range(2):
        env = {**_env(), "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2",
               "SLURM_LOCALID": str(rank), "SLURM_NTASKS_PER_NODE": "2",
               "SLURM_JOB_NODELIST": "localhost", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-m", "pretrain", *args], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        _wait_for_checkpoint(run_dir, 4, procs)
        procs[1].kill()
        _, err = procs[0].communicate(timeout=300)  # the timeout is 60 s: room for a loaded machine
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode == EXIT_FAULT, (procs[0].returncode, err[-3000:])
    assert "error: rank 0: a collective failed, another rank died or stopped answering" in err
    latest = int((run_dir / "checkpoints" / "latest").read_text()[4:])
    assert latest >= 4 and latest % 2 == 0
    before = len(_train_steps(run_dir))
    train(tmp_path, tiny_data, nprocs=2, name="run", overrides=[f"train.steps={latest + 1}"])
    assert _train_steps(run_dir)[before:] == [latest + 1]


def _saved_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's DeepSpeed files, by file and key path: each rank's model
    weights, fp32 masters, Adam moments and step counts (the RNG states left out)."""
    def walk(value, path: str):
        if isinstance(value, torch.Tensor):
            yield path, value
        elif isinstance(value, dict):
            for key, item in value.items():
                yield from walk(item, f"{path}/{key}")
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                yield from walk(item, f"{path}/{index}")

    tensors = {}
    for file in sorted(step_dir.glob("*.pt")):
        if not file.name.startswith("rng_"):
            state = torch.load(file, map_location="cpu", weights_only=False)
            tensors.update(walk(state, file.name))
    return tensors


def _changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[str]:
    """The keys whose tensors differ in any bit (dtype, shape or value)."""
    assert sorted(before) == sorted(after)
    return [key for key, tensor in before.items()
            if tensor.dtype != after[key].dtype or tensor.shape != after[key].shape
            or not torch.equal(tensor, after[key])]


@pytest.mark.parametrize("nprocs, zero", [(1, 0), (2, 1)], ids=["single-zero0", "dp2-zero1"])
def test_nan_step_is_skipped_and_training_continues(nprocs, zero, tiny_data, tmp_path):
    """Rank 0's loss is NaN at step 3. The checkpoints of steps 2 and 3 (saved after each) hold
    bitwise the same weights and optimizer state on every rank: no rank applied an update, and
    no weight decay or moment decay ran on zeroed gradients; step 4's shows a real update."""
    run_dir = tmp_path / "run"
    overrides = ["train.steps=5", f"deepspeed=ds_configs/zero{zero}.json",
                 "checkpoint.save_interval=1", "checkpoint.keep_last=5"]
    run = run_pretrain(_args(run_dir, tiny_data, overrides),
                       run_dir=run_dir, nprocs=nprocs, launcher="single" if nprocs == 1 else "torchrun",
                       env=nan_loss_environment({3}, directory=tmp_path)).check()
    records = [r for r in run.records if r["kind"] == "train"]
    assert [r["update_skipped"] for r in records] == [False, False, True, False, False]
    assert records[2]["loss"] is None  # metrics.jsonl writes NaN as null (strict JSON)
    assert all(math.isfinite(r["loss"]) for r in records[3:]), records  # weights stayed finite
    assert records[3]["lr"] == records[2]["lr"]  # the skipped update did not advance the schedule
    assert records[-1]["nonfinite_steps"] == 1 and records[-1]["skipped_steps"] == 1
    assert "[fault] step 3: non-finite loss/grad norm" in run.stdout
    assert "update skipped (1 in a row, 1 in total)" in run.stdout
    saved = {step: _saved_tensors(run_dir / "checkpoints" / f"step{step}") for step in (2, 3, 4)}
    files = {key.split("/")[0] for key in saved[2]}
    optimizer_files = {"mp_rank_00_model_states.pt"} if zero == 0 else \
        {f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in range(nprocs)}
    assert optimizer_files <= files, files  # every rank's optimizer partition is compared
    assert _changed(saved[2], saved[3]) == []
    assert _changed(saved[3], saved[4]) == list(saved[3])  # an applied step changes every one


def test_nonfinite_steps_in_a_row_stop_the_run(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    run = run_pretrain(_args(run_dir, tiny_data, ["train.steps=6", "train.max_nonfinite_steps=2"]),
                       run_dir=run_dir, env=nan_loss_environment({2, 3}, directory=tmp_path))
    assert run.returncode == EXIT_FAULT, run.stderr[-3000:]
    assert "error: 2 non-finite steps in a row (up to step 3): the run diverged" in run.stderr
    assert "Traceback" not in run.stderr


STOP_RUN = ["train.micro_batch_size=1", "train.global_batch_size=4", "train.steps=5",
            "train.warmup_steps=2", "train.eval_interval=2", "train.eval_batches=4",
            "train.precision=fp32", "checkpoint.save_final=false", "data.num_workers=0"]


@pytest.fixture(scope="module")
def uninterrupted(tiny_data, tmp_path_factory):
    """STOP_RUN on 2 forked ranks (the deepspeed launcher's environment), never stopped (the
    reference)."""
    return train(tmp_path_factory.mktemp("uninterrupted"), tiny_data, nprocs=2, name="full",
                 overrides=STOP_RUN)


@pytest.mark.parametrize("where, step", [
    # inside the first of the 8 micro-batches each rank evaluates after step 2
    ("eval", 2),
    # inside the first of step 3's 2 accumulated micro-batches: the partial step is abandoned
    ("step", 3),
])
def test_stop_request_is_honoured_within_one_micro_batch(where, step, tiny_data, tmp_path,
                                                         uninterrupted):
    """Rank 0 signals itself from inside a micro-batch (deterministic, no timed kill): both
    ranks stop after that micro-batch, save step 2 (the last completed one), exit 75, and the
    resumed run's losses are the uninterrupted run's."""
    from pretrain.testing.faults import signal_environment
    from pretrain.testing.runs import train_args

    env = signal_environment(where, step, directory=tmp_path)
    full = uninterrupted
    run_dir = tmp_path / "stopped"
    stopped = run_pretrain(train_args(run_dir, tiny_data, overrides=STOP_RUN), run_dir=run_dir,
                           launcher="deepspeed", nprocs=2, env=env)
    assert stopped.returncode == EXIT_REQUEUE, stopped.stderr[-3000:]
    # the micro-batch the signal arrived in, and no other, ran after it
    assert ("[stop] signal SIGUSR1 (1 micro-batch(es) ran after it arrived): saving step 2, "
            "then exiting to be requeued") in stopped.stdout, stopped.stdout[-3000:]
    if where == "eval":
        assert "[eval] step 2: interrupted by a stop request" in stopped.stdout
    assert _train_steps(run_dir) == [1, 2]
    assert json.loads((run_dir / "stopped.json").read_text())["step"] == 2

    # (the stop went through the deepspeed launcher; the resume needs no launcher of its own)
    resumed = run_pretrain(train_args(run_dir, tiny_data, overrides=STOP_RUN), run_dir=run_dir,
                           nprocs=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = [r for r in resumed.records if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in records] == [r["loss"] for r in full.records
                                            if r["kind"] == "train"]
