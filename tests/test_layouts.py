"""3D layouts through the real `pretrain train`: every (tp, pp, dp) trains the same model.

The reference is the single-process run of the same global batch (4 samples per step); each
layout's 10 fp32 losses, gradient norms and validation losses must match it within 1e-4 relative
(tensor-parallel reductions sum in another order, so the match is close, not bitwise). Gradient
norms are compared wherever losses are: Adam's update hardly moves when a gradient is scaled by
one factor, so the losses alone would not show a reduction with the wrong scale.
"""
from __future__ import annotations

import pytest
import torch

from pretrain.testing.runs import rel_diff, train

pytestmark = pytest.mark.slow  # training runs through the launchers (quick tier: not slow)

STEPS = 10
EVAL = ["train.eval_interval=5", "train.eval_batches=2"]  # validation at steps 5 and 10


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    """The single-process run, with its final/ weights for the layouts that write theirs."""
    run = train(tmp_path_factory.mktemp("ref"), tiny_data, name="single",
                overrides=[f"train.steps={STEPS}", *EVAL, "checkpoint.save_final=true"])
    assert run.records[0]["sequence_parallel"] is False
    return run


def _eval_losses(run) -> list[float]:
    losses = [r["loss"] for r in run.records if r["kind"] == "eval"]
    assert len(losses) == 2, run.records
    return losses


def _grad_norms(run) -> list[float]:
    return [r["grad_norm"] for r in run.records if r["kind"] == "train"]


def _assert_trains_like(run, reference, tolerance: float = 1e-4) -> None:
    """Same training losses and global gradient norms (before clipping), step by step."""
    assert rel_diff(run.losses, reference.losses) < tolerance, (run.losses, reference.losses)
    assert rel_diff(_grad_norms(run), _grad_norms(reference)) < tolerance, \
        (_grad_norms(run), _grad_norms(reference))


def _assert_same_final(run, reference) -> None:
    """final/ of `run` holds every tensor of the reference's final/, each in its place.

    10 Adam steps of lr 1e-3 move weights by ~1e-2; tensor parallelism's other summation order
    moves a few elements with near-zero gradients (where Adam's update is ~lr) by up to ~5e-6:
    rtol 1e-4 with atol 2e-5 passes that and fails a shard written in another's place."""
    from safetensors.torch import load_file

    ours = load_file(str(run.run_dir / "final" / "model.safetensors"))
    ref = load_file(str(reference.run_dir / "final" / "model.safetensors"))
    assert sorted(ours) == sorted(ref)
    for name, tensor in ref.items():
        assert ours[name].dtype == tensor.dtype == torch.float32, name
        assert ours[name].shape == tensor.shape, name
        assert torch.allclose(ours[name], tensor, rtol=1e-4, atol=2e-5), \
            (name, (ours[name] - tensor).abs().max().item())


def _layout(tmp_path, tiny_data, *, tp, pp, dp, zero, extra=(), launcher=None, name="layout"):
    return train(tmp_path, tiny_data, nprocs=tp * pp * dp, launcher=launcher, name=name,
                 overrides=[f"train.steps={STEPS}", f"parallel.tensor={tp}",
                            f"parallel.pipeline={pp}", f"deepspeed=ds_configs/zero{zero}.json",
                            *EVAL, *extra])


@pytest.mark.parametrize("tp, pp, dp, zero", [
    (1, 2, 1, 1),
    (2, 2, 1, 1),
    (1, 2, 2, 1),
    (2, 1, 1, 0),
    (2, 1, 1, 1),
    (2, 1, 2, 1),
    (2, 1, 2, 2),
    (2, 1, 2, 3),
])
def test_layout_matches_single_process(tp, pp, dp, zero, tiny_data, tmp_path, reference):
    run = _layout(tmp_path, tiny_data, tp=tp, pp=pp, dp=dp, zero=zero)
    head = run.records[0]
    assert (head["tensor"], head["pipeline"], head["data_parallel"]) == (tp, pp, dp)
    assert head["zero_stage"] == zero and head["sequence_parallel"] is False
    # the global gradient norm counts every shard once (DeepSpeed's mpu / our ZeRO-0 norm)
    _assert_trains_like(run, reference)
    # validation (the pipeline engine's inference schedule when pp > 1) sees the same loss
    assert rel_diff(_eval_losses(run), _eval_losses(reference)) < 1e-4


def test_sequence_parallel_matches_single_process(tiny_data, tmp_path, reference):
    run = _layout(tmp_path, tiny_data, tp=2, pp=1, dp=1, zero=1,
                  extra=["parallel.sequence_parallel=true"])
    assert run.records[0]["sequence_parallel"] is True  # every layer of the model as built
    # the norm weights' gradients are summed over the sequence shards: a missing or doubled
    # sum shows in the gradient norm even where Adam's update hides it
    _assert_trains_like(run, reference)
    assert rel_diff(_eval_losses(run), _eval_losses(reference)) < 1e-4


def test_tp2_dp2_through_deepspeed_launcher_writes_consolidated_final(tiny_data, tmp_path,
                                                                      reference):
    """A 4-rank layout under the real `deepspeed` launcher; final/ holds the unsharded model:
    every tensor equal to the single-process run's, so a shard in the wrong place fails."""
    run = _layout(tmp_path, tiny_data, tp=2, pp=1, dp=2, zero=1, launcher="deepspeed",
                  extra=["checkpoint.save_final=true"])
    assert run.records[0]["launcher"] == "deepspeed"
    _assert_trains_like(run, reference)
    _assert_same_final(run, reference)


@pytest.mark.parametrize("tp, pp, dp", [(1, 2, 1), (2, 2, 1)])
def test_final_weights_of_a_pipeline_equal_the_single_process_run(tp, pp, dp, tiny_data, tmp_path):
    """final/ gathers every stage's (and tensor shard's) weights into one Hugging Face file."""
    from safetensors.torch import load_file

    final = ["checkpoint.save_final=true", "model.tie_embeddings=true"]
    single = train(tmp_path, tiny_data, name="single_tied",
                   overrides=[f"train.steps={STEPS}", *final])
    run = _layout(tmp_path, tiny_data, tp=tp, pp=pp, dp=dp, zero=1, extra=final)
    _assert_trains_like(run, single)
    _assert_same_final(run, single)
    ours = load_file(str(run.run_dir / "final" / "model.safetensors"))
    assert "lm_head.weight" not in ours  # tied: stored once


def test_pipelined_evaluation_in_chunks_matches_single_process(tiny_data, tmp_path):
    """A pipeline evaluates in calls of PIPELINE_EVAL_CHUNK x stages micro-batches (so that a
    stop request waits for one call): 12 micro-batches at pp 2 are two calls, 8 + 4, whose
    weighted mean is the single process's validation loss."""
    from pretrain.training.evaluators import PIPELINE_EVAL_CHUNK

    micro_batches = 12  # eval_batches 3 x accum 4 (global batch 4, micro-batch 1, dp 1)
    assert PIPELINE_EVAL_CHUNK * 2 < micro_batches
    overrides = ["train.steps=2", "train.eval_interval=2", "train.eval_batches=3",
                 "train.micro_batch_size=1"]
    single = train(tmp_path, tiny_data, name="single", overrides=overrides)
    piped = train(tmp_path, tiny_data, nprocs=2, name="pp2",
                  overrides=[*overrides, "parallel.pipeline=2"])
    evals = [[r["loss"] for r in run.records if r["kind"] == "eval"] for run in (piped, single)]
    assert len(evals[1]) == 1
    assert rel_diff(*evals) < 1e-4
