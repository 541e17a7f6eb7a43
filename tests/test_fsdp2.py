"""`train.engine: fsdp2` (pretrain/training/fsdp2.py) trains like one process, resumes exactly (its own
checkpoints and DeepSpeed's, in both directions), and refuses what it cannot do before launch.

The reference is one process of the tiny fp32 model (hidden 64, 2 layers, seq 32): 6 steps of a
global batch of 4, saved at step 3. Every fsdp2 run must give its losses and whole-model
gradient norms within 1e-5 relative: only the reduction order differs, while a gradient
averaged with a wrong scale or a shard counted twice moves the norm by far more (and the clip at
1.0 acts at most steps, so the norm also steers the update).
"""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from pretrain.config import load_config
from pretrain.errors import CheckpointError, ConfigError
from pretrain.resolve.run import lay_out_as_loaded
from pretrain.testing.faults import nan_loss_environment
from pretrain.testing.cli import run_cli
from pretrain.testing.ranks import run_on_ranks
from pretrain.testing.runs import REPO, rel_diff, run_pretrain, train, train_args

STEPS, SAVE_AT = 6, 3
SAVES = [f"train.steps={STEPS}", f"checkpoint.save_interval={SAVE_AT}", "checkpoint.keep_last=5",
         f"train.eval_interval={STEPS}", "train.eval_batches=1"]  # one validation, at the end
FSDP2 = ["train.engine=fsdp2", "deepspeed=ds_configs/zero3.json"]
TOLERANCE = 1e-5


def _train_records(run) -> list[dict]:
    return [r for r in run.records if r["kind"] == "train"]


def _grad_norms(run) -> list[float]:
    return [r["grad_norm"] for r in _train_records(run)]


def _assert_trains_like(run, reference, *, first_step: int = 1) -> None:
    """`run`'s steps from `first_step` on, against the reference's same steps."""
    count = STEPS - first_step + 1
    losses, norms = run.losses[-count:], _grad_norms(run)[-count:]
    ref_losses, ref_norms = reference.losses[-count:], _grad_norms(reference)[-count:]
    assert rel_diff(losses, ref_losses) < TOLERANCE, (losses, ref_losses)
    assert rel_diff(norms, ref_norms) < TOLERANCE, (norms, ref_norms)


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    """One process under DeepSpeed (ZeRO-1 at dp 1: the plain fp32 AdamW step), final/ kept."""
    return train(tmp_path_factory.mktemp("ref"), tiny_data, name="single",
                 overrides=[*SAVES, "checkpoint.save_final=true"])


@pytest.fixture(scope="module")
def fsdp2_dp2(tiny_data, tmp_path_factory):
    return train(tmp_path_factory.mktemp("fsdp2"), tiny_data, nprocs=2, name="dp2",
                 overrides=[*SAVES, *FSDP2, "checkpoint.save_final=true"])


def _resume(tmp_path, tiny_data, source, *, nprocs: int, overrides: list[str]):
    """A new run directory holding `source`'s step-3 checkpoint, trained to step 6."""
    saved = source.run_dir / "checkpoints" / f"step{SAVE_AT}"
    shutil.copytree(saved, tmp_path / "resumed" / "checkpoints" / saved.name)
    run = train(tmp_path, tiny_data, nprocs=nprocs, name="resumed",
                overrides=[f"train.steps={STEPS}", *overrides])
    assert f"[resume] from {tmp_path / 'resumed' / 'checkpoints' / saved.name}" in run.stdout
    assert [r["step"] for r in _train_records(run)] == list(range(SAVE_AT + 1, STEPS + 1))
    return run


