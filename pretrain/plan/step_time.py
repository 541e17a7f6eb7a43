"""The planner's model of time: seconds per optimizer step of a layout on a cluster.

The step splits into compute (hardware FLOPs of the slowest stage at the sustained matmul rate),
tensor-parallel communication (with expert parallelism's all-to-alls, the dispatch and combine
of each MoE layer forward and backward, which run on the tensor group; `expert_comm` shows
them apart), context-parallel all-to-alls (four per attention layer forward: q, k, v and the
output; four backward; on the intra-node link while tensor x context fits a node), the 1F1B
pipeline bubble, pipeline point-to-point transfers, exposed data-parallel communication and the
offloaded optimizer step, and memory-bound copies on each micro-batch's critical path
(`memory_bound`: the fused projections' weight concatenations, DeepSpeed's BF16_Optimizer's fp32
gradient sum); the efficiency assumptions are those of `pretrain.plan.clusters`.

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

from pretrain.arithmetic import (layout_recomputed_layers, model_flops_per_token,
                                 stage_flops_per_token, stage_parameters)
from pretrain.config import Engine, ModelConfig, Precision
from pretrain.families import family_of
from pretrain.resolve.layout import Layout
from pretrain.resolve.ds_config import DTYPE_BYTES, gradient_dtypes
from pretrain.plan.clusters import (COLLECTIVE_EFFICIENCY, CPU_ADAM_PARAMS_PER_S,
                                    MATMUL_EFFICIENCY, MEMORY_BANDWIDTH_EFFICIENCY, Cluster)
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
    # of tensor_comm, expert parallelism's token dispatch and combine: all-to-alls over the
    # tensor group, on its links (a part, shown on its own; not a field: not added again)
    expert_comm: ClassVar[float] = 0.0

    @property
    def step(self) -> float:
        return (self.compute + self.tensor_comm + self.bubble + self.pipeline_comm
                + self.data_comm + self.offload + self.context_comm + self.memory_bound)


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
    gbps = _link_gbps(cluster, layout.tensor * layout.context)
    widths = family_of(model).attention_widths(model)
    exchanged = mb.tokens * (widths.queries + widths.keys + widths.values + widths.outputs) \
        / layout.tensor * mb.act_bytes
    all_to_alls = 2 * mb.layers + layout_recomputed_layers(layout, mb.layers)
    return all_to_alls * (layout.context - 1) / layout.context \
        * exchanged / (gbps * 1e9 * COLLECTIVE_EFFICIENCY)


def _expert_comm(model: ModelConfig, layout: Layout, cluster: Cluster, mb: _MicroBatch) -> float:
    """Seconds of one micro-batch's expert-parallel all-to-alls: per MoE layer, each rank of the
    tensor group sends its chunk's k rows per token (tokens / ep x k x hidden) to the experts'
    ranks and gets them back (dispatch, combine); the reverse two in backward; once more per
    recomputed layer. A balanced router keeps 1/ep of the rows on the rank."""
    ep = layout.expert
    if ep == 1:
        return 0.0
    rows = mb.tokens / ep * model.experts_per_token
    exchanged = rows * model.hidden_size * mb.act_bytes
    all_to_alls = 4 * mb.layers + 2 * layout_recomputed_layers(layout, mb.layers)
    return all_to_alls * (ep - 1) / ep * exchanged \
        / (_link_gbps(cluster, layout.tensor) * 1e9 * COLLECTIVE_EFFICIENCY)


def _pipeline_p2p(model: ModelConfig, layout: Layout, cluster: Cluster, mb: _MicroBatch) -> float:
    """Seconds of a step's stage-to-stage activations and gradients (1F1B). DeepSpeed
    (pipe_partitioned) and Megatron split the boundary activations over TP ranks; under
    sequence parallelism each TP rank holds its slice anyway."""
    if layout.pipeline == 1:
        return 0.0
    cross_node = layout.tensor * layout.context * layout.data >= cluster.gpus_per_node  # a stage
    gbps = cluster.inter_node_gbps if cross_node else cluster.intra_node_gbps  # fills a node
    boundary = mb.tokens * model.hidden_size * mb.act_bytes / layout.tensor
    return 2 * (layout.grad_accum + layout.pipeline - 2) * boundary \
        / (gbps * 1e9 * COLLECTIVE_EFFICIENCY)


def _data_comm(layout: Layout, cluster: Cluster, mb: _MicroBatch, *, stage_params: int,
               grad_bytes: int) -> float:
    """Seconds of exposed data-parallel communication: gradients (`grad_bytes` each: the
    communication dtype's) and ZeRO-3 parameters over the data x context replicas, less what
    the backward (ZeRO-3: the whole micro-batch) hides."""
    replicas = layout.data * layout.context  # DeepSpeed's data parallelism: data x context ranks
    param_bytes = bytes_per_param(layout)[0]
    gbps = _link_gbps(cluster, layout.tensor * replicas)
    backward = mb.compute * 2.0 / 3.0
    if layout.zero_stage <= 1:  # one all-reduce (ZeRO 1: reduce-scatter + all-gather) per step
        comm = _ring_seconds(stage_params * grad_bytes, replicas, gbps, passes=2)
        return max(0.0, comm - backward)
    # reduce-scatter every micro-batch; ZeRO 3 also gathers parameters forward and backward
    per_micro_batch = _ring_seconds(stage_params * grad_bytes, replicas, gbps, passes=1)
    if layout.zero_stage == 3:
        per_micro_batch += _ring_seconds(stage_params * param_bytes, replicas, gbps, passes=2)
        hidden = mb.compute
    else:
        hidden = backward
    exposed = layout.grad_accum * max(0.0, per_micro_batch - hidden)
    if layout.zero_stage == 2:  # updated parameters gathered once after the step
        exposed += _ring_seconds(stage_params * param_bytes, replicas, gbps, passes=1)
    return exposed


def fsdp2_bytes_per_micro_batch(layout: Layout, *, stage_params: int) -> tuple[float, float]:
    """(all-gathered, reduce-scattered) bytes of one micro-batch under fsdp2, whole tensors
    before the ring's (ranks - 1) / ranks: every unit gathered in the compute dtype forward and,
    resharded after forward, backward; every gradient reduced in fp32 (the bf16 policy's
    reduce dtype, fp32 runs' own)."""
    compute_bytes = 4 if layout.precision == Precision.FP32 else 2
    gathers = 2 if layout.zero_stage == 3 else 1
    return gathers * stage_params * compute_bytes, stage_params * 4.0


def _fsdp2_data_comm(layout: Layout, cluster: Cluster, mb: _MicroBatch, *,
                     stage_params: int, grad_bytes: int) -> float:
    """Seconds of FSDP2's exposed collectives: those of every micro-batch, less its compute.
    The shard group is consecutive data x context ranks (every tensor rank's between them);
    HSDP's replica groups stride across all the data x context ranks. FSDP2 reduces in its
    policy's reduce dtype (fp32, `fsdp2_bytes_per_micro_batch`), whatever the JSON's
    communication_data_type (`grad_bytes`, not read)."""
    shards = fsdp2_shard_ranks(layout)
    gbps = _link_gbps(cluster, layout.tensor * shards)
    gathered, reduced = fsdp2_bytes_per_micro_batch(layout, stage_params=stage_params)
    per_micro_batch = (_ring_seconds(gathered, shards, gbps, passes=1)
                       + _ring_seconds(reduced, shards, gbps, passes=1)
                       + _ring_seconds(reduced / shards, layout.fsdp2_replicas,
                                       _link_gbps(cluster, layout.world_size), passes=2))
    return layout.grad_accum * max(0.0, per_micro_batch - mb.compute)


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


def _offload(layout: Layout, cluster: Cluster, *, stage_params: int) -> float:
    """Seconds of host <-> device traffic and the CPU optimizer step: an offloaded optimizer
    sends gradients down and parameters up and runs CPU Adam on this GPU's share; offloaded
    parameters are fetched twice by every micro-batch."""
    shard = stage_params / (layout.data * layout.context)
    param_bytes = bytes_per_param(layout)[0]
    pcie = cluster.pcie_gbps * 1e9
    seconds = 0.0
    if layout.offload_optimizer != "none":
        seconds = shard * (4 + param_bytes) / pcie + shard / CPU_ADAM_PARAMS_PER_S
    if layout.offload_param != "none":
        seconds += layout.grad_accum * 2 * stage_params / (layout.data * layout.context) \
            * param_bytes / pcie
    return seconds


def _concatenated_weights(model: ModelConfig, layout: Layout) -> float:
    """Weight elements one decoder layer concatenates per pass on a GPU under fused projections
    (`pretrain.model.llama.fused_projections`): this rank's q, k and v rows, and gate and up of
    the MLP or of every expert it holds (1/tp of each of E, or E/ep whole: the same count)."""
    if not model.fused_projections:
        return 0.0
    qkv = family_of(model).attention_widths(model).concatenated  # the family's fused attention
    gate_up = 2 * model.hidden_size * model.ffn_hidden_size * max(1, model.num_experts)
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


def estimate_time(model: ModelConfig, layout: Layout, cluster: Cluster,
                  stages: list[list[str]], *, engine: Engine = Engine.DEEPSPEED,
                  ds: dict[str, Any] | None = None) -> tuple[TimeBreakdown, float, float]:
    """(time breakdown, model FLOPs per GPU per step, hardware FLOPs per GPU per step).

    Per micro-batch the slowest stage computes and copies, then waits for its TP and CP
    collectives; a step is `grad_accum` of them, the pipeline's fill and drain, and what data
    parallelism and offloading (`engine`'s) do not hide. `ds`: the run's resolved DeepSpeed
    JSON (communication dtype, gradient accumulation dtype); None plans what the resolver
    fills into an "auto" one."""
    flops = [stage_flops_per_token(model, layout, items) for items in stages]
    slow_model, slow_hw = max(flops, key=lambda f: f[1])
    tokens = layout.micro_batch * model.seq_length / layout.context
    mb = _MicroBatch(tokens=tokens, act_bytes=4 if layout.precision == Precision.FP32 else 2,
                     layers=max(items.count("layer") for items in stages),
                     compute=slow_hw * tokens / (cluster.peak_tflops * 1e12 * MATMUL_EFFICIENCY))
    tensor_mb = _tensor_comm(model, layout, cluster, mb)
    context_mb = _context_comm(model, layout, cluster, mb)
    expert_mb = _expert_comm(model, layout, cluster, mb)
    stage_params = max(stage_parameters(model, layout, items) for items in stages)
    micro_batches = layout.grad_accum
    deepspeed = engine is not Engine.FSDP2
    data_comm, offload = (_data_comm, _offload) if deepspeed else (_fsdp2_data_comm,
                                                                   _fsdp2_offload)
    copies_mb = _memory_bound(model, layout, cluster, mb, stage_params=stage_params,
                              bf16_optimizer=deepspeed and steps_with_bf16_optimizer(layout, ds))
    times = TimeBreakdown(
        compute=micro_batches * mb.compute, tensor_comm=micro_batches * (tensor_mb + expert_mb),
        bubble=(layout.pipeline - 1) * (mb.compute + tensor_mb + context_mb + expert_mb
                                        + copies_mb),
        pipeline_comm=_pipeline_p2p(model, layout, cluster, mb),
        data_comm=data_comm(layout, cluster, mb, stage_params=stage_params,
                            grad_bytes=DTYPE_BYTES[gradient_dtypes(layout, ds)[1]]),
        offload=offload(layout, cluster, stage_params=stage_params),
        context_comm=micro_batches * context_mb, memory_bound=micro_batches * copies_mb)
    times.expert_comm = micro_batches * expert_mb
    model_flops = model_flops_per_token(model) * layout.global_batch * model.seq_length \
        / layout.world_size
    hardware_flops = model_flops * slow_hw / slow_model if slow_model else model_flops
    return times, model_flops, hardware_flops
