"""Batch ramp-up (train.batch_ramp, pretrain/resolve/batch_ramp.py): each step's global batch from
the samples consumed before it, the sizes refused before launch, and (slow, fp32) a ramped run
whose losses equal, bit for bit, those of the same batches run at fixed sizes (one engine per
size, each resuming the previous one's state), across a resume at a ramp step, on both engines."""
from __future__ import annotations

import shutil

import pytest

from pretrain.config import load_config
from pretrain.errors import ConfigError
from pretrain.resolve.batch_ramp import RampSchedule
from pretrain.resolve.run import lay_out_as_loaded

# the runs' ramp: 2 samples, growing by 2 over the first 4 samples to 6: steps of 2, 4, 6, 6, 6
# samples (accumulation 2, 4, 6 at micro-batch 1: DeepSpeed's own count of micro-batches would
# end step 2 after its first micro-batch)
RAMP = "train.batch_ramp={start: 2, increment: 2, samples: 4}"
SIZES = [2, 4, 6, 6, 6]
RAMPED = ["train.micro_batch_size=1", "train.global_batch_size=6", RAMP,
          f"train.steps={len(SIZES)}", "data.valid_fraction=0"]


def _cfg(*overrides: str):
    return load_config(None, ["model.preset=tiny", *overrides])


def test_each_steps_batch_follows_the_samples_consumed():
    ramp = RampSchedule.of(_cfg("train.global_batch_size=8",
                                "train.batch_ramp={start: 2, increment: 2, samples: 12}"), 8)
    # 3 growths, one every 4 samples: 2 until 4 consumed, 4 until 8, 6 until 12, then 8
    assert ramp.sizes() == [2, 4, 6, 8]
    assert [ramp.size_at(c) for c in (0, 3, 4, 7, 8, 11, 12, 100)] == [2, 2, 4, 4, 6, 6, 8, 8]
    steps, consumed = [], 0
    for _ in range(6):
        steps.append(ramp.size_at(consumed))
        consumed += steps[-1]
    assert steps == [2, 2, 4, 6, 8, 8]
    assert ramp.samples_for(6) == consumed == 30
    assert ramp.samples_for(2, consumed=4) == 4 + 6  # a resume after steps 1-2 (4 samples)
    fixed = RampSchedule.of(_cfg("train.global_batch_size=8"), 8)
    assert fixed.sizes() == [8] and fixed.size_at(5) == 8 and fixed.samples_for(3) == 24


@pytest.mark.parametrize("overrides,named", [
    (["train.batch_ramp={start: 2, increment: 2, samples: 4}"], "needs train.global_batch_size"),
    (["train.global_batch_size=8", "train.batch_ramp={start: 8, increment: 2, samples: 4}"],
     "batch_ramp.start=8"),
    (["train.global_batch_size=8", "train.batch_ramp={start: 2, increment: 4, samples: 4}"],
     "batch_ramp.increment=4"),
    (["train.global_batch_size=8", "train.batch_ramp={start: 2, increment: 2, samples: 0}"],
     "must be positive"),
    (["train.global_batch_size=8", "train.batch_ramp.start=2"],
     r"train.batch_ramp: needs increment, samples as well, e.g. train.batch_ramp=\{start: "),
])
def test_bad_ramps_are_refused_as_loaded(overrides, named):
    with pytest.raises(ConfigError, match=named):
        _cfg(*overrides)


@pytest.mark.parametrize("overrides,named", [
    # micro-batch 2 x data 2: a size of 6 is not whole micro-batches on both ranks
    (["train.micro_batch_size=2", "train.global_batch_size=12",
      "train.batch_ramp={start: 4, increment: 2, samples: 8}"], "batch_ramp.increment=2"),
    (["train.micro_batch_size=2", "train.global_batch_size=12",
      "train.batch_ramp={start: 2, increment: 2, samples: 8}"], "batch_ramp.start=2"),
    (["train.micro_batch_size=1", "train.global_batch_size=8", "parallel.pipeline=2",
      "deepspeed=ds_configs/zero1.json", "train.batch_ramp={start: 4, increment: 2, samples: 8}"],
     "train.batch_ramp with parallel.pipeline=2"),
])
def test_sizes_the_layout_cannot_run_are_refused_before_launch(overrides, named):
    with pytest.raises(ConfigError, match=named):
        lay_out_as_loaded(_cfg(*overrides), world_size=4 if "parallel.pipeline=2" in overrides
                          else 2)


