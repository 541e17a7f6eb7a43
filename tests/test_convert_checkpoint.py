"""`pretrain convert-checkpoint`: consolidated fp32 weights of bf16 ZeRO runs (the fp32 masters).

The fp32 layouts (tp=1, and tp=2 x pp=2) are checked against the live weights of final/ in
tests/test_hf_interop.py, the tp=2 x pp=2 one also against a single process's weights. Here
bf16 runs at ZeRO >= 1 keep fp32 master weights in the optimizer shards: the consolidated weights
must be those masters exactly (DeepSpeed's own zero_to_fp32 on the whole checkpoint is the
reference; for a pipeline, which zero_to_fp32 does not read, DeepSpeed's universal conversion,
whose per-parameter masters carry the pipeline's names), and rounded to bf16 they must be the
module's live weights, which the run gathered into final/.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pretrain.testing.runs import train
from safetensors.torch import load_file
from test_hf_interop import VOCAB, make_data

from pretrain.cli import main as pretrain_main
from pretrain.config import load_config

pytestmark = pytest.mark.slow  # training runs through the launchers (quick tier: not slow)

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


def deepspeed_pipeline_reference(step_dir: Path, out: Path, *, vocab_size: int,
                                 num_layers: int) -> dict[str, torch.Tensor]:
    """DeepSpeed's universal conversion (ds_to_universal) of a pipeline checkpoint: each
    parameter's fp32 master under its pipeline name, renamed here by hand (layer spec 0 the
    tied embedding, 1..num_layers the decoder layers, num_layers + 1 the final norm)."""
    from argparse import Namespace

    from deepspeed.checkpoint import ds_to_universal

    ds_to_universal.main(Namespace(input_folder=str(step_dir), output_folder=str(out),
                                   num_extract_workers=1, num_merge_workers=1,
                                   keep_temp_folder=False, strict=True,
                                   inject_missing_state=False))
    state = {}
    for param in (out / "zero").iterdir():
        if not param.is_dir():  # optimizer_state.pt: the optimizer's common state
            continue
        index, _, local = param.name.partition(".")
        if param.name == "tied_modules.embed.embed_tokens.weight":
            name = "model.embed_tokens.weight"
        elif index == str(num_layers + 1):
            name = f"model.{local}"
        else:
            assert 1 <= int(index) <= num_layers, param.name
            name = f"model.layers.{int(index) - 1}.{local}"
        state[name] = torch.load(param / "fp32.pt", weights_only=False)["param"]
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"][:vocab_size]
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
    if "pp" in layout:  # DeepSpeed's zero_to_fp32 reads flat data-parallel checkpoints only
        num_layers = load_config(run.run_dir / "config.yaml").model.num_layers
        reference = deepspeed_pipeline_reference(step_dir, tmp_path / "universal",
                                                 vocab_size=VOCAB, num_layers=num_layers)
    else:
        reference = deepspeed_reference(step_dir, vocab_size=VOCAB)
    assert consolidated.keys() <= reference.keys()  # zero_to_fp32 adds a tied head's alias
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


def test_streamed_safetensors_file_is_what_safetensors_writes(tmp_path):
    """The writer of final/ appends one tensor at a time after a header written up front; the
    file must read back bitwise through safetensors, and a wrong order, shape or a missing
    tensor is refused."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from pretrain.checkpoint.safetensors_stream import SafetensorsWriter

    tensors = {"b.weight": torch.randn(3, 5), "a.weight": torch.randn(7).to(torch.bfloat16),
               "empty": torch.zeros(0, 4)}
    with SafetensorsWriter(tmp_path / "s.safetensors", {k: v.shape for k, v in tensors.items()},
                           metadata={"step": "3"}) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
    ours = load_file(tmp_path / "s.safetensors")
    save_file({k: v.float().contiguous() for k, v in tensors.items()}, tmp_path / "ref.safetensors")
    reference = load_file(tmp_path / "ref.safetensors")
    assert ours.keys() == reference.keys()
    assert all(torch.equal(ours[k], reference[k]) and ours[k].dtype == torch.float32 for k in ours)
    with safe_open(tmp_path / "s.safetensors", "pt") as f:
        assert f.metadata() == {"step": "3"}
        assert torch.equal(f.get_slice("b.weight")[1:2], tensors["b.weight"][1:2])

    with pytest.raises(ValueError, match="the header's order expects 'b.weight'"):
        SafetensorsWriter(tmp_path / "x", {"b.weight": (3, 5), "a": (7,)}).write("a", torch.ones(7))
    with pytest.raises(ValueError, match=r"shape \(5, 3\), the header says \(3, 5\)"):
        SafetensorsWriter(tmp_path / "y", {"b.weight": (3, 5)}).write("b.weight", torch.ones(5, 3))
    unfinished = SafetensorsWriter(tmp_path / "z", {"b.weight": (3, 5), "a": (7,)})
    unfinished.write("b.weight", torch.ones(3, 5))
    with pytest.raises(ValueError, match="1 tensors of the header were not written"):
        unfinished.close()
