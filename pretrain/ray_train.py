"""`pretrain launch ray`: `pretrain train` as a Ray Train job (`TorchTrainer`).

Each Ray Train worker is one rank. Ray places the workers (CPUs or GPUs each), gives each its
rank, and restarts the whole worker group after a failure (`FailureConfig.max_failures`). The
worker starts `pretrain train` as a child process with the rank's environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR of rank 0's node and a port rank 0 picked, shared through Ray), the way
torchrun or srun would: `pretrain train` ends its process with `os._exit` and installs signal
handlers, neither of which a Ray worker thread can host. A restarted group resumes from the
run's newest complete checkpoint on whatever worker count comes back (`pretrain train`'s resume).

The child's exit status decides: 0 done; 2 bad input: the group returns and the command exits 2
(no retry: Ray's FailureConfig cannot tell errors apart); 3 (fault), 75 (saved for a requeue) or
anything else: the worker raises, and Ray restarts the group while failures remain.

When Ray stops a worker group (a restart after a failure, or the job ending), it asks each worker
to shut down and kills it 5 s later (Ray Train 2.60's patience); a child that got only the
SIGTERM its dead parent leaves it would go on holding its GPU while the group restarts. So each
worker's shutdown hook (`StopRank`, Ray Train's worker callback) stops its child and every process
group below it (`launchers.local.stop_run`: SIGTERM, SIGKILL after `STOP_GRACE_S`), and returns once
the child is reaped, before Ray's kill.

Which Ray: `--address` (`auto`: the cluster running on this host), else $RAY_ADDRESS, else a Ray
started for the job (`ray.init(address="local")`; a bare `ray.init()` would join whichever cluster
was started last on the host).

Ray Train's placement-group cleaner polls the controller's state through Ray's state API every
second; without Ray's dashboard, which serves that API (not installed with `ray[train]`, and off
here), each poll warns "Failed to query Ray Train Controller actor state": `quiet_ray_train`, run
in every Ray worker process, drops that one message of that one logger.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from pretrain import storage
from pretrain.errors import EXIT_OK, EXIT_USER_ERROR, ConfigError
from pretrain.launchers.local import child_env, die_with_parent, stop_run
from pretrain.mounts import node_local_scratch

# Seconds between a stopped rank's SIGTERM and its SIGKILL: inside the 5 s Ray Train gives a
# worker between asking it to shut down and killing it, so the child is gone before its worker
STOP_GRACE_S = 4.0
# The logger and message of Ray Train's placement-group cleaner polling an unavailable state API
CLEANER_LOGGER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"
CLEANER_NOISE = "Failed to query Ray Train Controller actor state"


@dataclass
class RayJob:
    train_args: list[str]  # `pretrain train` arguments
    num_workers: int
    cpus_per_worker: float | None = None
    gpus_per_worker: float | None = None
    address: str | None = None  # a cluster to join (ray://..., host:port, auto); None: local Ray
    max_failures: int = 3
    storage_path: str | None = None  # Ray Train's own records (default <run_dir>/ray)

    def check(self) -> None:
        if self.num_workers < 1:
            raise ConfigError(f"--num-workers {self.num_workers}: need >= 1")
        if self.max_failures < -1:
            raise ConfigError(f"--max-failures {self.max_failures}: need >= 0 (-1: no limit)")


class RankFailed(RuntimeError):
    """A rank's `pretrain train` exited 3, 75 or otherwise non-zero: Ray restarts the group."""


def ray_address(address: str | None, env: Mapping[str, str]) -> str:
    """The `ray.init` address of a job: `--address` (`auto`: the cluster running on this host),
    else $RAY_ADDRESS, else `local`: a Ray started for the job."""
    return address or env.get("RAY_ADDRESS") or "local"


class RankProcess:
    """This worker's `pretrain train`: started in a session of its own (a signal to the worker's
    process group does not reach it), SIGTERM to it when the worker dies, and stopped with every
    process group below it by `stop`."""

    _running: set[RankProcess] = set()  # this worker process's ranks, for its shutdown hook
    _lock = threading.Lock()

    def __init__(self, command: list[str], *, cwd: str, env: dict[str, str],
                 grace_s: float = STOP_GRACE_S):
        self.grace_s = grace_s
        self.proc = subprocess.Popen(command, cwd=cwd, env=env, start_new_session=True,
                                     preexec_fn=die_with_parent)
        with self._lock:
            self._running.add(self)

    def wait(self) -> int:
        """The child's exit status (negative: the signal that ended it)."""
        try:
            return self.proc.wait()
        finally:
            with self._lock:
                self._running.discard(self)

    def stop(self) -> None:
        """SIGTERM to the child's process groups, SIGKILL after the grace; returns once the child
        is reaped (at once when it had exited)."""
        if self.proc.poll() is not None:
            return  # reaped: its pid, and the process group it led, may be another's by now
        print(f"[ray] stopping pretrain train (pid {self.proc.pid}): SIGTERM, SIGKILL after "
              f"{self.grace_s:g} s", file=sys.stderr, flush=True)
        stop_run(self.proc, grace_s=self.grace_s)

    @classmethod
    def stop_all(cls) -> None:
        """Stop every rank this worker process started (Ray is stopping the worker group)."""
        with cls._lock:
            running = list(cls._running)
        for rank in running:
            rank.stop()


def stop_on_shutdown():
    """A Ray Train worker callback whose `before_worker_shutdown` stops the worker's ranks (the
    class needs Ray Train, an optional dependency: made when asked for)."""
    from ray.train.v2._internal.execution.callback import WorkerCallback

    class StopRank(WorkerCallback):
        def before_worker_shutdown(self) -> None:
            RankProcess.stop_all()

    return StopRank()


