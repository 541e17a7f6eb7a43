"""Model arithmetic without torch: parameters and FLOPs per layer, per pipeline stage, per model.

One definition of each count, shared by the config dry run, the planner (`pretrain.plan`) and
the telemetry's MFU / HFU. FLOPs follow the Megatron / PaLM convention: 2 per weight per token
forward, causal attention's QK^T and AV counted whole (4 * seq * hidden per layer forward),
training = 3 x forward; recomputed layers run their forward once more, which only hardware
FLOPs count.

Mixture of experts (`model.num_experts` > 0): a layer holds num_experts SwiGLU experts and a
router (num_experts x hidden, replicated over tensor parallelism), but a token runs through
`experts_per_token` of them: parameter counts and memory use the total, FLOPs the active
parameters (router included).
"""
from __future__ import annotations

import math

from pretrain.config import ModelConfig, Recompute
from pretrain.layout import Layout


def layer_parameters(m: ModelConfig) -> tuple[int, int]:
    """(tensor-parallel-sharded, replicated) parameters of one decoder layer: q, o, k, v and
    SwiGLU's three projections (each expert's) are sharded; the two RMSNorms (and a mixture of
    experts' router) are replicated."""
    h = m.hidden_size
    return _attention_parameters(m) + max(m.num_experts, 1) * 3 * h * m.ffn_hidden_size, \
        2 * h + m.num_experts * h


def _attention_parameters(m: ModelConfig) -> int:
    kv = m.num_kv_heads * m.head_dim
    return 2 * m.hidden_size ** 2 + 2 * m.hidden_size * kv


def layer_active_matmul_parameters(m: ModelConfig) -> int:
    """The matrix parameters of one decoder layer a token is multiplied with: attention, the
    SwiGLU MLP or its experts_per_token experts, and the router."""
    h = m.hidden_size
    experts = m.experts_per_token if m.num_experts else 1
    return _attention_parameters(m) + experts * 3 * h * m.ffn_hidden_size + m.num_experts * h


def num_parameters(m: ModelConfig, *, include_embeddings: bool = True) -> int:
    """Parameter count of the unpadded model (what a Hugging Face export holds)."""
    n = m.num_layers * sum(layer_parameters(m)) + m.hidden_size  # + final norm
    if include_embeddings:
        n += m.vocab_size * m.hidden_size * (1 if m.tie_embeddings else 2)
    return n


def num_active_parameters(m: ModelConfig, *, include_embeddings: bool = True) -> int:
    """Parameters one token uses (`num_parameters` for a dense model): a mixture of experts
    counts experts_per_token experts per layer, and its router."""
    layer = layer_active_matmul_parameters(m) + 2 * m.hidden_size  # + the two norms
    n = m.num_layers * layer + m.hidden_size
    if include_embeddings:
        n += m.vocab_size * m.hidden_size * (1 if m.tie_embeddings else 2)
    return n


def layer_forward_flops_per_token(m: ModelConfig) -> float:
    """Forward matmul FLOPs of one decoder layer per token (active parameters under MoE)."""
    return 2.0 * layer_active_matmul_parameters(m) + 4.0 * m.seq_length * m.hidden_size


