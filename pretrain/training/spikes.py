"""Loss spikes: what `train.on_loss_spike` does once `NonFiniteGuard` sees one.

A spike is a step whose loss (the mean over the global batch) exceeds `train.loss_spike_factor`
times the running mean of the losses before it (`pretrain.training.faults.NonFiniteGuard.is_spike`).

- `log` (the default): a `[fault] ... loss spike` line; the update is applied.
- `skip`: the update is dropped through the non-finite path. The step's loss is reduced over
  the replicas after its last micro-batch's forward, before its backward; on a spike every rank
  multiplies that micro-batch's loss by NaN, so each optimizer's own overflow check (DeepSpeed's
  ZeRO and bf16 optimizers; `NonFiniteGuard`'s wrapper of ZeRO-0's plain optimizer) drops the
  update on every rank and the lr schedule does not advance. The data is consumed. Under fp16
  the overflow also halves the loss scale, as any overflow does. Flat models only: a pipeline's
  update happens inside DeepSpeed's schedule before the loss is known (`pretrain.resolve.run` refuses it).
- `rollback`: the step was applied; the run loads its last checkpoint, replays the steps from
  there up to the spike from the same state and data, and asks whether the spiking step spikes
  again: its replayed loss judged by the same rule against the same running mean
  (`NonFiniteGuard.is_spike`; the mean has not moved since, a spike staying out of it), or not
  finite. Not whether the replayed loss equals the first: GPU kernels (FlashAttention's backward,
  `index_add`, atomics, NCCL's reductions) do not repeat bitwise, so a replay differs in the last
  bits, and after many replayed steps in more, whatever the cause of the spike; a spike, though,
  is a loss `train.loss_spike_factor` (> 1) times the mean, which no rounding makes or unmakes.
  * the replay does not spike: a transient fault (hardware, not data). The line names the ranks
    whose own loss changed (below), with their hosts; training goes on from the replayed state.
  * the replay spikes again: a data problem. The run loads the checkpoint again and quarantines
    the global sample numbers of the spiking step's global batch (every micro-batch of it: the
    spike is a mean over them): the data stream leaves them out from now on
    (`pretrain.data.samples.stream_numbers`), every later checkpoint's meta.json lists them
    (`quarantined_samples`), and a resume honours the list. The run then equals one that never
    had those samples (`data.exclude_samples`): bitwise in fp32 on CPU ranks, to the last bits
    that a GPU's replays differ in.
  A rank's own loss changed when one of its first and replayed losses exceeds the other more
  than `train.loss_spike_factor` F times (a relative change above F - 1): that is the spike rule
  applied to one rank with its replay as the reference, far above what a replay's rounding moves
  a loss, and it names at least one rank whenever the first step's loss exceeds F times the
  replay's (the step's loss is the mean of the ranks' positive losses, and a ratio of two sums
  is at most the largest ratio of their terms).
  Without a checkpoint yet, a spike is only logged. Replaying costs the steps since the last
  checkpoint (at most `checkpoint.save_interval`); each replayed step beats the hang watchdog
  with its number, as a step does, and the checkpoint loads run with the watchdog paused, as
  saves do (`pretrain.training.hang`).

Counts go into every step record (`spikes_skipped`, `spikes_rolled_back`, `spikes_transient`,
`samples_quarantined`), a `{"kind": "spike"}` record marks each rollback, and the run ends with a
summary line when a spike was handled. Tests inject spikes through the seam
`LossSpikes.observed_loss` (here: the loss unchanged; `pretrain.testing.faults`).
"""
from __future__ import annotations

import math
import socket
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from pretrain import checkpoint
from pretrain.checkpoint.paths import read_meta
from pretrain.config import SpikeAction
from pretrain.dist import gather_for_io
from pretrain.log import log
from pretrain.training.loop_state import LoopState

QUARANTINE_KEY = "quarantined_samples"  # in a checkpoint's meta.json


