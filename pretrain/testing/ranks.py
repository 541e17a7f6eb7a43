"""Run a test function on N ranks: processes on this machine, gloo, no TCP ports.

    results = run_on_ranks(check_something, world_size=4, tmp_path=tmp_path, args=(2,))

calls ``check_something(rank, world_size, 2)`` in 4 spawned processes that share a default
process group, and returns the 4 return values in rank order. The rendezvous is a file under
`tmp_path` (``init_method="file://..."``), so tests running in parallel never clash on a port.
An exception or failed assertion in any rank fails the caller with that rank's traceback
(`torch.multiprocessing.start_processes` then terminates the other ranks), and a rank stuck in a
collective fails after `timeout_s` (gloo's timeout) instead of hanging the test run.

The function must be importable by name (defined at module level of a test module): the ranks
are forked from a fork server, not from the test process. The server imports torch, DeepSpeed and
the stack once per test process (`PRELOAD`), so a rank starts in a fraction of a second instead of
importing them again (about 7 s per rank on a 2-core AMD EPYC). A rank runs with the caller's
environment as it is at the call (not the server's), and on one thread: several ranks share few
cores.
"""
from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import os
import sys
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from pretrain.dist import create_io_group


# What the fork server imports once; a rank imports the rest (its test module) itself.
PRELOAD = ["pretrain.testing.ranks", "deepspeed", "pretrain.training.engine", "pretrain.model"]


def _rank_main(rank: int, fn: Callable, world_size: int, init_file: str, result_dir: str,
               timeout_s: float, args: tuple, environ: dict[str, str]) -> None:
    os.environ.clear()  # the caller's environment at the call, not the fork server's
    os.environ.update(environ)
    torch.set_num_threads(1)
    faulthandler.enable(all_threads=True)  # a C++ abort in a rank prints every thread's stack
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # deepspeed.init_distributed and the engine read these; the rendezvous itself is the file
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        create_io_group(timeout_minutes=timeout_s / 60)  # as init_distributed makes it
        result = fn(rank, world_size, *args)
        torch.save(result, Path(result_dir) / f"rank{rank}.pt")
        dist.barrier()  # nobody leaves while a peer still uses the group
    except BaseException:
        # time-stamped, so the caller can tell the first failure from its peers' consequences
        # ("connection closed by peer" in every rank that waited for the failed one)
        (Path(result_dir) / f"rank{rank}.error").write_text(
            f"{time.time():.6f}\n{traceback.format_exc()}")
        raise
    # Done: leave without the interpreter's teardown. Process groups that DeepSpeed or the test
    # made (and a background writer's pool) are still alive; tearing them down at exit has
    # aborted a rank ("terminate called without an active exception") after its result was
    # saved, which the caller would take for a failure of the code under test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class RankFailed(AssertionError):
    """A rank raised; the message holds every failed rank's traceback, earliest first."""


def run_on_ranks(fn: Callable[..., Any], *, world_size: int, tmp_path: Path, args: tuple = (),
                 timeout_s: float = 120.0, start_method: str = "forkserver") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on `world_size` gloo ranks; their results by rank.
    `start_method="spawn"`: fresh interpreters, for a test that measures a rank's memory (a
    forked rank starts with the server's heap) or sets what a process reads only when it starts
    (glibc's `MALLOC_*`)."""
    run_dir = Path(tmp_path) / f"ranks-{uuid.uuid4().hex[:8]}"
    run_dir.mkdir(parents=True)
    init_file = run_dir / "rendezvous"  # must not exist yet: the ranks create it
    try:
        if start_method == "forkserver":  # the preload list is read when the server starts
            multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
        mp.start_processes(_rank_main, args=(fn, world_size, str(init_file), str(run_dir),
                                             timeout_s, args, dict(os.environ)),
                           nprocs=world_size, join=True, start_method=start_method)
    except ProcessException as exc:
        failures = []
        for path in run_dir.glob("rank*.error"):
            stamp, _, trace = path.read_text().partition("\n")
            failures.append((float(stamp), path.stem, trace))
        if not failures:  # killed without a Python exception (signal, OOM)
            raise
        failures.sort()
        report = "\n".join(f"---- {name} (failure {i + 1} of {len(failures)}) ----\n{trace}"
                           for i, (_, name, trace) in enumerate(failures))
        raise RankFailed(f"{fn.__name__} failed on {failures[0][1]} first:\n{report}") from exc
    return [torch.load(run_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
