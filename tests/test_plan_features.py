"""The planner's accounting of fsdp2's pipeline schedules, FP8, selective recompute, Muon and a
family's per-head norms, each formula against a hand computation (`pretrain.plan`)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from pretrain.arithmetic import newton_schulz_flops, pipeline_rank_items, stage_items
from pretrain.config import Engine, ModelConfig, Precision, Recompute
from pretrain.errors import ConfigError
from pretrain.plan.clusters import MATMUL_EFFICIENCY, make_cluster
from pretrain.plan.memory import (fp8_buffers, fsdp2_gathered_bytes, layer_activation_elements,
                                  micro_batches_in_flight, muon_parameters, muon_step_bytes,
                                  stage_activations, stage_memory)
from pretrain.plan.search import FSDP2_SCHEDULES, estimate, search
from pretrain.plan.step_time import (fp8_flops_per_token, muon_step_seconds,
                                     pipeline_actions_per_micro_batch, pipeline_bubble_slots,
                                     pipeline_messages_per_micro_batch, pipeline_overhead,
                                     pipeline_p2p_bytes, pipeline_split_share)
from pretrain.resolve.layout import Layout

# a small model whose counts are easy by hand: h 64, 4 heads of 16 (2 kv heads), f 128
SMALL = ModelConfig(hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=128,
                    num_layers=8, seq_length=32, vocab_size=256, tie_embeddings=False,
                    fused_projections=False)
# q 64x64, k 32x64, v 32x64, o 64x64, gate/up 128x64, down 64x128
PROJECTIONS = 4096 + 2048 + 2048 + 4096 + 3 * 8192  # 36,864
H100 = make_cluster("h100-80gb", nodes=1)


def _fsdp2(**fields) -> Layout:
    return Layout(engine="fsdp2", zero_stage=2, **fields)


# ---- pipeline schedules ------------------------------------------------------------------------

@pytest.mark.parametrize("schedule, virtual, slots", [
    ("1f1b", 1, 7.0), ("interleaved_1f1b", 2, 3.5), ("interleaved_1f1b", 4, 1.75),
    ("zero_bubble", 1, 7 / 3), ("zero_bubble", 2, 7 / 6), ("zbv", 2, 7 / 6),
    ("dualpipe_v", 2, 7 / 3)])
def test_each_schedule_s_bubble_in_micro_batch_slots(schedule, virtual, slots):
    """pp 8: 1F1B fills and drains in pp - 1 = 7 slots; interleaving divides by v; the
    zero-bubble schedules leave F + B - W = a third of each slot (of each of v stages'); DualPipeV
    a third of 1F1B's; DeepSpeed's pipeline is 1F1B whatever the layout says."""
    layout = _fsdp2(pipeline=8, global_batch=16, schedule=schedule, virtual_stages=virtual)
    assert pipeline_bubble_slots(layout) == pytest.approx(slots)
    assert pipeline_bubble_slots(replace(layout, engine="deepspeed")) == 7.0


@pytest.mark.parametrize("schedule, virtual, flights", [
    ("1f1b", 1, [4, 3, 2, 1]),
    # ((v - 1) pp + 2 (pp - 1 - rank) + 1) / v = (4 + 6 + 1) / 2 at rank 0
    ("interleaved_1f1b", 2, [5.5, 4.5, 3.5, 2.5]),
    ("zero_bubble", 1, [4, 4, 4, 4]), ("zbv", 2, [4, 4, 4, 4]),
    ("dualpipe_v", 2, [4.5, 4.5, 4.5, 4.5])])
def test_each_schedule_s_micro_batches_in_flight_by_hand(schedule, virtual, flights):
    """The micro-batches each rank of a pp 4 pipeline holds at its peak (8 a step); fewer
    micro-batches than the warm-up wants cap it."""
    layout = _fsdp2(pipeline=4, global_batch=8, schedule=schedule, virtual_stages=virtual)
    assert [micro_batches_in_flight(layout, r) for r in range(4)] == pytest.approx(flights)
    few = replace(layout, global_batch=2)
    assert max(micro_batches_in_flight(few, r) for r in range(4)) <= 2


@pytest.mark.slow  # imports torch.distributed.pipelining (2 s), no ranks
@pytest.mark.parametrize("pipeline, micro_batches", [(2, 4), (4, 8), (8, 16), (4, 12)])
def test_the_schedule_formulas_are_torch_s_action_lists_replayed(pipeline, micro_batches):
    """Each schedule torch builds an action list for (`schedule_replay`: forwards, input and
    weight backwards a third of a slot each), replayed: its bubble in slots and every rank's
    peak micro-batches in flight are the planner's."""
    from pretrain.testing.schedule_replay import REPLAYED, replay

    for schedule in REPLAYED:
        for virtual in ((1, 2, 4) if schedule in ("interleaved_1f1b", "zero_bubble") else (2,)):
            layout = _fsdp2(pipeline=pipeline, global_batch=micro_batches, schedule=schedule,
                            virtual_stages=virtual)
            replayed = replay(schedule, pipeline=pipeline, virtual_stages=virtual,
                              micro_batches=micro_batches)
            where = (schedule, virtual)
            assert replayed.bubble_slots == pytest.approx(pipeline_bubble_slots(layout)), where
            assert replayed.peak_in_flight == pytest.approx(
                [micro_batches_in_flight(layout, r) for r in range(pipeline)]), where


def test_fsdp2_pipeline_ranks_hold_their_virtual_stages_looped_or_v_shaped():
    """8 layers in pp 2 x v 2 stages of 2: looped, rank 0 holds stages 0 and 2 (the embedding
    and layers 1-2, 5-6), rank 1 stages 1 and 3 (the norm and head); V-shaped, rank 0 holds
    stages 0 and 3: the embedding and the head."""
    looped = pipeline_rank_items(SMALL, _fsdp2(pipeline=2, virtual_stages=2, global_batch=4,
                                               schedule="interleaved_1f1b"))
    assert looped == [["embed"] + ["layer"] * 4, ["layer"] * 4 + ["norm", "head"]]
    v_shaped = _fsdp2(pipeline=2, virtual_stages=2, global_batch=4, schedule="zbv")
    assert stage_items(SMALL, v_shaped) == [["embed"] + ["layer"] * 4 + ["norm", "head"],
                                            ["layer"] * 4]
    assert estimate(SMALL, v_shaped, H100, engine=Engine.FSDP2).memory.stage == 0


def test_point_to_point_bytes_double_with_the_virtual_stages():
    """A rank sends each micro-batch's boundary out of each of its v stages and its gradient
    back: 2 v m boundaries a step."""
    layout = _fsdp2(pipeline=4, global_batch=8, schedule="interleaved_1f1b", virtual_stages=2)
    assert pipeline_p2p_bytes(layout, 1000.0) == 2 * 2 * 8 * 1000.0
    one = replace(layout, schedule="1f1b", virtual_stages=1)
    p2p = [estimate(SMALL, lay, H100, engine=Engine.FSDP2).time.pipeline_comm
           for lay in (one, layout)]
    # 2 (v m + pp - 2) boundaries on the critical path: 2 x 10 against 2 x 18
    assert p2p[1] / p2p[0] == pytest.approx(18 / 10)


@pytest.mark.parametrize("engine, pipeline, schedule, virtual, actions, messages", [
    ("deepspeed", 2, "1f1b", 1, 2, 2), ("fsdp2", 2, "1f1b", 1, 2, 2),
    ("fsdp2", 4, "1f1b", 1, 2, 4),  # a middle rank: a boundary on each side
    ("fsdp2", 2, "interleaved_1f1b", 2, 4, 6),  # stages 0 and 2 (1 and 3): 3 boundaries
    ("fsdp2", 4, "interleaved_1f1b", 2, 4, 8),  # rank 1's stages 1 and 5: 4 boundaries
    ("fsdp2", 2, "interleaved_1f1b", 4, 8, 14), ("fsdp2", 2, "zero_bubble", 1, 3, 2),
    ("fsdp2", 2, "zero_bubble", 2, 6, 6),
    ("fsdp2", 2, "zbv", 2, 6, 4),  # stages 1 and 2 on one rank: the V's turn sends nothing
    # DualPipeV: rank 0 splits 2 pp - 1 = 3 of its 2 x 8 backwards, the rest are full, and
    # 2 m - 3 pp + 1 = 11 of those are paired with a forward in one overlapped action
    ("fsdp2", 2, "dualpipe_v", 2, 4 + 3 / 8 - 11 / 8, 4)])
def test_a_schedule_s_actions_and_messages_per_micro_batch(engine, pipeline, schedule, virtual,
                                                           actions, messages):
    """Per micro-batch a rank runs a forward and a backward per stage (and a weight backward
    under the split schedules) and sends or receives twice over each boundary with another
    rank's stage, counted by hand."""
    layout = Layout(engine=engine, pipeline=pipeline, global_batch=8, schedule=schedule,
                    virtual_stages=virtual)
    assert pipeline_actions_per_micro_batch(layout) == actions
    assert pipeline_messages_per_micro_batch(layout) == messages


@pytest.mark.parametrize("pipeline, micro_batches", [(2, 4), (2, 8), (3, 6), (4, 8), (4, 16)])
def test_dualpipe_v_splits_the_backwards_torch_s_action_list_splits(pipeline, micro_batches):
    """DualPipeV defers a weight pass only for the backwards that fill its drain: rank 0 (the
    busiest) 2 pp - 1 of its 2 m, whatever m, as torch's own action list counts them, and its
    actions are that list's (an overlapped forward and backward one action); the zero bubble
    schedules split every backward, 1F1B none."""
    from pretrain.testing.schedule_replay import pipeline_order

    layout = _fsdp2(pipeline=pipeline, global_batch=micro_batches, schedule="dualpipe_v",
                    virtual_stages=2)
    order = pipeline_order("dualpipe_v", pipeline=pipeline, virtual_stages=2,
                           micro_batches=micro_batches)
    overlapped = "OVERLAP_F_B"  # a forward and a full backward, run one after the other
    actions = [sub for a in order[0] if a is not None
               for sub in (a.sub_actions if a.computation_type.name == overlapped else [a])]
    weights = sum(a.computation_type.name == "BACKWARD_WEIGHT" for a in actions)
    assert weights == 2 * pipeline - 1
    assert pipeline_split_share(layout) == weights / (2 * micro_batches)
    listed = [a for a in order[0] if a is not None]
    assert pipeline_actions_per_micro_batch(layout) == pytest.approx(len(listed) / micro_batches)
    assert len(listed) < len(actions)
    assert pipeline_split_share(replace(layout, schedule="zbv")) == 1.0
    assert pipeline_split_share(replace(layout, schedule="interleaved_1f1b")) == 0.0


def test_pipeline_overhead_lengthens_every_slot_of_the_step():
    """The schedule's fixed costs: per micro-batch its actions' runtime, its messages' latency
    and the split backward's weight pass per layer, over the m micro-batches and the bubble's
    slots; in the step, none without a pipeline."""
    cluster = replace(H100, p2p_latency_us=10.0, pipeline_action_us=100.0,
                      split_backward_layer_us=300.0, split_backward_fraction=0.1)
    zb = _fsdp2(pipeline=2, global_batch=8, schedule="zero_bubble", virtual_stages=1)
    # a micro-batch of 3 ms: a backward of 2 ms, its split 10% (0.2 ms) longer
    assert pipeline_overhead(zb, cluster, rank_layers=4, micro_batch_seconds=3e-3) == \
        pytest.approx((8 + 1 / 3) * ((3 * 100 + 2 * 10 + 4 * 300) * 1e-6 + 0.2e-3))
    one = replace(zb, schedule="1f1b")  # no split backward: no weight pass to pay
    assert pipeline_overhead(one, cluster, rank_layers=4, micro_batch_seconds=3e-3) == \
        pytest.approx((8 + 1) * (2 * 100 + 2 * 10) * 1e-6)
    assert pipeline_overhead(replace(zb, pipeline=1), cluster, rank_layers=4,
                             micro_batch_seconds=3e-3) == 0.0
    plans = [estimate(SMALL, lay, cluster, engine=Engine.FSDP2).time for lay in (zb, one)]
    for t in plans:
        assert t.pipeline_overhead > 0
        assert t.step == pytest.approx(
            t.compute + t.tensor_comm + t.bubble + t.pipeline_comm + t.data_comm + t.offload
            + t.context_comm + t.memory_bound + t.optimizer + t.pipeline_overhead)
    # the split schedule pays its weight pass: 4 of SMALL's 8 layers a rank, 8 + 1/3 slots,
    # and 10% of each backward (two thirds of a micro-batch's compute)
    micro = plans[0].compute / 8
    assert plans[0].pipeline_overhead - plans[1].pipeline_overhead == pytest.approx(
        (8 + 1 / 3) * ((3 * 100 + 2 * 10 + 4 * 300) * 1e-6 + 0.1 * micro * 2 / 3)
        - 9 * (2 * 100 + 2 * 10) * 1e-6)
    with pytest.raises(ConfigError, match="p2p_latency_us"):
        replace(H100, p2p_latency_us=-1.0)


def test_a_split_backward_frees_a_stage_s_activations_at_its_weight_pass():
    """What `micro_batches_in_flight` counts for the zero-bubble schedules: torch's input pass
    (`stage_backward_input`, the graph retained) keeps the saved activations, its weight pass
    frees them all once the stage's output is detached (as torch's stage does). Saved tensors
    are tracked detached: a tracker holding a node's own output (relu's result) makes a cycle
    that the weight pass, never running relu's node, leaves behind (what the bench once
    measured as 3.4 micro-batches in flight)."""
    import weakref

    import torch
    import torch.nn as nn
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    held = {"now": 0}

    def tracker(detached: bool):
        class Saved:
            def __init__(self, tensor) -> None:
                self.tensor = tensor.detach() if detached else tensor
                size = tensor.numel() * tensor.element_size()
                held["now"] += size
                weakref.finalize(self, lambda: held.__setitem__("now", held["now"] - size))
        return (Saved, lambda saved: saved.tensor)

    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8), nn.ReLU())
    left = {}
    for detached in (True, False):
        held["now"] = 0
        with torch.autograd.graph.saved_tensors_hooks(*tracker(detached)):
            x = torch.randn(4, 8).requires_grad_()
            out = stage(x)
            forward = held["now"]
            _, groups = stage_backward_input([out], [torch.ones_like(out)], [x],
                                             stage.parameters())
            # the input pass frees only what the output's own node saved (torch detaches the
            # output: the last relu's saved result goes with its node)
            assert held["now"] == forward - out.numel() * out.element_size() > 0
            stage_backward_weight(stage.parameters(), groups)
            del groups, out
            left[detached] = held["now"]
    assert left[True] == 0
    assert left[False] > 0  # the cycle: relu's saved results outlive the step


