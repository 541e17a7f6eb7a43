"""Elastic restarts: two torchrun agents (`launch/elastic.sh`, `--nnodes 1:2`, one rank each) on
this machine. One is SIGKILLed mid-run: the survivor's agent restarts its worker, which resumes
at dp 1 from the newest complete checkpoint; then a second agent joins and the run goes back to
dp 2. The run finishes every step, each step's samples are those of an uninterrupted run, and
each step's last logged loss is the uninterrupted run's within 1e-4 (the reshards change the
summation order, not the data).

Waiting is on conditions only: the rendezvous port accepting connections, a step appearing in
metrics.jsonl, a process exiting.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from pretrain.dist import free_port
from pretrain.testing.runs import REPO, rel_diff, train, train_args

pytestmark = pytest.mark.slow

STEPS = 400
OVERRIDES = [f"train.steps={STEPS}", "checkpoint.save_interval=10", "checkpoint.keep_last=2",
             "train.global_batch_size=4", "train.micro_batch_size=2"]


def _agent(args: list[str], *, port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "DS_ACCELERATOR": "cpu",
           "RDZV_ENDPOINT": f"127.0.0.1:{port}", "MIN_NODES": "1", "MAX_NODES": "2",
           "RDZV_ID": "elastic-test", "MAX_RESTARTS": "5",
           # a restart waits this long for more agents once one is there
           "RDZV_CONF": "last_call_timeout=2,join_timeout=120"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return subprocess.Popen(["bash", "launch/elastic.sh", *args[1:]], cwd=REPO, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL an agent and its workers (torchrun starts each worker in a session of its own),
    as a node's loss would."""
    tree, frontier = [agent.pid], [agent.pid]
    while frontier:
        parent = frontier.pop()
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent:
                child = int(stat.parent.name)
                tree.append(child)
                frontier.append(child)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait()


def _until(condition, *, what: str, timeout: float = 300, procs=()) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        dead = [p for p in procs if p.poll() is not None]
        assert not dead, f"an agent exited ({dead[0].returncode}) while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)  # polling a condition, not synchronising on time


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in _records(run_dir) if r["kind"] == "train"]


def _latest_step(run_dir: Path) -> int:
    """The step of the newest complete checkpoint (`latest` is replaced atomically); 0: none."""
    latest = run_dir / "checkpoints" / "latest"
    return int(latest.read_text().removeprefix("step")) if latest.exists() else 0


def _starts(run_dir: Path) -> list[int]:
    """The data-parallel size of each start of the run, in order."""
    return [r["data_parallel"] for r in _records(run_dir) if r["kind"] == "run"]


def _training_at(run_dir: Path, *, dp: int, start: int) -> bool:
    """Whether the `start`-th start of the run (1-based) has begun, at data-parallel size `dp`,
    and trained a step."""
    records = _records(run_dir)
    starts = [i for i, r in enumerate(records) if r["kind"] == "run"]
    if len(starts) < start:
        return False
    assert records[starts[start - 1]]["data_parallel"] == dp, records[starts[start - 1]]
    return any(r["kind"] == "train" for r in records[starts[start - 1]:])


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_elastic_run_survives_a_lost_node_and_takes_a_new_one(tiny_data, tmp_path):
    # the uninterrupted run: one process (2 micro-batches a step: the same samples, and the same
    # losses, as the elastic run's own dp 1 stretch shows), saving no checkpoint (none is resumed)
    reference = train(tmp_path, tiny_data, name="reference",
                      overrides=[*OVERRIDES, "checkpoint.save_interval=0"])
    run_dir = tmp_path / "elastic"
    args = train_args(run_dir, tiny_data, overrides=OVERRIDES)
    port = free_port()
    host = _agent(args, port=port, log=tmp_path / "host.log")  # serves the rendezvous store
    _until(lambda: _listening(port), what="the rendezvous store", procs=[host])
    leaving = _agent(args, port=port, log=tmp_path / "leaving.log")
    try:
        # Usually both agents meet in the first rendezvous. On a loaded machine the second may
        # join after the host's first round closed (its last call is 2 s): the host then starts
        # alone at dp 1 and restarts at dp 2 when the second arrives. Either way, wait for the
        # dp 2 start and for a checkpoint it saved, so that losing a node reshards dp 2 -> dp 1.
        _until(lambda: 2 in _starts(run_dir), what="the run training at dp 2",
               procs=[host, leaving])
        first = _starts(run_dir).index(2) + 1
        assert _starts(run_dir)[:first] in ([2], [1, 2]), _starts(run_dir)
        _until(lambda: _training_at(run_dir, dp=2, start=first), what="a step at dp 2",
               procs=[host, leaving])
        resumed = _latest_step(run_dir)
        _until(lambda: _latest_step(run_dir) > resumed, what="a checkpoint saved at dp 2",
               procs=[host, leaving])
        _kill_node(leaving)

        _until(lambda: _training_at(run_dir, dp=1, start=first + 1),
               what="the survivor training at dp 1", procs=[host])
        # the joined run must resume from a checkpoint saved at dp 1, or it has nothing to reshard
        resumed = _latest_step(run_dir)
        _until(lambda: _latest_step(run_dir) > resumed, what="a checkpoint saved at dp 1",
               procs=[host])
        joining = _agent(args, port=port, log=tmp_path / "joining.log")
        _until(lambda: _training_at(run_dir, dp=2, start=first + 2),
               what="the run going back to dp 2",
               procs=[host, joining])
        assert host.wait(timeout=600) == 0, (tmp_path / "host.log").read_text()[-4000:]
        assert joining.wait(timeout=120) == 0, (tmp_path / "joining.log").read_text()[-4000:]
    finally:
        for proc in (host, leaving, *([joining] if "joining" in locals() else [])):
            if proc.poll() is None:
                _kill_node(proc)

    log = (tmp_path / "host.log").read_text()
    assert "resharded tp1 pp1 dp2 ZeRO-1 -> tp1 pp1 dp1 ZeRO-1" in log
    assert "resharded tp1 pp1 dp1 ZeRO-1 -> tp1 pp1 dp2 ZeRO-1" in log
    # every step trained; the last record of a step is the one the run's history kept
    last = {r["step"]: r for r in _records(run_dir) if r["kind"] == "train"}
    assert sorted(last) == list(range(1, STEPS + 1))
    expected = {r["step"]: r for r in reference.records if r["kind"] == "train"}
    assert [last[s]["consumed_samples"] for s in sorted(last)] == [
        expected[s]["consumed_samples"] for s in sorted(expected)]
    assert rel_diff([last[s]["loss"] for s in sorted(last)],
                    [expected[s]["loss"] for s in sorted(expected)]) < 1e-4
