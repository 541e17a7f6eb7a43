"""Built and initialised models: the flat `LlamaModel`, pipeline stages, or whichever a run's
layout asks for (`build_for_layout`).

Every builder initialises with `form.init_weights`, so every form and every layout of the same
seed holds bitwise the same model.
"""
from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import deepspeed
import torch
import torch.nn as nn
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import PipelineModule

from pretrain.config import Engine, Fp8Recipe, ModelConfig, Recompute, RunConfig
from pretrain.model.expert_parallel import expert_groups_of
from pretrain.model.form import ModelForm, init_weights
from pretrain.model.fp8 import convert_to_fp8
from pretrain.model.llama import DecoderLayer, LlamaModel, fused_projections, torch_checkpoint
from pretrain.model.recompute import selective_checkpoint
from pretrain.model.pipeline import SequentialPipeline, pipeline_module, sequential_pipeline


def build_model(cfg: ModelConfig, *, seed: int, tp_group=None,
                sequence_parallel: bool = False, cp_group=None,
                expert_parallel: bool = False, context_kind: str = "ulysses") -> LlamaModel:
    """A `LlamaModel` initialised from `seed`: every tensor-parallel layout of the same seed
    holds shards of bitwise the same model (`cp_group`: context parallelism, same weights)."""
    model = LlamaModel(cfg, tp_group=tp_group, sequence_parallel=sequence_parallel,
                       cp_group=cp_group, expert_parallel=expert_parallel,
                       context_kind=context_kind)
    init_weights(model, cfg, seed=seed, tp_group=tp_group)
    return model


def build_pipeline_model(cfg: ModelConfig, *, seed: int, num_stages: int, tp_group=None,
                         **stage_options) -> PipelineModule:
    """This rank's pipeline stage (`pipeline.pipeline_module`, same options), initialised like
    `build_model(cfg, seed=)`. Collective over the world."""
    module = pipeline_module(cfg, num_stages=num_stages, tp_group=tp_group, **stage_options)
    init_weights(module, cfg, seed=seed, tp_group=tp_group)
    return module


def build_flat_pipeline(cfg: ModelConfig, *, seed: int, tp_group=None,
                        sequence_parallel: bool = False) -> SequentialPipeline:
    """The pipeline's specs as one sequential model, initialised like `build_model(cfg, seed=)`."""
    model = sequential_pipeline(cfg, tp_group=tp_group, sequence_parallel=sequence_parallel)
    init_weights(model, cfg, seed=seed, tp_group=tp_group)
    return model


# `groups` below: the run's process groups (`pretrain.resolve.topology.ProcessGroups`), handed
# down by the engine; the model reads their groups and never the rules that made them.
def tensor_parallel_group(groups):
    """The tensor-parallel group to build the model over; None when tp is 1 (no sharding)."""
    return groups.tensor if groups.topology.tensor > 1 else None


def construct_for_layout(cfg: RunConfig, groups) -> nn.Module:
    """This rank's model for the run's layout, not initialised: pipeline stages when
    parallel.pipeline > 1, else the flat model, tensor-parallel over `groups.tensor`.
    Under `torch.device("meta")` it allocates nothing (the pre-flight build of every rank).
    With `train.fp8` its block projections compute in FP8 (`fp8.convert_to_fp8`; what was
    converted in `model.fp8_conversion`)."""
    model = _construct(cfg, groups)
    if Fp8Recipe(cfg.train.fp8) is not Fp8Recipe.NONE:  # before any engine wraps or shards it
        model.fp8_conversion = convert_to_fp8(
            model, cfg.train.fp8, emulate=get_accelerator().device_name() != "cuda",
            fsdp_all_gather=Engine(cfg.train.engine) is Engine.FSDP2)
    return model


def _construct(cfg: RunConfig, groups: ProcessGroups) -> nn.Module:
    p = cfg.parallel
    tp_group = tensor_parallel_group(groups)
    if ModelForm.for_layout(p.pipeline) is ModelForm.PIPELINE:
        return pipeline_module(
            cfg.model, num_stages=p.pipeline, topology=groups.topology, tp_group=tp_group,
            sequence_parallel=p.sequence_parallel, partition_method=p.pipeline_partition,
            activation_checkpoint_interval=int(
                cfg.model.activation_checkpointing in (Recompute.FULL, Recompute.SELECTIVE)),
            activation_checkpoint_func=(selective_checkpoint if cfg.model.activation_checkpointing
                                        == Recompute.SELECTIVE else torch_checkpoint),
            groups_by_ranks=groups.by_ranks, cp_group=groups.context,
            expert_parallel=p.expert > 1, context_kind=p.context_kind)
    return LlamaModel(cfg.model, tp_group=tp_group, sequence_parallel=p.sequence_parallel,
                      cp_group=groups.context,  # None at parallel.context 1
                      expert_parallel=expert_groups_of(groups), context_kind=p.context_kind)


