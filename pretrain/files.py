"""Writing files so that a crash never leaves half of one, and recording what wrote them.

The bottom layer of the package (no torch, nothing of ours but the standard library):

- `atomic_file(path)`: a binary file written under a unique temporary name beside `path` and
  renamed over it only when the block succeeds,
- `write_text_atomic(path, text)`: the same for a small text file, synced to disk first (the
  `latest` pointer, manifests, `stopped.json`),
- `atomic_directory(path)`: a directory filled under a temporary name and swapped in whole
  (`final/`, a converted or exported checkpoint),
- `git_commit()`: the commit of the code that is running, marked when the checkout has
  uncommitted changes (recorded in checkpoints and Slurm job records).

Every writer of the package goes through these: a reader sees the old file or the new one, never
a mixture, and concurrent writers of the same path (several ranks building one cache) never
collide because each writes its own temporary name.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

_PACKAGE_ROOT = Path(__file__).resolve().parent


@contextmanager
def atomic_file(path: str | Path) -> Iterator[BinaryIO]:
    """Write to a unique temporary file beside `path`, renamed over `path` only on success.

    Unlike `tempfile`, the file gets the usual permissions (umask).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") as out:
            yield out
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    """Replace `path` with `text`, flushed and synced first: readers see the old or the new file."""
    with atomic_file(path) as out:
        out.write(text.encode())
        out.flush()
        os.fsync(out.fileno())


@contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield an empty temporary directory beside `path`; on success it replaces `path` whole.

    An existing `path` is removed only after the new contents are complete; on an exception the
    temporary directory is removed and `path` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    tmp.mkdir()  # the usual permissions (umask), unlike tempfile.mkdtemp's 0700
    try:
        yield tmp
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def git_commit(root: str | Path = _PACKAGE_ROOT) -> str:
    """The commit checked out at `root` (default: this package's checkout), with
    " (with uncommitted changes)" appended when tracked files differ from it;
    "unknown (not a git checkout)" outside one."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return head + (" (with uncommitted changes)" if dirty else "")
