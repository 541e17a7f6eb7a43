"""Expert parallelism beyond the tensor group (the expert grid, `Topology.expert_groups`): the
experts of a layer spread over ranks taken from the data ranks, whole (expert_tensor 1) or each
split over the tensor ranks (expert_tensor = tensor); their gradients reduced and ZeRO-1/2
partitioned over the expert-data ranks through DeepSpeed's MoE parameter groups
(`training.engine.experts_reduced_over_expert_data`).

Training runs against one process (fp32, 1e-5, losses, gradient norms and the routers'
statistics of every step) use `configs/tiny_moe.yaml` (tests/test_moe.py's reference) and the
families' Qwen3-MoE and DeepSeek-V3 rows (tests/test_families.py's FAMILY_LAYOUTS).
"""
from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from pretrain.errors import ConfigError
from pretrain.resolve.layout import Layout, check_engine, check_layout
from pretrain.testing.ranks import run_on_ranks
from pretrain.resolve.topology import Topology
from tests.test_moe import CFG, _assert_close

def _grid(**fields) -> Layout:
    """expert 2 from 2 data ranks (tensor 1), ZeRO-1, fp32: what the grid runs."""
    from pretrain.config import Precision

    return Layout(**{"tensor": 1, "data": 2, "expert": 2, "micro_batch": 1, "global_batch": 8,
                     "zero_stage": 1, "precision": Precision.FP32, **fields})


def test_expert_grid_layouts_the_stack_cannot_run_are_refused_with_the_reason_and_fix():
    import dataclasses

    from pretrain.config import Precision
    from pretrain.resolve.layout import check_expert_grid_engine, expert_grid

    for ok in (_grid(), _grid(zero_stage=2), _grid(tensor=2, expert=2, expert_tensor=2),
               _grid(tensor=2, data=2, expert=4), _grid(data=4, expert=4),
               _grid(precision=Precision.BF16, zero_stage=2),
               # what composes with the grid: context (ulysses, all-gather), CPU Adam, Muon
               _grid(context=2, data=1), _grid(context=2, context_kind="allgather", expert=4),
               _grid(zero_stage=2, offload_optimizer="cpu"), _grid(optimizer="muon")):
        check_layout(CFG, ok)
        check_expert_grid_engine(ok)
        assert expert_grid(ok)
    assert not expert_grid(_grid(tensor=2, expert=2))  # the tensor ranks: every layout runs
    check_expert_grid_engine(_grid(tensor=2, expert=2, zero_stage=3))
    engine_refusals = [
        (_grid(zero_stage=0), r"zero_optimization.stage=0 with parallel.expert=2 .*ZeRO-0 "
                              r"all-reduces every gradient over the data group.*zero1.json"),
        (_grid(zero_stage=3), "DeepSpeed refuses MoE parameter groups at ZeRO-3"),
        (_grid(tensor=2, expert=2, expert_tensor=2, zero_stage=3),
         r"or the tensor ranks as expert ranks \(parallel.expert=2, parallel.expert_tensor=1\)"),
        (_grid(precision=Precision.BF16), "bf16 at ZeRO-1 .*BF16_Optimizer.*zero2.json"),
    ]
    for layout, message in engine_refusals:
        with pytest.raises(ConfigError, match=message):
            check_expert_grid_engine(layout)
    layout_refusals = [
        (_grid(pipeline=2), "parallel.pipeline=2 with .*MoE parameter groups"),
        (_grid(tensor=4, data=2, expert=2), r"set parallel.expert to a multiple of 4"),
    ]
    for layout, message in layout_refusals:
        with pytest.raises(ConfigError, match=message):
            check_layout(dataclasses.replace(CFG, num_heads=8, num_kv_heads=4), layout)


