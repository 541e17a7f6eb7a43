"""The layout of a run and the one rulebook of which layouts the stack supports.

A `Layout` is how one training run is spread over `tensor * context * pipeline * data` ranks: the
parallel sizes, the batch arithmetic, the DeepSpeed engine's ZeRO stage, offload and buckets,
recomputation and sequence parallelism. `pretrain.resolve.run.resolve_layout` derives it, once per
process, from the run config and its `Topology` (the data-parallel size is computed there and
nowhere else); `check_layout(model, layout)` is the rulebook itself. Every caller asks the same
rules: the run's resolver (`pretrain.resolve.run`), the planner's search, and the model builders
(`check_tensor_split`, `check_pipeline_split`: the model's shape rules, `pretrain.families`). Every refusal is a ConfigError naming the field, its value and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass
from pretrain.config import ModelConfig, Precision, Recompute
from pretrain.errors import ConfigError
# the model's own shape rules, which the model checks itself; the layout applies them to a run
from pretrain.families import check_pipeline_split, check_tensor_split, family_of

DEEPSPEED_DEFAULT_BUCKET = 500_000_000  # reduce / allgather bucket elements when not configured


@dataclass(frozen=True)
class Layout:
    """How one training run is laid out over `tensor * context * pipeline * data` GPUs."""

    tensor: int = 1
    pipeline: int = 1
    data: int = 1
    micro_batch: int = 1
    global_batch: int = 1  # samples per optimizer step
    zero_stage: int = 0
    offload_optimizer: str = "none"  # none | cpu | nvme
    offload_param: str = "none"  # none | cpu | nvme (ZeRO 3)
    recompute: Recompute = Recompute.NONE
    recompute_interval: int = 1  # k of Recompute.EVERY_K
    sequence_parallel: bool = False
    precision: Precision = Precision.BF16
    partition: str = "parameters"  # pipeline stage partition (parallel.pipeline_partition)
    reduce_bucket: int = DEEPSPEED_DEFAULT_BUCKET  # elements (ZeRO 1/2 ipg, ZeRO 3 reduce)
    allgather_bucket: int = DEEPSPEED_DEFAULT_BUCKET  # elements (ZeRO 1/2), prefetch (ZeRO 3)
    max_live_parameters: int = 1_000_000_000  # ZeRO-3 stage3_max_live_parameters
    context: int = 1  # context-parallel ranks per sequence (parallel.context)
    context_kind: str = "ulysses"  # parallel.context_kind: ulysses (all-to-all) or allgather
    expert: int = 1  # expert-parallel ranks (parallel.expert)
    expert_tensor: int = 0  # ranks splitting each expert (parallel.expert_tensor; 0: the rule)
    fsdp2_replicas: int = 1  # train.fsdp2_replicas: HSDP replica groups of data x context ranks
    engine: str = "deepspeed"  # train.engine: whose pipeline (DeepSpeed's 1F1B or fsdp2's)
    schedule: str = "1f1b"  # parallel.pipeline_schedule (fsdp2's; DeepSpeed runs 1F1B)
    virtual_stages: int = 1  # parallel.virtual_stages: pipeline stages per rank
    fp8: str = "none"  # train.fp8: none | tensorwise | rowwise (the block projections' matmuls)
    optimizer: str = "adamw"  # train.optimizer: adamw | muon (the layers' matrices)

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline * self.context * self.data

    @property
    def deepspeed_batch(self) -> int:
        """DeepSpeed's `train_batch_size`: it counts every replica of a shard (data x context
        ranks) as data parallel, so each context rank's chunk of a sample counts once."""
        return self.global_batch * self.context

    @property
    def grad_accum(self) -> int:
        return self.global_batch // (self.micro_batch * self.data)

    def describe(self) -> str:
        off = [f"opt={self.offload_optimizer}"] if self.offload_optimizer != "none" else []
        off += [f"param={self.offload_param}"] if self.offload_param != "none" else []
        cp = f" cp{self.context}" if self.context > 1 else ""
        cp += " allgather" if self.context > 1 and self.context_kind == "allgather" else ""
        cp += f" ep{self.expert}" if self.expert > 1 else ""
        cp += f" etp{self.expert_tensor}" if self.expert > 1 and self.expert_tensor > 1 else ""
        cp += f" hsdp{self.fsdp2_replicas}" if self.fsdp2_replicas > 1 else ""
        if self.pipeline > 1 and (self.schedule != "1f1b" or self.virtual_stages > 1):
            cp += f" {self.schedule}" + (f" v{self.virtual_stages}"
                                         if self.virtual_stages > 1 else "")
        return (f"tp{self.tensor} pp{self.pipeline}{cp} dp{self.data} mbs{self.micro_batch} "
                f"ZeRO-{self.zero_stage}{' offload ' + ','.join(off) if off else ''} "
                f"recompute={self.recompute.value}{' sp' if self.sequence_parallel else ''}")


