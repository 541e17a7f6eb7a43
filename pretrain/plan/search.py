"""Plan one layout (`estimate`) or rank every layout of a cluster that fits (`search`).

`estimate(model, layout, cluster)` checks the layout with the stack's rulebook
(`pretrain.resolve.layout.check_layout`), then combines the memory model (`pretrain.plan.memory`) and the
time model (`pretrain.plan.step_time`) into a `Plan`: per-GPU memory of the heaviest stage,
step time, tokens/s, model FLOPs utilisation (MFU) and hardware FLOPs utilisation (HFU, counting
recomputation). `engine` is the run's `train.engine`: DeepSpeed's, or FSDP2's sharding of the
same layout (its ZeRO stage and offload read from the DeepSpeed JSON as `pretrain.resolve.fsdp2_rules`
reads them).
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pretrain.arithmetic import stage_items
from pretrain.config import Engine, ModelConfig, Precision, Recompute
from pretrain.errors import ConfigError
from pretrain.resolve.layout import Layout, check_expert_grid_engine, check_layout, expert_grid
from pretrain.plan.clusters import MEMORY_USABLE_FRACTION, Cluster
from pretrain.plan.memory import GB, MemoryBreakdown, fsdp2_stage_memory, stage_memory
from pretrain.plan.step_time import TimeBreakdown, estimate_time


@dataclass
class Plan:
    layout: Layout
    cluster: Cluster
    memory: MemoryBreakdown  # heaviest stage
    time: TimeBreakdown
    tokens_per_s: float
    model_tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    mfu: float
    hfu: float
    fits: bool
    memory_limit_gb: float
    stages: list[dict[str, Any]] = field(default_factory=list)
    engine: Engine = Engine.DEEPSPEED  # train.engine the plan models

    def to_dict(self) -> dict[str, Any]:
        lay = asdict(self.layout)
        lay.update(recompute=self.layout.recompute.value, precision=self.layout.precision.value,
                   grad_accum=self.layout.grad_accum, world_size=self.layout.world_size)
        t = asdict(self.time)
        t["step"] = self.time.step
        return {"engine": self.engine.value, "layout": lay, "cluster": asdict(self.cluster),
                "memory_gb": {"stage": self.memory.stage, **self.memory.to_gb()},
                "time_s": t, "tokens_per_s": self.tokens_per_s,
                "model_tflops_per_gpu": self.model_tflops_per_gpu,
                "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu, "mfu": self.mfu,
                "hfu": self.hfu, "fits": self.fits, "memory_limit_gb": self.memory_limit_gb,
                "stages": self.stages}


def estimate(model: ModelConfig, layout: Layout, cluster: Cluster, *,
             engine: Engine = Engine.DEEPSPEED, ds: dict[str, Any] | None = None) -> Plan:
    """Memory and time of `layout` under `engine`; raises ConfigError if the layout is invalid
    (or one `engine` does not run). `ds`: the run's resolved DeepSpeed JSON, whose gradient
    dtypes and bf16 settings DeepSpeed follows; None (a search's layouts) plans what the
    resolver fills into the shipped JSONs' "auto". The layout is planned as `engine` runs it
    (its `engine` field set: whose pipeline, DeepSpeed's 1F1B or fsdp2's schedule)."""
    layout = replace(layout, engine=Engine(engine).value)
    check_layout(model, layout)
    check_expert_grid_engine(layout)  # what the run refuses once its DeepSpeed JSON is read
    stages = stage_items(model, layout)
    if engine is Engine.FSDP2:
        memories = [fsdp2_stage_memory(model, layout, items, stage=s)
                    for s, items in enumerate(stages)]
    else:
        memories = [stage_memory(model, layout, s, items, ds=ds)
                    for s, items in enumerate(stages)]
    worst = max(memories, key=lambda mem: mem.total)
    times, model_flops, hw_flops = estimate_time(model, layout, cluster, stages, engine=engine,
                                                 ds=ds)
    step = times.step
    peak = cluster.peak_tflops * 1e12
    limit = cluster.gpu_memory_gb * MEMORY_USABLE_FRACTION
    return Plan(layout=layout, cluster=cluster, memory=worst, time=times,
                tokens_per_s=layout.global_batch * model.seq_length / step,
                model_tflops_per_gpu=model_flops / step / 1e12,
                hardware_tflops_per_gpu=hw_flops / step / 1e12,
                mfu=model_flops / step / peak, hfu=hw_flops / step / peak,
                fits=worst.total / GB <= limit, memory_limit_gb=limit, engine=engine,
                stages=[{"stage": s, "layers": items.count("layer"),
                         "embedding": "embed" in items, "head": "head" in items,
                         "memory_gb": round(mem.total / GB, 3)}
                        for s, (items, mem) in enumerate(zip(stages, memories))])


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# What `pretrain plan --search` keeps free beyond the planner's count: bf16 runs measured peaks
# up to 1.19x the predicted one (ZeRO-2/3, states + activations + buffers; BENCHMARKS.md,
# "Predicted vs measured peak memory per rank"), an overhead the model does not explain yet.
DEFAULT_MEMORY_MARGIN = 0.20
MEMORY_MARGIN_REASON = "bf16 runs measured up to 1.19x the predicted peak"


def keeps_margin(plan: Plan, margin: float) -> bool:
    """Whether `plan` still fits its GPUs' usable memory if the real peak is (1 + margin) x
    the predicted one."""
    return plan.memory.total / GB * (1 + margin) <= plan.memory_limit_gb


def check_margin(margin: float) -> float:
    if not 0 <= margin < 1:
        raise ConfigError(f"memory margin {margin}: give a fraction of the predicted memory "
                          f"in [0, 1), e.g. {DEFAULT_MEMORY_MARGIN} for "
                          f"{DEFAULT_MEMORY_MARGIN:.0%}")
    return margin


def search(model: ModelConfig, cluster: Cluster, *, global_batch: int,
           precision: Precision = Precision.BF16, micro_batches: tuple[int, ...] = (1, 2, 4, 8),
           allow_offload: bool = True,
           engines: set[tuple[int, str, str]] | None = None,
           contexts: tuple[int, ...] | None = None, memory_margin: float = 0.0,
           engine: Engine = Engine.DEEPSPEED, fp8: str = "none",
           optimizer: str = "adamw", step_checkpoints: bool = False) -> list[Plan]:
    """Every valid layout of `cluster.world_size` GPUs that fits with `memory_margin` to spare
    (`keeps_margin`) under `engine`, fastest first.

    TP stays inside a node (powers of two dividing the GPUs per node), and so does TP x context
    (context parallelism, powers of two; `contexts`: the sizes to consider, by default
    `default_contexts`); PP divides the world;
    ZeRO 0-3 (0/1 with pipelines), optimizer offload to CPU from ZeRO 1, parameter offload with
    ZeRO 3, recompute none/full, sequence parallelism whenever tp > 1 (it only saves memory),
    and for a mixture of experts every expert layout of a stage's ranks (`expert_layouts`:
    expert and expert_tensor).
    `engines`: only these (ZeRO stage, optimizer offload, parameter offload) triples (the CLI
    passes those a shipped DeepSpeed JSON selects). Under fsdp2: no ZeRO 0 nor what its
    pipelines refuse (`memory.check_fsdp2_layout`), and ZeRO-1 only where no ZeRO-2 JSON
    of the same offload is allowed (both mean the same FSDP2); HSDP's replica groups as
    `hsdp_replicas` gives them; a pipeline under each of `pipeline_schedules`' schedules.
    `fp8` and `optimizer` (the run's train.fp8 and train.optimizer) are kept, not searched.
    `step_checkpoints`: the run saves step checkpoints (checkpoint.save_interval), which the
    expert grid (expert ranks beyond the tensor group) cannot resume yet under DeepSpeed: those
    layouts skipped (fsdp2's resume).
    """
    check_margin(memory_margin)
    world = cluster.world_size
    base = Layout(precision=precision, global_batch=global_batch, engine=Engine(engine).value,
                  fp8=fp8, optimizer=optimizer)
    plans = []
    tps = [t for t in _divisors(cluster.gpus_per_node) if t & (t - 1) == 0]
    if contexts is None:
        contexts = default_contexts(model, cluster)
    cps = [c for c in _divisors(cluster.gpus_per_node) if c & (c - 1) == 0 and c in contexts]
    for tp, pp, cp in itertools.product(tps, _divisors(world), cps):
        if world % (tp * pp * cp) or pp > model.num_layers or tp * cp > cluster.gpus_per_node:
            continue
        dp = world // (tp * pp * cp)
        for mbs, stage, offload, recompute, (ep, etp) in itertools.product(
                micro_batches, (0, 1, 2, 3), ("none", "opt", "opt+param"),
                (Recompute.NONE, Recompute.FULL), expert_layouts(model, tp, tp * cp * dp)):
            if offload != "none" and not allow_offload:
                continue
            if step_checkpoints and engine is not Engine.FSDP2 and expert_grid(replace(
                    base, tensor=tp, expert=ep, expert_tensor=etp)):
                continue
            layout = replace(base, tensor=tp, pipeline=pp, data=dp, context=cp, micro_batch=mbs,
                             expert=ep, expert_tensor=etp,
                             zero_stage=stage, recompute=recompute,
                             sequence_parallel=tp > 1,
                             offload_optimizer="none" if offload == "none" else "cpu",
                             offload_param="cpu" if offload == "opt+param" else "none")
            if engines is not None and engine_key(layout) not in engines:
                continue
            if engine is Engine.FSDP2 and stage == 1 and (
                    engines is None or engine_key(replace(layout, zero_stage=2)) in engines):
                continue
            for replicas, (schedule, virtual), kind in itertools.product(
                    hsdp_replicas(layout, cluster) if engine is Engine.FSDP2 else (1,),
                    pipeline_schedules(layout, engine), context_kinds(layout)):
                try:
                    plan = estimate(model, replace(layout, fsdp2_replicas=replicas,
                                                   schedule=schedule, virtual_stages=virtual,
                                                   context_kind=kind),
                                    cluster, engine=engine)
                except ConfigError:
                    continue
                if plan.fits and keeps_margin(plan, memory_margin):
                    plans.append(plan)
    plans.sort(key=lambda p: (-p.tokens_per_s, p.memory.total))
    return plans


# (parallel.pipeline_schedule, parallel.virtual_stages) a search tries for an fsdp2 pipeline
FSDP2_SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4),
                   ("zero_bubble", 1), ("zero_bubble", 2), ("zbv", 2), ("dualpipe_v", 2))


def pipeline_schedules(layout: Layout, engine: Engine) -> tuple[tuple[str, int], ...]:
    """The (schedule, virtual stages) a search tries for `layout`: DeepSpeed's 1F1B, or under
    fsdp2 with a pipeline each of `FSDP2_SCHEDULES` (those whose stages outnumber the layers,
    or whose micro-batches torch refuses, are skipped by `estimate`)."""
    if engine is not Engine.FSDP2 or layout.pipeline == 1:
        return (("1f1b", 1),)
    return FSDP2_SCHEDULES


def context_kinds(layout: Layout) -> tuple[str, ...]:
    """The `parallel.context_kind`s a search tries: with context parallelism, Ulysses'
    all-to-alls and the all-gather of keys and values (which runs where tensor x context does not
    divide the heads, Ulysses' limit; `estimate` skips what `check_context` refuses)."""
    return ("ulysses", "allgather") if layout.context > 1 else ("ulysses",)


def hsdp_replicas(layout: Layout, cluster: Cluster) -> tuple[int, ...]:
    """The HSDP replica-group counts a search tries under fsdp2: 1 (plain FSDP2) and each count
    that leaves shard groups of whole nodes' data x context ranks or of a part of one node, so
    that every group's gathers run inside nodes or across the fewest of them."""
    ranks = layout.data * layout.context
    per_node = max(1, cluster.gpus_per_node // layout.tensor)  # data x context ranks of a node
    return tuple(replicas for replicas in _divisors(ranks)
                 if replicas == 1 or (ranks // replicas) % per_node == 0
                 or per_node % (ranks // replicas) == 0)


def expert_layouts(model: ModelConfig, tensor: int,
                   stage_ranks: int) -> tuple[tuple[int, int], ...]:
    """The (parallel.expert, parallel.expert_tensor) pairs a search tries for a mixture of
    experts on a stage of `stage_ranks` ranks (tensor x context x data) with `tensor` ranks:
    (1, 0), every expert split over the tensor ranks as the dense MLP; and for each expert size
    ep > 1 dividing model.num_experts, whole experts (expert_tensor 0: settled to 1) where ep
    divides the stage's ranks, and experts split over the tensor ranks (expert_tensor = tensor,
    tensor > 1) where ep x tensor does. A dense model: (1, 0) only. Layouts the rulebook
    refuses (`check_experts`: today the expert ranks must be the tensor ranks) are skipped by
    `estimate`."""
    layouts = [(1, 0)]
    for ep in _divisors(model.num_experts)[1:] if model.num_experts else ():
        if stage_ranks % ep == 0:
            layouts.append((ep, 0))
        if tensor > 1 and stage_ranks % (ep * tensor) == 0:
            layouts.append((ep, tensor))
    return tuple(layouts)


LONG_CONTEXT = 16384  # tokens from which a search also tries context parallelism


def default_contexts(model: ModelConfig, cluster: Cluster) -> tuple[int, ...]:
    """The context-parallel sizes a search tries: only 1 below `LONG_CONTEXT` tokens (context
    parallelism only trades activation memory for all-to-alls), else every power of two up to
    the GPUs of a node."""
    if model.seq_length < LONG_CONTEXT:
        return (1,)
    return tuple(c for c in _divisors(cluster.gpus_per_node) if c & (c - 1) == 0)


def engine_key(layout: Layout) -> tuple[int, str, str]:
    """What a DeepSpeed JSON decides of a layout: ZeRO stage and the two offload devices."""
    return layout.zero_stage, layout.offload_optimizer, layout.offload_param


def minimum_memory_gb(model: ModelConfig, cluster: Cluster, *, precision: Precision) -> float:
    """Per-GPU memory of the most frugal layout (ZeRO-3, full offload, recompute, micro 1)."""
    layout = Layout(data=cluster.world_size, global_batch=cluster.world_size, zero_stage=3,
                    offload_optimizer="cpu", offload_param="cpu", recompute=Recompute.FULL,
                    precision=precision)
    return estimate(model, layout, cluster).memory.total / GB
