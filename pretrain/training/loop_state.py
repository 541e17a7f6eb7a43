"""What the loop's helpers read and move of a run: the rollback of a loss spike
(`pretrain.training.spikes.roll_back`) and the evaluations during the run
(`pretrain.training.evaluators`) take a `LoopState`, which the trainer builds once, not the
trainer itself.

- `Position`: where the loop is, the one mutable part: the last finished step, the samples
  consumed, the step of the newest checkpoint, the current step's global sample numbers and this
  replica's loss of it (a rollback's replay compares them). The trainer's `step` and
  `consumed_samples` are this object's fields, so a rollback that moves them moves the loop.
- `LoopState`: the run's pieces those helpers use, each named (engine, config, data, groups,
  watchers, metrics), and the few things of the loop they call (`loader`, `train_step`,
  `finish_save`, `mean_over_dp`, `draw_curves`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator


@dataclass
class Position:
    """Where the loop is (mutable: the trainer's steps and a rollback move it)."""
    step: int = 0  # the last finished optimizer step
    consumed_samples: int = 0  # global samples the finished steps read
    saved_step: int | None = None  # the step the newest checkpoint holds
    step_samples: list[int] = field(default_factory=list)  # the running step's sample numbers
    local_loss: float = math.nan  # this replica's loss of the last step


@dataclass(frozen=True)
class LoopState:
    """The run as the rollback and the evaluations see it (built by the trainer)."""
    cfg: Any  # the resolved run's frozen `pretrain.config.Config`
    position: Position
    engine: Any  # DeepSpeed's engine (flat or pipelined) or `FSDP2Engine`
    device: str
    main: bool  # rank 0
    rank: int
    world_size: int
    groups: Any  # `pretrain.resolve.topology.ProcessGroups`
    run_dir: Path
    checkpoint_layout: dict[str, Any]
    global_batch: int  # samples per optimizer step
    grad_accum: int  # micro-batches per step of one replica
    pipelined: bool
    train_data: Any
    valid_data: Any | None
    tokenizer: Any
    watchdog: Any  # `pretrain.training.hang.Watchdog`
    guard: Any  # `pretrain.training.faults.NonFiniteGuard`: the spike rule and running mean
    control: Any  # `pretrain.training.faults.RunControl`: stops between micro-batches
    metrics: Any  # `pretrain.training.sinks.MetricsSink`
    spikes: Any  # `pretrain.training.spikes.LossSpikes`
    # micro-batches of a dataset from `consumed` samples on (the quarantine left out of training's)
    loader: Callable[..., Iterator[dict]]
    # one optimizer step from a data iterator: (mean loss or None when stopped, data wait)
    train_step: Callable[[Iterator], tuple[float | None, float]]
    finish_save: Callable[[], None]  # complete the checkpoint in flight (collective)
    mean_over_dp: Callable[[Any], float]  # a tensor's mean over the replicas (collective)
    draw_curves: Callable[[], None]  # curves.png, once per step