@pytest.mark.slow
def test_dp2_trains_like_one_process_and_writes_the_same_final(fsdp2_dp2, reference, tmp_path):
    from safetensors.torch import load_file

    from pretrain.checkpoint.engine import to_universal
    from pretrain.checkpoint.weights import load_weights

    head = fsdp2_dp2.records[0]
    assert (head["engine"], head["data_parallel"]) == ("fsdp2", 2)
    assert reference.records[0]["engine"] == "deepspeed"
    assert head["param_dtypes"] == ["float32"] and head["zero_stage"] == 3
    _assert_trains_like(fsdp2_dp2, reference)
    evals = [[r["loss"] for r in run.records if r["kind"] == "eval"]
             for run in (fsdp2_dp2, reference)]
    assert len(evals[1]) == 1 and rel_diff(*evals) < TOLERANCE, evals
    saved = fsdp2_dp2.run_dir / "checkpoints" / f"step{SAVE_AT}"
    assert json.loads((saved / "meta.json").read_text())["layout"]["engine"] == "fsdp2"
    assert sorted(p.name for p in saved.glob("fsdp2_rank*.pt")) == \
        ["fsdp2_rank00000.pt", "fsdp2_rank00001.pt"]
    ours = load_file(str(fsdp2_dp2.run_dir / "final" / "model.safetensors"))
    ref = load_file(str(reference.run_dir / "final" / "model.safetensors"))
    assert sorted(ours) == sorted(ref)
    for name, tensor in ref.items():  # 6 Adam steps of lr 1e-3; reduction order only
        assert torch.allclose(ours[name], tensor, rtol=1e-4, atol=1e-6), name
    # the readers of engine checkpoints (export-hf, convert) see the last checkpoint's masters
    last = load_weights(fsdp2_dp2.run_dir)
    assert last.step == STEPS and sorted(last.state) == sorted(ours)
    for name, tensor in ours.items():
        assert torch.equal(last.state[name], tensor), name
    with pytest.raises(CheckpointError, match="train.engine=fsdp2"):  # DeepSpeed's format only
        to_universal(fsdp2_dp2.run_dir, tmp_path / "universal")


@pytest.mark.slow
def test_tp2_sp_dp2_with_recompute_and_cpu_offload_trains_like_one_process(tiny_data, tmp_path,
                                                                          reference):
    """4 ranks: fully_shard over each tensor rank's data group; sequence parallelism (each
    tensor rank's norms see half the tokens: their gradient shards are summed over the tensor
    group at the step's end); every layer recomputed; the ZeRO-3 JSON's CPU offload as
    CPUOffloadPolicy (the optimizer steps the host shards)."""
    run = train(tmp_path, tiny_data, nprocs=4, name="tp2dp2", overrides=[
        f"train.steps={STEPS}", "train.engine=fsdp2", "parallel.tensor=2",
        "parallel.sequence_parallel=true", "deepspeed=ds_configs/zero3_offload_cpu.json",
        "model.activation_checkpointing=full"])
    head = run.records[0]
    assert (head["engine"], head["tensor"], head["data_parallel"]) == ("fsdp2", 2, 2)
    assert head["sequence_parallel"] is True
    assert (head["offload_optimizer"], head["offload_param"]) == ("cpu", "cpu")
    _assert_trains_like(run, reference)


def _bf16_step(rank: int, world_size: int) -> dict:
    """One forward and backward of the tiny model sharded with bf16's policy: the dtype a
    decoder layer's weight has inside its forward, and the shards' and gradients' dtypes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from pretrain.training.fsdp2 import shard_model
    from pretrain.model import build_model

    cfg = load_config("configs/tiny.yaml", overrides=["model.vocab_size=512"])
    model = build_model(cfg.model, seed=0)
    mesh = DeviceMesh.from_group(dist.new_group(list(range(world_size))), device_type="cpu")
    shard_model(model, mesh, reshard_after_forward=True, bf16=True, offload=False)
    seen = []
    norm = model.model.layers[0].post_attention_layernorm  # inside the layer's FSDP2 unit
    norm.register_forward_hook(lambda module, *_: seen.append(module.weight.dtype))
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(rank))
    model(ids, labels=ids).backward()
    return {"in_forward": str(seen[0]),
            "shards": sorted({str(p.dtype) for p in model.parameters()}),
            "grads": sorted({str(p.grad.dtype) for p in model.parameters()})}


@pytest.mark.slow
def test_bf16_computes_in_bf16_over_fp32_shards_and_fp32_gradients(tmp_path):
    """MixedPrecisionPolicy as `shard_model` sets it for train.precision=bf16: a layer's
    gathered weights are bf16 inside its forward; the shards the optimizer steps (the masters)
    and their gradients stay fp32. (2 ranks in-process, one step, no training run. FSDP2 hands
    fp32 gradients to the shards whatever the reduce dtype: that it reduces in fp32 is not
    observable here.)"""
    from pretrain.testing.ranks import run_on_ranks

    for result in run_on_ranks(_bf16_step, world_size=2, tmp_path=tmp_path):
        assert result == {"in_forward": "torch.bfloat16", "shards": ["torch.float32"],
                          "grads": ["torch.float32"]}, result


@pytest.mark.slow
def test_context_parallel_trains_like_one_process(tiny_data, tmp_path, reference):
    """Context 2: both ranks hold the same weights (FSDP2 shards over data x context, as
    ZeRO partitions) and each gives its chunk's share of the loss; gradient accumulation 2.
    The ZeRO-2 JSON: weights stay gathered from each layer's forward to its backward."""
    run = train(tmp_path, tiny_data, nprocs=2, name="cp2", overrides=[
        f"train.steps={STEPS}", "train.engine=fsdp2", "deepspeed=ds_configs/zero2.json",
        "parallel.context=2"])
    head = run.records[0]
    assert (head["context"], head["data_parallel"], head["grad_accum"]) == (2, 1, 2)
    assert head["zero_stage"] == 2
    _assert_trains_like(run, reference)