def test_a_pipeline_of_fsdp2_plans_each_schedule_and_refuses_what_torch_refuses():
    """fsdp2's pipelines are planned (the bubble shrinking with the schedule), and refused where
    the run is: zero-bubble schedules at ZeRO-3, DualPipeV with fewer micro-batches than
    stages; tied embeddings are planned (the head's stage holds a copy of the embedding)."""
    base = _fsdp2(pipeline=2, global_batch=8)
    bubbles = {(s, v): estimate(SMALL, replace(base, schedule=s, virtual_stages=v), H100,
                                engine=Engine.FSDP2).time.bubble for s, v in FSDP2_SCHEDULES}
    assert bubbles[("zbv", 2)] < bubbles[("zero_bubble", 1)] < bubbles[("interleaved_1f1b", 2)] \
        < bubbles[("1f1b", 1)]
    with pytest.raises(ConfigError, match="ZeRO stage 3"):
        estimate(SMALL, replace(base, schedule="zbv", virtual_stages=2, zero_stage=3), H100,
                 engine=Engine.FSDP2)
    with pytest.raises(ConfigError, match="DualPipeV needs at least its 4 stages"):
        estimate(SMALL, replace(base, schedule="dualpipe_v", virtual_stages=2, global_batch=2),
                 H100, engine=Engine.FSDP2)
    tied = estimate(replace(SMALL, tie_embeddings=True), base, H100, engine=Engine.FSDP2)
    untied = estimate(replace(SMALL, tie_embeddings=False), base, H100, engine=Engine.FSDP2)
    assert tied.memory.params == untied.memory.params  # each stage's copy, as untied


