"""Batch ramp-up (train.batch_ramp): the global batch of each step, and what a layout must allow.

The global batch starts at `start` samples and grows by `increment` samples in equal stretches of
the first `samples` samples trained on, up to train.global_batch_size (G): with
k = (G - start) / increment growths, the batch of a step that begins after `consumed` samples is

    start + increment * min(k, consumed * k // samples)

(Megatron's rampup_batch_size, in integers). The size is a function of the data position alone,
so a resume (whose checkpoint records the samples consumed) continues the ramp exactly, on any
layout. Each size is a whole number of micro-batches on every data-parallel rank
(`check_batch_ramp`): a step of B samples runs B / (micro_batch_size x data) micro-batches, the
engine's gradient accumulation of that step. The learning-rate schedule stays by optimizer step.
"""
from __future__ import annotations

from dataclasses import dataclass

from pretrain.config import BatchRamp, RunConfig
from pretrain.errors import ConfigError


@dataclass(frozen=True)
class RampSchedule:
    """The global batch of every step of a run: `ramp` None is a fixed `global_batch`."""

    global_batch: int
    ramp: BatchRamp | None = None

    @classmethod
    def of(cls, cfg: RunConfig, global_batch: int) -> "RampSchedule":
        """The schedule of `cfg` whose full global batch (the layout's) is `global_batch`."""
        return cls(global_batch, cfg.train.batch_ramp)

    @property
    def growths(self) -> int:
        ramp = self.ramp
        return 0 if ramp is None else (self.global_batch - ramp.start) // ramp.increment

    def size_at(self, consumed: int) -> int:
        """The global batch of the step that starts after `consumed` samples."""
        ramp = self.ramp
        if ramp is None:
            return self.global_batch
        return ramp.start + ramp.increment * min(self.growths, consumed * self.growths
                                                 // ramp.samples)

    def sizes(self) -> list[int]:
        """Every size the ramp passes through, the full global batch last."""
        ramp = self.ramp
        if ramp is None:
            return [self.global_batch]
        return [ramp.start + ramp.increment * k for k in range(self.growths + 1)]

    def samples_for(self, steps: int, *, consumed: int = 0) -> int:
        """The samples `steps` steps train on from `consumed` on."""
        total = consumed
        for done in range(steps):
            if self.ramp is None or total >= self.ramp.samples:  # the rest is at full size
                return total + (steps - done) * self.global_batch - consumed
            total += self.size_at(total)
        return total - consumed


def check_batch_ramp(cfg: RunConfig, *, micro_batch: int, data: int, pipeline: int) -> None:
    """Refuse a batch ramp whose sizes a layout of `micro_batch` x `data` cannot run (every
    size it passes through a whole number of micro-batches on each data-parallel rank), or a
    pipeline (its schedule's micro-batches are fixed when the engine is built)."""
    ramp = cfg.train.batch_ramp
    if ramp is None:
        return
    if pipeline > 1:
        raise ConfigError(f"train.batch_ramp with parallel.pipeline={pipeline}: a pipeline's "
                          "schedule is built for one number of micro-batches per step; ramp "
                          "without pipeline parallelism or drop train.batch_ramp")
    per_step = micro_batch * data
    for name, size in (("start", ramp.start), ("increment", ramp.increment)):
        if size % per_step:
            raise ConfigError(
                f"train.batch_ramp.{name}={size} is not a multiple of train.micro_batch_size x "
                f"data-parallel size = {micro_batch} x {data} = {per_step}: every size of the "
                f"ramp ({', '.join(map(str, RampSchedule.of(cfg, cfg.train.global_batch_size).sizes()))}) "
                "must be whole micro-batches on each rank")