def test_a_ramp_of_whole_micro_batches_lays_out():
    run = lay_out_as_loaded(_cfg("train.micro_batch_size=2", "train.global_batch_size=12",
                                 "train.batch_ramp={start: 4, increment: 4, samples: 8}"),
                            world_size=2)
    assert run.layout.global_batch == 12 and run.layout.grad_accum == 3  # the largest size's


def test_an_elastic_world_uses_the_ranks_every_ramp_size_divides():
    """On 4 launched ranks (micro-batch 1, global batch 8) a ramp from 2 by 2 trains on the 2
    data-parallel ranks that divide each of its sizes (2, 4, 6, 8), as `plan` and the Slurm
    pre-flight then say; without the ramp all 4 train."""
    from pretrain.resolve.world_fit import fit_of_config

    fixed = _cfg("train.micro_batch_size=1", "train.global_batch_size=8")
    assert fit_of_config(fixed, 4).used == 4
    fit = fit_of_config(_cfg("train.micro_batch_size=1", "train.global_batch_size=8",
                             "train.batch_ramp={start: 2, increment: 2, samples: 8}"), 4)
    assert fit.used == 2 and "train.batch_ramp's start and increment 2, 2" in fit.reason


# ---- runs (slow) --------------------------------------------------------------------------------
def _fixed_batches(rank: int, world_size: int, data: dict, overrides: list[str],
                   phases: list[tuple[int, int]], state_dir: str) -> list[float]:
    """The ramped run's batches at fixed sizes: for each (global batch, steps) of `phases` a
    new engine of that fixed global batch (the run's config otherwise, its schedule over all the
    steps), loading the previous engine's checkpoint, stepped on the next samples of the run's
    data stream by DeepSpeed's own accumulation count; the losses of every step."""
    import torch

    from pretrain.config import load_config
    from pretrain.data.build import build_datasets
    from pretrain.data.loader import micro_batches
    from pretrain.dist import init_deepspeed_comm
    from pretrain.resolve.run import resolve_ds_config
    from pretrain.resolve.topology import Topology
    from pretrain.testing.runs import REPO
    from pretrain.training.engine import TimedBatches, build_engine, engine_loss

    init_deepspeed_comm(dist_backend="gloo", verbose=False)
    groups = Topology(tensor=1, pipeline=1, world_size=1, rank=0).create_groups()
    losses: list[float] = []
    consumed, total_steps = 0, sum(steps for _, steps in phases)
    for index, (size, steps) in enumerate(phases):
        cfg = load_config(REPO / "configs" / "tiny.yaml", [
            f"data.tokenizer={data['tokenizer']}", f"data.dataset={data['dataset']}",
            *[o for o in overrides if not o.startswith("train.batch_ramp")],
            f"train.global_batch_size={size}", f"train.steps={total_steps}"])
        engine = build_engine(cfg, resolve_ds_config(cfg, world_size=1), groups, main=True)
        if index:
            engine.load_checkpoint(state_dir, tag=f"phase{index - 1}")
        train, _ = build_datasets(cfg.data, seq_length=cfg.model.seq_length,
                                  train_samples=sum(SIZES), with_valid=False, log=lambda _: None)
        batches = TimedBatches(micro_batches(train, micro_batch_size=1, dp_rank=0, dp_size=1,
                                             consumed_samples=consumed))
        for _ in range(steps):
            total = torch.zeros(())
            for _ in range(size):
                inputs, labels = next(batches)
                loss = engine_loss(engine, inputs, labels, "cpu")
                total += loss.detach().float()
                engine.backward(loss)
                engine.step()
            losses.append((total / size).item())
            consumed += size
        engine.save_checkpoint(state_dir, tag=f"phase{index}")
    return losses


def _train_records(run) -> list[dict]:
    return [r for r in run.records if r["kind"] == "train"]


