"""`plan --search` with a memory margin, how far a layout is from the best and why, the warning
of `plan` and the pre-flight, and the shipped recipes against the search at their cluster size."""
from __future__ import annotations

import re
import subprocess
from dataclasses import replace

import pytest

from pretrain.config import MODEL_PRESETS, ModelConfig, Recompute, load_config
from pretrain.resolve.ds_config import shipped_ds_configs
from pretrain.errors import ConfigError
from pretrain.resolve.layout import Layout, expert_grid
from pretrain.plan.clusters import make_cluster
from pretrain.plan.dry_run import dry_run, settle_for_plan
from pretrain.plan.memory import GB
from pretrain.plan.report import (SLOWER_THAN_BEST, selecting_arguments, step_difference,
                                  times_slower, warnings_against_best)
from pretrain.plan.search import (DEFAULT_MEMORY_MARGIN, engine_key, estimate, keeps_margin,
                                  search)
from pretrain.testing.cli import run_cli
from pretrain.testing.runs import REPO

LLAMA_13B = ModelConfig(**MODEL_PRESETS["13b"])
# Each recipe and the Slurm script its documented command submits (the MoE recipe through the
# 70B script: README's `CONFIG=configs/mixtral_8x7b.yaml sbatch slurm/pretrain_70b.sh`; Qwen3's
# through the 7B one; Qwen3-30B-A3B has its own).
SCRIPTS = {"llama_7b": "pretrain_7b.sh", "llama_13b": "pretrain_13b.sh",
           "llama_70b": "pretrain_70b.sh", "mixtral_8x7b": "pretrain_70b.sh",
           "qwen3_8b": "pretrain_7b.sh", "qwen3_30b_a3b": "pretrain_qwen3_moe.sh"}
RECIPES = list(SCRIPTS)
# The 70B recipe as it shipped before the search picked its layout: 1.5x slower predicted.
OLD_70B = ["parallel.tensor=8", "parallel.pipeline=4", "parallel.sequence_parallel=false",
           "model.activation_checkpointing=full"]


def _documented_cluster(recipe: str):
    """The cluster `slurm/pretrain_<size>.sh` asks for (its #SBATCH nodes and GPUs per node)."""
    script = (REPO / "slurm" / SCRIPTS[recipe]).read_text()
    assert f"configs/{recipe}.yaml" in script or re.search(
        rf"CONFIG=configs/{recipe}\.yaml sbatch [^`]*slurm/{SCRIPTS[recipe]}", _readme_text())
    sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", script, re.M))
    return make_cluster("h100-80gb", nodes=int(sbatch["nodes"]),
                        gpus_per_node=int(sbatch["gpus-per-node"]))


def _readme_text() -> str:
    return " ".join((REPO / "README.md").read_text().split())  # lines joined


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_is_within_10_percent_of_the_best_layout_with_the_margin(recipe):
    """At the size its Slurm script asks for, the recipe's own layout keeps the default margin and
    no layout the search ranks is predicted more than 10% faster."""
    cluster = _documented_cluster(recipe)
    cfg = load_config(REPO / "configs" / f"{recipe}.yaml")
    settled = settle_for_plan(cfg, on_this_machine=False)
    layout = dry_run(settled, world_size=cluster.world_size, accelerator="cuda").layout
    own = estimate(cfg.model, layout, cluster, engine=cfg.train.engine)
    plans = search(cfg.model, cluster, global_batch=layout.global_batch,
                   precision=layout.precision, engines=set(shipped_ds_configs()),
                   memory_margin=DEFAULT_MEMORY_MARGIN, engine=cfg.train.engine)
    assert keeps_margin(own, DEFAULT_MEMORY_MARGIN), own.memory.total / GB
    assert times_slower(own, plans[0]) <= 1 + SLOWER_THAN_BEST, plans[0].layout.describe()


def test_the_search_spreads_experts_over_the_expert_grid_within_what_runs():
    """A mixture of experts is searched with its experts sharded on each tensor rank (expert 1),
    whole on the tensor ranks (expert = tensor) and over the expert grid (expert ranks beyond the
    tensor group), the grid only where the run takes it (ZeRO-1/2, no pipeline, ZeRO-1 in fp32
    only), with optimizer offload, context parallelism and Muon too; a dense model only ever
    with expert 1."""
    moe = load_config(REPO / "configs" / "mixtral_8x7b.yaml").model
    cluster = make_cluster("h100-80gb", nodes=2)
    plans = search(moe, cluster, global_batch=64, micro_batches=(1,))
    on_tensor = {p.layout.tensor for p in plans if p.layout.expert > 1 and not expert_grid(p.layout)}
    grid = [p.layout for p in plans if expert_grid(p.layout)]
    assert on_tensor and {p.layout.tensor for p in plans if p.layout.expert == 1} & on_tensor
    assert grid and all(g.zero_stage == 2 and g.pipeline == 1 for g in grid)
    assert {g.offload_optimizer for g in grid} == {"none", "cpu"}
    grid = [p.layout for p in search(moe, cluster, global_batch=64, micro_batches=(1,),
                                     contexts=(2,), optimizer="muon", allow_offload=False)
            if expert_grid(p.layout)]
    assert grid and all(g.context == 2 and g.optimizer == "muon" for g in grid)
    assert all(p.layout.expert == 1 for p in search(LLAMA_13B, cluster, global_batch=64,
                                                     micro_batches=(1,)))


