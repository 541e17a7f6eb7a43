"""The planner's model of memory: what one GPU of the heaviest pipeline stage holds.

Parameters, gradients and optimizer states by precision, ZeRO stage (sharded over data x
context ranks) and offload; activations by recompute mode, context parallelism (1/context of the
tokens per rank) and sequence parallelism (after Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models") with the micro-batches 1F1B keeps in flight (stage i
holds pp - i); and DeepSpeed's communication buffers.

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
(`fsdp2_gathered_bytes`, `fsdp2_gradients_in_flight`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pretrain.arithmetic import layer_parameters, layout_recomputed_layers, stage_parameters
from pretrain.config import ModelConfig, Precision
from pretrain.resolve.ds_config import gradient_dtypes, immediate_grad_update
from pretrain.resolve.fsdp2_rules import layout_refusals, raise_refusals
from pretrain.errors import ConfigError
from pretrain.families import family_of
from pretrain.resolve.layout import Layout

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


def layer_activation_elements(m: ModelConfig, layout: Layout) -> tuple[float, float]:
    """Activation elements one decoder layer saves for backward per token (micro-batch of one
    sample), split into (replicated over TP unless sequence parallel, sharded over TP).

    Korthikanti et al. count 34*s*b*h bytes for a GPT layer; for this Llama block (SDPA's fused
    attention keeps no s x s scores, no dropout, SwiGLU) the saved tensors are, in units of h
    elements of the activation dtype: replicated: the two RMSNorms' inputs and outputs (4; 6 in
    16-bit, where the norm saves its fp32 upcast); sharded: q (1), k and v (2*kv/h), the attention
    output (1) and the output projection's input (1) (q's width heads x head_dim; the widths are
    the family's `attention_widths`: DeepSeek-V3's keys as wide as its queries, its values and
    outputs heads x v_head_dim; its replicated latents are not counted), and SwiGLU's gate, up,
    silu(gate) and product (4*f/h). A mixture of experts (pretrain/model/moe.py) runs SwiGLU on experts_per_token
    (k) copies of each token (4*k*f/h, sharded) and holds, on the whole gathered sequence even
    under sequence parallelism, the k gathered inputs and the k expert outputs (2*k) and the
    router's fp32 logits and probabilities (2 * num_experts elements, counted as h-dtype ones).
    """
    h = m.hidden_size
    widths = family_of(m).attention_widths(m)  # Llama: q, output h (unless head_dim is set)
    attention = widths.queries + widths.keys + widths.values + 2.0 * widths.outputs
    replicated = (4.0 if layout.precision == Precision.FP32 else 6.0) * h
    copies = m.experts_per_token if m.num_experts else 1
    sharded = (attention + 4.0 * copies * m.ffn_hidden_size) / layout.tensor
    if layout.sequence_parallel:
        replicated /= layout.tensor
    if m.num_experts:
        replicated += 2.0 * copies * h + 2.0 * m.num_experts
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
    params, grads, optimizer = n * p_b, n * g_b, n * o_b
    host = 0.0
    bf16_optimizer = steps_with_bf16_optimizer(lay, ds)
    if bf16_optimizer:
        # the whole fp32 buffer the gradients are summed into, + the bf16 gradients kept to the
        # end of backward unless each is added and freed in its hook (immediate_grad_update)
        grads = n * (4 if immediate_grad_update(lay, ds) else p_b + 4)
        optimizer = n * 12.0  # fp32 master + Adam m + v, sharded below even at ZeRO 0
    if lay.zero_stage >= 1 or bf16_optimizer:
        optimizer /= dp
    if lay.zero_stage >= 2:
        grads /= dp
    if lay.zero_stage >= 3:
        params /= dp
    if lay.offload_optimizer != "none":
        host += optimizer + (n * 4 / dp if lay.zero_stage >= 2 else 0)  # fp32 grad partition
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
        sharded, replicated = layer_parameters(m)
        layer_full = (sharded // lay.tensor + replicated) * p_b
        gathered = 2 * min(n, lay.max_live_parameters) * p_b
        buffers += max(gathered, 2 * layer_full) + min(lay.reduce_bucket, n) * g_b
    if lay.zero_stage >= 1 and lay.offload_optimizer == "none" and lay.precision != Precision.FP32 \
            and not bf16_optimizer:
        buffers += n * 4 / dp  # fp32 gradient partition the optimizer steps on
    return MemoryBreakdown(stage=stage, parameters_count=n, params=params, grads=grads,
                           optimizer=optimizer, activations=activations, buffers=buffers,
                           host=host)


def stage_activations(m: ModelConfig, layout: Layout, stage: int, items: list[str]) -> float:
    """Bytes of activations one GPU of pipeline stage `stage` (its `items`) holds at the peak:
    the micro-batches 1F1B keeps in flight, recomputation's workspace, the loss's logits. The
    model's own code saves them, whichever engine shards its weights."""
    lay = layout
    act_bytes = 4 if lay.precision == Precision.FP32 else 2
    # context parallelism: a rank holds T/context tokens of every activation (attention's
    # q, k, v and output after the all-to-all: T tokens of heads/context, the same elements)
    tokens = lay.micro_batch * m.seq_length / lay.context
    in_flight = min(lay.pipeline - stage, lay.grad_accum)  # 1F1B: pp - stage, all if fewer
    layers = items.count("layer")
    rep, shard = layer_activation_elements(m, lay)
    full_layer = (rep + shard) * tokens * act_bytes
    layer_input = m.hidden_size * tokens * act_bytes / (lay.tensor if lay.sequence_parallel else 1)
    recomputed = layout_recomputed_layers(lay, layers)
    per_micro = recomputed * layer_input + (layers - recomputed) * full_layer
    # + recomputation's workspace: one layer's activations while it runs forward again
    activations = in_flight * per_micro + (full_layer if recomputed else 0.0)
    if "embed" in items:
        activations += in_flight * layer_input
    if "head" in items:  # logits shard in the compute dtype + fp32 softmax of the loss
        vocab = m.padded_vocab_size(lay.tensor) // lay.tensor
        activations += tokens * vocab * (act_bytes + 4) + tokens * m.hidden_size * act_bytes
    return activations


