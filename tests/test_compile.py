"""`model.compile`: every decoder layer compiled by `torch.compile` (inductor, C++ kernels on
CPU), the same model as the eager one.

Compiling changes how the layers compute, not what: the parameters, their names and the
checkpoints are those of the eager model, and fp32 training gives the eager run's losses within
1e-5 at every step in each layout that reaches the layers differently: one process, tensor
parallelism (collectives inside the compiled layers), pipeline stages (DeepSpeed's stage
modules), ZeRO-3 (parameters gathered by DeepSpeed's hooks around the compiled modules), and
fsdp2 (`fully_shard`'s hooks around each compiled layer, and its pipelines' stages). The
compiled runs use the fused projections and the chunked loss (the defaults); the reference is
the eager model with neither, so one comparison covers the three levers together.

Inductor's kernels are cached under TORCHINDUCTOR_CACHE_DIR (the tests share the build
folder's, like DeepSpeed's compiled ops), so only the first compile of a shape builds them.
"""
from __future__ import annotations

import os

import pytest
import torch

from pretrain.config import load_config
from pretrain.model import build_model, compile_blocks, compile_report
from pretrain.model.llama import DecoderLayer
from pretrain.testing.runs import LEVER_LAYOUTS, rel_diff, train

pytestmark = pytest.mark.slow  # inductor builds C++ kernels (tens of seconds the first time)

STEPS = 10


def test_compiled_layers_keep_the_model_and_its_gradients(tmp_path, monkeypatch):
    """In one process: the compiled model has the eager model's parameters under the same names
    (no `_orig_mod.`), and its loss and every gradient agree with the eager model's within fp32
    rounding; the compile shows in torch's own counters, and its kernels in the run's cache
    folder (torch had already written its own default into TORCHINDUCTOR_CACHE_DIR)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    cfg = load_config(None, ["model.preset=tiny"]).model
    eager, compiled = build_model(cfg, seed=0), build_model(cfg, seed=0)
    assert compile_blocks(compiled, cache_dir=tmp_path / "cache") == cfg.num_layers
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache")
    assert all(layer._compiled_call_impl is not None
               for layer in compiled.modules() if isinstance(layer, DecoderLayer))
    assert list(compiled.state_dict()) == list(eager.state_dict())

    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1),
                           generator=torch.Generator().manual_seed(0))
    before = compile_report()
    losses = []
    for model in (eager, compiled):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses.append(loss.item())
    after = compile_report()  # dynamo and inductor ran: one graph serves both layers
    assert after.seconds > before.seconds and after.graphs > before.graphs
    assert after.graph_breaks == before.graph_breaks  # the whole layer is one graph
    assert any((tmp_path / "cache").rglob("*.so"))  # inductor's C++ kernels, built there
    assert abs(losses[1] - losses[0]) <= 1e-6 * abs(losses[0]), losses
    for (name, p), (_, q) in zip(compiled.named_parameters(), eager.named_parameters()):
        scale = float(q.grad.abs().max())
        assert float((p.grad - q.grad).abs().max()) <= 1e-5 * scale, name


# fsdp2: each compiled layer a `fully_shard` unit (its all-gather and reduce-scatter hooks left
# to eager code by dynamo) under ZeRO-3's JSON (parameters freed after each layer's forward), and
# a pipeline's stages under torch's interleaved schedule (2 stages a rank, 4 layers)
FSDP2_LAYOUTS = {
    "fsdp2_dp2": (2, ["train.engine=fsdp2", "deepspeed=ds_configs/zero3.json"]),
    "fsdp2_pp2": (2, ["train.engine=fsdp2", "deepspeed=ds_configs/zero2.json",
                      "parallel.pipeline=2", "parallel.pipeline_schedule=interleaved_1f1b",
                      "parallel.virtual_stages=2", "model.num_layers=4"]),
}


@pytest.mark.parametrize("layout", [*LEVER_LAYOUTS, *FSDP2_LAYOUTS])
def test_compiled_training_matches_eager(layout, tiny_data, tmp_path):
    """10 fp32 steps of `pretrain train`: compiled + fused projections + chunked loss against
    the eager, unfused, whole-logits model, losses within 1e-5 relative at every step and grad
    norms within 1e-4; the run line reports the layers compiled and the compile time."""
    nprocs, overrides = {**LEVER_LAYOUTS, **FSDP2_LAYOUTS}[layout]
    common = [f"train.steps={STEPS}", *overrides]
    compiled = train(tmp_path, tiny_data, nprocs=nprocs, name=f"{layout}_compiled",
                     overrides=[*common, "model.compile=true"])
    eager = train(tmp_path, tiny_data, nprocs=nprocs, name=f"{layout}_eager",
                  overrides=[*common, "model.compile=false", "model.fused_projections=false",
                             "model.loss_chunk_tokens=0"])
    assert len(compiled.losses) == len(eager.losses) == STEPS
    assert rel_diff(compiled.losses, eager.losses) < 1e-5, (compiled.losses, eager.losses)
    norms = [[r["grad_norm"] for r in run.records if r["kind"] == "train"]
             for run in (compiled, eager)]
    assert rel_diff(*norms) < 1e-4, norms
    out = compiled.stdout + compiled.stderr
    assert "decoder layers compiled by torch.compile" in out, out[-3000:]
    assert "[compile]" in out and "s of the first step" in out, out[-3000:]
    if layout in ("flat", "fsdp2_dp2"):  # nothing left to eager Python inside a layer
        assert "(0 graph breaks)" in out, out[-3000:]
    assert "[compile]" not in eager.stdout + eager.stderr


def test_a_restarted_run_reuses_its_compiled_kernels(tiny_data, tmp_path, monkeypatch):
    """Without TORCHINDUCTOR_CACHE_DIR the kernels go to <run_dir>/torch_compile; the run
    resumed from its checkpoint loads them there instead of building them again."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    first = train(tmp_path, tiny_data, name="run",
                  overrides=["train.steps=2", "checkpoint.save_interval=2", "model.compile=true",
                             "model.hidden_size=96"])  # a shape no other test has compiled
    cache = tmp_path / "run" / "torch_compile"
    assert f"inductor cache: {cache}" in first.stdout + first.stderr
    assert "reused, 0 built" not in first.stdout + first.stderr  # built the first time
    resumed = train(tmp_path, tiny_data, name="run",
                    overrides=["train.steps=3", "checkpoint.save_interval=2", "model.compile=true",
                               "model.hidden_size=96"])
    out = resumed.stdout + resumed.stderr
    assert "resum" in out.lower() and len(resumed.losses) == 3, out[-3000:]
    line = next(line for line in out.splitlines() if "s of the first step" in line)
    assert line.endswith(" reused, 0 built") and "cache: 0 reused" not in line, line
