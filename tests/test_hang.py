"""Hang attribution (pretrain/training/hang.py): a rank that blocks forever inside a micro-batch, or
SIGSTOPs itself, is named with its host in one verdict line; every rank that can still run
Python dumps its stacks and last collectives; the job exits 75 to be requeued. The hang is
injected through `pretrain.testing.faults.hang_inside` (deterministic: no timed kill); waits are
on conditions (a file appearing, a process exiting).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pretrain.testing.faults import hang_environment
from pretrain.testing.runs import REPO, run_pretrain, train_args

EXIT_REQUEUE = 75
# 2 ranks, grad accum 1, fp32; rank 1 hangs as step 2 starts; 12 s without progress is a hang
# (a loaded 2-core machine runs a tiny micro-batch in well under a second)
HANG_RUN = ["train.steps=4", "train.hang_timeout_minutes=0.2",
            "train.collective_timeout_minutes=2", "checkpoint.save_interval=1"]
HOST = socket.gethostname()


def _hang_files(run_dir: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted((run_dir / "hang").glob("*.txt"))}


def _check_blocked_rank_named(run_dir: Path, records: list[dict]) -> None:
    files = _hang_files(run_dir)
    assert set(files) == {"rank0.txt", "rank1.txt", "verdict.txt"}, list(files)
    line = files["verdict.txt"].strip()
    assert line.startswith(f"[hang] rank 1 ({HOST}) did not reach "), line
    assert "rank 0 waits in" in line and "rank 0 (" not in line, line  # only rank 1 is named
    # the rank that called the hang did so for the configured timeout (not the default's 1 min)
    assert any("(train.hang_timeout_minutes=0.2)" in files[f] for f in ("rank0.txt", "rank1.txt"))
    assert "blocked_forever" in files["rank1.txt"]  # the stuck frame
    assert "micro_batch_started" in files["rank1.txt"]
    assert "waiting" in files["rank0.txt"].split("last collectives")[1]  # rank 0's wait
    hangs = [r for r in records if r["kind"] == "hang"]
    assert len(hangs) == 1 and hangs[0]["ranks"] == [1] and hangs[0]["hosts"] == [HOST], hangs
    assert hangs[0]["verdict"] == line and hangs[0]["step"] == 1
    # step 1's background save, written by both ranks but not yet completed by the training
    # threads (they meet for that at a later step), was completed before the exit
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step1"
    assert (run_dir / "checkpoints" / "step1" / "manifest.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_rank_blocked_in_a_micro_batch_is_named(launcher, tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    run = run_pretrain(train_args(run_dir, tiny_data, overrides=HANG_RUN), run_dir=run_dir,
                       launcher=launcher, nprocs=2, timeout=300,
                       env=hang_environment(2, 1, "block", directory=tmp_path))
    line = (run_dir / "hang" / "verdict.txt").read_text().strip()
    assert line in run.stdout, run.stdout[-3000:]
    _check_blocked_rank_named(run_dir, run.records)
    if launcher == "deepspeed":  # it passes the ranks' status on
        assert run.returncode == EXIT_REQUEUE, (run.returncode, run.stderr[-3000:])
    else:  # torchrun exits 1 on a failed worker and reports each worker's status
        assert run.returncode == 1 and f"exitcode  : {EXIT_REQUEUE}" in run.stderr, \
            run.stderr[-3000:]


@pytest.mark.slow
def test_stopped_rank_is_named_as_unable_to_answer(tiny_data, tmp_path):
    """srun-style ranks (each rank's status is the job's, as under Slurm): rank 1 SIGSTOPs
    itself; rank 0 names it, writes its own dump and exits 75; rank 1 wrote nothing."""
    from pretrain.dist import free_port

    run_dir, port = tmp_path / "run", free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           **hang_environment(2, 1, "stop", directory=tmp_path)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    procs = []
    for rank in range(2):
        rank_env = {**env, "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2",
                    "SLURM_LOCALID": str(rank), "SLURM_NTASKS_PER_NODE": "2",
                    "SLURM_JOB_NODELIST": "localhost", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "pretrain", *train_args(run_dir, tiny_data, overrides=HANG_RUN)],
            cwd=REPO, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        out, err = procs[0].communicate(timeout=300)
        assert psutil.Process(procs[1].pid).status() == psutil.STATUS_STOPPED
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode == EXIT_REQUEUE, (procs[0].returncode, err[-3000:])
    files = _hang_files(run_dir)
    assert set(files) == {"rank0.txt", "verdict.txt"}, list(files)
    line = files["verdict.txt"].strip()
    assert line in out
    assert line.startswith(f"[hang] rank 1 ({HOST}) cannot answer (stopped or frozen"), line
    assert "rank 0 (" not in line and "that rank 0 waits in" in line, line
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    hangs = [r for r in records if r["kind"] == "hang"]
    assert [(h["ranks"], h["silent"]) for h in hangs] == [([1], [1])], hangs


@pytest.mark.slow
def test_healthy_run_raises_no_alarm(tiny_data, tmp_path):
    """Saves every step (paused watchdog) and an evaluation, with a short hang timeout."""
    run_dir = tmp_path / "run"
    run = run_pretrain(train_args(run_dir, tiny_data, overrides=[
        "train.steps=3", "train.hang_timeout_minutes=0.25", "checkpoint.save_interval=1",
        "train.eval_interval=2", "train.eval_batches=1"]), run_dir=run_dir,
        launcher="deepspeed", nprocs=2, timeout=300)
    run.check()
    assert not (run_dir / "hang").exists()
    assert [r["step"] for r in run.records if r["kind"] == "train"] == [1, 2, 3]
    assert "[hang]" not in run.stdout


def test_hang_timeout_must_stay_below_the_collective_timeout():
    from pretrain.config import load_config
    from pretrain.errors import ConfigError

    assert load_config(None, []).train.hang_timeout == 5.0
    assert load_config(None, ["train.collective_timeout_minutes=1"]).train.hang_timeout == 0.5
    for bad in ("0", "10", "-1"):
        with pytest.raises(ConfigError, match="hang_timeout_minutes.*below"):
            load_config(None, [f"train.hang_timeout_minutes={bad}"])


class _Control:
    received: str | None = None


def test_watchdog_fires_on_no_progress_and_on_an_unheeded_sigterm(monkeypatch, tmp_path):
    """The decision alone, on a fake clock: no beat for the timeout; a SIGTERM without progress
    for min(grace, timeout); never while paused (a save)."""
    from pretrain.training import hang

    control = _Control()
    dog = hang.Watchdog(timeout_minutes=2.0, rank=0, world_size=1, run_dir=tmp_path,
                        control=control)
    dog.last_progress = 1000.0
    assert dog.due(1119.0) is None
    assert dog.due(1120.0).startswith("no progress for 120.0 s")
    with dog.paused():
        assert dog.due(5000.0) is None
    dog.last_progress = 2000.0
    control.received = "SIGUSR1"  # asks for a save ahead of time: no deadline
    assert dog.due(2100.0) is None
    control.received = "SIGTERM"
    assert dog.due(2100.0) is None  # first seen now
    dog.last_progress = 2110.0  # a micro-batch ran after it: the loop is alive
    assert dog.due(2139.0) is None
    assert dog.due(2140.0).startswith("SIGTERM not acted on: no progress for 30.0 s")


def _measured(tmp_path, *, step_s: float, save_s: float, platform_grace_s: float | None = None,
              control=None):
    """A watchdog on a fake clock after three steps: the first (warm-up, not measured), a step
    of `step_s` followed by a save of `save_s`, and another step of `step_s`."""
    from pretrain.training import hang

    now = [0.0]
    dog = hang.Watchdog(timeout_minutes=30.0, rank=0, world_size=1, run_dir=tmp_path,
                        control=control, clock=lambda: now[0], platform_grace_s=platform_grace_s)
    now[0] = 100.0
    dog.beat(1)
    now[0] += step_s
    dog.beat(2)
    with dog.paused():  # the save after step 2
        now[0] += save_s
    now[0] += step_s
    dog.beat(3)
    return dog, now[0]


def test_sigterm_grace_follows_the_runs_measured_step_and_save(tmp_path):
    """After a SIGTERM the loop may be silent for what finishing a step and saving took so far,
    GRACE_MARGIN times over (at least 30 s): a long step is not called a hang."""
    control = _Control()
    fast, _ = _measured(tmp_path, step_s=2.0, save_s=3.0)
    assert fast.sigterm_grace() == 30.0  # the floor
    dog, end = _measured(tmp_path, step_s=80.0, save_s=40.0, control=control)
    assert (dog.longest_step, dog.longest_pauses) == (80.0, 40.0)  # the save apart from the step
    assert dog.sigterm_grace() == 1.5 * (80.0 + 40.0)
    control.received = "SIGTERM"
    assert dog.due(end) is None  # first seen now, inside step 4
    assert dog.due(end + 179.0) is None  # the old fixed 30 s would have exited 75 here
    assert dog.due(end + 180.0).startswith("SIGTERM not acted on: no progress for 180.0 s")


def test_sigterm_grace_never_exceeds_the_platforms(tmp_path, monkeypatch):
    """The pod's grace (PRETRAIN_TERMINATION_GRACE_S) bounds the watchdog's, less the answer
    window its dump and verdict take, however slow the run's steps."""
    from pretrain.training import hang

    dog, _ = _measured(tmp_path, step_s=80.0, save_s=40.0, platform_grace_s=120.0)
    assert dog.window == 30.0 and dog.sigterm_grace() == 120.0 - 30.0
    short, _ = _measured(tmp_path, step_s=1.0, save_s=1.0, platform_grace_s=20.0)
    assert short.sigterm_grace() <= 20.0  # below the 30 s floor: the platform kills at 20
    monkeypatch.setenv("PRETRAIN_TERMINATION_GRACE_S", "600")
    assert hang.Watchdog(timeout_minutes=30.0, rank=0, world_size=1,
                         run_dir=tmp_path).platform_grace_s == 600.0
    assert hang.platform_grace({}) is None
    assert hang.platform_grace({"PRETRAIN_TERMINATION_GRACE_S": "soon"}) is None


