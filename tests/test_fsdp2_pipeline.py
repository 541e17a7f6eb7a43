"""`train.engine: fsdp2` with pipelines (pretrain/training/pipeline_schedules.py): every schedule of
`torch.distributed.pipelining` trains like one process, its checkpoints resume under another
schedule, and DeepSpeed's engine refuses the schedules it does not run before launch.

The reference is one process of the tiny fp32 model with 4 decoder layers (4 stages of an
interleaved pipeline of 2 ranks need a layer each): 10 steps of 4 micro-batches of 1. Every
pipeline run must give its losses and whole-model gradient norms within 1e-5 relative: a
micro-batch dropped or counted twice, a gradient not divided by the accumulation, a stage's
parameters left out of the norm, all move them by far more.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from pretrain.config import load_config
from pretrain.errors import ConfigError
from pretrain.resolve.run import lay_out_as_loaded
from pretrain.testing.runs import REPO, rel_diff, train
from pretrain.training.pipeline_schedules import stage_indices, stage_spans

STEPS, SAVE_AT = 10, 5
TOLERANCE = 1e-5
MODEL = ["model.num_layers=4", "train.micro_batch_size=1", "train.global_batch_size=4",
         f"train.steps={STEPS}"]
PIPELINE = ["train.engine=fsdp2", "deepspeed=ds_configs/zero2.json", "parallel.pipeline=2"]
ZERO3 = "deepspeed=ds_configs/zero3.json"  # weights freed after each unit's forward


def _norms(run) -> list[float]:
    return [r["grad_norm"] for r in run.records if r["kind"] == "train"]


def _evals(run) -> list[float]:
    return [r["loss"] for r in run.records if r["kind"] == "eval"]


def _assert_trains_like(run, reference, *, last: int = STEPS) -> None:
    losses, norms = run.losses[-last:], _norms(run)[-last:]
    ref_losses, ref_norms = reference.losses[-last:], _norms(reference)[-last:]
    assert rel_diff(losses, ref_losses) < TOLERANCE, (losses, ref_losses)
    assert rel_diff(norms, ref_norms) < TOLERANCE, (norms, ref_norms)


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    """One process under DeepSpeed, a validation pass at the end, final/ kept."""
    return train(tmp_path_factory.mktemp("ref"), tiny_data, name="single", overrides=[
        *MODEL, f"train.eval_interval={STEPS}", "train.eval_batches=1",
        "checkpoint.save_final=true"])


@pytest.mark.slow
@pytest.mark.parametrize("schedule, virtual, zero3", [
    ("1f1b", 1, True), ("interleaved_1f1b", 2, True), ("zero_bubble", 2, False),
    ("zbv", 2, False), ("dualpipe_v", 2, False)])
def test_each_schedule_trains_like_one_process(schedule, virtual, zero3, reference, tiny_data,
                                               tmp_path):
    """The split-backward (zero-bubble) schedules under ZeRO-2's JSON (ZeRO-3's is refused),
    the others under ZeRO-3's: the weights gathered again for each micro-batch's backward."""
    run = train(tmp_path, tiny_data, nprocs=2, name=schedule, overrides=[
        *MODEL, *PIPELINE, *([ZERO3] if zero3 else []), f"parallel.pipeline_schedule={schedule}",
        f"parallel.virtual_stages={virtual}", f"train.eval_interval={STEPS}",
        "train.eval_batches=1"])
    head = run.records[0]
    assert (head["engine"], head["pipeline"]) == ("fsdp2", 2)
    # the schedule torch runs, and rank 0's stages: looped, or the V's first and last
    ours = {"1f1b": "0 (layer specs 0-2)", "zbv": "0 (layer specs 0-1), 3 (layer specs 4-6)",
            "dualpipe_v": "0 (layer specs 0-1), 3 (layer specs 4-6)"}.get(
                schedule, "0 (layer specs 0-1), 2 (layer specs 3-3)")
    torch_name = {"1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
                  "zero_bubble": "ScheduleInterleavedZeroBubble",
                  "zbv": "ScheduleZBVZeroBubble", "dualpipe_v": "ScheduleDualPipeV"}[schedule]
    assert (f"[pipeline] {schedule} ({torch_name}): {2 * virtual} stages over 2 ranks, 4 "
            f"micro-batches a step; this rank holds stage {ours}") in run.stdout
    _assert_trains_like(run, reference)
    assert len(_evals(reference)) == 1
    assert rel_diff(_evals(run), _evals(reference)) < TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ["parallel.tensor=2", "parallel.sequence_parallel=true"],  # the norms' grads summed over tp
    ["parallel.context=2"],  # each stage's context ranks send their chunk
    # HSDP on each stage: its 2 data ranks as 2 replica groups of 1 shard (the gradients
    # all-reduced over the replicas, the norm and the checkpoint from the first group's)
    ["train.fsdp2_replicas=2"],
], ids=["tp2-sp", "cp2", "hsdp2"])
def test_interleaved_pipeline_composes_with_tensor_and_context_parallelism(
        overrides, reference, tiny_data, tmp_path):
    run = train(tmp_path, tiny_data, nprocs=4, name="pp2", overrides=[
        *MODEL, *PIPELINE, ZERO3, "parallel.pipeline_schedule=interleaved_1f1b",
        "parallel.virtual_stages=2", *overrides])
    if "train.fsdp2_replicas=2" in overrides:  # built, not only asked for
        assert run.records[0]["fsdp2_replicas"] == 2
        assert "x dp 2 (hsdp: 2 replica groups x 1 shard)" in run.stdout
    _assert_trains_like(run, reference)


@pytest.mark.slow
def test_a_checkpoint_resumes_under_another_schedule_and_on_one_process(reference, tiny_data,
                                                                        tmp_path):
    """Saved by interleaved 1F1B (two stages a rank), resumed by ZBV (the V placement: other
    stages on each rank) and by one process: both continue the reference's steps. The
    interleaved run's final/ is the reference's."""
    from safetensors.torch import load_file

    saver = train(tmp_path / "a", tiny_data, nprocs=2, name="interleaved", overrides=[
        *MODEL, *PIPELINE, "parallel.pipeline_schedule=interleaved_1f1b",
        "parallel.virtual_stages=2", f"checkpoint.save_interval={SAVE_AT}",
        "checkpoint.keep_last=2", "checkpoint.save_final=true"])
    ours = load_file(str(saver.run_dir / "final" / "model.safetensors"))
    ref = load_file(str(reference.run_dir / "final" / "model.safetensors"))
    assert sorted(ours) == sorted(ref)
    for name, tensor in ref.items():  # 10 Adam steps of lr 1e-3; reduction order only
        assert torch.allclose(ours[name], tensor, rtol=1e-4, atol=1e-6), name
    saved = saver.run_dir / "checkpoints" / f"step{SAVE_AT}"
    for nprocs, overrides in ((2, [*PIPELINE, "parallel.pipeline_schedule=zbv",
                                   "parallel.virtual_stages=2"]),
                              (1, ["train.engine=fsdp2", "deepspeed=ds_configs/zero3.json"])):
        where = tmp_path / f"resumed{nprocs}"
        shutil.copytree(saved, where / "run" / "checkpoints" / saved.name)
        run = train(where, tiny_data, nprocs=nprocs, name="run", overrides=[*MODEL, *overrides])
        assert f"[resume] from {where / 'run' / 'checkpoints' / saved.name}" in run.stdout
        _assert_trains_like(run, reference, last=STEPS - SAVE_AT)


TIED = [*MODEL, "model.tie_embeddings=true"]


@pytest.fixture(scope="module")
def tied_reference(tiny_data, tmp_path_factory):
    """One process of the tied model (the head is the embedding), final/ kept."""
    return train(tmp_path_factory.mktemp("tied_ref"), tiny_data, name="single",
                 overrides=[*TIED, "checkpoint.save_final=true"])


@pytest.mark.slow
@pytest.mark.parametrize("schedule, virtual, json, ranks", [
    ("interleaved_1f1b", 2, ZERO3, 2),  # the embedding on rank 0, the head's copy on rank 1
    ("zbv", 2, "deepspeed=ds_configs/zero2.json", 2),  # the V: both on rank 0, two FSDP2 roots
    ("1f1b", 1, ZERO3, 4),  # pipeline 4: the pair (ranks 0 and 3) a group of its own
])
def test_tied_embeddings_train_like_one_process(schedule, virtual, json, ranks, tied_reference,
                                                tiny_data, tmp_path):
    """The head's copy of the embedding starts equal to it and takes the summed gradient of
    both, counted once in the norm and written once: losses and gradient norms within 1e-5,
    final/ holds the reference's tensors, and the step-5 checkpoint resumes on one process
    under DeepSpeed as the reference's steps."""
    from safetensors.torch import load_file

    run = train(tmp_path, tiny_data, nprocs=ranks, name=schedule, overrides=[
        *TIED, *PIPELINE, json, f"parallel.pipeline={ranks}",
        f"parallel.pipeline_schedule={schedule}", f"parallel.virtual_stages={virtual}",
        "checkpoint.save_final=true",
        f"checkpoint.save_interval={SAVE_AT}", "checkpoint.keep_last=2"])
    _assert_trains_like(run, tied_reference)
    ours = load_file(str(run.run_dir / "final" / "model.safetensors"))
    ref = load_file(str(tied_reference.run_dir / "final" / "model.safetensors"))
    assert sorted(ours) == sorted(ref)
    for name, tensor in ref.items():
        assert torch.allclose(ours[name], tensor, rtol=1e-4, atol=1e-6), name
    saved = run.run_dir / "checkpoints" / f"step{SAVE_AT}"
    where = tmp_path / "resumed"
    shutil.copytree(saved, where / "run" / "checkpoints" / saved.name)
    resumed = train(where, tiny_data, name="run", overrides=TIED)
    assert f"[resume] from {where / 'run' / 'checkpoints' / saved.name}" in resumed.stdout
    _assert_trains_like(resumed, tied_reference, last=STEPS - SAVE_AT)


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv"])
def test_the_planner_counts_each_rank_s_stages_as_built_with_tied_embeddings(schedule):
    """The planner's parameters of each pipeline rank equal its stages built on the meta
    device: the head's stage holds its own copy of the tied embedding, on another rank
    (interleaved) or beside the embedding's stage on the same one (the V)."""
    from types import SimpleNamespace

    from pretrain.arithmetic import num_parameters, stage_items, stage_parameters
    from pretrain.resolve.topology import Topology
    from pretrain.training.pipeline_schedules import construct_stages

    cfg = load_config(REPO / "configs" / "tiny.yaml", [
        *TIED, *PIPELINE, f"parallel.pipeline_schedule={schedule}", "parallel.virtual_stages=2"])
    layout = lay_out_as_loaded(cfg, world_size=2).layout
    planned = [stage_parameters(cfg.model, layout, items)
               for items in stage_items(cfg.model, layout)]
    built = []
    for rank in range(2):
        groups = SimpleNamespace(topology=Topology(tensor=1, pipeline=2, world_size=2,
                                                   rank=rank), tensor=None, context=None)
        with torch.device("meta"):
            stages = construct_stages(cfg, groups)
        built.append(sum(p.numel() for p in stages.parameters()))
    assert planned == built
    vocab = cfg.model.padded_vocab_size(1) * cfg.model.hidden_size
    assert sum(built) == num_parameters(cfg.model) + vocab  # one more copy of the embedding


