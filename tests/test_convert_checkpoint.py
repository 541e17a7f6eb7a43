"""`pretrain convert-checkpoint`: consolidated fp32 weights of bf16 ZeRO runs (the fp32 masters).

The fp32 layouts (tp=1, and tp=2 x pp=2) are checked against the live weights of final/ in
tests/test_hf_interop.py. Here bf16 runs at ZeRO >= 1 keep fp32 master weights in the optimizer
shards: the consolidated weights must be those masters exactly (DeepSpeed's own zero_to_fp32 on
the whole checkpoint is the reference), and rounded to bf16 they must be the module's live
weights, which the run gathered into final/.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pretrain.testing.runs import train
from safetensors.torch import load_file
from test_hf_interop import VOCAB, make_data

from pretrain.cli import main as pretrain_main

LAYOUTS = {
    "zero2_dp2_tied": (2, ["deepspeed=ds_configs/zero2.json", "model.tie_embeddings=true"]),
    "zero3_dp2_untied": (2, ["deepspeed=ds_configs/zero3.json"]),
    "zero1_pp2_tied": (2, ["parallel.pipeline=2", "model.tie_embeddings=true"]),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    return make_data(tmp_path_factory.mktemp("data"))


def deepspeed_reference(step_dir: Path, *, vocab_size: int) -> dict[str, torch.Tensor]:
    """DeepSpeed's zero_to_fp32 over a whole (data-parallel only) checkpoint, unpadded."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(step_dir.parent), tag=step_dir.name)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        state[name] = state[name][:vocab_size]
    return state


@pytest.mark.parametrize("layout", LAYOUTS)
def test_consolidated_fp32_are_the_bf16_runs_master_weights(layout, data, tmp_path):
    nprocs, overrides = LAYOUTS[layout]
    run = train(tmp_path, data, nprocs=nprocs, overrides=[
        f"model.vocab_size={VOCAB}", "train.steps=2", "train.precision=bf16",
        "checkpoint.save_final=true", *overrides])
    step_dir = run.run_dir / "checkpoints" / "step2"
    pretrain_main(["convert-checkpoint", str(step_dir), "--to", "fp32", "--output",
                   str(tmp_path / "fp32")])
    consolidated = load_file(str(tmp_path / "fp32" / "model.safetensors"))
    live = load_file(str(run.run_dir / "final" / "model.safetensors"))
    assert consolidated.keys() == live.keys()
    assert ("lm_head.weight" in live) == ("untied" in layout)
    masters_differ = False
    for name, tensor in consolidated.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor.bfloat16().float(), live[name]), name
        masters_differ |= not torch.equal(tensor, live[name])
    assert masters_differ  # fp32 masters, not the bf16 module copies widened
    if "pp" not in layout:  # DeepSpeed's zero_to_fp32 reads flat data-parallel checkpoints
        reference = deepspeed_reference(step_dir, vocab_size=VOCAB)
        for name, tensor in consolidated.items():
            assert torch.equal(tensor, reference[name]), name


def test_universal_conversion_and_damaged_checkpoints(data, tmp_path, capsys):
    run = train(tmp_path, data, nprocs=1, overrides=[f"model.vocab_size={VOCAB}",
                                                     "train.steps=1", "checkpoint.save_final=true"])
    # --to universal hands the checkpoint to DeepSpeed's ds_to_universal
    pretrain_main(["convert-checkpoint", str(run.run_dir), "--to", "universal", "--output",
                   str(tmp_path / "universal")])
    assert (tmp_path / "universal" / "latest").read_text().strip() == "step1"
    assert (tmp_path / "universal" / "step1" / "zero").is_dir()

    # a checkpoint that lost its optimizer shards, and a path that does not exist: exit 2
    step_dir = run.run_dir / "checkpoints" / "step1"
    for optim in step_dir.glob("*optim_states.pt"):
        optim.unlink()
    capsys.readouterr()
    for src, message in ((step_dir, "is damaged: missing file"),
                         (tmp_path / "nothing", "does not exist")):
        with pytest.raises(SystemExit) as exit_info:
            pretrain_main(["convert-checkpoint", str(src), "--to", "fp32", "--output",
                           str(tmp_path / "out")])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
