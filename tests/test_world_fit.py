"""An allocation the layout or the batch cannot use whole trains on its largest usable part.

The arithmetic on the 70B recipe (tp 4 x pp 8, global batch 1024, 8 GPUs a node), the pre-flight's
exit statuses, and a 4-rank data-parallel checkpoint resumed under 3 ranks of the real `deepspeed`
launcher: global batch 4 with micro-batch 1 lets 2 of the 3 ranks train, the third sits idle and
exits with the job; the losses are the uninterrupted 4-rank run's.
"""
from __future__ import annotations

import shutil
import subprocess

import pytest

from pretrain.config import load_config
from pretrain.errors import EXIT_REQUEUE, EXIT_USER_ERROR
from pretrain.testing.cli import run_cli
from pretrain.testing.runs import REPO, rel_diff, run_pretrain, train, train_args
from pretrain.resolve.world_fit import (WorldTooSmall, fit_of_config, idle_warning,
                                         usable_node_counts, usable_world)

GPUS_PER_NODE = 8


@pytest.fixture(scope="module")
def llama_70b():
    return load_config(str(REPO / "configs" / "llama_70b.yaml"), [])


@pytest.mark.parametrize("nodes, used_nodes", [(4, 4), (8, 8), (12, 8), (13, 8), (14, 8),
                                               (15, 8), (16, 16), (20, 16)])
def test_70b_on_any_node_count_trains_on_the_largest_usable_part(llama_70b, nodes, used_nodes):
    fit = fit_of_config(llama_70b, nodes * GPUS_PER_NODE)
    assert fit.used == used_nodes * GPUS_PER_NODE
    assert list(fit.idle) == list(range(used_nodes * GPUS_PER_NODE, nodes * GPUS_PER_NODE))
    if nodes != used_nodes:
        assert f"ranks {fit.used}-{fit.launched - 1} sit idle" in fit.describe()
        assert f"data parallel {nodes // 4} does not divide train.global_batch_size=1024" \
            in fit.describe()


def test_70b_usable_node_counts(llama_70b):
    assert usable_node_counts(llama_70b, ranks_per_node=GPUS_PER_NODE, up_to=40) == [4, 8, 16, 32]


def test_fewer_ranks_than_a_replica_is_cured_by_more_nodes(llama_70b):
    with pytest.raises(WorldTooSmall, match="at least 32 ranks") as caught:
        fit_of_config(llama_70b, 3 * GPUS_PER_NODE)
    assert caught.value.exit_code == EXIT_REQUEUE


def test_usable_world_arithmetic():
    # not whole replicas: 7 ranks of tp 2 -> 6
    assert usable_world(7, model_parallel=2, micro_batch=1, global_batch=None).used == 6
    # the micro-batch counts: global 8 at micro 2 allows dp 4, 2, 1 but not 3
    fit = usable_world(3, model_parallel=1, micro_batch=2, global_batch=8)
    assert (fit.used, list(fit.idle)) == (2, [2])
    assert usable_world(4, model_parallel=1, micro_batch=2, global_batch=8).idle == range(4, 4)
    # global batch 6 at micro 2: dp 2 would need 4 | 6, dp 1 fits
    assert usable_world(2, model_parallel=1, micro_batch=2, global_batch=6).used == 1
    # global batch 5 at micro 2 fits no dp: the whole world, for the layout check to refuse
    assert usable_world(2, model_parallel=1, micro_batch=2, global_batch=5).used == 2


def _preflight(world_size: int, *extra: str) -> subprocess.CompletedProcess:
    return run_cli(["launch", "preflight", "--config", "configs/llama_70b.yaml", "--world-size",
                    str(world_size), "--ranks-per-node", str(GPUS_PER_NODE), "--no-build", *extra],
                   cwd=REPO, timeout=600)


def test_preflight_prints_usable_node_counts_and_plans_the_used_ranks():
    proc = _preflight(12 * GPUS_PER_NODE)
    assert proc.returncode == 0, proc.stderr
    assert "usable node counts (8 ranks a node, every rank training): 4, 8, 16;" in proc.stdout
    assert "ranks 64-95 sit idle" in proc.stdout
    assert "tp 4 x pp 8 x dp 2 = 64 ranks" in proc.stdout


def test_preflight_requeues_a_job_smaller_than_a_replica_and_refuses_bad_input():
    small = _preflight(3 * GPUS_PER_NODE)
    assert small.returncode == EXIT_REQUEUE and "at least 32 ranks" in small.stderr
    # a model the layout cannot split is bad input, even on fewer ranks than a replica
    bad = _preflight(2 * GPUS_PER_NODE, "--set", "parallel.tensor=3")
    assert bad.returncode == EXIT_USER_ERROR, bad.stderr
    assert "parallel.tensor=3: must divide model.num_heads=64" in bad.stderr


