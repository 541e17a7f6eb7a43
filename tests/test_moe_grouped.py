"""The experts of a MoE layer as one grouped matmul (`torch._grouped_mm`) against the loop over
experts (`pretrain/model/moe.py`): output, auxiliary losses and every gradient, with and without
dropped assignments, fp32 and bf16; the grouped forward's host reads (none); the device rule;
and the expert-parallel dispatch with grouped local experts on 2 ranks.

torch 2.13's CPU build runs `_grouped_mm` (fp32, and bf16 with 16-byte rows), so these run on
CPU with `MoE.grouped` forced; the layer picks the grouped kernel by itself on CUDA only.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from pretrain.model.moe import grouped_mm_runs
from pretrain.testing.ranks import run_on_ranks
from tests.test_moe import CFG, HostReads, _assert_close, _layer, _reference


def _grouped_and_looped(cfg, dtype=torch.float32, seed=0):
    grouped, looped = _layer(cfg, seed), _layer(cfg, seed)
    grouped.grouped, looped.grouped = True, False
    return grouped.to(dtype), looped.to(dtype)


def _run(layer, x, g):
    x = x.clone().requires_grad_(True)
    out = layer(x)
    (out.float() * g).sum().backward()
    return out, x.grad, {n: p.grad for n, p in layer.named_parameters()}


@pytest.mark.parametrize("capacity_factor", [0.0, 0.3])
def test_the_grouped_experts_equal_the_loop_in_output_and_every_gradient(capacity_factor):
    """fp32, top-2 of 64 tokens over 4 experts; at capacity 0.3 (10 places each) assignments are
    dropped: they ride in the last expert's group with weight 0 and must add nothing, to the
    output or to any gradient (the per-token reference says what the layer gives)."""
    cfg = dataclasses.replace(CFG, moe_capacity_factor=capacity_factor)
    grouped, looped = _grouped_and_looped(cfg, seed=3)
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(2))
    g = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(5))
    out, x_grad, grads = _run(grouped, x, g)
    ref_out, ref_x_grad, ref_grads = _run(looped, x, g)
    dropped = grouped.stats[3].item()
    assert (dropped > 0) == (capacity_factor > 0)
    capacity = math.ceil(capacity_factor * 64 * 2 / 4) if capacity_factor else None
    with torch.no_grad():  # and both are the per-token reference's output
        per_token, _, _, ref_dropped = _reference(looped, x, k=2, capacity=capacity)
    assert ref_dropped == dropped
    _assert_close(out, per_token, "per-token output")
    _assert_close(out, ref_out, "output")
    _assert_close(x_grad, ref_x_grad, "input gradient")
    for name, grad in grads.items():
        _assert_close(grad, ref_grads[name], name)
    assert grads["gate.weight"].abs().max() > 0


def test_the_grouped_experts_equal_the_loop_in_bf16():
    """bf16 (hidden 64, ffn 96: 16-byte rows, the grouped kernel's alignment): within bf16's
    rounding of the loop (2^-7 of the largest element)."""
    grouped, looped = _grouped_and_looped(CFG, torch.bfloat16, seed=1)
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(8)).bfloat16()
    g = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(9))
    out, x_grad, grads = _run(grouped, x, g)
    ref_out, ref_x_grad, ref_grads = _run(looped, x, g)
    for name, a, b in [("output", out, ref_out), ("input", x_grad, ref_x_grad),
                       *((n, grads[n], ref_grads[n]) for n in grads)]:
        scale = b.float().abs().max().item()
        assert (a.float() - b.float()).abs().max().item() <= scale / 128, name


@pytest.mark.parametrize("capacity_factor", [0.0, 0.5])
def test_a_grouped_forward_reads_nothing_back_from_the_device(capacity_factor):
    """The grouped kernel takes each expert's rows as a device tensor (the running sum of the
    counts), so the forward never waits for the device; the loop reads the counts once."""
    layer = _layer(dataclasses.replace(CFG, moe_capacity_factor=capacity_factor))
    x = torch.randn(2, 32, 64)
    for grouped, expected in ((True, []), (False, ["tolist"])):
        layer.grouped = grouped
        with HostReads() as reads:
            layer(x)
        assert reads.calls == expected, grouped


def test_the_layer_takes_the_grouped_kernel_only_where_torch_has_one():
    """On CPU the loop (torch's CPU `_grouped_mm` is a matmul per group, no faster), bf16 or
    not; `MoE.grouped` None follows the device, True/False force it."""
    for dtype in (torch.float32, torch.bfloat16):  # bf16 rows and weights 16-byte aligned
        layer = _layer(CFG).to(dtype)
        tokens = torch.zeros(4, 64, dtype=dtype)
        assert not grouped_mm_runs(tokens, list(layer.experts))
        assert layer.grouped is None and not layer._grouped(tokens, list(layer.experts))


def _grouped_expert_parallel_on_ranks(rank: int, world_size: int) -> None:
    """The expert-parallel layer with grouped local experts against the looped one, same ranks
    and inputs: output and gradients equal, still one host read (the all-to-alls' counts)."""
    import torch.distributed as dist

    from tests.test_expert_parallel import _expert_parallel_layer

    group = dist.new_group(list(range(world_size)))
    reference = _layer(CFG, seed=4)
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(7))
    g = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(8))
    results = []
    for grouped in (True, False):
        layer = _expert_parallel_layer(CFG, group, reference, sequence_parallel=False)
        layer.grouped = grouped
        mine = x.clone().requires_grad_(True)
        with HostReads() as reads:
            out = layer(mine)
        assert reads.calls == ["tolist"]
        (out * g).sum().backward()
        results.append((out, mine.grad, {n: p.grad for n, p in layer.named_parameters()}))
    (out, x_grad, grads), (ref_out, ref_x_grad, ref_grads) = results
    _assert_close(out, ref_out, "output")
    _assert_close(x_grad, ref_x_grad, "input gradient")
    for name, grad in grads.items():
        _assert_close(grad, ref_grads[name], name)


