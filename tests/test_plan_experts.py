"""The planner's terms of expert layouts beyond the tensor group (parallel.expert from a stage's
data ranks, parallel.expert_tensor), by hand on Qwen3-30B-A3B's shape; the search's expert
candidates; the Qwen3-30B-A3B recipe built on the meta device as planned.

The memory and time functions are called directly: they plan any expert layout of the grid
(`pretrain.resolve.topology`), whether or not the rulebook (`check_experts`) lets a run use it
yet."""
from __future__ import annotations

import json

import pytest

from pretrain.arithmetic import (expert_data_size, expert_parameters_per_rank,
                                 expert_tensor_size, layer_on_gpu, stage_expert_parameters,
                                 stage_items, stage_parameters)
from pretrain.config import MODEL_PRESETS, ModelConfig, Precision
from pretrain.plan.clusters import make_cluster
from pretrain.plan.memory import expert_dispatch_buffers, stage_memory
from pretrain.plan.report import _experts_line
from pretrain.plan.search import expert_layouts
from pretrain.plan.step_time import (_data_comm, _MicroBatch, estimate_time,
                                     experts_in_fp8, experts_with_rows,
                                     expert_router_flops_per_token, fp8_cast_elements,
                                     fp8_flops_per_token)
from pretrain.resolve.layout import Layout
from pretrain.resolve.topology import Topology

QWEN3_MOE = ModelConfig(**MODEL_PRESETS["qwen3_30b_a3b"])  # 48 layers of 128 experts, top 8
H, F, E, K = 2048, 768, 128, 8
EXPERT = 3 * H * F  # one expert's gate, up and down: 4,718,592
ATTENTION = 2 * 4096 * H + 2 * 512 * H  # q and o (32 heads of 128), k and v (4 kv heads)
LINK = 450e9 * 0.8  # an H100's NVLink at the collectives' efficiency
NETWORK = 50e9 * 0.8  # its share of the node's NICs


def _layout(**kw) -> Layout:
    return Layout(**{"micro_batch": 1, "global_batch": 64, "precision": Precision.BF16,
                     "sequence_parallel": True, **kw})


def test_expert_weights_per_gpu_and_their_zero_partition_over_the_expert_data_ranks():
    """tp 2 x ep 8 (whole experts) x dp 16 on 32 ranks: each GPU holds 16 of the 128 experts
    whole, which 32 / (8 x 1) = 4 ranks hold the same of: ZeRO partitions the experts' state
    over those 4, the dense weights' over the 16 data ranks."""
    ep8 = _layout(tensor=2, data=16, expert=8, zero_stage=2)
    assert (expert_tensor_size(ep8), expert_data_size(ep8)) == (1, 4)
    assert expert_parameters_per_rank(QWEN3_MOE, ep8, layers=48) == 48 * 16 * EXPERT
    router_and_norms = E * H + 2 * H + 2 * 128  # router, two RMSNorms, Qwen3's q/k norms
    assert layer_on_gpu(QWEN3_MOE, ep8, 0) == ATTENTION // 2 + 16 * EXPERT + router_and_norms
    # each expert split over the tensor ranks instead: 8 expert ranks x 2 = 16, 2 expert-data
    etp = _layout(tensor=2, data=16, expert=8, expert_tensor=2, zero_stage=2)
    assert (expert_tensor_size(etp), expert_data_size(etp)) == (2, 2)
    assert expert_parameters_per_rank(QWEN3_MOE, etp, layers=48) == 48 * 16 * EXPERT // 2
    assert layer_on_gpu(QWEN3_MOE, etp, 0) == ATTENTION // 2 + 16 * EXPERT // 2 + router_and_norms
    # on the tensor ranks (ep = tp) or split as the dense MLP (ep 1): 1/tp of the experts,
    # partitioned over the data ranks as before
    for same in (_layout(tensor=2, data=16, expert=2), _layout(tensor=2, data=16)):
        assert expert_data_size(same) == 16
        assert expert_parameters_per_rank(QWEN3_MOE, same, layers=48) == 48 * E * EXPERT // 2

    items = stage_items(QWEN3_MOE, ep8)[0]
    n = stage_parameters(QWEN3_MOE, ep8, items)
    experts = stage_expert_parameters(QWEN3_MOE, ep8, items)
    assert experts == 48 * 16 * EXPERT
    mem = stage_memory(QWEN3_MOE, ep8, 0, items)
    # bf16 ZeRO-2: 2-byte gradients and 12 bytes of optimizer state partitioned, 2-byte weights
    # whole; dense / 16, experts / 4
    shard = (n - experts) / 16 + experts / 4
    assert mem.params == n * 2
    assert mem.grads == pytest.approx(2 * shard, rel=1e-12)
    assert mem.optimizer == pytest.approx(12 * shard, rel=1e-12)
    # the same layout with the experts' ranks the data ranks would partition them 4x finer
    assert mem.optimizer > 12 * n / 16


