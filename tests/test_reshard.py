"""Resuming on another layout: a checkpoint of one (tp, pp, dp, ZeRO stage, offload, sequence
parallel) continues on another, with no offline step.

An uninterrupted fp32 run on the old layout saves at step 3 and goes on to step 13; a run on
the new layout resumes from that checkpoint alone. Its 10 losses must be those of the
uninterrupted run within 1e-5 relative (the new layout sums in another order, so not bitwise),
its learning rates and consumed samples exactly those. The state itself is compared too: the
resharded engine saves at once, and its fp32 masters and Adam moments, consolidated, must be
bitwise the saved ones, tensor by tensor.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from pretrain.testing.ranks import run_on_ranks
from pretrain.testing.runs import rel_diff, run_pretrain, train, train_args

STEPS, SAVE_AT = 13, 3


def _layout(tp: int, pp: int, dp: int, ds: str, *extra: str) -> tuple[int, list[str]]:
    return tp * pp * dp, [f"parallel.tensor={tp}", f"parallel.pipeline={pp}",
                          f"deepspeed=ds_configs/{ds}.json", *extra]


BF16 = "train.precision=bf16"
TRANSITIONS = {
    "tp1dp2z1-tp2dp1z1": (_layout(1, 1, 2, "zero1"), _layout(2, 1, 1, "zero1"),
                          "tp1 pp1 dp2 ZeRO-1 -> tp2 pp1 dp1 ZeRO-1"),
    "tp2pp2z1-tp1dp2z3": (_layout(2, 2, 1, "zero1"), _layout(1, 1, 2, "zero3"),
                          "tp2 pp2 dp1 ZeRO-1 -> tp1 pp1 dp2 ZeRO-3"),
    "pp2dp2z1-single-z0": (_layout(1, 2, 2, "zero1"), _layout(1, 1, 1, "zero0"),
                           "tp1 pp2 dp2 ZeRO-1 -> tp1 pp1 dp1 ZeRO-0"),
    "dp2z3offload-tp2z2": (_layout(1, 1, 2, "zero3_offload_cpu"), _layout(2, 1, 1, "zero2"),
                           "tp1 pp1 dp2 ZeRO-3 offload cpu -> tp2 pp1 dp1 ZeRO-2"),
    "tp2sp-dp2z2": (_layout(2, 1, 1, "zero1", "parallel.sequence_parallel=true"),
                    _layout(1, 1, 2, "zero2"), "tp2 pp1 dp1 ZeRO-1 -> tp1 pp1 dp2 ZeRO-2"),
    # a pipeline as the target; ZeRO-0 as the source; CPU offload as source and target
    "dp2z2offload-pp2z1": (_layout(1, 1, 2, "zero2_offload_cpu"), _layout(1, 2, 1, "zero1"),
                           "tp1 pp1 dp2 ZeRO-2 offload cpu -> tp1 pp2 dp1 ZeRO-1"),
    "z0-dp2z2offload": (_layout(1, 1, 1, "zero0"), _layout(1, 1, 2, "zero2_offload_cpu"),
                        "tp1 pp1 dp1 ZeRO-0 -> tp1 pp1 dp2 ZeRO-2 offload cpu"),
    # DeepSpeed's two bf16 optimizers: BF16_Optimizer (ZeRO-1) and FP16_UnfusedOptimizer (ZeRO-0)
    "bf16-dp2z1-tp2z0": (_layout(1, 1, 2, "zero1", BF16), _layout(2, 1, 1, "zero0", BF16),
                         "tp1 pp1 dp2 ZeRO-1 -> tp2 pp1 dp1 ZeRO-0"),
}


def _train_records(run) -> list[dict]:
    return [r for r in run.records if r["kind"] == "train"]


@pytest.mark.slow  # training runs through the launchers (quick tier: not slow)
@pytest.mark.parametrize("transition", list(TRANSITIONS))
def test_a_checkpoint_continues_on_another_layout(transition, tiny_data, tmp_path):
    (old_n, old), (new_n, new), change = TRANSITIONS[transition]
    common = [f"train.steps={STEPS}", f"checkpoint.save_interval={SAVE_AT}",
              "checkpoint.keep_last=1", "checkpoint.keep_every=3"]
    full = train(tmp_path, tiny_data, nprocs=old_n, name="full", overrides=common + old)
    saved = full.run_dir / "checkpoints" / f"step{SAVE_AT}"
    shutil.copytree(saved, tmp_path / "resumed" / "checkpoints" / saved.name)

    resumed = train(tmp_path, tiny_data, nprocs=new_n, name="resumed", overrides=common + new)
    assert f"resharded {change}" in resumed.stdout
    after, before = _train_records(resumed), _train_records(full)[SAVE_AT:]
    assert [r["step"] for r in after] == list(range(SAVE_AT + 1, STEPS + 1))
    assert [r["consumed_samples"] for r in after] == [r["consumed_samples"] for r in before]
    assert [r["lr"] for r in after] == [r["lr"] for r in before]
    # bf16 rounds each layout's partial sums differently: its losses agree to bf16's precision
    tolerance = 1e-2 if BF16 in old else 1e-5
    assert rel_diff([r["loss"] for r in after], [r["loss"] for r in before]) < tolerance

    # The resharded state, saved on the new layout before any step, is the saved state.
    refused = run_pretrain(train_args(tmp_path / "resumed", tiny_data, overrides=common + new)
                           + ["--require-same-layout", "--resume-from", str(saved)],
                           run_dir=tmp_path / "resumed", nprocs=new_n)
    # every rank refuses (exit 2, the user's error); rank 0 says why
    assert refused.returncode == 2 and f"({change}) and --require-same-layout is set" in (
        refused.stderr), refused.stderr[-3000:]
    out = tmp_path / "resaved"
    run_on_ranks(_reshard_and_save, world_size=new_n, tmp_path=tmp_path,
                 args=(train_args(out, tiny_data, overrides=common + new), str(saved)))
    _assert_same_state(saved, out / "checkpoints" / f"step{SAVE_AT}")


def _reshard_and_save(rank: int, world_size: int, args: list[str], source: str) -> None:
    """Build the new layout's trainer resuming `source` (resharding it), then save at once."""
    from pretrain.commands.train import add_arguments
    from pretrain.config import load_config, config_overrides
    from pretrain.checkpoint import find_resume
    from pretrain.dist import discover_world, init_deepspeed_comm
    from pretrain.training.faults import RunControl
    from pretrain.resolve.run import resolve_run
    from pretrain.training.trainer import Trainer
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ns = parser.parse_args(args[1:])
    cfg = load_config(ns.config, config_overrides(ns))
    init_deepspeed_comm(dist_backend="gloo")  # on the process group the ranks share
    run = resolve_run(cfg, world_size=world_size, rank=rank, device_type="cpu",
                      find_resume=lambda c: find_resume(c, resume_from=source, log=lambda t: None))
    control = RunControl(save_interval_minutes=0, exit_after_minutes=0)
    trainer = Trainer(run, discover_world(), run.topology.create_groups(), resume=run.resume,
                      control=control)
    trainer.save()
    trainer.saver.finish()


