"""A rank's start-up does not import MLflow for DeepSpeed's unused autotuner, and MLflow itself
still imports for the MLflow sink."""
from __future__ import annotations

import os
import subprocess
import sys

from pretrain.testing.runs import REPO


def test_a_rank_imports_deepspeed_without_mlflow_and_mlflow_still_imports():
    code = ("import sys, pretrain.training.trainer\n"
            "import deepspeed.autotuning.autotuner as tuner\n"
            "print('mlflow' in sys.modules, tuner.has_mlflow)\n"
            "import mlflow\n"
            "print(mlflow.__name__)\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[:2] == ["False False", "mlflow"]


def test_deepspeeds_comm_layer_on_cpu_builds_no_shared_memory_op(tmp_path):
    """deepspeed.initialize sets up DeepSpeed's comm layer itself when nothing did; on a CPU
    accelerator that would compile the shared-memory all-reduce op (about 80 s on a fresh
    machine). Without it, DeepSpeed's all-reduce is torch.distributed's and sums as before."""
    code = ("import os, torch, pretrain, deepspeed\n"
            "os.environ.update(RANK='0', WORLD_SIZE='1', LOCAL_RANK='0', "
            "MASTER_ADDR='127.0.0.1', MASTER_PORT=str(__import__('pretrain.dist').dist.free_port()))\n"
            "import deepspeed.comm as dist\n"
            "deepspeed.init_distributed(dist_backend='gloo', verbose=False)\n"
            "from deepspeed.comm import comm\n"
            "t = torch.ones(3)\n"
            "dist.all_reduce(t)\n"
            "print(comm.cdb.shm_comm_op, t.tolist())\n")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(tmp_path / "ops")}
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env=env)  # 15 s here; building the op takes minutes
    assert run.returncode == 0, run.stderr[-2000:]
    assert not (tmp_path / "ops").exists()
    assert run.stdout.strip().splitlines()[-1] == "None [1.0, 1.0, 1.0]", run.stdout