def planned_precision(precision: Precision) -> Precision:
    """The precision a layout is planned with: `auto` is bf16 on every GPU the planner knows
    (a run resolves `auto` on its own device before its layout is resolved)."""
    return Precision.BF16 if precision == Precision.AUTO else precision


def check_layout(model: ModelConfig, layout: Layout) -> None:
    """Raise ConfigError for a layout the stack would refuse."""
    lay = layout
    check_tensor_split(model, lay.tensor)
    check_pipeline_split(model, lay.pipeline, partition_method=lay.partition)
    check_batch(lay)
    check_context(model, lay)
    check_experts(model, lay)
    check_mtp(model, lay)
    if lay.sequence_parallel and lay.tensor == 1:
        raise ConfigError("parallel.sequence_parallel=True: needs parallel.tensor > 1 (set "
                          "parallel.sequence_parallel=false or raise parallel.tensor)")
    if lay.sequence_parallel and model.seq_length % lay.tensor:
        raise ConfigError(f"model.seq_length={model.seq_length}: must be divisible by "
                          f"parallel.tensor={lay.tensor} for sequence parallelism")
    if lay.pipeline > 1 and lay.recompute == Recompute.EVERY_K:
        raise ConfigError(f"model.activation_checkpointing={lay.recompute.value!r}: with "
                          "parallel.pipeline > 1 use none or full (DeepSpeed's pipeline "
                          "recomputes every decoder layer of a stage)")
    check_fsdp2_replicas(lay)
    check_engine(lay)


def check_mtp(model: ModelConfig, layout: Layout) -> None:
    """Multi-token prediction (`pretrain.model.mtp`) runs after the decoder with the
    model's embedding and head; under context parallelism each rank reads the tokens after its
    chunk from the next rank's (Ulysses' contiguous chunks: DeepSeek-V3's latent attention
    refuses all-gather context), at most a chunk ahead."""
    if not model.mtp_depth:
        return
    if layout.pipeline > 1:
        raise ConfigError(f"model.mtp_depth={model.mtp_depth} with parallel.pipeline="
                          f"{layout.pipeline}: not supported (the prediction modules need the "
                          "token embedding on the last stage, which the first stage holds); "
                          "set parallel.pipeline=1 or model.mtp_depth=0")
    chunk = model.seq_length // layout.context
    if layout.context > 1 and chunk < model.mtp_depth:
        raise ConfigError(f"model.mtp_depth={model.mtp_depth} with parallel.context="
                          f"{layout.context}: each rank's chunk of model.seq_length="
                          f"{model.seq_length} is {chunk} tokens, fewer than the modules read "
                          "ahead; lower parallel.context or model.mtp_depth")


def check_fsdp2_replicas(layout: Layout) -> None:
    """HSDP splits the data x context ranks into equal replica groups."""
    ranks, replicas = layout.data * layout.context, layout.fsdp2_replicas
    if ranks % replicas:
        raise ConfigError(
            f"train.fsdp2_replicas={replicas}: must divide the {ranks} data-parallel ranks "
            f"(data {layout.data} x context {layout.context}), which HSDP splits into equal "
            f"replica groups; choose a divisor of {ranks}, or 1 to shard over all of them")


def check_context(model: ModelConfig, layout: Layout) -> None:
    """Context parallelism. Ulysses: each of the tensor x context ranks of a sequence attends
    with whole query and kv heads over the whole sequence, and holds an equal contiguous chunk
    of it (of tensor x context tokens under sequence parallelism). All-gather: no head count
    rule (each rank keeps its tensor rank's heads and gathers the keys and values); the
    sequence is cut into 2 x context equal chunks, two per rank (head and tail)."""
    cp, tp = layout.context, layout.tensor
    if cp == 1:
        return
    if layout.context_kind == "allgather":
        _check_allgather(model, layout)
        return
    for name in ("num_heads", "num_kv_heads"):
        if getattr(model, name) % (tp * cp):
            raise ConfigError(
                f"parallel.context={cp}: model.{name}={getattr(model, name)} is not divisible by "
                f"parallel.tensor x parallel.context = {tp} x {cp} = {tp * cp} (the all-to-all "
                "gives each rank whole query and kv heads of the whole sequence)")
    shards = cp * (tp if layout.sequence_parallel else 1)
    if model.seq_length % shards:
        what = ("parallel.context x parallel.tensor (sequence parallelism splits each chunk "
                f"again) = {shards}" if shards != cp else f"parallel.context={cp}")
        raise ConfigError(f"model.seq_length={model.seq_length}: must be divisible by {what} "
                          "(equal contiguous chunks per rank)")
    if model.compile:
        raise ConfigError(f"model.compile=true with parallel.context={cp}: not supported yet "
                          "(the compiled decoder layers would hold the all-to-all of attention, "
                          "untested); set model.compile=false or parallel.context=1")