def _assert_same_state(old: Path, new: Path) -> None:
    from pretrain.checkpoint.reshard import ADAM_MOMENTS
    from pretrain.checkpoint.weights import engine_tensors

    for key in (None, *ADAM_MOMENTS):
        a, b = engine_tensors(old, key), engine_tensors(new, key)
        assert sorted(a) == sorted(b)
        for name in a:
            assert torch.equal(a[name], b[name]), (key, name)


def test_layout_change_names_what_differs():
    from pretrain.resolve.run import layout_change

    saved = {"tensor": 1, "pipeline": 1, "data": 2, "world_size": 2, "zero_stage": 1,
             "offload": "none", "precision": "fp32"}
    assert layout_change(saved, dict(saved)) is None
    assert layout_change(saved, {**saved, "tensor": 2, "data": 1}) == (
        "tp1 pp1 dp2 ZeRO-1 -> tp2 pp1 dp1 ZeRO-1")
    assert layout_change(saved, {**saved, "zero_stage": 3, "offload": "cpu"}) == (
        "tp1 pp1 dp2 ZeRO-1 -> tp1 pp1 dp2 ZeRO-3 offload cpu")
    assert layout_change(saved, {**saved, "precision": "bf16"}) == (
        "tp1 pp1 dp2 ZeRO-1 fp32 -> tp1 pp1 dp2 ZeRO-1 bf16")
    # a checkpoint of an older version records no offload or precision: not compared
    older = {k: saved[k] for k in ("tensor", "pipeline", "data", "world_size", "zero_stage")}
    assert layout_change(older, {**saved, "precision": "bf16"}) is None


