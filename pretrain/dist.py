"""Process environment: who am I, under which launcher, and the process group.

`pretrain train` runs under the `deepspeed` launcher, `torchrun`, Slurm's `srun`, or as a plain
single process. Each launcher describes the world differently; `discover_world` maps them all to
the torch.distributed variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) before DeepSpeed looks at them. Without these `deepspeed.init_distributed` falls
back to discovering them through MPI (mpi4py), so a plain process gets a world of one on a free
local port.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Iterator, NoReturn
from unittest import mock

import torch


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str  # deepspeed | torchrun | slurm | single

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slurm_master_addr() -> str:
    nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "")
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True,
                             text=True, check=True, timeout=30).stdout.split()
        return out[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "127.0.0.1"


def discover_world() -> World:
    """Read the launcher's environment and export the torch.distributed variables."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:  # deepspeed launcher or torchrun (or set by hand)
        # `pretrain launch ray` names itself; the deepspeed launcher sets nothing to tell it by
        launcher = ("torchrun" if "TORCHELASTIC_RUN_ID" in env
                    else env.get("PRETRAIN_LAUNCHER", "deepspeed"))
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:  # srun, one task per device
        launcher = "slurm"
        env["RANK"] = env["SLURM_PROCID"]
        env["WORLD_SIZE"] = env["SLURM_NTASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        env.setdefault("LOCAL_WORLD_SIZE", env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])
        env.setdefault("MASTER_ADDR", _slurm_master_addr())
        env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    else:
        launcher = "single"
        env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"] = "0", "1", "0"
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(free_port()))
    env.setdefault("LOCAL_RANK", "0")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    local_world = int(env.get("LOCAL_WORLD_SIZE", "0")) or _guess_local_world(int(env["WORLD_SIZE"]))
    env["LOCAL_WORLD_SIZE"] = str(local_world)
    return World(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                 local_rank=int(env["LOCAL_RANK"]), local_world_size=local_world,
                 launcher=launcher)


