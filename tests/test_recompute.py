"""Selective activation recompute (`model.activation_checkpointing: selective`,
pretrain/model/recompute.py): bitwise no recompute's numerics in fp32, no matmul recomputed,
the cheap operators recomputed, and the activation memory between none and full."""
from __future__ import annotations

import collections
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pretrain.config import MODEL_PRESETS, ModelConfig
from pretrain.model import build_model
from pretrain.testing.runs import REPO, train

MODES = ("none", "selective", "full")


class _OpCounts(TorchDispatchMode):
    """How often each aten operator ran while the mode was on."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _step(mode: str, **model):
    cfg = ModelConfig(**{**MODEL_PRESETS["tiny"], **model, "activation_checkpointing": mode})
    net = build_model(cfg, seed=3)
    ids = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    loss = net(ids[:, :-1], labels=ids[:, 1:])
    with _OpCounts() as backward:
        loss.backward()
    return loss, {n: p.grad for n, p in net.named_parameters()}, backward.counts


@pytest.mark.parametrize("fused", [True, False])
def test_selective_is_bitwise_none_and_recomputes_no_matmul(fused):
    """fp32, the tiny model: loss and every gradient bitwise equal to no recompute's. Backward
    runs the same matmuls as no recompute (full runs each layer's forward matmuls again) and
    no attention forward, but recomputes the norms (rsqrt) and SwiGLU's silu."""
    loss, grads, ops = _step("none", fused_projections=fused)
    sel_loss, sel_grads, sel_ops = _step("selective", fused_projections=fused)
    _, _, full_ops = _step("full", fused_projections=fused)
    assert torch.equal(loss, sel_loss)
    assert all(torch.equal(grads[n], sel_grads[n]) for n in grads)
    assert sel_ops["mm"] == ops["mm"] < full_ops["mm"]
    attention = "_scaled_dot_product_flash_attention_for_cpu"
    assert sel_ops[attention] == ops[attention] == 0 < full_ops[attention]
    layers = MODEL_PRESETS["tiny"]["num_layers"]
    assert ops["rsqrt"] == 0 and sel_ops["rsqrt"] == 2 * layers == full_ops["rsqrt"]
    assert ops["silu"] == 0 and sel_ops["silu"] == layers


@pytest.mark.slow
def test_selective_keeps_less_than_none_and_more_than_full():
    """The quickstart's model (small preset) at a quarter of its micro-batch, each mode in its
    own process with every tensor over 64 KiB mapped (bench/recompute_memory.py): the peak of a
    forward and backward, selective at least 30% below none and above full."""
    sys.path.insert(0, str(REPO / "bench"))
    from recompute_memory import measure_apart

    peaks = {mode: measure_apart(mode, micro_batch=2) for mode in MODES}
    assert peaks["full"] < peaks["selective"] <= 0.7 * peaks["none"], peaks


LAYOUTS = {"tp2_sp": ["parallel.tensor=2", "parallel.sequence_parallel=true"],
           "pp2": ["parallel.pipeline=2"],
           "zero2": ["deepspeed=ds_configs/zero2.json"],
           "fsdp2": ["train.engine=fsdp2", "deepspeed=ds_configs/zero3.json"]}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_selective_trains_bitwise_like_none_on_every_recomputing_layout(tiny_data, tmp_path,
                                                                        layout):
    over = ["train.steps=3", *LAYOUTS[layout]]
    none = train(tmp_path, tiny_data, nprocs=2, name="none", overrides=over)
    selective = train(tmp_path, tiny_data, nprocs=2, name="selective",
                      overrides=[*over, "model.activation_checkpointing=selective"])
    assert selective.losses == none.losses
    grad_norms = [[r["grad_norm"] for r in run.records if r["kind"] == "train"]
                  for run in (none, selective)]
    assert grad_norms[0] == grad_norms[1]


def test_deepspeeds_zero3_is_refused_with_the_reason(tmp_path):
    """Selective recompute replays the layer's operators; ZeRO-3's gathers inside it differ."""
    from pretrain.config import load_config
    from pretrain.errors import ConfigError
    from pretrain.resolve.run import lay_out_as_loaded

    def cfg(*over):
        return load_config(REPO / "configs" / "tiny.yaml", [
            f"run_dir={tmp_path}", "model.activation_checkpointing=selective", *over])
    with pytest.raises(ConfigError, match="ZeRO-3"):
        lay_out_as_loaded(cfg("deepspeed=ds_configs/zero3.json"), world_size=2)
    lay_out_as_loaded(cfg("deepspeed=ds_configs/zero3.json", "train.engine=fsdp2"), world_size=2)
    lay_out_as_loaded(cfg("deepspeed=ds_configs/zero2.json"), world_size=2)
