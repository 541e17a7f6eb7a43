"""Model arithmetic without torch: parameters and FLOPs per layer, per pipeline stage, per model,
and how a pipeline's stages are cut.

One definition of each count, shared by the config dry run, the planner (`pretrain.plan`) and
the telemetry's MFU / HFU. The parameters of a layer come from its family's parameter table
(`pretrain.families`), so a family counts what it holds without a line here. FLOPs follow the
Megatron / PaLM convention: 2 per weight per token forward, causal attention's QK^T and AV
counted whole (2 * seq * (queries + outputs) per layer forward, the widths of the family's
`attention_widths`: 4 * seq * heads * head_dim, 4 * seq * hidden in Llama),
training = 3 x forward; recomputed layers run their forward once more, which only hardware
FLOPs count.

Mixture of experts (`model.num_experts` > 0): a layer holds num_experts SwiGLU experts and a
router (num_experts x hidden, replicated over tensor parallelism), but a token runs through
`experts_per_token` of them: parameter counts and memory use the total, FLOPs the active
parameters (router included).
"""
from __future__ import annotations

import functools
import math

from pretrain.config import ModelConfig, Recompute
from pretrain.families import family_of
from pretrain.resolve.layout import Layout


def layer_parameters(m: ModelConfig) -> tuple[int, int]:
    """(tensor-parallel-sharded, replicated) parameters of one decoder layer, by the family's
    table: Llama's q, o, k, v and SwiGLU's three projections (each expert's) are sharded; the
    two RMSNorms (and a mixture of experts' router, Qwen3's q/k norms) are replicated."""
    return family_of(m).layer_parameters(m)


def layer_active_matmul_parameters(m: ModelConfig) -> int:
    """The matrix parameters of one decoder layer a token is multiplied with: attention, the
    SwiGLU MLP or its experts_per_token experts, and the router."""
    return family_of(m).layer_matmul_parameters(m, active=True)


def _attention_width(m: ModelConfig) -> int:
    """The widths attention's scores and outputs are computed at, summed (heads x (the q.k
    width + the value width): 2 x heads x head_dim in Llama), from the family."""
    widths = family_of(m).attention_widths(m)
    return widths.queries + widths.outputs


def kv_cache_elements_per_token(m: ModelConfig) -> int:
    """Elements one token leaves in the decoding cache of the whole model (all layers), from
    the family: Llama's keys and values, 2 x num_kv_heads x head_dim a layer; DeepSeek-V3's
    latent and rotary key, kv_lora_rank + qk_rope_head_dim."""
    return m.num_layers * family_of(m).attention_widths(m).cached


def num_parameters(m: ModelConfig, *, include_embeddings: bool = True) -> int:
    """Parameter count of the unpadded model (what a Hugging Face export holds)."""
    n = m.num_layers * sum(layer_parameters(m)) + m.hidden_size  # + final norm
    if include_embeddings:
        n += m.vocab_size * m.hidden_size * (1 if m.tie_embeddings else 2)
    return n


def num_active_parameters(m: ModelConfig, *, include_embeddings: bool = True) -> int:
    """Parameters one token uses (`num_parameters` for a dense model): a mixture of experts
    counts experts_per_token experts per layer, and its router."""
    # + the gains: what is not a matrix (the replicated matrices - a router, DeepSeek-V3's
    # latent down-projections - are counted above)
    family = family_of(m)
    layer = layer_active_matmul_parameters(m) + sum(layer_parameters(m)) \
        - family.layer_matmul_parameters(m)
    n = m.num_layers * layer + m.hidden_size
    if include_embeddings:
        n += m.vocab_size * m.hidden_size * (1 if m.tie_embeddings else 2)
    return n


def layer_forward_flops_per_token(m: ModelConfig) -> float:
    """Forward matmul FLOPs of one decoder layer per token (active parameters under MoE)."""
    return 2.0 * layer_active_matmul_parameters(m) + 2.0 * m.seq_length * _attention_width(m)