def build_for_layout(cfg: RunConfig, groups, *,
                     zero3_config: dict[str, Any] | None = None) -> nn.Module:
    """This rank's model for the run's layout (`construct_for_layout`), initialised from
    train.seed like `build_model`. Given a ZeRO-3 DeepSpeed config (`zero3_config`: the caller
    knows the run's stage) it is constructed inside `deepspeed.zero.Init`: each parameter is
    partitioned over the data-parallel ranks as it is created, so no rank ever holds its whole
    tensor-parallel shard of the model; initialising gathers one parameter at a time."""
    partitioned = zero3_config is not None
    # mpu: DeepSpeed checks the batch arithmetic against the data-parallel size, not the world
    with deepspeed.zero.Init(config_dict_or_path=zero3_config, data_parallel_group=groups.data,
                             mpu=groups.mpu) if partitioned else contextlib.nullcontext():
        model = construct_for_layout(cfg, groups)
    init_weights(model, cfg.model, seed=cfg.train.seed, tp_group=tensor_parallel_group(groups))
    return model


def compile_blocks(module: nn.Module, *, cache_dir: Path) -> int:
    """`torch.compile` every decoder layer of `module` in place (regional compilation, as
    torchtitan does): the layers share one code object, so one graph serves all of them and
    compiling costs one layer's time, not the model's. `nn.Module.compile` keeps the module
    and its parameter names (no `_orig_mod.` prefix), so checkpoints, hooks (ZeRO-3's gathers,
    activation checkpointing, the pipeline's stages) and every weight format are unchanged.

    Inductor's caches go to `cache_dir` unless the user set TORCHINDUCTOR_CACHE_DIR: a restart of the
    run reuses the compiled kernels instead of generating and building them again. Compiling
    happens at the first forward and backward; `compile_report` says what it cost. Returns the
    number of layers compiled."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # torch writes its default (a per-user /tmp folder) into the variable once anything asks
    # for the cache: that value is not a user's choice
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    layers = [m for m in module.modules() if isinstance(m, DecoderLayer)]
    # ZeRO-3: a partitioned weight is gathered when eager code reads it (DeepSpeed's hooks);
    # traced, the fused projections would see its empty partition. They run eagerly there (a
    # graph break around each fused matmul); the rest of each layer stays compiled.
    partitioned = any(hasattr(p, "ds_id") for p in module.parameters())
    for layer in layers:
        if partitioned:
            for part in layer.modules():  # attention, the MLP or each expert (FP8's unfused)
                if getattr(part, "project", None) is fused_projections:
                    part.project = eager_fused_projections()
        layer.compile()
    return len(layers)


@functools.cache
def eager_fused_projections() -> Callable[..., tuple[torch.Tensor, ...]]:
    """`fused_projections` left to eager code by dynamo, one wrapper for the whole process.

    Dynamo guards on the identity of the function a layer calls: a new `torch.compiler.disable`
    wrapper per layer made every layer a new graph (one compile per layer instead of one for all
    of them)."""
    return torch.compiler.disable(fused_projections, recursive=True)


class CompileReport(NamedTuple):
    seconds: float  # dynamo tracing + inductor code generation and builds, forward and backward
    graphs: int  # distinct graphs compiled (one per layer shape, plus one per graph break)
    graph_breaks: int  # places dynamo left to eager Python (e.g. ZeRO-3's eager projections)
    cache_hits: int  # inductor graphs loaded from the cache instead of being built
    cache_misses: int


def compile_report() -> CompileReport:
    """What compiling has cost so far in this process, from torch's own counters."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    seconds = sum(sum(compilation_time_metrics.get(key, ()))
                  for key in ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler"))
    inductor = counters["inductor"]
    return CompileReport(seconds, counters["stats"]["unique_graphs"],
                         sum(counters["graph_break"].values()), inductor["fxgraph_cache_hit"],
                         inductor["fxgraph_cache_miss"])
