"""Where NVMe offload swaps: node-local scratch by default, never silently a network file
system (a fake /proc/mounts stands for the cluster's)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pretrain import mounts
from pretrain.config import load_config
from pretrain.resolve.run import resolve_ds_config
from pretrain.errors import ConfigError

MOUNTS = """\
/dev/sda1 / ext4 rw 0 0
10.0.0.5@o2ib:/scratch {root}/lustre lustre rw,flock 0 0
/dev/nvme0n1 {root}/local xfs rw,noatime 0 0
tmpfs {root}/shm tmpfs rw 0 0
"""


@pytest.fixture
def cluster_disks(tmp_path, monkeypatch):
    table = tmp_path / "mounts"
    table.write_text(MOUNTS.format(root=tmp_path))
    monkeypatch.setattr(mounts, "MOUNTS_FILE", str(table))
    for name in ("lustre", "local", "shm"):
        (tmp_path / name).mkdir()
    monkeypatch.delenv("SLURM_TMPDIR", raising=False)
    return tmp_path


def _swap_paths(root: Path, *, nvme_path: str = "auto") -> set[str]:
    ds = json.loads(Path("ds_configs/zero3_offload_nvme.json").read_text())
    for key in ("offload_optimizer", "offload_param"):
        ds["zero_optimization"][key]["nvme_path"] = nvme_path
    path = root / "ds.json"
    path.write_text(json.dumps(ds))
    cfg = load_config(None, ["model.preset=tiny", f"deepspeed={path}",
                             f"run_dir={root}/lustre/runs/my_run", "train.micro_batch_size=2",
                             "train.global_batch_size=8"])
    zero = resolve_ds_config(cfg, world_size=2)["zero_optimization"]
    return {zero[key]["nvme_path"] for key in ("offload_optimizer", "offload_param")}


def test_auto_swaps_to_the_jobs_node_local_scratch_not_the_run_dir(cluster_disks, monkeypatch):
    root = cluster_disks
    monkeypatch.setenv("TMPDIR", str(root / "shm"))
    monkeypatch.setenv("SLURM_TMPDIR", str(root / "local" / "job42"))  # wins over $TMPDIR
    (path,) = _swap_paths(root)
    assert Path(path).parent == root / "local" / "job42" / "pretrain_nvme_swap"
    assert Path(path).name.startswith("my_run-") and Path(path).is_dir()
    monkeypatch.delenv("SLURM_TMPDIR")
    monkeypatch.setenv("TMPDIR", str(root / "local"))
    assert Path(*_swap_paths(root)).parent == root / "local" / "pretrain_nvme_swap"


def test_auto_on_a_network_file_system_is_refused_with_the_reason(cluster_disks, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(cluster_disks / "lustre" / "tmp"))
    with pytest.raises(ConfigError, match="on a lustre network file system .* needs a "
                                          "node-local disk; set nvme_path"):
        _swap_paths(cluster_disks)


def test_an_explicit_network_or_memory_path_is_used_with_a_warning(cluster_disks):
    chosen = str(cluster_disks / "lustre" / "swap")
    with pytest.warns(UserWarning, match="lustre network file system: slow and maybe without "
                                         "O_DIRECT"):
        assert _swap_paths(cluster_disks, nvme_path=chosen) == {chosen}
    with pytest.warns(UserWarning, match="tmpfs: the swap files take memory"):
        _swap_paths(cluster_disks, nvme_path=str(cluster_disks / "shm" / "swap"))


@pytest.mark.parametrize("key, message", [
    ("thread_count", "unknown DeepSpeed key aio.thread_count (DeepSpeed renamed it "
                     "'intra_op_parallelism'): DeepSpeed would ignore it"),
    ("queue_dept", "unknown DeepSpeed key aio.queue_dept (did you mean 'queue_depth'?)"),
])
def test_an_aio_key_deepspeed_does_not_read_is_refused(cluster_disks, monkeypatch, tmp_path,
                                                       key, message):
    """DeepSpeed reads the "aio" section key by key and ignores any other: an old name or a
    typo would leave the async-io handles at their defaults without a word."""
    monkeypatch.setenv("TMPDIR", str(cluster_disks / "local"))
    ds = json.loads(Path("ds_configs/zero3_offload_nvme.json").read_text())
    ds["aio"][key] = 2
    cfg = load_config(None, ["model.preset=tiny", f"run_dir={tmp_path}/run",
                             "train.micro_batch_size=2", "train.global_batch_size=8"])
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_ds_config(cfg, world_size=2, source=ds)