def _guess_local_world(world_size: int) -> int:
    # The deepspeed launcher does not export LOCAL_WORLD_SIZE; CROSS_SIZE is its node count.
    nodes = int(os.environ.get("CROSS_SIZE", "1")) or 1
    return max(1, world_size // nodes)


def set_cpu_threads(world: World) -> int:
    """Give each rank its share of the cores unless the user or launcher chose already.

    Oversubscribed intra-op threads made a 2-rank training loop 2x slower on a 2-core machine.
    """
    if "OMP_NUM_THREADS" in os.environ:
        threads = int(os.environ["OMP_NUM_THREADS"])
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        # A launcher that bound this rank to its cores (--bind_cores_to_rank) already shrank
        # the affinity mask; otherwise split the node's cores between its ranks.
        total = os.cpu_count() or 1
        threads = cores if cores < total else max(1, total // world.local_world_size)
    torch.set_num_threads(max(1, threads))
    return torch.get_num_threads()


def device_index(local_rank: int, visible_devices: int) -> int:
    """This rank's device among those it sees: its local rank when the task sees every GPU of
    the node, 0 when Slurm binds one GPU per task (--gpus-per-task=1, --gpu-bind) and the task
    sees only its own."""
    if visible_devices < 1:
        raise RuntimeError(f"local rank {local_rank} sees no accelerator device")
    return local_rank % visible_devices


def init_deepspeed_comm(**kwargs) -> None:
    """`deepspeed.init_distributed(**kwargs)`: DeepSpeed's comm layer over the process group
    (made here, or the one the caller made). On CPU accelerators it comes without the
    shared-memory all-reduce op DeepSpeed would compile (`pretrain.training.deepspeed_imports`)."""
    import deepspeed

    deepspeed.init_distributed(**kwargs)


def init_distributed(world: World, *, timeout_minutes: float = 30.0,
                     io_timeout_minutes: float = 120.0) -> None:
    """Create the default process group through DeepSpeed (NCCL on GPUs, gloo/ccl on CPU), and
    the CPU group `wait_for_io` waits on, whose timeout is `io_timeout_minutes`."""
    # DeepSpeed is imported here, not at the top: launch scripts and tests import this module
    # for `free_port` and must not pay DeepSpeed's start-up
    from deepspeed.accelerator import get_accelerator

    if torch.distributed.is_initialized():
        return
    accel = get_accelerator()
    if accel.device_name() != "cpu":
        accel.set_device(device_index(world.local_rank, accel.device_count()))
    init_deepspeed_comm(dist_backend=accel.communication_backend_name(),
                        timeout=datetime.timedelta(minutes=timeout_minutes), verbose=False)
    create_io_group(timeout_minutes=io_timeout_minutes)


_IO_GROUP = None  # gloo, over every rank: see wait_for_io


def create_io_group(*, timeout_minutes: float) -> None:
    """The group `wait_for_io` waits on (collective: every rank calls it once)."""
    global _IO_GROUP
    _IO_GROUP = torch.distributed.new_group(
        backend="gloo", timeout=datetime.timedelta(minutes=timeout_minutes))


def _timeout_minutes(group) -> float | None:
    """The timeout a process group was built with, read back from its CPU backend (gloo keeps
    it in its options); None where the backend does not say."""
    try:
        backend = group._get_backend(torch.device("cpu"))
        return backend.options._timeout.total_seconds() / 60.0
    except (AttributeError, RuntimeError):
        return None


def group_timeouts() -> dict[str, float | None]:
    """{"collectives": the default group's timeout, "io": the I/O group's}, in minutes, as the
    groups were built (the run record shows them: a setting lost on its way is seen there)."""
    default = torch.distributed.distributed_c10d._get_default_group()
    return {"collectives": _timeout_minutes(default),
            "io": _timeout_minutes(_IO_GROUP) if _IO_GROUP is not None else None}


def _io_group():
    """The I/O group; an error, not the default group, when it was never created: the default
    group's timeout (NCCL's watchdog) would abort a long wait for one rank's file work."""
    if _IO_GROUP is None:
        raise RuntimeError("no I/O process group on this rank: call pretrain.dist.create_io_group "
                           "on every rank after the default group (init_distributed does)")
    return _IO_GROUP


def _several_ranks() -> bool:
    return torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def wait_for_io() -> None:
    """A barrier for the ranks waiting on one rank's file work (sample indices, a checkpoint's
    manifest and pruning, the final weights): on a CPU group whose timeout is
    train.io_timeout_minutes, not the collectives' (NCCL's watchdog would abort a long wait)."""
    if _several_ranks():
        torch.distributed.barrier(group=_io_group())


@contextlib.contextmanager
def barriers_for_io() -> Iterator[None]:
    """Within the block, DeepSpeed's barriers over every rank are `wait_for_io`'s: a save's
    barriers (`engine.save_checkpoint` meets at one once each rank has written its files) wait
    for the slowest rank's file work, which may outlast the collectives' timeout."""
    import deepspeed.comm

    collective_barrier = deepspeed.comm.barrier

    def barrier(group=None, *args, **kwargs):
        if group is None and _IO_GROUP is not None:
            return torch.distributed.barrier(group=_IO_GROUP)
        return collective_barrier(group, *args, **kwargs)

    with mock.patch.object(deepspeed.comm, "barrier", barrier):
        yield


def gather_for_io(value: Any) -> list[Any]:
    """Every rank's `value` (a small picklable object), in rank order, on every rank: a
    `wait_for_io` that also tells each rank what the others report (a checkpoint's files)."""
    if not _several_ranks():
        return [value]
    values: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(values, value, group=_io_group())
    return values


def same_on_every_rank(value: int) -> bool:
    """Whether every rank passed the same integer (collective, on the CPU group)."""
    if not _several_ranks():
        return True
    both = torch.tensor([value, -value], dtype=torch.int64)
    torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX, group=_io_group())
    return int(both[0]) == -int(both[1])  # the largest value is the smallest


def any_rank(flag: bool) -> bool:
    """Whether `flag` is true on any rank (collective, on the CPU group: no device sync)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return flag
    value = torch.tensor([float(flag)])
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX, group=_IO_GROUP)
    return bool(value.item())


def exit_distributed(code: int) -> NoReturn:
    """Wait for every rank, flush, and end the process with `code` - skipping the teardown.

    Tearing the process groups down, or leaving it to the interpreter's exit, runs the C++
    destructors of gloo's transport while its worker threads are still joinable: now and then
    a rank aborted there ("terminate called without an active exception", exit -6) after a
    complete run. Every file is written and closed by now, so nothing is lost by skipping it.
    """
    if _several_ranks():
        torch.distributed.barrier(group=_io_group())
    from pretrain.resolve.world_fit import publish_exit  # ranks left idle exit with this code too

    publish_exit(code, rank=int(os.environ.get("RANK", "0")))
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