def _status(rank, *, step=1, counts=None, last=None, answered=True, at=100.0):
    return {"rank": rank, "host": f"node{rank // 2}", "pid": 1, "step": step, "at": at,
            "answered": answered, "counts": counts or {}, "last": last}


def _entry(seq, *, group="1", ranks=(0, 1, 2, 3), state="waiting", op="all_reduce"):
    return {"seq": seq, "op": op, "group": group, "ranks": list(ranks), "started": 90.0,
            "state": state}


def test_verdict_names_the_end_of_a_chain_and_a_silent_rank():
    from pretrain.training.hang_verdict import verdict

    # ranks 0, 1 wait in all_reduce #5 of group 1; rank 3 waits in #5 too; rank 2 never got there
    statuses = {r: _status(r, counts={"1": 5}, last=_entry(5)) for r in (0, 1, 3)}
    statuses[2] = _status(2, counts={"1": 4}, last=_entry(4, state="done"))
    line, record = verdict(statuses, now=100.0)
    assert line.startswith("[hang] rank 2 (node1) did not reach all_reduce #5 on group 1 "
                           "(ranks 0-3) that ranks 0, 1, 3 wait in (for 10.0 s); it finished step 1 and "
                           "waits in no collective (last: all_reduce #4 on group 1 (ranks 0-3), done)"), line
    assert record["ranks"] == [2] and record["hosts"] == ["node1"] and record["silent"] == []
    # a chain: rank 0 waits for rank 1 in group 2, rank 1 waits for rank 2 in group 3
    statuses = {0: _status(0, counts={"2": 3}, last=_entry(3, group="2", ranks=(0, 1))),
                1: _status(1, counts={"2": 2, "3": 7}, last=_entry(7, group="3", ranks=(1, 2))),
                2: _status(2, counts={"3": 6}, last=_entry(6, group="3", ranks=(1, 2),
                                                           state="done"))}
    assert verdict(statuses, now=100.0)[1]["ranks"] == [2]
    # rank 1 is stopped: its heartbeat is old and it never answered
    statuses = {0: _status(0, counts={"1": 5}, last=_entry(5, ranks=(0, 1))),
                1: _status(1, counts={"1": 4}, answered=False, at=40.0)}
    line, record = verdict(statuses, now=100.0)
    assert line.startswith("[hang] rank 1 (node0) cannot answer (stopped or frozen: last heard "
                           "60 s ago, at step 1) and did not reach all_reduce #5"), line
    assert record["ranks"] == [1] and record["silent"] == [1]
    # never heard from at all
    line, record = verdict({0: statuses[0], 1: None}, now=100.0)
    assert "rank 1 cannot answer (never heard from" in line and record["ranks"] == [1]
    # nobody in a collective: every rank is stuck in its own code
    line, record = verdict({0: _status(0), 1: _status(1)}, now=100.0)
    assert "no rank waits in a collective" in line and record["ranks"] == []


