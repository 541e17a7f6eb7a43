"""Mixtures of experts under `train.engine: fsdp2` (pretrain/training/fsdp2.py): data-parallel and
tensor x expert layouts, pipelines with expert-parallel stages, checkpoints across engines, and
what fsdp2 refuses of experts before launch.

The references are single processes under DeepSpeed: `moe_reference` (configs/tiny_moe.yaml:
Mixtral-style, 2 layers of 4 experts top-2, the balance loss and z-loss on; tests/test_moe.py)
and the imported bias-balanced DeepSeek-V3 of tests/test_families.py. Every fsdp2 run must give
their losses, gradient norms and router statistics within 1e-5 (expert token counts exactly): an
auxiliary loss's gradient at the wrong scale, a router gradient not summed over the tensor
ranks, an expert counted twice in the norm or a bias not stepped all move them by far more.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from pretrain.config import load_config
from pretrain.errors import ConfigError
from pretrain.resolve.fsdp2_rules import layout_refusals
from pretrain.resolve.run import lay_out_as_loaded
from pretrain.testing.runs import REPO, rel_diff, train
from tests.test_families import family_runs  # noqa: F401  (the DeepSeek-V3 reference)
from tests.test_moe import (SAVE_AT, _assert_final_is_last_checkpoint,
                             _assert_same_steps, _moe_train)

FSDP2 = ["train.engine=fsdp2", "deepspeed=ds_configs/zero3.json"]
SAVES = [f"checkpoint.save_interval={SAVE_AT}", "checkpoint.keep_last=1",
         f"checkpoint.keep_every={SAVE_AT}"]


def _train_records(run) -> list[dict]:
    return [r for r in run.records if r["kind"] == "train"]


@pytest.mark.slow
def test_dp2_moe_equals_one_process_and_resumes_deepspeeds_checkpoint(moe_reference, tiny_data,
                                                                      tmp_path):
    """Two data ranks, each layer's experts and router sharded by fully_shard (ZeRO-3's JSON);
    then the one process's DeepSpeed step-3 checkpoint continued by fsdp2 on two data ranks."""
    run = _moe_train(tmp_path, tiny_data, name="dp2", nprocs=2, overrides=FSDP2)
    head = run.records[0]
    assert (head["engine"], head["data_parallel"]) == ("fsdp2", 2)
    _assert_same_steps(run, moe_reference)
    saved = moe_reference.run_dir / "checkpoints" / f"step{SAVE_AT}"
    shutil.copytree(saved, tmp_path / "resumed" / "checkpoints" / saved.name)
    resumed = _moe_train(tmp_path, tiny_data, name="resumed", nprocs=2, overrides=FSDP2)
    assert "resharded" in resumed.stdout
    _assert_same_steps(resumed, moe_reference, first_step=SAVE_AT + 1)


@pytest.mark.slow
def test_tp2_expert2_moe_equals_one_process_and_resumes_on_deepspeed(moe_reference, tiny_data,
                                                                      tmp_path):
    """Tensor 2 = expert 2 with sequence parallelism: each rank holds 2 whole experts (sharded
    over its data group, here itself), routes its half of the tokens and exchanges them by
    all-to-all; the router's gradient is summed over the pair at the step's end. Its final/ is
    its last checkpoint, each expert from the rank that held it; its step-3 checkpoint (experts
    whole in one tensor rank's file) continues under DeepSpeed on one process."""
    from pretrain.checkpoint.zero_shards import load_checkpoint_file

    run = _moe_train(tmp_path, tiny_data, name="ep2", nprocs=2, overrides=[
        *FSDP2, "parallel.tensor=2", "parallel.expert=2", "parallel.sequence_parallel=true",
        *SAVES, "checkpoint.save_final=true"])
    assert run.records[0]["engine"] == "fsdp2" and "ep2" in run.stdout
    _assert_same_steps(run, moe_reference)
    _assert_final_is_last_checkpoint(run)
    saved = run.run_dir / "checkpoints" / f"step{SAVE_AT}"
    held = load_checkpoint_file(saved / "fsdp2_rank00001.pt")["tensors"]
    experts = {n: e["shape"] for n, e in held.items() if ".mlp.experts." in n}
    assert sorted({n.split(".")[5] for n in experts}) == ["2", "3"]  # whole, global names
    assert tuple(experts["model.layers.0.mlp.experts.2.down_proj.weight"]) == (64, 96)
    shutil.copytree(saved, tmp_path / "resumed" / "checkpoints" / saved.name)
    resumed = _moe_train(tmp_path, tiny_data, name="resumed")
    assert resumed.records[0]["engine"] == "deepspeed" and "resharded" in resumed.stdout
    _assert_same_steps(resumed, moe_reference, first_step=SAVE_AT + 1)


