"""`pretrain launch ray` on a local Ray cluster (one head, 2 CPU workers, shared by the tests): a
rank killed mid-run is restarted by Ray and the run finishes with no step lost or repeated, its
output free of Ray Train's placement-group cleaner's polling warnings; bad input ends the job with
2 and no retry, on a Ray of its own when no address is given although another cluster runs on the
host. That a Ray job's losses equal the deepspeed launcher's is tested where the Ray cluster is
started by slurm/ray_cluster.sh (tests/test_slurm.py). Without Ray (the quick tier): which Ray a
job joins, how a worker stops its rank, and the filter on the cleaner's warnings."""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")
TINY = ["--config", "configs/tiny.yaml"]


# Ray 2.60 clusters started with `ray start` require a token from their clients: one for the
# test cluster, given to the head and to every client through the environment
TOKEN = secrets.token_hex(32)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RAY_DISABLE_USAGE_STATS="1",
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=TOKEN,
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    return env


def _until(condition, *, what: str, timeout: float = 300, procs=()) -> None:
    """Poll `condition` (a state change we wait for, not a delay), failing after `timeout` or
    when one of `procs` ended first."""
    deadline = time.monotonic() + timeout
    while not condition():
        ended = [p.returncode for p in procs if p.poll() is not None]
        assert not ended, f"{what}: a process ended first ({ended})"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def ray_address(tmp_path_factory):
    """One local Ray head with 2 CPUs for the module's tests."""
    from pretrain.dist import free_port

    port = free_port()
    log = (tmp_path_factory.mktemp("ray") / "head.log").open("w")
    head = subprocess.Popen([RAY, "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
                             "--num-gpus=0", "--include-dashboard=false"],
                            env=_env(), stdout=log, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    try:
        _until(lambda: subprocess.run([RAY, "status", f"--address={address}"], env=_env(),
                                      capture_output=True).returncode == 0,
               what="the Ray head", timeout=300, procs=[head])
        yield address
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops what it started
        head.wait(timeout=120)


def _ray_run(address: str | None, data: list[str], run_dir: Path, *extra: str,
             max_failures: int = 0) -> subprocess.Popen:
    join = ["--address", address] if address else []
    return subprocess.Popen(
        [sys.executable, "-m", "pretrain", "launch", "ray", "--num-workers", "2",
         "--cpus-per-worker", "1", *join, "--max-failures", str(max_failures),
         "--", *TINY, *data, "--set", f"run_dir={run_dir}", *extra],
        cwd=REPO, env=_env(), stdout=(run_dir.parent / f"{run_dir.name}.log").open("w"),
        stderr=subprocess.STDOUT)


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _data(tiny_data) -> list[str]:
    return ["--set", f"data.tokenizer={tiny_data['tokenizer']}",
            "--set", f"data.dataset={tiny_data['dataset']}"]


# Ray Train's placement-group cleaner polls Ray's state API every second; without the dashboard
# (which serves that API) each poll logged this line
CLEANER_NOISE = "Failed to query Ray Train Controller actor state"


@pytest.mark.slow
def test_ray_restarts_a_killed_rank_and_resumes(ray_address, tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    total = 40
    run = _ray_run(ray_address, _data(tiny_data), run_dir, "--set", f"train.steps={total}",
                   "--set", "checkpoint.save_interval=5", "--set", "checkpoint.keep_last=2",
                   max_failures=2)
    latest = run_dir / "checkpoints" / "latest"
    _until(lambda: latest.exists(), what="a first checkpoint", procs=[run])
    victim = _rank_process(run_dir, rank=1)
    os.kill(victim, signal.SIGKILL)
    assert run.wait(timeout=900) == 0, (tmp_path / "run.log").read_text()[-4000:]
    assert (tmp_path / "run.log").read_text().count(CLEANER_NOISE) == 0

    records = _records(run_dir)
    starts = [i for i, r in enumerate(records) if r["kind"] == "run"]
    assert len(starts) == 2, "Ray restarted the worker group once"
    first = [r["step"] for r in records[:starts[1]] if r["kind"] == "train"]
    second = [r for r in records[starts[1]:] if r["kind"] == "train"]
    resumed_from = second[0]["step"] - 1
    assert resumed_from >= 5 and resumed_from % 5 == 0 and resumed_from <= max(first)
    # no step lost or repeated: the second start continues the checkpoint, step by step
    assert [r["step"] for r in second] == list(range(resumed_from + 1, total + 1))
    assert [r["consumed_samples"] for r in second] == [4 * r["step"] for r in second]
    # the steps trained twice (after the checkpoint, before the kill) give the same loss
    again = {r["step"]: r["loss"] for r in second}
    before = {r["step"]: r["loss"] for r in records[:starts[1]] if r["kind"] == "train"}
    assert all(before[s] == again[s] for s in before if s in again)


def _rank_process(run_dir: Path, *, rank: int) -> int:
    """The pid of `pretrain train` of `rank` for `run_dir` (read from /proc)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (b"train" in cmdline and f"run_dir={run_dir}".encode() in cmdline
                and f"RANK={rank}".encode() in environ):
            return int(proc.name)
    raise AssertionError(f"no pretrain train process of rank {rank} for {run_dir}")


@pytest.mark.slow
def test_bad_input_in_a_rank_is_not_retried(ray_address, tiny_data, tmp_path):
    """Without --address the job starts a Ray of its own, although the module's cluster (started
    after any other on this host) is running: `ray.init()` would join that one."""
    data = ["--set", f"data.tokenizer={tiny_data['tokenizer']}",
            "--set", f"data.dataset={tmp_path / 'missing'}"]  # found missing by the ranks: exit 2
    run = _ray_run(None, data, tmp_path / "bad", max_failures=2)
    assert run.wait(timeout=600) == 2
    log = (tmp_path / "bad.log").read_text()
    assert "[FailurePolicy] RETRY" not in log and "missing" in log, log[-3000:]
    assert "Started a local Ray instance" in log, log[-3000:]
    assert "Connecting to existing Ray cluster" not in log, log[-3000:]


# ---- without Ray ----------------------------------------------------------------------------
def test_a_job_without_an_address_starts_its_own_ray():
    from pretrain.ray_train import ray_address

    assert ray_address(None, {}) == "local"  # not ray.init()'s "the cluster started last here"
    assert ray_address(None, {"RAY_ADDRESS": "head:6379"}) == "head:6379"
    assert ray_address("auto", {"RAY_ADDRESS": "head:6379"}) == "auto"
    assert ray_address("ray://head:10001", {}) == "ray://head:10001"


def _stubborn_rank(tmp_path: Path) -> list[str]:
    """A rank that ignores SIGTERM (as `pretrain train` does until its loop polls the flag) and
    has a process of its own below it; it writes both pids, then waits."""
    return ["bash", "-c", "trap '' TERM; sleep 600 & echo $$ $! > pids.tmp; mv pids.tmp pids; "
                          "wait"]


def _pids(tmp_path: Path, proc: subprocess.Popen) -> list[int]:
    _until(lambda: (tmp_path / "pids").exists(), what="the rank's pids", timeout=60, procs=[proc])
    return [int(pid) for pid in (tmp_path / "pids").read_text().split()]


def _gone(pid: int) -> bool:
    """No process `pid`, or only its zombie (exited, not yet reaped by init)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.parametrize("through", ["stop_all", "ray_callback"])
def test_a_stopped_worker_leaves_no_process_of_its_rank(through, tmp_path):
    """Ray stopping a worker group asks each worker to shut down (Ray Train's worker callback),
    then kills it: when that returns, the worker's rank and the processes below it are gone,
    the rank SIGKILLed after the grace since it ignored SIGTERM; the worker's waiting thread
    (Ray Train's training thread) gets the rank's status."""
    from pretrain.ray_train import RankProcess

    if through == "ray_callback":
        pytest.importorskip("ray.train")
        from pretrain.ray_train import stop_on_shutdown
        stop = stop_on_shutdown().before_worker_shutdown
    else:
        stop = RankProcess.stop_all
    rank = RankProcess(_stubborn_rank(tmp_path), cwd=str(tmp_path), env=dict(os.environ),
                       grace_s=0.5)
    statuses: list[int] = []
    waiting = threading.Thread(target=lambda: statuses.append(rank.wait()), daemon=True)
    waiting.start()
    try:
        pid, below = _pids(tmp_path, rank.proc)
        stop()
        assert _gone(pid), "the rank outlived its worker's stop"
        waiting.join(timeout=60)
        assert statuses == [-signal.SIGKILL]
        _until(lambda: _gone(below), what="the rank's own child to die", timeout=30)
        assert not RankProcess._running  # nothing left for the next stop
    finally:  # a stop that failed leaves the stubborn rank (its own session) to the test
        with contextlib.suppress(ProcessLookupError):
            os.killpg(rank.proc.pid, signal.SIGKILL)


def test_a_rank_that_exited_is_not_signalled_again(tmp_path):
    from pretrain.ray_train import RankProcess

    rank = RankProcess(["bash", "-c", "exit 75"], cwd=str(tmp_path), env=dict(os.environ))
    assert rank.wait() == 75
    rank.stop()  # its pid may be another process's by now: no signal, no wait
    assert rank.proc.returncode == 75


def test_only_the_cleaners_state_api_warning_is_dropped():
    """`quiet_ray_train` (every Ray worker's set-up hook) drops the placement-group cleaner's
    once-a-second warning; its other warnings and other loggers' lines stay."""
    import logging

    from pretrain.ray_train import CLEANER_LOGGER, quiet_ray_train

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    cleaner, other = logging.getLogger(CLEANER_LOGGER), logging.getLogger("ray.train.other")
    keep = Keep()
    for logger in (cleaner, other):
        logger.addHandler(keep)
    try:
        quiet_ray_train()
        quiet_ray_train()  # a second call adds no second filter
        cleaner.warning("Failed to query Ray Train Controller actor state. State API may be "
                        "temporarily unavailable. Continuing to monitor.")
        cleaner.warning("Failed to clean up placement group: boom")
        other.warning("Failed to query Ray Train Controller actor state. (another logger)")
        assert seen == ["Failed to clean up placement group: boom",
                        "Failed to query Ray Train Controller actor state. (another logger)"]
        assert len(cleaner.filters) == 1
    finally:
        for logger in (cleaner, other):
            logger.removeHandler(keep)
        cleaner.filters.clear()
