"""`model.fused_projections`: q/k/v and gate/up as one matmul each, the same model as three and
two matmuls.

The fused model keeps the separate parameters (Hugging Face names and values), so it is the
unfused model computed another way: the same state dict, the same loss and gradients up to
float rounding (one matmul sums in another blocking than three), the same greedy tokens through
the KV cache, at tp 1 and 2, and the same fp32 training losses through the real `pretrain train`
in the layouts that touch the projections' weights differently: one process, tensor
parallelism (local shards concatenated), pipeline stages, and ZeRO-3 (weights gathered by
DeepSpeed although the projection modules are never called).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist

from pretrain.config import load_config
from pretrain.model import build_model
from pretrain.testing.numerics import VOCAB_MATRICES, full_grads
from pretrain.testing.ranks import run_on_ranks
from pretrain.testing.runs import LEVER_LAYOUTS, rel_diff, train

GQA = {"num_heads": 4, "num_kv_heads": 2}  # two query heads per kv head
MHA = {"num_heads": 4, "num_kv_heads": 4}


def tiny_cfg(**fields):
    """The `tiny` preset (hidden 64, 2 layers, vocab 512) with overrides."""
    overrides = ["model.preset=tiny"] + [f"model.{k}={v}" for k, v in fields.items()]
    return load_config(None, overrides).model


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest magnitude (elementwise relative
    errors of near-zero gradient elements say nothing about the matmul)."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def batch(cfg, *, seed: int = 1, size: int = 2):
    tokens = torch.randint(0, cfg.vocab_size, (size, cfg.seq_length + 1),
                           generator=torch.Generator().manual_seed(seed))
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[0, :5] = -100
    return inputs, labels


def loss_and_grads(model, inputs, labels):
    loss = model(inputs, labels)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def matmul_widths(model, inputs) -> Counter:
    """Output features of every matmul one no-grad forward runs, counted (dispatched aten ops:
    what ran, whichever Python path called it)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    widths: Counter = Counter()

    class Matmuls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm,
                                       torch.ops.aten.bmm):
                widths[out.shape[-1]] += 1
            return out

    with torch.no_grad(), Matmuls():
        model(inputs)
    return widths


def projection_calls(model, inputs) -> int:
    """Forward calls of the q/k/v and gate/up modules in one forward (the fused path reads
    their weights without calling them)."""
    calls = []
    names = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    hooks = [m.register_forward_hook(lambda *_: calls.append(1))
             for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in names]
    with torch.no_grad():
        model(inputs)
    for hook in hooks:
        hook.remove()
    return len(calls)


# ---- one process ---------------------------------------------------------------------------------

@pytest.mark.parametrize("heads", [GQA, MHA], ids=["gqa", "mha"])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_fused_model_is_the_unfused_model(heads, recompute):
    """Same parameters by name and value, loss and every gradient within 1e-6 relative, and
    the same greedy tokens from the KV-cache generation path."""
    fields = dict(heads, activation_checkpointing=recompute)
    fused = build_model(tiny_cfg(**fields, fused_projections="true"), seed=0)
    unfused = build_model(tiny_cfg(**fields, fused_projections="false"), seed=0)
    assert fused.cfg.fused_projections and not unfused.cfg.fused_projections
    assert all(layer.self_attn.fused and layer.mlp.fused for layer in fused.model.layers)

    state, ref_state = fused.state_dict(), unfused.state_dict()
    assert list(state) == list(ref_state)
    assert all(torch.equal(state[name], ref_state[name]) for name in ref_state)
    assert "model.layers.0.self_attn.k_proj.weight" in state  # Hugging Face names, unfused
    assert "model.layers.1.mlp.up_proj.weight" in state

    inputs, labels = batch(fused.cfg)
    loss, grads = loss_and_grads(fused, inputs, labels)
    ref_loss, ref_grads = loss_and_grads(unfused, inputs, labels)
    assert abs(float(loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss)), (loss, ref_loss)
    assert list(grads) == list(ref_grads)
    for name, ref in ref_grads.items():
        assert grads[name] is not None and grads[name].shape == ref.shape, name
        assert rel(grads[name], ref) < 1e-6, (name, rel(grads[name], ref))

    with torch.no_grad():  # logits of evaluation, and greedy tokens through the KV cache
        assert rel(fused(inputs), unfused(inputs)) < 1e-5
    prompt = inputs[:, :7]
    tokens = fused.generate(prompt, max_new_tokens=8)
    assert torch.equal(tokens, unfused.generate(prompt, max_new_tokens=8))
    assert tokens.shape == (2, 7 + 8)


