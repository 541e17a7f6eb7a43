"""The planner's model of `train.engine: fsdp2`: memory and data-parallel time of FSDP2 as
`pretrain.training.fsdp2` shards the model (a unit per decoder layer, the root unit the embedding, final
norm and head), counted by hand for one small layout, and where it differs from DeepSpeed's."""
from __future__ import annotations

from dataclasses import replace

import pytest

from pretrain.config import Engine, ModelConfig, Precision, Recompute
from pretrain.errors import ConfigError
from pretrain.resolve.layout import Layout
from pretrain.plan.clusters import COLLECTIVE_EFFICIENCY, make_cluster
from pretrain.plan.search import estimate, search

# hidden 64, 4 layers, an untied 512-token vocabulary (a multiple of 128: no padding)
MODEL = ModelConfig(vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=4,
                    ffn_hidden_size=176, seq_length=32)
LAYER = 4 * 64 * 64 + 3 * 64 * 176 + 2 * 64  # q, k, v, o; gate, up, down; two norms: 50,304
HEAD = 512 * 64 + 64  # the final norm and the head
ROOT = 512 * 64 + HEAD  # and the embedding: 65,600
N = 4 * LAYER + ROOT  # 266,816 on each rank before sharding
ZERO3 = Layout(data=2, micro_batch=2, global_batch=4, zero_stage=3, precision=Precision.BF16)
H100 = make_cluster("h100-80gb", nodes=1)
# compute takes no time here: what the data-parallel collectives cost is all exposed
NO_COMPUTE = make_cluster("h100-80gb", nodes=1, peak_tflops=1e15)


def _fsdp2(layout: Layout, cluster=H100):
    return estimate(MODEL, layout, cluster, engine=Engine.FSDP2)


def _deepspeed(layout: Layout, cluster=H100):
    return estimate(MODEL, layout, cluster)


def test_fsdp2_memory_counted_by_hand():
    """bf16 with the ZeRO-3 JSON on 2 ranks: fp32 shards (the masters), fp32 gradient shards and
    AdamW's two fp32 moments; the root unit, the layer computing and one more layer gathered in
    bf16; the head's and final norm's, and one layer's, bf16 gradients and that layer's fp32
    reduce-scatter input (the embedding's gradient comes once the activations are freed)."""
    memory = _fsdp2(ZERO3).memory
    assert memory.parameters_count == N == 266_816
    assert (memory.params, memory.grads, memory.optimizer) == (4 * N / 2, 4 * N / 2, 8 * N / 2)
    assert memory.model_states == 16 * N / 2
    gathered = (ROOT + 2 * LAYER) * 2
    in_flight = (HEAD + LAYER) * 2 + LAYER * 4
    assert memory.buffers == gathered + in_flight == 332_416 + 367_488
    assert memory.host == 0
    # the model's own activations, whichever engine shards its weights
    assert memory.activations == _deepspeed(ZERO3).memory.activations > 0
    # the ZeRO-1/2 JSONs keep every layer gathered from its forward to its backward
    kept = _fsdp2(replace(ZERO3, zero_stage=1)).memory
    assert kept.buffers == (ROOT + 5 * LAYER) * 2 + in_flight
    assert kept.model_states == memory.model_states
    assert _fsdp2(replace(ZERO3, zero_stage=2)).memory == kept


def test_fsdp2_states_are_sixteen_bytes_per_parameter_in_fp32_too_and_offload_moves_them():
    """DeepSpeed's fp32 ZeRO-3 clones an fp32 master of the fp32 weights (20 bytes / parameter /
    ranks); FSDP2 steps the fp32 shards themselves (16). CPUOffloadPolicy keeps all three on
    the host, whichever of the JSON's offloads asks for it."""
    fp32 = replace(ZERO3, precision=Precision.FP32)
    assert _fsdp2(fp32).memory.model_states == 16 * N / 2
    assert _deepspeed(fp32).memory.model_states == 20 * N / 2
    assert _fsdp2(fp32).memory.buffers == (ROOT + 2 * LAYER) * 4 + (HEAD + LAYER) * 4 + LAYER * 4
    for offload in ({"offload_optimizer": "cpu"},
                    {"offload_optimizer": "cpu", "offload_param": "cpu"}):
        moved = _fsdp2(replace(ZERO3, **offload)).memory
        assert (moved.params, moved.grads, moved.optimizer) == (0, 0, 0)
        assert moved.host == 16 * N / 2
        assert moved.buffers == _fsdp2(ZERO3).memory.buffers


