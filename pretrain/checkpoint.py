"""Checkpoints: DeepSpeed engine checkpoints for resuming, a plain `final/` for using the model.

Layout of a run directory::

    <run_dir>/checkpoints/step<N>/...     DeepSpeed engine checkpoint (all ranks write their shards)
    <run_dir>/checkpoints/latest          DeepSpeed's pointer to the newest complete tag
    <run_dir>/final/model.safetensors     consolidated fp32 weights, Hugging Face names and shapes
    <run_dir>/final/config.yaml           the run config the weights belong to
    <run_dir>/final/tokenizer.model       the tokenizer, copied so the directory is self-contained

`final/` holds the module's working weights, whatever the layout (ZeRO-3 shards and tensor-parallel
shards gathered, padded vocabulary rows dropped, a tied lm_head stored once as Hugging Face
does), so `transformers` can load `model.safetensors` as a `LlamaForCausalLM`. With bf16 training
these are the bf16 weights widened to fp32 (DeepSpeed keeps the fp32 master weights in the
optimizer state of the engine checkpoint, which is what resuming uses). Rank 0 holds the whole
model in CPU memory while writing it: for models that do not fit, set `checkpoint.save_final:
false` and convert the engine checkpoint instead.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist

from pretrain.config import RunConfig, load_config
from pretrain.errors import CheckpointError

FINAL_WEIGHTS = "model.safetensors"


def save_engine(engine, ckpt_dir: Path, *, step: int, client_state: dict[str, Any],
                keep_last: int, main: bool) -> None:
    """Save a DeepSpeed checkpoint tagged step<N> on every rank, then prune old ones (rank 0)."""
    engine.save_checkpoint(str(ckpt_dir), tag=f"step{step}", client_state=client_state)
    torch_dist.barrier()
    if main:
        tags = sorted((p for p in ckpt_dir.glob("step*") if p.is_dir() and p.name[4:].isdigit()),
                      key=lambda p: int(p.name[4:]))
        for old in tags[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    torch_dist.barrier()


def load_latest(engine, ckpt_dir: Path) -> dict[str, Any] | None:
    """Load the newest DeepSpeed checkpoint of a run directory; None when there is none."""
    if not (ckpt_dir / "latest").is_file():
        return None
    path, state = engine.load_checkpoint(str(ckpt_dir))
    if path is None or state is None:
        raise CheckpointError(f"could not load the checkpoint named by {ckpt_dir / 'latest'}: "
                              "remove it to start over, or restore the missing files")
    return state


def save_final(engine, *, cfg: RunConfig, groups, tokenizer, run_dir: Path, step: int,
               main: bool) -> Path:
    """Write `final/` with the consolidated module weights (gathered from ZeRO-3 shards)."""
    import deepspeed
    from safetensors.torch import save_file

    from pretrain.model.hf import to_hf_state_dict

    out = run_dir / "final"
    module = engine.module
    params = list(module.parameters())
    # Under ZeRO-3 each rank holds a shard: gather every parameter for the copy (collective),
    # then the tensor-parallel shards (collective over the TP group), then the stages.
    gather = deepspeed.zero.GatheredParameters(params, modifier_rank=None) \
        if hasattr(params[0], "ds_id") else contextlib.nullcontext()
    with gather:
        full = _gather_model(module, cfg=cfg, groups=groups)
    if main:
        tensors = {k: v.float().contiguous() for k, v in to_hf_state_dict(full, cfg.model).items()}
        tmp = run_dir / "final.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(tensors, str(tmp / FINAL_WEIGHTS), metadata={"step": str(step)})
        cfg.save(tmp / "config.yaml")
        shutil.copyfile(tokenizer.path, tmp / "tokenizer.model")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)  # readers never see a half-written final/
    torch_dist.barrier()
    return out


def _gather_model(module, *, cfg: RunConfig, groups) -> dict[str, torch.Tensor]:
    """The whole model's weights (Hugging Face names, unpadded) on global rank 0.

    Flat model: gathered over the tensor-parallel group. Pipeline: each stage gathers its
    tensor-parallel shards, then the first replica's stages send theirs to rank 0.
    """
    from deepspeed.pipe import PipelineModule

    from pretrain.model import gather_full_state_dict
    from pretrain.model.llama import gather_tensor_parallel_state
    from pretrain.model.pipeline import stage_state_dict

    if not isinstance(module, PipelineModule):
        return gather_full_state_dict(module)
    tp_group = groups.tensor if cfg.parallel.tensor > 1 else None
    stage = gather_tensor_parallel_state(stage_state_dict(module, num_layers=cfg.model.num_layers),
                                         cfg=cfg.model, tp_group=tp_group)
    coords = groups.topology.my_coords
    full: dict[str, torch.Tensor] = {}
    if coords.tensor == 0 and coords.data == 0:  # rank 0's pipeline: one copy of every stage
        parts = [None] * cfg.parallel.pipeline if groups.topology.rank == 0 else None
        torch_dist.gather_object(stage, parts, dst=0, group=groups.pipeline)
        for part in parts or []:
            full.update(part)
    if cfg.model.tie_embeddings and full:
        full["lm_head.weight"] = full["model.embed_tokens.weight"]
    return full


def load_final(path: str | Path) -> tuple[RunConfig, dict[str, torch.Tensor], Path]:
    """(run config, Hugging Face-format state dict, tokenizer path) of a `final/` directory or
    a run directory; `pretrain.model.hf.from_hf_state_dict` pads it for `LlamaModel`."""
    from safetensors.torch import load_file

    path = Path(path)
    if (path / "final").is_dir():
        path = path / "final"
    weights = path / FINAL_WEIGHTS
    if not weights.is_file() or not (path / "config.yaml").is_file():
        raise CheckpointError(f"{str(path)!r} is not a final checkpoint (no {FINAL_WEIGHTS} and "
                              "config.yaml): pass <run_dir> or <run_dir>/final of a finished run")
    cfg = load_config(path / "config.yaml")
    try:
        state = load_file(str(weights))
    except Exception as exc:  # safetensors raises its own error types for damaged files
        raise CheckpointError(f"{str(weights)!r} cannot be read ({exc}): the file is damaged "
                              "or incomplete") from None
    return cfg, state, path / "tokenizer.model"
