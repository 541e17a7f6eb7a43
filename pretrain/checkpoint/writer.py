"""The files of a checkpoint, written now or by a background thread: DeepSpeed's pluggable
checkpoint engine.

`ShardWriter` takes the place of `engine.checkpoint_engine` while a checkpoint is saved, so every
file DeepSpeed's `save_checkpoint` writes goes through `save(state, path)`, as do our RNG states.
In the background mode `save` queues the file for the one writer thread, which runs at the
lowest CPU priority, so it slows training as little as it can. A checkpoint is the state at the
save step, bitwise; what the thread reads depends on where the state lives:

- device (GPU) tensors are copied, on the training thread's stream without blocking it
  (`non_blocking` into pinned memory), into host storages the writer keeps and copies into at
  every save: one host buffer per rank, the size of its device state in one save; the thread
  waits for the copies (a CUDA event) before it writes. Training changes the device tensors
  as soon as `save` returns.
- tensors already in host memory (CPU ranks, the optimizer state under CPU offload) are not
  copied: the thread reads the live tensors, and the engine's next optimizer step - the first
  thing that changes them - first waits until every rank has written its files (`Saver`,
  on the file-work group). Forward and backward of that step overlap the write; no second
  copy of the host state is ever made.

The containers (dicts, lists, DeepSpeed's loss scaler object) are copied in either mode, so a
change of them after `save` returns is not written. Either way a file is written by
`torch.save` through a stream that adds up its CRC32 as the bytes go out, then fsync'd; `wait`
returns the (size, CRC32) of every file saved since the previous `wait` once all of them, and
their directories, are on disk, or raises the first writer's error.
"""
from __future__ import annotations

import copy
import os
import sys
import threading
import zlib
from concurrent import futures
from typing import Any, Callable

import torch
from torch.utils.serialization import config as _save_config
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (CheckpointCommitInfo,
                                                                   CheckpointEngine)

import pretrain.checkpoint.safe_load as safe_load


class _Checksummed:
    """A binary file that adds up the CRC32 and the size of what is written through it."""

    def __init__(self, out):
        self.out, self.crc, self.size = out, 0, 0

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.size += memoryview(data).nbytes
        return self.out.write(data)

    def flush(self) -> None:
        self.out.flush()


def _write_file(path: str, state: Any) -> tuple[str, int, int]:
    """`torch.save(state)` into `path`, synced to disk: (path, size, CRC32).

    The CRC32 of the whole file is ours (the manifest's); torch's per-record CRC32 of its zip
    format is switched off: a second pass over every byte, which made a save write at a third
    of the disk's rate. Nothing checks it on loading, and the manifest's covers those bytes."""
    with open(path, "wb") as out, _save_config.patch({"save.compute_crc32": False}):
        stream = _Checksummed(out)
        torch.save(state, stream)
        out.flush()
        os.fsync(out.fileno())
    return path, stream.size, stream.crc