def test_the_all_to_all_buffers_of_one_moe_layer_in_flight():
    """Send and receive buffers of the dispatch: a micro-batch of 2 x 4096 tokens, 1/tp of
    them a rank's, 8 rows each of 2048 bf16 values; none without expert parallelism."""
    ep8 = _layout(tensor=2, data=16, expert=8, micro_batch=2)
    rows = 2 * 4096 / 2 * K
    assert expert_dispatch_buffers(QWEN3_MOE, ep8) == 2 * rows * H * 2  # 256 MiB
    assert expert_dispatch_buffers(QWEN3_MOE, _layout(tensor=2, data=16)) == 0
    items = stage_items(QWEN3_MOE, ep8)[0]
    without = stage_memory(QWEN3_MOE, _layout(tensor=2, data=16, expert=8, micro_batch=1),
                           0, items)
    with_two = stage_memory(QWEN3_MOE, ep8, 0, items)
    assert with_two.buffers - without.buffers == pytest.approx(2 * rows * H * 2 / 2, rel=1e-12)


def _expert_comm(layout: Layout, cluster) -> float:
    return estimate_time(QWEN3_MOE, layout, cluster, stage_items(QWEN3_MOE, layout))[0].expert_comm


def test_the_dispatch_and_combine_all_to_alls_on_the_expert_groups_link_by_hand():
    """Per micro-batch 4 all-to-alls a MoE layer (48 of them), each rank sending its 4096 / tp
    tokens' 8 rows of 2048 bf16 values, (ep - 1) / ep of them away: over NVLink while ep x
    expert_tensor ranks fit a node's 8 GPUs, over the network beyond."""
    two_nodes = make_cluster("h100-80gb", nodes=2)
    rows = 4096 / 2 * K
    per_layer = 4 * rows * H * 2  # bytes a rank sends and receives in a layer's 4 all-to-alls
    micro_batches = 64 // 8  # global 64 = 1 x 8 x dp 8
    ep4 = _layout(tensor=2, data=8, expert=4)  # 4 ranks x 1: one node
    assert _expert_comm(ep4, two_nodes) == pytest.approx(
        micro_batches * 48 * 3 / 4 * per_layer / LINK, rel=1e-12)
    ep16 = _layout(tensor=2, data=8, expert=16)  # 16 ranks: two nodes
    assert _expert_comm(ep16, two_nodes) == pytest.approx(
        micro_batches * 48 * 15 / 16 * per_layer / NETWORK, rel=1e-12)
    # each expert split over the 2 tensor ranks: 4 x 2 = 8 ranks (one node), and each layer
    # all-gathers the rows the expert-tensor pair received, and reduce-scatters their outputs,
    # forward and backward: 4 more collectives of 2 x rows, half of them moving
    etp = _layout(tensor=2, data=8, expert=4, expert_tensor=2)
    gathers = 4 * (2 * rows * H * 2) / 2 / LINK
    assert _expert_comm(etp, two_nodes) == pytest.approx(
        micro_batches * 48 * (3 / 4 * per_layer / LINK + gathers), rel=1e-12)
    assert _expert_comm(_layout(tensor=2, data=8), two_nodes) == 0.0  # no expert parallelism


def test_the_experts_gradients_are_reduced_over_the_expert_data_ranks():
    """ZeRO-1's all-reduce of the step's gradients (fp32, 4 bytes): the dense ones over the 16
    data ranks, the experts' over the 4 expert-data ranks; nothing of the backward hides it
    here (compute 0)."""
    ep8 = _layout(tensor=2, data=16, expert=8, zero_stage=1)
    items = stage_items(QWEN3_MOE, ep8)[0]
    n = stage_parameters(QWEN3_MOE, ep8, items)
    experts = stage_expert_parameters(QWEN3_MOE, ep8, items)
    cluster = make_cluster("h100-80gb", nodes=4)
    mb = _MicroBatch(tokens=4096, act_bytes=2, layers=48, compute=0.0)
    seconds = _data_comm(ep8, cluster, mb, stage_params=n, grad_bytes=4, expert_params=experts)
    # a 32-rank stage spans 4 nodes: both rings on the network
    dense = 2 * 15 / 16 * (n - experts) * 4 / NETWORK
    expert = 2 * 3 / 4 * experts * 4 / NETWORK
    assert seconds == pytest.approx(dense + expert, rel=1e-12)
    # with the experts on the tensor ranks their ranks are the data ranks: one ring of all
    tp_ep = _layout(tensor=2, data=16, expert=2, zero_stage=1)
    n2 = stage_parameters(QWEN3_MOE, tp_ep, items)
    assert _data_comm(tp_ep, cluster, mb, stage_params=n2, grad_bytes=4,
                      expert_params=stage_expert_parameters(QWEN3_MOE, tp_ep, items)) == \
        pytest.approx(2 * 15 / 16 * n2 * 4 / NETWORK, rel=1e-12)


