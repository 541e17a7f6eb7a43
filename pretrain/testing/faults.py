"""Fault injection for tests, the one way in: production code reads no test switch.

The seams are in `pretrain.training.faults`:
- `NonFiniteGuard.corrupt_loss` returns a micro-batch's loss unchanged. `inject_nan_losses(steps)`
  replaces it in this process, so that global rank 0's first micro-batch loss of each optimizer
  step in `steps` is multiplied by NaN (flat models; the pipeline engine computes its loss inside
  its schedule).
- `RunControl.micro_batch_started` does nothing. `signal_inside(where, step)` replaces it, so
  that global rank 0 sends itself SIGUSR1 as the first micro-batch of step `step` ("step", flat
  models) or of the evaluation after step `step` ("eval"; a pipeline's first chunk) starts.
- `hang_inside(step, rank, how)` replaces the same seam, so that global rank `rank` hangs as the
  first micro-batch of step `step` starts: it blocks forever in `blocked_forever` ("block") or
  SIGSTOPs itself ("stop"), for the hang watchdog (`pretrain.training.hang`) to find.
  `slow_micro_batches(rank, seconds)` replaces it too, so that rank `rank` sleeps as each
  micro-batch of a step starts (a pipeline's as DeepSpeed's schedule takes it from the data).
- `LossSpikes.observed_loss` (`pretrain.training.spikes`) returns a replica's step loss unchanged.
  `inject_loss_spikes(data=, transient=)` replaces it, so that data-parallel replica 0's loss
  is multiplied by 100 in every step whose global batch holds one of the sample numbers `data`
  (a data problem: a replay spikes again), and in the first step run that holds one of
  `transient` (a transient fault: a replay does not).
- `StragglerWatch.step_started` and `StragglerWatch.measured` (`pretrain.training.stragglers`) do
  nothing. `delay_rank(rank, seconds)` makes one rank sleep as each step starts;
  `fake_step_times(rank, from_step=)` replaces every rank's measured times by fixed ones, that
  rank's compute 3x longer from a step on.
A `pretrain` process a test spawns gets the same through `nan_loss_environment(steps,
directory=)`, `spike_environment(data=, transient=, directory=, nondeterministic=)` (with reruns
in other last bits: `pretrain.testing.nondeterminism`), `slow_spike_environment(rank, seconds,
from_step=, data=, directory=)`, `straggler_environment(call,
directory=)`, `signal_environment(where, step, directory=)` or `hang_environment(step, rank,
how, directory=)`: a `sitecustomize.py` in
`directory`, put first on PYTHONPATH, which Python imports at start-up in every process of the
run::

    run_pretrain(args, run_dir=run_dir, env=nan_loss_environment({3}, directory=tmp_path))
"""
from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Iterable

import torch


def inject_nan_losses(steps: Iterable[int]) -> None:
    """From now on in this process, rank 0's first micro-batch loss of `steps` is NaN."""
    from pretrain.training.faults import NonFiniteGuard

    chosen = frozenset(steps)

    def corrupt_loss(self, loss: torch.Tensor, *, step: int, micro: int) -> torch.Tensor:
        if step in chosen and micro == 0 and self.rank == 0:
            return loss * float("nan")
        return loss

    NonFiniteGuard.corrupt_loss = corrupt_loss


SPIKE_FACTOR = 100.0  # far above train.loss_spike_factor's default (one test sets it higher)


def inject_loss_spikes(*, data: Iterable[int] = (), transient: Iterable[int] = ()) -> None:
    """From now on in this process, replica 0's step loss is SPIKE_FACTOR x larger in every step
    whose samples include one of `data`, and in the first step run that includes one of
    `transient`."""
    from pretrain.training.spikes import LossSpikes

    always, once = frozenset(data), frozenset(transient)
    fired: list[int] = []

    def observed_loss(self, loss: torch.Tensor, *, step: int, samples, dp_rank: int):
        if dp_rank != 0:
            return loss
        hit = bool(always.intersection(samples))
        if not fired and once.intersection(samples):
            fired.append(step)
            hit = True
        return loss * SPIKE_FACTOR if hit else loss

    LossSpikes.observed_loss = observed_loss


def signal_inside(where: str, step: int) -> None:
    """From now on in this process, global rank 0 sends itself SIGUSR1 as the first micro-batch
    of step `step` (`where` "step") or of the evaluation after step `step` ("eval") starts."""
    from pretrain.training.faults import RunControl

    def micro_batch_started(self, at: str, *, step: int, micro: int, rank: int) -> None:
        if (at, step, micro, rank) == (where, chosen, 0, 0):
            os.kill(os.getpid(), signal.SIGUSR1)

    chosen = step
    RunControl.micro_batch_started = micro_batch_started


def blocked_forever() -> None:
    """The frame a "block" hang waits in (the test finds it in the rank's stack dump)."""
    threading.Event().wait()


def hang_inside(step: int, rank: int, how: str) -> None:
    """From now on in this process, global rank `rank` hangs as the first micro-batch of step
    `step` starts: `how` "block" (forever, in `blocked_forever`) or "stop" (SIGSTOP)."""
    from pretrain.training.faults import RunControl

    if how not in ("block", "stop"):
        raise ValueError(how)
    chosen = ("step", step, 0, rank)

    def micro_batch_started(self, at: str, *, step: int, micro: int, rank: int) -> None:
        if (at, step, micro, rank) == chosen:
            if how == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            blocked_forever()

    RunControl.micro_batch_started = micro_batch_started