def model_flops_per_token(m: ModelConfig) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), without recomputation:
    6 per non-embedding weight and output-projection weight, plus attention's QK^T and AV
    (12 * seq * hidden per layer for forward and backward; causality's halving not applied)."""
    n = num_active_parameters(m, include_embeddings=False) + m.vocab_size * m.hidden_size
    return 6.0 * n + 12.0 * m.num_layers * m.hidden_size * m.seq_length


def recomputed_layers(recompute: Recompute, *, interval: int, layers: int) -> int:
    """How many of `layers` decoder layers run their forward twice (layer i recomputes under
    every_k when i % interval == 0, as `LlamaModel.recomputes_layer`)."""
    if recompute == Recompute.FULL:
        return layers
    if recompute == Recompute.EVERY_K:
        return math.ceil(layers / interval)
    return 0


def hardware_flops_per_token(m: ModelConfig) -> float:
    """Training FLOPs per token the hardware executes: `model_flops_per_token` plus the forward
    of every recomputed layer (the telemetry's HFU; MFU counts the former only)."""
    extra = recomputed_layers(m.activation_checkpointing,
                              interval=m.activation_checkpointing_interval, layers=m.num_layers)
    return model_flops_per_token(m) + extra * layer_forward_flops_per_token(m)


# ---- per pipeline stage ---------------------------------------------------------------------

def stage_items(m: ModelConfig, layout: Layout) -> list[list[str]]:
    """The pipeline stages as lists of 'embed' / 'layer' / 'head' items, cut like DeepSpeed:
    'uniform' splits decoder layers evenly; 'parameters' (and 'type:...') balance parameters,
    so stages holding the embedding or the output projection get fewer layers."""
    pp = layout.pipeline
    if pp == 1:
        return [["embed"] + ["layer"] * m.num_layers + ["head"]]
    if layout.partition == "uniform":
        sizes = [m.num_layers // pp + (1 if s < m.num_layers % pp else 0) for s in range(pp)]
        stages = [["layer"] * n for n in sizes]
        stages[0].insert(0, "embed")
        stages[-1].append("head")
        return stages
    vocab_weight = m.padded_vocab_size(layout.tensor) * m.hidden_size
    weights = {"embed": vocab_weight, "layer": sum(layer_parameters(m)), "head": vocab_weight}
    items = ["embed"] + ["layer"] * m.num_layers + ["head"]
    limit = _smallest_stage_limit([weights[i] for i in items], pp)
    stages, load = [[]], 0
    for i, item in enumerate(items):
        remaining_items, remaining_stages = len(items) - i, pp - len(stages)
        if stages[-1] and (load + weights[item] > limit or remaining_items <= remaining_stages):
            stages.append([])
            load = 0
        stages[-1].append(item)
        load += weights[item]
    return stages


def _smallest_stage_limit(weights: list[int], stages: int) -> int:
    """The smallest maximum stage weight that cuts `weights` into <= `stages` contiguous runs."""
    lo, hi = max(weights), sum(weights)
    while lo < hi:
        mid = (lo + hi) // 2
        count, load = 1, 0
        for weight in weights:
            if load + weight > mid:
                count, load = count + 1, 0
            load += weight
        lo, hi = (mid + 1, hi) if count > stages else (lo, mid)
    return lo


def stage_parameters(m: ModelConfig, layout: Layout, items: list[str]) -> int:
    """Parameters one GPU of this stage holds (its tensor-parallel shard plus replicated norms),
    before ZeRO sharding."""
    sharded, replicated = layer_parameters(m)
    vocab = m.padded_vocab_size(layout.tensor) * m.hidden_size // layout.tensor
    n = items.count("layer") * (sharded // layout.tensor + replicated)
    n += vocab * items.count("embed")
    if "head" in items:  # final norm + output projection (its own copy unless tied in one stage)
        tied_here = m.tie_embeddings and "embed" in items
        n += m.hidden_size + (0 if tied_here else vocab)
    return n


def layout_recomputed_layers(layout: Layout, layers: int) -> int:
    """`recomputed_layers` of `layers` decoder layers under the layout's recompute mode."""
    return recomputed_layers(layout.recompute, interval=layout.recompute_interval, layers=layers)


def stage_flops_per_token(m: ModelConfig, layout: Layout, items: list[str]) -> tuple[float, float]:
    """(model, hardware) training FLOPs per token of this stage on one GPU: forward + backward is
    3x forward; recomputed layers run their forward once more (hardware FLOPs only)."""
    layer_fwd = layer_forward_flops_per_token(m)
    layers = items.count("layer")
    model = 3.0 * layer_fwd * layers
    if "head" in items:
        model += 6.0 * m.vocab_size * m.hidden_size
    hardware = model + layer_fwd * layout_recomputed_layers(layout, layers)
    return model / layout.tensor, hardware / layout.tensor