# ---- each rank reads only its own piece ----------------------------------------------------------

@pytest.mark.slow  # a training run through the launcher, then two ranks resharding
@pytest.mark.parametrize("target", ["zero1", "zero3"])
def test_each_rank_reads_only_its_new_shard(target, tiny_data, tmp_path):
    """A tp 2 checkpoint resumed at dp 2: each rank copies out of the files at most 1.25x the
    bytes of the masters and Adam moments it keeps (its ZeRO partition), counted by the reader
    (the pickles' metadata aside); reading every parameter whole, as a reshard did, is 2x."""
    common = ["train.steps=2", "checkpoint.save_interval=2"]
    saved = train(tmp_path, tiny_data, nprocs=2, name="tp2",
                  overrides=common + _layout(2, 1, 1, "zero1")[1])
    step_dir = saved.run_dir / "checkpoints" / "step2"
    new = _layout(1, 1, 2, target)[1]
    volumes = run_on_ranks(_reshard_and_count, world_size=2, tmp_path=tmp_path,
                           args=(train_args(tmp_path / "new", tiny_data, overrides=common + new),
                                 str(step_dir)))
    size = sum(f.stat().st_size for f in step_dir.rglob("*") if f.is_file())
    for rank, (read, kept, checkpoint_bytes) in enumerate(volumes):
        assert checkpoint_bytes == size
        assert 0 < read <= 1.25 * kept, (rank, read, kept)


def _reshard_and_count(rank: int, world_size: int, args: list[str], source: str):
    """(bytes the reshard read, bytes of the fp32 master partitions and two moments this rank
    keeps, checkpoint size)."""
    from pretrain.checkpoint import find_resume
    from pretrain.checkpoint.reshard import load_resharded
    from pretrain.training.engine import build_engine

    cfg, ds_config, groups = _new_layout(rank, world_size, args)
    engine = build_engine(cfg, ds_config, groups, main=False)
    point = find_resume(cfg, resume_from=source, log=lambda text: None)
    volume = load_resharded(engine, point.path, point.meta, cfg=cfg, groups=groups, rank=rank)
    optimizer = engine.optimizer
    partitions = getattr(optimizer, "single_partition_of_fp32_groups", None) or \
        optimizer.fp32_partitioned_groups_flat
    kept = sum(t.numel() * t.element_size() for t in partitions) * 3  # masters + 2 moments
    return volume.bytes_read, kept, volume.checkpoint_bytes


def _new_layout(rank: int, world_size: int, args: list[str]):
    """(config, resolved DeepSpeed config, process groups) of `pretrain train` `args`."""
    import argparse

    from pretrain.commands.train import add_arguments
    from pretrain.config import config_overrides, load_config
    from pretrain.dist import init_deepspeed_comm
    from pretrain.resolve.run import resolve_ds_config
    from pretrain.resolve.topology import Topology

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ns = parser.parse_args(args[1:])
    cfg = load_config(ns.config, config_overrides(ns))
    init_deepspeed_comm(dist_backend="gloo")
    ds_config = resolve_ds_config(cfg, world_size=world_size, accelerator="cpu")
    groups = Topology.from_parallel_config(cfg.parallel, world_size=world_size,
                                           rank=rank).create_groups()
    return cfg, ds_config, groups