@pytest.mark.slow
def test_expert_parallel_ranks_run_their_experts_grouped_as_the_loop_does(tmp_path):
    run_on_ranks(_grouped_expert_parallel_on_ranks, world_size=2, tmp_path=tmp_path)


# Qwen3-MoE's fine-grained experts: many narrow ones (16 of inner 32, beside a dense 96), top-4,
# the chosen probabilities not renormalised (norm_topk_prob false)
FINE = dataclasses.replace(CFG, family="qwen3", num_experts=16, experts_per_token=4,
                           moe_ffn_hidden_size=32, moe_norm_topk_prob=False)


@pytest.mark.parametrize("renormalise", [False, True])
def test_fine_grained_experts_grouped_equal_the_loop_and_transformers_block(renormalise):
    """The fine-grained shape: the grouped matmul equals the loop (output, every gradient), and
    both are transformers' `Qwen3MoeSparseMoeBlock` holding the same weights, with and without
    renormalising the top-k probabilities."""
    import transformers

    from pretrain.model.hf import to_hf_config

    cfg = dataclasses.replace(FINE, moe_norm_topk_prob=renormalise)
    grouped, looped = _grouped_and_looped(cfg, seed=4)
    assert looped.experts[0].gate_proj.weight.shape == (32, 64)
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(3))
    g = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(6))
    out, x_grad, grads = _run(grouped, x, g)
    ref_out, ref_x_grad, ref_grads = _run(looped, x, g)
    _assert_close(out, ref_out, "output")
    _assert_close(x_grad, ref_x_grad, "input gradient")
    for name, grad in grads.items():
        _assert_close(grad, ref_grads[name], name)

    block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(
        to_hf_config(cfg))
    experts = looped.experts
    with torch.no_grad():
        block.gate.weight.copy_(looped.gate.weight)
        block.experts.gate_up_proj.copy_(torch.stack(
            [torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in experts]))
        block.experts.down_proj.copy_(torch.stack([e.down_proj.weight for e in experts]))
        _assert_close(looped(x), block(x), "transformers' block")
