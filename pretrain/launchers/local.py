"""The launchers of this machine (`LAUNCHERS`, one command each: `launcher_command`), and
`pretrain train` runs started through them by another command (`pretrain sweep`, `pretrain
tune`, a Ray worker, the tests) as child processes, stopped again with every process they started.

A child run lives in a session (and process group) of its own, so Ctrl-C at the terminal reaches
only the command that started it, which then stops the run itself (`stop_run`). The launcher is
asked to die with its parent (Linux's PR_SET_PDEATHSIG, SIGTERM): when that command is killed with
SIGKILL and cannot stop the run, the launcher still gets SIGTERM and ends its ranks (a rank
saves a checkpoint and exits 75, see `pretrain.training.faults`). torchrun starts each rank in a session of
its own, out of reach of a signal to the launcher's group: `process_groups` follows /proc from the
launcher down to find them.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

from pretrain.errors import ConfigError

# Seconds a stopped run has between SIGTERM and SIGKILL: its ranks finish the step in flight, save
# a checkpoint and exit (torchrun waits up to 30 s for them); a rank stuck in a collective does not.
STOP_GRACE_S = 30.0
LAUNCHERS = ("torchrun", "deepspeed", "single")
_PR_SET_PDEATHSIG = 1


def launcher_command(launcher: str, nprocs: int) -> list[str]:
    """The command that starts `pretrain` on `nprocs` ranks of this machine through `launcher`,
    one of `LAUNCHERS`, each with a free port of its own."""
    from pretrain.dist import free_port

    if launcher not in LAUNCHERS:
        raise ConfigError(f"launcher {launcher!r}: one of {', '.join(LAUNCHERS)}")
    if launcher == "single":
        if nprocs != 1:
            raise ConfigError(f"--launcher single runs one process, got --nprocs {nprocs}: "
                              "use torchrun or deepspeed")
        return [sys.executable, "-m", "pretrain"]
    port = str(free_port())  # concurrent runs must not share the default port 29500
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nprocs),
                "--master_port", port, "-m", "pretrain"]
    return [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(nprocs),
            "--master_port", port, "--no_local_rank", "--module", "pretrain"]


def child_env() -> dict[str, str]:
    """This process's environment for a child run: unbuffered, and without the rank variables of
    a launcher that started us, or of the Slurm task we run in (`dist.discover_world` would take
    a one-process run for a rank of the job): each run is its own job, not a rank of ours."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
                "SLURM_NTASKS", "SLURM_LOCALID"):
        env.pop(var, None)
    return env


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send `sig` to this process when its parent exits (a no-op elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def start_run(command: list[str], *, log: IO[str], env: dict[str, str]) -> subprocess.Popen:
    """`command` in a session of its own, its output in `log`, SIGTERM to it when we die."""
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, preexec_fn=die_with_parent)


def process_groups(pid: int) -> set[int]:
    """The process groups of `pid` and of every process below it. Reads /proc (Linux)."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):  # no procfs: the launcher's group only
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses
                    ppid = int(Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue  # exited meanwhile
                children.setdefault(ppid, []).append(int(entry.name))
    groups, todo = set(), [pid]
    while todo:
        current = todo.pop()
        todo += children.get(current, [])
        with contextlib.suppress(ProcessLookupError):
            groups.add(os.getpgid(current))
    return groups


def signal_groups(groups: set[int], sig: signal.Signals) -> None:
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # gone already
            os.killpg(group, sig)


@contextlib.contextmanager
def sigterm_raises():
    """SIGTERM to this command raises SystemExit (status 143), so the run it started is stopped
    on the way out instead of being left running in its own session."""
    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop_run(proc: subprocess.Popen, *, grace_s: float) -> None:
    """SIGTERM to the run's process groups (the launcher's and each rank's), SIGKILL to whatever
    is left of them after `grace_s` or once the launcher has exited; returns once it is reaped."""
    groups = process_groups(proc.pid) | {proc.pid}
    signal_groups(groups, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        groups |= process_groups(proc.pid)  # ranks started since the SIGTERM
    signal_groups(groups, signal.SIGKILL)
    proc.wait()
