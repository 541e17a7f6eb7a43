"""`pretrain plan --build`: every distinct rank of a run constructed on the meta device through
the real model code and DeepSpeed's PipelineModule, in a fake process group of the run's world
size, against the planner. Each case is one `pretrain` process (the fake group is per process):
forked from the fork server (`run_cli`), or a new interpreter where the case changes the code
before `main` runs or asks what a fresh machine compiles."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from pretrain.arithmetic import num_parameters
from pretrain.config import load_config
from pretrain.testing.cli import run_cli
from pretrain.testing.runs import REPO

PLAN_70B = ["plan", "--config", "configs/llama_70b.yaml", "--world-size", "128", "--build"]


def _pretrain(args: list[str], *, prelude: str = "",
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    code = f"{prelude}\nfrom pretrain.cli import main\nmain({args!r})"
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu", **(env or {})})


def _forked(args: list[str]) -> subprocess.CompletedProcess:
    return run_cli(args, cwd=REPO, timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"})


def test_every_rank_of_the_70b_recipe_builds_as_planned():
    """TP 4 x PP 8 x DP 4: 32 distinct ranks, each the planner's stage parameters."""
    run = _forked(PLAN_70B + ["--json"])
    assert run.returncode == 0, run.stderr[-3000:]
    builds = json.loads(run.stdout)["builds"]
    assert sorted((b["stage"], b["tensor_rank"]) for b in builds) == \
        [(s, t) for s in range(8) for t in range(4)]
    assert all(b["built"] == b["planned"] for b in builds)
    # 80 layers over 8 stages of 10, the embedding on the first, norm + head on the last
    by_stage = {b["stage"]: b["built"] for b in builds}
    assert by_stage[1] == by_stage[6] < by_stage[0] < by_stage[7]
    assert {b["rank"] for b in builds if b["stage"] == 7} == set(range(112, 116))


def test_zero3_tp2_layout_of_70b_builds_shards_of_the_whole_model():
    # with recomputation, as a ZeRO-3 tp2 70B run on 80 GB GPUs needs it
    overrides = ["parallel.tensor=2", "parallel.pipeline=1", "deepspeed=ds_configs/zero3.json",
                 "model.activation_checkpointing=full"]
    args = PLAN_70B + ["--json"] + [a for o in overrides for a in ("--set", o)]
    run = _forked(args)
    assert run.returncode == 0, run.stderr[-3000:]
    builds = json.loads(run.stdout)["builds"]
    assert len(builds) == 2 and builds[0]["built"] == builds[1]["built"]
    # The two shards hold every matrix once and each its own copy of the 161 RMSNorm weights.
    m = load_config("configs/llama_70b.yaml", overrides).model
    norms = (2 * m.num_layers + 1) * m.hidden_size
    assert 2 * builds[0]["built"] - norms == num_parameters(m)


def test_a_rank_that_differs_from_the_plan_is_one_error_line():
    """A stage the planner counts differently (here: one parameter more) fails the pre-flight."""
    prelude = ("import pretrain.plan.build_check as check\n"
               "planned = check.stage_parameters\n"
               "check.stage_parameters = lambda *args: planned(*args) + 1")
    run = _pretrain(["plan", "--config", "configs/tiny.yaml", "--world-size", "4", "--build",
                     "--set", "parallel.pipeline=2", "--set", "parallel.tensor=2"],
                    prelude=prelude)
    assert run.returncode == 2, run.stderr[-3000:]
    error = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "rank 0 (pipeline stage 0, tensor rank 0) builds" in error[0]
    assert "the planner expects" in error[0] and "Traceback" not in run.stderr


def test_the_build_check_compiles_nothing_on_a_fresh_machine(tmp_path):
    """DeepSpeed's CPU communication backend compiles a shared-memory all-reduce op for
    inference on first use (~50 s); the pre-flight never needs it, so an empty extension
    directory stays empty."""
    extensions = tmp_path / "torch_extensions"
    extensions.mkdir()
    run = _pretrain(["plan", "--config", "configs/tiny.yaml", "--world-size", "2", "--build"],
                    env={"TORCH_EXTENSIONS_DIR": str(extensions)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "built" in run.stdout.lower() or "stage" in run.stdout, run.stdout[-2000:]
    assert not list(extensions.iterdir()), sorted(p.name for p in extensions.iterdir())
