"""The expert grid (expert ranks taken from the data ranks, `Topology.expert_groups`) under
`train.engine: fsdp2`: each MoE layer's local experts (`moe.LocalExperts`) are a `fully_shard`
unit of their own over the expert-data ranks (the ranks holding the same experts), their
gradients reduce-scattered there and divided by the data ranks; everything else is sharded over
the data group as without experts (`pretrain.training.fsdp2._shard_experts`).

Training runs against one process (fp32, 1e-5: losses, gradient norms, auxiliary losses; the
tokens per expert exactly): `configs/tiny_moe.yaml` (tests/test_moe.py's reference) on the
layouts of tests/test_expert_data_parallel.py, plus expert 2 over 4 data ranks, where the
experts are really sharded (2 ranks hold each), and the families' Qwen3-MoE and bias-balanced
DeepSeek-V3 (tests/test_families.py).
"""
from __future__ import annotations

import shutil
from collections import Counter

import pytest
import torch

from pretrain.testing.ranks import run_on_ranks
from tests.test_expert_data_parallel import (BUILT, GRID_LAYOUTS,
                                             moe_reference_batch8)  # noqa: F401
from tests.test_families import family_runs  # noqa: F401  (the families' references)
from tests.test_moe import STEPS, _assert_final_is_last_checkpoint, _assert_same_steps, _moe_train

FSDP2 = ["train.engine=fsdp2", "deepspeed=ds_configs/zero3.json"]

FSDP2_GRID = {  # name: (ranks, overrides): DeepSpeed's grid layouts (not its context, offload
    # and Muon rows: those are its engine's own) and fsdp2's
    **{name: GRID_LAYOUTS[name] for name in ("expert2_dp2", "expert2_tp2_etp2_dp2", "expert4_dp4",
                                             "expert2_cp2_dp2", "expert4_cp2_dp2_allgather")},
    # 2 ranks hold each expert: its unit sharded over them, its gradient reduce-scattered
    "expert2_dp4": (4, ["parallel.expert=2", "train.global_batch_size=8"]),
    # CPUOffloadPolicy: the expert units' shards, gradients and Adam's moments in host memory
    "expert2_dp2_offload": (2, ["parallel.expert=2",
                                "deepspeed=ds_configs/zero3_offload_cpu.json"]),
}


def test_fsdp2_runs_the_expert_grid_and_refuses_what_it_does_not_verify():
    """fsdp2 lays out every grid layout DeepSpeed's engine takes, at any ZeRO stage of its JSON
    (ZeRO-3 included, which DeepSpeed refuses and whose refusal names fsdp2), step checkpoints
    on, and pipelines (fsdp2's schedules); HSDP replicas of the grid are refused with the
    reason and the fix, as DeepSpeed's pipeline engine is (naming fsdp2)."""
    import dataclasses

    from pretrain.config import load_config
    from pretrain.errors import ConfigError
    from pretrain.resolve.layout import check_expert_grid_engine, check_layout
    from pretrain.resolve.run import resolve_layout
    from pretrain.resolve.topology import Topology
    from pretrain.testing.runs import REPO
    from tests.test_expert_data_parallel import _grid
    from tests.test_moe import CFG

    for fields in (dict(), dict(tensor=2, expert_tensor=2), dict(tensor=2, data=2, expert=4),
                   dict(data=4, expert=4), dict(data=4)):
        for stage in (1, 2, 3):
            layout = _grid(engine="fsdp2", zero_stage=stage, **fields)
            check_layout(CFG, layout)
            check_expert_grid_engine(layout)
    with pytest.raises(ConfigError, match=r"DeepSpeed refuses MoE parameter groups at ZeRO-3.*"
                                          r"set train.engine=fsdp2 \(the experts fully sharded"):
        check_expert_grid_engine(_grid(zero_stage=3))
    wide = dataclasses.replace(CFG, num_heads=8, num_kv_heads=4)
    check_layout(wide, _grid(engine="fsdp2", pipeline=2))  # fsdp2's schedules, not DeepSpeed's
    for layout, message in (
            (_grid(pipeline=2), "DeepSpeed's pipeline engine .*set train.engine=fsdp2"),
            (_grid(engine="fsdp2", data=4, fsdp2_replicas=2),
             "train.fsdp2_replicas=2 with .*set train.fsdp2_replicas=1")):
        with pytest.raises(ConfigError, match=message):
            check_layout(wide, layout)
    topo = Topology(tensor=1, pipeline=1, world_size=2, expert=2)
    saving = ["parallel.expert=2", "checkpoint.save_interval=3"]
    for engine in ("fsdp2", "deepspeed"):  # the grid's step checkpoints resume under either
        cfg = load_config(str(REPO / "configs" / "tiny_moe.yaml"),
                          [*saving, f"train.engine={engine}"])
        assert resolve_layout(cfg, topo).engine == engine


