"""A rollback's verdict when reruns are not bitwise (`pretrain.training.spikes`), in this process:
`roll_back` drives a loop without a model (`_Loop`, through the `LoopState` it takes) whose step
losses are those of a run on a GPU, where every rerun of a step differs in the last bits
(`pretrain.testing.nondeterminism.nudge`); the rules alone (`spikes_again`, `loss_changed`)
against their definitions. The launched runs are in tests/test_spikes.py.
"""
from __future__ import annotations

import math
import random
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from pretrain.config import SpikeAction
from pretrain.data.samples import stream_numbers
from pretrain.testing.faults import SPIKE_FACTOR
from pretrain.testing.nondeterminism import nudge
from pretrain.training import spikes
from pretrain.training.faults import NonFiniteGuard
from pretrain.training.hang import Watchdog
from pretrain.training.loop_state import LoopState, Position

GLOBAL_BATCH, SAVED_AT, LOSS = 4, 2, 3.0  # a checkpoint at step 2; every clean step's loss


def _guard(mean_loss: float, factor: float = 2.0) -> NonFiniteGuard:
    """The spike rule of `NonFiniteGuard` with a running mean, without an engine."""
    guard = NonFiniteGuard.__new__(NonFiniteGuard)
    guard.spike_factor, guard.mean_loss = factor, mean_loss
    return guard


class _Beats(Watchdog):
    """A watchdog that is never started and records its beats, and whether it was paused."""

    def __init__(self, tmp_path):
        super().__init__(timeout_minutes=1.0, rank=0, world_size=1, run_dir=tmp_path)
        self.beats: list[int | None] = []

    def beat(self, step: int | None = None) -> None:
        super().beat(step)
        self.beats.append(step)


class _Loop:
    """A loop without a model, for a world of one, and the `LoopState` `roll_back` takes of it:
    step s's loss is LOSS, SPIKE_FACTOR x that when its samples hold one of `bad` (always) or of
    `once` (the first time only), nudged up by as many ulps as the step ran before (a GPU's
    rerun)."""

    def __init__(self, tmp_path, *, bad=(), once=()):
        self.bad, self.once, self.fired = set(bad), set(once), False
        self.spikes = spikes.LossSpikes(SpikeAction.ROLLBACK, excluded=[])
        self.watchdog, self.guard = _Beats(tmp_path), _guard(LOSS)
        self.metrics = SimpleNamespace(records=[], write=lambda r: self.metrics.records.append(r))
        self.position = Position()
        self.runs: Counter = Counter()
        self.loads: list[tuple[int, bool]] = []  # (step, watchdog paused) of each load
        self.state = LoopState(
            cfg=SimpleNamespace(data=SimpleNamespace(num_workers=0)), position=self.position,
            engine=None, device="cpu", main=True, rank=0, world_size=1, groups=None,
            run_dir=tmp_path, checkpoint_layout={}, global_batch=GLOBAL_BATCH, grad_accum=1,
            pipelined=False, train_data="train", valid_data=None, tokenizer=None,
            watchdog=self.watchdog, guard=self.guard, control=None, metrics=self.metrics,
            spikes=self.spikes, loader=self.loader, train_step=self.train_step,
            finish_save=lambda: None, mean_over_dp=lambda t: t.item(), draw_curves=lambda: None)

    def loader(self, data, *, consumed, workers):
        return (None for _ in iter(int, 1))  # a generator: roll_back closes it

    def train_step(self, batches):
        next(batches)
        position = self.position
        position.step_samples = stream_numbers(position.consumed_samples, GLOBAL_BATCH,
                                               skip=self.spikes.quarantine)
        hit = bool(self.bad.intersection(position.step_samples))
        if not self.fired and self.once.intersection(position.step_samples):
            self.fired = hit = True
        step = position.step + 1
        loss = nudge(torch.tensor(LOSS * (SPIKE_FACTOR if hit else 1.0)), self.runs[step])
        self.runs[step] += 1
        self.watchdog.beat()  # a micro-batch ran
        position.local_loss = loss.item()
        return position.local_loss, 0.0

    def run_to(self, step: int, losses: list[float]) -> float:
        """Steps up to `step` (a checkpoint at SAVED_AT), as the training loop runs them."""
        position = self.position
        while position.step < step:
            loss, _ = self.train_step(self.loader(None, consumed=0, workers=0))
            position.step += 1
            position.consumed_samples += GLOBAL_BATCH
            losses.append(loss)
            if position.step == SAVED_AT:
                position.saved_step = SAVED_AT
        return loss


def _loading(monkeypatch, loop: _Loop) -> _Loop:
    """`loop` with `roll_back`'s checkpoint loads recorded (step, watchdog paused) instead."""
    def load(engine, point, **kwargs):
        loop.loads.append((point.step, bool(loop.watchdog._paused)))

    def read_meta(path):
        step = int(path.name.removeprefix("step"))
        return {"step": step, "consumed_samples": step * GLOBAL_BATCH}

    monkeypatch.setattr(spikes, "read_meta", read_meta)
    monkeypatch.setattr(spikes.checkpoint, "load", load)
    return loop


