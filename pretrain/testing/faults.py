"""Fault injection for tests, the one way in: production code reads no test switch.

`NonFiniteGuard.corrupt_loss` (`pretrain.faults`) is the seam: it returns a micro-batch's loss
unchanged. `inject_nan_losses(steps)` replaces it in this process, so that global rank 0's first
micro-batch loss of each optimizer step in `steps` is multiplied by NaN (flat models; the
pipeline engine computes its loss inside its schedule). A `pretrain` process a test spawns gets
the same through `nan_loss_environment(steps, directory=)`: a `sitecustomize.py` in `directory`,
put first on PYTHONPATH, which Python imports at start-up in every process of the run::

    run_pretrain(args, run_dir=run_dir, env=nan_loss_environment({3}, directory=tmp_path))
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import torch


def inject_nan_losses(steps: Iterable[int]) -> None:
    """From now on in this process, rank 0's first micro-batch loss of `steps` is NaN."""
    from pretrain.faults import NonFiniteGuard

    chosen = frozenset(steps)

    def corrupt_loss(self, loss: torch.Tensor, *, step: int, micro: int) -> torch.Tensor:
        if step in chosen and micro == 0 and self.rank == 0:
            return loss * float("nan")
        return loss

    NonFiniteGuard.corrupt_loss = corrupt_loss


def nan_loss_environment(steps: Iterable[int], *, directory: Path) -> dict[str, str]:
    """The environment (PYTHONPATH) under which a spawned process calls `inject_nan_losses`."""
    from pretrain.testing.runs import REPO

    directory = Path(directory) / "inject_nan_losses"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(
        "from pretrain.testing.faults import inject_nan_losses\n"
        f"inject_nan_losses({sorted(set(steps))!r})\n")
    path = [str(directory), str(REPO), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in path if p)}