def test_search_tries_all_gather_context_where_ulysses_cannot_split_the_heads():
    """With context parallelism a search tries both `parallel.context_kind`s: 2 key/value heads
    split over tensor x context 2 (Ulysses) or gathered whole (all-gather); at tensor x context
    4 only the all-gather runs, and its arguments say so."""
    from pretrain.plan.report import selecting_arguments

    model = replace(SMALL, seq_length=64)
    plans = search(model, make_cluster("h100-80gb", nodes=1, gpus_per_node=4), global_batch=8,
                   micro_batches=(1,), allow_offload=False, contexts=(2,))
    kinds = {(p.layout.tensor * p.layout.context, p.layout.context_kind) for p in plans
             if p.layout.context > 1}
    assert {(2, "ulysses"), (2, "allgather"), (4, "allgather")} <= kinds
    assert (4, "ulysses") not in kinds
    gathered = next(p.layout for p in plans if p.layout.context_kind == "allgather")
    assert "parallel.context_kind=allgather" in selecting_arguments(gathered, "zero1.json")
    assert " allgather" in gathered.describe()


def test_search_tries_the_schedules_under_fsdp2_only():
    """`plan --search` under fsdp2 ranks pipelines of several schedules and virtual stages;
    under DeepSpeed only its 1F1B."""
    cluster = make_cluster("h100-80gb", nodes=1, gpus_per_node=4)
    fsdp2 = search(SMALL, cluster, global_batch=16, micro_batches=(1,), engine=Engine.FSDP2)
    tried = {(p.layout.schedule, p.layout.virtual_stages) for p in fsdp2 if p.layout.pipeline > 1}
    assert tried == set(FSDP2_SCHEDULES)
    deepspeed = search(SMALL, cluster, global_batch=16, micro_batches=(1,))
    assert {(p.layout.schedule, p.layout.virtual_stages) for p in deepspeed} == {("1f1b", 1)}