def test_step_checkpoints_of_the_expert_grid_are_taken_and_their_layout_compared():
    """The grid saves step checkpoints; resuming one compares its layout with each expert's
    split (a run at expert = tensor 2 with the experts whole is another layout than expert 2 x
    expert_tensor 2), and DeepSpeed's universal conversion of one is refused with the fix."""
    from pretrain.checkpoint.engine import _check_convertible, expert_grid_layout
    from pretrain.config import load_config
    from pretrain.errors import CheckpointError
    from pretrain.resolve.run import layout_change, resolve_layout
    from pretrain.testing.runs import REPO

    topo = Topology(tensor=1, pipeline=1, world_size=2, expert=2)
    cfg = load_config(str(REPO / "configs" / "tiny_moe.yaml"),
                      ["parallel.expert=2", "checkpoint.save_interval=3"])
    assert resolve_layout(cfg, topo).expert == 2
    base = {"tensor": 2, "pipeline": 1, "data": 1, "expert": 2, "zero_stage": 1}
    split = {**base, "expert_tensor": 2}
    assert layout_change(base, {**base, "expert_tensor": 1}) is None
    assert layout_change(base, split) == "tp2 pp1 ep2 dp1 ZeRO-1 -> tp2 pp1 ep2 etp2 dp1 ZeRO-1"
    assert not expert_grid_layout(base) and expert_grid_layout(split)
    assert expert_grid_layout({**base, "tensor": 1, "data": 2})
    with pytest.raises(CheckpointError, match="universal conversion reads the first data rank"):
        _check_convertible(Path("step3"), {"layout": {**split, "tensor": 1}})


def test_the_plan_says_where_the_experts_of_the_grid_are():
    from pretrain.arithmetic import expert_layout_label
    from pretrain.plan.report import _experts_line

    split = _grid(tensor=2, expert=2, expert_tensor=2)
    assert expert_layout_label(split) == " (ep 2 x etp 2 of a stage's ranks)"
    line = _experts_line(CFG, split)
    assert line.startswith("experts 2 of 4 experts each split over 2 ranks per GPU"), line
    assert "all-to-all over expert groups like [0, 2]" in line
    assert "expert-data groups of 1 like [0]" in line
    assert "over expert groups like [0, 1], experts reduced and partitioned over expert-data " \
        "groups of 2 like [0, 2]" in _experts_line(CFG, _grid(data=4))
    assert expert_layout_label(_grid(tensor=2, expert=2)) == " (ep 2: the tp ranks)"


GRID_LAYOUTS = {  # name: (ranks, overrides)
    "expert2_dp2": (2, ["parallel.expert=2"]),
    "expert2_tp2_etp2_dp2": (4, ["parallel.tensor=2", "parallel.expert=2",
                                 "parallel.expert_tensor=2"]),
    # 4 data ranks of one micro-batch of 2 each: against one process of global batch 8 (the
    # auxiliary losses are each micro-batch's: the micro-batch must be one process's)
    "expert4_dp4": (4, ["parallel.expert=4", "train.global_batch_size=8"]),
    # the expert ranks are the context pair: the two chunks of each sequence swap their tokens,
    # the auxiliary losses pooled over them (one micro-batch); alone, or with an expert-data
    # peer (the other data rank's pair), the experts' gradients summed over the two
    "expert2_cp2": (2, ["parallel.context=2", "parallel.expert=2"]),
    "expert2_cp2_dp2": (4, ["parallel.context=2", "parallel.expert=2"]),
    # expert 4 over both context chunks of both data ranks' micro-batches (all-gather
    # attention): the all-to-all mixes micro-batches, the losses pool over the chunks only
    "expert4_cp2_dp2_allgather": (4, ["parallel.context=2", "parallel.context_kind=allgather",
                                      "parallel.expert=4"]),
    # DeepSpeed's CPU Adam stepping each expert-data pair's halves of the experts (expert 2
    # over 4 data ranks, global batch 8 as expert4_dp4)
    "expert2_dp4_offload": (4, ["parallel.expert=2", "train.global_batch_size=8",
                                "deepspeed=ds_configs/zero2_offload_cpu.json"]),
    # Muon: each expert's matrices orthogonalised whole, gathered from the expert-data pair's
    # ZeRO-1 partitions; against one process of Muon (Newton-Schulz in fp32 on both sides)
    "expert2_dp4_muon": (4, ["parallel.expert=2", "train.global_batch_size=8",
                             "train.optimizer=muon", "train.muon_ns_dtype=fp32"]),
}
# the one process each row is compared with: the same micro-batches and optimizer
REFERENCES = {"expert4_dp4": "moe_reference_batch8", "expert2_dp4_offload": "moe_reference_batch8",
              "expert2_dp4_muon": "moe_reference_muon_batch8"}
