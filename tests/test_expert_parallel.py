"""Expert parallelism (`parallel.expert`, `pretrain/model/expert_parallel.py`): the all-to-all
dispatch against the single-process layer, training against one process, resuming on another
expert layout, and the refusals.

The layer test runs one MoE layer (hidden 64, 4 experts, top-2, 64 tokens) on 2 gloo ranks
against `tests/test_moe.py`'s single-process layer; the training tests share that file's
single-process run of `configs/tiny_moe.yaml` as the reference.
"""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from pretrain.config import ModelConfig, Precision
from pretrain.errors import ConfigError
from pretrain.resolve.layout import Layout, check_layout
from pretrain.model.llama import fused_projections
from pretrain.model.moe import MoE
from pretrain.testing.ranks import run_on_ranks
from pretrain.resolve.topology import Topology
from tests.test_moe import CFG, HostReads, _assert_close, _layer


def _expert_parallel_layer(cfg: ModelConfig, group, reference: MoE, *,
                           sequence_parallel: bool) -> MoE:
    """An expert-parallel copy of `reference` over `group`: the router, and this rank's experts
    under the same names."""
    layer = MoE(cfg, tp_group=group, sequence_parallel=sequence_parallel,
                project=fused_projections, expert_parallel=True)
    ours = dict(reference.named_parameters())
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(ours[name])
    return layer


def _layer_on_ranks(rank: int, world_size: int, sequence_parallel: bool) -> list[str]:
    import torch.distributed as dist

    from pretrain.training import collective_log

    log = collective_log.CollectiveLog()
    collective_log.install(log)
    group = dist.new_group(list(range(world_size)))
    reference = _layer(CFG, seed=4)  # the same on every rank
    layer = _expert_parallel_layer(CFG, group, reference, sequence_parallel=sequence_parallel)
    names = sorted({n.split(".")[1] for n, _ in layer.named_parameters() if "experts" in n})
    assert names == [str(2 * rank), str(2 * rank + 1)]  # whole experts, global names
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(2, 32, 64, generator=generator)
    g = torch.randn(2, 32, 64, generator=generator)
    x_ref = x.clone().requires_grad_(True)
    ref_out = reference(x_ref)
    (ref_out * g).sum().backward()  # the layer adds its auxiliary losses' gradient (scale 1)

    chunk = slice(16 * rank, 16 * (rank + 1))
    mine = (x[:, chunk] if sequence_parallel else x).clone().requires_grad_(True)
    with HostReads() as reads:
        out = layer(mine)
    assert reads.calls == ["tolist"]  # the counts, sent and received, read back once
    (out * (g[:, chunk] if sequence_parallel else g)).sum().backward()
    expected_out = ref_out[:, chunk] if sequence_parallel else ref_out
    expected_grad = x_ref.grad[:, chunk] if sequence_parallel else x_ref.grad
    _assert_close(out, expected_out.detach(), "output")
    _assert_close(mine.grad, expected_grad, "input gradient")
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    for name, p in layer.named_parameters():
        _assert_close(p.grad, ref_grads[name], name)  # router summed over ranks; experts whole
    # dropless: each of this rank's tokens goes to the experts one process gives it
    with torch.no_grad():
        ours = layer.route(x[:, chunk].reshape(-1, 64))[0].top_experts
        theirs = reference.route(x.reshape(-1, 64))[0].top_experts
    torch.testing.assert_close(ours, theirs.view(2, 32, -1)[:, chunk].reshape(ours.shape),
                               rtol=0, atol=0)
    ops = [entry[1] for entry in log.recent()]
    # counts, rows out, rows back; and the reverse two in backward: seen by the collective log
    assert ops.count("all_to_all_single") == 5, ops
    assert all(entry[5] == "done" for entry in log.recent())
    return names


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_all_to_all_dispatch_gives_the_single_process_layer_output_and_gradients(
        tmp_path, sequence_parallel):
    names = run_on_ranks(_layer_on_ranks, world_size=2, tmp_path=tmp_path,
                         args=(sequence_parallel,))
    assert names == [["0", "1"], ["2", "3"]]


