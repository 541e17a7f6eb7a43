"""Faults a long run must survive: preemption signals, wall-time limits, dead ranks, NaNs.

- `RunControl`: SIGTERM / SIGUSR1 only set a flag; once per step every rank all-reduces (MAX)
  its flags, so all ranks stop (or save on the wall-clock cadence, or complete a checkpoint
  written in the background) at the same step even when the signal reached only some of them.
  The trainer then saves, waits for the checkpoint's files and exits with EXIT_REQUEUE (75).
  Between micro-batches (of a training step's gradient accumulation and of an evaluation)
  `RunControl.stop_agreed` asks the same of every rank in one 1-element all-reduce on the CPU
  (gloo) group, so a stop waits for one micro-batch, not a step and a whole evaluation. A stop
  inside a step's accumulation abandons the partial step: its gradients are never applied
  (the optimizer and the learning-rate schedule only move at the accumulation boundary) nor
  saved, the checkpoint holds the last completed step, and the resumed run redoes the whole step
  from its first micro-batch (the data position is saved per step). The process exits right
  after that save, so the partial gradients and DeepSpeed's micro-step counter die with it.
  A pipeline's training step runs inside DeepSpeed's 1F1B schedule and stops at its end; its
  evaluation runs in chunks of `pipeline_eval_chunk` micro-batches and stops between them.
- `NonFiniteGuard`: a step whose loss or gradient norm is NaN/Inf is not applied (DeepSpeed's ZeRO
  and bf16 optimizers skip it themselves; the plain torch optimizer of ZeRO-0 is wrapped to do
  the same), counted and logged; after `max_in_a_row` such steps in a row the run stops with
  `TrainingFault` (EXIT_FAULT). Loss spikes and fp16 loss-scale changes are logged; what a
  spike does beyond that (skip, rollback) is `pretrain.training.spikes`'.
- `is_collective_failure`: tells a peer's death or a collective timeout from other errors, so
  `pretrain train` exits with EXIT_FAULT and a one-line reason instead of a traceback or a hang.

Tests inject non-finite losses and stop signals through `pretrain.testing.faults`, which
replaces the seams `NonFiniteGuard.corrupt_loss` (here: the loss unchanged) and
`RunControl.micro_batch_started` (here: nothing).
"""
from __future__ import annotations

import math
import signal
import time
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as torch_dist

from pretrain.errors import TrainingFault

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def is_collective_failure(exc: BaseException) -> bool:
    """A failed or timed-out collective (a peer died or hangs), as raised by gloo / NCCL."""
    if isinstance(exc, torch_dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("gloo", "nccl", "connection closed", "connection reset",
                            "timed out", "timeout", "broken pipe"))


class Poll(NamedTuple):
    """What the ranks agreed on after a step."""
    stop: str | None  # why to stop now (None: go on)
    save_due: bool  # the wall-clock save cadence is due (or a stop needs a save)
    writing: bool  # some rank is still writing the checkpoint saved in the background