def hang_environment(step: int, rank: int, how: str, *, directory: Path,
                     first_attempt_only: bool = False) -> dict[str, str]:
    """The environment (PYTHONPATH) under which a spawned process calls `hang_inside`; with
    `first_attempt_only`, only in a Slurm job's first attempt (SLURM_RESTART_COUNT unset or 0),
    so that the requeued job runs clean."""
    call = f"hang_inside({int(step)}, {int(rank)}, {how!r})"
    if first_attempt_only:
        call = f"import os\nif os.environ.get('SLURM_RESTART_COUNT', '0') == '0':\n    {call}"
    return _environment("hang_inside", call, directory=directory)


def nan_loss_environment(steps: Iterable[int], *, directory: Path) -> dict[str, str]:
    """The environment (PYTHONPATH) under which a spawned process calls `inject_nan_losses`."""
    return _environment("inject_nan_losses", f"inject_nan_losses({sorted(set(steps))!r})",
                        directory=directory)


def spike_environment(*, data: Iterable[int] = (), transient: Iterable[int] = (),
                      directory: Path, nondeterministic: bool = False) -> dict[str, str]:
    """The environment (PYTHONPATH) under which a spawned process calls `inject_loss_spikes`;
    with `nondeterministic`, reruns of a step also differ in the last bits, as on GPUs
    (`pretrain.testing.nondeterminism`)."""
    return _environment("inject_loss_spikes", f"inject_loss_spikes(data={sorted(set(data))!r}, "
                        f"transient={sorted(set(transient))!r})", directory=directory,
                        nondeterministic=nondeterministic)


def slow_micro_batches(rank: int, seconds: float, *, from_step: int = 1) -> None:
    """From now on in this process, global rank `rank` sleeps `seconds` as each micro-batch of a
    training step from `from_step` on starts (a pipeline's: as DeepSpeed's schedule takes it):
    steps far longer than their micro-batches, whatever the machine's speed."""
    import time

    from pretrain.training.faults import RunControl

    def micro_batch_started(self, at: str, *, step: int, micro: int, rank: int) -> None:
        if at == "step" and rank == slowed and step >= from_step:
            time.sleep(seconds)

    slowed = rank
    RunControl.micro_batch_started = micro_batch_started


def slow_spike_environment(rank: int, seconds: float, *, from_step: int = 1,
                           data: Iterable[int] = (), directory: Path,
                           nondeterministic: bool = False) -> dict[str, str]:
    """The environment under which a spawned process calls `slow_micro_batches(rank, seconds,
    from_step=)` and `inject_loss_spikes(data=data)` (and `rerun_in_last_bits` with
    `nondeterministic`)."""
    call = (f"slow_micro_batches({int(rank)}, {float(seconds)!r}, from_step={int(from_step)})\n"
            "from pretrain.testing.faults import inject_loss_spikes\n"
            f"inject_loss_spikes(data={sorted(set(data))!r})")
    return _environment("slow_micro_batches", call, directory=directory,
                        nondeterministic=nondeterministic)


def delay_rank(rank: int, seconds: float) -> None:
    """From now on in this process, global rank `rank` sleeps `seconds` as each step starts (a
    real straggler: its data wait and compute stay, the others wait in collectives)."""
    import time

    from pretrain.training.stragglers import StragglerWatch

    def step_started(self, *, step: int, rank: int) -> None:
        if rank == slowed:
            time.sleep(seconds)

    slowed = rank
    StragglerWatch.step_started = step_started


def fake_step_times(slow_rank: int, *, from_step: int, factor: float = 3.0) -> None:
    """From now on in this process, every rank reports the same measured times (compute 1 s,
    data wait 0.1 s, collective wait 0.2 s per check) except `slow_rank`, whose compute is
    `factor` x longer at the checks after steps >= `from_step`: a naming that no timing moves."""
    from pretrain.training.stragglers import StragglerWatch

    def measured(self, times, *, step: int, rank: int):
        slow = rank == slow_rank and step >= from_step
        return (factor if slow else 1.0, 0.1, 0.2)

    StragglerWatch.measured = measured


def straggler_environment(call: str, *, directory: Path) -> dict[str, str]:
    """The environment under which a spawned process makes `call`, one of
    ``delay_rank(rank, seconds)`` / ``fake_step_times(rank, from_step=...)``."""
    name = call.split("(")[0]
    assert name in ("delay_rank", "fake_step_times"), call
    return _environment(name, call, directory=directory)


def signal_environment(where: str, step: int, *, directory: Path) -> dict[str, str]:
    """The environment (PYTHONPATH) under which a spawned process calls `signal_inside`."""
    return _environment("signal_inside", f"signal_inside({where!r}, {int(step)})",
                        directory=directory)


def _environment(name: str, call: str, *, directory: Path, module: str = "pretrain.testing.faults",
                 nondeterministic: bool = False) -> dict[str, str]:
    """A `sitecustomize.py` that imports `name` from `module` and makes `call`; with
    `nondeterministic`, then `pretrain.testing.nondeterminism.rerun_in_last_bits()`."""
    from pretrain.testing.runs import REPO

    directory = Path(directory) / (name + ("_nondeterministic" if nondeterministic else ""))
    directory.mkdir(parents=True, exist_ok=True)
    lines = [f"from {module} import {name}", call]
    if nondeterministic:
        lines += ["from pretrain.testing.nondeterminism import rerun_in_last_bits",
                  "rerun_in_last_bits()"]
    (directory / "sitecustomize.py").write_text("\n".join(lines) + "\n")
    path = [str(directory), str(REPO), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in path if p)}
