"""The planner's all-gather context parallelism (`parallel.context_kind: allgather`).

Each of the `context` ranks of a sequence keeps its queries and all-gathers the keys and values
of the whole sequence every attention layer (`pretrain.model.context_parallel`): per layer
forward a rank receives (context - 1) / context of the sequence's K and V of its tensor rank's
kv heads, and backward reduce-scatters their gradients (the same bytes); a recomputed layer
gathers again. The gathered K and V (the whole sequence's, not 1/context of it) stay saved for
the layer's backward: the activation memory Ulysses does not have. Ulysses' all-to-alls are
`step_time._context_comm`'s; this module is all-gather's alone, and `step_time` and `memory`
add what it returns.
"""
from __future__ import annotations

from dataclasses import dataclass

from pretrain.arithmetic import layout_recomputed_layers
from pretrain.config import ModelConfig, Precision
from pretrain.plan.clusters import COLLECTIVE_EFFICIENCY, Cluster
from pretrain.resolve.layout import Layout


@dataclass(frozen=True)
class AllGatherContext:
    """One rank's all-gather context parallelism in one micro-batch (zero at context 1)."""

    bytes_per_layer: float  # received per layer forward: (context - 1) / context of gathered
    gathered_bytes_per_layer: float  # the whole sequence's K and V, held per layer for backward
    seconds: float  # the micro-batch's all-gathers and reduce-scatters over `layers` layers


def gathered_kv_bytes(model: ModelConfig, layout: Layout) -> float:
    """Bytes of the whole sequence's K and V one rank gathers per layer (its tensor rank's kv
    heads, a micro-batch of sequences); 0 without all-gather context parallelism."""
    if layout.context == 1 or layout.context_kind != "allgather":
        return 0.0
    act_bytes = 4 if layout.precision == Precision.FP32 else 2
    kv_heads = model.num_kv_heads / layout.tensor  # a tensor rank's (a fraction: replicated)
    return 2 * layout.micro_batch * model.seq_length * kv_heads * model.head_dim * act_bytes


def allgather_context(model: ModelConfig, layout: Layout, cluster: Cluster, *,
                      layers: int | None = None) -> AllGatherContext:
    """`AllGatherContext` of `layers` decoder layers (default: a stage's share of the model)
    under `layout`, the group on NVLink while tensor x context fits a node."""
    cp = layout.context
    if cp == 1:
        return AllGatherContext(0.0, 0.0, 0.0)
    if layers is None:
        layers = -(-model.num_layers // layout.pipeline)
    gathered = gathered_kv_bytes(model, layout)
    received = gathered * (cp - 1) / cp
    ranks = layout.tensor * cp
    gbps = cluster.intra_node_gbps if ranks <= cluster.gpus_per_node else cluster.inter_node_gbps
    collectives = 2 * layers + layout_recomputed_layers(layout, layers)
    seconds = collectives * received / (gbps * 1e9 * COLLECTIVE_EFFICIENCY)
    return AllGatherContext(received, gathered, seconds)
