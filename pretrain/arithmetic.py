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

Mixture of experts (`model.num_experts` > 0): a mixture layer holds num_experts SwiGLU experts
and a router (num_experts x hidden, replicated over tensor parallelism), but a token runs through
`experts_per_token` of them: parameter counts and memory use the total, FLOPs the active
parameters (router included). Which layers are mixtures is the family's (`Family.moe_layer`:
Mixtral every layer, Qwen3-MoE every `moe_layer_interval`-th), so every count sums its layers one
by one; a pipeline stage's layers are `LayerItem`s that know their index.
"""
from __future__ import annotations

import functools
import math

from pretrain.config import ModelConfig, Recompute
from pretrain.errors import ConfigError
from pretrain.families import family_of
from pretrain.resolve.layout import Layout


class LayerItem(str):
    """A decoder layer of a pipeline stage's items (`stage_items`): equal to "layer", and
    knowing its index (`.index`) for the counts that differ by layer."""

    index: int

    def __new__(cls, index: int) -> "LayerItem":
        item = super().__new__(cls, "layer")
        item.index = index
        return item


def layer_indices(items: list[str]) -> list[int]:
    """The decoder layers of a stage's `items`: their indices (`LayerItem`); plain "layer"
    items count from layer 0 (a whole model's list)."""
    layers = [item for item in items if item == "layer"]
    return [getattr(item, "index", n) for n, item in enumerate(layers)]


# counts of a decoder layer by (what, the model's fields, index): a family's table lists a
# mixture layer's parameters expert by expert (128 x 3 names a Qwen3-MoE layer), which a layout
# search would otherwise walk again for every layer of every layout
_LAYER_COUNTS: dict[tuple[str, str, int], object] = {}


def _layer_count(what: str, m: ModelConfig, index: int, count):
    key = (what, m.key(), index)
    if key not in _LAYER_COUNTS:
        if len(_LAYER_COUNTS) > 65536:
            _LAYER_COUNTS.clear()
        _LAYER_COUNTS[key] = count()
    return _LAYER_COUNTS[key]


def layer_parameters(m: ModelConfig, index: int = 0) -> tuple[int, int]:
    """(tensor-parallel-sharded, replicated) parameters of decoder layer `index`, by the
    family's table: Llama's q, o, k, v and SwiGLU's three projections (each expert's) are
    sharded; the two RMSNorms (and a mixture of experts' router, Qwen3's q/k norms) are
    replicated."""
    return _layer_count("parameters", m, index,
                        lambda: family_of(m).layer_parameters(m, index))


def layer_projection_shapes(m: ModelConfig, index: int = 0) -> list[tuple[int, int]]:
    """The unsharded (rows, columns) of decoder layer `index`'s projection matrices (the family's
    table): what `train.optimizer: muon` orthogonalises, each whole, and what `train.fp8`
    multiplies in FP8 (`pretrain.model.fp8`): attention's and the MLP's projections, each
    expert's; the router, the embedding and the head stay in the run's precision. (Projections
    whose local sizes are not multiples of 16 stay too: not modelled, no recipe has one.)"""
    return family_of(m).projection_shapes(m, index)


def mean_layer_elements(m: ModelConfig, matrices_of) -> float:
    """Elements of a decoder layer's matrices listed by `matrices_of(m, index)`
    (`layer_projection_shapes`), averaged over the model's layers (a family
    may mix dense and mixture layers; for a model of like layers, any one layer's)."""
    return sum(r * c for i in range(m.num_layers) for r, c in matrices_of(m, i)) / m.num_layers


def largest_matrix(m: ModelConfig, matrices_of) -> tuple[int, int]:
    """The largest (rows, columns) of every decoder layer's matrices listed by `matrices_of`."""
    return max((shape for i in range(m.num_layers) for shape in matrices_of(m, i)),
               key=lambda shape: shape[0] * shape[1])


def newton_schulz_flops(rows: int, cols: int, *, steps: int = 5) -> float:
    """FLOPs of Muon's Newton-Schulz on one rows x cols matrix (torch.optim.Muon's quintic
    iteration on the shorter side r of the two, the other c): per step A = X X^T (2 r^2 c),
    B = b A + c A A (2 r^3), X = a X + B X (2 r^2 c)."""
    r, c = min(rows, cols), max(rows, cols)
    return steps * (4.0 * r * r * c + 2.0 * r ** 3)


def layer_active_matmul_parameters(m: ModelConfig, index: int = 0) -> int:
    """The matrix parameters of decoder layer `index` a token is multiplied with: attention, the
    SwiGLU MLP or its experts_per_token experts, and the router."""
    return _layer_count("active matmul", m, index,
                        lambda: family_of(m).layer_matmul_parameters(m, index, active=True))


def _layer_matmul_parameters(m: ModelConfig, index: int) -> int:
    """Every matrix parameter of decoder layer `index` (all experts): the family's count."""
    return _layer_count("matmul", m, index,
                        lambda: family_of(m).layer_matmul_parameters(m, index))


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


def mtp_own_parameters(m: ModelConfig) -> int:
    """Parameters of one multi-token prediction module beside its decoder layer (`model.mtp_depth`:
    its input projection 2h x h and three norms, whole on every tensor rank); its decoder layer
    counts as layer num_layers + depth (`stage_items`), its embedding and head are the model's."""
    if not m.mtp_depth:
        return 0
    module = sum(family_of(m).mtp_parameters(m))
    layers = sum(sum(layer_parameters(m, m.num_layers + k)) for k in range(m.mtp_depth))
    return (module - layers) // m.mtp_depth


def num_parameters(m: ModelConfig, *, include_embeddings: bool = True) -> int:
    """Parameter count of the unpadded model (what a Hugging Face export holds, its
    multi-token prediction modules included)."""
    n = sum(sum(layer_parameters(m, i)) for i in range(m.num_layers + m.mtp_depth)) \
        + m.hidden_size + m.mtp_depth * mtp_own_parameters(m)  # + norm
    if include_embeddings:
        n += m.vocab_size * m.hidden_size * (1 if m.tie_embeddings else 2)
    return n


def _layer_active_parameters(m: ModelConfig, index: int) -> int:
    """The parameters one token uses in decoder layer `index`: its active matrices (a mixture's
    experts_per_token experts and its router) and what is not a matrix (the gains; the
    replicated matrices - a router, DeepSeek-V3's latent down-projections - are counted with
    the matrices)."""
    return layer_active_matmul_parameters(m, index) + sum(layer_parameters(m, index)) \
        - _layer_matmul_parameters(m, index)


def num_active_parameters(m: ModelConfig, *, include_embeddings: bool = True) -> int:
    """Parameters one token uses (`num_parameters` for a dense model): a mixture of experts
    counts experts_per_token experts per mixture layer, and its router."""
    n = sum(_layer_active_parameters(m, i) for i in range(m.num_layers)) + m.hidden_size
    if include_embeddings:
        n += m.vocab_size * m.hidden_size * (1 if m.tie_embeddings else 2)
    return n


def layer_forward_flops_per_token(m: ModelConfig, index: int = 0) -> float:
    """Forward matmul FLOPs of decoder layer `index` per token (active parameters under MoE)."""
    return 2.0 * layer_active_matmul_parameters(m, index) \
        + 2.0 * m.seq_length * _attention_width(m)


def mean_layer_forward_flops_per_token(m: ModelConfig, indices: list[int]) -> float:
    """`layer_forward_flops_per_token` averaged over the decoder layers `indices` (0: none)."""
    return mean([layer_forward_flops_per_token(m, i) for i in indices])


def mean(values: list[float]) -> float:
    """The mean of `values` (0 for none); exactly the value when they are all one (the layers
    of a family whose layers are alike: no rounding of a sum)."""
    if not values:
        return 0.0
    if all(v == values[0] for v in values):
        return values[0]
    return sum(values) / len(values)


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
    # the mean layer's forward (the family's dense and mixture layers alike, or mixed)
    return model_flops_per_token(m) + extra * mean_layer_forward_flops_per_token(
        m, list(range(m.num_layers)))


# ---- per pipeline stage ---------------------------------------------------------------------

def stage_items(m: ModelConfig, layout: Layout) -> list[list[str]]:
    """The pipeline stages as lists of 'embed' / 'layer' / 'norm' / 'head' items: the specs of
    `pretrain.model.pipeline` (embedding, decoder layers, final norm, output projection), cut
    as DeepSpeed's `PipelineModule` cuts them for `parallel.pipeline_partition`: 'uniform' gives
    every stage the same number of specs, 'parameters' balances the specs' parameters on one
    GPU, 'type:DecoderLayerPipe' balances decoder layers only. Under `train.engine: fsdp2`
    one list per pipeline rank: the specs of its virtual stages (`pipeline_rank_items`).
    Multi-token prediction (`model.mtp_depth`, one stage only) adds its modules: decoder layers
    num_layers .. num_layers + depth - 1 and an "mtp" item each (its projection, norms and one
    more pass of the head)."""
    items = ["embed"] + [LayerItem(i) for i in range(m.num_layers)] + ["norm", "head"]
    if layout.pipeline == 1:
        mtp = [LayerItem(m.num_layers + k) for k in range(m.mtp_depth)] + ["mtp"] * m.mtp_depth
        return [items + mtp]
    if layout.engine == "fsdp2":
        return pipeline_rank_items(m, layout)
    if layout.partition == "uniform":
        parts = partition_uniform(len(items), layout.pipeline)
    else:
        if layout.partition == "parameters":
            vocab = m.padded_vocab_size(layout.tensor) * m.hidden_size // layout.tensor
            weights = {"embed": vocab, "norm": m.hidden_size, "head": vocab}
            weight = [layer_on_gpu(m, layout, i.index) if i == "layer" else weights[i]
                      for i in items]
        else:  # type:DecoderLayerPipe
            weight = [1 if i == "layer" else 0 for i in items]
        parts = partition_balanced(tuple(weight), layout.pipeline)
    return [items[parts[s]:parts[s + 1]] for s in range(layout.pipeline)]


# ---- train.engine: fsdp2's pipelines (torch.distributed.pipelining) ----------------------------

V_SHAPED = ("zbv", "dualpipe_v")  # two stages a rank, the second counted back from the end


def stage_indices(pipeline_rank: int, *, pipeline: int, virtual_stages: int,
                  schedule: str) -> list[int]:
    """The stages rank `pipeline_rank` of the pipeline group holds, in order: looped (r, r + pp,
    ...) for 1F1B and the interleaved schedules, V-shaped (r and 2 pp - 1 - r) for ZBV and
    DualPipeV, which torch places that way."""
    if schedule in V_SHAPED:
        return [pipeline_rank, 2 * pipeline - 1 - pipeline_rank]
    return [pipeline_rank + v * pipeline for v in range(virtual_stages)]


def stage_spans(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """[start, stop) of each stage in the layer-spec list (0: embedding, 1 .. L: decoder
    layers, L + 1: norm, L + 2: head): each stage gets num_layers // num_stages decoder layers,
    the first num_layers % num_stages one more; the embedding opens the first stage, the norm
    and head close the last."""
    if num_layers < num_stages:
        raise ConfigError(f"parallel.pipeline x parallel.virtual_stages = {num_stages} stages "
                          f"for model.num_layers={num_layers}: every stage needs a decoder "
                          f"layer; use at most {num_layers} stages")
    base, extra = divmod(num_layers, num_stages)
    stops = [1 + sum(base + (s < extra) for s in range(stage + 1))
             for stage in range(num_stages)]
    starts = [0] + stops[:-1]
    stops[-1] = num_layers + 3
    return list(zip(starts, stops))


def pipeline_rank_items(m: ModelConfig, layout: Layout) -> list[list[str]]:
    """Each pipeline rank's items under fsdp2's pipelines: the specs of the stages it holds
    (`stage_indices`), `pipeline x virtual_stages` stages cut by `stage_spans`."""
    items = ["embed"] + ["layer"] * m.num_layers + ["norm", "head"]
    spans = stage_spans(m.num_layers, layout.pipeline * layout.virtual_stages)
    return [[item for stage in stage_indices(rank, pipeline=layout.pipeline,
                                             virtual_stages=layout.virtual_stages,
                                             schedule=layout.schedule)
             for item in items[slice(*spans[stage])]]
            for rank in range(layout.pipeline)]


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
    vocab = m.padded_vocab_size(layout.tensor) * m.hidden_size // layout.tensor
    n = sum(layer_on_gpu(m, layout, i) for i in layer_indices(items))
    n += vocab * items.count("embed") + m.hidden_size * items.count("norm")
    if "head" in items:  # the output projection: its own copy unless tied in the same stage
        # (fsdp2's V schedules put the first and last stages on one rank: two stages, two copies)
        shared = "embed" in items and not (layout.engine == "fsdp2" and layout.pipeline > 1)
        n += 0 if m.tie_embeddings and shared else vocab
    return n + items.count("mtp") * mtp_own_parameters(m)


def layer_on_gpu(m: ModelConfig, layout: Layout, index: int) -> int:
    """Parameters one GPU holds of decoder layer `index`: its tensor-parallel shard plus the
    replicated ones, before ZeRO sharding; a mixture layer's routed experts as the expert
    layout lays them out (`layer_experts_on_gpu`)."""
    sharded, replicated = layer_parameters(m, index)
    experts = layer_expert_parameters(m, index)
    if not experts:
        return sharded // layout.tensor + replicated
    return (sharded - experts) // layout.tensor + layer_experts_on_gpu(m, layout, index) \
        + replicated


def largest_layer_on_gpu(m: ModelConfig, layout: Layout, items: list[str]) -> int:
    """The most parameters one GPU holds of one decoder layer of `items` (a mixture layer's,
    where the family mixes dense and mixture layers); 0 without layers."""
    return max((layer_on_gpu(m, layout, i) for i in layer_indices(items)), default=0)


def moe_layer_count(m: ModelConfig, items: list[str]) -> int:
    """How many of the decoder layers of `items` are mixtures of experts."""
    family = family_of(m)
    return sum(1 for i in layer_indices(items) if family.moe_layer(m, i))


def expert_tensor_size(layout: Layout) -> int:
    """`parallel.expert_tensor` settled (`Topology`'s rule): the ranks splitting each expert's
    matrices; 0 (auto) is the tensor size without expert parallelism, else 1 (whole experts)."""
    if layout.expert_tensor:
        return layout.expert_tensor
    return layout.tensor if layout.expert == 1 else 1


def expert_layout_label(layout: Layout) -> str:
    """' (ep 8: the tp ranks)', ' (ep 16 x etp 1 of a stage's ranks)', or '' at expert 1: where
    the experts lie, as the plan and the run's first line say it."""
    if layout.expert == 1:
        return ""
    etp = expert_tensor_size(layout)
    if layout.expert == layout.tensor and etp == 1:
        return f" (ep {layout.expert}: the tp ranks)"
    return f" (ep {layout.expert} x etp {etp} of a stage's ranks)"


def expert_data_size(layout: Layout) -> int:
    """The ranks holding the same experts (`Topology.expert_data_groups`): a stage's tensor x
    context x data ranks over expert x expert_tensor. The experts' gradients are reduced, and
    their ZeRO/FSDP state partitioned, over these; with the experts on the tensor ranks (expert
    = tensor, expert_tensor 1) or split as the dense MLP (expert 1) they are the data x context
    ranks, the dense weights' own."""
    stage = layout.tensor * layout.context * layout.data
    return max(1, stage // (layout.expert * expert_tensor_size(layout)))


def layer_expert_parameters(m: ModelConfig, index: int) -> int:
    """The routed experts' weights of decoder layer `index`, all of them unsharded (each a
    SwiGLU of 3 x hidden x `expert_ffn_hidden_size`); 0 in a dense layer. Shared experts
    (DeepSeek-V3's) are split over the tensor ranks as the dense MLP and are not counted."""
    if not m.num_experts or not family_of(m).moe_layer(m, index):
        return 0
    return m.num_experts * 3 * m.hidden_size * m.expert_ffn_hidden_size


def layer_experts_on_gpu(m: ModelConfig, layout: Layout, index: int) -> int:
    """The routed experts' weights one GPU holds of decoder layer `index`: num_experts /
    expert of them, each split over expert_tensor ranks (without expert parallelism 1/tp of
    every expert; with the experts whole on the tensor ranks num_experts / tp whole experts:
    the same count)."""
    experts = layer_expert_parameters(m, index)
    if not experts:
        return 0
    return experts // layout.expert // expert_tensor_size(layout)


def expert_parameters_per_rank(m: ModelConfig, layout: Layout, *, layers: int) -> int:
    """Expert weights one GPU holds for `layers` MoE layers, before ZeRO sharding: num_experts /
    expert experts, each whole (expert_tensor 1) or a 1/expert_tensor slice of it; without
    expert parallelism a 1/tp slice of every expert. Experts on the tensor ranks (expert = tp)
    weigh the same as the 1/tp slices; taken from the data ranks they weigh less."""
    if not m.num_experts:
        return 0
    expert = 3 * m.hidden_size * m.expert_ffn_hidden_size
    return layers * m.num_experts * expert // layout.expert // expert_tensor_size(layout)


def expert_share(layout: Layout) -> float:
    """The routed experts' weights a GPU holds relative to a 1/tp slice of every expert:
    tp / (expert x expert_tensor); 1 with the experts whole on the tensor ranks (expert = tp)
    or split as the dense MLP (expert 1), less where the expert ranks come from the data
    ranks."""
    return layout.tensor / (layout.expert * expert_tensor_size(layout))


def layer_projection_elements_on_gpu(m: ModelConfig, layout: Layout, index: int) -> float:
    """Elements of decoder layer `index`'s projection matrices (`layer_projection_shapes`) one
    GPU holds: 1/tp of attention's and the dense MLP's, and `expert_share` of 1/tp of the
    routed experts'."""
    total = sum(r * c for r, c in layer_projection_shapes(m, index))
    experts = layer_expert_parameters(m, index)
    return (total - experts + experts * expert_share(layout)) / layout.tensor


def mean_projection_elements_on_gpu(m: ModelConfig, layout: Layout) -> float:
    """`layer_projection_elements_on_gpu` averaged over the model's layers (what `train.fp8`
    casts and FSDP2 gathers in FP8 of a mean layer): mean_layer_elements / tp unless the expert
    ranks come from the data ranks."""
    if expert_share(layout) == 1:
        return mean_layer_elements(m, layer_projection_shapes) / layout.tensor
    return mean([layer_projection_elements_on_gpu(m, layout, i) for i in range(m.num_layers)])


def stage_expert_parameters(m: ModelConfig, layout: Layout, items: list[str]) -> int:
    """The routed experts' weights one GPU of this stage holds (`layer_experts_on_gpu` of its
    mixture layers), before ZeRO sharding: the part of `stage_parameters` partitioned over the
    expert-data ranks."""
    return sum(layer_experts_on_gpu(m, layout, i) for i in layer_indices(items))


def partitioned_parameters(layout: Layout, parameters: float, experts: float) -> float:
    """One rank's ZeRO/FSDP partition of `parameters` (`experts` of them the routed experts'):
    the dense ones over the data x context ranks, the experts over the expert-data ranks
    (`expert_data_size`). Where these are the same ranks, parameters / (data x context)."""
    dense_ranks = layout.data * layout.context
    expert_ranks = expert_data_size(layout)
    if not experts or expert_ranks == dense_ranks:
        return parameters / dense_ranks
    return (parameters - experts) / dense_ranks + experts / expert_ranks


def layout_recomputed_layers(layout: Layout, layers: int) -> int:
    """`recomputed_layers` of `layers` decoder layers under the layout's recompute mode."""
    return recomputed_layers(layout.recompute, interval=layout.recompute_interval, layers=layers)


def stage_flops_per_token(m: ModelConfig, layout: Layout, items: list[str]) -> tuple[float, float]:
    """(model, hardware) training FLOPs per token of this stage on one GPU: forward + backward is
    3x forward; recomputed layers run their forward once more (hardware FLOPs only)."""
    indices = layer_indices(items)
    model = 3.0 * sum(layer_forward_flops_per_token(m, i) for i in indices)
    if "head" in items:
        model += 6.0 * m.vocab_size * m.hidden_size
    # each multi-token prediction module: the head once more, and its projection (2h -> h,
    # whole on every tensor rank)
    model += items.count("mtp") * 6.0 * m.vocab_size * m.hidden_size
    projection = items.count("mtp") * 6.0 * 2 * m.hidden_size * m.hidden_size
    hardware = model + mean_layer_forward_flops_per_token(m, indices) \
        * layout_recomputed_layers(layout, len(indices))
    return (model / layout.tensor + projection,
            hardware / layout.tensor + projection)