def test_fsdp2_pipelines_keep_units_gathered_and_gradients_unreduced_to_the_step_s_end():
    """torch's pipeline stages turn FSDP2's gradient reduction and resharding off until the last
    micro-batch: every parameter of the rank keeps an unsharded fp32 gradient."""
    layout = _fsdp2(pipeline=2, global_batch=8)
    items = stage_items(SMALL, layout)[1]
    plan = estimate(SMALL, layout, H100, engine=Engine.FSDP2)
    from pretrain.arithmetic import stage_parameters
    from pretrain.plan.memory import fsdp2_gradients_in_flight

    assert fsdp2_gradients_in_flight(SMALL, layout, items) == 4 * stage_parameters(SMALL, layout,
                                                                                   items)
    assert plan.memory.buffers >= fsdp2_gradients_in_flight(SMALL, layout, items)


# ---- FP8 ---------------------------------------------------------------------------------------

def test_fp8_runs_the_block_projections_at_the_fp8_peak():
    """The projections' 2 x 36,864 FLOPs a token forward, x 3 with backward, per layer; at tp 2
    half; the step's compute drops by those FLOPs' time at bf16 less at FP8 (1979 TFLOP/s)."""
    layout = Layout(global_batch=8, fp8="tensorwise")
    assert fp8_flops_per_token(SMALL, layout, 1) == 6 * PROJECTIONS
    assert fp8_flops_per_token(SMALL, replace(layout, tensor=2), 8) == 8 * 6 * PROJECTIONS / 2
    assert fp8_flops_per_token(SMALL, replace(layout, recompute=Recompute.FULL), 1) == \
        8 * PROJECTIONS
    bf16 = estimate(SMALL, replace(layout, fp8="none"), H100).time
    fp8 = estimate(SMALL, layout, H100).time
    tokens = 8 * SMALL.seq_length
    saved = 8 * 6 * PROJECTIONS * tokens * (1 / 989e12 - 1 / 1979e12) / MATMUL_EFFICIENCY
    assert bf16.compute - fp8.compute == pytest.approx(saved, rel=1e-9)
    assert fp8.memory_bound > bf16.memory_bound  # the casts
    with pytest.raises(ConfigError, match="no FP8 matmuls"):
        estimate(SMALL, layout, make_cluster("a100-80gb", nodes=1))


