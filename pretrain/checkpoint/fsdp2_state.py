"""Checkpoints of `train.engine: fsdp2` (`pretrain.training.fsdp2.FSDP2Engine`), read by name.

An fsdp2 step directory holds one `fsdp2_rank<R>.pt` per rank (with the usual `rng_rank<R>.pt`,
`meta.json` and `manifest.json`): rank R's rows of its tensor-parallel shard of every parameter and
of Adam's two moments, by Hugging Face name (an expert-parallel expert: rows of the whole expert,
in the files of the one tensor rank holding it, read back as `MergedShards`' whole experts), and
the buffers the weights carry (DeepSeek-V3's expert bias), whole in every file. Under HSDP only the first replica group's ranks write
(the other groups hold the same shards), so the files are those of a run at dp = one group's size.
`fsdp2_tensors` merges them back into whole tensors (`fsdp2_shards`, merged by
`weights.engine_tensors` into the same `MergedShards` view DeepSpeed's files give), so that:

- an fsdp2 run resumes from its own checkpoint on any tensor or data-parallel size
  (`reshard.load_into_fsdp2`: each rank copies out its rows of its new shard);
- an fsdp2 run resumes from a DeepSpeed checkpoint of any layout and ZeRO stage (the masters and
  moments `weights.engine_tensors` reads), and DeepSpeed's engine from an fsdp2 checkpoint
  (`reshard.load_resharded` reads it through `weights.engine_tensors`, which hands fsdp2 step
  directories here); the schedule's position, Adam's step and the counters come along.

Every fp32 tensor arrives bitwise: continuing differs from the uninterrupted run only by the new
layout's reduction order. This round reads each tensor-parallel rank's files whole when a tensor
is asked for (no partial reads as `zero_shards` does for DeepSpeed's flat partitions).
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

import torch

from pretrain.checkpoint.store import materialize
from pretrain.checkpoint.zero_shards import load_checkpoint_file
from pretrain.errors import CheckpointError

FILE_GLOB = "fsdp2_rank*.pt"
MOMENTS = ("exp_avg", "exp_avg_sq")


def is_fsdp2_checkpoint(step_dir: Path) -> bool:
    return any(Path(step_dir).glob(FILE_GLOB))


def _rank_files(step_dir: Path) -> list[dict[str, Any]]:
    files = sorted(Path(step_dir).glob(FILE_GLOB))
    if not files:
        raise CheckpointError(f"{str(step_dir)!r} holds no {FILE_GLOB} files: not an fsdp2 "
                              "checkpoint of `pretrain train`")
    return [load_checkpoint_file(f) for f in files]


class _RowPieces(Mapping):
    """{name: one tensor-parallel shard} of the files of one tensor rank: the rows of `key`
    ("master" or a moment) of every file holding the name (a pipeline stage's ranks hold its
    parameters only) put back in order. Zeros for a moment not saved yet."""

    def __init__(self, files: list[dict[str, Any]], key: str) -> None:
        self._files, self._key = files, key
        self._names = list(dict.fromkeys(name for f in files for name in f["tensors"]))

    def __getitem__(self, name: str) -> torch.Tensor:
        entries = sorted((f["tensors"][name] for f in self._files if name in f["tensors"]),
                         key=lambda e: e["row"])
        parts = [materialize(e[self._key]) if self._key in e else torch.zeros(e["master"].shape)
                 for e in entries]
        whole = torch.cat(parts)
        if tuple(whole.shape) != tuple(entries[0]["shape"]):
            raise CheckpointError(f"{name}: the fsdp2 files hold {tuple(whole.shape)} of its shard "
                                  f"of {tuple(entries[0]['shape'])}: a rank's file is missing")
        return whole

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def fsdp2_shards(step_dir: Path, key: str | None = None) -> dict[str, dict[int, tuple]]:
    """{Hugging Face name: {tensor rank: (its shards' mapping, name)}} of an fsdp2 checkpoint,
    the masters (`key` None) or Adam's moment `key`: what `weights.MergedShards` merges (the
    view `weights.engine_tensors` gives of any engine checkpoint). Nothing is read per tensor
    yet."""
    by_tensor_rank: dict[int, list[dict[str, Any]]] = {}
    for f in _rank_files(step_dir):
        by_tensor_rank.setdefault(int(f["tensor_rank"]), []).append(f)
    shards: dict[str, dict[int, tuple]] = {}
    for rank, rank_files in by_tensor_rank.items():
        pieces = _RowPieces(rank_files, key or "master")
        for name in pieces:
            shards.setdefault(name, {})[rank] = (pieces, name)
        # the buffers the weights carry: whole in every rank's file (no moments: zeros)
        buffers = rank_files[0].get("buffers", {})
        if key is not None:
            buffers = {name: torch.zeros(tensor.shape) for name, tensor in buffers.items()}
        for name in buffers:
            shards.setdefault(name, {})[rank] = (buffers, name)
    return shards


def carries_buffers(step_dir: Path) -> bool:
    """Whether an fsdp2 checkpoint's files hold the buffers the weights carry (the expert
    bias): every file since fsdp2 trained models with experts."""
    return "buffers" in _rank_files(step_dir)[0]


def fsdp2_client_state(step_dir: Path) -> dict[str, Any]:
    """What the trainer saved with the checkpoint (rank 0's file): step, config, tokenizer."""
    return next(f for f in _rank_files(step_dir) if "client_state" in f)["client_state"]


def fsdp2_counters(step_dir: Path) -> dict[str, Any]:
    """Adam's step, the schedule's state and the engine counters of an fsdp2 checkpoint."""
    head = _rank_files(step_dir)[0]
    return {"adam_step": int(head["adam_step"]), "lr_scheduler": head["lr_scheduler"],
            **{k: int(head[k]) for k in ("global_steps", "global_samples", "skipped_steps")}}