@dataclass
class SpikeCounts:
    skipped: int = 0
    rolled_back: int = 0  # data problems: the batch was quarantined
    transient: int = 0  # replays that differed
    quarantined: int = 0  # samples this process added to the quarantine

    def fields(self) -> dict[str, int]:
        return {"spikes_skipped": self.skipped, "spikes_rolled_back": self.rolled_back,
                "spikes_transient": self.transient, "samples_quarantined": self.quarantined}

    def summary(self) -> str | None:
        if not (self.skipped or self.rolled_back or self.transient):
            return None
        return (f"[spike] run summary: {self.skipped} update(s) skipped, {self.rolled_back} "
                f"rollback(s) for data ({self.quarantined} samples quarantined), "
                f"{self.transient} transient fault(s) replayed away")


class LossSpikes:
    """The run's spike policy, its counts and the quarantine of sample numbers."""

    def __init__(self, action: SpikeAction, *, excluded: Sequence[int]):
        self.action = action
        self.quarantine: list[int] = sorted(set(excluded))
        self.counts = SpikeCounts()

    @property
    def skips(self) -> bool:
        return self.action is SpikeAction.SKIP

    @property
    def rolls_back(self) -> bool:
        return self.action is SpikeAction.ROLLBACK

    def resume(self, meta: dict[str, Any]) -> None:
        """Honour a checkpoint's quarantine (on top of data.exclude_samples)."""
        self.quarantine = sorted(set(self.quarantine) | set(meta.get(QUARANTINE_KEY, [])))

    def write_summary(self, metrics, *, step: int, log) -> None:
        """The end-of-run line and record, when a spike was handled."""
        summary = self.counts.summary()
        if summary:
            log(summary)
            metrics.write({"kind": "spike_summary", "step": step, **self.counts.fields()})

    def meta_fields(self) -> dict[str, list[int]]:
        return {QUARANTINE_KEY: list(self.quarantine)} if self.quarantine else {}

    def observed_loss(self, loss: torch.Tensor, *, step: int, samples: Sequence[int],
                      dp_rank: int) -> torch.Tensor:
        """This replica's loss of step `step` (before the mean over replicas), whose global
        batch holds the sample numbers `samples`, on a rank of data-parallel index `dp_rank`:
        unchanged. The seam through which `pretrain.testing.faults.inject_loss_spikes` makes
        chosen samples spike."""
        return loss