@pytest.mark.slow
def test_deepseek_v3_with_the_bias_on_dp2_equals_one_process_and_resumes_on_tp2(
        tiny_data, tmp_path, family_runs):  # noqa: F811
    """The bias-balanced DeepSeek-V3 (sigmoid group-limited router, shared experts, layer 0
    dense) on two fsdp2 data ranks: the bias stepped from the loads of the whole batch, the
    same on each rank, as one process; saved at step 2 (the bias in every rank's file) and
    continued by fsdp2 at tensor 2 x expert 2 and by DeepSpeed on two data ranks, which both
    read it back (a bias lost or reset changes the experts chosen, so the losses)."""
    from pretrain.checkpoint.weights import load_weights
    from tests.test_families import _family_run

    shape = "deepseek_v3_moe_bias"
    imported, single = family_runs(shape)
    run = _family_run(tmp_path, tiny_data, shape, imported, nprocs=2, name="dp2", overrides=[
        *FSDP2, "checkpoint.save_interval=2", "checkpoint.keep_last=1",
        "checkpoint.keep_every=2"])
    assert run.records[0]["engine"] == "fsdp2"
    ours, ref = _train_records(run), _train_records(single)
    for key in ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss"):
        assert rel_diff([r[key] for r in ours], [r[key] for r in ref]) < 1e-5, key
    for key in ("moe_expert_tokens", "moe_expert_bias"):
        assert [r[key] for r in ours] == [r[key] for r in ref], key
    bias = "model.layers.2.mlp.gate.e_score_correction_bias"
    final, start = (load_weights(p).state[bias] for p in (run.run_dir / "final", imported))
    assert torch.equal(final, load_weights(single.run_dir / "final").state[bias])
    assert not torch.equal(final, start)  # moved by the balancing
    step = run.run_dir / "checkpoints" / "step2"
    for name, overrides in (("fsdp2_ep2", [*FSDP2, "parallel.tensor=2", "parallel.expert=2"]),
                            ("deepspeed_dp2", ["deepspeed=ds_configs/zero1.json"])):
        shutil.copytree(step, tmp_path / name / "checkpoints" / step.name)
        resumed = _family_run(tmp_path, tiny_data, shape, imported, nprocs=2, name=name,
                              overrides=overrides)
        assert "resharded" in resumed.stdout, name
        assert rel_diff(resumed.losses, single.losses[2:]) < 1e-5, (name, resumed.losses,
                                                                    single.losses)
        final = load_weights(resumed.run_dir / "final").state[bias]
        assert torch.equal(final, load_weights(single.run_dir / "final").state[bias]), name


# ---- pipelines with expert-parallel stages --------------------------------------------------------

PIPE_MODEL = ["model.num_layers=4", "train.micro_batch_size=1", "train.global_batch_size=4"]


@pytest.fixture(scope="module")
def moe4_reference(tiny_data, tmp_path_factory):
    """One process under DeepSpeed, tiny_moe with 4 layers (4 stages of 2 ranks need a layer
    each), 4 micro-batches of 1 a step."""
    return _moe_train(tmp_path_factory.mktemp("moe4"), tiny_data, name="single",
                      overrides=PIPE_MODEL)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, virtual, json", [
    ("1f1b", 1, "zero3"), ("interleaved_1f1b", 2, "zero3"), ("zero_bubble", 2, "zero2"),
    ("zbv", 2, "zero2"), ("dualpipe_v", 2, "zero2")])
def test_pipeline2_expert2_equals_one_process(schedule, virtual, json, moe4_reference, tiny_data,
                                              tmp_path):
    """4 ranks: 2 stages (4 interleaved, or 4 in a V: the first pipeline rank holds the first
    and the last, under zbv and dualpipe_v) of tensor 2 = expert 2: each stage's all-to-all
    inside its forward, the auxiliary losses' gradients from its layers' backward (the loss
    divided by the micro-batches before it; the zero-bubble schedules' backward split into input
    and weight gradients, under ZeRO-2's JSON), the router summed over the tensor pair. Torch's
    metadata inference at the first step (a forward of made-up tensors) counts in no
    statistic."""
    run = _moe_train(tmp_path, tiny_data, name=schedule, nprocs=4, overrides=[
        *PIPE_MODEL, "train.engine=fsdp2", f"deepspeed=ds_configs/{json}.json",
        "parallel.pipeline=2", "parallel.tensor=2", "parallel.expert=2",
        f"parallel.pipeline_schedule={schedule}", f"parallel.virtual_stages={virtual}"])
    head = run.records[0]
    assert (head["engine"], head["pipeline"], head["tensor"]) == ("fsdp2", 2, 2)
    assert f"[pipeline] {schedule}" in run.stdout
    _assert_same_steps(run, moe4_reference)


# ---- refusals ---------------------------------------------------------------------------------

def _lay_out(overrides: list[str], *, world_size: int = 2):
    cfg = load_config(REPO / "configs" / "tiny_moe.yaml", [*FSDP2, *overrides])
    return lay_out_as_loaded(cfg, world_size=world_size)


def test_fsdp2_lays_out_experts_over_the_tensor_ranks_and_refuses_the_rest():
    _lay_out([])  # dp 2
    _lay_out(["parallel.tensor=2", "parallel.expert=2"])
    with pytest.raises(ConfigError, match=r"train.fp8=tensorwise with model.num_experts=4"):
        _lay_out(["train.fp8=tensorwise", "train.precision=bf16"])
    with pytest.raises(ConfigError, match=r"train.optimizer=muon with parallel.expert=2"):
        _lay_out(["parallel.tensor=2", "parallel.expert=2", "train.optimizer=muon"])
    _lay_out(["model.compile=true"])  # compiled layers under fully_shard (tests/test_compile.py)
    # expert ranks from the data ranks (the expert grid): its own rules
    # (tests/test_fsdp2_expert_grid.py), none of these
    common = dict(num_experts=4, fp16=False, zero_stage=3, offload=["none", "none"],
                  where="zero3.json")
    assert layout_refusals(**common, expert=2, tensor=2) == []
    assert layout_refusals(**common) == []
    for grid in (dict(expert=2, tensor=1), dict(expert=4, tensor=2),
                 dict(expert=2, tensor=2, expert_tensor=2)):
        assert layout_refusals(**common, **grid) == []
