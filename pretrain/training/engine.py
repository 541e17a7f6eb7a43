"""The DeepSpeed engine of a run: the model for its layout, its initial weights, the optimizer's
parameter groups and learning-rate schedule, and `deepspeed.initialize`; the (inputs, labels)
pairs the engine takes from the loader's batches, and the flat engine's loss of one.

DeepSpeed owns sharding (ZeRO), mixed precision, gradient accumulation and clipping; the
schedule is ours (`schedule_factor`: train.lr_schedule), so the DeepSpeed config carries no
"scheduler".
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import deepspeed
import torch

from pretrain.training import deepspeed_imports
from pretrain.config import (DecayShape, Engine, LRSchedule, ModelConfig, Optimizer, RunConfig,
                             TrainConfig)
from pretrain.checkpoint import load_initial_weights
from pretrain.resolve.ds_config import zero_stage
from pretrain.training.fsdp2 import FSDP2Engine, build_fsdp2_engine
from pretrain.log import log
from pretrain.training import muon
from pretrain.training.metrics import global_grad_norm
from pretrain.model import (ModelForm, build_for_layout, compile_blocks,
                            defer_sequence_parallel_grads, tensor_parallel_group)
from pretrain.model.expert_parallel import ExpertGroups, expert_groups_of
from pretrain.model.moe import expert_group_name
from pretrain.model.mup import describe, is_mup, optimizer_groups
from pretrain.resolve.topology import ProcessGroups

def warmup_cosine(update: int, *, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Learning rate of optimizer update number `update` (1-based).

    Linear warmup from lr/warmup to lr over the first `warmup` updates, then cosine decay from lr
    to min_lr at update `total` (and min_lr after it). Update 1 already learns: DeepSpeed's
    WarmupCosineLR would give it lr = 0.
    """
    if update <= warmup:
        return lr * update / warmup
    progress = min(1.0, (update - warmup) / max(1, total - warmup))
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def param_groups(model: torch.nn.Module, weight_decay: float, *, cfg: ModelConfig | None = None,
                 lr: float | None = None) -> list[dict[str, Any]]:
    """The optimizer's parameter groups: `pretrain.model.mup.optimizer_groups` (by parameter
    name: weight decay on matrices, none on RMSNorm gains; under muP per-group learning rates)
    when `cfg` and `lr` are given. Without them the standard two groups by shape, without an
    "lr" of their own (the optimizer's)."""
    if cfg is not None and lr is not None:
        return optimizer_groups(model, lr=lr, weight_decay=weight_decay, cfg=cfg)
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:  # a ZeRO-3 parameter's data is its partition: ds_shape is its shape
            (decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def schedule_factor(step: int, *, schedule: LRSchedule, warmup: int, total: int,
                    min_ratio: float, decay_start: int = 0,
                    decay_shape: DecayShape = DecayShape.LINEAR) -> float:
    """The factor of each group's lr after `step` updates (the scheduler's 0-based step count),
    i.e. for update `step + 1`; `min_ratio` is train.min_lr / train.lr.

    Every schedule warms up linearly over the first `warmup` updates (update u: u / warmup).
    cosine: `warmup_cosine`. linear: 1 down to min_ratio in a straight line at update `total`.
    constant: 1. wsd: 1 up to update `decay_start`, then decayed over the updates after it to
    min_ratio at update `total`, by `decay_shape` of the decay's progress p = (u - decay_start)
    / (total - decay_start): linear 1 - p, sqrt 1 - sqrt(p), cosine (1 + cos(pi p)) / 2. The
    first decayed update is already below 1 and the last is at min_ratio, as with cosine; past
    `total` the factor stays at min_ratio.
    """
    update = step + 1
    schedule = LRSchedule(schedule)
    if schedule is LRSchedule.COSINE:  # as it always was, bit for bit
        return warmup_cosine(update, lr=1.0, min_lr=min_ratio, warmup=warmup, total=total)
    if update <= warmup:
        return update / warmup
    if schedule is LRSchedule.CONSTANT:
        return 1.0
    start = warmup if schedule is LRSchedule.LINEAR else decay_start
    if update <= start:
        return 1.0
    progress = min(1.0, (update - start) / max(1, total - start))
    shape = DecayShape(decay_shape) if schedule is LRSchedule.WSD else DecayShape.LINEAR
    if shape is DecayShape.LINEAR:
        remaining = 1.0 - progress
    elif shape is DecayShape.SQRT:
        remaining = 1.0 - math.sqrt(progress)
    else:
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * remaining


def lr_factor(t: TrainConfig) -> Callable[[int], float]:
    """`schedule_factor` of the run's train.lr_schedule, by the scheduler's 0-based step count:
    the LambdaLR of both engines (DeepSpeed's `_lr_schedule`, fsdp2's own)."""
    shape = dict(schedule=LRSchedule(t.lr_schedule), warmup=t.warmup_steps, total=t.steps,
                 min_ratio=t.min_lr / t.lr, decay_start=t.decay_start,
                 decay_shape=DecayShape(t.decay_shape))
    return lambda step: schedule_factor(step, **shape)


def _lr_schedule(t: TrainConfig, factor: Callable[[int], float] | None = None):
    """`lr_factor` as DeepSpeed's `lr_scheduler=` (a `LambdaLR` of the optimizer)."""
    factor = factor or lr_factor(t)
    return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor)