def roll_back(state: LoopState, batches: Iterator, *, record: dict[str, Any],
              losses: list[float]) -> Iterator:
    """`rollback` for the step of `record`, a spike the run of `state` just took (its engine,
    position and checkpoints this moves): replay it from the last checkpoint, then keep the replay
    (transient) or quarantine the step's samples and go back to that checkpoint (data); the steps
    undone leave `losses`. Collective. Returns the data iterator to go on with (`batches` is
    closed)."""
    step, spikes, position = record["step"], state.spikes, state.position
    samples, first_local = position.step_samples, position.local_loss
    if position.saved_step is None:
        log(f"[spike] step {step}: no checkpoint to roll back to yet; the update is "
                      "kept", main=state.main, level="warning")
        return batches
    state.finish_save()
    batches.close()
    point = _restore(state)
    batches = state.loader(state.train_data, consumed=position.consumed_samples,
                           workers=state.cfg.data.num_workers)
    replay_mean = None
    while position.step < step:
        replay_mean, _ = state.train_step(batches)
        if replay_mean is None:  # a stop request: the loop stops at this step (not quarantined)
            return batches
        position.step += 1
        state.watchdog.beat(position.step)
        position.consumed_samples += len(position.step_samples)  # the step's (a ramp's size)
    guard = state.guard
    differing = _ranks_whose_loss_changed(first_local, position.local_loss,
                                          factor=guard.spike_factor)
    if not spikes_again(guard, replay_mean):
        spikes.counts.transient += 1
        where = ", ".join(f"rank {r} (host {h})" for r, h in differing) or "no single rank"
        log(f"[spike] step {step}: replayed from step {point.step}, the loss is now "
                      f"{replay_mean:.4f} (was {record['loss']:.4f}): a transient fault on "
                      f"{where}; going on from the replayed step", main=state.main,
                      level="warning")
        _write_record(state, step=step, verdict="transient", to_step=point.step, samples=[],
                      hosts=[h for _, h in differing], replay_loss=replay_mean)
        if losses:
            losses[-1] = replay_mean  # the step as the run now holds it
        return batches
    batches.close()
    spikes.quarantine = sorted(set(spikes.quarantine) | set(samples))
    spikes.counts.rolled_back += 1
    spikes.counts.quarantined += len(samples)
    _restore(state)
    del losses[len(losses) - min(len(losses), step - position.step):]
    log(f"[spike] step {step}: the replay from step {point.step} spikes again (loss "
                  f"{replay_mean:.4f}, was {record['loss']:.4f}): a data problem. Rolled back "
                  f"to step {point.step}; "
                  f"quarantined its {len(samples)} samples (numbers {_ranges(samples)}), left "
                  "out of the data stream and listed in every later checkpoint",
                  main=state.main, level="warning")
    _write_record(state, step=step, verdict="data", to_step=point.step, samples=samples,
                  hosts=[], replay_loss=replay_mean)
    return state.loader(state.train_data, consumed=position.consumed_samples,
                        workers=state.cfg.data.num_workers)


def spikes_again(guard: Any, replay_loss: float) -> bool:
    """Whether the replayed loss of a spiking step is a spike too (or not finite), by `guard`'s
    rule and running mean (a `pretrain.training.faults.NonFiniteGuard`): the data verdict."""
    return not math.isfinite(replay_loss) or guard.is_spike(replay_loss)


def loss_changed(first: float, replay: float, *, factor: float) -> bool:
    """Whether one rank's loss changed between a run and its replay: one of the two (positive
    losses) exceeds the other more than `factor` times, or one is not finite."""
    if not (math.isfinite(first) and math.isfinite(replay)):
        return not (first == replay or (math.isnan(first) and math.isnan(replay)))
    return max(first, replay) > factor * min(first, replay)


def _restore(state: LoopState) -> checkpoint.ResumePoint:
    """Load the newest checkpoint this run saved into the engine (collective), with the hang
    watchdog paused (its waits have train.io_timeout_minutes, as a save's)."""
    position = state.position
    path = state.run_dir / "checkpoints" / f"step{position.saved_step}"
    point = checkpoint.ResumePoint(path, read_meta(path))
    with state.watchdog.paused():
        checkpoint.load(state.engine, point, cfg=state.cfg, groups=state.groups,
                        layout=state.checkpoint_layout, rank=state.rank)
    position.step, position.consumed_samples = point.step, point.meta["consumed_samples"]
    state.watchdog.beat(point.step)  # the last finished step is the checkpoint's again
    return point


def _ranks_whose_loss_changed(first: float, replay: float, *,
                              factor: float) -> list[tuple[int, str]]:
    """(rank, host) of every rank whose own replica loss changed between the two runs
    (`loss_changed`; collective)."""
    mine = (torch.distributed.get_rank() if torch.distributed.is_initialized() else 0,
            socket.gethostname(), loss_changed(first, replay, factor=factor))
    return [(rank, host) for rank, host, changed in gather_for_io(mine) if changed]


def _write_record(state: LoopState, **fields: Any) -> None:
    state.metrics.write({"kind": "spike", **fields, **state.spikes.counts.fields()})


def _ranges(numbers: list[int]) -> str:
    """'4-7, 12' for [4, 5, 6, 7, 12]."""
    spans: list[list[int]] = []
    for n in sorted(numbers):
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
