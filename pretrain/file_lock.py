"""An exclusive lock on a shared directory that holds across the nodes of a cluster.

`exclusive_lock(path)` takes `flock(LOCK_EX)` on `path` where that excludes other nodes. Lustre
mounted without `-o flock` refuses flock (ENOSYS), with `-o localflock` it grants it per node
only (two nodes would both hold it), and some NFS mounts behave alike (`mounts.py`). There the
lock is a lock file made with O_CREAT | O_EXCL (atomic on NFS v3+ and Lustre) beside `path`,
holding `host pid time`; a lock file left by a process that died is taken over: at once when
its host is this one and the pid is gone, after `STALE_AFTER_S` when it is another host's (the
sections this lock guards last seconds).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from pretrain.mounts import flock_is_cluster_wide

# flock's answers on a file system that has no (cluster-wide) flock
FLOCK_UNSUPPORTED = {errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL, errno.EBADF}
STALE_AFTER_S = 600.0  # a lock file of another host this old is taken over
POLL_S = 0.2
_RELEASED = ("", 0, 0.0)  # the lock file went away between the attempt and the read


@contextlib.contextmanager
def exclusive_lock(path: str | Path) -> Iterator[None]:
    """Hold an exclusive lock named `path` (created if missing) for the block, on every node
    that sees the directory."""
    path = Path(path)
    if flock_is_cluster_wide(path.parent):
        with open(path, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX)
            except OSError as error:
                if error.errno not in FLOCK_UNSUPPORTED:
                    raise
            else:
                try:
                    yield
                finally:
                    fcntl.flock(f, fcntl.LOCK_UN)
                return
    with lock_file(path.with_name(path.name + ".owner")):
        yield


@contextlib.contextmanager
def lock_file(path: Path) -> Iterator[None]:
    """The O_EXCL lock file: made by the holder, removed when the block ends."""
    announced = False
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            owner = _owner(path)
            if owner is _RELEASED:
                continue
            if owner is None or _is_stale(owner):
                print(f"[lock] {path}: taking over the lock of {_describe(owner)}, which is gone",
                      file=sys.stderr)
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                continue
            if not announced:
                print(f"[lock] {path}: waiting for {_describe(owner)}", file=sys.stderr)
                announced = True
            time.sleep(POLL_S)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{socket.gethostname()} {os.getpid()} {time.time():.0f}\n")
        break
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _owner(path: Path) -> tuple[str, int, float] | None:
    """(host, pid, time) from the lock file; None when it is unreadable or half written (its
    writer died between creating and writing it: the file's age decides then)."""
    try:
        host, pid, since = path.read_text().split()
        return host, int(pid), float(since)
    except FileNotFoundError:
        return _RELEASED
    except (OSError, ValueError):
        try:
            since = path.stat().st_mtime
        except FileNotFoundError:
            return _RELEASED
        return None if time.time() - since > STALE_AFTER_S else ("", 0, since)


def _is_stale(owner: tuple[str, int, float]) -> bool:
    host, pid, since = owner
    if host == socket.gethostname():
        return not pid_alive(pid)
    return bool(host) and time.time() - since > STALE_AFTER_S


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host exists (one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _describe(owner: tuple[str, int, float] | None) -> str:
    if owner is None or not owner[0]:
        return "a writer that did not finish its lock file"
    host, pid, since = owner
    return f"pid {pid} on {host} (since {time.strftime('%H:%M:%S', time.localtime(since))})"