def test_fused_gradients_under_bf16_autocast():
    """Under autocast the fused matmul runs in bf16 like the unfused ones, and its backward
    hands each weight and the input a gradient in their own (fp32) dtype."""
    fused = build_model(tiny_cfg(**GQA, fused_projections="true"), seed=0)
    unfused = build_model(tiny_cfg(**GQA, fused_projections="false"), seed=0)
    inputs, labels = batch(fused.cfg)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grads = loss_and_grads(fused, inputs, labels)
        ref_loss, ref_grads = loss_and_grads(unfused, inputs, labels)
    assert abs(float(loss) - float(ref_loss)) < 1e-2 * abs(float(ref_loss))
    for name, ref in ref_grads.items():
        assert grads[name].dtype == ref.dtype == torch.float32, name
        assert rel(grads[name], ref) < 5e-2, (name, rel(grads[name], ref))


def test_fused_model_runs_one_matmul_per_group_and_never_calls_the_projections():
    """What the fused path is, observed: per layer one matmul as wide as q + k + v (64 + 32 +
    32) and one as wide as gate + up (2 x 176), none as wide as a single k/v or gate/up, and
    the projection modules never called; the unfused model runs the five thin ones."""
    cfg = tiny_cfg(**GQA, fused_projections="true")
    fused = build_model(cfg, seed=0)
    unfused = build_model(tiny_cfg(**GQA, fused_projections="false"), seed=0)
    inputs, _ = batch(cfg)
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    kv, ffn, layers = cfg.num_kv_heads * cfg.head_dim, cfg.ffn_hidden_size, cfg.num_layers
    widths = matmul_widths(fused, inputs)
    assert (widths[qkv], widths[2 * ffn], widths[kv], widths[ffn]) == (layers, layers, 0, 0), \
        widths
    assert projection_calls(fused, inputs) == 0
    ref_widths = matmul_widths(unfused, inputs)
    assert (ref_widths[qkv], ref_widths[kv], ref_widths[ffn]) == (0, 2 * layers, 2 * layers), \
        ref_widths
    assert projection_calls(unfused, inputs) == 5 * layers


# ---- tensor parallelism --------------------------------------------------------------------------

def _fused_tp_against_unfused(rank, world_size, variants):
    for fields, sequence_parallel in variants:
        cfg = tiny_cfg(**fields, seq_length=16, fused_projections="true")
        model = build_model(cfg, seed=3, tp_group=dist.group.WORLD,
                            sequence_parallel=sequence_parallel)
        ref = build_model(tiny_cfg(**fields, seq_length=16, fused_projections="false"), seed=3)
        what = f"{fields} sp={sequence_parallel}"
        # this rank's q/k/v shards are whole heads: [q_local; k_local; v_local] is split by them
        attn = model.model.layers[0].self_attn
        assert attn.qkv_sizes == [attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0],
                                  attn.v_proj.weight.shape[0]], what
        assert attn.qkv_sizes[0] == cfg.num_heads * cfg.head_dim // world_size, what

        inputs, labels = batch(cfg)
        assert projection_calls(model, inputs) == 0, what  # the fused path, not the modules
        loss, _ = loss_and_grads(model, inputs, labels)
        ref_loss, ref_grads = loss_and_grads(ref, inputs, labels)
        assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss)), what
        grads = full_grads(model)
        assert grads.keys() == ref_grads.keys(), what
        for name, expected in ref_grads.items():
            if name in VOCAB_MATRICES:
                expected = expected[:cfg.vocab_size]
            assert rel(grads[name], expected) < 1e-5, (what, name, rel(grads[name], expected))
        prompt = inputs[:, :7]
        assert torch.equal(model.generate(prompt, max_new_tokens=4),
                           ref.generate(prompt, max_new_tokens=4)), what


def test_fused_tp2_matches_unfused_single_process(tmp_path):
    """tp 2: GQA with one kv head per rank, without GQA, and with sequence parallelism."""
    variants = [(GQA, False), (MHA, False), (GQA, True)]
    run_on_ranks(_fused_tp_against_unfused, world_size=2, tmp_path=tmp_path, args=(variants,))


# ---- training runs through `pretrain train` ------------------------------------------------------

STEPS = 10


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LEVER_LAYOUTS))
def test_fused_training_matches_unfused(layout, tiny_data, tmp_path):
    """10 fp32 steps: the losses of fused and unfused runs of one layout within 1e-5 relative
    at every step. ZeRO-3 partitions q/k/v and gate/up over the ranks: the fused forward reads
    them outside their own modules, so DeepSpeed must gather them (a weight not gathered is
    empty and the matmul fails)."""
    nprocs, overrides = LEVER_LAYOUTS[layout]
    runs = {fused: train(tmp_path, tiny_data, nprocs=nprocs, name=f"{layout}_fused_{fused}",
                         overrides=[f"train.steps={STEPS}", f"model.fused_projections={fused}",
                                    *overrides])
            for fused in ("true", "false")}
    fused, unfused = runs["true"], runs["false"]
    assert len(fused.losses) == len(unfused.losses) == STEPS
    assert rel_diff(fused.losses, unfused.losses) < 1e-5, (fused.losses, unfused.losses)
    norms = [[r["grad_norm"] for r in run.records if r["kind"] == "train"]
             for run in (fused, unfused)]
    assert rel_diff(*norms) < 1e-4, norms
    if layout == "zero3":
        assert fused.records[0]["zero_stage"] == 3
