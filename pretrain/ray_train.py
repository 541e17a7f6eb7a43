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
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from pretrain.child_runs import child_env, die_with_parent
from pretrain.errors import EXIT_OK, EXIT_USER_ERROR, ConfigError


@dataclass
class RayJob:
    train_args: list[str]  # `pretrain train` arguments
    num_workers: int
    cpus_per_worker: float | None = None
    gpus_per_worker: float | None = None
    address: str | None = None  # an existing cluster (ray://... or host:port); None: local Ray
    max_failures: int = 3
    storage_path: str | None = None  # Ray Train's own records (default <run_dir>/ray)

    def check(self) -> None:
        if self.num_workers < 1:
            raise ConfigError(f"--num-workers {self.num_workers}: need >= 1")
        if self.max_failures < -1:
            raise ConfigError(f"--max-failures {self.max_failures}: need >= 0 (-1: no limit)")


class RankFailed(RuntimeError):
    """A rank's `pretrain train` exited 3, 75 or otherwise non-zero: Ray restarts the group."""


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
    proc = subprocess.Popen([sys.executable, "-u", "-m", "pretrain", "train", *config["argv"]],
                            cwd=config["cwd"], env=env, preexec_fn=die_with_parent)
    try:
        status = proc.wait()
    finally:
        if proc.poll() is None:  # Ray is tearing the group down: let the rank save and exit
            proc.terminate()
            proc.wait()
    if rank == 0:  # for the driver: Ray Train keeps no worker's return value or metrics
        Path(config["status_file"]).write_text(f"{status}\n")
    if status not in (EXIT_OK, EXIT_USER_ERROR):
        raise RankFailed(f"rank {rank}: pretrain train exited {status}")


def fit(job: RayJob, *, run_dir: Path) -> int:
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
        ray.init(address=job.address, include_dashboard=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}}
                 if os.environ.get("PYTHONPATH") else None)
    per_worker = ({"GPU": job.gpus_per_worker} if job.gpus_per_worker else {}) | (
        {"CPU": job.cpus_per_worker} if job.cpus_per_worker else {})
    storage = Path(job.storage_path or run_dir / "ray").resolve()
    status_file = storage / "exit_status"  # on the run's file system, which every node sees
    storage.mkdir(parents=True, exist_ok=True)
    status_file.unlink(missing_ok=True)
    trainer = TorchTrainer(
        run_rank,
        train_loop_config={"argv": job.train_args, "gpus": job.gpus_per_worker or 0,
                           "cpus": job.cpus_per_worker, "cwd": os.getcwd(),
                           "status_file": str(status_file)},
        scaling_config=ScalingConfig(num_workers=job.num_workers,
                                     use_gpu=bool(job.gpus_per_worker),
                                     resources_per_worker=per_worker or None),
        run_config=RunConfig(name=run_dir.name, storage_path=str(storage),
                             failure_config=FailureConfig(max_failures=job.max_failures)))
    trainer.fit()  # raises TrainingFailedError once max_failures restarts failed too
    return int(status_file.read_text()) if status_file.exists() else EXIT_OK
