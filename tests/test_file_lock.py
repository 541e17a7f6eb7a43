"""The study lock of `pretrain tune` on file systems without a cluster-wide flock, and the mount
table it decides from (a fake /proc/mounts)."""
from __future__ import annotations

import errno
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from pretrain import file_lock, mounts
from pretrain.tune.study import study_lock

MOUNTS = """\
/dev/nvme0n1p2 / ext4 rw,relatime 0 0
tmpfs /tmp tmpfs rw,nosuid,nodev 0 0
10.0.0.5@o2ib:/scratch {root}/lustre lustre rw,localflock,lazystatfs 0 0
10.0.0.6@o2ib:/projects {root}/lustre_flock lustre rw,flock,lazystatfs 0 0
nfs01:/home {root}/home nfs4 rw,relatime,vers=4.2,local_lock=none 0 0
nfs01:/apps {root}/apps nfs rw,vers=3,local_lock=all 0 0
/dev/nvme1n1 {root}/local\\040disk xfs rw,noatime 0 0
"""


@pytest.fixture
def fake_mounts(tmp_path, monkeypatch):
    table = tmp_path / "mounts"
    table.write_text(MOUNTS.format(root=tmp_path))
    monkeypatch.setattr(mounts, "MOUNTS_FILE", str(table))
    return tmp_path


def test_mount_table_names_the_file_system_of_a_path(fake_mounts):
    root = fake_mounts
    assert mounts.network_filesystem(root / "lustre" / "run" / "not_yet") == "lustre"
    assert mounts.network_filesystem(root / "home" / "me") == "nfs4"
    assert mounts.network_filesystem(root / "local disk" / "swap") is None  # \040 is a space
    assert mounts.mount_of(root / "local disk").fstype == "xfs"
    assert mounts.network_filesystem(root / "lustreX") is None  # a prefix of the name only
    assert not mounts.flock_is_cluster_wide(root / "lustre")  # localflock: one node only
    assert mounts.flock_is_cluster_wide(root / "lustre_flock")
    assert mounts.flock_is_cluster_wide(root / "home")
    assert not mounts.flock_is_cluster_wide(root / "apps")  # local_lock=all


def test_study_lock_falls_back_to_a_lock_file_where_flock_is_refused(tmp_path, monkeypatch):
    """Lustre mounted without `-o flock` answers flock with ENOSYS: the study lock is then an
    O_EXCL lock file naming this host and process, removed when the block ends."""
    def no_flock(*_):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(file_lock.fcntl, "flock", no_flock)
    settings = SimpleNamespace(study_dir=tmp_path / "study")
    owner = settings.study_dir / ".tune.lock.owner"
    with study_lock(settings):
        host, pid, _ = owner.read_text().split()
        assert (host, int(pid)) == (socket.gethostname(), file_lock.os.getpid())
    assert not owner.exists()


def test_lock_file_is_used_where_flock_locks_one_node_only(fake_mounts):
    """localflock grants flock to every node at once: the lock file must be used instead."""
    study = fake_mounts / "lustre" / "study"
    study.mkdir(parents=True)
    with file_lock.exclusive_lock(study / ".tune.lock"):
        assert (study / ".tune.lock.owner").exists()
    (fake_mounts / "lustre_flock").mkdir()
    with file_lock.exclusive_lock(fake_mounts / "lustre_flock" / ".tune.lock"):
        assert not (fake_mounts / "lustre_flock" / ".tune.lock.owner").exists()


def test_a_lock_file_of_a_dead_process_is_taken_over(tmp_path, capsys):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    path = tmp_path / "x.owner"
    path.write_text(f"{socket.gethostname()} {int(dead.stdout)} {time.time():.0f}\n")
    with file_lock.lock_file(path):
        assert path.read_text().split()[1] == str(file_lock.os.getpid())
    assert "taking over the lock of pid" in capsys.readouterr().err


def test_which_lock_files_count_as_stale():
    here, now = socket.gethostname(), time.time()
    assert not file_lock._is_stale((here, file_lock.os.getpid(), now - 1e6))  # alive: never
    assert not file_lock._is_stale(("other-node", 1, now - 10))  # another host's, recent
    assert file_lock._is_stale(("other-node", 1, now - file_lock.STALE_AFTER_S - 1))
