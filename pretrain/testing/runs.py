"""Run `pretrain` as a user would: through the real launchers in subprocesses, or on ranks forked
from the test's fork server (`pretrain.testing.cli`)."""
from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pretrain.launchers.local import launcher_command

REPO = Path(__file__).resolve().parents[2]  # the checkout: configs/, launch/, ds_configs/


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path

    @property
    def records(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.records if r["kind"] == "train"]

    def check(self) -> "Run":
        assert self.returncode == 0, f"exit {self.returncode}\n{self.stdout[-3000:]}\n{self.stderr[-6000:]}"
        return self


# The layouts that reach a decoder layer's weights differently, for checks that a change in how
# the model computes (fused projections, compiled layers) leaves training unchanged: one
# process, tensor-parallel shards, pipeline stages, ZeRO-3's partitions. name: (ranks, overrides)
LEVER_LAYOUTS = {
    "flat": (1, []),
    "tp2": (2, ["parallel.tensor=2"]),
    "pp2": (2, ["parallel.pipeline=2"]),
    "zero3": (2, ["deepspeed=ds_configs/zero3.json"]),
}


def run_pretrain(args: list[str], *, run_dir: Path, launcher: str = "forked", nprocs: int = 1,
                 timeout: float = 900, env: dict[str, str] | None = None) -> Run:
    """`pretrain <args>` under a launcher of `launchers.local.LAUNCHERS`; each rank gets one
    thread (2-core CI machines).
    `launcher="forked"`: the ranks forked from the test's fork server with the `deepspeed`
    launcher's environment (`pretrain.testing.cli.run_ranks`), without an interpreter's start-up
    per rank."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
                "TORCH_EXTENSIONS_DIR": os.environ.get(
                    "TORCH_EXTENSIONS_DIR", str(REPO / ".build" / "torch_extensions")),
                **(env or {})}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(var, None)
    if launcher == "forked":
        from pretrain.testing.cli import run_ranks

        proc = run_ranks(args, nprocs=nprocs, cwd=REPO, env=full_env, timeout=timeout)
    else:
        proc = subprocess.run(launcher_command(launcher, nprocs) + args, cwd=REPO, env=full_env,
                              capture_output=True, text=True, timeout=timeout)
    return Run(proc.returncode, proc.stdout, proc.stderr, run_dir)


def train_args(run_dir: Path, data: dict[str, str], *, overrides: Sequence[str] = (),
               config: str = "configs/tiny.yaml") -> list[str]:
    """The arguments of `pretrain train` of `config` on `data` into `run_dir`, with `overrides`
    (each a `--set`)."""
    args = ["train", "--config", config, "--set", f"run_dir={run_dir}",
            "--set", f"data.tokenizer={data['tokenizer']}", "--set", f"data.dataset={data['dataset']}"]
    for o in overrides:
        args += ["--set", o]
    return args


def train(tmp_path: Path, data: dict[str, str], *, overrides: list[str] = (), nprocs: int = 1,
          launcher: str | None = None, name: str = "run", config: str = "configs/tiny.yaml",
          timeout: float = 900) -> Run:
    """Train the tiny config on `data` with `overrides`; returns the finished Run (checked).
    Without a `launcher`, the ranks are forked (`run_pretrain`'s "forked")."""
    run_dir = tmp_path / name
    args = train_args(run_dir, data, overrides=overrides, config=config)
    launcher = launcher or "forked"
    return run_pretrain(args, run_dir=run_dir, launcher=launcher, nprocs=nprocs,
                        timeout=timeout).check()


def rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
