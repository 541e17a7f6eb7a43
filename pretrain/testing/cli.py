"""`pretrain ...` as a test runs it, without a new interpreter's start-up per process.

`python -m pretrain plan ...` in a subprocess spends most of its seconds importing torch and
DeepSpeed before it plans anything, and every rank of a training run pays the same again; the
suite starts hundreds of them. Here each process is forked from the fork server `run_on_ranks`
starts (torch and DeepSpeed imported once, no thread pool started) and runs `python -m pretrain`'s
module with its own working directory, environment, file descriptors 1 and 2 and exit status, as a
subprocess has, so that nothing a command sets (log level, warning filters, environment) reaches
the test or the next call:

- `run_cli`: one `pretrain ...` process;
- `run_ranks`: `pretrain train ...` on N local ranks with the environment the `deepspeed`
  launcher gives its ranks (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, CROSS_*), one thread
  each; when a rank fails the others get a grace period to end by themselves (a check that
  fails on every rank lets rank 0 print its error line; torchrun and the `deepspeed` launcher
  end them at once), then are ended; the first failure's status is the run's.

Tests of what a fresh interpreter or a launcher does (start-up, imports, torchrun's restarts,
signals through `deepspeed` or srun) name their launcher and keep using subprocesses.
"""
from __future__ import annotations

import atexit
import importlib.util
import multiprocessing
import multiprocessing.connection
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from pretrain.testing.ranks import PRELOAD


def _main(argv: list[str], cwd: str, environ: dict[str, str], out: str, err: str) -> None:
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    for fd, path in ((1, out), (2, err)):  # C-level writes too, as a subprocess's pipes take them
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND), fd)
    for stream in (sys.stdout, sys.stderr):  # written as it happens, as PYTHONUNBUFFERED=1 does
        stream.reconfigure(line_buffering=True, write_through=True)
    sys.argv = ["pretrain", *argv]
    _start_as_an_interpreter_would(environ)
    code = 0
    try:  # what `python -m pretrain` runs
        runpy.run_module("pretrain", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # an interpreter's exit runs them; a multiprocessing child's does not
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _start_as_an_interpreter_would(environ: dict[str, str]) -> None:
    """What a new interpreter takes from PYTHONPATH: its folders first on `sys.path`, and the
    first `sitecustomize.py` among them run (how `pretrain.testing.faults` reaches a run)."""
    folders = [f for f in environ.get("PYTHONPATH", "").split(os.pathsep) if f]
    sys.path[:0] = [f for f in folders if f not in sys.path]
    for folder in folders:
        site = Path(folder, "sitecustomize.py")
        if site.is_file():
            spec = importlib.util.spec_from_file_location("sitecustomize", site)
            module = importlib.util.module_from_spec(spec)
            sys.modules["sitecustomize"] = module
            spec.loader.exec_module(module)
            return


def _process(ctx, argv: list[str], cwd, environ: dict[str, str], out: Path, err: Path):
    return ctx.Process(target=_main, args=([str(a) for a in argv], str(cwd), environ, str(out),
                                           str(err)))


def _forkserver():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # the server run_on_ranks uses (read when it starts)
    return ctx


def run_cli(args: list[str], *, cwd: str | Path, env: dict[str, str] | None = None,
                 timeout: float = 120.0) -> subprocess.CompletedProcess:
    """`pretrain *args` in `cwd` with `env` (default: this process's environment), its output
    and status as `subprocess.run(..., capture_output=True, text=True)` returns them."""
    with tempfile.TemporaryDirectory(prefix="pretrain-cli-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        out.touch()
        err.touch()
        proc = _process(_forkserver(), args, cwd, dict(os.environ if env is None else env), out,
                        err)
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(["pretrain", *args], timeout,
                                            output=out.read_text(), stderr=err.read_text())
        return subprocess.CompletedProcess(["pretrain", *args], proc.exitcode,
                                           stdout=out.read_text(), stderr=err.read_text())


def rank_environ(env: dict[str, str], *, rank: int, world_size: int, port: int) -> dict[str, str]:
    """What the `deepspeed` launcher exports to rank `rank` of `world_size` on one node."""
    return {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_SIZE": str(world_size), "CROSS_RANK": "0", "CROSS_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}


def run_ranks(args: list[str], *, nprocs: int, cwd: str | Path, env: dict[str, str],
              timeout: float = 900.0, grace_s: float = 30.0) -> subprocess.CompletedProcess:
    """`pretrain *args` on `nprocs` local ranks; their interleaved output (as a launcher passes
    it on) and the run's status: 0, or the status of the first rank that failed (the others
    get `grace_s` to end, then SIGTERM, and SIGKILL after another `grace_s`)."""
    from pretrain.dist import free_port

    port = free_port()
    ctx = _forkserver()
    with tempfile.TemporaryDirectory(prefix="pretrain-ranks-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        out.touch()
        err.touch()
        procs = [_process(ctx, args, cwd, rank_environ(env, rank=r, world_size=nprocs, port=port),
                          out, err) for r in range(nprocs)]
        for proc in procs:
            proc.start()
        status = _wait_for_ranks(procs, timeout=timeout, grace_s=grace_s)
        if status is None:
            raise subprocess.TimeoutExpired(["pretrain", *args], timeout,
                                            output=out.read_text(), stderr=err.read_text())
        return subprocess.CompletedProcess(["pretrain", *args], status, stdout=out.read_text(),
                                           stderr=err.read_text())


def _wait_for_ranks(procs, *, timeout: float, grace_s: float) -> int | None:
    """0 when every rank exits 0; the first failure's status; None after `timeout` (all killed)."""
    import time

    deadline = time.monotonic() + timeout
    running = list(procs)
    while running:
        left = deadline - time.monotonic()
        if left <= 0:
            _end(procs, signal.SIGKILL)
            return None
        done = multiprocessing.connection.wait([p.sentinel for p in running], timeout=left)
        for proc in [p for p in running if p.sentinel in done]:
            proc.join()
            running.remove(proc)
            if proc.exitcode != 0:
                # the others first get `grace_s` to end by themselves: a check that fails on
                # every rank (bad input) lets rank 0 print its error line before it is ended
                for other in running:
                    other.join(max(0.0, min(grace_s, deadline - time.monotonic())))
                _end(running, signal.SIGTERM)
                for other in running:
                    other.join(grace_s)
                _end(running, signal.SIGKILL)
                return proc.exitcode if proc.exitcode > 0 else 128 - proc.exitcode
    return 0


def _end(procs, sig: int) -> None:
    for proc in procs:
        if proc.exitcode is None:
            os.kill(proc.pid, sig)
    for proc in procs:
        if sig == signal.SIGKILL:
            proc.join()