@pytest.mark.slow
def test_a_tied_head_trains_like_one_process(tiny_data, tmp_path):
    """The embedding and the tied head are one parameter in the root FSDP2 unit."""
    tied = ["train.steps=3", "model.tie_embeddings=true"]
    single = train(tmp_path, tiny_data, name="single", overrides=tied)
    run = train(tmp_path, tiny_data, nprocs=2, name="fsdp2", overrides=[*tied, *FSDP2])
    assert rel_diff(run.losses, single.losses) < TOLERANCE, (run.losses, single.losses)
    assert rel_diff(_grad_norms(run), _grad_norms(single)) < TOLERANCE


@pytest.mark.slow
def test_a_nonfinite_step_is_skipped_with_its_schedule(tiny_data, tmp_path):
    """A NaN loss on rank 0 at step 2: every rank skips the update (the norm is the whole
    grid's), the schedule stays, and the weights and Adam's state saved at steps 1 and 2 are
    bitwise the same on both ranks' files."""
    run_dir = tmp_path / "nan"
    run = run_pretrain(train_args(run_dir, tiny_data, overrides=[
        "train.steps=3", *FSDP2, "checkpoint.save_interval=1", "checkpoint.keep_last=5"]),
        run_dir=run_dir, nprocs=2, env=nan_loss_environment({2}, directory=tmp_path)).check()
    records = _train_records(run)
    assert [r["update_skipped"] for r in records] == [False, True, False]
    assert records[2]["lr"] == records[1]["lr"] and records[-1]["skipped_steps"] == 1
    assert math.isfinite(records[2]["loss"])
    for rank in (0, 1):
        one, two = (torch.load(run_dir / "checkpoints" / f"step{step}" / f"fsdp2_rank{rank:05d}.pt",
                               weights_only=True)["tensors"] for step in (1, 2))
        for name, entry in one.items():
            for key in ("master", "exp_avg", "exp_avg_sq"):
                assert torch.equal(entry[key], two[name][key]), (rank, name, key)


@pytest.mark.slow
def test_resume_in_its_run_dir_gives_bitwise_the_same_steps(fsdp2_dp2, tiny_data, tmp_path):
    resumed = _resume(tmp_path, tiny_data, fsdp2_dp2, nprocs=2, overrides=FSDP2)
    after, before = _train_records(resumed), _train_records(fsdp2_dp2)[SAVE_AT:]
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in after] == [r[key] for r in before], key


@pytest.mark.slow
def test_a_deepspeed_checkpoint_resumes_under_fsdp2_and_back(fsdp2_dp2, reference, tiny_data,
                                                           tmp_path):
    """DeepSpeed (one process) -> fsdp2 at tp 2 (each rank reads its tensor shard's rows), and
    fsdp2's dp-2 checkpoint -> DeepSpeed on one process: each continues the reference's steps
    4-6. (Resuming fsdp2 on its own layout reads its files the same way.)"""
    into_fsdp2 = _resume(tmp_path / "a", tiny_data, reference, nprocs=2,
                         overrides=[*FSDP2, "parallel.tensor=2"])
    assert "resharded" in into_fsdp2.stdout
    _assert_trains_like(into_fsdp2, reference, first_step=SAVE_AT + 1)
    into_deepspeed = _resume(tmp_path / "b", tiny_data, fsdp2_dp2, nprocs=1, overrides=[])
    assert "resharded" in into_deepspeed.stdout
    _assert_trains_like(into_deepspeed, reference, first_step=SAVE_AT + 1)


