"""Reruns that differ in the last bits, as on GPUs: a harness mode for the tests of whatever
decides by comparing a run with its replay (`pretrain.training.spikes`' rollback).

GPU kernels do not repeat bitwise: FlashAttention's backward, `index_add`, atomics and NCCL's
reductions sum in an order that changes from run to run, so a replay of the same steps from the
same checkpoint gives losses that differ in the last bits, and weights that differ from then on.
CPU ranks (gloo, fp32) repeat bitwise, which hides any comparison that only works bitwise.
`rerun_in_last_bits()` makes this process's reruns differ like a GPU's, through the training's
seams. It wraps whatever each seam holds when it is called, so it composes with the injections of
`pretrain.testing.faults` made before it (a spike, then its last bits):

- `NonFiniteGuard.corrupt_loss` (`pretrain.training.faults`; flat models, whose micro-batch losses
  the loop sees): micro-batch `m`'s loss of step `s` is scaled by 1 + k eps (eps of its dtype,
  k = 1 + (attempt + m + rank) mod 4, attempt: how many times this process computed that
  micro-batch before) ahead of its backward, so the gradients, the update and every later loss
  move in the last bits, differently in a replay (the micro-batches of a step, and the ranks,
  get different k: not a common factor that Adam would normalise away);
- `LossSpikes.observed_loss` (`pretrain.training.spikes`; every model, pipelines included): a
  replica's loss of step `s` is moved up by exactly `ULPS_PER_ATTEMPT` x (attempt + 1) units in
  the last place (attempt: how many times this process observed step `s` before), so the loss a
  replay compares always differs from the first run's by a few ulps (on one replica exactly;
  `ULPS_PER_ATTEMPT` keeps the difference through a mean over several).

A spawned run gets it through `pretrain.testing.faults.spike_environment(...,
nondeterministic=True)` or `environment(directory=)` here.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

ULPS_PER_ATTEMPT = 4


def nudge(x: torch.Tensor, ulps: int) -> torch.Tensor:
    """`x` moved up by exactly `ulps` units in the last place of its dtype (elementwise)."""
    up = torch.full_like(x, float("inf"))
    for _ in range(ulps):
        x = torch.nextafter(x, up)
    return x


def rerun_in_last_bits() -> None:
    """From now on in this process, every rerun of a step computes it in other last bits (the
    module's docstring says how)."""
    from pretrain.training.faults import NonFiniteGuard
    from pretrain.training.spikes import LossSpikes

    corrupt_loss, observed_loss = NonFiniteGuard.corrupt_loss, LossSpikes.observed_loss
    computed: Counter = Counter()  # (step, micro) -> times computed
    observed: Counter = Counter()  # step -> times observed

    def rescaled_loss(self, loss: torch.Tensor, *, step: int, micro: int) -> torch.Tensor:
        loss = corrupt_loss(self, loss, step=step, micro=micro)
        attempt = computed[step, micro]
        computed[step, micro] += 1
        k = 1 + (attempt + micro + self.rank) % 4
        return loss * (1.0 + k * torch.finfo(loss.dtype).eps)

    def nudged_loss(self, loss: torch.Tensor, *, step: int, samples, dp_rank: int):
        loss = observed_loss(self, loss, step=step, samples=samples, dp_rank=dp_rank)
        attempt = observed[step]
        observed[step] += 1
        return nudge(loss, ULPS_PER_ATTEMPT * (attempt + 1))

    NonFiniteGuard.corrupt_loss = rescaled_loss
    LossSpikes.observed_loss = nudged_loss


def environment(*, directory: Path) -> dict[str, str]:
    """The environment (PYTHONPATH) under which a spawned process calls `rerun_in_last_bits`."""
    from pretrain.testing.faults import _environment

    return _environment("rerun_in_last_bits", "rerun_in_last_bits()", directory=directory,
                        module="pretrain.testing.nondeterminism")