def clip_by_the_whole_models_norm(engine: deepspeed.DeepSpeedEngine,
                                   groups: ProcessGroups) -> None:
    """Make an fp32 pipeline engine at ZeRO-0 clip by the whole model's gradient norm.

    DeepSpeed clips such an engine with `clip_grad_norm_(mpu=grid)`, which counts replicated
    weights (the norms) only where the grid's model-parallel rank is 0: on the first stage's
    first tensor rank. Every later stage's norms are left out, the norm is too small, and the
    run drifts from one process as soon as clipping acts (1e-5 relative in three steps of the
    tiny model at pp 2). `global_grad_norm` counts each element once across the grid; the norm
    is also what `get_global_grad_norm` (the step record) reports. bf16 and fp16 engines and
    ZeRO >= 1 clip through their optimizers, which count by the tensor-parallel rank."""
    def clip() -> None:
        grads = [p for p in engine.module.parameters() if p.grad is not None]
        norm = global_grad_norm(grads, groups, device=str(engine.device))
        torch.nn.utils.clip_grads_with_norm_(grads, engine.gradient_clipping(),
                                             torch.tensor(norm))
        engine._global_grad_norm = norm  # what engine.get_global_grad_norm() returns

    engine.clip_fp32_gradients = clip


@torch.no_grad()
def forget_the_construction_step(engine: deepspeed.DeepSpeedEngine) -> bool:
    """Undo the optimizer step DeepSpeed's bf16 path at ZeRO-0 takes while it is built.

    `FP16_UnfusedOptimizer` (bf16 at ZeRO-0) steps its optimizer once with zero gradients in
    its constructor, to create Adam's state: Adam's step count then runs one ahead (the first
    real update gets step 2's bias correction, 0.735 x lr instead of lr) and AdamW's decoupled
    weight decay has already shrunk every fp32 master once, at the peak learning rate. Clear the
    state (torch's AdamW creates it again at its first step) and copy the module's weights back
    into the masters, which were exactly those weights widened. Returns whether it applied."""
    wrapper = engine.optimizer
    if type(wrapper).__name__ != "FP16_UnfusedOptimizer":
        return False
    wrapper.optimizer.state.clear()
    for low_group, master_group in zip(wrapper.fp16_groups, wrapper.fp32_groups):
        for low, master in zip(low_group, master_group):
            master.copy_(low)
    return True


@contextlib.contextmanager
def bf16_pipelines_sum_gradients_in_fp32() -> Iterator[None]:
    """Let DeepSpeed build a bf16 pipeline at ZeRO-0 whose gradients are summed in fp32.

    DeepSpeed's pipeline engine steps bf16 at ZeRO-0 with its BF16_Optimizer, which sums each
    micro-batch's bf16 gradients into a buffer of `data_types.grad_accum_dtype` (the same
    optimizer does it in fp32 at ZeRO-1). Its start-up check refuses fp32 there without ZeRO
    (`_do_optimizer_sanity_check`: "unsupported mix"), so the sum would stay in bf16, where
    terms below 1/256 of the running sum are lost. For that one case the check answers what it
    answers at ZeRO-1, while the engine is built."""
    from deepspeed.runtime.constants import BFLOAT16
    from deepspeed.runtime.pipe.engine import PipelineEngine

    name = "_do_optimizer_sanity_check"
    deepspeeds = getattr(PipelineEngine, name)
    own = name in PipelineEngine.__dict__

    def sanity_check(engine, basic_optimizer):
        model_dtype, grad_dtype = engine.get_data_types()
        if (not engine.zero_optimization() and model_dtype == torch.bfloat16
                and grad_dtype == torch.float32):
            return BFLOAT16
        return deepspeeds(engine, basic_optimizer)

    setattr(PipelineEngine, name, sanity_check)
    try:
        yield
    finally:
        if own:
            setattr(PipelineEngine, name, deepspeeds)
        else:
            delattr(PipelineEngine, name)