def test_fp8_memory_the_casts_scales_and_fsdp2_s_fp8_all_gather():
    """One layer's e4m3 weights (1 byte each) and their scales: 7 fp32 scales (tensorwise) or
    one per row and per column (rowwise); FSDP2 all-gathers the projections in FP8 under
    tensorwise only: a byte less per element of each gathered layer."""
    rows_cols = 2 * (64 + 64) + 2 * (32 + 64) + 2 * (128 + 64) + (64 + 128)
    assert fp8_buffers(SMALL, Layout(fp8="tensorwise")) == PROJECTIONS + 7 * 4
    assert fp8_buffers(SMALL, Layout(fp8="rowwise")) == PROJECTIONS + 4 * rows_cols
    assert fp8_buffers(SMALL, Layout()) == 0
    layout = _fsdp2(global_batch=8, data=8)
    items = stage_items(SMALL, layout)[0]
    plain = fsdp2_gathered_bytes(SMALL, layout, items)
    # ZeRO-2's units stay gathered: 8 layers + 1 more in flight
    assert plain - fsdp2_gathered_bytes(SMALL, replace(layout, fp8="tensorwise"), items) == \
        9 * PROJECTIONS
    assert fsdp2_gathered_bytes(SMALL, replace(layout, fp8="rowwise"), items) == plain