def _context_layer_on_ranks(rank: int, world_size: int, tensor: int) -> float:
    """One MoE layer on context 2 (x expert 2 = tensor 2): context rank c holds tokens
    [16c, 16c + 16) of each sequence. Its objective is N x its chunk's share, as the model's
    loss is (`chunk_loss_scale`), and the data-parallel mean over the context ranks must give
    one process's gradients, the auxiliary losses' included."""
    import torch.distributed as dist

    context = world_size // tensor
    groups = Topology(tensor=tensor, pipeline=1, world_size=world_size, rank=rank,
                      context=context, expert=tensor).create_groups()
    reference = _layer(CFG, seed=4)
    layer = MoE(CFG, tp_group=groups.tensor if tensor > 1 else None, project=fused_projections,
                expert_parallel=tensor > 1, cp_group=groups.context)
    ours = dict(reference.named_parameters())
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(ours[name])
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(2, 32, 64, generator=generator)
    g = torch.randn(2, 32, 64, generator=generator)
    x_ref = x.clone().requires_grad_(True)
    ref_out = reference(x_ref)
    (ref_out * g).sum().backward()

    c = groups.topology.my_coords.context
    chunk = slice(c * 32 // context, (c + 1) * 32 // context)
    mine = x[:, chunk].clone().requires_grad_(True)
    out = layer(mine)
    (context * (out * g[:, chunk]).sum()).backward()
    _assert_close(out, ref_out[:, chunk].detach(), "output")
    _assert_close(mine.grad / context, x_ref.grad[:, chunk], "input gradient")
    # the auxiliary losses over the whole micro-batch, on every rank
    torch.testing.assert_close(layer.stats[1:3], reference.stats[1:3], rtol=1e-6, atol=0)
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    for name, p in layer.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=groups.data)  # DeepSpeed's mean over data x context ranks
        _assert_close(grad / context, ref_grads[name], name)
    return float(layer.stats[1])


@pytest.mark.slow
@pytest.mark.parametrize("tensor", [1, 2])
def test_context2_layer_with_and_without_experts_split_gives_one_process(tmp_path, tensor):
    """Context 2 alone (2 ranks) and tensor 2 = expert 2 x context 2 (4 ranks)."""
    balance = run_on_ranks(_context_layer_on_ranks, world_size=2 * tensor, tmp_path=tmp_path,
                           args=(tensor,))
    assert len(set(balance)) == 1  # the same balance loss on every rank


# ---- refusals ------------------------------------------------------------------------------------

def _layout(**fields) -> Layout:
    return Layout(**{"tensor": 2, "expert": 2, "micro_batch": 1, "global_batch": 1,
                     "precision": Precision.FP32, **fields})


def test_expert_layouts_the_stack_cannot_run_are_refused_with_the_reason():
    with pytest.raises(ConfigError, match="parallel.expert=2: must divide model.num_experts=3"):
        check_layout(dataclasses.replace(CFG, num_experts=3), _layout())
    with pytest.raises(ConfigError, match="the model has no experts"):
        check_layout(dataclasses.replace(CFG, num_experts=0), _layout())
    check_layout(CFG, _layout(tensor=1, expert=2, data=2, global_batch=2))  # the expert grid
    with pytest.raises(ConfigError, match="moe_capacity_factor"):
        check_layout(dataclasses.replace(CFG, moe_capacity_factor=1.0), _layout())
    # each expert rank routes an equal chunk of its context chunk: 34 / 2 = 17 does not split
    with pytest.raises(ConfigError, match=r"seq_length=34: must be divisible by parallel.expert "
                                          r"x parallel.context = 2 x 2 = 4"):
        check_layout(dataclasses.replace(CFG, num_heads=8, num_kv_heads=4, seq_length=34),
                     _layout(context=2))
    with pytest.raises(ConfigError, match="experts_per_token=5: must be between 1 and"):
        dataclasses.replace(CFG, experts_per_token=5)  # top-k above the expert count
    # a world that cannot hold the expert layout: 2 expert ranks do not divide a stage of 3
    with pytest.raises(ConfigError, match=r"parallel.expert x parallel.expert_tensor = 2 x 1 = 2 "
                                          r"must divide the ranks of a pipeline stage"):
        Topology(tensor=1, pipeline=1, world_size=3, expert=2)
    with pytest.raises(ConfigError, match="parallel.expert_tensor=1 with parallel.expert=1"):
        Topology(tensor=2, pipeline=1, world_size=2, expert_tensor=1)
    check_layout(CFG, _layout())  # tp 2 = ep 2: 2 whole experts per rank
    check_layout(CFG, _layout(pipeline=2))  # with a pipeline, and with context parallelism
    check_layout(dataclasses.replace(CFG, num_heads=8, num_kv_heads=4), _layout(context=2))