# ---- train.engine: fsdp2 --------------------------------------------------------------------

def check_fsdp2_layout(m: ModelConfig, layout: Layout) -> None:
    """ConfigError for what fsdp2 does not run (the rules `pretrain.resolve.fsdp2_rules` applies to a
    run config), so that no plan is made of it."""
    if layout.pipeline > 1:
        raise ConfigError(f"parallel.pipeline={layout.pipeline} under train.engine=fsdp2: the "
                          "planner does not model fsdp2's pipeline schedules (their bubble and "
                          "micro-batches in flight) yet; plan parallel.pipeline=1, or the "
                          "pipeline under train.engine=deepspeed")
    raise_refusals(layout_refusals(
        num_experts=m.num_experts,
        fp16=layout.precision == Precision.FP16,
        zero_stage=layout.zero_stage, offload=[layout.offload_optimizer, layout.offload_param],
        where="the DeepSpeed config"))


def fsdp2_units(m: ModelConfig, layout: Layout, items: list[str]) -> tuple[int, int, int]:
    """(parameters of one decoder-layer unit, of the root unit, layer units) on one GPU before
    sharding: its tensor-parallel shard of each."""
    sharded, replicated = layer_parameters(m)
    layer = sharded // layout.tensor + replicated
    layers = items.count("layer")
    return layer, stage_parameters(m, layout, items) - layers * layer, layers


def fsdp2_shard_ranks(layout: Layout) -> int:
    """The ranks each FSDP2 unit is sharded over: the data x context ranks, or under HSDP
    (`train.fsdp2_replicas`) those of one replica group."""
    return layout.data * layout.context // layout.fsdp2_replicas


def fsdp2_offloads(layout: Layout) -> bool:
    """CPUOffloadPolicy: either offload of the DeepSpeed JSON on cpu (`fsdp2_rules`)."""
    return "cpu" in (layout.offload_optimizer, layout.offload_param)


def fsdp2_gathered_bytes(m: ModelConfig, layout: Layout, items: list[str]) -> float:
    """Unsharded parameters (compute dtype) at the peak: the root unit's, gathered for the whole
    forward and again for the whole backward; the layer units kept gathered (1, the one
    computing, when resharded after forward (ZeRO-3's JSON); every layer from its forward to its
    backward otherwise); and one more layer's all-gather output: forward keeps the computing
    unit's until the next unit's copy-out, backward prefetches the next unit's."""
    layer, root, layers = fsdp2_units(m, layout, items)
    kept = 1 if layout.zero_stage == 3 else layers
    return (root + (kept + 1) * layer) * _compute_bytes(layout)


def fsdp2_gradients_in_flight(m: ModelConfig, layout: Layout, items: list[str]) -> float:
    """Unsharded gradients at the peak (the start of backward, the activations all held): the
    root unit's first ones, the head's and the final norm's, which wait for the embedding's at
    the end of backward to be reduced with them (the embedding's come when the activations are
    gone: not counted); one layer's being computed, and its fp32 reduce-scatter input, which
    FSDP2 keeps until the next unit's reduce-scatter."""
    layer, _, _ = fsdp2_units(m, layout, items)
    head = m.padded_vocab_size(layout.tensor) // layout.tensor * m.hidden_size + m.hidden_size
    return (head + layer) * _compute_bytes(layout) + layer * 4


def _compute_bytes(layout: Layout) -> int:
    return 4 if layout.precision == Precision.FP32 else 2


def fsdp2_stage_memory(m: ModelConfig, layout: Layout, items: list[str]) -> MemoryBreakdown:
    """Per-GPU bytes under train.engine: fsdp2 (one stage: fsdp2 runs no pipeline)."""
    check_fsdp2_layout(m, layout)
    n = stage_parameters(m, layout, items)
    ranks = fsdp2_shard_ranks(layout)
    params, grads, optimizer = 4 * n / ranks, 4 * n / ranks, 8 * n / ranks
    host = 0.0
    if fsdp2_offloads(layout):
        host, params, grads, optimizer = params + grads + optimizer, 0.0, 0.0, 0.0
    buffers = fsdp2_gathered_bytes(m, layout, items) + fsdp2_gradients_in_flight(m, layout, items)
    return MemoryBreakdown(stage=0, parameters_count=n, params=params, grads=grads,
                           optimizer=optimizer, activations=stage_activations(m, layout, 0, items),
                           buffers=buffers, host=host)