def test_stages_are_split_and_placed_as_torch_runs_them():
    # 4 layers on 4 stages: one each; the embedding opens, norm and head close the list
    assert stage_spans(4, 4) == [(0, 2), (2, 3), (3, 4), (4, 7)]
    assert stage_spans(5, 2) == [(0, 4), (4, 8)]  # the first stage takes the odd layer
    assert stage_indices(0, pipeline=2, virtual_stages=2, schedule="interleaved_1f1b") == [0, 2]
    assert stage_indices(1, pipeline=2, virtual_stages=2, schedule="zbv") == [1, 2]
    assert stage_indices(0, pipeline=4, virtual_stages=2, schedule="dualpipe_v") == [0, 7]
    with pytest.raises(ConfigError, match="every stage needs a decoder layer"):
        stage_spans(2, 4)


def _lay_out(overrides: list[str], *, world_size: int = 2):
    cfg = load_config(REPO / "configs" / "tiny.yaml", overrides)
    return lay_out_as_loaded(cfg, world_size=world_size)


def test_deepspeed_refuses_schedules_other_than_its_1f1b_before_launch():
    with pytest.raises(ConfigError, match="train.engine=fsdp2"):
        _lay_out(["parallel.pipeline=2", "parallel.pipeline_schedule=interleaved_1f1b",
                  "parallel.virtual_stages=2", "model.num_layers=4"])
    with pytest.raises(ConfigError, match="train.engine=fsdp2"):
        _lay_out(["parallel.pipeline=2", "parallel.pipeline_schedule=zero_bubble"])
    _lay_out(["parallel.pipeline=2"])  # its own 1F1B
    # fsdp2 runs them, at any ZeRO stage the JSON names
    _lay_out([*PIPELINE, ZERO3, "parallel.pipeline_schedule=interleaved_1f1b",
              "parallel.virtual_stages=2", "model.num_layers=4"])