@pytest.mark.slow
def test_hsdp_trains_like_one_process_and_its_checkpoint_resumes_on_other_layouts(
        tiny_data, tmp_path, reference):
    """dp 4 as 2 replica groups x 2 shards (HSDP: reduce-scatter in a group, all-reduce across
    the groups): one process's steps; the first group alone writes the checkpoint, which
    resumes under HSDP again, under plain fsdp2 at dp 2 and under DeepSpeed on one process,
    each continuing the uninterrupted HSDP run."""
    hsdp = [*FSDP2, "train.fsdp2_replicas=2", "train.micro_batch_size=1"]
    run = train(tmp_path, tiny_data, nprocs=4, name="hsdp", overrides=[*SAVES, *hsdp])
    head = run.records[0]
    assert (head["engine"], head["data_parallel"]) == ("fsdp2", 4)
    _assert_trains_like(run, reference)
    saved = run.run_dir / "checkpoints" / f"step{SAVE_AT}"
    assert sorted(p.name for p in saved.glob("fsdp2_rank*.pt")) == \
        ["fsdp2_rank00000.pt", "fsdp2_rank00001.pt"]
    for nprocs, overrides in ((4, hsdp), (2, FSDP2), (1, [])):
        resumed = _resume(tmp_path / f"on{nprocs}", tiny_data, run, nprocs=nprocs,
                          overrides=overrides)
        _assert_trains_like(resumed, run, first_step=SAVE_AT + 1)


# vocabulary 500: tensor 2 pads it, so one tensor rank's shard ends in zero rows
SHARDED_BUILD = ["model.vocab_size=500", "model.tie_embeddings=false", "parallel.tensor=2",
                 "train.micro_batch_size=1", "train.global_batch_size=2", *FSDP2]


def _sharded_build(rank: int, world_size: int, init_from: str | None) -> dict:
    """Build the fsdp2 engine at tensor 2 x data 2 as a run does (`build_engine`), recording
    whether `fully_shard` met only meta-device parameters and the largest storage any operation
    created on a real device (a DTensor's: its local shard's); this rank's FSDP2 rows of each
    parameter, from the seed or from `init_from`."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from pretrain.dist import init_deepspeed_comm
    from pretrain.model import canonical_parameters
    from pretrain.resolve.run import resolve_ds_config
    from pretrain.resolve.topology import Topology
    from pretrain.training import fsdp2
    from pretrain.training.engine import build_engine

    class Largest(TorchDispatchMode):
        size = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                local = t._local_tensor if isinstance(t, DTensor) else t
                if isinstance(local, torch.Tensor) and not local.is_meta:
                    self.size = max(self.size, local.untyped_storage().nbytes())
            return out

    cfg = load_config(REPO / "configs/tiny.yaml", [
        *SHARDED_BUILD, f"run_dir={REPO}/runs/unused",
        *([f"model.init_from={init_from}"] if init_from else [])])
    init_deepspeed_comm(dist_backend="gloo", verbose=False)
    ds_config = resolve_ds_config(cfg, world_size=world_size)
    groups = Topology.from_parallel_config(cfg.parallel, world_size=world_size,
                                           rank=rank).create_groups()
    met, shard = [], fsdp2.fully_shard

    def recording(module, **options):
        met.extend(p.is_meta for p in module.parameters())
        return shard(module, **options)

    fsdp2.fully_shard, largest = recording, Largest()
    try:
        with largest:
            engine = build_engine(cfg, ds_config, groups, main=False)
    finally:
        fsdp2.fully_shard = shard
    return {"tensor_rank": groups.topology.my_coords.tensor, "meta": met,
            "largest": largest.size,
            "rows": {name: (fsdp2._first_row(p), fsdp2._local(p.detach()).clone())
                     for name, p in canonical_parameters(engine.module, cfg.model)}}


def test_fsdp2_builds_each_rank_its_shard_only_bitwise_as_one_process(tmp_path):
    """tensor 2 x data 2: `fully_shard` meets only meta-device parameters, and building the
    seeded model creates no storage larger than the largest FSDP2 shard or one initialisation
    block (the whole tensor-parallel model was built on every rank before, its embedding
    twice the bound); `init_from` reads one whole tensor at a time. Each rank's rows are
    bitwise those of one process's model, seeded or read from `init_from`."""
    from pretrain.checkpoint.weights import Weights, write_final
    from pretrain.model import build_model
    from pretrain.model.llama import INIT_BLOCK, gather_full_state_dict, shard_of

    cfg = load_config(REPO / "configs/tiny.yaml", SHARDED_BUILD)
    seeded = gather_full_state_dict(build_model(cfg.model, seed=cfg.train.seed))
    other = gather_full_state_dict(build_model(cfg.model, seed=cfg.train.seed + 7))
    write_final(Weights(model=cfg.model, state=other, tokenizer=None, source="seed + 7"),
                tmp_path / "final")
    for init_from, full in ((None, seeded), (str(tmp_path / "final"), other)):
        results = run_on_ranks(_sharded_build, world_size=4, tmp_path=tmp_path,
                               args=(init_from,))
        shards = [rows for r in results for _, rows in r["rows"].values()]
        block = INIT_BLOCK * cfg.model.hidden_size * 4  # the widest block drawn: fp32 rows
        bound = max(block, max(t.numel() * 4 for t in shards))
        if init_from:  # `load_initial_weights` reads one whole tensor at a time, at most
            bound = max(bound, max(t.numel() * 4 for t in full.values()))
        for result in results:
            assert result["meta"] and all(result["meta"]), result["meta"]
            assert result["largest"] <= bound, (result["largest"], bound)
            for name, (first, rows) in result["rows"].items():
                mine = shard_of(full[name], name, cfg=cfg.model, tp_rank=result["tensor_rank"],
                                tp_size=2)
                assert torch.equal(rows, mine[first:first + len(rows)]), (name, init_from)