def test_the_router_runs_on_every_tensor_rank_without_expert_parallelism():
    """Expert 1: each tensor rank routes the whole gathered sequence (the h x 128 matmul,
    forward and backward, not 1/tp of it); expert-parallel ranks route their own chunk."""
    tp4 = _layout(tensor=4, data=4)
    assert expert_router_flops_per_token(QWEN3_MOE, tp4, 12) == 6 * E * H * 12 * 3 / 4
    assert expert_router_flops_per_token(QWEN3_MOE, _layout(tensor=4, data=4, expert=4), 12) == 0
    assert expert_router_flops_per_token(QWEN3_MOE, _layout(tensor=1, data=4), 12) == 0


def test_a_gpu_concatenates_and_casts_only_the_experts_it_holds():
    """Fused projections concatenate the gate and up weights of the experts a GPU holds, and
    FP8 casts their weights: 16 of 128 whole at tp 2 x ep 8, a quarter of the 1/2 of every
    expert it holds at expert 1 (or 2, the tensor ranks)."""
    import dataclasses

    from pretrain.arithmetic import mean_projection_elements_on_gpu
    from pretrain.plan.step_time import _concatenated_weights

    fused = dataclasses.replace(QWEN3_MOE, fused_projections=True)
    ep8, ep1 = _layout(tensor=2, data=16, expert=8), _layout(tensor=2, data=16)
    assert _concatenated_weights(fused, ep1) == _concatenated_weights(
        fused, _layout(tensor=2, data=16, expert=2))
    assert _concatenated_weights(fused, ep1) - _concatenated_weights(fused, ep8) == \
        pytest.approx(2 * H * F * E * (1 - 1 / 4) / 2, rel=1e-12)
    assert mean_projection_elements_on_gpu(QWEN3_MOE, ep1) - \
        mean_projection_elements_on_gpu(QWEN3_MOE, ep8) == \
        pytest.approx(E * EXPERT * (1 - 1 / 4) / 2, rel=1e-12)


def test_the_search_tries_every_expert_layout_of_a_stage():
    """(expert, expert_tensor) candidates: expert 1 (experts split as the dense MLP), every
    expert size dividing the 128 experts and the stage's 32 ranks with whole experts, and with
    the experts split over the tensor ranks where expert x tensor divides them; whatever the
    rulebook runs today (its refusals are `estimate`'s)."""
    assert expert_layouts(QWEN3_MOE, 2, 32) == (
        (1, 0), (2, 0), (2, 2), (4, 0), (4, 2), (8, 0), (8, 2), (16, 0), (16, 2), (32, 0))
    assert expert_layouts(QWEN3_MOE, 1, 8) == ((1, 0), (2, 0), (4, 0), (8, 0))
    mixtral = ModelConfig(num_experts=8, experts_per_token=2)
    assert expert_layouts(mixtral, 8, 32) == ((1, 0), (2, 0), (2, 8), (4, 0), (4, 8), (8, 0))
    assert expert_layouts(ModelConfig(), 8, 32) == ((1, 0),)  # dense: no expert layouts


def test_plan_prints_where_the_experts_lie_and_the_expert_grid():
    """The experts line of `pretrain plan`: how many experts a GPU holds and rank 0's expert
    and expert-data groups, as `Topology` draws them."""
    ep8 = _layout(tensor=2, data=16, expert=8)
    line = _experts_line(QWEN3_MOE, ep8)
    assert line.startswith("experts 16 of 128 experts whole per GPU: 3.62B expert parameters "
                           "(48 layers); expert=8 x expert_tensor=1: all-to-all over expert "
                           "groups like [0, 1, 2, 3, 4, 5, 6, 7], experts reduced and "
                           "partitioned over expert-data groups of 4 like [0, 8, 16, 24]"), line
    topo = Topology(tensor=2, pipeline=1, world_size=32, expert=8)
    assert topo.expert_groups()[0] == list(range(8))
    assert topo.expert_data_groups()[0] == [0, 8, 16, 24]
    assert "expert=8 x expert_tensor=1: expert groups [[0, 1, 2, 3, 4, 5, 6, 7]" \
        in topo.describe()
    etp = _experts_line(QWEN3_MOE, _layout(tensor=2, data=16, expert=8, expert_tensor=2))
    assert "16 of 128 experts each split over 2 ranks" in etp
    assert "groups like [0, 2, 4, 6, 8, 10, 12, 14]" in etp