# ---- selective recompute -----------------------------------------------------------------------

def test_selective_recompute_keeps_the_matmul_and_attention_outputs():
    """h 64, q 64, kv 32, f 128, bf16, tp 1: selective keeps the layer input, o's and down's
    outputs (64 each) and q, k, v, attention's output, gate and up (2 x 64 + 2 x 32 + 2 x 128
    = 448): 640 elements a token, between none's 6 x 64 + 3 x 64 + 2 x 32 + 4 x 128 = 1152
    and full's 64 (the layer input); at tp 2 with sequence parallelism 32 + 128 + 224."""
    layout = Layout(global_batch=8, recompute=Recompute.SELECTIVE)
    assert layer_activation_elements(SMALL, layout) == (192, 448)
    assert sum(layer_activation_elements(SMALL, replace(layout, recompute=Recompute.NONE))) == 1152
    assert layer_activation_elements(SMALL, replace(layout, tensor=2, sequence_parallel=True)) \
        == (32 + 128, 224)
    items = stage_items(SMALL, layout)[0]
    peaks = {mode: stage_activations(SMALL, replace(layout, recompute=mode), 0, items)
             for mode in (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)}
    assert peaks[Recompute.FULL] < peaks[Recompute.SELECTIVE] < peaks[Recompute.NONE]
    tokens = SMALL.seq_length
    rest = peaks[Recompute.NONE] - 8 * 1152 * tokens * 2  # the embedding's and the head's
    # 8 layers kept, one layer's rebuilt intermediates (1152 - 640) while it runs backward
    assert peaks[Recompute.SELECTIVE] - rest == (8 * 640 + 512) * tokens * 2
    # no matmul runs twice: the hardware FLOPs are the model's
    plan = estimate(SMALL, layout, H100)
    assert plan.hfu == pytest.approx(plan.mfu)


