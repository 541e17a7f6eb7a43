"""Stragglers: a rank that is slower than the others, named with its host while the run goes on.

Every step each rank adds up three times (`StragglerWatch.begin_step` / `end_step`):
- data wait: waiting for its data loader;
- collective wait: time inside torch.distributed's blocking calls (all-reduce, all-gather,
  reduce-scatter, broadcast, send / recv, barrier - DeepSpeed's gradient reductions and
  pipeline transfers included: `pretrain.training.collective_log`'s wrapper of them times the training
  thread's calls), where a
  rank that is ahead waits for the one behind;
- compute: the rest of the step.
Every `train.straggler_interval` steps the ranks gather those sums (one small all-gather on the
CPU group). A rank's own time is compute + data wait: what it spent not waiting for the others.
A rank whose own time exceeds the median over the ranks by more than `train.straggler_margin`
(0.2: 20% slower) is slow at that check; slow for `train.straggler_patience` checks in a row, it
is named - in a `[straggler]` line, in the step line, in the step's `metrics.jsonl` record
(`stragglers`, and the running count `stragglers_named` the sinks get) - at every check until it
catches up. The run ends with the slowest ranks by their own time over every check.

What this measures on a GPU: NCCL collectives return at once and the host waits later (at the
step's loss), so a fast rank's wait lands in compute there; a host-side measure of the device
(CUDA events) is not implemented. On CPU (gloo) the calls block and the split holds.

Tests slow a rank through the seams `StragglerWatch.step_started` (a real delay) and
`StragglerWatch.measured` (fake measured times, for a naming that does not depend on timing),
both doing nothing here (`pretrain.testing.faults`).
"""
from __future__ import annotations

import socket
import statistics
import threading
from typing import Any, Callable

from pretrain.training import collective_log
from pretrain.dist import gather_for_io

def slow_ranks(own: list[float], *, margin: float) -> list[int]:
    """The ranks whose own time exceeds the median of `own` by more than `margin`."""
    median = statistics.median(own)
    return [rank for rank, value in enumerate(own) if value > median * (1.0 + margin)]


class StragglerWatch:
    """One rank's side of the straggler checks (`interval` 0: off, nothing is measured)."""

    def __init__(self, *, interval: int, margin: float, patience: int, rank: int,
                 log: Callable[[str], None]):
        self.interval, self.margin, self.patience, self.rank = interval, margin, patience, rank
        self.log = log
        self.clock = collective_log.LOG
        if interval:
            collective_log.install()  # idempotent: the wrapper the hang watchdog reads too
            self.clock.time_thread(threading.current_thread())
        self._since_check = [0.0, 0.0, 0.0]  # compute, data wait, collective wait
        self._clock_at = 0.0
        self.hosts: list[str] = []
        self.in_a_row: list[int] = []  # per rank: checks in a row found slow
        self.own_total: list[float] = []  # per rank: own time over every check
        self.named = 0  # namings so far (a rank named at 3 checks counts 3)

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def step_started(self, *, step: int, rank: int) -> None:
        """A seam for tests (`pretrain.testing.faults.delay_rank`): called as step `step`
        starts on global rank `rank`. Nothing here."""

    def measured(self, times: tuple[float, float, float], *, step: int,
                 rank: int) -> tuple[float, float, float]:
        """(compute, data wait, collective wait) of global rank `rank` since the last check,
        at the check after step `step`, unchanged: the seam through which
        `pretrain.testing.faults.fake_step_times` sets them."""
        return times

    def begin_step(self, step: int) -> None:
        if self.enabled:
            self.step_started(step=step, rank=self.rank)
            self._clock_at = self.clock.wait_seconds

    def end_step(self, *, step: int, elapsed: float, data_wait: float) -> dict[str, Any]:
        """Account for step `step`; at a check (collective) the fields of its record."""
        if not self.enabled:
            return {}
        collective = self.clock.wait_seconds - self._clock_at
        for index, value in enumerate((elapsed - data_wait - collective, data_wait, collective)):
            self._since_check[index] += value
        if step % self.interval:
            return {"stragglers_named": self.named}
        times = self.measured(tuple(self._since_check), step=step, rank=self.rank)
        self._since_check = [0.0, 0.0, 0.0]
        gathered = gather_for_io((times, socket.gethostname()))
        return self._judge([t for t, _ in gathered], hosts=[h for _, h in gathered], step=step)

    def _judge(self, times: list[tuple[float, float, float]], *, hosts: list[str],
               step: int) -> dict[str, Any]:
        if not self.in_a_row:
            self.in_a_row, self.own_total = [0] * len(times), [0.0] * len(times)
        self.hosts = hosts
        own = [compute + data for compute, data, _ in times]
        self.own_total = [total + value for total, value in zip(self.own_total, own)]
        slow = set(slow_ranks(own, margin=self.margin))
        self.in_a_row = [count + 1 if rank in slow else 0
                         for rank, count in enumerate(self.in_a_row)]
        median = statistics.median(own)
        named = []
        for rank in sorted(slow):
            if self.in_a_row[rank] < self.patience:
                continue
            compute, data, collective = times[rank]
            named.append({"rank": rank, "host": hosts[rank],
                          "slowdown": own[rank] / median if median else None,
                          "compute_s": compute, "data_wait_s": data,
                          "collective_wait_s": collective})
            self.log(f"[straggler] step {step}: rank {rank} (host {hosts[rank]}) is "
                     f"{own[rank] / median:.2f}x the median rank's own time for "
                     f"{self.in_a_row[rank]} checks in a row: compute {compute:.2f}s, data "
                     f"wait {data:.2f}s, collective wait {collective:.2f}s since the last check")
        self.named += len(named)
        fields: dict[str, Any] = {"stragglers_named": self.named,
                                  "straggler_max_slowdown": max(own) / median if median else None}
        if named:
            fields["stragglers"] = named
        return fields

    def summary(self) -> tuple[str, list[dict[str, Any]]] | None:
        """The slowest ranks by their own time over every check (None before any check)."""
        if not self.own_total:
            return None
        median = statistics.median(self.own_total) or 1.0
        order = sorted(range(len(self.own_total)), key=lambda r: -self.own_total[r])[:3]
        slowest = [{"rank": r, "host": self.hosts[r], "vs_median": self.own_total[r] / median}
                   for r in order]
        text = ", ".join(f"rank {s['rank']} (host {s['host']}) {s['vs_median']:.2f}x"
                         for s in slowest)
        return (f"[straggler] slowest ranks by own time (compute + data wait) against the "
                f"median: {text}; {self.named} naming(s) during the run"), slowest

    def write_summary(self, metrics, *, step: int) -> None:
        """The end-of-run line and record (`metrics`: the run's sink), after a check."""
        summary = self.summary()
        if summary:
            self.log(summary[0])
            metrics.write({"kind": "straggler_summary", "step": step,
                           "stragglers_named": self.named, "slowest": summary[1]})

    def close(self) -> None:
        if self.enabled:
            self.clock.time_thread(None)