def model_flops_per_token(m: ModelConfig) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), without recomputation:
    6 per non-embedding weight and output-projection weight, plus attention's QK^T and AV
    (6 * seq * (queries + outputs) per layer for forward and backward: 12 * seq * heads *
    head_dim in Llama; causality's halving not applied)."""
    n = num_active_parameters(m, include_embeddings=False) + m.vocab_size * m.hidden_size
    return 6.0 * n + 6.0 * m.num_layers * _attention_width(m) * m.seq_length


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
    """The pipeline stages as lists of 'embed' / 'layer' / 'norm' / 'head' items: the specs of
    `pretrain.model.pipeline` (embedding, decoder layers, final norm, output projection), cut
    as DeepSpeed's `PipelineModule` cuts them for `parallel.pipeline_partition`: 'uniform' gives
    every stage the same number of specs, 'parameters' balances the specs' parameters on one
    GPU, 'type:DecoderLayerPipe' balances decoder layers only."""
    items = ["embed"] + ["layer"] * m.num_layers + ["norm", "head"]
    if layout.pipeline == 1:
        return [items]
    if layout.partition == "uniform":
        parts = partition_uniform(len(items), layout.pipeline)
    else:
        if layout.partition == "parameters":
            sharded, replicated = layer_parameters(m)
            vocab = m.padded_vocab_size(layout.tensor) * m.hidden_size // layout.tensor
            weights = {"embed": vocab, "layer": sharded // layout.tensor + replicated,
                       "norm": m.hidden_size, "head": vocab}
        else:  # type:DecoderLayerPipe
            weights = {"embed": 0, "layer": 1, "norm": 0, "head": 0}
        parts = partition_balanced(tuple(weights[i] for i in items), layout.pipeline)
    return [items[parts[s]:parts[s + 1]] for s in range(layout.pipeline)]


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Stage boundaries of `num_items` specs cut into `num_parts` runs of equal count, the
    first ones one longer (DeepSpeed's `runtime.utils.partition_uniform`)."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


@functools.lru_cache(maxsize=256)
def partition_balanced(weights: tuple[int, ...], num_parts: int) -> tuple[int, ...]:
    """Stage boundaries that cut `weights` into `num_parts` contiguous runs with the smallest
    spread (heaviest - lightest run), ties to the latest cut: DeepSpeed's
    `runtime.utils.partition_balanced` (a linear-partition dynamic programme), without NumPy."""
    n, m = len(weights), num_parts
    if n <= m:
        return tuple(partition_uniform(n, m))
    inf = math.inf
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    dp_max[0][0] = dp_cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                run = prefix[i] - prefix[k]
                max_sum, min_sum = max(dp_max[k][j - 1], run), min(dp_min[k][j - 1], run)
                if dp_cost[i][j] >= max_sum - min_sum:
                    dp_cost[i][j], dp_max[i][j], dp_min[i][j] = max_sum - min_sum, max_sum, min_sum
                    position[i][j] = k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(position[parts[-1]][j])
    return tuple(parts[::-1])


def stage_parameters(m: ModelConfig, layout: Layout, items: list[str]) -> int:
    """Parameters one GPU of this stage holds (its tensor-parallel shard plus replicated norms),
    before ZeRO sharding."""
    sharded, replicated = layer_parameters(m)
    vocab = m.padded_vocab_size(layout.tensor) * m.hidden_size // layout.tensor
    n = items.count("layer") * (sharded // layout.tensor + replicated)
    n += vocab * items.count("embed") + m.hidden_size * items.count("norm")
    if "head" in items:  # the output projection: its own copy unless tied in the same stage
        n += 0 if m.tie_embeddings and "embed" in items else vocab
    return n


def expert_parameters_per_rank(m: ModelConfig, layout: Layout, *, layers: int) -> int:
    """Expert weights one GPU holds for `layers` MoE layers, before ZeRO sharding: a 1/tp slice
    of every expert, or under expert parallelism (the tensor ranks) num_experts / ep whole
    experts; the same count either way, as each rank holds 1/tp of them."""
    if not m.num_experts:
        return 0
    expert = 3 * m.hidden_size * m.ffn_hidden_size
    if layout.expert > 1:
        return layers * (m.num_experts // layout.expert) * expert
    return layers * m.num_experts * expert // layout.tensor


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
