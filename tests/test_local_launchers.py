"""This machine's launcher table (`pretrain.launchers.local`), the one the commands and the tests
start ranks through: each launcher's command, and what it refuses."""
from __future__ import annotations

import sys

import pytest

from pretrain.errors import ConfigError
from pretrain.launchers.local import LAUNCHERS, launcher_command


def test_each_launcher_starts_pretrain_on_the_ranks_asked_for():
    torchrun, deepspeed = launcher_command("torchrun", 2), launcher_command("deepspeed", 3)
    assert torchrun[:5] == [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    assert torchrun[-2:] == ["-m", "pretrain"]
    assert deepspeed[1:3] == ["--num_gpus", "3"] and deepspeed[-2:] == ["--module", "pretrain"]
    assert launcher_command("single", 1) == [sys.executable, "-m", "pretrain"]
    assert set(LAUNCHERS) == {"torchrun", "deepspeed", "single"}


def test_a_launcher_not_in_the_table_or_one_process_on_two_ranks_is_refused():
    with pytest.raises(ConfigError, match="launcher 'srun': one of torchrun, deepspeed, single"):
        launcher_command("srun", 2)
    with pytest.raises(ConfigError, match="--launcher single runs one process"):
        launcher_command("single", 2)
