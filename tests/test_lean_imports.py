"""A rank's start-up does not import MLflow for DeepSpeed's unused autotuner, and MLflow itself
still imports for the MLflow sink."""
from __future__ import annotations

import subprocess
import sys

from pretrain.testing.runs import REPO


def test_a_rank_imports_deepspeed_without_mlflow_and_mlflow_still_imports():
    code = ("import sys, pretrain.trainer\n"
            "import deepspeed.autotuning.autotuner as tuner\n"
            "print('mlflow' in sys.modules, tuner.has_mlflow)\n"
            "import mlflow\n"
            "print(mlflow.__name__)\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[:2] == ["False False", "mlflow"]