class _DropCleanerNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(CLEANER_NOISE)


def quiet_ray_train() -> None:
    """Every Ray worker process's set-up hook: the placement-group cleaner's warning that Ray's
    state API is unavailable (once a second without the dashboard) is dropped; its other lines,
    and every other logger's, are kept."""
    logger = logging.getLogger(CLEANER_LOGGER)
    if not any(isinstance(f, _DropCleanerNoise) for f in logger.filters):
        logger.addFilter(_DropCleanerNoise())


def run_rank(config: dict) -> None:
    """The Ray Train worker: this rank's `pretrain train`, as a child process."""
    import ray.train
    from ray.train.collective import broadcast_from_rank_zero
    from ray.util import get_node_ip_address

    from pretrain.dist import free_port

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    master = broadcast_from_rank_zero((get_node_ip_address(), free_port()) if rank == 0 else None)
    env = {**child_env(), "RANK": str(rank), "WORLD_SIZE": str(ctx.get_world_size()),
           "LOCAL_RANK": str(ctx.get_local_rank()),
           "LOCAL_WORLD_SIZE": str(ctx.get_local_world_size()),
           "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]),
           "DS_ACCELERATOR": "cuda" if config["gpus"] else "cpu",
           "PRETRAIN_LAUNCHER": "ray"}  # the launcher metrics.jsonl names
    if not config["gpus"]:
        env.setdefault("OMP_NUM_THREADS", str(max(1, int(config["cpus"] or 1))))
    child = RankProcess([sys.executable, "-u", "-m", "pretrain", "train", *config["argv"]],
                        cwd=config["cwd"], env=env)
    try:
        status = child.wait()
    finally:
        child.stop()  # a no-op once it exited; else (this thread raised) it must not outlive us
    if rank == 0:  # for the driver: Ray Train keeps no worker's return value or metrics
        write_status(config["status_file"], status)
    if status not in (EXIT_OK, EXIT_USER_ERROR):
        raise RankFailed(f"rank {rank}: pretrain train exited {status}")


def write_status(where: str, status: int) -> None:
    """Rank 0's exit status where the driver reads it (`read_status`): a file on the run's
    file system, or an object beside a run directory in the store."""
    if storage.is_remote(where):
        storage.put_text(where, f"{status}\n")
    else:
        Path(where).write_text(f"{status}\n")


def read_status(where: str) -> int | None:
    """The status `write_status` left, None when there is none (no rank 0 finished)."""
    if storage.is_remote(where):
        return int(storage.read_bytes(where)) if storage.size(where) is not None else None
    return int(Path(where).read_text()) if Path(where).exists() else None


def status_place(job: RayJob, run_dir: str) -> tuple[Path, str]:
    """Ray Train's storage folder and where rank 0's status goes. A run directory in the store
    has no shared file system: Ray's records stay on the driver's node (the run's state is in
    the store; Ray Train reports no checkpoint of its own) and the status is an object of the
    run, `<run_dir>/ray/exit_status`."""
    if storage.is_remote(run_dir):
        storage_path = Path(job.storage_path or node_local_scratch() / "pretrain-ray").resolve()
        return storage_path, storage.join(run_dir, "ray", "exit_status")
    storage_path = Path(job.storage_path or Path(run_dir) / "ray").resolve()
    return storage_path, str(storage_path / "exit_status")  # on the run's file system


def fit(job: RayJob, *, run_dir: str) -> int:
    """Run the job on Ray; the command's exit status (0, or 2 for bad input; a group that failed
    more than max_failures times raises Ray's TrainingFailedError)."""
    job.check()
    try:
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer
    except ImportError as exc:
        raise ConfigError(f"pretrain launch ray needs Ray Train ({exc}): pip install -c "
                          "launch/constraints.txt -e '.[ray]'") from None
    if not ray.is_initialized():
        runtime_env: dict = {"worker_process_setup_hook": f"{__name__}.quiet_ray_train"}
        if os.environ.get("PYTHONPATH"):
            runtime_env["env_vars"] = {"PYTHONPATH": os.environ["PYTHONPATH"]}
        ray.init(address=ray_address(job.address, os.environ), include_dashboard=False,
                 runtime_env=runtime_env)
    per_worker = ({"GPU": job.gpus_per_worker} if job.gpus_per_worker else {}) | (
        {"CPU": job.cpus_per_worker} if job.cpus_per_worker else {})
    storage_path, status_file = status_place(job, run_dir)
    storage_path.mkdir(parents=True, exist_ok=True)
    if storage.is_remote(status_file):
        storage.remove(status_file)
    else:
        Path(status_file).unlink(missing_ok=True)
    trainer = TorchTrainer(
        run_rank,
        train_loop_config={"argv": job.train_args, "gpus": job.gpus_per_worker or 0,
                           "cpus": job.cpus_per_worker, "cwd": os.getcwd(),
                           "status_file": status_file},
        scaling_config=ScalingConfig(num_workers=job.num_workers,
                                     use_gpu=bool(job.gpus_per_worker),
                                     resources_per_worker=per_worker or None),
        run_config=RunConfig(name=run_dir.rstrip("/").rsplit("/", 1)[-1],
                             storage_path=str(storage_path),
                             failure_config=FailureConfig(max_failures=job.max_failures),
                             callbacks=[stop_on_shutdown()]))
    trainer.fit()  # raises TrainingFailedError once max_failures restarts failed too
    status = read_status(status_file)
    return EXIT_OK if status is None else status