def test_elastic_minimum_is_raised_to_one_replica():
    proc = run_cli(["launch", "nodes", "--config", "configs/llama_70b.yaml", "--ranks-per-node",
                    "8", "--min-nodes", "1", "--max-nodes", "14"], cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["4"]
    assert "every rank trains at 4, 8, other counts leave ranks idle" in proc.stderr


STEPS, SAVE_AT = 6, 3
DP = ["train.micro_batch_size=1", "train.global_batch_size=4", f"train.steps={STEPS}",
      f"checkpoint.save_interval={SAVE_AT}", "checkpoint.keep_last=2", "train.eval_interval=0",
      "train.precision=fp32", "checkpoint.save_final=false"]


@pytest.fixture(scope="module")
def four_rank_run(tiny_data, tmp_path_factory):
    """A 4-rank data-parallel run checkpointed at step SAVE_AT (forked ranks: the resumed runs
    are the ones through the launchers)."""
    return train(tmp_path_factory.mktemp("four"), tiny_data, nprocs=4, name="full", overrides=DP)


@pytest.mark.slow  # training runs through the launchers (quick tier: not slow)
@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_four_rank_checkpoint_resumes_on_two_of_three_ranks(launcher, four_rank_run, tiny_data,
                                                             tmp_path):
    """3 ranks cannot share a global batch of 4: ranks 0-1 resume the 4-rank checkpoint at dp 2
    with the same global batch (and losses), rank 2 waits idle and exits 0 with them, under
    either launcher (torchrun's rendezvous and its own exit-status rules)."""
    full = four_rank_run
    saved = full.run_dir / "checkpoints" / f"step{SAVE_AT}"
    shutil.copytree(saved, tmp_path / "resumed" / "checkpoints" / saved.name)

    resumed = run_pretrain(train_args(tmp_path / "resumed", tiny_data, overrides=DP),
                           run_dir=tmp_path / "resumed", launcher=launcher, nprocs=3)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-6000:]
    out = resumed.stdout + resumed.stderr
    assert ("training on ranks 0-1 of 3; rank 2 sits idle until the job ends: data parallel 3 "
            "does not divide train.global_batch_size=4") in out
    assert "resharded tp1 pp1 dp4 ZeRO-1 -> tp1 pp1 dp2 ZeRO-1" in out
    run = [r for r in resumed.records if r["kind"] == "run"]
    assert [(r["world_size"], r["data_parallel"], r["global_batch"]) for r in run] == [(2, 2, 4)]
    after = [r for r in resumed.records if r["kind"] == "train"]
    before = [r for r in full.records if r["kind"] == "train"][SAVE_AT:]
    assert [r["step"] for r in after] == list(range(SAVE_AT + 1, STEPS + 1))
    assert [r["consumed_samples"] for r in after] == [r["consumed_samples"] for r in before]
    assert rel_diff([r["loss"] for r in after], [r["loss"] for r in before]) < 1e-5


# ---- what `plan` and the Slurm pre-flight say before a job starts, in agreement ---------------

def _plan_7b(*extra: str) -> subprocess.CompletedProcess:
    return run_cli(["plan", "--config", "configs/llama_7b.yaml", *extra], cwd=REPO, timeout=600)


def _preflight_7b(world_size: int, *extra: str) -> subprocess.CompletedProcess:
    return run_cli(["launch", "preflight", "--config", "configs/llama_7b.yaml", "--world-size",
                    str(world_size), "--ranks-per-node", str(GPUS_PER_NODE), "--accelerator",
                    "cuda", "--no-build", *extra], cwd=REPO, timeout=600)


def _warnings(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("warning:")
            and "not found" not in line]  # the recipe's data paths do not exist here


def test_plan_and_preflight_agree_on_idle_gpus_and_name_a_batch_that_uses_them_all():
    """6 nodes of the 7B recipe (tp 2, micro-batch 4, global batch 1024): dp 24 does not divide
    the batch, so 16 of the 48 GPUs would sit idle. `plan` and the pre-flight both plan the 32
    that train, exit 0, and warn naming the global batches (multiples of 4 x 24) that use all 48;
    with one of them every GPU trains and neither warns."""
    for proc in (_plan_7b("--world-size", "48"), _preflight_7b(48)):
        assert proc.returncode == 0, proc.stderr
        assert "tp 2 x pp 1 x dp 16 = 32 ranks" in proc.stdout
        warning, = _warnings(proc)
        assert "16 of the 48 GPUs sit idle" in warning, warning
        assert "train.global_batch_size=960 or 1056" in warning, warning
    for proc in (_plan_7b("--world-size", "48", "--set", "train.global_batch_size=1056"),
                 _preflight_7b(48, "--set", "train.global_batch_size=1056")):
        assert proc.returncode == 0, proc.stderr
        assert "tp 2 x pp 1 x dp 24 = 48 ranks" in proc.stdout and not _warnings(proc)


def test_idle_ranks_that_no_batch_can_use_name_the_node_counts_instead():
    fit = fit_of_config(load_config(str(REPO / "configs" / "llama_70b.yaml"), []), 100)
    text = idle_warning(fit, load_config(str(REPO / "configs" / "llama_70b.yaml"), []),
                        ranks_per_node=GPUS_PER_NODE)
    assert text.startswith("36 of the 100 GPUs sit idle"), text
    assert "--set train.global_batch_size" not in text, text  # no batch uses 100 ranks
    assert text.endswith("To train on every GPU: a job of 4, 8, 16 nodes of 8"), text


def test_tensor_parallelism_wider_than_a_node_is_refused_before_launch():
    """tp 16 on 8-GPU nodes would run every layer's all-reduce over the network: `plan` with a
    cluster preset and the Slurm pre-flight refuse it with one error line (exit 2); on 16-GPU
    nodes it is allowed."""
    for proc in (_plan_7b("--world-size", "32", "--set", "parallel.tensor=16"),
                 _preflight_7b(32, "--set", "parallel.tensor=16")):
        assert proc.returncode == EXIT_USER_ERROR, proc.stderr
        error, = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert "parallel.tensor=16" in error and "8 GPUs" in error, error
    wide = _plan_7b("--world-size", "32", "--gpus-per-node", "16", "--set", "parallel.tensor=16")
    assert wide.returncode == 0, wide.stderr