def test_the_pre_flight_refuses_an_expert_layout_with_its_reason_and_exit_2():
    from pretrain.testing.cli import run_cli
    from pretrain.testing.runs import REPO

    base = ["plan", "--config", "configs/tiny_moe.yaml", "--world-size", "2",
            "--set", "parallel.tensor=2", "--set", "parallel.expert=2"]
    bad = run_cli([*base, "--set", "model.num_experts=3"], cwd=REPO)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert "error: parallel.expert=2: must divide model.num_experts=3" in bad.stderr
    good = run_cli(base, cwd=REPO)
    assert good.returncode == 0, good.stderr
    assert "experts 2 of 4 experts whole per GPU" in good.stdout


def test_topology_draws_the_expert_groups():
    topo = Topology(tensor=2, pipeline=1, world_size=4, expert=2)
    assert topo.expert_groups() == topo.tensor_groups() == [[0, 1], [2, 3]]
    assert topo.expert_data_groups() == topo.data_groups() == [[0, 2], [1, 3]]
    assert "expert=2 x expert_tensor=1: expert groups [[0, 1], [2, 3]]" in topo.describe()
    assert Topology(tensor=2, pipeline=1, world_size=2).expert_groups() == [[0], [1]]
    # expert ranks beyond the tensor group: tp 2 x expert 4 over 8 ranks of 2 stages
    topo = Topology(tensor=2, pipeline=2, world_size=16, expert=4)
    assert topo.expert_groups()[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert topo.expert_data_groups()[:2] == [[0, 4], [1, 5]]
    assert [topo.expert_rank(r) for r in (0, 3, 4, 9)] == [0, 3, 0, 1]
    # experts split over the tensor ranks, expert ranks from the data ranks, with context 2
    from pretrain.config import ParallelConfig
    topo = Topology.from_parallel_config(
        ParallelConfig(tensor=2, context=2, expert=2, expert_tensor=2), world_size=8)
    assert topo.expert_tensor_groups() == topo.tensor_groups()
    assert topo.expert_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.expert_data_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # every rank sits in exactly one group of each kind, and the three together span a stage
    for kind in (topo.expert_groups, topo.expert_data_groups, topo.expert_tensor_groups):
        assert sorted(r for g in kind() for r in g) == list(range(8))


# ---- training through `pretrain train`: expert layouts against one process ----------------------

@pytest.mark.slow
def test_expert2_and_expert2_with_zero3_equal_one_process_and_resume_on_expert1(
        moe_reference, tiny_data, tmp_path):
    import shutil

    from tests.test_moe import (SAVE_AT, _assert_final_is_last_checkpoint, _assert_same_steps,
                                _moe_train)

    run = _moe_train(tmp_path, tiny_data, name="ep2", nprocs=2, overrides=[
        "parallel.tensor=2", "parallel.expert=2", f"checkpoint.save_interval={SAVE_AT}",
        "checkpoint.keep_last=1", f"checkpoint.keep_every={SAVE_AT}", "checkpoint.save_final=true"])
    assert "ep2" in run.stdout
    _assert_same_steps(run, moe_reference)
    # final/ holds every expert once, each from the rank that held it: the last checkpoint's
    from pretrain.checkpoint.weights import load_weights

    _assert_final_is_last_checkpoint(run)
    final = load_weights(run.run_dir / "final").state
    zero3 = _moe_train(tmp_path, tiny_data, name="ep2_zero3", nprocs=2, overrides=[
        "parallel.tensor=2", "parallel.expert=2", "parallel.sequence_parallel=true",
        "deepspeed=ds_configs/zero3.json", "checkpoint.save_final=true"])
    _assert_same_steps(zero3, moe_reference)
    # ZeRO-3's final/: each expert gathered over its data ranks, sent by its tensor rank; the
    # same weights as ZeRO-1's up to the layouts' rounding
    final3 = load_weights(zero3.run_dir / "final").state
    assert sorted(final3) == sorted(final)
    for name in final:
        torch.testing.assert_close(final3[name], final[name], rtol=0, atol=1e-5)
    # rank 1 of the tensor group held experts 2 and 3 whole, under their global names
    from pretrain.checkpoint.zero_shards import load_checkpoint_file

    held = load_checkpoint_file(run.run_dir / "checkpoints" / f"step{SAVE_AT}"
                                / "mp_rank_01_model_states.pt")["module"]
    experts = {n: tuple(t.shape) for n, t in held.items() if ".mlp.experts." in n}
    assert sorted({n.split(".")[5] for n in experts}) == ["2", "3"]
    assert experts["model.layers.0.mlp.experts.2.down_proj.weight"] == (64, 96)
    # expert 2's step-3 checkpoint (experts whole on the rank that held them) continues on one
    # process, which holds all four, as the uninterrupted run does
    saved = run.run_dir / "checkpoints" / f"step{SAVE_AT}"
    shutil.copytree(saved, tmp_path / "resumed" / "checkpoints" / saved.name)
    resumed = _moe_train(tmp_path, tiny_data, name="resumed")
    assert "tp2 pp1 ep2 dp1 ZeRO-1 -> tp1 pp1 dp1 ZeRO-1" in resumed.stdout
    _assert_same_steps(resumed, moe_reference, first_step=SAVE_AT + 1)
    # and one process's step-3 checkpoint continues on expert 2, each rank taking its experts
    saved = moe_reference.run_dir / "checkpoints" / f"step{SAVE_AT}"
    shutil.copytree(saved, tmp_path / "onto_ep2" / "checkpoints" / saved.name)
    onto_ep2 = _moe_train(tmp_path, tiny_data, name="onto_ep2", nprocs=2,
                          overrides=["parallel.tensor=2", "parallel.expert=2"])
    assert "tp1 pp1 dp1 ZeRO-1 -> tp2 pp1 ep2 dp1 ZeRO-1" in onto_ep2.stdout
    _assert_same_steps(onto_ep2, moe_reference, first_step=SAVE_AT + 1)


# tensor 2 x context 2 attend with whole query and kv heads: 8 and 4 of them
HEADS_8 = ["model.num_heads=8", "model.num_kv_heads=4"]


@pytest.fixture(scope="module")
def moe_reference_8_heads(tiny_data, tmp_path_factory):
    """One process, as `moe_reference` with 8 query and 4 kv heads."""
    from tests.test_moe import _moe_train

    return _moe_train(tmp_path_factory.mktemp("moe_ref8"), tiny_data, name="single",
                      overrides=HEADS_8)


@pytest.mark.slow
def test_expert2_with_context2_equals_one_process(moe_reference_8_heads, tiny_data, tmp_path):
    """tensor 2 = expert 2 x context 2 (4 ranks): each expert rank routes half of its context
    rank's chunk; the auxiliary losses (summed over both groups) and the tokens per expert are
    one process's."""
    from tests.test_moe import _assert_same_steps, _moe_train

    run = _moe_train(tmp_path, tiny_data, name="ep2_cp2", nprocs=4, overrides=[
        *HEADS_8, "parallel.tensor=2", "parallel.expert=2", "parallel.context=2"])
    assert "tp 2 x pp 1 x cp 2 x dp 1" in run.stdout
    _assert_same_steps(run, moe_reference_8_heads)


@pytest.mark.slow
def test_expert2_with_pipeline2_equals_one_process_and_resumes_on_one_process(
        moe_reference, tiny_data, tmp_path):
    """tensor 2 = expert 2 x pipeline 2 (4 ranks): each stage's tensor ranks hold whole experts
    of its layer; the checkpoint names them globally, final/ holds each once, and the step-3
    checkpoint continues on one process as the uninterrupted run does."""
    import shutil

    from pretrain.checkpoint.zero_shards import load_checkpoint_file
    from tests.test_moe import (SAVE_AT, _assert_final_is_last_checkpoint, _assert_same_steps,
                                _moe_train)

    run = _moe_train(tmp_path, tiny_data, name="ep2_pp2", nprocs=4, overrides=[
        "parallel.tensor=2", "parallel.expert=2", "parallel.pipeline=2",
        f"checkpoint.save_interval={SAVE_AT}", "checkpoint.keep_last=1",
        f"checkpoint.keep_every={SAVE_AT}", "checkpoint.save_final=true"])
    assert "tp 2 x pp 2 x dp 1" in run.stdout
    _assert_same_steps(run, moe_reference)
    saved = run.run_dir / "checkpoints" / f"step{SAVE_AT}"
    # layer 1 (spec 2, on the second stage), tensor rank 1: experts 2 and 3 whole
    held = load_checkpoint_file(saved / "layer_02-model_01-model_states.pt")
    assert sorted({n.split(".")[2] for n in held if n.startswith("mlp.experts.")}) == ["2", "3"]
    assert tuple(held["mlp.experts.3.down_proj.weight"].shape) == (64, 96)
    _assert_final_is_last_checkpoint(run)
    shutil.copytree(saved, tmp_path / "resumed" / "checkpoints" / saved.name)
    resumed = _moe_train(tmp_path, tiny_data, name="resumed")
    assert "tp2 pp2 ep2 dp1 ZeRO-1 -> tp1 pp1 dp1 ZeRO-1" in resumed.stdout
    _assert_same_steps(resumed, moe_reference, first_step=SAVE_AT + 1)


# ---- which group reduces which gradient ----------------------------------------------------------

def _gradients_in(flat: torch.Tensor, grads: dict[str, torch.Tensor]) -> list[str]:
    """The parameters whose local gradients `flat` is the concatenation of (a DeepSpeed bucket
    before its all-reduce), in order; "?" where nothing matches."""
    names, offset = [], 0
    while offset < flat.numel():
        found = next((n for n, g in grads.items() if n not in names
                      and torch.equal(flat[offset:offset + g.numel()], g.flatten())), None)
        if found is None:
            return [*names, "?"]
        names.append(found)
        offset += grads[found].numel()
    return names


def _reductions_of_one_step(rank: int, world_size: int) -> dict:
    """One backward and step of tensor 2 = expert 2 x context 2 under ZeRO-0 (whose buckets
    hold whole gradients, so each reduction's parameters can be named), every reduction of
    torch.distributed recorded; the gradients against one process's."""
    import torch.distributed as dist

    from pretrain.config import load_config
    from pretrain.dist import init_deepspeed_comm
    from pretrain.training.engine import build_engine
    from pretrain.model import build_model
    from pretrain.model.llama import shard_range
    from pretrain.model.moe import moe_layers
    from pretrain.resolve.run import resolve_ds_config
    from pretrain.testing.reductions import recorded_reductions
    from pretrain.testing.runs import REPO

    init_deepspeed_comm(dist_backend="gloo", verbose=False)
    cfg = load_config(str(REPO / "configs" / "tiny_moe.yaml"), [
        *HEADS_8, "model.moe_aux_loss_coeff=1.0", "parallel.tensor=2", "parallel.expert=2",
        "parallel.context=2", f"deepspeed={REPO / 'ds_configs' / 'zero0.json'}",
        "train.global_batch_size=2"])
    groups = Topology(tensor=2, pipeline=1, world_size=world_size, rank=rank, context=2,
                      expert=2).create_groups()
    engine = build_engine(cfg, resolve_ds_config(cfg, world_size=world_size), groups, main=False)
    ids = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(3))
    single = build_model(cfg.model, seed=cfg.train.seed)  # one process, the whole sequences
    single(ids[:, :-1], labels=ids[:, 1:]).backward()
    c = groups.topology.my_coords.context
    loss = engine(ids[:, 16 * c:16 * c + 16], labels=ids[:, 16 * c + 1:16 * c + 17])

    params = dict(engine.module.named_parameters())
    tensor_ranks, data_ranks = (tuple(dist.get_process_group_ranks(g))
                                for g in (groups.tensor, groups.data))
    def described(op, group, tensor) -> tuple[str, str, tuple]:  # (op, group, what was reduced)
        where = {tensor_ranks: "tensor", data_ranks: "data"}.get(group, str(group))
        grads = {n: p.grad for n, p in params.items() if p.grad is not None}
        if tensor.numel() == 1:  # the gradient norm's sums
            what = ("norm",)
        elif where == "data":
            what = tuple(_gradients_in(tensor.flatten(), grads))
        else:
            what = tuple(tensor.shape)
        return op, where, what

    with recorded_reductions(described) as seen:
        engine.backward(loss)
        reference = dict(single.named_parameters())
        for name, p in params.items():  # reduced by now: one process's gradients
            expected = reference[name].grad
            if not getattr(p, "expert_parallel", False):
                part = shard_range(name, cfg.model, tp_rank=groups.topology.my_coords.tensor,
                                   tp_size=2)
                expected = expected.narrow(part.dim, part.start, part.stop - part.start)
            _assert_close(p.grad, expected, name)
        engine.step()
    routers = sum(layer.weight_grad.reductions for layer in moe_layers(engine.module))
    experts = sorted(n for n, p in params.items() if getattr(p, "expert_parallel", False))
    return {"seen": seen, "params": sorted(params), "experts": experts, "routers": routers}