def _refusal(overrides: list[str], *, world_size: int = 2) -> str:
    cfg = load_config("configs/tiny.yaml", overrides=["train.engine=fsdp2", *overrides])
    with pytest.raises(ConfigError) as error:
        lay_out_as_loaded(cfg, world_size=world_size)
    return str(error.value)


@pytest.mark.parametrize("overrides, reason", [
    (["deepspeed=ds_configs/zero3_offload_nvme.json"], "offloads to cpu only"),
    (["deepspeed=ds_configs/zero0.json"], "ZeRO stage 0"),
    (["train.precision=fp16", "deepspeed=ds_configs/zero3.json"], "no loss scaling"),
    (["train.fsdp2_replicas=3", "deepspeed=ds_configs/zero3.json"],
     "must divide the 2 data-parallel ranks"),
])
def test_settings_fsdp2_cannot_honour_are_refused(overrides, reason):
    assert reason in _refusal(overrides)


def test_hsdp_replicas_need_the_fsdp2_engine():
    with pytest.raises(ConfigError, match="only with train.engine=fsdp2"):
        load_config("configs/tiny.yaml", overrides=["train.fsdp2_replicas=2"])


def test_the_default_engine_is_deepspeed_and_its_layout_is_unchanged():
    cfg = load_config("configs/tiny.yaml")
    run = lay_out_as_loaded(cfg, world_size=1)
    assert cfg.train.engine.value == "deepspeed" and "engine" not in run.checkpoint_layout


@pytest.mark.slow
def test_pretrain_train_refuses_what_fsdp2_cannot_honour_before_launch(tiny_data, tmp_path):
    """fp16 (fsdp2 has no loss scaling), through the real launcher: exit 2 before any rank."""
    run = run_pretrain(train_args(tmp_path / "run", tiny_data, overrides=[
        "train.engine=fsdp2", "deepspeed=ds_configs/zero3.json", "train.precision=fp16"]),
        run_dir=tmp_path / "run", nprocs=2)
    assert run.returncode == 2, (run.stdout[-2000:], run.stderr[-2000:])
    assert "no loss scaling" in run.stdout + run.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_pretrain_plan_shows_and_plans_the_fsdp2_engine():
    """The plan names fsdp2 and what it makes of the JSON's stage, and its memory is fsdp2's
    (`pretrain.plan.memory.fsdp2_stage_memory`: 16 bytes of states per parameter / ranks)."""
    args = ["plan", "--config", "configs/tiny.yaml", "--set", "train.engine=fsdp2",
            "--set", "model.vocab_size=512", "--world-size", "2"]
    run = run_cli(args, cwd=REPO)
    assert run.returncode == 0, run.stderr[-2000:]
    assert ("engine  fsdp2 (fully_shard per decoder layer, the JSON's ZeRO-1: kept gathered "
            "from forward to backward) | offload optimizer=none param=none | fp32") in run.stdout
    assert "planned as DeepSpeed's" not in run.stdout
    planned = run_cli([*args, "--json"], cwd=REPO)
    assert planned.returncode == 0, planned.stderr[-2000:]
    plan = json.loads(planned.stdout)
    assert plan["engine"] == "fsdp2"
    states = sum(plan["memory_gb"][k] for k in ("params", "grads", "optimizer"))
    assert states * 2**30 == pytest.approx(16 * plan["parameters"] / 2, rel=1e-9)