# ---- Muon --------------------------------------------------------------------------------------

def test_muon_keeps_one_momentum_per_matrix_and_pays_its_gathers_and_newton_schulz():
    """The projections (36,864 a layer) step with one fp32 momentum: 4 bytes fewer each than
    AdamW's two moments, sharded alike; each step gathers them whole and orthogonalises each:
    5 steps of 4 r^2 c + 2 r^3 FLOPs (r the shorter side)."""
    layout = Layout(global_batch=8, data=4, zero_stage=1, optimizer="muon")
    items = stage_items(SMALL, layout)[0]
    assert muon_parameters(SMALL, layout, items) == 8 * PROJECTIONS
    assert muon_parameters(SMALL, replace(layout, tensor=2), items) == 8 * PROJECTIONS // 2
    adamw = stage_memory(SMALL, replace(layout, optimizer="adamw"), 0, items)
    muon = stage_memory(SMALL, layout, 0, items)
    assert adamw.optimizer - muon.optimizer == 4 * 8 * PROJECTIONS / 4
    fsdp2 = _fsdp2(global_batch=8, data=4)
    assert estimate(SMALL, fsdp2, H100, engine=Engine.FSDP2).memory.optimizer - estimate(
        SMALL, replace(fsdp2, optimizer="muon"), H100, engine=Engine.FSDP2).memory.optimizer \
        == 4 * 8 * PROJECTIONS / 4
    assert newton_schulz_flops(128, 64) == 5 * (4 * 64 * 64 * 128 + 2 * 64 ** 3)
    flops = 8 * (2 * newton_schulz_flops(64, 64) + 2 * newton_schulz_flops(32, 64)
                 + 3 * newton_schulz_flops(128, 64))
    alone = Layout(global_batch=8, optimizer="muon")
    assert muon_step_seconds(SMALL, alone, H100, layers=8) == pytest.approx(
        flops / (989e12 * MATMUL_EFFICIENCY))
    assert muon_step_seconds(SMALL, layout, H100, layers=8) > muon_step_seconds(
        SMALL, alone, H100, layers=8)  # + the gather over data parallelism
    # ZeRO-1's step gathers the stage's flat group of matrices whole, in fp32
    assert muon_step_bytes(SMALL, layout, items, flat_group=True) >= 4 * 8 * PROJECTIONS
    assert muon_step_bytes(SMALL, replace(layout, optimizer="adamw"), items,
                           flat_group=True) == 0


# ---- a family's per-head norms -----------------------------------------------------------------

def test_qwen3_s_q_and_k_norms_save_their_inputs_through_the_family():
    """Qwen3 normalises q and k per head ((4 + 2) x 16 = 96 features a token): its norms save
    input, output and (16-bit) the fp32 upcast, sharded with the heads; selective recompute
    recomputes them."""
    qwen3 = replace(SMALL, family="qwen3")
    layout = Layout(global_batch=8)
    llama_rep, llama_shard = layer_activation_elements(SMALL, layout)
    assert layer_activation_elements(qwen3, layout) == (llama_rep, llama_shard + 3 * 96)
    fp32 = replace(layout, precision=Precision.FP32, tensor=2)
    assert layer_activation_elements(qwen3, fp32)[1] - layer_activation_elements(SMALL, fp32)[1] \
        == 2 * 96 / 2
    selective = replace(layout, recompute=Recompute.SELECTIVE)
    assert layer_activation_elements(qwen3, selective) == layer_activation_elements(SMALL,
                                                                                    selective)