def test_the_planner_shards_fsdp2_experts_over_the_expert_data_ranks_and_searches_the_grid():
    """Under fsdp2 a grid layout's routed experts are sharded over the expert-data ranks, the
    rest over the data ranks; the search spreads experts over the grid at ZeRO-3, in pipelines
    and with context parallelism too, under ZeRO-3's JSON."""
    from dataclasses import replace

    from pretrain.arithmetic import stage_expert_parameters, stage_items, stage_parameters
    from pretrain.config import Engine, Precision, load_config
    from pretrain.plan.clusters import make_cluster
    from pretrain.plan.memory import fsdp2_stage_memory
    from pretrain.plan.search import search
    from pretrain.resolve.layout import Layout, expert_grid
    from pretrain.testing.runs import REPO

    moe = load_config(REPO / "configs" / "mixtral_8x7b.yaml").model
    layout = Layout(data=16, expert=8, global_batch=64, zero_stage=3, engine="fsdp2",
                    precision=Precision.BF16)
    (items,) = stage_items(moe, layout)
    n, experts = stage_parameters(moe, layout, items), stage_expert_parameters(moe, layout, items)
    memory = fsdp2_stage_memory(moe, layout, items)
    assert memory.params == pytest.approx(4 * (n - experts) / 16 + 4 * experts / 2)
    # the same shard as all experts over 16 ranks; what a layer gathers is 1/8 of the experts
    dense = replace(layout, expert=1)
    assert memory.buffers < fsdp2_stage_memory(moe, dense, stage_items(moe, dense)[0]).buffers
    plans = search(moe, make_cluster("h100-80gb", nodes=2), global_batch=64,
                   micro_batches=(1,), engine=Engine.FSDP2,
                   engines={(3, "none", "none")}, allow_offload=False,  # ZeRO-3's JSON only
                   contexts=(1, 2))
    grid = [p.layout for p in plans if expert_grid(p.layout)]
    assert grid and any(g.pipeline > 1 for g in grid) and any(g.context > 1 for g in grid)
    assert all(g.fsdp2_replicas == 1 for g in grid)


