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

from collections import Counter

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
        (_grid(engine="fsdp2"), "train.engine=fsdp2 with parallel.expert=2"),
        (_grid(tensor=4, data=2, expert=2), r"set parallel.expert to a multiple of 4"),
    ]
    for layout, message in layout_refusals:
        with pytest.raises(ConfigError, match=message):
            check_layout(dataclasses.replace(CFG, num_heads=8, num_kv_heads=4), layout)


def test_step_checkpoints_of_the_expert_grid_are_refused_before_launch():
    from pretrain.config import load_config
    from pretrain.resolve.run import resolve_layout
    from pretrain.testing.runs import REPO

    topo = Topology(tensor=1, pipeline=1, world_size=2, expert=2)
    cfg = load_config(str(REPO / "configs" / "tiny_moe.yaml"),
                      ["parallel.expert=2", "checkpoint.save_interval=3"])
    with pytest.raises(ConfigError, match="checkpoint.save_interval with parallel.expert=2"):
        resolve_layout(cfg, topo)
    cfg = load_config(str(REPO / "configs" / "tiny_moe.yaml"), ["parallel.expert=2"])
    assert resolve_layout(cfg, topo).expert == 2


def test_the_plan_says_where_the_experts_of_the_grid_are():
    from pretrain.plan.report import _expert_layout, _experts_line

    split = _grid(tensor=2, expert=2, expert_tensor=2)
    assert _expert_layout(split) == " (ep 2 x etp 2 of a stage's ranks)"
    line = _experts_line(CFG, split)
    assert line.startswith("experts 2 of 4 experts each split over 2 ranks per GPU"), line
    assert "all-to-all over expert groups like [0, 2]" in line
    assert "expert-data groups of 1 like [0]" in line
    assert "over expert groups like [0, 1], experts reduced and partitioned over expert-data " \
        "groups of 2 like [0, 2]" in _experts_line(CFG, _grid(data=4))
    assert _expert_layout(_grid(tensor=2, expert=2)) == " (ep 2: the tp ranks)"


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
    final/ holds every expert once, one process's last weights (1e-5); the last step's
    checkpoint of expert 2 x dp 2 is refused on resume."""
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
    from tests.test_moe import STEPS, TRAIN

    single = consolidate_engine_checkpoint(
        moe_reference.run_dir / "checkpoints" / f"step{STEPS}").state
    assert sorted(final) == sorted(single)
    for name, tensor in single.items():
        # Adam's steps of gradients equal within 1e-7: the weights within 1e-5
        torch.testing.assert_close(final[name], tensor, rtol=0, atol=1e-5, msg=name)
    if layout == "expert2_dp2":  # its last step's checkpoint: refused on resume, any layout
        import shutil

        from pretrain.testing.runs import run_pretrain, train_args

        saved = run.run_dir / "checkpoints" / f"step{STEPS}"
        resumed = tmp_path / "resumed"
        shutil.copytree(saved, resumed / "checkpoints" / saved.name)
        refused = run_pretrain(train_args(resumed, tiny_data, config="configs/tiny_moe.yaml",
                                          overrides=[*TRAIN, "train.steps=12"]),
                               run_dir=resumed, launcher="forked", nprocs=1)
        assert refused.returncode != 0
        assert "beyond the tensor group (the expert grid), whose step checkpoints are not " \
               "resumable yet" in refused.stderr, refused.stderr[-3000:]


# ---- which group reduces which gradient ----------------------------------------------------------

def _grid_reductions_of_one_step(rank: int, world_size: int) -> dict:
    """One backward and step of expert 2 over 4 data ranks (tensor 1) under ZeRO-1, every
    reduction of torch.distributed recorded by group and size."""
    import torch.distributed as dist

    from pretrain.config import load_config
    from pretrain.dist import init_deepspeed_comm
    from pretrain.training.engine import build_engine
    from pretrain.resolve.run import resolve_ds_config
    from pretrain.testing.reductions import recorded_reductions
    from pretrain.testing.runs import REPO

    init_deepspeed_comm(dist_backend="gloo", verbose=False)
    cfg = load_config(str(REPO / "configs" / "tiny_moe.yaml"), [
        "model.moe_aux_loss_coeff=1.0", "parallel.expert=2",
        f"deepspeed={REPO / 'ds_configs' / 'zero1.json'}", "train.micro_batch_size=1",
        "train.global_batch_size=4"])
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
    params = dict(engine.module.named_parameters())
    experts = {n: p.numel() for n, p in params.items() if getattr(p, "allreduce", True) is False}
    return {"seen": seen, "experts": sorted(experts), "expert_elements": sum(experts.values()),
            "other_elements": sum(p.numel() for n, p in params.items() if n not in experts),
            "expert_data": sorted(dist.get_process_group_ranks(groups.expert_data))}


@pytest.mark.slow
def test_each_gradient_is_reduced_over_its_group_on_the_expert_grid(tmp_path):
    """expert 2 over 4 data ranks, ZeRO-1: each rank holds 2 of the 4 experts of each layer;
    their gradients are reduced over the 2 ranks holding the same experts (rank r and r + 2),
    every element once, and every other gradient over the 4 data ranks, every element once;
    nothing is reduced over the expert group (the all-to-all only swaps tokens)."""
    results = run_on_ranks(_grid_reductions_of_one_step, world_size=4, tmp_path=tmp_path)
    for rank, result in enumerate(results):
        assert result["expert_data"] == [rank % 2, rank % 2 + 2]
        held = sorted({n.split(".")[5] for n in result["experts"]})
        assert held == [str(2 * (rank % 2)), str(2 * (rank % 2) + 1)], (rank, held)
        assert len(result["experts"]) == 2 * 2 * 3  # 2 experts x 3 matrices x 2 layers
        sizes = Counter()
        for op, where, elements in result["seen"]:
            if elements > 1:  # the gradient norm's sums are single values
                sizes[where] += elements
        assert sizes == {"expert_data": result["expert_elements"],
                         "data": result["other_elements"]}, (rank, sizes)