def test_fsdp2_memory_has_no_deepspeed_bucket_term():
    """DeepSpeed's ZeRO-3 buffers follow its reduce bucket and live-parameter limit; FSDP2 has
    neither."""
    small = replace(ZERO3, reduce_bucket=1000, allgather_bucket=1000, max_live_parameters=LAYER)
    assert _deepspeed(small).memory.buffers < _deepspeed(ZERO3).memory.buffers
    assert _fsdp2(small).memory.buffers == _fsdp2(ZERO3).memory.buffers


def _seconds(nbytes: float, *, ranks: int = 2) -> float:
    """One ring all-gather or reduce-scatter of `nbytes` on the H100 node's links."""
    return (ranks - 1) / ranks * nbytes / (450e9 * COLLECTIVE_EFFICIENCY)


def test_fsdp2_communication_per_micro_batch_counted_by_hand():
    """ZeRO-3's JSON: every micro-batch gathers every unit forward and backward in bf16 and
    reduce-scatters every gradient in fp32; DeepSpeed's ZeRO-3 reduce-scatters in the JSON's
    communication_data_type (the resolver's fp32 for bf16), which fsdp2 does not read."""
    fsdp2, deepspeed = _fsdp2(ZERO3, NO_COMPUTE).time, _deepspeed(ZERO3, NO_COMPUTE).time
    assert fsdp2.data_comm == pytest.approx(_seconds(2 * N * 2) + _seconds(N * 4), rel=1e-6)
    assert deepspeed.data_comm == pytest.approx(_seconds(2 * N * 2) + _seconds(N * 4), rel=1e-6)
    bf16_reduce = {"communication_data_type": "bf16"}
    assert estimate(MODEL, ZERO3, NO_COMPUTE, ds=bf16_reduce).time.data_comm == pytest.approx(
        _seconds(2 * N * 2) + _seconds(N * 2), rel=1e-6)
    assert estimate(MODEL, ZERO3, NO_COMPUTE, engine=Engine.FSDP2,
                    ds=bf16_reduce).time.data_comm == fsdp2.data_comm
    # the ZeRO-1/2 JSONs gather once (forward) and still reduce-scatter every micro-batch
    kept = _fsdp2(replace(ZERO3, zero_stage=1), NO_COMPUTE).time
    assert kept.data_comm == pytest.approx(_seconds(N * 2) + _seconds(N * 4), rel=1e-6)
    # behind the micro-batch's compute, as ZeRO-3's prefetch: what exceeds it is exposed
    time = _fsdp2(ZERO3).time
    assert 0 < time.compute < fsdp2.data_comm
    assert time.data_comm == pytest.approx(fsdp2.data_comm - time.compute, rel=1e-6)


def test_fsdp2_communication_grows_with_micro_batches_where_deepspeeds_zero1_does_not():
    """FSDP2 has no accumulation without communication: 4 micro-batches per step cost 4 times
    the collectives of one. DeepSpeed's ZeRO-1 reduces the accumulated gradients once per
    step; its ZeRO-3 also communicates per micro-batch."""
    one = replace(ZERO3, zero_stage=1)
    four = replace(one, global_batch=16)
    assert four.grad_accum == 4 * one.grad_accum == 4

    def data_comm(layout, engine):
        return estimate(MODEL, layout, NO_COMPUTE, engine=engine).time.data_comm

    assert data_comm(four, Engine.FSDP2) == pytest.approx(4 * data_comm(one, Engine.FSDP2))
    assert data_comm(four, Engine.DEEPSPEED) == pytest.approx(data_comm(one, Engine.DEEPSPEED))
    assert data_comm(replace(four, zero_stage=3), Engine.DEEPSPEED) == pytest.approx(
        4 * data_comm(replace(one, zero_stage=3), Engine.DEEPSPEED))


def test_fsdp2_offload_copies_shards_every_micro_batch_and_steps_on_the_host():
    """CPUOffloadPolicy: each all-gather copies the fp32 shard to the device, each reduce-scatter
    the fp32 gradient shard back; the step's AdamW on the host. DeepSpeed's ZeRO-Offload moves
    the gradients and parameters once per step."""
    offload = replace(ZERO3, offload_optimizer="cpu", global_batch=16)
    shard = N / 2
    copies = 4 * 3 * shard * 4 / (H100.pcie_gbps * 1e9)  # 4 micro-batches x (2 gathers + 1)
    assert _fsdp2(offload).time.offload == pytest.approx(copies + shard / 1e9, rel=1e-9)
    assert _fsdp2(ZERO3).time.offload == 0.0