# what the engine must have built (the run record's facts), where the row asks for it
BUILT = {"expert2_cp2": {"context": 2, "data_parallel": 1},
         "expert4_cp2_dp2_allgather": {"context": 2, "context_kind": "allgather",
                                       "data_parallel": 2},
         "expert2_cp2_dp2": {"context": 2, "data_parallel": 2},
         "expert2_dp4_offload": {"zero_stage": 2, "offload_optimizer": "cpu",
                                 "optimizer": "DeepSpeedCPUAdam"},
         "expert2_dp4_muon": {"zero_stage": 1, "optimizer": "MuonAdamW"}}


@pytest.fixture(scope="module")
def moe_reference_batch8(tiny_data, tmp_path_factory):
    """One process, as `moe_reference` with a global batch of 8 (4 micro-batches of 2)."""
    from tests.test_moe import _moe_train

    return _moe_train(tmp_path_factory.mktemp("moe_ref_b8"), tiny_data, name="single",
                      overrides=["train.global_batch_size=8"])  # its last step saved


@pytest.fixture(scope="module")
def moe_reference_muon_batch8(tiny_data, tmp_path_factory):
    """One process, as `moe_reference_batch8` stepped by Muon (Newton-Schulz in fp32)."""
    from tests.test_moe import _moe_train

    return _moe_train(tmp_path_factory.mktemp("moe_ref_muon"), tiny_data, name="single",
                      overrides=["train.global_batch_size=8", "train.optimizer=muon",
                                 "train.muon_ns_dtype=fp32"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", GRID_LAYOUTS)
def test_expert_grid_trains_like_one_process(layout, request, tiny_data, tmp_path):
    """The tiny mixture on each grid layout: 10 steps, ZeRO-1 (ZeRO-2 on the 4-rank expert 4
    and under optimizer offload), with context parallelism, DeepSpeed's CPU Adam or Muon,
    equal to one process (losses, gradient norms, auxiliary losses: 1e-5; tokens per expert);
    final/ holds every expert once, one process's last weights (1e-5)."""
    from pretrain.checkpoint.weights import load_weights
    from tests.test_moe import _assert_same_steps, _moe_train

    nprocs, overrides = GRID_LAYOUTS[layout]
    moe_reference = request.getfixturevalue(REFERENCES.get(layout, "moe_reference"))
    if layout == "expert4_dp4":
        overrides = [*overrides, "deepspeed=ds_configs/zero2.json"]
    run = _moe_train(tmp_path, tiny_data, name=layout, nprocs=nprocs,
                     overrides=[*overrides, "checkpoint.save_final=true"])
    head = next(r for r in run.records if r["kind"] == "run")
    assert {k: head[k] for k in BUILT.get(layout, {})} == BUILT.get(layout, {}), head
    _assert_same_steps(run, moe_reference)
    final = load_weights(run.run_dir / "final").state  # every expert once, whole
    assert sorted(n for n in final if ".mlp.experts." in n) == sorted(
        f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight"
        for layer in range(2) for e in range(4) for p in ("gate", "up", "down"))
    # the weights one process ends on (its last step checkpoint), each expert from its rank
    from pretrain.checkpoint.weights import consolidate_engine_checkpoint
    from tests.test_moe import STEPS

    single = consolidate_engine_checkpoint(
        moe_reference.run_dir / "checkpoints" / f"step{STEPS}").state
    assert sorted(final) == sorted(single)
    for name, tensor in single.items():
        # Adam's steps of gradients equal within 1e-7: the weights within 2e-5 (Adam's
        # normalised step magnifies the summation-order noise of near-zero gradient elements:
        # the tensor-split layout's embedding ended 1.1e-5 away on an AVX-512 CPU)
        torch.testing.assert_close(final[name], tensor, rtol=0, atol=2e-5, msg=name)


def _grid_zero1_files(root: Path) -> None:
    """The files DeepSpeed's ZeRO-1 writes for expert 2 from 4 data ranks (tensor 1), in
    miniature: a dense group of one 8-element tensor partitioned over the 4 data ranks, a MoE
    group of 2 experts of 5 elements partitioned over the 2 expert-data ranks (ranks d and
    d + 2 hold experts 2 (d % 2) and 2 (d % 2) + 1, one each: `Topology.expert_coords`); the
    model states (data rank 0's) name rank 0's experts. Every element of expert k is 100 k + its index (its
    exp_avg the negative), the dense tensor's 1000 + its index."""
    dense = "model.norm.weight"
    expert = "model.layers.0.mlp.experts.{}.down_proj.weight"
    torch.save({"param_shapes": [{dense: torch.Size([8])},
                                 {expert.format(0): torch.Size([5]),
                                  expert.format(1): torch.Size([5])}]},
               root / "mp_rank_00_model_states.pt")
    for d in range(4):
        ep, edp = d % 2, d // 2
        experts = torch.cat([100.0 * k + torch.arange(5.0) for k in (2 * ep, 2 * ep + 1)])
        flat = [1000.0 + torch.arange(8.0)[2 * d:2 * d + 2], experts[5 * edp:5 * edp + 5]]
        torch.save({"optimizer_state_dict": {
            "zero_stage": 1, "partition_count": [4, 2], "single_partition_of_fp32_groups": flat,
            "param_alignment_paddings": [[0], [0, 0]],
            "param_slice_mappings": [{dense: None}, {expert.format(2 * ep + edp): None}],
            "base_optimizer_state": {"state": {g: {"exp_avg": -t} for g, t in enumerate(flat)}}}},
            root / f"zero_pp_rank_{d}_mp_rank_00_optim_states.pt")


def test_the_reader_finds_every_expert_of_a_grid_checkpoint_in_its_expert_ranks_files(tmp_path):
    """Each expert's master and moments are read from the files of the ranks holding it (its
    expert rank's, concatenated in expert-data order, under names moved from the first rank's),
    whole and by element runs across the two partitions; a file holding an expert its place in
    the grid does not give it is refused."""
    from pretrain.checkpoint.weights import expert_files
    from pretrain.checkpoint.zero_shards import ZeroMasters
    from pretrain.config import load_config
    from pretrain.errors import CheckpointError
    from pretrain.testing.runs import REPO

    cfg = load_config(str(REPO / "configs" / "tiny_moe.yaml"), ["parallel.expert=2"])
    placement = expert_files(cfg, mp_rank=0, replicas=4)
    assert (placement.expert, placement.position, placement.shift) == (
        ((0, 0), (0, 1), (0, 0), (0, 1)), (0, 0, 1, 1), (0, 2, 0, 2))
    split = load_config(str(REPO / "configs" / "tiny_moe.yaml"), [
        "parallel.tensor=2", "parallel.expert=2", "parallel.expert_tensor=2"])
    placement = expert_files(split, mp_rank=1, replicas=2)  # tensor rank 1: ranks 1 and 3
    assert (placement.expert, placement.shift) == (((1, 0), (1, 1)), (0, 2))
    assert expert_files(load_config(str(REPO / "configs" / "tiny_moe.yaml"), [
        "parallel.tensor=2", "parallel.expert=2"]), mp_rank=0, replicas=1) is None

    _grid_zero1_files(tmp_path)
    grid = expert_files(cfg, mp_rank=0, replicas=4)
    masters = ZeroMasters(tmp_path, mp_rank=0, experts=grid)
    moments = ZeroMasters(tmp_path, mp_rank=0, key="exp_avg", experts=grid)
    expert = "model.layers.0.mlp.experts.{}.down_proj.weight"
    assert sorted(masters) == sorted(["model.norm.weight", *(expert.format(k) for k in range(4))])
    for k in range(4):
        assert torch.equal(masters[expert.format(k)], 100.0 * k + torch.arange(5.0)), k
        assert torch.equal(moments[expert.format(k)], -(100.0 * k + torch.arange(5.0))), k
    assert torch.equal(masters["model.norm.weight"], 1000.0 + torch.arange(8.0))
    # a run of expert 3's elements: in rank 3's file (expert rank 1, expert-data rank 1)
    assert masters.read_runs(expert.format(3), [(1, 4)]).tolist() == [301.0, 302.0, 303.0]
    with pytest.raises(CheckpointError, match="config places no experts there"):
        ZeroMasters(tmp_path, mp_rank=0)
    swapped = expert_files(cfg, mp_rank=0, replicas=4)
    swapped = type(swapped)(expert=swapped.expert, position=swapped.position, shift=(0, 0, 0, 0))
    with pytest.raises(CheckpointError, match="which its place in the expert grid does not"):
        ZeroMasters(tmp_path, mp_rank=0, experts=swapped)


# ---- step checkpoints of the grid, resumed on any layout -----------------------------------------

# DeepSeek-V3 (tests/test_families.py's tiny shape: 8 experts in 4 groups, shared experts, layer
# 0 dense, an odd vocabulary) balanced by the expert bias alone (no auxiliary loss: the losses do
# not depend on how a step's batch is cut into micro-batches, so 4 data ranks of 1 sample
# continue 2 of 2); the bias, a buffer moved outside the gradient, must come back with the
# experts' masters and moments, or the experts chosen, so the losses, change
RESUME_STEPS, RESUME_AT = 7, 3
RESUME_RUN = [f"train.steps={RESUME_STEPS}", f"checkpoint.save_interval={RESUME_AT}",
              "checkpoint.keep_last=1", f"checkpoint.keep_every={RESUME_AT}",
              "model.moe_bias_update_rate=0.01", "model.moe_z_loss_coeff=0"]
GRID_SOURCES = {  # name: (ranks, overrides) of an uninterrupted run saving at step 3
    # expert 2 from 4 data ranks: each expert's state ZeRO-partitioned over 2 expert-data ranks
    "expert2_dp4": (4, ["parallel.expert=2", "train.micro_batch_size=1"]),
    "single": (1, []),
}
FSDP2_DP2 = (2, ["train.engine=fsdp2", "deepspeed=ds_configs/zero3.json"])
GRID_RESUMES = {  # name: (source, (ranks, overrides) resuming its step 3, the layout change)
    # its own layout: resharded too (DeepSpeed's load gives every rank the first data rank's
    # module states, whose experts are not the others'), and bitwise the uninterrupted run
    "expert2_dp4-same": ("expert2_dp4", GRID_SOURCES["expert2_dp4"],
                         "tp1 pp1 ep2 dp4 ZeRO-1 fp32, its own layout"),
    "expert2_dp4-expert4_dp4_zero2": ("expert2_dp4", (4, [
        "parallel.expert=4", "train.micro_batch_size=1", "deepspeed=ds_configs/zero2.json"]),
        "tp1 pp1 ep2 dp4 ZeRO-1 -> tp1 pp1 ep4 dp4 ZeRO-2"),
    "expert2_dp4-single": ("expert2_dp4", (1, []), "tp1 pp1 ep2 dp4 ZeRO-1 -> tp1 pp1 dp1 ZeRO-1"),
    # the fsdp2 engine (expert 1, each expert's rows over the data ranks); its own save of the
    # resharded state then goes back onto the grid
    "expert2_dp4-fsdp2_dp2": ("expert2_dp4", FSDP2_DP2,
                              "tp1 pp1 ep2 dp4 ZeRO-1 -> tp1 pp1 dp2 ZeRO-3 fsdp2"),
    "single-expert2_tp2_etp2_dp2": ("single", (4, [
        "parallel.tensor=2", "parallel.expert=2", "parallel.expert_tensor=2"]),
        "tp1 pp1 dp1 ZeRO-1 -> tp2 pp1 ep2 etp2 dp2 ZeRO-1"),
}


def _deepseek(overrides: list[str]) -> list[str]:
    """The overrides of configs/tiny_moe.yaml training the tiny DeepSeek-V3 with `overrides`."""
    from tests.test_families import SHAPES, VOCAB

    return [f"model.vocab_size={VOCAB}", "model.tie_embeddings=false",
            *SHAPES["deepseek_v3_moe"], *RESUME_RUN, *overrides]


def _deepseek_train(tmp_path, tiny_data, *, name: str, nprocs: int, overrides: list[str]):
    from pretrain.testing.runs import train

    return train(tmp_path, tiny_data, nprocs=nprocs, name=name, config="configs/tiny_moe.yaml",
                 overrides=_deepseek(overrides))


@pytest.fixture(scope="module")
def grid_sources(tiny_data, tmp_path_factory):
    """Per source layout, made once: its uninterrupted run, saving at step 3."""
    made = {}

    def get(name: str):
        if name not in made:
            nprocs, overrides = GRID_SOURCES[name]
            made[name] = _deepseek_train(tmp_path_factory.mktemp(name), tiny_data, name=name,
                                         nprocs=nprocs, overrides=overrides)
        return made[name]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("transition", GRID_RESUMES)
def test_a_checkpoint_of_the_expert_grid_resumes_on_any_layout(transition, grid_sources,
                                                               tiny_data, tmp_path):
    """A step-3 checkpoint of the grid (or of one process) continues on another layout (or its
    own): its 4 steps' losses are the uninterrupted run's within 1e-5 (bitwise on its own
    layout), and so are the expert bias and tokens per expert of every step; the resharded
    state, saved at once on the new layout, holds every master, Adam moment and the bias
    bitwise as saved (so the grid's files, read back, hold every expert's state). The fsdp2
    engine's save of it resumes on the grid bitwise as the uninterrupted grid run."""
    from pretrain.testing.runs import rel_diff, train_args
    from tests.test_reshard import _reshard_and_save

    source, (nprocs, overrides), change = GRID_RESUMES[transition]
    full = grid_sources(source)
    saved = full.run_dir / "checkpoints" / f"step{RESUME_AT}"
    shutil.copytree(saved, tmp_path / "resumed" / "checkpoints" / saved.name)
    resumed = _deepseek_train(tmp_path, tiny_data, name="resumed", nprocs=nprocs,
                              overrides=overrides)
    assert f"resharded {change}" in resumed.stdout, resumed.stdout[-2000:]
    after, before = (_records(resumed), _records(full)[RESUME_AT:])
    assert [r["step"] for r in after] == list(range(RESUME_AT + 1, RESUME_STEPS + 1))
    losses = [r["loss"] for r in after], [r["loss"] for r in before]
    assert losses[0] == losses[1] if transition.endswith("-same") else \
        rel_diff(*losses) < 1e-5, losses
    for key in ("moe_expert_tokens", "moe_expert_bias"):
        assert [r[key] for r in after] == [r[key] for r in before], key

    out = tmp_path / "resaved"
    args = train_args(out, tiny_data, config="configs/tiny_moe.yaml",
                      overrides=_deepseek(overrides))
    run_on_ranks(_reshard_and_save, world_size=nprocs, tmp_path=tmp_path, args=(args, str(saved)))
    resaved = out / "checkpoints" / f"step{RESUME_AT}"
    _assert_same_state(saved, resaved)
    if (nprocs, overrides) == FSDP2_DP2:  # fsdp2's files, back onto the grid
        shutil.copytree(resaved, tmp_path / "back" / "checkpoints" / resaved.name)
        back = _deepseek_train(tmp_path, tiny_data, name="back", nprocs=4,
                               overrides=GRID_SOURCES["expert2_dp4"][1])
        assert "resharded tp1 pp1 dp2 ZeRO-3 fsdp2 -> tp1 pp1 ep2 dp4 ZeRO-1" in back.stdout
        assert [r["loss"] for r in _records(back)] == losses[1]


def _assert_same_state(old: Path, new: Path) -> None:
    """Every fp32 master, Adam moment and buffer (the expert bias) of two checkpoints, bitwise
    (a buffer has no moments: its listing under a moment's key is the reader's filler)."""
    from pretrain.checkpoint.reshard import ADAM_MOMENTS
    from pretrain.checkpoint.weights import engine_tensors

    for key in (None, *ADAM_MOMENTS):
        a, b = engine_tensors(old, key), engine_tensors(new, key)
        assert sorted(a) == sorted(b)
        for name in a:
            if key is None or not name.endswith("e_score_correction_bias"):
                assert torch.equal(a[name], b[name]), (key, name)


def _records(run) -> list[dict]:
    return [r for r in run.records if r["kind"] == "train"]


# ---- which group reduces which gradient ----------------------------------------------------------

def one_grid_step_recorded(rank: int, world_size: int, overrides: list[str]):
    """One backward and step of the tiny mixture at expert 2 over 4 data ranks (tensor 1), every
    reduction of torch.distributed recorded as (op, group: data / expert_data / expert, elements);
    returns (engine, cfg, groups, recorded). `overrides`: the engine, its JSON, a family."""
    import torch.distributed as dist

    from pretrain.config import load_config
    from pretrain.dist import init_deepspeed_comm
    from pretrain.training.engine import build_engine
    from pretrain.resolve.run import resolve_ds_config
    from pretrain.testing.reductions import recorded_reductions
    from pretrain.testing.runs import REPO

    init_deepspeed_comm(dist_backend="gloo", verbose=False)
    cfg = load_config(str(REPO / "configs" / "tiny_moe.yaml"), [
        "model.moe_aux_loss_coeff=1.0", "parallel.expert=2", "train.micro_batch_size=1",
        "train.global_batch_size=4", *overrides])
    groups = Topology(tensor=1, pipeline=1, world_size=world_size, rank=rank,
                      expert=2).create_groups()
    engine = build_engine(cfg, resolve_ds_config(cfg, world_size=world_size), groups, main=False)
    ids = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(3))
    loss = engine(ids[rank:rank + 1, :-1], labels=ids[rank:rank + 1, 1:])
    names = {tuple(dist.get_process_group_ranks(g)): kind
             for kind, g in (("data", groups.data), ("expert_data", groups.expert_data),
                             ("expert", groups.expert))}
    with recorded_reductions(lambda op, group, tensor:  # (op, group, elements)
                             (op, names.get(group, str(group)), tensor.numel())) as seen:
        engine.backward(loss)
        engine.step()
    return engine, cfg, groups, seen


def _grid_reductions_of_one_step(rank: int, world_size: int, family: tuple = ()) -> dict:
    """One ZeRO-1 step of expert 2 over 4 data ranks (`one_grid_step_recorded`; `family`: the
    overrides of another family's tiny mixture): the reductions and the experts held."""
    import torch.distributed as dist

    from pretrain.families import family_of
    from pretrain.testing.runs import REPO

    engine, cfg, groups, seen = one_grid_step_recorded(
        rank, world_size, [f"deepspeed={REPO / 'ds_configs' / 'zero1.json'}", *family])
    params = dict(engine.module.named_parameters())
    experts = {n: p.numel() for n, p in params.items() if getattr(p, "allreduce", True) is False}
    moe_layers = sum(family_of(cfg.model).moe_layer(cfg.model, i)
                     for i in range(cfg.model.num_layers))
    return {"seen": seen, "experts": sorted(experts), "expert_elements": sum(experts.values()),
            "local": cfg.model.num_experts // 2, "moe_layers": moe_layers,
            "other_elements": sum(p.numel() for n, p in params.items() if n not in experts),
            "expert_data": sorted(dist.get_process_group_ranks(groups.expert_data))}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe8_losses", "deepseek_v3_moe_bias"])
def test_each_gradient_is_reduced_over_its_group_on_the_expert_grid(family, tmp_path):
    """expert 2 over 4 data ranks, ZeRO-1: each rank holds half the experts of each MoE layer;
    their gradients are reduced over the 2 ranks holding the same experts (rank r and r + 2),
    every element once, and every other gradient (DeepSeek-V3's shared experts and router
    included) over the 4 data ranks, every element once; nothing is reduced over the expert
    group (the all-to-all only swaps tokens). The tiny Mixtral-style mixture, Qwen3-MoE (8
    experts, every second layer) and the bias-balanced DeepSeek-V3 (8 experts, layer 0 dense,
    2 shared)."""
    from tests.test_families import SHAPES, VOCAB

    overrides = () if family == "mixtral" else (f"model.vocab_size={VOCAB}", *SHAPES[family])
    results = run_on_ranks(_grid_reductions_of_one_step, world_size=4, tmp_path=tmp_path,
                           args=(overrides,))
    for rank, result in enumerate(results):
        assert result["expert_data"] == [rank % 2, rank % 2 + 2]
        local = result["local"]
        held = sorted({int(n.split(".")[5]) for n in result["experts"]})
        assert held == list(range(local * (rank % 2), local * (rank % 2 + 1))), (rank, held)
        assert result["moe_layers"] == {"mixtral": 2, "qwen3_moe8_losses": 1,
                                        "deepseek_v3_moe_bias": 2}[family]
        assert len(result["experts"]) == local * 3 * result["moe_layers"]  # 3 matrices each
        sizes = Counter()
        for op, where, elements in result["seen"]:
            if elements > 1:  # the gradient norm's sums are single values
                sizes[where] += elements
        assert sizes == {"expert_data": result["expert_elements"],
                         "data": result["other_elements"]}, (rank, sizes)