def _lowest_priority() -> None:
    """Run the writer thread at nice 19: training threads get the cores first and the writer
    what they leave idle (waits in collectives, data loading), all of it once training waits
    for the write. Only on Linux, where nice is per thread (elsewhere it is the process's)."""
    if sys.platform == "linux":
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def host_copy(state: Any, storage: Callable[[int], torch.UntypedStorage] = torch.UntypedStorage,
              *, copy_host_tensors: bool = True) -> Any:
    """A deep copy of `state` whose device tensors are copies in host memory.

    Each device tensor storage is copied once, into `storage(nbytes)` (without blocking when
    that is pinned memory), and the tensors are rebuilt as the same views of the copies, so
    `torch.save` of the copy stores what it would have stored of `state`: the same bytes,
    sharing the same storages. Tensors in host memory are copied likewise with
    `copy_host_tensors`, else the copy holds them themselves (its containers are new).
    """
    copies: dict[int, torch.UntypedStorage] = {}
    memo: dict[int, Any] = {}

    def tensor_copy(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == "cpu" and not copy_host_tensors:
            return tensor
        source = tensor.untyped_storage()
        key = source._cdata  # what torch.save tells storages apart by
        if key not in copies:
            copies[key] = storage(source.nbytes())
            copies[key].copy_(source, non_blocking=copies[key].is_pinned())
        out = torch.empty(0, dtype=tensor.dtype).set_(copies[key], tensor.storage_offset(),
                                                      tensor.size(), tensor.stride())
        if isinstance(tensor, torch.nn.Parameter):
            return torch.nn.Parameter(out, requires_grad=tensor.requires_grad)
        return out.requires_grad_(tensor.requires_grad)

    def visit(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            if id(obj) not in memo:
                memo[id(obj)] = tensor_copy(obj)
        elif isinstance(obj, dict):
            for value in obj.values():
                visit(value)
        elif isinstance(obj, (list, tuple, set)):
            for value in obj:
                visit(value)

    visit(state)
    return copy.deepcopy(state, memo)  # the tensors come from the memo, the containers are new


def _new_host_storage(nbytes: int) -> torch.UntypedStorage:
    """Host memory for copies of device tensors: pinned where CUDA is (a copy into it does not
    block the training thread, and runs at the link's full rate), pageable elsewhere."""
    if torch.cuda.is_available():
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage()
    return torch.UntypedStorage(nbytes)


def _copies_done() -> Callable[[], None]:
    """What the writer thread calls before it reads the copies queued so far on the training
    thread's stream (nothing to wait for without CUDA)."""
    if not torch.cuda.is_available():
        return lambda: None
    event = torch.cuda.Event()
    event.record()
    return event.synchronize


def _write_after(ready: Callable[[], None], path: str, state: Any) -> tuple[str, int, int]:
    ready()
    return _write_file(path, state)


class ShardWriter(CheckpointEngine):
    """DeepSpeed's checkpoint engine interface; files are written at once or, with `background`,
    by one thread (files in the order they were saved). `live_host_state`: tensors in host
    memory are written as they are, not copied (the caller keeps them unchanged until `wait`
    returns); device tensors are always copied."""

    def __init__(self, *, background: bool, live_host_state: bool = False):
        super().__init__()
        self.name = "ShardWriter"
        self.background, self.live_host_state = background, live_host_state
        self._pool = futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer",
                                                initializer=_lowest_priority)
        self._files: list[futures.Future] = []
        self._spare: dict[int, list[torch.UntypedStorage]] = {}  # host storages of the last save
        self._used: list[torch.UntypedStorage] = []  # ... and of the save being written

    def _host_storage(self, nbytes: int) -> torch.UntypedStorage:
        spare = self._spare.get(nbytes)
        self._used.append(spare.pop() if spare else _new_host_storage(nbytes))
        return self._used[-1]

    def save(self, state_dict: Any, path: str) -> None:
        if self.background:
            snapshot = host_copy(state_dict, self._host_storage,
                                 copy_host_tensors=not self.live_host_state)
            self._files.append(self._pool.submit(_write_after, _copies_done(), path, snapshot))
        else:
            done: futures.Future = futures.Future()
            done.set_result(_write_file(path, state_dict))
            self._files.append(done)

    def written(self) -> None:
        """Return once the files saved since the last `wait` are written (or failed); unlike
        `wait`, the results stay for `wait`."""
        futures.wait(self._files)

    def writing(self) -> bool:
        """Whether files saved since the last `wait` are still being written (this rank)."""
        return not all(f.done() for f in self._files)

    def wait(self) -> dict[str, tuple[int, int]]:
        """{path: (size, CRC32)} of the files saved since the last `wait`, once they and their
        directories are on disk; the first writer's exception if one failed."""
        files, self._files = self._files, []
        try:
            written = {}
            for future in files:
                path, size, crc = future.result()
                written[path] = (size, crc)
        finally:
            futures.wait(files)  # none is written any more: the next save may copy into them
            self._spare = {}  # the storages of this save only: one save's worth at most
            for storage in self._used:
                self._spare.setdefault(storage.nbytes(), []).append(storage)
            self._used = []
        for directory in {os.path.dirname(p) for p in written}:
            fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return written

    def load(self, path: str, map_location=None) -> Any:
        return safe_load.load(path, map_location=map_location)

    def create(self, info: CheckpointCommitInfo) -> None:
        pass

    def commit(self, info: CheckpointCommitInfo) -> bool:
        return True  # the save becomes complete in `pretrain.checkpoint.saver.Saver.finish`