def _check_allgather(model: ModelConfig, layout: Layout) -> None:
    """All-gather context parallelism: 2 x context equal chunks of each sequence, and (under
    sequence parallelism) each rank's two of them split again over the tensor ranks."""
    cp, tp = layout.context, layout.tensor
    if model.seq_length % (2 * cp):
        raise ConfigError(f"model.seq_length={model.seq_length}: must be divisible by 2 x "
                          f"parallel.context = {2 * cp} with parallel.context_kind=allgather (each "
                          "rank holds a head and a tail chunk of every sequence)")
    if layout.sequence_parallel and (model.seq_length // cp) % tp:
        raise ConfigError(f"model.seq_length={model.seq_length}: each context rank's "
                          f"{model.seq_length // cp} tokens must be divisible by parallel.tensor="
                          f"{tp} for sequence parallelism with parallel.context_kind=allgather")
    widths = family_of(model).attention_widths(model)
    if widths.keys != widths.values or widths.cached != widths.keys + widths.values:
        raise ConfigError(f"parallel.context_kind=allgather with model.family={model.family}: "
                          "all-gather context gathers per-head keys and values of one width, and "
                          "this family's attention makes them from a latent (not built); use "
                          "parallel.context_kind=ulysses")
    if model.compile:
        raise ConfigError(f"model.compile=true with parallel.context={cp}: not supported yet "
                          "(the compiled decoder layers would hold the all-gather of attention, "
                          "untested); set model.compile=false or parallel.context=1")


def check_experts(model: ModelConfig, layout: Layout) -> None:
    """Expert parallelism: the expert ranks hold an equal number of experts each and exchange
    their tokens by all-to-all (dropless routing only). Either the tensor-parallel ranks hold
    whole experts (expert = tensor, expert_tensor 1: every engine, stage, pipeline and context
    layout), or the expert grid takes them from the data ranks too (`expert_grid_refusal`)."""
    ep, tp = layout.expert, layout.tensor
    if ep == 1:
        return
    if not model.num_experts:
        raise ConfigError(f"parallel.expert={ep}: the model has no experts (model.num_experts=0); "
                          "set parallel.expert=1 or model.num_experts")
    etp = layout.expert_tensor or 1  # 0: 1 at expert > 1
    if etp not in (1, tp):
        raise ConfigError(f"parallel.expert_tensor={etp}: must be 1 (whole experts) or "
                          f"parallel.tensor={tp} (each expert split like the dense MLP)")
    grid = not (ep == tp and etp == 1)  # the expert ranks are not the tensor group
    if grid:
        expert_grid_refusal(layout, ep=ep, etp=etp)
    if model.num_experts % ep:
        raise ConfigError(f"parallel.expert={ep}: must divide model.num_experts="
                          f"{model.num_experts} (each rank holds the same number of whole experts)")
    if model.moe_capacity_factor > 0:
        raise ConfigError(f"model.moe_capacity_factor={model.moe_capacity_factor} with "
                          f"parallel.expert={ep}: capacity is first come first served over the "
                          "whole micro-batch, which no rank sees; use the dropless router "
                          "(model.moe_capacity_factor=0) or parallel.expert=1")
    cp = layout.context
    chunks = (1 if etp > 1 else tp) if grid else ep  # ranks routing chunks of one sequence
    if model.seq_length % (chunks * cp):
        what = f"parallel.tensor={chunks}" if grid else f"parallel.expert={ep}"
        if cp > 1:
            what = f"parallel.expert x parallel.context = {ep} x {cp} = {ep * cp}"
        raise ConfigError(f"model.seq_length={model.seq_length}: must be divisible by {what} "
                          "(each expert rank routes an equal chunk of its context chunk)")
    if model.compile:
        raise ConfigError(f"model.compile=true with parallel.expert={ep}: not supported yet (the "
                          "token counts of the all-to-all are data-dependent: every step would "
                          "recompile); set model.compile=false or parallel.expert=1")


def expert_grid(layout: Layout) -> bool:
    """Whether the expert ranks go beyond the tensor group (`Topology.expert_groups`): expert
    > 1 and not (expert = tensor with whole experts)."""
    etp = layout.expert_tensor or (layout.tensor if layout.expert == 1 else 1)
    return layout.expert > 1 and not (layout.expert == layout.tensor and etp == 1)


def _grid_fix(layout: Layout) -> str:
    tp = layout.tensor
    return (f"use ds_configs/zero1.json or zero2.json, or the tensor ranks as expert ranks "
            f"(parallel.expert={tp}, parallel.expert_tensor=1)" if tp > 1 else
            "use ds_configs/zero1.json or zero2.json, or parallel.expert=1")


def check_expert_grid_engine(layout: Layout) -> None:
    """The expert grid's ZeRO stage: the experts' gradients are reduced and partitioned over
    the expert-data ranks through DeepSpeed's MoE parameter groups, which its ZeRO-1/2
    optimizer alone takes."""
    if not expert_grid(layout) or layout.engine != "deepspeed":
        return
    what = f"parallel.expert={layout.expert} (expert ranks beyond the tensor group)"
    if layout.zero_stage not in (1, 2):
        reason = ("DeepSpeed refuses MoE parameter groups at ZeRO-3" if layout.zero_stage == 3
                  else "ZeRO-0 all-reduces every gradient over the data group, experts included")
        fix = _grid_fix(layout)
        if layout.zero_stage == 3:  # fully sharded experts: fsdp2's unit over expert-data ranks
            fix = fix.replace("use ds_configs", "set train.engine=fsdp2 (the experts fully "
                              "sharded over their expert-data ranks), or use ds_configs", 1)
        raise ConfigError(f"zero_optimization.stage={layout.zero_stage} with {what}: {reason}; "
                          "the experts' gradients must be reduced over the ranks holding the "
                          f"same experts; {fix}")
    if layout.zero_stage == 1 and layout.precision is Precision.BF16:
        raise ConfigError(f"bf16 at ZeRO-1 with {what}: DeepSpeed steps it with its BF16_Optimizer, "
                          "whose gradients the engine all-reduces over the data group, experts "
                          "included; use ds_configs/zero2.json (or train.precision=fp32)")


def expert_grid_refusal(layout: Layout, *, ep: int, etp: int) -> None:
    """The layouts the expert grid (expert ranks beyond the tensor group) cannot run yet, each
    refused with its reason (its ZeRO stage under DeepSpeed: `check_expert_grid_engine`; fsdp2
    shards the experts over their expert-data ranks at any ZeRO stage of its JSON)."""
    tp, what = layout.tensor, f"parallel.expert={ep} x parallel.expert_tensor={etp}"
    fix = _grid_fix(layout)
    if layout.engine == "fsdp2" and layout.fsdp2_replicas > 1:
        raise ConfigError(f"train.fsdp2_replicas={layout.fsdp2_replicas} with {what} (expert "
                          "ranks beyond the tensor group): the experts are sharded over their "
                          "expert-data ranks, not over HSDP's replica x shard mesh; set "
                          "train.fsdp2_replicas=1")
    if layout.pipeline > 1 and layout.engine == "deepspeed":
        raise ConfigError(f"parallel.pipeline={layout.pipeline} with {what} (expert ranks beyond "
                          "the tensor group): DeepSpeed's pipeline engine takes no MoE parameter "
                          f"groups; set train.engine=fsdp2 or parallel.pipeline=1, or "
                          f"{fix.split(', or ')[-1]}")
    if etp == 1 and ep % tp:
        raise ConfigError(f"{what} with parallel.tensor={tp}: whole experts on expert ranks "
                          "that do not span whole tensor groups; set parallel.expert to a "
                          f"multiple of {tp}, or parallel.expert_tensor={tp}")


def check_batch(layout: Layout) -> None:
    """The global batch must be a whole number of micro-batches on every data-parallel rank."""
    per_step = layout.micro_batch * layout.data
    if layout.global_batch % per_step == 0:
        return
    raise ConfigError(f"train.global_batch_size={layout.global_batch} is not a multiple of "
                      f"train.micro_batch_size x data-parallel size = {layout.micro_batch} x "
                      f"{layout.data} = {per_step}: set it to a multiple of {per_step}")


def check_engine(layout: Layout) -> None:
    """What DeepSpeed refuses, or silently gets wrong, in a ZeRO stage / offload combination."""
    lay, stage = layout, layout.zero_stage
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_optimization.stage={stage} must be 0, 1, 2 or 3")
    if lay.pipeline > 1 and stage > 1 and lay.engine == "deepspeed":
        raise ConfigError(f"ZeRO stage {stage} with parallel.pipeline={lay.pipeline}: DeepSpeed "
                          "pipelines support ZeRO 0 or 1 only (gradients must stay whole across "
                          "micro-batches); use ds_configs/zero1.json")
    if "nvme" in (lay.offload_optimizer, lay.offload_param) and stage != 3:
        raise ConfigError(f"NVMe offload needs ZeRO stage 3 (stage {stage} accepts it but does "
                          "no NVMe I/O); use ds_configs/zero3_offload_nvme.json")
    if lay.offload_param != "none" and stage != 3:
        raise ConfigError(f"offload_param needs ZeRO stage 3, got stage {stage}")
    if lay.offload_optimizer != "none" and stage == 0:
        raise ConfigError("offload_optimizer needs ZeRO stage 1 or more, got stage 0")