@pytest.mark.slow
def test_each_gradient_is_reduced_over_the_right_group_and_equals_one_process(tmp_path):
    """tensor 2 = expert 2 x context 2 (ZeRO-0): every parameter's gradient, experts' too, is
    all-reduced once over its data x context ranks (the context pair here); over the tensor
    (expert) group only the routers' gradients (once per step each) and activation gradients
    are, never an expert's; every gradient is then one process's (checked in the ranks)."""
    results = run_on_ranks(_reductions_of_one_step, world_size=4, tmp_path=tmp_path)
    for rank, result in enumerate(results):
        data = [n for op, where, what in result["seen"] if where == "data" and what != ("norm",)
                for n in what]
        assert "?" not in data and sorted(data) == result["params"], (rank, data)
        assert len(result["experts"]) == 2 * 2 * 3  # 2 of 4 experts in each of 2 layers
        tensor = [what for op, where, what in result["seen"] if where == "tensor"]
        # the routers' (E, h) once per step each (their hooks counted 2); the input gradients
        # (B, T/N, C) of the two attentions and the head, the norm's sum: nothing else
        router, activation = (4, 64), (2, 16, 64)
        assert result["routers"] == 2, (rank, result["routers"])
        assert Counter(tensor) == {router: 2, activation: 3, ("norm",): 1}, (rank, tensor)
        other = [(op, where) for op, where, _ in result["seen"] if where not in ("data", "tensor")]
        assert not other, (rank, other)


