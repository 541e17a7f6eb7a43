"""launch/: single-node runs through the real deepspeed and torchrun launchers (launch/single_node.sh),
hostfile and .deepspeed_env generation, and the pre-flight record (`pretrain launch ...`)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.commands import launch
from pretrain.errors import ConfigError

pytestmark = pytest.mark.slow  # training runs through the launchers (quick tier: not slow)

REPO = Path(__file__).resolve().parents[1]
TINY = ["--config", "configs/tiny.yaml", "--set", "train.steps=3", "--set", "data.num_workers=0"]


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "SLURM_JOB_NODELIST", "SLURM_JOB_ID", "VIRTUAL_ENV"):
        env.pop(var, None)
    env.update(extra)
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    return env


def _pretrain(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pretrain", *args], cwd=REPO, env=_env(**env),
                          capture_output=True, text=True, timeout=300)


# ---- single node through the real launchers ------------------------------------------------
@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_single_node_script_runs_two_cpu_ranks(launcher, tiny_data, tmp_path):
    run_dir = tmp_path / launcher
    proc = subprocess.run(
        ["bash", "launch/single_node.sh", *TINY, "--set", f"run_dir={run_dir}",
         "--set", f"data.tokenizer={tiny_data['tokenizer']}",
         "--set", f"data.dataset={tiny_data['dataset']}"],
        cwd=REPO, env=_env(LAUNCHER=launcher, NPROC="2"), capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"[launch] {launcher}: 2 ranks" in proc.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert (records[0]["world_size"], records[0]["launcher"]) == (2, launcher)
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3]


def test_single_node_script_refuses_unknown_launcher():
    proc = subprocess.run(["bash", "launch/single_node.sh", *TINY], cwd=REPO,
                          env=_env(LAUNCHER="mpirun"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "LAUNCHER=mpirun: use deepspeed or torchrun" in proc.stderr


# ---- hostfiles -------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, names", [
    ("node1", ["node1"]),
    ("gpu[01-03,7],login", ["gpu01", "gpu02", "gpu03", "gpu7", "login"]),
    ("a[8-11]", ["a8", "a9", "a10", "a11"]),
    ("n[009-011]", ["n009", "n010", "n011"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    (" x1 , y[2] ", ["x1", "y2"]),
])
def test_expand_nodelist_follows_slurm_grammar(spec, names):
    assert launch.expand_nodelist(spec) == names


@pytest.mark.parametrize("spec, message", [
    ("node[1-2", "unbalanced '['"),
    ("node1-2]", "unbalanced ']'"),
    ("node[3-1]", "runs backwards"),
    ("node[a-b]", "is not a number"),
])
def test_expand_nodelist_rejects_malformed_lists(spec, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        launch.expand_nodelist(spec)


def test_node_names_without_slurm_expand_the_job_nodelist(monkeypatch):
    monkeypatch.setattr(launch.shutil, "which", lambda name: None)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu-[1-2]")
    assert launch.node_names() == ["gpu-1", "gpu-2"]
    assert launch.node_names("other[3-4]") == ["other3", "other4"]  # an explicit list wins
    monkeypatch.delenv("SLURM_JOB_NODELIST")
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST is not set"):
        launch.node_names()


def test_hostfile_text_and_its_errors():
    assert launch.hostfile_text(["a", "b"], slots=8) == "a slots=8\nb slots=8\n"
    with pytest.raises(ConfigError, match="slots per node = 0"):
        launch.hostfile_text(["a"], slots=0)
    with pytest.raises(ConfigError, match="names a node twice"):
        launch.hostfile_text(["a", "a"], slots=1)


def test_hostfile_command_reads_the_slurm_nodelist(tmp_path):
    out = tmp_path / "hostfile"
    proc = _pretrain("launch", "hostfile", "--slots", "4", "--output", str(out),
                     SLURM_JOB_NODELIST="c[1-3]")
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == "c1 slots=4\nc2 slots=4\nc3 slots=4\n"
    proc = _pretrain("launch", "hostfile", "--slots", "4", "--output", str(out),
                     "--nodes", "c[1-")
    assert proc.returncode == 2 and proc.stderr.startswith("error: node list 'c[1-'")


def test_deepspeed_env_carries_the_run_environment_only():
    env = {"NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "4", "PYTHONPATH": "/x", "HOME": "/root",
           "DS_ACCELERATOR": "cuda", "MY_SETTING": "1", "SLURM_JOB_ID": "7",
           "VIRTUAL_ENV_PROMPT": "(.venv)", "PATHEXT": "x"}
    text = launch.deepspeed_env_text(env, names=("MY_SETTING",))
    assert text == "DS_ACCELERATOR=cuda\nMY_SETTING=1\nNCCL_DEBUG=WARN\nOMP_NUM_THREADS=4\nPYTHONPATH=/x\n"
    with pytest.raises(ConfigError, match="NCCL_X holds a newline"):
        launch.deepspeed_env_text({"NCCL_X": "a\nb"})


# ---- pre-flight --------------------------------------------------------------------------------
def test_preflight_records_the_resolved_run(tmp_path):
    proc = _pretrain("launch", "preflight", "--world-size", "4", "--accelerator", "cpu",
                     "--log-dir", str(tmp_path), *TINY, "--set", "parallel.pipeline=2",
                     "--deepspeed-config", "ds_configs/zero0.json")
    assert proc.returncode == 0, proc.stderr
    assert "layout  tp 1 x pp 2 x dp 2 = 4 ranks | global batch 4" in proc.stdout
    assert "engine  ZeRO-0" in proc.stdout
    assert (tmp_path / "plan.txt").read_text() == proc.stdout
    ds = json.loads((tmp_path / "ds_config.json").read_text())
    assert (ds["train_batch_size"], ds["zero_optimization"]["stage"]) == (4, 0)
    assert "pipeline: 2" in (tmp_path / "config.yaml").read_text()
    commit = (tmp_path / "git_commit.txt").read_text()
    assert commit.startswith(subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, text=True,
                                            capture_output=True).stdout.strip())


def test_preflight_refuses_a_config_that_does_not_fit_the_world(tmp_path):
    proc = _pretrain("launch", "preflight", "--world-size", "3", "--log-dir", str(tmp_path), *TINY)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: train.global_batch_size=4 is not a multiple of train.micro_batch_size x "
        "data-parallel size = 2 x 3 = 6: set it to a multiple of 6"]
    assert not (tmp_path / "config.yaml").exists()
    proc = _pretrain("launch", "preflight", "--world-size", "2", "--search", *TINY)
    assert proc.returncode == 2 and "use `pretrain plan --search`" in proc.stderr
