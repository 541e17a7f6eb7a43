"""DeepSpeed's compiled ops (CPU Adam, async I/O) of offloading configs: which ones a config
needs, the pre-flight's refusal of one that cannot load, the node-local folder a Slurm job builds
them in, and the build locks a cancelled build leaves. Nothing is compiled here."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from pretrain import compiled_ops
from pretrain.testing.cli import run_cli

REPO = Path(__file__).resolve().parents[1]
TINY = ["--config", "configs/tiny.yaml", "--set", "train.steps=3"]


def _ds(name: str) -> dict:
    return json.loads((REPO / "ds_configs" / name).read_text())


def test_the_ops_each_shipped_config_needs():
    assert compiled_ops.needed_ops(_ds("zero1.json")) == []
    assert compiled_ops.needed_ops(_ds("zero2_offload_cpu.json")) == ["cpu_adam"]
    assert compiled_ops.needed_ops(_ds("zero3_offload_nvme.json")) == ["cpu_adam", "async_io"]
    assert compiled_ops.shipped_ops(REPO / "ds_configs") == ["cpu_adam", "async_io"]


def test_preflight_refuses_an_offload_config_whose_op_cannot_load(tmp_path):
    """No CPU Adam built (an empty extensions folder) and no compiler on the node: exit 2 with
    the reason, before the job's ranks are started or anything is recorded."""
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"),
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "PYTHONPATH": str(REPO)}
    proc = run_cli(
        ["launch", "preflight", "--world-size", "2", "--accelerator", "cpu", "--no-build",
         "--log-dir", str(tmp_path / "log"), *TINY,
         "--deepspeed-config", "ds_configs/zero2_offload_cpu.json"], cwd=REPO, env=env, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {REPO}/ds_configs/zero2_offload_cpu.json needs DeepSpeed's compiled op(s) cpu_adam; "
        f"cpu_adam is not built and this node has no {tmp_path / 'no-such-compiler'} to build "
        "it: run `bash launch/setup_env.sh --ops` where there is one")
    assert not (tmp_path / "log" / "ds_config.json").exists()


def test_a_slurm_job_builds_its_ops_in_node_local_scratch():
    assert compiled_ops.node_local_ops_dir(
        {"SLURM_JOB_ID": "42", "SLURM_TMPDIR": "/local/job42", "TMPDIR": "/scratch"}) == \
        Path("/local/job42/pretrain_torch_extensions-42")
    assert compiled_ops.node_local_ops_dir({"SLURM_JOB_ID": "7", "TMPDIR": "/scratch"}) == \
        Path("/scratch/pretrain_torch_extensions-7")
    assert compiled_ops.node_local_ops_dir({"SLURM_JOB_ID": "7"}) == \
        Path("/tmp/pretrain_torch_extensions-7")


def test_a_build_made_for_another_cpu_is_not_reused(tmp_path):
    """DeepSpeed compiles CPU ops with -march=native: the set-up's build is copied to a node
    only when it was made for the node's CPU model."""
    seed = tmp_path / "cpu_adam"
    seed.mkdir()
    (seed / "cpu_adam.so").write_bytes(b"\0")
    (seed / compiled_ops.CPU_STAMP).write_text("another-cpu\n")
    assert not compiled_ops._same_cpu_build(seed)
    (seed / compiled_ops.CPU_STAMP).write_text(compiled_ops.cpu_signature() + "\n")
    assert compiled_ops._same_cpu_build(seed)


def test_a_stale_build_lock_is_removed_and_a_live_one_left(tmp_path, monkeypatch):
    ext = tmp_path / "ext"
    for op in ("cpu_adam", "async_io"):
        (ext / op).mkdir(parents=True)
        (ext / op / "lock").touch()
    old = time.time() - compiled_ops.STALE_LOCK_S - 60
    os.utime(ext / "cpu_adam" / "lock", (old, old))  # a build cancelled long ago
    lines = compiled_ops.clear_stale_locks(["cpu_adam", "async_io"], ext)
    assert not (ext / "cpu_adam" / "lock").exists()
    assert (ext / "async_io" / "lock").exists()  # young: a build may hold it
    assert "removed a stale build lock (1860 s old, no build running on this node)" in lines[0]
    assert "a build holds it" in lines[1] and "no process on this node" in lines[1]

    # two minutes old: stale on a node-local disk, not where another node may be building
    minutes = time.time() - 120
    os.utime(ext / "async_io" / "lock", (minutes, minutes))
    monkeypatch.setattr(compiled_ops, "network_filesystem", lambda path: "lustre")
    assert "a build holds it" in compiled_ops.clear_stale_locks(["async_io"], ext)[0]
    monkeypatch.setattr(compiled_ops, "network_filesystem", lambda path: None)
    assert "removed a stale build lock" in compiled_ops.clear_stale_locks(["async_io"], ext)[0]
    (ext / "async_io" / "lock").touch()

    # old, but a process works in the folder (torch runs ninja and the compiler there)
    os.utime(ext / "async_io" / "lock", (old, old))
    builder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                               cwd=ext / "async_io", stdin=subprocess.PIPE)
    try:
        (line,) = compiled_ops.clear_stale_locks(["async_io"], ext)
    finally:
        builder.communicate(b"")
    assert (ext / "async_io" / "lock").exists() and f"pid {builder.pid}" in line


def test_preflight_records_the_ops_and_their_node_local_folder(tmp_path):
    """An offload config whose op can load: the job record says which ops to build per node
    and where (slurm/common.sh reads it); a config without ops leaves the record empty."""
    env = {**os.environ, "SLURM_JOB_ID": "77", "SLURM_TMPDIR": str(tmp_path / "local"),
           "PYTHONPATH": str(REPO)}
    for ds_config, expected in (("zero2_offload_cpu.json",
                                 f"cpu_adam\t{tmp_path}/local/pretrain_torch_extensions-77\n"),
                                ("zero1.json", "")):
        proc = run_cli(
            ["launch", "preflight", "--world-size", "2", "--accelerator", "cpu", "--no-build",
             "--log-dir", str(tmp_path / "log"), *TINY, "--deepspeed-config",
             f"ds_configs/{ds_config}"], cwd=REPO, env=env, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert (tmp_path / "log" / "ops.tsv").read_text() == expected