def _roll_back(loop: _Loop, step: int) -> tuple[list[float], dict]:
    losses: list[float] = []
    first = loop.run_to(step, losses)
    assert loop.guard.is_spike(first)
    record = {"step": step, "loss": first}
    loop.watchdog.beats.clear()
    spikes.roll_back(loop.state, loop.loader(None, consumed=0, workers=0), record=record,
                     losses=losses)
    [spike] = loop.metrics.records
    return losses, spike


def test_a_data_spike_whose_replay_differs_in_the_last_bits_is_quarantined(tmp_path, monkeypatch):
    """Step 4's samples spike every time; its replay from step 2 gives another loss (by ulps):
    it spikes again, so the batch is quarantined and the loop is back at step 2. Each replayed
    step beats the watchdog with its number; each load runs with the watchdog paused."""
    loop = _loading(monkeypatch, _Loop(tmp_path, bad={13}))
    losses, spike = _roll_back(loop, 4)
    assert (spike["verdict"], spike["to_step"], spike["samples"]) == ("data", 2, [12, 13, 14, 15])
    assert spike["replay_loss"] != LOSS * SPIKE_FACTOR  # the replay differed from the first run
    assert loop.spikes.quarantine == [12, 13, 14, 15]
    assert (loop.position.step, loop.position.consumed_samples, len(losses)) == (2, 8, 2)
    assert loop.spikes.counts.fields() == {"spikes_skipped": 0, "spikes_rolled_back": 1,
                                           "spikes_transient": 0, "samples_quarantined": 4}
    assert [b for b in loop.watchdog.beats if b is not None] == [2, 3, 4, 2]
    assert loop.loads == [(2, True), (2, True)] and not loop.watchdog._paused


def test_a_transient_spike_is_replayed_away_and_its_rank_named(tmp_path, monkeypatch):
    """Step 4 spikes the first time only: its replay (in other last bits) is no spike, the run
    goes on from the replayed step 4, and the rank whose loss changed by the spike is named."""
    loop = _loading(monkeypatch, _Loop(tmp_path, once={13}))
    losses, spike = _roll_back(loop, 4)
    assert (spike["verdict"], spike["to_step"], spike["samples"]) == ("transient", 2, [])
    assert spike["hosts"] == [loop.watchdog.host] and loop.spikes.quarantine == []
    assert (loop.position.step, loop.position.consumed_samples) == (4, 16)
    assert losses[-1] == spike["replay_loss"] != LOSS  # the replayed step, in its last bits
    assert [b for b in loop.watchdog.beats if b is not None] == [2, 3, 4]
    assert loop.spikes.counts.transient == 1


def test_a_replay_spikes_again_by_the_spike_rule_not_by_equality():
    guard = _guard(mean_loss=1.0, factor=2.0)
    first = torch.tensor(3.0)
    for ulps in (0, 1, 4):  # the same spike in other last bits
        assert spikes.spikes_again(guard, nudge(first, ulps).item())
    assert not spikes.spikes_again(guard, 1.5)  # not above 2 x the running mean
    assert spikes.spikes_again(guard, math.inf) and spikes.spikes_again(guard, math.nan)


def test_a_rank_loss_changed_by_more_than_the_spike_factor():
    """Changed: one loss more than F times the other (or non-finite). Last bits and a replay's
    drift do not change a loss; and whenever the first step loss (the mean of the ranks'
    positive losses) exceeds F times the replay's, at least one rank's changed."""
    assert not spikes.loss_changed(3.0, nudge(torch.tensor(3.0), 4).item(), factor=2.0)
    assert not spikes.loss_changed(3.0, 3.03, factor=2.0)
    assert spikes.loss_changed(6.1, 3.0, factor=2.0) and spikes.loss_changed(3.0, 6.1, factor=2.0)
    assert not spikes.loss_changed(5.9, 3.0, factor=2.0)
    assert spikes.loss_changed(math.nan, 3.0, factor=2.0)
    assert not spikes.loss_changed(math.inf, math.inf, factor=2.0)
    rng = random.Random(0)
    for _ in range(2000):
        factor, ranks = rng.uniform(1.01, 5.0), rng.randint(1, 16)
        replay = [rng.uniform(0.1, 10.0) for _ in range(ranks)]
        first = [r * rng.uniform(0.2, 3 * factor) for r in replay]
        if sum(first) / ranks > factor * sum(replay) / ranks:
            assert any(spikes.loss_changed(f, r, factor=factor) for f, r in zip(first, replay))


def test_nudge_moves_a_float_by_whole_units_in_the_last_place():
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        x = torch.tensor([3.0, 0.7, 1e-3], dtype=dtype)
        eps = torch.finfo(dtype).eps
        for ulps in (1, 4):
            moved = nudge(x, ulps)
            assert (moved > x).all()
            ulp = torch.tensor([2.0, 0.5, 2.0 ** -10], dtype=torch.float64) * eps  # 2^e x eps
            assert torch.equal((moved.double() - x.double()) / ulp,
                               torch.full((3,), float(ulps), dtype=torch.float64))