# where each layout's step-3 checkpoint resumes: (name, ranks, overrides); None: not resumed
RESUMES = {
    "expert2_dp2": ("same_layout", 2, [*FSDP2, "parallel.expert=2"]),
    # the experts split over the tensor pair, read back whole and cut again per expert rank
    "expert2_tp2_etp2_dp2": ("on_expert2_dp2", 2, [*FSDP2, "parallel.expert=2"]),
    # the other engine, one process
    "expert2_dp4": ("on_deepspeed", 1, ["train.global_batch_size=8"]),
    "expert4_dp4": None,
    "expert2_cp2_dp2": None,
    "expert4_cp2_dp2_allgather": None,
    "expert2_dp2_offload": None,
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", FSDP2_GRID)
def test_fsdp2_expert_grid_trains_like_one_process_and_resumes(layout, request, tiny_data,
                                                               tmp_path):
    """The tiny mixture on each grid layout under fsdp2 (ZeRO-3's JSON: the expert units freed
    after forward and gathered again for backward): 10 steps equal to one process; final/ is
    the last step checkpoint bitwise (each expert once, from the ranks holding it) and one
    process's last weights within 1e-5; the step-3 checkpoint continues like one process on the
    same layout, on another grid layout, or on DeepSpeed's engine."""
    from pretrain.checkpoint.weights import consolidate_engine_checkpoint, load_weights
    from tests.test_fsdp2_experts import SAVES

    nprocs, overrides = FSDP2_GRID[layout]
    batch8 = "train.global_batch_size=8" in overrides
    reference = request.getfixturevalue("moe_reference_batch8" if batch8 else "moe_reference")
    run = _moe_train(tmp_path, tiny_data, name=layout, nprocs=nprocs,
                     overrides=[*FSDP2, *overrides, *SAVES, "checkpoint.save_final=true"])
    built = {"engine": "fsdp2", "expert": int(next(o for o in overrides if o.startswith(
        "parallel.expert=")).split("=")[1]), **BUILT.get(layout, {})}
    assert {key: run.records[0][key] for key in built} == built
    _assert_same_steps(run, reference)
    _assert_final_is_last_checkpoint(run)
    final = load_weights(run.run_dir / "final").state
    single = consolidate_engine_checkpoint(reference.run_dir / "checkpoints" / f"step{STEPS}").state
    assert sorted(final) == sorted(single)
    for name, tensor in single.items():
        # 2e-5: Adam's steps of the rare tokens' nearly-zero embedding gradients magnify the
        # reduction order (one element of 32768 at tensor 2)
        torch.testing.assert_close(final[name], tensor, rtol=0, atol=2e-5, msg=name)
    if RESUMES[layout] is None:
        return
    name, ranks, resume = RESUMES[layout]
    saved = run.run_dir / "checkpoints" / "step3"
    shutil.copytree(saved, tmp_path / name / "checkpoints" / saved.name)
    resumed = _moe_train(tmp_path, tiny_data, name=name, nprocs=ranks, overrides=resume)
    assert "resharded" in resumed.stdout or name == "same_layout", resumed.stdout[-2000:]
    _assert_same_steps(resumed, reference, first_step=4)


@pytest.mark.slow
def test_a_deepspeed_checkpoint_of_one_process_continues_on_the_fsdp2_grid(moe_reference,
                                                                            tiny_data, tmp_path):
    """The one process's DeepSpeed step-3 checkpoint continued by fsdp2 at expert 2 x dp 2:
    each rank reads its experts' rows by name from DeepSpeed's flat partitions."""
    saved = moe_reference.run_dir / "checkpoints" / "step3"
    shutil.copytree(saved, tmp_path / "grid" / "checkpoints" / saved.name)
    resumed = _moe_train(tmp_path, tiny_data, name="grid", nprocs=2,
                         overrides=[*FSDP2, "parallel.expert=2"])
    assert resumed.records[0]["engine"] == "fsdp2" and "resharded" in resumed.stdout
    _assert_same_steps(resumed, moe_reference, first_step=4)


# ---- the families -------------------------------------------------------------------------------

def _family_grid_layouts() -> dict:
    """tests/test_families.py's expert-grid rows of Qwen3-MoE and the bias-balanced DeepSeek-V3,
    their DeepSpeed JSON swapped for fsdp2's (the same micro-batches and steps: the same
    one-process reference)."""
    from tests.test_families import FAMILY_LAYOUTS

    return {(shape, layout): (ranks, [*FSDP2, *(o for o in overrides
                                                 if not o.startswith("deepspeed="))])
            for (shape, layout), (ranks, overrides) in FAMILY_LAYOUTS.items()
            if layout in GRID_LAYOUTS and shape != "qwen3_moe_losses" or
            (shape, layout) == ("qwen3_moe_losses", "expert2_tp2_etp2_dp2")}


FAMILY_GRID = _family_grid_layouts()


@pytest.mark.slow
@pytest.mark.parametrize("shape, layout", FAMILY_GRID)
def test_fsdp2_expert_grid_trains_the_families_like_one_process(
        shape, layout, tiny_data, tmp_path, family_runs):  # noqa: F811
    """Qwen3-MoE (its experts split over the tensor pair too, or 2 of 8 on each of 4 ranks) and
    DeepSeek-V3 (sigmoid group-limited router, shared experts, the expert bias) on the grid
    under fsdp2: 10 steps' losses and gradient norms within 1e-5 of one process, the tokens
    per expert equal, the bias moved the same from every rank's loads (bitwise: sign steps of
    equal counts), and final/ exported equals transformers."""
    from pretrain.checkpoint.weights import load_weights
    from pretrain.testing.runs import rel_diff
    from tests.test_families import (HF_CLASSES, VOCAB, _assert_equals_transformers,
                                     _family_run, cli)

    ranks, overrides = FAMILY_GRID[shape, layout]
    imported, single = family_runs(shape, *(o for o in overrides if o.startswith("train.")))
    run = _family_run(tmp_path, tiny_data, shape, imported, nprocs=ranks, overrides=overrides,
                      name=layout)
    assert run.records[0]["engine"] == "fsdp2"
    ours, ref = ([r for r in x.records if r["kind"] == "train"] for x in (run, single))
    assert len(ours) == len(ref) == 10
    for key in ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss"):
        assert rel_diff([r[key] for r in ours], [r[key] for r in ref]) < 1e-5, key
    keys = ["moe_expert_tokens"] + (["moe_expert_bias"] if "bias" in shape else [])
    for key in keys:
        assert [r[key] for r in ours] == [r[key] for r in ref], key
    final = load_weights(run.run_dir / "final")
    if "bias" in shape:
        bias = "model.layers.1.mlp.gate.e_score_correction_bias"
        assert torch.equal(final.state[bias], load_weights(single.run_dir / "final").state[bias])
        assert not torch.equal(final.state[bias], load_weights(imported).state[bias])
    cli("export-hf", run.run_dir / "final", "--output", tmp_path / "hf", "--dtype", "fp32")
    hf = HF_CLASSES[shape].from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    ids = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(1))
    _assert_equals_transformers(final, hf, ids, prompt=5, new_tokens=8)


# ---- which group reduces which gradient ----------------------------------------------------------

