"""Which file system a path is on, and the node-local scratch directory of a job.

The bottom layer of the package (standard library only). Cluster jobs write three kinds of
files that should not go to the shared (network) file system, NVMe offload's swap files (many
small O_DIRECT reads and writes at every step) and DeepSpeed's compiled ops (a build lock that a
cancelled job leaves behind hangs every later job sharing the directory), and takes one lock
that must hold across nodes (`pretrain tune`'s study lock). This module answers from the
kernel's mount table (`/proc/mounts`; tests pass their own):

- `mount_of(path)`: the mount holding `path` (longest mount point that is a prefix of it),
- `network_filesystem(path)`: the type when that mount is a network or parallel file system,
- `flock_is_cluster_wide(path)`: False where `flock` locks only this node (Lustre without
  `-o flock`, NFS with `local_lock=flock|all`),
- `node_local_scratch()`: `$SLURM_TMPDIR`, else `$TMPDIR`, else `/tmp`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

# Mount types whose data lives on other machines: shared by the nodes of a cluster, slower per
# operation than a local disk, some without O_DIRECT or cluster-wide flock.
NETWORK_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "smbfs", "ceph", "cephfs",
    "fuse.cephfs", "glusterfs", "fuse.glusterfs", "panfs", "wekafs", "orangefs", "pvfs2",
    "fuse.sshfs", "9p", "afs", "ocfs2", "gfs2", "fuse.juicefs", "fuse.s3fs",
})
MOUNTS_FILE = "/proc/mounts"


class Mount(NamedTuple):
    point: str
    fstype: str
    options: frozenset[str]


def read_mounts(text: str | None = None) -> list[Mount]:
    """The mount table: `text` in /proc/mounts format, else this machine's ([] where there is
    none, e.g. macOS)."""
    if text is None:
        try:
            text = Path(MOUNTS_FILE).read_text()
        except OSError:
            return []
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 4:  # device, mount point (spaces escaped as \040), type, options
            point = fields[1].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
            mounts.append(Mount(point, fields[2], frozenset(fields[3].split(","))))
    return mounts


def mount_of(path: str | Path, mounts: list[Mount] | None = None) -> Mount | None:
    """The mount `path` is on (it need not exist yet: its nearest existing parent's), or None
    where the table is unknown."""
    mounts = read_mounts() if mounts is None else mounts
    target = _existing_real_path(Path(path))
    best = None
    for mount in mounts:  # the last of equal mount points wins: it is mounted over the others
        point = Path(mount.point)
        if (target == point or point in target.parents) and \
                (best is None or len(point.parts) >= len(Path(best.point).parts)):
            best = mount
    return best


def _existing_real_path(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate.resolve() / path.relative_to(candidate)
    return path


def network_filesystem(path: str | Path, mounts: list[Mount] | None = None) -> str | None:
    """The file system type of `path` when it is a network or parallel one (nfs4, lustre, ...),
    else None."""
    mount = mount_of(path, mounts)
    return mount.fstype if mount is not None and mount.fstype in NETWORK_FILESYSTEMS else None


def flock_is_cluster_wide(path: str | Path, mounts: list[Mount] | None = None) -> bool:
    """Whether `flock` on `path` excludes processes on other nodes. Lustre gives it only when
    mounted with `-o flock` (`localflock` locks one node; by default flock fails with ENOSYS);
    NFS with `local_lock=flock` or `local_lock=all` keeps it on the node."""
    mount = mount_of(path, mounts)
    if mount is None:
        return True
    if mount.fstype == "lustre":
        return "flock" in mount.options
    if mount.fstype in ("nfs", "nfs4"):
        return not {"local_lock=flock", "local_lock=all"} & mount.options
    return True


def node_local_scratch(env: dict[str, str] | None = None) -> Path:
    """This node's scratch directory: `$SLURM_TMPDIR` (sites that give each job one), else
    `$TMPDIR`, else /tmp."""
    env = os.environ if env is None else env
    return Path(env.get("SLURM_TMPDIR") or env.get("TMPDIR") or "/tmp")