class RunControl:
    """When to stop or save, agreed by all ranks once per step (one 4-element all-reduce)."""

    def __init__(self, *, save_interval_minutes: float = 0.0, exit_after_minutes: float = 0.0,
                 save_interval_steps: int = 0):
        """Installs the SIGTERM / SIGUSR1 handlers and starts the wall-time clock: create it
        first thing in a process, so a signal during start-up is not lost either."""
        self.started = self.last_save = time.monotonic()
        self.received: str | None = None
        self.after_signal = 0  # micro-batches run since the signal arrived (this rank)
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        self.schedule(save_interval_steps=save_interval_steps,
                      save_interval_minutes=save_interval_minutes,
                      exit_after_minutes=exit_after_minutes)

    def schedule(self, *, save_interval_steps: int, save_interval_minutes: float,
                 exit_after_minutes: float) -> None:
        """A save is due every `save_interval_steps` steps and every `save_interval_minutes`
        minutes (0: never); the run stops `exit_after_minutes` after the clock started (0: no
        limit)."""
        self.save_every_steps = save_interval_steps
        self.save_every_s = save_interval_minutes * 60.0
        self.deadline = self.started + exit_after_minutes * 60.0 if exit_after_minutes else None

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only a flag: the micro-batch in flight finishes, then every rank learns of it in
        # `stop_agreed` (or in `poll`, after the step).
        self.received = signal.Signals(signum).name

    def micro_batch_done(self) -> None:
        """Count a micro-batch that ran (for the stop line: how many ran after the signal)."""
        if self.received is not None:
            self.after_signal += 1

    def stop_agreed(self) -> bool:
        """Between micro-batches: whether any rank got a stop signal or reached the time limit
        (collective: one 1-element all-reduce on the CPU group, no device synchronisation)."""
        from pretrain.dist import any_rank

        local = self.received is not None or (self.deadline is not None
                                               and time.monotonic() >= self.deadline)
        return any_rank(local)

    def micro_batch_started(self, where: str, *, step: int, micro: int, rank: int) -> None:
        """A seam for tests (`pretrain.testing.faults.signal_inside`): called as micro-batch
        `micro` of step `step`'s accumulation (`where` "step") or of the evaluation after step
        `step` ("eval") starts on global rank `rank`. Nothing here."""

    def restore_handlers(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def mark_saved(self) -> None:
        self.last_save = time.monotonic()

    def poll(self, *, device: str, step: int | None = None, writing: bool = False) -> Poll:
        """The same `Poll` on all ranks after optimizer step `step`: signal, time limit, save
        cadence (steps or minutes) and `writing` (this rank still writes a checkpoint in the
        background) are each the MAX over the world."""
        now = time.monotonic()
        flags = torch.tensor([float(self.received is not None),
                              float(self.deadline is not None and now >= self.deadline),
                              float(self.save_every_s > 0 and now - self.last_save >= self.save_every_s),
                              float(writing)], device=device)
        if torch_dist.is_initialized() and torch_dist.get_world_size() > 1:
            torch_dist.all_reduce(flags, op=torch_dist.ReduceOp.MAX)
        signalled, out_of_time, save_due, writing = (bool(v) for v in flags.tolist())
        if step is not None and self.save_every_steps and step % self.save_every_steps == 0:
            save_due = True  # the same step on every rank
        if signalled:
            late = (f" ({self.after_signal} micro-batch(es) ran after it arrived)"
                    if self.received and self.after_signal else "")
            return Poll(f"signal {self.received or 'received by another rank'}{late}", True,
                        writing)
        if out_of_time:
            return Poll("--exit-after-minutes reached", True, writing)
        return Poll(None, save_due, writing)


def _has_nonfinite_grad(params: list[torch.nn.Parameter], device: str) -> bool:
    """True when any gradient on any rank holds NaN/Inf (collective over the world)."""
    bad = torch.zeros((), device=device)
    for p in params:
        if p.grad is not None and not torch.isfinite(p.grad).all():
            bad.fill_(1.0)
            break
    if torch_dist.is_initialized() and torch_dist.get_world_size() > 1:
        torch_dist.all_reduce(bad, op=torch_dist.ReduceOp.MAX)
    return bool(bad.item())


class NonFiniteGuard:
    """Skip, count and log non-finite steps; log loss spikes and loss-scale changes."""

    def __init__(self, engine, *, max_in_a_row: int, spike_factor: float, device: str,
                 rank: int, log: Callable[[str], None], spikes_kept_out: bool = False):
        """`spikes_kept_out`: a spike's loss stays out of the running mean (its update was
        skipped or rolled back, `pretrain.training.spikes`); otherwise every finite loss enters it."""
        self.engine, self.max_in_a_row, self.spike_factor = engine, max_in_a_row, spike_factor
        self.spikes_kept_out = spikes_kept_out
        self.log, self.rank = log, rank
        self.total = self.in_a_row = 0
        self.mean_loss: float | None = None  # running mean (EMA) of finite losses
        self.loss_scale = self._loss_scale()
        optimizer = engine.optimizer
        if not hasattr(optimizer, "overflow"):
            # ZeRO-0 hands DeepSpeed a plain torch optimizer, which would apply NaN gradients:
            # give it DeepSpeed's overflow protocol (the engine then counts the step as skipped
            # and does not advance the lr schedule, as for the ZeRO optimizers).
            params = [p for g in optimizer.param_groups for p in g["params"]]
            step = optimizer.step

            def guarded_step(*args, **kwargs):
                optimizer.overflow = _has_nonfinite_grad(params, device)
                return None if optimizer.overflow else step(*args, **kwargs)

            optimizer.overflow = False
            optimizer.step = guarded_step

    def _loss_scale(self) -> float | None:
        scale = getattr(self.engine.optimizer, "cur_scale", None)
        return float(scale) if scale is not None else None

    def corrupt_loss(self, loss: torch.Tensor, *, step: int, micro: int) -> torch.Tensor:
        """Micro-batch `micro`'s loss of step `step`, unchanged: the seam through which
        `pretrain.testing.faults.inject_nan_losses` makes it non-finite."""
        return loss

    def is_spike(self, loss: float) -> bool:
        """A finite loss above spike_factor x the running mean of the losses before it."""
        return math.isfinite(loss) and self.mean_loss is not None \
            and loss > self.spike_factor * self.mean_loss

    def after_step(self, *, step: int, loss: float, skipped_before: int,
                   spike_skipped: bool = False) -> dict[str, Any]:
        """Account for the step just taken; the fields it adds to the step record.
        `spike_skipped`: the trainer dropped this step's update for a loss spike (through the
        non-finite path: `pretrain.training.spikes`), which is then no non-finite step."""
        skipped = self.engine.skipped_steps > skipped_before
        nonfinite = not spike_skipped and (
            not math.isfinite(loss) or (skipped and self.loss_scale is None))
        spike = False
        if nonfinite:
            self.total += 1
            self.in_a_row += 1
            self.log(f"[fault] step {step}: non-finite loss/grad norm (loss {loss}); update "
                     f"{'skipped' if skipped else 'NOT skipped'} ({self.in_a_row} in a row, "
                     f"{self.total} in total)")
            if self.in_a_row >= self.max_in_a_row:
                raise TrainingFault(
                    f"{self.in_a_row} non-finite steps in a row (up to step {step}): the run "
                    "diverged; lower train.lr, raise warmup, or resume from an earlier checkpoint "
                    f"(train.max_nonfinite_steps={self.max_in_a_row})")
        else:
            self.in_a_row = 0
            spike = self.is_spike(loss)
            if spike:
                self.log(f"[fault] step {step}: loss spike {loss:.4f} > {self.spike_factor} x "
                         f"running mean {self.mean_loss:.4f}"
                         + ("; update skipped (train.on_loss_spike=skip)" if spike_skipped else ""))
            if not (spike and self.spikes_kept_out):
                self.mean_loss = loss if self.mean_loss is None \
                    else 0.9 * self.mean_loss + 0.1 * loss
        scale = self._loss_scale()
        if scale is not None and scale != self.loss_scale:
            self.log(f"[fp16] step {step}: loss scale {self.loss_scale:g} -> {scale:g}")
            self.loss_scale = scale
        return {"update_skipped": skipped, "nonfinite_steps": self.total, "loss_spike": spike}
