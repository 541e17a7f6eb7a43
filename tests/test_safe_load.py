"""Checkpoint files are read without running code from their pickles.

A file whose pickle names a callable (here `os.system`, which would create a marker file) is
refused, by every reader of the formats this stack loads, with one `CheckpointError` line naming
the file and the type; the marker never appears. Real checkpoints of every layout load (the
resume, reshard, universal and export tests read them through the same function).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from pretrain.errors import CheckpointError


class _RunsCode:
    """Pickles as a call of os.system: what a hostile checkpoint would hold."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _hostile(path: Path, marker: Path, *, layout: dict) -> Path:
    """`layout` (a real file's top-level structure) with a code-running object inside."""
    torch.save({**layout, "payload": _RunsCode(marker)}, path)
    return path


LAYOUTS = {  # the top-level keys of each kind of file, with a tensor, as the real ones hold
    "mp_rank_00_model_states.pt": {"module": {"w": torch.ones(2)}, "param_shapes": [],
                                   "ds_version": "0.19.8"},
    "zero_pp_rank_0_mp_rank_00_optim_states.pt": {"optimizer_state_dict": {}, "ds_version": ""},
    "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt": {"optimizer_state_dict": {}},
    "rng_rank00000.pt": {"python": (3, (1, 2), None), "torch": torch.ones(2, dtype=torch.uint8)},
    "layer_01-model_00-model_states.pt": {"weight": torch.ones(2)},  # pipeline layer files
    "fp32.pt": {"param": torch.ones(2)},  # a universal checkpoint's parameter files
}


def _readers():
    """Every way this stack reads a pickled checkpoint file."""
    from pretrain.checkpoint import safe_load
    from pretrain.checkpoint.writer import ShardWriter
    from pretrain.checkpoint.zero_shards import load_checkpoint_file

    def deepspeed_reads(path):  # DeepSpeed's own torch.load calls, while loading an engine
        with safe_load.loading_safely():
            return torch.load(path, map_location="cpu", weights_only=False)

    return {"safe_load": safe_load.load,
            "deepspeed engine (ShardWriter.load)": ShardWriter(background=False).load,
            "reshard / export / init_from (load_checkpoint_file)": load_checkpoint_file,
            "deepspeed torch.load": deepspeed_reads}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_file_naming_another_type_is_refused_by_every_reader(name, tmp_path):
    marker = tmp_path / "code-ran"
    path = _hostile(tmp_path / name, marker, layout=LAYOUTS[name])
    for reader_name, read in _readers().items():
        with pytest.raises(CheckpointError) as refused:
            read(path)
        message = str(refused.value)
        assert "\n" not in message and str(path) in message, (reader_name, message)
        assert "posix.system" in message or "os.system" in message, (reader_name, message)
        assert not marker.exists(), reader_name


def test_the_types_deepspeed_and_the_rng_states_pickle_load(tmp_path):
    """What the allow-list is for: numpy's RNG state, DeepSpeed's loss scaler, ZeRO stage and
    fragment addresses, as the real files hold them."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    from pretrain.checkpoint import safe_load

    state = {"numpy": np.random.get_state(), "scaler": LossScaler(1.0),
             "stage": ZeroStageEnum.optimizer_states,
             "fragments": {"w": fragment_address(numel=4, start=0)}}
    torch.save(state, tmp_path / "f.pt")
    back = safe_load.load(tmp_path / "f.pt")
    assert np.array_equal(back["numpy"][1], state["numpy"][1])
    assert back["scaler"].cur_scale == 1.0 and back["stage"] is ZeroStageEnum.optimizer_states
    assert back["fragments"]["w"] == fragment_address(numel=4, start=0)


def test_loading_safely_restores_torch_load():
    from pretrain.checkpoint import safe_load

    real = torch.load
    with safe_load.loading_safely():
        assert torch.load is not real
    assert torch.load is real