# ---- the planner ---------------------------------------------------------------------------------

def test_planned_expert_memory_and_all_to_all_time_of_mixtral_8x7b_by_hand():
    from pretrain.arithmetic import expert_parameters_per_rank, stage_items
    from pretrain.plan.clusters import make_cluster
    from pretrain.plan.step_time import estimate_time
    from tests.test_moe import MIXTRAL_8X7B as m

    h100 = make_cluster("h100-80gb", nodes=1)  # NVLink 450 GB/s per GPU, 80% of it reached
    ep2 = Layout(tensor=2, expert=2, micro_batch=1, global_batch=8, precision=Precision.BF16)
    tp2 = dataclasses.replace(ep2, expert=1)
    # 4 of the 8 experts whole (3 matrices of 4096 x 14336) in each of 32 layers: 22.5B
    assert expert_parameters_per_rank(m, ep2, layers=32) == 32 * 4 * 3 * 4096 * 14336 \
        == expert_parameters_per_rank(m, tp2, layers=32) == 22_548_578_304
    ep_time = estimate_time(m, ep2, h100, stage_items(m, ep2))[0]
    tp_time = estimate_time(m, tp2, h100, stage_items(m, tp2))[0]
    # a micro-batch: 4096 tokens, 2048 per rank, 2 rows each (top-2) of 4096 bf16 values sent by
    # 4 all-to-alls per layer (dispatch, combine; backward both), half of them to the other rank
    link = 450e9 * 0.8
    per_micro_batch = 32 * 4 * 0.5 * (2048 * 2 * 4096 * 2) / link
    assert ep_time.expert_comm == pytest.approx(8 * per_micro_batch, rel=1e-12)  # 0.0477 s
    assert ep_time.expert_comm == pytest.approx(0.047721858, rel=1e-6)
    # tensor parallelism: an all-reduce of 4096 x 4096 bf16 activations costs 1/2 x 2 x 32 MiB
    # over the link; attention 2 per layer, the tp MLP 2, the expert MLP's all-gathers 1
    all_reduce = 4096 * 4096 * 2 / link
    assert tp_time.tensor_comm == pytest.approx(8 * 32 * 4 * all_reduce, rel=1e-12)
    assert ep_time.tensor_comm == pytest.approx(8 * 32 * 3 * all_reduce + ep_time.expert_comm,
                                                rel=1e-12)


