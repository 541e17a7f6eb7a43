"""The environment the launch scripts and the Slurm jobs give the ranks (launch/env.sh, shared by
launch/*.sh and slurm/common.sh): the launchers are replaced by a script that records what it was
given, so no rank starts."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def _fake_bin(tmp_path: Path) -> Path:
    """`deepspeed`, `torchrun` and `scontrol` that record their environment instead."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("deepspeed", "torchrun"):
        (bin_dir / name).write_text('#!/bin/sh\nenv > "$ENV_OUT"\n')
    (bin_dir / "scontrol").write_text('#!/bin/sh\necho "$3" | tr , "\\n"\n')  # show hostnames
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir


def _clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMP_", "DS_", "TORCH_EXTENSIONS", "CUDA_DEVICE"))}
    env.update(PATH=f"{_fake_bin(tmp_path)}:{VENV_BIN}:{env['PATH']}", PYTHONPATH=str(REPO),
               VIRTUAL_ENV=str(VENV_BIN.parent), ENV_OUT=str(tmp_path / "env.txt"),
               # a stale rendezvous left in the submitting shell by another run
               MASTER_ADDR="stale-host", MASTER_PORT="11111", **extra)
    return env


def _recorded(tmp_path: Path) -> dict[str, str]:
    lines = (tmp_path / "env.txt").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


@pytest.mark.parametrize("script, extra", [
    ("launch/single_node.sh", {"NPROC": "2"}),
    ("launch/elastic.sh", {"NPROC_PER_NODE": "2"}),
    ("launch/multi_node.sh", {"GPUS_PER_NODE": "2", "LAUNCHER": "no_ssh", "NODE_RANK": "0",
                              "NODES": "localhost"}),
])
def test_launch_scripts_give_the_ranks_the_shared_environment(script, extra, tmp_path):
    env = _clean_env(tmp_path, LAUNCH_DIR=str(tmp_path / "launch"), **extra)
    proc = subprocess.run(["bash", script, "--config", "configs/tiny.yaml"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = _recorded(tmp_path)
    assert got["DS_ACCELERATOR"] == "cpu"
    assert got["OMP_NUM_THREADS"] == str(max(1, os.cpu_count() // 2))  # cores / 2 ranks
    assert got["TORCH_EXTENSIONS_DIR"] == f"{REPO}/.build/torch_extensions"
    assert got["VIRTUAL_ENV"] == str(VENV_BIN.parent)  # an active environment is kept
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in got


def _slurm_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    script = (f'source "{REPO}/slurm/common.sh"\n'
              'env > "$ENV_OUT"\n')
    env = _clean_env(tmp_path, SLURM_JOB_ID="1234", SLURM_JOB_NODELIST="nodeA,nodeB",
                     SLURM_JOB_NAME="envtest", SLURM_NTASKS_PER_NODE="2", PRETRAIN_ROOT=str(REPO),
                     JOB_LOG="/dev/stdout", LOG_DIR=str(tmp_path / "log"), VENV=str(tmp_path),
                     CONFIG="configs/tiny.yaml", **extra)
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return _recorded(tmp_path)


def test_slurm_jobs_rendezvous_at_their_allocation_not_a_stale_address(tmp_path):
    got = _slurm_env(tmp_path)
    assert (got["MASTER_ADDR"], got["MASTER_PORT"]) == ("nodeA", str(20000 + 12340))
    assert (got["DS_ACCELERATOR"], got["OMP_NUM_THREADS"]) == ("cpu", "1")
    assert got["TORCH_EXTENSIONS_DIR"] == f"{REPO}/.build/torch_extensions"
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in got  # would serialise ZeRO-3's streams


def test_slurm_rendezvous_port_is_chosen_by_its_own_variable(tmp_path):
    got = _slurm_env(tmp_path, PRETRAIN_MASTER_PORT="23456", SLURM_CPUS_PER_TASK="6")
    assert (got["MASTER_ADDR"], got["MASTER_PORT"]) == ("nodeA", "23456")
    assert got["OMP_NUM_THREADS"] == "6"


def test_slurm_job_builds_the_ops_once_per_node_before_the_ranks(tmp_path):
    """The pre-flight's ops.tsv (ops, node-local folder) makes one task per node build them,
    and the ranks' TORCH_EXTENSIONS_DIR is that folder; without ops nothing runs."""
    (tmp_path / "log").mkdir()
    (tmp_path / "log" / "ops.tsv").write_text("cpu_adam,async_io\t/local/job/ext dir\n")
    srun = tmp_path / "bin" / "srun"
    script = (f'source "{REPO}/slurm/common.sh"\n'
              'printf "%s\\n" "#!/bin/sh" "echo \\"\\$*\\" > $ENV_OUT.srun" > "$SRUN_FAKE"\n'
              'chmod +x "$SRUN_FAKE"\n'
              'prepare_ops\n'
              'env > "$ENV_OUT"\n')
    env = _clean_env(tmp_path, SLURM_JOB_ID="1234", SLURM_JOB_NODELIST="nodeA,nodeB",
                     SLURM_JOB_NAME="envtest", PRETRAIN_ROOT=str(REPO), JOB_LOG="/dev/stdout",
                     LOG_DIR=str(tmp_path / "log"), VENV=str(tmp_path), CONFIG="configs/tiny.yaml",
                     SRUN_FAKE=str(srun))
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _recorded(tmp_path)["TORCH_EXTENSIONS_DIR"] == "/local/job/ext dir"
    args = (tmp_path / "env.txt.srun").read_text().split()
    assert args[:3] == ["--ntasks=2", "--ntasks-per-node=1", "--nodes=2"]
    assert args[args.index("build-ops"):args.index("--seed") + 2] == [
        "build-ops", "--ops", "cpu_adam,async_io", "--dir", "/local/job/ext", "dir",
        "--seed", f"{REPO}/.build/torch_extensions"]