def expert_param_groups(parameters: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The optimizer's groups with the experts reduced apart (`allreduce` False: the expert
    grid's experts) in groups of their own, DeepSpeed's MoE groups (`moe`, `name`: the
    expert-data group their gradients are reduced and their ZeRO state partitioned over);
    `parameters` unchanged when there are none."""
    out = []
    for group in parameters:
        experts = [p for p in group["params"] if getattr(p, "allreduce", True) is False]
        rest = [p for p in group["params"] if getattr(p, "allreduce", True) is not False]
        if rest or not experts:
            out.append({**group, "params": rest})
        if experts:
            out.append({**group, "params": experts, "moe": True,
                        "name": experts[0].group_name})
    return out


@contextlib.contextmanager
def experts_reduced_over_expert_data(groups: ProcessGroups, name: str) -> Iterator[None]:
    """Let DeepSpeed's ZeRO-1/2 optimizer reduce and partition the MoE groups
    (`expert_param_groups`) over OUR expert-data groups while the engine is built.

    DeepSpeed does this only for models holding its own MoE class (`has_moe_layers`, an
    isinstance check), whose expert groups it would create itself in its own rank order. Here
    its group registry (`deepspeed.utils.groups`, read by the engine for the broadcast of the
    initial weights and by the optimizer) gets our `ProcessGroups.expert` and `expert_data`
    under `name`, and `has_moe_layers` is true only while the ZeRO optimizer is built: the
    engine's checkpoints stay its ordinary ones (not its MoE layout, which expects its class).
    Its scaling is then one process's: every gradient is divided by the data-group size
    before the sum over its reduction group (experts: sum over expert-data of what every
    token of the expert group gave, / data = the mean over the data ranks' micro-batches),
    and the gradient norm sums each partition's squares over the data and tensor groups,
    which together hold every expert element once (`_average_expert_grad_norms` then
    averages equal values)."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.utils import groups as ds_groups

    registry = [(ds_groups._EXPERT_PARALLEL_GROUP, groups.expert),
                (ds_groups._EXPERT_DATA_PARALLEL_GROUP, groups.expert_data)]
    for table, group in registry:
        table[name] = group
    ranks = [(ds_groups._EXPERT_PARALLEL_GROUP_RANKS, groups.expert),
             (ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS, groups.expert_data)]
    for table, group in ranks:
        table[name] = torch.distributed.get_process_group_ranks(group)
    original = DeepSpeedEngine._configure_zero_optimizer

    def configure(engine, optimizer):
        engine.has_moe_layers = True
        try:
            return original(engine, optimizer)
        finally:
            engine.has_moe_layers = False

    DeepSpeedEngine._configure_zero_optimizer = configure
    try:
        yield
    finally:
        DeepSpeedEngine._configure_zero_optimizer = original


class TimedBatches:
    """(inputs, labels) pairs from a loader's batches (the tuple DeepSpeed's pipeline engine
    takes: inputs are input_ids, or (input_ids, document_ids) under data.document_mask),
    adding up the time spent waiting for them in `wait`."""

    def __init__(self, batches: Iterator[dict[str, torch.Tensor]]):
        self.batches, self.wait = batches, 0.0

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        start = time.perf_counter()
        batch = next(self.batches)
        self.wait += time.perf_counter() - start
        if "document_ids" in batch:
            return (batch["input_ids"], batch["document_ids"]), batch["labels"]
        return batch["input_ids"], batch["labels"]


def engine_loss(engine, inputs, labels: torch.Tensor, device: str, *,
                non_blocking: bool = False) -> torch.Tensor:
    """The flat engine's loss of one (inputs, labels) pair of `TimedBatches`."""
    labels = labels.to(device, non_blocking=non_blocking)
    if isinstance(inputs, torch.Tensor):
        return engine(inputs.to(device, non_blocking=non_blocking), labels=labels)
    input_ids, document_ids = (t.to(device, non_blocking=non_blocking) for t in inputs)
    return engine(input_ids, labels=labels, document_ids=document_ids)


def set_step_micro_batches(engine, micro_batches: int) -> None:
    """train.batch_ramp: the next optimizer step runs `micro_batches` micro-batches on each
    data-parallel rank; its loss is their mean (each backward divided by them) and its update
    is at the last one, which the caller marks (`set_gradient_accumulation_boundary`: DeepSpeed
    counts micro-batches over the whole run, which a changed accumulation misaligns). The
    sequence-parallel weights' reduction follows (once per step of that many backwards)."""
    per_micro = engine.train_batch_size() // engine.gradient_accumulation_steps()
    engine.set_train_batch_size(per_micro * micro_batches)
    if not isinstance(engine, FSDP2Engine):  # fsdp2 sums those weights' grads once per step
        defer_sequence_parallel_grads(engine.module, micro_batches=micro_batches)


def log_fp8(model: torch.nn.Module, *, main: bool) -> None:
    """The run log's line of `train.fp8`: the projections that compute in FP8, those kept."""
    conversion = getattr(model, "fp8_conversion", None)
    if conversion is not None:
        log(f"[fp8] {conversion.line()}", main=main)


def _compile_layers(module, cfg: RunConfig, *, main: bool) -> None:
    """model.compile: each decoder layer of the engine's model compiled (`compile_blocks`), its
    kernels cached in the run directory."""
    layers = compile_blocks(module, cache_dir=Path(cfg.run_dir) / "torch_compile")
    log(f"[compile] {layers} decoder layers compiled by torch.compile at the first "
        f"step (inductor cache: {os.environ['TORCHINDUCTOR_CACHE_DIR']})", main=main)


def build_engine(cfg: RunConfig, ds_config: dict[str, Any], groups: ProcessGroups, *,
                 main: bool) -> deepspeed.DeepSpeedEngine:
    """This rank's engine over the run's model (`model.build_for_layout`), with the weights of
    `model.init_from` when set. `ds_config` is the resolved DeepSpeed config. Collective.
    With `train.engine: fsdp2` it is `pretrain.training.fsdp2.FSDP2Engine`, which answers the same calls."""
    fsdp2, t = cfg.train.engine is Engine.FSDP2, cfg.train
    factor = lr_factor(t)  # the schedule; each group's lr (muP: hidden matrices lr/m) it scales
    if is_mup(cfg.model):
        log(f"[mup] parametrization {describe(cfg.model)}", main=main)
    if fsdp2:  # built on the meta device, sharded, each rank's shards initialised where they live
        engine = build_fsdp2_engine(
            cfg, ds_config, groups, lr_factor=factor,
            optimizer_groups=lambda sharded: optimizer_groups(
                sharded, lr=t.lr, weight_decay=t.weight_decay, cfg=cfg.model))
        if engine.pipeline is not None:
            log(engine.pipeline.describe(), main=main)
        if cfg.model.init_from:
            log(f"[init] weights from {engine.load_initial_weights()}", main=main)
        log_fp8(engine.module, main=main)
        if cfg.model.compile:  # after fully_shard: its hooks stay eager around each graph
            _compile_layers(engine.module, cfg, main=main)
        return engine
    model = build_for_layout(cfg, groups,
                             zero3_config=ds_config if zero_stage(ds_config) == 3 else None)
    log_fp8(model, main=main)
    if cfg.model.init_from:  # one parameter at a time (gathered under ZeRO-3), before the engine
        source = load_initial_weights(model, cfg=cfg.model, tp_group=tensor_parallel_group(groups))
        log(f"[init] weights from {source}", main=main)
    flat = ModelForm.of(model) is ModelForm.FLAT
    deepspeed_imports.import_muon_uncompiled()
    parameters = optimizer_groups(model, lr=t.lr, weight_decay=t.weight_decay, cfg=cfg.model)
    grid = expert_groups_of(groups)
    experts = contextlib.nullcontext()
    if isinstance(grid, ExpertGroups):  # experts beyond the tensor group: reduced apart
        parameters = expert_param_groups(parameters)
        experts = experts_reduced_over_expert_data(groups, expert_group_name(grid.size))
    # train.optimizer=muon: ours, handed to DeepSpeed (its JSON then has no "optimizer" block);
    # built on the MoE groups, so that the expert grid's matrices keep groups of their own
    optimizer = (muon.build_optimizer(model.named_parameters(), parameters, t)
                 if t.optimizer is Optimizer.MUON else None)
    with contextlib.nullcontext() if flat else bf16_pipelines_sum_gradients_in_fp32(), experts:
        engine, _, _, _ = deepspeed.initialize(
            model=model, config=ds_config, lr_scheduler=_lr_schedule(t, factor),
            optimizer=optimizer, model_parameters=None if optimizer else parameters,
            # without it DeepSpeed treats every rank as data parallel; a PipelineModule brings
            # its own grid (DeepSpeed asserts mpu is None)
            mpu=groups.mpu if flat else None)
    if optimizer is not None:  # where each matrix's pieces are, once DeepSpeed flattened them
        muon.bind_to_deepspeed(engine, tensor_parallel_group(groups))
    if not flat and zero_stage(ds_config) == 0:
        clip_by_the_whole_models_norm(engine, groups)
    forget_the_construction_step(engine)
    # every micro-batch's backward runs once per step, in the flat and the pipeline engine alike
    defer_sequence_parallel_grads(engine.module,
                                  micro_batches=engine.gradient_accumulation_steps())
    if cfg.model.compile:
        _compile_layers(engine.module, cfg, main=main)
    if groups.topology.replicas == 1 and zero_stage(ds_config) == 0 and flat:
        # One replica: DeepSpeed's bucketed gradient all-reduce would only copy gradients
        # in and out of flat buffers (measured ~2% of a step of the quickstart model).
        engine.enable_backward_allreduce = False
    return engine