def test_every_rank_of_the_mixtral_8x7b_recipe_builds_as_planned():
    """tp 8 = ep 8 x pp 4 x dp 4 on 128 GPUs: each of the 32 distinct ranks (4 stages x 8 tensor
    ranks) built on the meta device holds 1/8 of attention, one whole expert of each of its
    stage's 8 layers, the routers and norms, and on the first stage 1/8 of the embedding, on the
    last the final norm and 1/8 of the head."""
    import json

    from tests.test_plan_build import _pretrain

    run = _pretrain(["plan", "--config", "configs/mixtral_8x7b.yaml", "--world-size", "128",
                     "--build", "--json"])
    assert run.returncode == 0, run.stderr[-3000:]
    plan = json.loads(run.stdout)
    builds = plan["builds"]
    assert sorted((b["stage"], b["tensor_rank"]) for b in builds) == \
        [(stage, rank) for stage in range(4) for rank in range(8)]
    assert [s["layers"] for s in plan["stages"]] == [8, 8, 8, 8]
    attention = (2 * 4096 * 4096 + 2 * 4096 * 1024) // 8
    layer = attention + 3 * 4096 * 14336 + 8 * 4096 + 2 * 4096  # one expert, router, norms
    vocab = 32768 * 4096 // 8  # 32000 padded to a multiple of 128 x 8, untied embedding and head
    expected = [8 * layer + vocab, 8 * layer, 8 * layer, 8 * layer + 4096 + vocab]
    assert all(b["built"] == b["planned"] == expected[b["stage"]] for b in builds)
