"""The planner's model of time: seconds per optimizer step of a layout on a cluster.

The step splits into compute (hardware FLOPs of the slowest stage at the sustained matmul rate),
tensor-parallel communication (with expert parallelism's all-to-alls, the dispatch and combine
of each MoE layer forward and backward, on the expert group's link: `expert_comm_seconds`;
`expert_comm` shows them apart), context-parallel all-to-alls (four per attention layer
forward: q, k, v and the output; four backward; on the intra-node link while tensor x context
fits a node), the pipeline bubble of the schedule (`pipeline_bubble_slots`: DeepSpeed's 1F1B,
or fsdp2's interleaved, zero-bubble, ZBV and DualPipeV schedules), pipeline point-to-point transfers (v
sends a micro-batch with v virtual stages), exposed data-parallel communication and the
offloaded optimizer step, memory-bound copies on each micro-batch's critical path
(`memory_bound`: the fused projections' weight concatenations, DeepSpeed's BF16_Optimizer's fp32
gradient sum, `train.fp8`'s casts), and Muon's step (`optimizer`: its matrices gathered whole and
orthogonalised on every rank); the efficiency assumptions are those of `pretrain.plan.clusters`.
Under `train.fp8` the block projections' FLOPs run at the cluster's FP8 peak
(`fp8_flops_per_token`), attention's products, the router and the head at the bf16 one.

Data-parallel gradients go in the run's `communication_data_type` (the resolved DeepSpeed JSON's,
fp32 for bf16 under ZeRO and in pipelines by the resolver's rule, `resolve.ds_config`): bf16
gradients reduced in fp32 move 4 bytes each, not 2.

Under `train.engine: fsdp2` (`_fsdp2_data_comm`, `_fsdp2_offload`) the data-parallel part is
FSDP2's: every micro-batch all-gathers each unit (`pretrain.plan.memory.fsdp2_units`) in
forward and, resharded after forward (ZeRO-3's JSON), again in backward, and reduce-scatters
every gradient in fp32 (there is no accumulation without communication): the volume grows with
the micro-batches, where DeepSpeed's ZeRO-0/1 reduce once per step. It overlaps as ZeRO-3's
prefetch does, behind the micro-batch's forward and backward. Under HSDP
(`train.fsdp2_replicas`) those collectives run within a replica group, and every micro-batch
adds an all-reduce of each rank's fp32 gradient shard across the groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pretrain.arithmetic import (expert_data_size, expert_share, expert_tensor_size,
                                 layer_active_matmul_parameters, layer_experts_on_gpu,
                                 layer_projection_shapes,
                                 layout_recomputed_layers, mean,
                                 mean_projection_elements_on_gpu, model_flops_per_token,
                                 newton_schulz_flops, partitioned_parameters,
                                 stage_expert_parameters, stage_flops_per_token, stage_indices,
                                 stage_parameters)
from pretrain.config import Engine, ModelConfig, Precision
from pretrain.errors import ConfigError
from pretrain.families import family_of
from pretrain.resolve.layout import Layout
from pretrain.resolve.ds_config import DTYPE_BYTES, gradient_dtypes
from pretrain.plan.clusters import (COLLECTIVE_EFFICIENCY, CPU_ADAM_PARAMS_PER_S,
                                    MATMUL_EFFICIENCY, MEMORY_BANDWIDTH_EFFICIENCY, Cluster)
from pretrain.plan.context import allgather_context
from pretrain.plan.memory import (bytes_per_param, fsdp2_offloads, fsdp2_shard_ranks,
                                  steps_with_bf16_optimizer)


@dataclass
class TimeBreakdown:
    """Seconds per optimizer step."""

    compute: float  # every micro-batch on the slowest stage (hardware FLOPs)
    tensor_comm: float  # TP all-reduces / reduce-scatters on the critical path
    bubble: float  # 1F1B fill and drain: (pp - 1) micro-batch slots
    pipeline_comm: float  # stage-to-stage activations and gradients
    data_comm: float  # exposed data-parallel gradient / parameter communication
    offload: float  # host <-> device copies and the CPU optimizer step
    context_comm: float = 0.0  # context parallelism's all-to-alls of attention (Ulysses)
    memory_bound: float = 0.0  # weight concatenations, BF16_Optimizer's fp32 gradient sums
    optimizer: float = 0.0  # Muon's step: its matrices gathered whole and Newton-Schulz
    # the pipeline schedule's fixed costs: message latency, runtime per action, split backward
    pipeline_overhead: float = 0.0
    # of tensor_comm, expert parallelism's token dispatch and combine: all-to-alls over the
    # expert group, on its link (a part, shown on its own; not a field: not added again)
    expert_comm: ClassVar[float] = 0.0

    @property
    def step(self) -> float:
        return (self.compute + self.tensor_comm + self.bubble + self.pipeline_comm
                + self.data_comm + self.offload + self.context_comm + self.memory_bound
                + self.optimizer + self.pipeline_overhead)


def _ring_seconds(nbytes: float, ranks: int, gbps: float, *, passes: float) -> float:
    """Ring collective time: each GPU moves passes * (n - 1) / n of the bytes (all-reduce: 2)."""
    if ranks <= 1:
        return 0.0
    return passes * (ranks - 1) / ranks * nbytes / (gbps * 1e9 * COLLECTIVE_EFFICIENCY)


@dataclass(frozen=True)
class _MicroBatch:
    """One micro-batch on the slowest stage: what every part of the step is counted from."""

    tokens: float  # this rank's tokens: its context chunk of micro_batch sequences
    act_bytes: int  # bytes of one activation element
    layers: int  # decoder layers of the largest stage
    compute: float  # seconds of its forward and backward at the sustained matmul rate


def _link_gbps(cluster: Cluster, ranks: int) -> float:
    """The bandwidth of a group of `ranks` consecutive GPUs: NVLink-class while it fits a node."""
    return cluster.intra_node_gbps if ranks <= cluster.gpus_per_node else cluster.inter_node_gbps


def _tensor_comm(model: ModelConfig, layout: Layout, cluster: Cluster, mb: _MicroBatch) -> float:
    """Seconds of one micro-batch's tensor-parallel collectives: 2 of the layer's activations
    forward (attention's and the MLP's), 2 backward, 2 more per recomputed layer. An
    expert-parallel MoE layer replaces the MLP's: without sequence parallelism an all-gather of
    its output (forward and backward: half an all-reduce each), with it none."""
    mlp = 1.0 if layout.expert == 1 else (0.0 if layout.sequence_parallel else 0.5)
    collectives = (2 + 2 * mlp) * mb.layers \
        + (1 + mlp) * layout_recomputed_layers(layout, mb.layers)
    activations = mb.tokens * model.hidden_size * mb.act_bytes
    return collectives * _ring_seconds(activations, layout.tensor,
                                       _link_gbps(cluster, layout.tensor), passes=2)


def _context_comm(model: ModelConfig, layout: Layout, cluster: Cluster, mb: _MicroBatch) -> float:
    """Seconds of one micro-batch's context-parallel all-to-alls: per attention layer q, k, v
    (this rank's chunk of its TP heads) and the output, each rank keeping 1/context of them,
    forward, their gradients backward, once more per recomputed layer."""
    if layout.context == 1:
        return 0.0
    if layout.context_kind == "allgather":  # K and V gathered instead (`plan.context`)
        return allgather_context(model, layout, cluster, layers=mb.layers).seconds
    gbps = _link_gbps(cluster, layout.tensor * layout.context)
    widths = family_of(model).attention_widths(model)
    exchanged = mb.tokens * (widths.queries + widths.keys + widths.values + widths.outputs) \
        / layout.tensor * mb.act_bytes
    all_to_alls = 2 * mb.layers + layout_recomputed_layers(layout, mb.layers)
    return all_to_alls * (layout.context - 1) / layout.context \
        * exchanged / (gbps * 1e9 * COLLECTIVE_EFFICIENCY)


def _expert_comm(model: ModelConfig, layout: Layout, cluster: Cluster, mb: _MicroBatch) -> float:
    """Seconds of one micro-batch's expert-parallel communication (`expert_comm_seconds`)."""
    return expert_comm_seconds(model, layout, cluster, tokens=mb.tokens, act_bytes=mb.act_bytes,
                               layers=mb.layers)


def expert_comm_seconds(model: ModelConfig, layout: Layout, cluster: Cluster, *, tokens: float,
                        act_bytes: int, layers: int) -> float:
    """Seconds of expert parallelism's collectives for `tokens` on a rank (its context chunk of
    a micro-batch) through `layers` decoder layers: per MoE layer the dispatch and combine
    all-to-alls over the expert group forward and the reverse two backward (4; 2 more per
    recomputed layer), not hidden. Each rank sends its 1/tp share of the tokens, k rows each
    (tokens / tp x k x hidden; a balanced router keeps 1/ep of them on the rank), on the link
    of the expert group's span: expert x expert_tensor consecutive ranks (expert_tensor
    innermost), inside a node while they fit its GPUs, else the inter-node bandwidth. Experts
    split over the tensor ranks (expert_tensor = tp > 1) also all-gather the rows each
    expert-tensor rank received before the experts and reduce-scatter their outputs after
    (the reverse backward: 4 more collectives of tokens x k rows a layer, on the tensor link).
    0 at parallel.expert 1 (no all-to-all: the experts are split like the dense MLP)."""
    ep, etp = layout.expert, expert_tensor_size(layout)
    if ep == 1 or not model.num_experts:
        return 0.0
    rows = tokens / layout.tensor * model.experts_per_token
    exchanged = rows * model.hidden_size * act_bytes
    # the stage's mixture layers: every layer (Mixtral), or the family's share of them
    share = len(family_of(model).moe_layers(model)) / model.num_layers
    collectives = (4 * layers + 2 * layout_recomputed_layers(layout, layers)) * share
    seconds = collectives * (ep - 1) / ep * exchanged \
        / (_link_gbps(cluster, ep * etp) * 1e9 * COLLECTIVE_EFFICIENCY)
    if etp > 1:  # every expert-tensor rank computes its slice on the group's rows
        seconds += collectives * _ring_seconds(exchanged * etp, etp, _link_gbps(cluster, etp),
                                               passes=1)
    return seconds


def expert_router_flops_per_token(model: ModelConfig, layout: Layout, layers: int) -> float:
    """Training FLOPs per token a GPU's router runs beyond its 1/tp share of the model's
    (`stage_flops_per_token` divides every FLOP by tp): without expert parallelism every tensor
    rank routes the whole sequence (the router is replicated: (tp - 1) / tp of its h x E
    matmul, forward and backward, over again per mixture layer of `layers`); expert-parallel
    ranks route their own 1/tp chunk only (0)."""
    if layout.expert > 1 or not model.num_experts or layout.tensor == 1:
        return 0.0
    share = len(family_of(model).moe_layers(model)) / model.num_layers
    passes = 3 * layers + layout_recomputed_layers(layout, layers)
    return 2.0 * model.num_experts * model.hidden_size * passes * share \
        * (layout.tensor - 1) / layout.tensor


def expert_data_comm_seconds(layout: Layout, gbps: float, *, expert_bytes: float,
                             passes: float) -> float:
    """Seconds of one collective of the routed experts' `expert_bytes` (a rank's experts'
    gradients, or its ZeRO-3 parameters) over the expert-data ranks (`expert_data_size`, the
    ranks holding the same experts; a group as wide as the stage, so the data group's link
    `gbps`): the same bytes per rank as a data-parallel ring of them, a smaller group."""
    return _ring_seconds(expert_bytes, expert_data_size(layout), gbps, passes=passes)


def pipeline_bubble_slots(layout: Layout) -> float:
    """The pipeline's fill and drain, in micro-batch slots (one micro-batch's forward and
    backward through all of a rank's layers), of the schedule (`torch.distributed.pipelining`'s
    under fsdp2, DeepSpeed's 1F1B), with pp ranks and v virtual stages a rank and a backward
    split into input gradients (B) and weight gradients (W), F = B = W a third of a slot:

    - DeepSpeed's pipeline and `1f1b`: pp - 1;
    - `interleaved_1f1b`: (pp - 1) / v: the stages v times shorter;
    - `zero_bubble` (torch's interleaved zero bubble) and `zbv`: (pp - 1) / (3 v): the deferred
      W fill all but F + B - W of each slot of the fill and drain (ZB-H1, Qi et al. 2023);
    - `dualpipe_v`: (pp - 1) / 3: its overlapped F&B pairs start a stage later than ZBV's.

    `bench/pipeline_bubble.py` replays torch's action lists with these costs (the same slots)
    and measures the schedules on CPU ranks."""
    p, v = layout.pipeline, layout.virtual_stages
    if layout.engine != "fsdp2" or layout.schedule == "1f1b":
        return float(p - 1)
    if layout.schedule == "interleaved_1f1b":
        return (p - 1) / v
    if layout.schedule in ("zero_bubble", "zbv"):
        return (p - 1) / (3.0 * v)
    return (p - 1) / 3.0  # dualpipe_v


SPLIT_BACKWARD_SCHEDULES = ("zero_bubble", "zbv", "dualpipe_v")


def pipeline_split_share(layout: Layout) -> float:
    """The share of the busiest pipeline rank's backwards that its schedule splits into an input
    pass and a deferred weight pass (torch's action lists): all of them under `zero_bubble` and
    `zbv`; under `dualpipe_v` only the 2 pp - 1 of rank 0's that fill its drain (its other
    backwards are full, paired with a forward in its overlapped F&B actions), of the rank's
    v m; none under the other schedules."""
    if layout.engine != "fsdp2" or layout.schedule not in SPLIT_BACKWARD_SCHEDULES:
        return 0.0
    if layout.schedule == "dualpipe_v":
        return min(1.0, (2 * layout.pipeline - 1)
                   / (layout.virtual_stages * layout.grad_accum))
    return 1.0


def pipeline_actions_per_micro_batch(layout: Layout) -> float:
    """The schedule actions one pipeline rank runs per micro-batch, as torch's action list
    holds them: a forward and a backward of each of its v stages, and a weight-gradient backward
    of each backward its schedule splits (`pipeline_split_share`). DualPipeV pairs a forward
    with a full backward in one overlapped action wherever its steady state can: 2 m - 3 pp + 1
    of them on rank 0 (the busiest), whose list then holds 2 m + 5 pp - 2 actions."""
    v = layout.virtual_stages if layout.engine == "fsdp2" else 1
    actions = v * (2 + pipeline_split_share(layout))
    if layout.engine == "fsdp2" and layout.schedule == "dualpipe_v":
        m = layout.grad_accum
        actions -= max(0, 2 * m - 3 * layout.pipeline + 1) / m
    return actions


def pipeline_messages_per_micro_batch(layout: Layout) -> int:
    """Point-to-point messages (sends and receives) the busiest pipeline rank has per
    micro-batch: an activation forward and a gradient back over every boundary between one of
    its stages and another rank's (looped stages: every boundary; V-shaped ones keep the
    boundary at the V's turn on one rank)."""
    p = layout.pipeline
    if p == 1:
        return 0
    fsdp2 = layout.engine == "fsdp2"
    v, schedule = (layout.virtual_stages, layout.schedule) if fsdp2 else (1, "1f1b")
    owner = {stage: rank for rank in range(p)
             for stage in stage_indices(rank, pipeline=p, virtual_stages=v, schedule=schedule)}
    crossing = [b for b in range(p * v - 1) if owner[b] != owner[b + 1]]
    return max(2 * sum(rank in (owner[b], owner[b + 1]) for b in crossing) for rank in range(p))


def pipeline_overhead(layout: Layout, cluster: Cluster, *, rank_layers: int,
                      micro_batch_seconds: float) -> float:
    """Seconds a step's pipeline schedule spends on fixed costs, independent of the stages' work:
    per micro-batch, each action's runtime cost (`pipeline_actions_per_micro_batch` x the
    cluster's `pipeline_action_us`), each message's fixed cost (`pipeline_messages_per_micro_batch`
    x `p2p_latency_us`: the link's latency, and on CPU ranks the runtime's work to post it; the
    bytes are `pipeline_comm`'s) and, for each backward split
    (`pipeline_split_share`), its weight pass's graph walk (`rank_layers` x
    `split_backward_layer_us`) and its share `split_backward_fraction` of the backward's time
    (two thirds of `micro_batch_seconds`, a micro-batch's forward and backward on the rank).
    They lengthen every slot of
    the step, the m micro-batches' and the bubble's (`pipeline_bubble_slots`): the more actions
    a schedule runs to shrink its bubble, the more it pays here (`bench/pipeline_bubble.py`
    measures both against these terms)."""
    if layout.pipeline == 1:
        return 0.0
    split = pipeline_split_share(layout)
    per_micro = (pipeline_actions_per_micro_batch(layout) * cluster.pipeline_action_us
                 + pipeline_messages_per_micro_batch(layout) * cluster.p2p_latency_us
                 + split * rank_layers * cluster.split_backward_layer_us) * 1e-6
    per_micro += split * cluster.split_backward_fraction * micro_batch_seconds * 2.0 / 3.0
    return (layout.grad_accum + pipeline_bubble_slots(layout)) * per_micro


def pipeline_p2p_bytes(layout: Layout, boundary: float) -> float:
    """Bytes one pipeline rank sends point to point in a step: each micro-batch's boundary
    activations (`boundary` bytes) forward out of each of its v stages, and their gradients
    backward (2 v per micro-batch; the first and last stages send one way only, not counted
    off: the busiest rank's)."""
    return 2.0 * layout.virtual_stages * layout.grad_accum * boundary


def _pipeline_p2p(model: ModelConfig, layout: Layout, cluster: Cluster, mb: _MicroBatch) -> float:
    """Seconds of a step's stage-to-stage activations and gradients on the critical path: the
    sends of every micro-batch's stages (v a rank: `pipeline_p2p_bytes`) and the fill's and
    drain's pp - 2 more. DeepSpeed (pipe_partitioned) and Megatron split the boundary
    activations over TP ranks; under sequence parallelism each TP rank holds its slice anyway."""
    if layout.pipeline == 1:
        return 0.0
    cross_node = layout.tensor * layout.context * layout.data >= cluster.gpus_per_node  # a stage
    gbps = cluster.inter_node_gbps if cross_node else cluster.intra_node_gbps  # fills a node
    boundary = mb.tokens * model.hidden_size * mb.act_bytes / layout.tensor
    sent = pipeline_p2p_bytes(layout, boundary) + 2 * (layout.pipeline - 2) * boundary
    return sent / (gbps * 1e9 * COLLECTIVE_EFFICIENCY)


def _data_comm(layout: Layout, cluster: Cluster, mb: _MicroBatch, *, stage_params: int,
               grad_bytes: int, expert_params: int = 0) -> float:
    """Seconds of exposed data-parallel communication: gradients (`grad_bytes` each: the
    communication dtype's) and ZeRO-3 parameters over the data x context replicas, the routed
    experts' (`expert_params` of `stage_params`) over the expert-data ranks where those differ
    (`expert_data_comm_seconds`), less what the backward (ZeRO-3: the whole micro-batch)
    hides."""
    replicas = layout.data * layout.context  # DeepSpeed's data parallelism: data x context ranks
    param_bytes = bytes_per_param(layout)[0]
    gbps = _link_gbps(cluster, layout.tensor * replicas)
    backward = mb.compute * 2.0 / 3.0
    if expert_data_size(layout) == replicas:
        expert_params = 0  # the experts' ranks are the dense ones': one collective of both
    dense = stage_params - expert_params

    def ring(nbytes_per_param: float, passes: float) -> float:
        return _ring_seconds(dense * nbytes_per_param, replicas, gbps, passes=passes) \
            + expert_data_comm_seconds(layout, gbps, expert_bytes=expert_params
                                       * nbytes_per_param, passes=passes)

    if layout.zero_stage <= 1:  # one all-reduce (ZeRO 1: reduce-scatter + all-gather) per step
        comm = ring(grad_bytes, 2)
        return max(0.0, comm - backward)
    # reduce-scatter every micro-batch; ZeRO 3 also gathers parameters forward and backward
    per_micro_batch = ring(grad_bytes, 1)
    if layout.zero_stage == 3:
        per_micro_batch += ring(param_bytes, 2)
        hidden = mb.compute
    else:
        hidden = backward
    exposed = layout.grad_accum * max(0.0, per_micro_batch - hidden)
    if layout.zero_stage == 2:  # updated parameters gathered once after the step
        exposed += ring(param_bytes, 1)
    return exposed


def fsdp2_bytes_per_micro_batch(layout: Layout, *, stage_params: int,
                                fp8_params: float = 0.0) -> tuple[float, float]:
    """(all-gathered, reduce-scattered) bytes of one micro-batch under fsdp2, whole tensors
    before the ring's (ranks - 1) / ranks: every unit gathered in the compute dtype forward and,
    resharded after forward, backward (`fp8_params` of them, the block projections under
    `train.fp8: tensorwise`, in FP8: 1 byte); every gradient reduced in fp32 (the bf16 policy's
    reduce dtype, fp32 runs' own)."""
    compute_bytes = 4 if layout.precision == Precision.FP32 else 2
    gathers = 2 if layout.zero_stage == 3 else 1
    gathered = stage_params * compute_bytes - fp8_params * (compute_bytes - 1)
    return gathers * gathered, stage_params * 4.0


def _fsdp2_data_comm(layout: Layout, cluster: Cluster, mb: _MicroBatch, *,
                     stage_params: int, grad_bytes: int, fp8_params: float = 0.0) -> float:
    """Seconds of FSDP2's exposed collectives: those of every micro-batch, less its compute.
    The shard group is consecutive data x context ranks (every tensor rank's between them);
    HSDP's replica groups stride across all the data x context ranks. FSDP2 reduces in its
    policy's reduce dtype (fp32, `fsdp2_bytes_per_micro_batch`), whatever the JSON's
    communication_data_type (`grad_bytes`, not read). In a pipeline torch keeps the units
    gathered and their gradients unreduced until the step's last backward: one all-gather
    (ZeRO-3: every micro-batch's) and one reduce-scatter a step, less one micro-batch's
    compute."""
    shards = fsdp2_shard_ranks(layout)
    gbps = _link_gbps(cluster, layout.tensor * shards)
    gathered, reduced = fsdp2_bytes_per_micro_batch(layout, stage_params=stage_params,
                                                    fp8_params=fp8_params)
    gather_s = _ring_seconds(gathered, shards, gbps, passes=1)
    reduce_s = (_ring_seconds(reduced, shards, gbps, passes=1)
                + _ring_seconds(reduced / shards, layout.fsdp2_replicas,
                                _link_gbps(cluster, layout.world_size), passes=2))
    if layout.pipeline > 1:
        gathers = layout.grad_accum if layout.zero_stage == 3 else 1
        return max(0.0, gathers * gather_s + reduce_s - mb.compute)
    return layout.grad_accum * max(0.0, gather_s + reduce_s - mb.compute)


def _fsdp2_offload(layout: Layout, cluster: Cluster, *, stage_params: int) -> float:
    """Seconds of CPUOffloadPolicy: every all-gather copies the fp32 shard to the device, every
    reduce-scatter copies the fp32 gradient shard back, and the step runs torch's AdamW on the
    host (at the rate assumed for DeepSpeed's CPU Adam)."""
    if not fsdp2_offloads(layout):
        return 0.0
    shard = stage_params / fsdp2_shard_ranks(layout)
    copies = (2 if layout.zero_stage == 3 else 1) + 1
    return (layout.grad_accum * copies * shard * 4 / (cluster.pcie_gbps * 1e9)
            + shard / CPU_ADAM_PARAMS_PER_S)


def _offload(layout: Layout, cluster: Cluster, *, stage_params: int,
             expert_params: int = 0) -> float:
    """Seconds of host <-> device traffic and the CPU optimizer step: an offloaded optimizer
    sends gradients down and parameters up and runs CPU Adam on this GPU's share (the routed
    experts' `expert_params` partitioned over the expert-data ranks); offloaded parameters are
    fetched twice by every micro-batch."""
    shard = partitioned_parameters(layout, stage_params, expert_params)
    param_bytes = bytes_per_param(layout)[0]
    pcie = cluster.pcie_gbps * 1e9
    seconds = 0.0
    if layout.offload_optimizer != "none":
        seconds = shard * (4 + param_bytes) / pcie + shard / CPU_ADAM_PARAMS_PER_S
    if layout.offload_param != "none":
        fetched = shard * (layout.data * layout.context) if expert_params else stage_params
        seconds += layout.grad_accum * 2 * fetched / (layout.data * layout.context) \
            * param_bytes / pcie
    return seconds


def _concatenated_weights(model: ModelConfig, layout: Layout) -> float:
    """Weight elements one decoder layer concatenates per pass on a GPU under fused projections
    (`pretrain.model.llama.fused_projections`): this rank's q, k and v rows, and gate and up of
    the MLP or of every expert it holds (1/tp of each of E, or E/ep whole: the same count; fewer
    where the expert ranks come from the data ranks: `expert_share`)."""
    if not model.fused_projections:
        return 0.0
    qkv = family_of(model).attention_widths(model).concatenated  # the family's fused attention
    family = family_of(model)  # dense and mixture layers (a family may mix them): their mean
    gate_up = mean([2 * model.hidden_size * (
        model.expert_ffn_hidden_size * model.num_experts * expert_share(layout)
        if family.moe_layer(model, i)
        else model.ffn_hidden_size) for i in range(model.num_layers)])
    return (qkv + gate_up) / layout.tensor


def _memory_bound(model: ModelConfig, layout: Layout, cluster: Cluster, mb: _MicroBatch, *,
                  stage_params: int, bf16_optimizer: bool) -> float:
    """Seconds of one micro-batch's memory-bound copies on the slowest stage, at the sustained
    memory bandwidth: fused projections concatenate each layer's weights (read and write) in
    forward, again in backward, and once more per recomputed layer; DeepSpeed's
    BF16_Optimizer adds every bf16 gradient of the stage into its fp32 buffer (read 2 + 4 bytes,
    write 4)."""
    passes = 2 * mb.layers + layout_recomputed_layers(layout, mb.layers)
    nbytes = passes * 2 * _concatenated_weights(model, layout) * mb.act_bytes
    if bf16_optimizer:
        nbytes += stage_params * (2 + 4 + 4)
    return nbytes / (cluster.memory_gbps * 1e9 * MEMORY_BANDWIDTH_EFFICIENCY)


def experts_in_fp8(model: ModelConfig, layout: Layout, cluster: Cluster) -> bool:
    """Whether `train.fp8` reaches the routed experts: their loop calls each expert that has
    rows, each of its three projections through its own FP8 matmul; where they run as torch's
    grouped matmul instead (`Cluster.grouped_matmul`, bf16, the rows and this rank's expert width
    multiples of 16 bytes: `pretrain.model.moe.grouped_mm_runs`) they multiply in bf16."""
    if layout.fp8 == "none" or not model.num_experts:
        return False
    align = 8  # bf16 elements in 16 bytes
    grouped = (cluster.grouped_matmul and layout.precision in (Precision.BF16, Precision.AUTO)
               and model.hidden_size % align == 0
               and model.expert_ffn_hidden_size // expert_tensor_size(layout) % align == 0)
    return not grouped


def fp8_flops_per_token(model: ModelConfig, layout: Layout, layers: int, *,
                        experts: bool = True) -> float:
    """Training FLOPs per token on one GPU of `layers` decoder layers that `train.fp8` runs in
    FP8: every block projection's three matmuls (forward, and backward's two), a token's
    experts_per_token experts under a mixture of experts (`experts`: False where they run as
    the grouped matmul, in bf16: `experts_in_fp8`), once more per recomputed layer's forward;
    attention's products, the router and the head stay in the run's precision."""
    if layout.fp8 == "none":
        return 0.0
    # a token's projections: the layer's active matrices less the router (num_experts x h),
    # and less its routed experts' where they stay bf16 (the model's mean layer: a family may
    # mix dense and mixture layers)
    family = family_of(model)
    routed = 0 if experts else \
        model.experts_per_token * 3 * model.hidden_size * model.expert_ffn_hidden_size
    per_token = 2.0 * mean([layer_active_matmul_parameters(model, i)
                            - (model.num_experts * model.hidden_size + routed
                               if family.moe_layer(model, i) else 0)
                            for i in range(model.num_layers)])
    passes = 3 * layers + layout_recomputed_layers(layout, layers)
    return per_token * passes / layout.tensor


# bytes a dynamic FP8 cast moves per element: the amax read (2), the cast's read (2) and
# write (1) of a 16-bit operand
FP8_CAST_BYTES = 5.0


def experts_with_rows(model: ModelConfig, layout: Layout, tokens: float) -> float:
    """The expected share of a GPU's routed experts that get at least one row of a
    micro-batch of `tokens` a rank (uniform routing: each of the tokens its expert group
    routes picks a given expert with probability k/E). The group routes expert x
    expert_tensor / tp ranks' tokens: a rank's own without expert parallelism or with the
    experts on the tensor ranks, each data rank's where the expert ranks come from them."""
    if not model.num_experts:
        return 0.0
    routed = tokens * layout.expert * expert_tensor_size(layout) / layout.tensor
    return 1.0 - (1.0 - model.experts_per_token / model.num_experts) ** routed


def fp8_cast_elements(model: ModelConfig, layout: Layout, mb: _MicroBatch, *,
                      experts: bool = True) -> float:
    """Elements one micro-batch casts to FP8 on the slowest stage (`train.fp8`), each a
    memory-bound pass of `FP8_CAST_BYTES`: per layer forward the projections' inputs (h for
    q/k/v and gate/up, heads x head_dim for o, f for down) and weights; backward casts the
    output gradients (as many as the outputs) and the inputs and weights again along their
    other dimension: twice forward's. A mixture layer's routed experts (`experts`: where they
    compute in FP8, `experts_in_fp8`) cast the rows routed to this GPU's experts (the whole h
    for gate and up, this rank's width for down) and the weights of the experts that got rows
    (`experts_with_rows`): an expert called with none casts nothing. Its shared experts count
    as a dense MLP of their width."""
    if layout.fp8 == "none":
        return 0.0
    h = model.hidden_size
    q = model.num_heads * model.head_dim
    family = family_of(model)
    etp = expert_tensor_size(layout)

    def mlp_inputs(index: int) -> float:
        if not family.moe_layer(model, index):
            return mb.tokens * (2 * h + model.ffn_hidden_size) / layout.tensor
        shared = model.num_shared_experts * model.expert_ffn_hidden_size
        elements = mb.tokens * (2 * h + shared) / layout.tensor if shared else 0.0
        if experts:  # the k x tokens rows over the expert group, this rank's share of them
            rows = mb.tokens * model.experts_per_token * etp / layout.tensor
            elements += rows * (2 * h + model.expert_ffn_hidden_size / etp)
        return elements

    inputs = mb.tokens * (2 * h + q) / layout.tensor \
        + mean([mlp_inputs(i) for i in range(model.num_layers)])
    # every weight a GPU holds, its routed experts' only those that run
    routed = mean([layer_experts_on_gpu(model, layout, i) for i in range(model.num_layers)])
    running = experts_with_rows(model, layout, mb.tokens) if experts else 0.0
    weights = mean_projection_elements_on_gpu(model, layout) - routed + running * routed
    passes = 3 * mb.layers + 3 * layout_recomputed_layers(layout, mb.layers)
    return passes * (inputs + weights)


def muon_step_seconds(model: ModelConfig, layout: Layout, cluster: Cluster, *,
                      layers: int) -> float:
    """Seconds of `train.optimizer: muon`'s step beyond AdamW's (`pretrain.training.muon`):
    the Nesterov updates' pieces all-gathered in fp32 over the data x context ranks where they
    are sharded (ZeRO 1-3, fsdp2), then over the tensor ranks, and every rank's Newton-Schulz
    on each whole matrix of its `layers` (bf16, at the matmul rate)."""
    if layout.optimizer != "muon" or not layers:
        return 0.0
    # every layer's matrices, scaled to `layers` of the model's mean layer
    matrices = [shape for i in range(model.num_layers) for shape in layer_projection_shapes(model, i)]
    share = layers / model.num_layers
    whole = sum(r * c for r, c in matrices) * 4.0 * share
    seconds = 0.0
    replicas = layout.data * layout.context
    if layout.zero_stage >= 1 or layout.engine == "fsdp2":
        seconds += _ring_seconds(whole / layout.tensor, replicas,
                                 _link_gbps(cluster, layout.tensor * replicas), passes=1)
    seconds += _ring_seconds(whole, layout.tensor, _link_gbps(cluster, layout.tensor), passes=1)
    flops = sum(newton_schulz_flops(r, c) for r, c in matrices) * share
    return seconds + flops / (cluster.peak_tflops * 1e12 * MATMUL_EFFICIENCY)


def estimate_time(model: ModelConfig, layout: Layout, cluster: Cluster,
                  stages: list[list[str]], *, engine: Engine = Engine.DEEPSPEED,
                  ds: dict[str, Any] | None = None) -> tuple[TimeBreakdown, float, float]:
    """(time breakdown, model FLOPs per GPU per step, hardware FLOPs per GPU per step).

    Per micro-batch the slowest stage computes and copies, then waits for its TP and CP
    collectives; a step is `grad_accum` of them, the pipeline's fill and drain (its schedule's
    `pipeline_bubble_slots`), and what data parallelism and offloading (`engine`'s) do not
    hide, and Muon's step. Under `train.fp8` the block projections compute at the cluster's
    FP8 peak (`fp8_flops_per_token`) and their casts are memory-bound copies. `ds`: the run's
    resolved DeepSpeed JSON (communication dtype, gradient accumulation dtype); None plans
    what the resolver fills into an "auto" one."""
    if layout.fp8 != "none" and not cluster.fp8_tflops:
        raise ConfigError(f"train.fp8={layout.fp8} on {cluster.name}: its GPUs have no FP8 "
                          "matmuls (compute capability 8.9 or more: H100, H200, L40S); set "
                          "train.fp8=none")
    flops = [stage_flops_per_token(model, layout, items) for items in stages]
    slow_index = max(range(len(stages)), key=lambda i: flops[i][1])
    slow_model, slow_hw = flops[slow_index]
    tokens = layout.micro_batch * model.seq_length / layout.context
    layers = max(items.count("layer") for items in stages)
    experts_fp8 = experts_in_fp8(model, layout, cluster)
    fp8_flops = fp8_flops_per_token(model, layout, stages[slow_index].count("layer"),
                                    experts=experts_fp8)
    peak = cluster.peak_tflops * 1e12 * MATMUL_EFFICIENCY
    compute = (slow_hw - fp8_flops) * tokens / peak
    # the router replicated on the tensor ranks without expert parallelism (0 with it)
    compute += expert_router_flops_per_token(model, layout, stages[slow_index].count("layer")) \
        * tokens / peak
    if fp8_flops:
        compute += fp8_flops * tokens / (cluster.fp8_tflops * 1e12 * MATMUL_EFFICIENCY)
    mb = _MicroBatch(tokens=tokens, act_bytes=4 if layout.precision == Precision.FP32 else 2,
                     layers=layers, compute=compute)
    tensor_mb = _tensor_comm(model, layout, cluster, mb)
    context_mb = _context_comm(model, layout, cluster, mb)
    expert_mb = _expert_comm(model, layout, cluster, mb)
    heaviest = max(stages, key=lambda items: stage_parameters(model, layout, items))
    stage_params = stage_parameters(model, layout, heaviest)
    micro_batches = layout.grad_accum
    deepspeed = engine is not Engine.FSDP2
    copies_mb = _memory_bound(model, layout, cluster, mb, stage_params=stage_params,
                              bf16_optimizer=deepspeed and steps_with_bf16_optimizer(layout, ds))
    copies_mb += fp8_cast_elements(model, layout, mb, experts=experts_fp8) * FP8_CAST_BYTES \
        / (cluster.memory_gbps * 1e9 * MEMORY_BANDWIDTH_EFFICIENCY)
    grad_bytes = DTYPE_BYTES[gradient_dtypes(layout, ds)[1]]
    if deepspeed:
        data_comm = _data_comm(layout, cluster, mb, stage_params=stage_params,
                               grad_bytes=grad_bytes,
                               expert_params=stage_expert_parameters(model, layout, heaviest))
        offload = _offload(layout, cluster, stage_params=stage_params,
                           expert_params=stage_expert_parameters(model, layout, heaviest))
    else:
        fp8_params = (layers * mean_projection_elements_on_gpu(model, layout)
                      if layout.fp8 == "tensorwise" else 0.0)
        data_comm = _fsdp2_data_comm(layout, cluster, mb, stage_params=stage_params,
                                     grad_bytes=grad_bytes, fp8_params=fp8_params)
        offload = _fsdp2_offload(layout, cluster, stage_params=stage_params)
    times = TimeBreakdown(
        compute=micro_batches * mb.compute, tensor_comm=micro_batches * (tensor_mb + expert_mb),
        bubble=pipeline_bubble_slots(layout) * (mb.compute + tensor_mb + context_mb + expert_mb
                                                + copies_mb),
        pipeline_comm=_pipeline_p2p(model, layout, cluster, mb),
        data_comm=data_comm, offload=offload,
        context_comm=micro_batches * context_mb, memory_bound=micro_batches * copies_mb,
        optimizer=muon_step_seconds(model, layout, cluster, layers=layers),
        pipeline_overhead=pipeline_overhead(layout, cluster, rank_layers=layers,
                                            micro_batch_seconds=mb.compute))
    times.expert_comm = micro_batches * expert_mb
    model_flops = model_flops_per_token(model) * layout.global_batch * model.seq_length \
        / layout.world_size
    hardware_flops = model_flops * slow_hw / slow_model if slow_model else model_flops
    return times, model_flops, hardware_flops
