"""Reading the pickled files of a checkpoint without running code from them.

`torch.load(weights_only=False)` lets a pickle call anything it names: a checkpoint copied from
a shared file system or another team would run its author's code in every rank that resumes
from it, initialises from it or converts it. `load` reads with `weights_only=True`, which builds
only tensors, containers and plain values, plus the types below: the only others that
DeepSpeed's files (model states, ZeRO and BF16 optimizer partitions, universal checkpoints) and
our RNG states hold, found by reading real checkpoints of every layout the tests make (ZeRO 0-3,
fp32 and bf16, pipeline, tensor parallel, CPU offload, universal). A file that names anything
else is refused with a `CheckpointError` naming the file and the type.

`loading_safely()` routes DeepSpeed's own `torch.load` calls (its checkpoint engine, universal
checkpoints, ZeRO-3's loads) through `load` while a checkpoint is loaded into an engine.
"""
from __future__ import annotations

import contextlib
import pickle
import re
from pathlib import Path
from typing import Any, Iterator
from unittest import mock

import numpy as np
import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from pretrain.errors import CheckpointError

ALLOWED_TYPES = [
    # DeepSpeed's optimizer files: the ZeRO stage, the loss scaler object (fp16/bf16/fp32
    # alike), the fragment addresses of BF16_Optimizer and ZeRO-1/2 partitions
    ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address,
    # numpy's RNG state (`numpy.random.get_state()`: an array of uint32 words)
    np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32)),
]


def load(path: str | Path, *, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """The object pickled in `path`, built from tensors, containers, plain values and
    `ALLOWED_TYPES` only; `CheckpointError` when the pickle names anything else."""
    with torch.serialization.safe_globals(ALLOWED_TYPES):
        try:
            return _TORCH_LOAD(path, map_location=map_location, weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as exc:
            raise CheckpointError(f"{str(path)!r} is refused: its pickle names "
                                  f"{_foreign_type(path, exc)}, which no checkpoint of this "
                                  "stack holds (loading it could run code from the file); "
                                  "use a checkpoint written by `pretrain train`") from None


def _foreign_type(path: str | Path, exc: Exception) -> str:
    """The first type the pickle in `path` names that is not allowed (from the file itself,
    else from torch's message)."""
    allowed = {f"{t.__module__}.{t.__qualname__}" for t in ALLOWED_TYPES}
    try:
        named = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception:  # noqa: BLE001 - not a zip checkpoint: fall back on torch's message
        named = []
    foreign = [name for name in named if name not in allowed]
    if foreign:
        return foreign[0]
    said = re.search(r"GLOBAL (\S+)", str(exc))
    return said[1] if said else "a type that is not allowed"


_TORCH_LOAD = torch.load  # the real one: `loading_safely` replaces the attribute


def _deepspeed_load(path, map_location=None, *args, mmap: bool = False, **kwargs) -> Any:
    """`torch.load` as DeepSpeed calls it (weights_only=False, pickle modules...), made `load`."""
    return load(path, map_location=map_location, mmap=mmap)


@contextlib.contextmanager
def loading_safely() -> Iterator[None]:
    """Within the block, every `torch.load` (DeepSpeed's included) is `load`."""
    with mock.patch.object(torch, "load", _deepspeed_load):
        yield