@pytest.mark.slow
def test_a_ramped_run_equals_its_batches_at_fixed_sizes_across_a_resume(tiny_data, tmp_path):
    """DeepSpeed (ZeRO-1, fp32): the ramped run's losses are bit for bit those of its batches
    run at fixed sizes; metrics.jsonl records each step's global batch and the samples consumed;
    a run restarted from the checkpoint of step 1 (the next step is the first growth) continues
    the ramp: its steps' sizes, samples and losses are the uninterrupted run's."""
    from pretrain.testing.ranks import run_on_ranks
    from pretrain.testing.runs import run_pretrain, train, train_args

    overrides = [*RAMPED, "checkpoint.save_interval=1", "checkpoint.keep_last=10"]
    ramped = train(tmp_path, tiny_data, name="ramped", overrides=overrides)
    records = _train_records(ramped)
    assert [r["global_batch"] for r in records] == SIZES
    assert [r["consumed_samples"] for r in records] == [sum(SIZES[:i + 1])
                                                        for i in range(len(SIZES))]
    [fixed] = run_on_ranks(_fixed_batches, world_size=1, tmp_path=tmp_path, timeout_s=600,
                           args=(tiny_data, RAMPED, [(2, 1), (4, 1), (6, 3)],
                                 str(tmp_path / "fixed")))
    assert ramped.losses == fixed

    restarted_dir = tmp_path / "restarted"
    step1 = ramped.run_dir / "checkpoints" / "step1"
    shutil.copytree(step1, restarted_dir / "checkpoints" / "step1")
    restarted = run_pretrain(train_args(restarted_dir, tiny_data, overrides=overrides),
                             run_dir=restarted_dir).check()
    assert f"[resume] from {restarted_dir / 'checkpoints' / 'step1'}" in restarted.stdout
    again = _train_records(restarted)
    for key in ("step", "global_batch", "consumed_samples", "loss", "lr"):
        assert [r[key] for r in again] == [r[key] for r in records[1:]], key


@pytest.mark.slow
def test_fsdp2_ramps_like_deepspeed_across_a_resume(tiny_data, tmp_path):
    """fsdp2 (its ZeRO-3, fp32): the ramped run's sizes are the ramp's, its losses DeepSpeed's
    ramped run's (within 1e-5: another engine's sums); restarted from step 2's checkpoint (a
    size change behind it, one ahead) it continues bit for bit."""
    from pretrain.testing.runs import rel_diff, run_pretrain, train, train_args

    deepspeed = train(tmp_path, tiny_data, name="deepspeed", overrides=RAMPED)
    overrides = [*RAMPED, "train.engine=fsdp2", "deepspeed=ds_configs/zero3.json",
                 "checkpoint.save_interval=1", "checkpoint.keep_last=10"]
    fsdp2 = train(tmp_path, tiny_data, name="fsdp2", overrides=overrides)
    records = _train_records(fsdp2)
    assert [r["global_batch"] for r in records] == SIZES
    assert rel_diff(fsdp2.losses, deepspeed.losses) < 1e-5

    restarted_dir = tmp_path / "restarted"
    step2 = fsdp2.run_dir / "checkpoints" / "step2"
    shutil.copytree(step2, restarted_dir / "checkpoints" / "step2")
    restarted = run_pretrain(train_args(restarted_dir, tiny_data, overrides=overrides),
                             run_dir=restarted_dir).check()
    again = _train_records(restarted)
    for key in ("step", "global_batch", "consumed_samples", "loss", "lr"):
        assert [r[key] for r in again] == [r[key] for r in records[2:]], key


@pytest.mark.slow
def test_a_restart_at_a_ramp_step_on_another_layout_continues_the_ramp(tiny_data, tmp_path):
    """The one-rank ramped run's checkpoint of step 1 (the first growth next), resumed on 2
    data-parallel ranks at ZeRO-2 (resharded): the same sizes and samples at every step, each
    rank's micro-batches half of them, the losses within 1e-5 of the uninterrupted run's (the
    sums reduced over two ranks)."""
    from pretrain.testing.runs import rel_diff, run_pretrain, train, train_args

    overrides = [*RAMPED, "checkpoint.save_interval=1", "checkpoint.keep_last=10"]
    one = train(tmp_path, tiny_data, name="one", overrides=overrides)
    records = _train_records(one)
    restarted_dir = tmp_path / "two"
    shutil.copytree(one.run_dir / "checkpoints" / "step1", restarted_dir / "checkpoints" / "step1")
    two = run_pretrain(train_args(restarted_dir, tiny_data,
                                  overrides=[*overrides, "deepspeed=ds_configs/zero2.json"]),
                       run_dir=restarted_dir, nprocs=2).check()
    assert "resharded" in two.stdout, two.stdout[-3000:]
    again = _train_records(two)
    for key in ("step", "global_batch", "consumed_samples"):
        assert [r[key] for r in again] == [r[key] for r in records[1:]], key
    assert rel_diff(two.losses, one.losses[1:]) < 1e-5