def test_fsdp2_refuses_what_it_does_not_run():
    refused = [(replace(ZERO3, pipeline=2, data=1, schedule="zbv", virtual_stages=2),
                "parallel.pipeline_schedule=zbv with ZeRO stage 3"),
               (replace(ZERO3, zero_stage=0), "train.engine=fsdp2 cannot run this config: .*"
                                              "ZeRO stage 0")]
    for layout, reason in refused:
        with pytest.raises(ConfigError, match=reason):
            _fsdp2(layout)
        _deepspeed(replace(layout, zero_stage=min(layout.zero_stage, 1)))  # DeepSpeed runs it


def test_the_search_under_fsdp2_ranks_only_what_fsdp2_runs():
    plans = search(MODEL, make_cluster("h100-80gb", nodes=1), global_batch=32,
                   engine=Engine.FSDP2)
    assert plans and all(p.engine is Engine.FSDP2 for p in plans)
    assert {p.layout.zero_stage for p in plans} == {2, 3}  # ZeRO-1's JSON is ZeRO-2's here
    # pipelines under fsdp2's schedules, none splitting the backward at ZeRO-3
    piped = [p.layout for p in plans if p.layout.pipeline > 1]
    assert piped and all(lay.engine == "fsdp2" for lay in piped)
    assert len({lay.schedule for lay in piped}) > 1
    assert not any(lay.zero_stage == 3 and lay.schedule in ("zero_bubble", "zbv", "dualpipe_v")
                   for lay in piped)
    # sequence parallelism wherever the tensor is split, as under DeepSpeed
    assert all(p.layout.sequence_parallel == (p.layout.tensor > 1) for p in plans)
    assert any(p.layout.tensor > 1 for p in plans)
    assert any(p.layout.recompute is Recompute.FULL for p in plans)
    assert plans[0].to_dict()["engine"] == "fsdp2"


def test_hsdp_shards_within_a_replica_group_and_all_reduces_across_the_groups():
    """dp 4 as 2 replica groups x 2 shards (one node, ZeRO-3's JSON, bf16, one micro-batch):
    the states of 2 ranks' shards, not 4; per micro-batch the bf16 gathers (forward and
    backward) and the fp32 reduce-scatter over 2 ranks, then an all-reduce (2 passes of the
    ring) of each rank's fp32 gradient shard, N / 2 elements, over the 2 groups."""
    dp4 = replace(ZERO3, data=4, micro_batch=1)
    hsdp = replace(dp4, fsdp2_replicas=2)
    assert _fsdp2(dp4).memory.model_states == 16 * N / 4
    assert _fsdp2(hsdp).memory.model_states == 16 * N / 2
    assert _fsdp2(hsdp).memory.buffers == _fsdp2(dp4).memory.buffers
    assert _fsdp2(hsdp, NO_COMPUTE).time.data_comm == pytest.approx(
        _seconds(2 * N * 2) + _seconds(N * 4) + 2 * _seconds(N / 2 * 4), rel=1e-6)
    with pytest.raises(ConfigError, match="train.fsdp2_replicas=3: must divide the 4"):
        _fsdp2(replace(dp4, fsdp2_replicas=3))


def test_the_search_under_fsdp2_tries_hsdp_groups_of_whole_nodes_and_names_them():
    """On 4 nodes x 8 GPUs at tp 1, the data ranks split into replica groups whose shard group is
    one node (4 groups) or whole nodes (2), or a part of one node (8, 16, 32); on 3 nodes into 3
    groups of a node (no power of two); a layout's arguments carry train.fsdp2_replicas where it
    is HSDP, and its description says hsdp<R>."""
    from pretrain.plan.report import selecting_arguments
    from pretrain.plan.search import hsdp_replicas

    cluster = make_cluster("h100-80gb", nodes=4)
    assert hsdp_replicas(Layout(data=32), cluster) == (1, 2, 4, 8, 16, 32)
    assert hsdp_replicas(Layout(tensor=2, data=16), cluster) == (1, 2, 4, 8, 16)
    assert hsdp_replicas(Layout(data=24), make_cluster("h100-80gb", nodes=3)) == \
        (1, 3, 6, 12, 24)  # not 2 (12 ranks: a node and a half) nor 4 or 8 (6 or 3 ranks)
    plans = search(MODEL, cluster, global_batch=64, engine=Engine.FSDP2)
    replicas = {p.layout.fsdp2_replicas for p in plans}
    assert 1 in replicas and len(replicas) > 1
    for plan in plans[:20]:
        r = plan.layout.fsdp2_replicas
        assert (f"train.fsdp2_replicas={r}" in selecting_arguments(
            plan.layout, "ds.json", engine=Engine.FSDP2)) == (r > 1)
        assert (f"hsdp{r}" in plan.layout.describe()) == (r > 1)
    # under DeepSpeed there is no HSDP
    assert {p.layout.fsdp2_replicas for p in search(MODEL, cluster, global_batch=64)} == {1}
