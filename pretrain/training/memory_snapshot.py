"""CUDA memory snapshots (`logging.memory_snapshot: N`): the allocator's history recorded from
the start of training, written as torch's snapshot file (`torch.cuda.memory._dump_snapshot`,
the pickle https://pytorch.org/memory_viz draws) after step N and when a step runs out of
memory, one file per rank: <run_dir>/memory/rank<R>_step<N>.pickle, rank<R>_oom.pickle.

On a CPU there is no CUDA allocator to record: the setting is a no-op there, said in one line.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch

from pretrain.log import log

HISTORY_ENTRIES = 100_000  # allocation events kept (torch's default is unbounded)


class MemorySnapshots:
    """The trainer's recorder: `recording` around each step (dumps on an out-of-memory error,
    then re-raises), `after_step(step)` (dumps at the chosen step)."""

    def __init__(self, step: int, *, run_dir: Path, rank: int, device_type: str,
                 main: bool = True) -> None:
        self.step, self.rank = step, rank
        self.directory = Path(run_dir) / "memory"
        self.active = step > 0 and device_type == "cuda"
        if step > 0 and not self.active:
            log(f"[memory] logging.memory_snapshot={step}: no snapshot on {device_type} ranks "
                "(it records the CUDA allocator's history); nothing is recorded", main=main)
        if self.active:
            torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)

    def path(self, tag: str) -> Path:
        return self.directory / f"rank{self.rank}_{tag}.pickle"

    def dump(self, tag: str) -> Path:
        """Write the snapshot now, as `tag`; returns its path."""
        path = self.path(tag)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        return path

    def after_step(self, step: int) -> Path | None:
        if self.active and step == self.step:
            path = self.dump(f"step{step}")
            log(f"[memory] snapshot of step {step} in {path}", main=self.rank == 0)
            return path
        return None

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Around a step: an out-of-memory error dumps the history that led to it first."""
        try:
            yield
        except torch.OutOfMemoryError:
            if self.active:
                path = self.dump("oom")
                print(f"[memory] out of memory: snapshot in {path}", flush=True)
            raise