@pytest.mark.slow  # 8 meta-device builds of 12 layers of 128 experts: ~40 s loaded
def test_every_rank_of_the_qwen3_30b_a3b_recipe_builds_as_planned():
    """tp 2 x pp 4 x dp 4 on 32 GPUs: each of the 8 distinct ranks (4 stages x 2 tensor ranks)
    built on the meta device holds 12 layers of half of attention and half of each of the 128
    experts, the routers and norms; the first stage half of the embedding, the last the final
    norm and half of the head."""
    from tests.test_plan_build import _pretrain

    run = _pretrain(["plan", "--config", "configs/qwen3_30b_a3b.yaml", "--world-size", "32",
                     "--build", "--json"])
    assert run.returncode == 0, run.stderr[-3000:]
    plan = json.loads(run.stdout)
    builds = plan["builds"]
    assert sorted((b["stage"], b["tensor_rank"]) for b in builds) == \
        [(stage, rank) for stage in range(4) for rank in range(2)]
    assert [s["layers"] for s in plan["stages"]] == [12, 12, 12, 12]
    layer = ATTENTION // 2 + E * EXPERT // 2 + E * H + 2 * H + 2 * 128
    vocab = 152064 * H // 2  # 151936 padded to a multiple of 128 x 2, untied embedding and head
    expected = [12 * layer + vocab, 12 * layer, 12 * layer, 12 * layer + H + vocab]
    assert all(b["built"] == b["planned"] == expected[b["stage"]] for b in builds)


def test_fp8_costs_the_experts_that_run_and_their_routed_rows_on_the_loop_only():
    """tp 2 (SP, each expert split over the two), one layer, FP8. The loop casts, forward and
    twice in backward: attention's inputs (2 x 2048 + 4096) / 2 a token, the k x tokens routed
    rows (every tensor rank routes the whole sequence) at gate's and up's full 2048 and down's
    768 / 2, attention's weights / 2 and the weights of the experts that got a row: of 16
    tokens, each expert misses all of them with probability (1 - 8/128)^16. Its FP8 FLOPs are
    attention's and the k experts'. On H100s in bf16 the experts run as the grouped matmul:
    neither their casts nor their FLOPs count; in fp32, with no grouped kernel, or at an expert
    width that is no multiple of 16 bytes, they run as the loop."""
    layout = _layout(tensor=2, data=16, fp8="tensorwise")
    h100 = make_cluster("h100-80gb", nodes=4)
    running = 1 - (1 - K / E) ** 16
    assert experts_with_rows(QWEN3_MOE, layout, 16) == pytest.approx(running, rel=1e-12)
    assert experts_with_rows(QWEN3_MOE, layout, 4096) == 1.0
    mb = _MicroBatch(tokens=16, act_bytes=2, layers=1, compute=0.0)
    attention = 16 * (2 * H + 4096) / 2 + ATTENTION / 2
    experts = 16 * K * (2 * H + F / 2) + running * E * EXPERT / 2
    assert fp8_cast_elements(QWEN3_MOE, layout, mb) == pytest.approx(3 * (attention + experts),
                                                                     rel=1e-12)
    assert fp8_cast_elements(QWEN3_MOE, layout, mb, experts=False) == pytest.approx(
        3 * attention, rel=1e-12)
    # expert ranks from the data ranks (ep 8, whole experts): 16 of the 128 on a GPU, the
    # group's 8 ranks' rows to them, their k x 8 x 16 / 8 rows on this GPU
    ep8 = _layout(tensor=1, data=32, expert=8, fp8="tensorwise")
    running8 = 1 - (1 - K / E) ** (8 * 16)
    assert fp8_cast_elements(QWEN3_MOE, ep8, mb) == pytest.approx(
        3 * (16 * (2 * H + 4096) + ATTENTION + 16 * K * (2 * H + F)
             + running8 * 16 * EXPERT), rel=1e-12)
    assert fp8_flops_per_token(QWEN3_MOE, layout, 1) == 3 * 2 * (ATTENTION + K * EXPERT) / 2
    assert fp8_flops_per_token(QWEN3_MOE, layout, 1, experts=False) == 3 * 2 * ATTENTION / 2
    assert not experts_in_fp8(QWEN3_MOE, layout, h100)
    assert experts_in_fp8(QWEN3_MOE, _layout(tensor=2, fp8="tensorwise",
                                             precision=Precision.FP32), h100)
    assert experts_in_fp8(QWEN3_MOE, layout, make_cluster("h100-80gb", nodes=4,
                                                          grouped_matmul=False))
    odd = ModelConfig(**{**MODEL_PRESETS["qwen3_30b_a3b"], "moe_ffn_hidden_size": 772})
    assert experts_in_fp8(odd, layout, h100)  # 386 a tensor rank: not 8 bf16 elements' multiple
    assert not experts_in_fp8(QWEN3_MOE, _layout(tensor=2), make_cluster("h100-80gb", nodes=4,
                                                                         grouped_matmul=False))