def _fsdp2_grid_reductions_of_one_step(rank: int, world_size: int) -> dict:
    """One backward and step of fsdp2 with expert 2 over 4 data ranks (tensor 1), every
    reduction of torch.distributed recorded by group and size, and where each parameter lives."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from pretrain.testing.runs import REPO
    from tests.test_expert_data_parallel import one_grid_step_recorded

    engine, _, groups, seen = one_grid_step_recorded(
        rank, world_size, ["train.engine=fsdp2", f"deepspeed={REPO / 'ds_configs' / 'zero3.json'}"])
    params = dict(engine.module.named_parameters())
    experts = {n: p for n, p in params.items() if ".mlp.experts." in n}
    return {"seen": seen, "experts": sorted(experts),
            "expert_elements": sum(p.numel() for p in experts.values()),
            "other_elements": sum(p.numel() for n, p in params.items() if n not in experts),
            "meshes": {n: sorted(p.device_mesh.mesh.flatten().tolist()) for n, p in params.items()
                       if isinstance(p, DTensor)},
            "expert_data": sorted(dist.get_process_group_ranks(groups.expert_data))}


@pytest.mark.slow
def test_each_gradient_is_reduce_scattered_over_its_group_under_fsdp2(tmp_path):
    """fsdp2, expert 2 over 4 data ranks: each rank holds 2 of the 4 experts of each layer,
    sharded over the 2 ranks holding the same experts (rank r and r + 2), whose gradients are
    reduce-scattered over that pair, every element once; every other parameter sharded and its
    gradient reduce-scattered over the 4 data ranks; nothing is reduced over the expert group
    (the all-to-all only swaps tokens)."""
    results = run_on_ranks(_fsdp2_grid_reductions_of_one_step, world_size=4, tmp_path=tmp_path)
    for rank, result in enumerate(results):
        pair = [rank % 2, rank % 2 + 2]
        assert result["expert_data"] == pair
        held = sorted({n.split(".")[5] for n in result["experts"]})
        assert held == [str(2 * (rank % 2)), str(2 * (rank % 2) + 1)], (rank, held)
        assert len(result["experts"]) == 2 * 2 * 3  # 2 experts x 3 matrices x 2 layers
        for name, mesh in result["meshes"].items():
            assert mesh == (pair if name in result["experts"] else [0, 1, 2, 3]), (rank, name)
        sizes = Counter()
        for op, where, elements in result["seen"]:
            if elements > 1:  # the gradient norm's sums are single values
                assert op == "reduce_scatter_single", (op, where)
                sizes[where] += elements
        assert sizes == {"expert_data": result["expert_elements"],
                         "data": result["other_elements"]}, (rank, sizes)


# ---- pipelines --------------------------------------------------------------------------------

# 4 layers (4 stages of a V need a layer each), 8 micro-batches of 1 a step: 4 a data rank,
# as many as DualPipeV's stages
PIPE_MODEL = ["model.num_layers=4", "train.micro_batch_size=1", "train.global_batch_size=8"]


@pytest.fixture(scope="module")
def moe4_reference_batch8(tiny_data, tmp_path_factory):
    """One process under DeepSpeed, tiny_moe with `PIPE_MODEL`'s layers and batch."""
    return _moe_train(tmp_path_factory.mktemp("moe4_b8"), tiny_data, name="single",
                      overrides=PIPE_MODEL)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, virtual, json", [
    ("1f1b", 1, "zero3"), ("interleaved_1f1b", 2, "zero3"), ("zero_bubble", 2, "zero2"),
    ("zbv", 2, "zero2"), ("dualpipe_v", 2, "zero2")])
def test_pipeline2_expert_grid_equals_one_process(schedule, virtual, json, moe4_reference_batch8,
                                                  tiny_data, tmp_path):
    """4 ranks: 2 stages (4 interleaved or in a V) of 2 data ranks, which are each stage's
    expert ranks (2 whole experts each): each stage's expert units sharded over their
    expert-data ranks (here one), their gradients accumulated over the schedule's micro-batches
    (the zero-bubble schedules' weight gradients apart) and reduced at its end."""
    run = _moe_train(tmp_path, tiny_data, name=schedule, nprocs=4, overrides=[
        *PIPE_MODEL, "train.engine=fsdp2", f"deepspeed=ds_configs/{json}.json",
        "parallel.pipeline=2", "parallel.expert=2",
        f"parallel.pipeline_schedule={schedule}", f"parallel.virtual_stages={virtual}"])
    head = run.records[0]
    assert (head["engine"], head["pipeline"], head["data_parallel"]) == ("fsdp2", 2, 2)
    assert f"[pipeline] {schedule}" in run.stdout
    _assert_same_steps(run, moe4_reference_batch8)
