"""Flat or pipeline: the one place that tells the two model forms apart, and the one copy loop.

The same Llama weights live in two forms: the flat `LlamaModel` (Hugging Face parameter names)
and pipeline stages (`PipelineModule`, or `SequentialPipeline` in one process) whose parameters
are named by layer-spec index. `ModelForm.of(module)` says which one a module is,
`canonical_parameters` yields its parameters under their Hugging Face names, and
`copy_full_weights` fills them from full, unsharded tensors by those names, cutting this rank's
tensor-parallel shard; `init_weights` fills them with their seeded initial shards.
"""
from __future__ import annotations

import contextlib
import enum
from typing import Callable, Iterator

import deepspeed
import torch
import torch.nn as nn
from deepspeed import DeepSpeedEngine
from deepspeed.pipe import PipelineModule

from pretrain.config import ModelConfig
from pretrain.model.hf import EMBED, LM_HEAD
from pretrain.model.llama import LlamaModel, shard_init, shard_of
from pretrain.model.pipeline import SequentialPipeline, pipeline_to_canonical_name
from pretrain.model.tensor_parallel import tp_rank, tp_world_size


class ModelForm(enum.Enum):
    """How a model is laid out: one `LlamaModel`, or DeepSpeed pipeline stages."""

    FLAT = "flat"
    PIPELINE = "pipeline"

    @classmethod
    def of(cls, module: nn.Module | DeepSpeedEngine) -> "ModelForm":
        """The form of a built model, or of the model a DeepSpeed engine wraps."""
        if isinstance(module, DeepSpeedEngine) or not isinstance(module, nn.Module):
            module = module.module  # DeepSpeed's engine or `pretrain.training.fsdp2.FSDP2Engine`
        if isinstance(module, LlamaModel):
            return cls.FLAT
        if isinstance(module, (PipelineModule, SequentialPipeline)):
            return cls.PIPELINE
        raise TypeError(f"{type(module).__name__} is neither a LlamaModel nor pipeline stages")

    @classmethod
    def for_layout(cls, pipeline_stages: int) -> "ModelForm":
        """The form a run with `pipeline_stages` stages (parallel.pipeline) builds."""
        return cls.PIPELINE if pipeline_stages > 1 else cls.FLAT


def canonical_parameters(module: nn.Module,
                         cfg: ModelConfig) -> Iterator[tuple[str, nn.Parameter]]:
    """(Hugging Face name, parameter) of each parameter this rank holds, each once.

    A tied head is the embedding: it is yielded once, as `model.embed_tokens.weight`, like
    `LlamaModel.named_parameters()` does.
    """
    form = ModelForm.of(module)
    for name, param in module.named_parameters():
        if form is ModelForm.PIPELINE:
            name = pipeline_to_canonical_name(name, num_layers=cfg.num_layers)
        if cfg.tie_embeddings and name == LM_HEAD:
            name = EMBED
        yield name, param


def canonical_buffers(module: nn.Module, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, buffer) of each buffer this rank holds that the weights carry (its
    family's `Family.buffers`: DeepSeek-V3's expert bias), whole and replicated on every rank."""
    from pretrain.families import family_of

    kept = family_of(cfg).buffers
    if not kept:
        return
    form = ModelForm.of(module)
    for name, buffer in module.named_buffers():
        if name.rsplit(".", 1)[-1] not in kept:
            continue
        if form is ModelForm.PIPELINE:
            name = pipeline_to_canonical_name(name, num_layers=cfg.num_layers)
        yield name, buffer


@torch.no_grad()
def copy_full_weights(module: nn.Module, cfg: ModelConfig,
                      full_tensor: Callable[[str], torch.Tensor], *, tp_group=None) -> None:
    """Set every parameter of `module` to this rank's tensor-parallel shard (`shard_of`) of
    `full_tensor(canonical name)`, a whole tensor of the unsharded model, and every buffer the
    weights carry (`canonical_buffers`) to its whole tensor."""
    tp_size, rank = tp_world_size(tp_group), tp_rank(tp_group)
    params = dict(canonical_parameters(module, cfg))
    copy_shards(module, cfg, lambda name: shard_of(
        full_tensor(name), name, cfg=cfg,
        **shard_of_rank(params[name], tp_rank=rank, tp_size=tp_size)))
    for name, buffer in canonical_buffers(module, cfg):
        buffer.copy_(full_tensor(name))


def init_weights(module: nn.Module, cfg: ModelConfig, *, seed: int, tp_group=None) -> None:
    """Initialise every parameter from generators seeded by (seed, canonical name, block).

    Each value depends only on (seed, name, cfg), never on the order of construction, the device
    or the parallel layout: `llama.shard_init` draws this rank's tensor-parallel shard block by
    block, and the blocks are fixed, so tensor-parallel ranks hold shards of one model, pipeline
    stages initialise only the names they hold, and every layout starts from bitwise the same
    model as a single process, while no rank draws more than its shard (plus a block). Padded
    vocabulary rows of the embedding and lm_head are 0 (they never reach the loss); the real
    rows do not depend on the padding, so models padded for different tp sizes agree. A tied
    lm_head is the embedding and is not drawn again.
    """
    tp_size, rank = tp_world_size(tp_group), tp_rank(tp_group)
    _each_parameter(module, cfg, lambda name, param: shard_init(
        name, cfg, seed=seed, out=param, **shard_of_rank(param, tp_rank=rank, tp_size=tp_size)))


def shard_of_rank(param: torch.Tensor, *, tp_rank: int, tp_size: int) -> dict[str, int]:
    """The (tp_rank, tp_size) whose shard `param` holds: an expert-parallel expert is whole."""
    if getattr(param, "expert_parallel", False):
        return {"tp_rank": 0, "tp_size": 1}
    return {"tp_rank": tp_rank, "tp_size": tp_size}


def copy_shards(module: nn.Module, cfg: ModelConfig,
                local_tensor: Callable[[str], torch.Tensor]) -> None:
    """Copy `local_tensor(canonical name)`, this rank's shard, into each parameter."""
    def copy(name: str, param: torch.Tensor) -> None:
        local = local_tensor(name)
        if local.shape != param.shape:
            raise RuntimeError(f"{name}: local shape {tuple(param.shape)} differs from its "
                               f"tensor-parallel shard {tuple(local.shape)}")
        param.copy_(local)

    _each_parameter(module, cfg, copy)


@torch.no_grad()
def _each_parameter(module: nn.Module, cfg: ModelConfig,
                    write: Callable[[str, torch.Tensor], None]) -> None:
    """`write(canonical name, parameter)` for each parameter, one at a time. A ZeRO-3
    parameter is whole only while gathered; rank 0's values are kept (every rank computes the
    same ones)."""
    for name, param in canonical_parameters(module, cfg):
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0) \
                if hasattr(param, "ds_id") else contextlib.nullcontext():
            write(name, param)
