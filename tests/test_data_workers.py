"""data.num_workers: a run's samples are read in that many DataLoader worker processes.

Observed in a real `pretrain train`: a `sitecustomize.py` first on the run's PYTHONPATH wraps
the loader's fetch (`pretrain.data.loader._MicroBatches.__getitem__`), and every fetch appends
the process it ran in and torch's worker id to a file.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from pretrain.testing.runs import REPO, run_pretrain, train_args

pytestmark = pytest.mark.slow  # a training run

RECORDER = """\
import os

import torch.utils.data

from pretrain.data import loader

_fetch = loader._MicroBatches.__getitem__


def _recorded(self, group):
    info = torch.utils.data.get_worker_info()
    with open({path!r}, "a") as out:
        out.write(f"{{os.getpid()}} {{-1 if info is None else info.id}}\\n")
    return _fetch(self, group)


loader._MicroBatches.__getitem__ = _recorded
"""


def test_the_runs_samples_are_read_in_num_workers_processes(tiny_data, tmp_path):
    """data.num_workers=2: every fetch runs in a worker process, and both workers fetch (the
    loader hands each worker its first fetches at once); 0 or 1 worker would show one pid."""
    fetches = tmp_path / "fetches.txt"
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(RECORDER.format(path=str(fetches)))
    path = [str(site), str(REPO), os.environ.get("PYTHONPATH", "")]
    run_dir = tmp_path / "run"
    run_pretrain(train_args(run_dir, tiny_data, overrides=["data.num_workers=2",
                                                           "train.steps=2"]),
                 run_dir=run_dir, env={"PYTHONPATH": os.pathsep.join(p for p in path if p)}
                 ).check()
    seen = [line.split() for line in Path(fetches).read_text().splitlines()]
    assert seen and all(worker != "-1" for _, worker in seen), seen
    assert {worker for _, worker in seen} == {"0", "1"}, seen
    assert len({pid for pid, _ in seen}) == 2, seen
