"""The engine a run builds (`build_engine`) reads train.lr and train.grad_clip: the values read
back from it. The tests cited for them before checked step 1's loss, which neither changes."""
from __future__ import annotations

import pytest

from pretrain.testing.ranks import run_on_ranks
from pretrain.testing.runs import REPO


def _built(rank: int, world_size: int) -> dict:
    from pretrain.config import load_config
    from pretrain.dist import init_deepspeed_comm
    from pretrain.resolve.run import resolve_ds_config
    from pretrain.resolve.topology import Topology
    from pretrain.training.engine import build_engine, lr_factor

    cfg = load_config(REPO / "configs/tiny.yaml", [
        "deepspeed=ds_configs/zero1.json", "train.precision=fp32", "train.global_batch_size=2",
        "model.num_layers=1", "train.lr=3e-3", "train.min_lr=3e-4", "train.grad_clip=0.25",
        f"run_dir={REPO}/runs/unused"])
    init_deepspeed_comm(dist_backend="gloo")
    ds_config = resolve_ds_config(cfg, world_size=1, accelerator="cpu")
    groups = Topology.from_parallel_config(cfg.parallel, world_size=1, rank=0).create_groups()
    engine = build_engine(cfg, ds_config, groups, main=False)
    return {"lrs": engine.get_lr(), "expected": 3e-3 * lr_factor(cfg.train)(0),
            "clip": engine.gradient_clipping()}


def test_the_built_engine_has_the_runs_lr_and_gradient_clipping(tmp_path):
    built, = run_on_ranks(_built, world_size=1, tmp_path=tmp_path, timeout_s=300)
    assert built["lrs"] and all(lr == pytest.approx(built["expected"]) for lr in built["lrs"])
    assert built["clip"] == 0.25
