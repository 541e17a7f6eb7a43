"""The planner's model of time: seconds per optimizer step of a layout on a cluster.

The step splits into compute (hardware FLOPs of the slowest stage at the sustained matmul rate),
tensor-parallel communication, context-parallel all-to-alls (four per attention layer forward:
q, k, v and the output; four backward; on the intra-node link while tensor x context fits a
node), the 1F1B pipeline bubble, pipeline point-to-point transfers,
exposed data-parallel communication and the offloaded optimizer step; the efficiency
assumptions are those of `pretrain.plan.clusters`.
"""
from __future__ import annotations

from dataclasses import dataclass

from pretrain.arithmetic import (layout_recomputed_layers, model_flops_per_token,
                                 stage_flops_per_token, stage_parameters)
from pretrain.config import ModelConfig, Precision
from pretrain.layout import Layout
from pretrain.plan.clusters import (COLLECTIVE_EFFICIENCY, CPU_ADAM_PARAMS_PER_S,
                                    MATMUL_EFFICIENCY, Cluster)
from pretrain.plan.memory import bytes_per_param


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

    @property
    def step(self) -> float:
        return (self.compute + self.tensor_comm + self.bubble + self.pipeline_comm
                + self.data_comm + self.offload + self.context_comm)


def _ring_seconds(nbytes: float, ranks: int, gbps: float, *, passes: float) -> float:
    """Ring collective time: each GPU moves passes * (n - 1) / n of the bytes (all-reduce: 2)."""
    if ranks <= 1:
        return 0.0
    return passes * (ranks - 1) / ranks * nbytes / (gbps * 1e9 * COLLECTIVE_EFFICIENCY)


def estimate_time(m: ModelConfig, layout: Layout, cluster: Cluster,
                  stages: list[list[str]]) -> tuple[TimeBreakdown, float, float]:
    """(time breakdown, model FLOPs per GPU per step, hardware FLOPs per GPU per step)."""
    lay = layout
    tokens_mb = lay.micro_batch * m.seq_length / lay.context  # this rank's chunk
    replicas = lay.data * lay.context  # DeepSpeed's data parallelism: data x context ranks
    flops = [stage_flops_per_token(m, lay, items) for items in stages]
    slow_model, slow_hw = max(flops, key=lambda f: f[1])
    sustained = cluster.peak_tflops * 1e12 * MATMUL_EFFICIENCY
    compute_mb = slow_hw * tokens_mb / sustained

    # TP: 2 collectives of the layer's activations forward, 2 backward, 2 more per recomputed layer.
    gpn = cluster.gpus_per_node
    act_bytes = 4 if lay.precision == Precision.FP32 else 2
    tp_bw = cluster.intra_node_gbps if lay.tensor <= gpn else cluster.inter_node_gbps
    layers = max(items.count("layer") for items in stages)
    collectives = 4 * layers + 2 * layout_recomputed_layers(lay, layers)
    tp_mb = collectives * _ring_seconds(tokens_mb * m.hidden_size * act_bytes, lay.tensor, tp_bw,
                                        passes=2)
    # CP: per attention layer, q, k, v (this rank's chunk of its TP heads) and the output are
    # exchanged by all-to-all (each rank keeps 1/context of them) forward, their gradients
    # backward, once more per recomputed layer.
    cp_bw = cluster.intra_node_gbps if lay.tensor * lay.context <= gpn else \
        cluster.inter_node_gbps
    kv = m.num_kv_heads * m.head_dim
    a2a_bytes = tokens_mb * (2 * m.hidden_size + 2 * kv) / lay.tensor * act_bytes
    cp_mb = 0.0 if lay.context == 1 else \
        (2 * layers + layout_recomputed_layers(lay, layers)) * (lay.context - 1) / lay.context \
        * a2a_bytes / (cp_bw * 1e9 * COLLECTIVE_EFFICIENCY)
    m_count = lay.grad_accum
    compute, tensor_comm = m_count * compute_mb, m_count * tp_mb
    context_comm = m_count * cp_mb
    bubble = (lay.pipeline - 1) * (compute_mb + tp_mb + cp_mb)
    cross_node = lay.tensor * lay.context * lay.data >= gpn  # a stage fills at least one node
    p2p_bw = cluster.inter_node_gbps if cross_node else cluster.intra_node_gbps
    # DeepSpeed (pipe_partitioned) and Megatron split the boundary activations over TP ranks;
    # under sequence parallelism each TP rank holds its slice anyway.
    boundary = tokens_mb * m.hidden_size * act_bytes / lay.tensor
    pipeline_comm = 0.0 if lay.pipeline == 1 else \
        2 * (m_count + lay.pipeline - 2) * boundary / (p2p_bw * 1e9 * COLLECTIVE_EFFICIENCY)

    # DP: gradients (and ZeRO-3 parameters) over the data-parallel group.
    n = max(stage_parameters(m, lay, items) for items in stages)
    p_b, g_b, _ = bytes_per_param(lay)
    dp_bw = cluster.intra_node_gbps if lay.tensor * replicas <= gpn else cluster.inter_node_gbps
    backward_mb = compute_mb * 2.0 / 3.0
    if lay.zero_stage <= 1:  # one all-reduce (ZeRO 1: reduce-scatter + all-gather) per step
        comm = _ring_seconds(n * g_b, replicas, dp_bw, passes=2)
        data_comm = max(0.0, comm - backward_mb)
    else:  # reduce-scatter every micro-batch; ZeRO 3 also gathers parameters forward and backward
        per_mb = _ring_seconds(n * g_b, replicas, dp_bw, passes=1)
        if lay.zero_stage == 3:
            per_mb += _ring_seconds(n * p_b, replicas, dp_bw, passes=2)
            hide = compute_mb
        else:
            hide = backward_mb
        data_comm = m_count * max(0.0, per_mb - hide)
        if lay.zero_stage == 2:  # updated parameters gathered once after the step
            data_comm += _ring_seconds(n * p_b, replicas, dp_bw, passes=1)
    offload = 0.0
    if lay.offload_optimizer != "none":  # grads down, params up, CPU Adam on this GPU's share
        shard = n / replicas
        offload = shard * (4 + p_b) / (cluster.pcie_gbps * 1e9) + shard / CPU_ADAM_PARAMS_PER_S
    if lay.offload_param != "none":  # every micro-batch fetches its parameters twice
        offload += m_count * 2 * n / replicas * p_b / (cluster.pcie_gbps * 1e9)
    times = TimeBreakdown(compute=compute, tensor_comm=tensor_comm, bubble=bubble,
                          pipeline_comm=pipeline_comm, data_comm=data_comm, offload=offload,
                          context_comm=context_comm)
    model_flops = model_flops_per_token(m) * lay.global_batch * m.seq_length / lay.world_size
    hardware_flops = model_flops * slow_hw / slow_model if slow_model else model_flops
    return times, model_flops, hardware_flops