def test_one_rank_that_stops_progressing_dumps_judges_and_exits_75(tmp_path):
    """In this process, a world of one (no store): the main thread waits on an event that only
    the watchdog's exit sets; the watchdog writes the stack with that wait, the verdict, the
    metrics record, and exits 75."""
    import threading

    from pretrain.training import collective_log, hang

    exited: list[int] = []
    done = threading.Event()

    def exit_(code: int) -> None:
        exited.append(code)
        done.set()

    log = collective_log.CollectiveLog()
    log.start("all_reduce", None)[5] = "done"
    lines: list[str] = []
    dog = hang.Watchdog(timeout_minutes=0.005, rank=0, world_size=1, run_dir=tmp_path,
                        log=lines.append, exit=exit_, collectives=log)
    dog.start()
    assert done.wait(timeout=120), "the watchdog did not fire"  # the main thread "hangs" here
    dog.stop()
    assert exited == [EXIT_REQUEUE]
    assert lines == [(tmp_path / "hang" / "verdict.txt").read_text().strip()]
    assert lines[0].startswith("[hang] no rank waits in a collective: rank 0 made no progress")
    dump = (tmp_path / "hang" / "rank0.txt").read_text()
    assert "test_one_rank_that_stops_progressing" in dump and "all_reduce #1 on group" in dump
    [record] = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert record["kind"] == "hang" and record["ranks"] == [] and record["hangs"] == 1
