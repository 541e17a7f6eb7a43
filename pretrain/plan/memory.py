"""The planner's model of memory: what one GPU of the heaviest pipeline stage holds.

Parameters, gradients and optimizer states by precision, ZeRO stage (sharded over data x
context ranks) and offload; activations by recompute mode (none, full, every k, selective:
`selective_layer_activation_elements`), context parallelism (1/context of the tokens per rank)
and sequence parallelism (after Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models") with the micro-batches the pipeline schedule keeps in flight
(`micro_batches_in_flight`: 1F1B's stage i holds pp - i); and DeepSpeed's communication
buffers. `train.optimizer: muon` keeps one fp32 momentum for the layers' projection matrices
instead of Adam's two moments (4 bytes fewer a parameter, `MUON_STATE_SAVING`) and gathers them
whole for its step (`muon_step_bytes`); `train.fp8` adds its casts and scales (`fp8_buffers`)
and, under fsdp2's tensorwise recipe, all-gathers the projections in FP8. A mixture of experts'
routed experts are partitioned over the expert-data ranks, the ranks holding the same experts
(`expert_partition`: fewer than the data ranks where the expert ranks are taken from them),
and expert parallelism keeps one MoE layer's all-to-all buffers (`expert_dispatch_buffers`).

Bytes per parameter (P = compute dtype bytes: 2 for bf16/fp16, 4 for fp32):

==========  =======  =====  =====================================================
precision   params   grads  optimizer (sharded by dp from ZeRO 1)
==========  =======  =====  =====================================================
bf16/fp16   2        2      12: fp32 master + Adam m + v
bf16, BF16  2        4      12, sharded by dp at ZeRO 0 too: DeepSpeed's
_Optimizer                  BF16_Optimizer (ZeRO 1 without offload; pipelines at
                            ZeRO 0) sums the bf16 gradients into an fp32 buffer
                            of the whole stage, never sharded; each bf16 gradient
                            is added in its backward hook and freed
                            (bf16.immediate_grad_update, the resolver's); + 2
                            where a JSON sets it false (all kept to the step)
bf16 ZeRO 0 2        2 + 4  12, not sharded (FP16_UnfusedOptimizer: fp32 masters,
(flat)                      gradients widened to fp32 at the step)
fp32        4        4      8 at ZeRO 0 (m + v); 12 from ZeRO 1 (DeepSpeed clones
                            an fp32 master partition even of fp32 weights)
==========  =======  =====  =====================================================

ZeRO 2 shards gradients, ZeRO 3 also parameters; optimizer offload moves the optimizer states
(and, from ZeRO 2, the fp32 gradient partition) to the host, parameter offload (ZeRO 3) the
parameters.

`train.engine: fsdp2` (`fsdp2_stage_memory`, after `pretrain.training.fsdp2.shard_model` and torch's
FSDP2): each decoder layer is one `fully_shard` unit and the root unit holds the embedding, the
final norm and the head; every unit is sharded over the data x context ranks (the rows' padding
to a multiple of the ranks is not counted). The shards are fp32 and are the optimizer's masters
(bf16 computes through `MixedPrecisionPolicy`), their gradients fp32 shards, torch's AdamW adds
two fp32 moments: 4 + 4 + 8 = 16 bytes per parameter / ranks in fp32 and bf16 alike, all three
in host memory under `CPUOffloadPolicy` (either offload of the JSON on cpu). No DeepSpeed
buckets; the buffers are the gathered units and the gradients in flight
(`fsdp2_gathered_bytes`, `fsdp2_gradients_in_flight`). Its pipelines
(`torch.distributed.pipelining`, `parallel.pipeline_schedule`) give each rank the layer specs of
its virtual stages (`pretrain.arithmetic.pipeline_rank_items`) and keep every unit gathered and
every gradient unsharded, in fp32, until the step's last backward.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pretrain.arithmetic import (expert_data_size, expert_share, largest_layer_on_gpu,
                                 largest_matrix, layer_projection_elements_on_gpu,
                                 mean_projection_elements_on_gpu,
                                 layer_indices, layer_on_gpu, layer_projection_shapes,
                                 layout_recomputed_layers, mean,
                                 partitioned_parameters, stage_expert_parameters,
                                 stage_parameters)
from pretrain.config import ModelConfig, Precision, Recompute
from pretrain.families import family_of
from pretrain.resolve.ds_config import gradient_dtypes, immediate_grad_update
from pretrain.resolve.fsdp2_rules import (SPLIT_BACKWARD, layout_refusals,
                                          micro_batch_refusals, raise_refusals,
                                          reshards_after_forward)
from pretrain.errors import ConfigError
from pretrain.families import family_of
from pretrain.resolve.layout import Layout
from pretrain.plan.context import gathered_kv_bytes

GB = 2**30


def steps_with_bf16_optimizer(layout: Layout, ds: dict[str, Any] | None = None) -> bool:
    """Whether DeepSpeed wraps the optimizer in its BF16_Optimizer: bf16 at ZeRO 1 without
    optimizer offload summing gradients in fp32 (the resolved JSON `ds`'s grad_accum_dtype; the
    resolver's fp32 when None), and bf16 pipelines at ZeRO 0 (DeepSpeed 0.19's
    `DeepSpeedEngine._do_optimizer_sanity_check`). It keeps a flat fp32 gradient buffer of
    every parameter of the stage (`fp32_groups_gradients_flat`, not partitioned), and fp32
    masters and Adam moments partitioned over data parallelism."""
    if layout.precision != Precision.BF16 or layout.offload_optimizer != "none":
        return False
    return (layout.zero_stage == 0 and layout.pipeline > 1) or (
        layout.zero_stage == 1 and gradient_dtypes(layout, ds)[0] == "fp32")


def bytes_per_param(layout: Layout) -> tuple[int, int, int]:
    """(params, grads, optimizer states) bytes per parameter before ZeRO sharding."""
    low = 4 if layout.precision == Precision.FP32 else 2
    if layout.precision == Precision.BF16 and layout.zero_stage == 0:
        # DeepSpeed's bf16 ZeRO-0 optimizer (FP16_UnfusedOptimizer) keeps fp32 masters (4) with
        # Adam's two moments (8), and at each step widens every gradient to fp32 at once (4 more)
        return low, low + 4, 12
    if layout.precision == Precision.FP32 and layout.zero_stage == 0:
        return low, low, 8
    return low, low, 12


def layer_activation_elements(m: ModelConfig, layout: Layout,
                              index: int = 0) -> tuple[float, float]:
    """Activation elements one decoder layer saves for backward per token (micro-batch of one
    sample), split into (replicated over TP unless sequence parallel, sharded over TP).

    Korthikanti et al. count 34*s*b*h bytes for a GPT layer; for this Llama block (SDPA's fused
    attention keeps no s x s scores, no dropout, SwiGLU) the saved tensors are, in units of h
    elements of the activation dtype: replicated: the two RMSNorms' inputs and outputs (4; 6 in
    16-bit, where the norm saves its fp32 upcast); sharded: q (1), k and v (2*kv/h), the attention
    output (1) and the output projection's input (1) (q's width heads x head_dim; the widths are
    the family's `attention_widths`: DeepSeek-V3's keys as wide as its queries, its values and
    outputs heads x v_head_dim; its replicated latents are not counted), and SwiGLU's gate, up,
    silu(gate) and product (4*f/h). A family that normalises attention's projections per head (its
    `normed_projection_width`: Qwen3's q and k) adds those norms' inputs and outputs (2 units of
    the width, 3 in 16-bit: the upcast), sharded with the heads. A mixture of experts (pretrain/model/moe.py) runs SwiGLU on experts_per_token
    (k) copies of each token (4*k*f/h, sharded) and holds, on the whole gathered sequence even
    under sequence parallelism, the k gathered inputs and the k expert outputs (2*k) and the
    router's fp32 logits and probabilities (2 * num_experts elements, counted as h-dtype ones).
    Layer `index`'s MLP is the family's (`Family.moe_layer`): dense or the mixture, whose experts
    are `expert_ffn_hidden_size` wide. Selective recompute: `selective_layer_activation_elements`.
    """
    if layout.recompute == Recompute.SELECTIVE:
        return selective_layer_activation_elements(m, layout, index)
    h = m.hidden_size
    widths = family_of(m).attention_widths(m)  # Llama: q, output h (unless head_dim is set)
    attention = widths.queries + widths.keys + widths.values + 2.0 * widths.outputs
    norm_units = 2.0 if layout.precision == Precision.FP32 else 3.0
    replicated = 2 * norm_units * h
    moe = family_of(m).moe_layer(m, index)
    copies = m.experts_per_token if moe else 1
    inner = m.expert_ffn_hidden_size if moe else m.ffn_hidden_size
    sharded = (attention + 4.0 * copies * inner
               + norm_units * family_of(m).normed_projection_width(m)) / layout.tensor
    if layout.sequence_parallel:
        replicated /= layout.tensor
    if moe:
        replicated += 2.0 * copies * h + 2.0 * m.num_experts
    return replicated, sharded


def selective_layer_activation_elements(m: ModelConfig, layout: Layout,
                                        index: int = 0) -> tuple[float, float]:
    """(replicated, sharded) elements per token a decoder layer keeps under
    `model.activation_checkpointing: selective` (`pretrain.model.recompute`: the outputs of its
    matmuls and of attention saved, every other operator recomputed in backward): the layer's
    input (h; 1/tp of it under sequence parallelism, the checkpoint's input); the outputs of the
    row-parallel projections, o and down (h each, the whole sequence on each tensor rank: the
    reduction or reduce-scatter comes after the matmul; k down outputs under a mixture of
    experts, and the router's logits); sharded: the q, k and v projections (q + 2 kv), the
    attention output (q), SwiGLU's gate and up (2 f, k copies under a mixture of experts). The
    norms (the family's per-head ones too), rotary, silu and products are recomputed."""
    h = m.hidden_size
    widths = family_of(m).attention_widths(m)
    moe = family_of(m).moe_layer(m, index)
    copies = m.experts_per_token if moe else 1
    inner = m.expert_ffn_hidden_size if moe else m.ffn_hidden_size
    layer_input = h / layout.tensor if layout.sequence_parallel else float(h)
    replicated = layer_input + h + copies * h + (m.num_experts if moe else 0)
    sharded = (widths.queries + widths.keys + widths.values + widths.outputs
               + 2.0 * copies * inner) / layout.tensor
    return replicated, sharded


@dataclass
class MemoryBreakdown:
    """Per-GPU bytes of the heaviest pipeline stage (GiB in `to_gb`)."""

    stage: int
    parameters_count: int  # parameters this GPU's stage holds before ZeRO sharding
    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    host: float  # bytes kept in host memory by offload (per GPU)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    def to_gb(self) -> dict[str, float]:
        keys = ("params", "grads", "optimizer", "activations", "buffers", "host")
        out = {k: getattr(self, k) / GB for k in keys}
        out["total"] = self.total / GB
        return out


def stage_memory(m: ModelConfig, layout: Layout, stage: int, items: list[str], *,
                 ds: dict[str, Any] | None = None) -> MemoryBreakdown:
    """Per-GPU bytes of pipeline stage `stage` (its `items`) under DeepSpeed; `ds`: the run's
    resolved DeepSpeed JSON (None: the resolver's choices for an "auto" JSON)."""
    lay = layout
    n = stage_parameters(m, lay, items)
    p_b, g_b, o_b = bytes_per_param(lay)
    dp = lay.data * lay.context  # ZeRO shards over every replica: data x context ranks
    # ... and the routed experts over the expert-data ranks (`expert_partition`)
    part = expert_partition(m, lay, items)  # None: the experts' ranks are the dense ones'

    def zero(nbytes: float) -> float:  # one rank's ZeRO partition of the stage's `nbytes`
        return nbytes / dp if part is None else nbytes * part

    params, grads, optimizer = n * p_b, n * g_b, n * o_b
    host = 0.0
    bf16_optimizer = steps_with_bf16_optimizer(lay, ds)
    if bf16_optimizer:
        # the whole fp32 buffer the gradients are summed into, + the bf16 gradients kept to the
        # end of backward unless each is added and freed in its hook (immediate_grad_update)
        grads = n * (4 if immediate_grad_update(lay, ds) else p_b + 4)
        optimizer = n * 12.0  # fp32 master + Adam m + v, sharded below even at ZeRO 0
    muon = muon_parameters(m, lay, items)
    optimizer -= MUON_STATE_SAVING * muon  # one momentum for Muon's matrices, not Adam's two
    if lay.zero_stage >= 1 or bf16_optimizer:
        optimizer = zero(optimizer)
    if lay.zero_stage >= 2:
        grads = zero(grads)
    if lay.zero_stage >= 3:
        params = zero(params)
    if lay.offload_optimizer != "none":
        host += optimizer + (zero(n * 4) if lay.zero_stage >= 2 else 0)  # fp32 grad partition
        optimizer = 0.0
    if lay.offload_param != "none":
        host += params
        params = 0.0

    activations = stage_activations(m, lay, stage, items)

    buffers = 0.0
    if lay.zero_stage in (1, 2) or (lay.zero_stage == 0 and dp > 1):
        # gradient reduction bucket (BF16_Optimizer reduces its fp32 buffer)
        buffers += min(lay.reduce_bucket, n) * (4 if bf16_optimizer else g_b)
    if lay.zero_stage in (1, 2) or bf16_optimizer:
        buffers += min(lay.allgather_bucket, n) * p_b  # parameter all-gather after the step
    if lay.zero_stage == 3:
        # Gathered 16-bit parameters: DeepSpeed keeps up to stage3_max_live_parameters (1e9 by
        # default) of them, and parameters gathered in forward stay until their reuse in
        # backward (stage3_max_reuse_distance, also 1e9). Measured on CPU (bench/plan_memory.py):
        # about two gathered copies of a model under the limit; one layer at least.
        layer_full = largest_layer_on_gpu(m, lay, items) * p_b
        gathered = 2 * min(n, lay.max_live_parameters) * p_b
        buffers += max(gathered, 2 * layer_full) + min(lay.reduce_bucket, n) * g_b
    if lay.zero_stage >= 1 and lay.offload_optimizer == "none" and lay.precision != Precision.FP32 \
            and not bf16_optimizer:
        buffers += zero(n * 4)  # fp32 gradient partition the optimizer steps on
    buffers += fp8_buffers(m, lay)
    buffers += expert_dispatch_buffers(m, lay)
    # Muon's step comes after backward has freed the activations: only what exceeds them
    buffers += max(0.0, muon_step_bytes(m, lay, items, flat_group=lay.zero_stage in (1, 2))
                   - activations)
    return MemoryBreakdown(stage=stage, parameters_count=n, params=params, grads=grads,
                           optimizer=optimizer, activations=activations, buffers=buffers,
                           host=host)


def expert_partition(m: ModelConfig, layout: Layout, items: list[str]) -> float | None:
    """The fraction of a stage's per-GPU parameters (`stage_parameters`) in one rank's ZeRO
    partition: the dense ones over the data x context ranks, the routed experts
    (`stage_expert_parameters`) over the expert-data ranks (`arithmetic.expert_data_size`: a
    stage's ranks / (expert x expert_tensor), fewer than the data ranks where the expert ranks
    are taken from them). None where the two are the same ranks (1 / (data x context))."""
    n = stage_parameters(m, layout, items)
    experts = stage_expert_parameters(m, layout, items)
    if not n or not experts or expert_data_size(layout) == layout.data * layout.context:
        return None
    return partitioned_parameters(layout, n, experts) / n


def expert_dispatch_buffers(m: ModelConfig, layout: Layout) -> float:
    """Bytes of expert parallelism's all-to-all in flight (one MoE layer's at a time): the
    dispatch's send and receive buffers of this rank's routed rows (its 1/tp share of the
    micro-batch's tokens, experts_per_token rows each, hidden wide; a balanced router), the
    combine reusing them. 0 without expert parallelism (no all-to-all)."""
    if layout.expert == 1 or not m.num_experts:
        return 0.0
    act_bytes = 4 if layout.precision == Precision.FP32 else 2
    rows = layout.micro_batch * m.seq_length / layout.context / layout.tensor \
        * m.experts_per_token
    return 2.0 * rows * m.hidden_size * act_bytes


# bytes per parameter Muon's matrices save against AdamW: one fp32 momentum, not two moments
MUON_STATE_SAVING = 4


def muon_parameters(m: ModelConfig, layout: Layout, items: list[str]) -> int:
    """Parameters of the matrices Muon steps (`train.optimizer: muon`) that one GPU of this
    stage holds before ZeRO sharding (its tensor-parallel shard); 0 under AdamW."""
    if layout.optimizer != "muon":
        return 0
    if expert_share(layout) != 1:  # fewer experts on the GPU than 1/tp of each
        return int(sum(layer_projection_elements_on_gpu(m, layout, i)
                       for i in layer_indices(items)))
    return sum(r * c for i in layer_indices(items)
               for r, c in layer_projection_shapes(m, i)) // layout.tensor


def muon_step_bytes(m: ModelConfig, layout: Layout, items: list[str], *,
                    flat_group: bool) -> float:
    """Transient bytes of Muon's step (`pretrain.training.muon`): the Nesterov update gathered
    whole in fp32 - the stage's whole flat group of hidden matrices at once where DeepSpeed's
    ZeRO-1/2 partitions it (`flat_group`), else one matrix at a time (tensor-parallel or
    ZeRO-3/FSDP2 shards; none unsharded) - and Newton-Schulz's bf16 workspace on the largest
    matrix (r x c, r the shorter side): X and B X (r c each), A and B (r^2 each)."""
    n = muon_parameters(m, layout, items)
    if not n:
        return 0.0
    rows, cols = largest_matrix(m, layer_projection_shapes)
    short = min(rows, cols)
    workspace = 2 * (2 * rows * cols + 2 * short * short)
    sharded = layout.tensor > 1 or layout.zero_stage >= 1 or layout.engine == "fsdp2"
    gathered = n * 4 if flat_group else (rows * cols * 4 if sharded else 0)
    return gathered + workspace


def fp8_buffers(m: ModelConfig, layout: Layout) -> float:
    """Bytes of `train.fp8`'s casts in flight (`pretrain.model.fp8`): torchao casts each block
    projection's weight to e4m3 (1 byte an element) for its matmul, one decoder layer's at a time
    at most, with its scales (one fp32 per tensor under tensorwise; per row and per column
    under rowwise, whose backward casts along the other dimension). The inputs' casts are the
    size of activations the layer already saves (not counted); the parameters and the saved
    activations stay in the run's precision."""
    if layout.fp8 == "none":
        return 0.0
    # the layer with the most FP8 weights (a family may mix dense and mixture layers)
    matrices = max((layer_projection_shapes(m, i) for i in range(m.num_layers)),
                   key=lambda shapes: sum(r * c for r, c in shapes))
    weights = sum(r * c for r, c in matrices) / layout.tensor
    if expert_share(layout) != 1:  # the heaviest layer's experts: this GPU's share of them
        weights = max(layer_projection_elements_on_gpu(m, layout, i)
                      for i in range(m.num_layers))
    scales = (len(matrices) if layout.fp8 == "tensorwise"
              else sum(r + c for r, c in matrices) / layout.tensor)
    return weights * 1.0 + scales * 4.0


def micro_batches_in_flight(layout: Layout, rank: int) -> float:
    """Micro-batches whose activations pipeline rank `rank` holds at its peak, in units of one
    micro-batch through all of the rank's layers (its virtual stages' together), as
    `torch.distributed.pipelining`'s schedules order their actions (a stage's activations are
    counted held until its weight gradients are computed):

    - DeepSpeed's pipeline and `1f1b`: pp - rank (all of them if fewer);
    - `interleaved_1f1b` and `zero_bubble` (v virtual stages): torch's warm-up runs
      (v - 1) pp + 2 (pp - 1 - rank) forwards of one stage, and one more before the first
      backward: ((v - 1) pp + 2 (pp - 1 - rank) + 1) / v, at most the step's micro-batches;
      the zero-bubble variant's weight gradients, deferred, hold pp on every rank instead;
    - `zbv`: pp on every rank (1F1B's peak, balanced: the V's two stages);
    - `dualpipe_v`: pp + 1/2 (one stage's micro-batch more, DeepSeek's "PP + 1" of a half).

    `bench/pipeline_bubble.py` replays torch's own action lists and measures the peaks."""
    p, m, v = layout.pipeline, layout.grad_accum, layout.virtual_stages
    if layout.engine != "fsdp2" or layout.schedule == "1f1b":
        return float(min(p - rank, m))
    if layout.schedule == "interleaved_1f1b":
        return min((v - 1) * p + 2 * (p - 1 - rank) + 1, v * m) / v
    if layout.schedule in ("zero_bubble", "zbv"):
        return float(min(p, m))
    return min(p + 0.5, float(m))  # dualpipe_v


def stage_activations(m: ModelConfig, layout: Layout, stage: int, items: list[str]) -> float:
    """Bytes of activations one GPU of pipeline stage `stage` (its `items`) holds at the peak:
    the micro-batches its schedule keeps in flight (`micro_batches_in_flight`), recomputation's workspace, the loss's logits. The
    model's own code saves them, whichever engine shards its weights."""
    lay = layout
    act_bytes = 4 if lay.precision == Precision.FP32 else 2
    # context parallelism: a rank holds T/context tokens of every activation (attention's
    # q, k, v and output after the all-to-all: T tokens of heads/context, the same elements)
    tokens = lay.micro_batch * m.seq_length / lay.context
    in_flight = micro_batches_in_flight(lay, stage)
    indices = layer_indices(items)
    layers = len(indices)
    # each layer's saved activations (a family may mix dense and mixture layers)
    kept = [layer_activation_elements(m, lay, i) for i in indices]
    full = [sum(elements) * tokens * act_bytes for elements in kept]
    full_layer = mean(full)  # the stage's mean layer
    layer_input = m.hidden_size * tokens * act_bytes / (lay.tensor if lay.sequence_parallel else 1)
    recomputed = layout_recomputed_layers(lay, layers)
    per_micro = recomputed * layer_input + (layers - recomputed) * full_layer
    # all-gather context parallelism: + the whole sequence's K and V each layer keeps
    gathered = gathered_kv_bytes(m, lay)  # 0 otherwise (`plan.context`)
    per_micro += (layers - recomputed) * gathered
    # + recomputation's workspace: one (the largest) layer's activations while it runs forward
    activations = in_flight * per_micro + (max(full) + gathered if recomputed else 0.0)
    if lay.recompute == Recompute.SELECTIVE and layers:
        # what selective recompute rebuilds of one layer in its backward, beside what it kept
        whole = [sum(layer_activation_elements(m, replace(lay, recompute=Recompute.NONE), i))
                 for i in indices]
        activations += max(w - sum(k) for w, k in zip(whole, kept)) * tokens * act_bytes
    if "embed" in items:
        activations += in_flight * layer_input
    # the head's logits shard in the compute dtype + fp32 softmax of the loss: the main head's,
    # and each multi-token prediction module's (kept until the backward) with its joined input
    # (embedding and hidden state, 2h) and projection
    heads = ("head" in items) + items.count("mtp")
    vocab = m.padded_vocab_size(lay.tensor) // lay.tensor
    activations += heads * (tokens * vocab * (act_bytes + 4) + tokens * m.hidden_size * act_bytes)
    activations += items.count("mtp") * tokens * 3 * m.hidden_size * act_bytes
    return activations


# ---- train.engine: fsdp2 --------------------------------------------------------------------

def check_fsdp2_layout(m: ModelConfig, layout: Layout) -> None:
    """ConfigError for what fsdp2 does not run (the rules `pretrain.resolve.fsdp2_rules` applies to a
    run config, and what torch's schedules refuse), so that no plan is made of it."""
    refusals = layout_refusals(
        num_experts=m.num_experts,
        fp16=layout.precision == Precision.FP16,
        zero_stage=layout.zero_stage, offload=[layout.offload_optimizer, layout.offload_param],
        where="the DeepSpeed config", expert=layout.expert, tensor=layout.tensor,
        expert_tensor=layout.expert_tensor, fp8=layout.fp8, optimizer=layout.optimizer)
    if layout.pipeline > 1:
        refusals += pipeline_refusals(layout)
    raise_refusals(refusals)


def pipeline_refusals(layout: Layout) -> list[str]:
    """Why fsdp2's pipeline cannot run `layout`'s schedule: `fsdp2_rules.check_fsdp2`'s rules
    of a layout (zero-bubble schedules under ZeRO-3) and the micro-batch counts
    torch's schedules take (DualPipeV: at least the stages; the interleaved ones: a multiple of
    their rounds, max(1, micro-batches // pp))."""
    p, micro, schedule = layout.pipeline, layout.grad_accum, layout.schedule
    refusals = []
    if schedule in SPLIT_BACKWARD and reshards_after_forward(layout.zero_stage):
        refusals.append(f"parallel.pipeline_schedule={schedule} with ZeRO stage 3: the "
                        "zero-bubble schedules need the weights kept gathered from forward to "
                        "backward (a ZeRO-1/2 JSON)")
    return refusals + micro_batch_refusals(schedule=schedule, pipeline=p,
                                           virtual_stages=layout.virtual_stages,
                                           micro_batches=micro)


def fsdp2_units(m: ModelConfig, layout: Layout, items: list[str]) -> tuple[int, int, int]:
    """(parameters of one decoder-layer unit, of the root unit, layer units) on one GPU before
    sharding: its tensor-parallel shard of each."""
    indices = layer_indices(items)
    root = stage_parameters(m, layout, items) - sum(layer_on_gpu(m, layout, i) for i in indices)
    return largest_layer_on_gpu(m, layout, items), root, len(indices)


def fsdp2_shard_ranks(layout: Layout) -> int:
    """The ranks each FSDP2 unit is sharded over: the data x context ranks, or under HSDP
    (`train.fsdp2_replicas`) those of one replica group."""
    return layout.data * layout.context // layout.fsdp2_replicas


def fsdp2_expert_shard_ranks(layout: Layout) -> int:
    """The ranks the routed experts' FSDP2 shards are split over: the expert-data ranks (those
    holding the same experts, `arithmetic.expert_data_size`), of one replica group under HSDP
    where its replica groups divide them; the data x context shard group's
    (`fsdp2_shard_ranks`) where the expert ranks are the tensor ranks or there are none."""
    ranks = expert_data_size(layout)
    if ranks == layout.data * layout.context:
        return fsdp2_shard_ranks(layout)
    return ranks // layout.fsdp2_replicas if ranks % layout.fsdp2_replicas == 0 else ranks


def fsdp2_offloads(layout: Layout) -> bool:
    """CPUOffloadPolicy: either offload of the DeepSpeed JSON on cpu (`fsdp2_rules`)."""
    return "cpu" in (layout.offload_optimizer, layout.offload_param)


def fsdp2_gathered_bytes(m: ModelConfig, layout: Layout, items: list[str]) -> float:
    """Unsharded parameters (compute dtype) at the peak: the root unit's, gathered for the whole
    forward and again for the whole backward; the layer units kept gathered (1, the one
    computing, when resharded after forward (ZeRO-3's JSON); every layer from its forward to its
    backward otherwise, and in a pipeline, where torch keeps every unit gathered from its first
    backward to the step's last (`reshard_after_backward` off)); and one more layer's
    all-gather output: forward keeps the computing unit's until the next unit's copy-out,
    backward prefetches the next unit's. Under `train.fp8: tensorwise` the block projections
    are all-gathered in FP8 (1 byte an element, torchao's FP8 all-gather)."""
    layer, root, layers = fsdp2_units(m, layout, items)
    kept = 1 if layout.zero_stage == 3 and layout.pipeline == 1 else layers
    layer_bytes = layer * _compute_bytes(layout)
    if layout.fp8 == "tensorwise":
        fp8 = mean_projection_elements_on_gpu(m, layout)
        layer_bytes -= fp8 * (_compute_bytes(layout) - 1)
    return root * _compute_bytes(layout) + (kept + 1) * layer_bytes


def fsdp2_gradients_in_flight(m: ModelConfig, layout: Layout, items: list[str]) -> float:
    """Unsharded gradients at the peak (the start of backward, the activations all held): the
    root unit's first ones, the head's and the final norm's, which wait for the embedding's at
    the end of backward to be reduced with them (the embedding's come when the activations are
    gone: not counted); one layer's being computed, and its fp32 reduce-scatter input, which
    FSDP2 keeps until the next unit's reduce-scatter. In a pipeline torch turns the gradient
    reduction off until the step's last backward: every parameter of the rank keeps its
    unsharded gradient, accumulated in fp32 (the reduce dtype)."""
    layer, _, _ = fsdp2_units(m, layout, items)
    if layout.pipeline > 1:
        return stage_parameters(m, layout, items) * 4.0
    head = m.padded_vocab_size(layout.tensor) // layout.tensor * m.hidden_size + m.hidden_size
    return (head + layer) * _compute_bytes(layout) + layer * 4


def _compute_bytes(layout: Layout) -> int:
    return 4 if layout.precision == Precision.FP32 else 2


def fsdp2_stage_memory(m: ModelConfig, layout: Layout, items: list[str], *,
                       stage: int = 0) -> MemoryBreakdown:
    """Per-GPU bytes under train.engine: fsdp2 of pipeline rank `stage` (its `items`: its
    stages' specs together)."""
    check_fsdp2_layout(m, layout)
    n = stage_parameters(m, layout, items)
    ranks = fsdp2_shard_ranks(layout)
    experts = stage_expert_parameters(m, layout, items)
    expert_ranks = fsdp2_expert_shard_ranks(layout)
    optimizer_bytes = 8 * n - MUON_STATE_SAVING * muon_parameters(m, layout, items)
    params, grads, optimizer = 4 * n / ranks, 4 * n / ranks, optimizer_bytes / ranks
    if experts and expert_ranks != ranks:  # the routed experts' shards over their own ranks
        moved = experts * (1 / expert_ranks - 1 / ranks)
        params, grads, optimizer = params + 4 * moved, grads + 4 * moved, optimizer + 8 * moved
    host = 0.0
    if fsdp2_offloads(layout):
        host, params, grads, optimizer = params + grads + optimizer, 0.0, 0.0, 0.0
    activations = stage_activations(m, layout, stage, items)
    buffers = fsdp2_gathered_bytes(m, layout, items) + fsdp2_gradients_in_flight(m, layout, items)
    buffers += fp8_buffers(m, layout)
    buffers += max(0.0, muon_step_bytes(m, layout, items, flat_group=False) - activations)
    return MemoryBreakdown(stage=stage, parameters_count=n, params=params, grads=grads,
                           optimizer=optimizer, activations=activations,
                           buffers=buffers, host=host)