@pytest.mark.parametrize("overrides, match", [
    (["parallel.pipeline_schedule=gpipe"], "choose one of 1f1b"),
    (["parallel.pipeline_schedule=zbv"], "parallel.virtual_stages=2"),
    (["parallel.virtual_stages=2"], "parallel.virtual_stages=1"),
    ([*PIPELINE, ZERO3, "parallel.pipeline_schedule=zbv", "parallel.virtual_stages=2"],
     "zero-bubble schedules compute weight gradients apart"),
    # torch's constructors would raise after launch: too few micro-batches for DualPipeV's 4
    # stages, or a count that is no multiple of the interleaved schedule's rounds
    ([*PIPELINE, "parallel.pipeline_schedule=dualpipe_v", "parallel.virtual_stages=2",
      "model.num_layers=4", "train.micro_batch_size=1", "train.global_batch_size=2"],
     "dualpipe_v with 2 micro-batches a step: DualPipeV needs at least its 4 stages"),
    ([*PIPELINE, "parallel.pipeline_schedule=interleaved_1f1b", "parallel.virtual_stages=2",
      "model.num_layers=4", "train.micro_batch_size=1", "train.global_batch_size=5"],
     "multiple of its 2 rounds"),
])
def test_schedule_settings_are_checked(overrides, match):
    with pytest.raises(ConfigError, match=match):
        _lay_out(overrides)
