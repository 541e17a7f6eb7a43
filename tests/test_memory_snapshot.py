"""`logging.memory_snapshot` (pretrain/training/memory_snapshot.py): the CUDA allocator's history
recorded from the start, its snapshot written at the chosen step and on out-of-memory; a no-op
with one line on CPU ranks. The CUDA calls are stand-ins bound against the installed torch's
signatures (`pretrain.testing.cuda_calls`)."""
from __future__ import annotations

import pytest
import torch

from pretrain.config import load_config
from pretrain.errors import ConfigError
from pretrain.testing.cuda_calls import resolve, signature_of
from pretrain.testing.runs import REPO
from pretrain.training.memory_snapshot import HISTORY_ENTRIES, MemorySnapshots


@pytest.fixture
def cuda_memory(monkeypatch):
    """Stand-ins for the two calls: each binds its arguments to the real function's signature;
    the dump writes a file where the real one would."""
    calls = []

    def stand_in(name):
        real = signature_of(resolve(f"torch.cuda.memory:{name}"))

        def call(*args, **kwargs):
            bound = real.bind(*args, **kwargs)
            calls.append((name, bound.arguments))
            if name == "_dump_snapshot":
                open(bound.arguments["filename"], "wb").write(b"snapshot")
        return call

    for name in ("_record_memory_history", "_dump_snapshot"):
        monkeypatch.setattr(torch.cuda.memory, name, stand_in(name))
    return calls


def test_history_is_recorded_and_dumped_at_the_step_and_on_oom(tmp_path, cuda_memory):
    snaps = MemorySnapshots(3, run_dir=tmp_path, rank=1, device_type="cuda")
    assert cuda_memory == [("_record_memory_history", {"max_entries": HISTORY_ENTRIES})]
    assert snaps.after_step(2) is None and len(cuda_memory) == 1
    assert snaps.after_step(3) == tmp_path / "memory" / "rank1_step3.pickle"
    assert (tmp_path / "memory" / "rank1_step3.pickle").read_bytes() == b"snapshot"
    with pytest.raises(torch.OutOfMemoryError):
        with snaps.recording():
            raise torch.OutOfMemoryError("CUDA out of memory")
    assert (tmp_path / "memory" / "rank1_oom.pickle").exists()
    with snaps.recording():  # a step without error writes nothing
        pass
    assert [name for name, _ in cuda_memory].count("_dump_snapshot") == 2


def test_cpu_ranks_record_nothing_and_say_so_once(tmp_path, cuda_memory, capsys):
    snaps = MemorySnapshots(2, run_dir=tmp_path, rank=0, device_type="cpu")
    assert snaps.after_step(2) is None
    with pytest.raises(torch.OutOfMemoryError):
        with snaps.recording():
            raise torch.OutOfMemoryError("out of memory")
    assert cuda_memory == [] and not (tmp_path / "memory").exists()
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if "memory_snapshot" in line]
    assert len(lines) == 1 and "no snapshot on cpu" in lines[0], lines
    MemorySnapshots(0, run_dir=tmp_path, rank=0, device_type="cuda")  # off: no call at all
    assert cuda_memory == []


def test_a_negative_step_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="memory_snapshot"):
        load_config(REPO / "configs" / "tiny.yaml", ["logging.memory_snapshot=-1"])


@pytest.mark.slow
def test_a_cpu_run_says_its_snapshot_setting_is_a_no_op(tiny_data, tmp_path):
    """The setting reaches the trainer: a CPU run with it trains and says, once, why nothing
    is recorded."""
    from pretrain.testing.runs import train

    run = train(tmp_path, tiny_data, overrides=["train.steps=2", "logging.memory_snapshot=1"])
    lines = [line for line in run.stdout.splitlines() if "memory_snapshot=1" in line]
    assert len(lines) == 1 and "no snapshot on cpu ranks" in lines[0], run.stdout[-2000:]
    assert len(run.losses) == 2 and not (run.run_dir / "memory").exists()