def test_the_margin_drops_exactly_the_layouts_that_would_not_fit_that_much_larger():
    cluster = make_cluster("h100-80gb", nodes=2)
    every = search(LLAMA_13B, cluster, global_batch=64)
    kept = search(LLAMA_13B, cluster, global_batch=64, memory_margin=0.2)
    fits_larger = [p for p in every if p.memory.total / GB * 1.2 <= p.memory_limit_gb]
    assert 0 < len(kept) < len(every)
    assert [p.layout for p in kept] == [p.layout for p in fits_larger]
    with pytest.raises(ConfigError, match="memory margin 1.5"):
        search(LLAMA_13B, cluster, global_batch=64, memory_margin=1.5)


def test_the_difference_to_the_best_is_split_into_the_terms_that_cost_it():
    """Recomputation shows as its own term; the terms add up to the difference of the steps
    (the slower layout's scaled to the best's global batch)."""
    cluster = make_cluster("h100-80gb", nodes=2)
    best = estimate(LLAMA_13B, Layout(tensor=2, data=8, global_batch=64, zero_stage=1,
                                      sequence_parallel=True), cluster)
    slow = estimate(LLAMA_13B, replace(best.layout, tensor=8, data=2, global_batch=32,
                                       recompute=Recompute.FULL), cluster)
    diff = step_difference(slow, best)
    assert sum(diff.values()) == pytest.approx(slow.time.step * 2 - best.time.step, rel=1e-9)
    assert list(diff)[:2] == sorted(["recompute", "tensor_comm"], key=lambda k: -diff[k])
    assert diff["recompute"] == pytest.approx(2 * slow.time.compute * (1 - slow.mfu / slow.hfu))
    assert diff["bubble"] == diff["pipeline_comm"] == diff["offload"] == 0
    assert times_slower(slow, best) == pytest.approx(best.tokens_per_s / slow.tokens_per_s)
    engines = shipped_ds_configs()
    warning, = warnings_against_best(slow, [best], margin=0.2, ds_configs=engines)
    assert "--set parallel.tensor=2 --set parallel.pipeline=1" in warning
    assert warnings_against_best(best, [best], margin=0.2, ds_configs=engines) == []


def _pretrain(*args: str) -> subprocess.CompletedProcess:
    return run_cli(list(args), cwd=REPO)


def _sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


@pytest.mark.parametrize("command", [["plan"], ["launch", "preflight", "--no-build"]])
def test_a_layout_much_slower_than_the_best_is_warned_about_with_the_better_arguments(command):
    """`plan` and the Slurm pre-flight on 128 H100s: the old 70B layout is warned about (the
    arguments of the fastest layout with the margin, the terms that cost the time); the shipped
    one is not."""
    base = [*command, "--config", "configs/llama_70b.yaml", "--world-size", "128",
            "--accelerator", "cuda", "--gpu-memory-gb", "80"]
    old = _pretrain(*base, *_sets(OLD_70B))
    assert old.returncode == 0, old.stderr
    warning, = [line for line in old.stderr.splitlines() if "warning: this layout" in line]
    assert "tp8 pp4 dp4 mbs1 ZeRO-1 recompute=full" in warning
    assert "slower than the fastest layout with a 20% memory margin" in warning
    assert "recomputation +" in warning and "tensor-parallel communication +" in warning
    engines = shipped_ds_configs()
    best = search(ModelConfig(**MODEL_PRESETS["70b"]), make_cluster("h100-80gb", nodes=16),
                  global_batch=1024, engines=set(engines), memory_margin=DEFAULT_MEMORY_MARGIN)[0]
    assert warning.endswith(selecting_arguments(best.layout, engines[engine_key(best.layout)]))
    ok = _pretrain(*base)
    assert ok.returncode == 0 and "warning: this layout" not in ok.stderr, ok.stderr


def test_search_prints_the_margin_and_where_the_config_stands():
    out = _pretrain("plan", "--config", "configs/llama_70b.yaml", "--world-size", "128",
                    "--search", "--top", "1", *_sets(OLD_70B), "--memory-margin", "0.3")
    assert out.returncode == 0, out.stderr
    assert "memory margin 30% (--memory-margin 0.3): a layout is ranked when its predicted " \
           "memory x 1.30 fits the 72.0 GB usable (at most 55.4 GB predicted)" in out.stdout
    line, = [line for line in out.stdout.splitlines() if line.startswith("this config: ")]
    assert "tp8 pp4 dp4 mbs1 ZeRO-1 recompute=full" in line and "x slower than #1 (" in line
    bad = _pretrain("plan", "--config", "configs/llama_70b.yaml", "--world-size", "128",
                    "--search", "--memory-margin", "-0.1")
    assert bad.returncode == 2 and "error: memory margin -0.1" in bad.stderr
