"""DeepSeek-V3's router pieces (`pretrain.model.moe.sigmoid_choice`, `updated_expert_bias`)
against transformers' `DeepseekV3TopkRouter`: sigmoid scores, the expert bias steering the
choice only, group-limited top-k, renormalised and scaled weights."""
from __future__ import annotations

import pytest
import torch
import transformers

from pretrain.model.moe import sigmoid_choice, updated_expert_bias


def _sorted(experts: torch.Tensor, weights: torch.Tensor):
    order = experts.argsort(dim=-1)
    return experts.gather(1, order), weights.gather(1, order)


@pytest.mark.parametrize("groups, topk_groups, renormalise", [(1, 1, True), (4, 2, True),
                                                               (4, 1, False)])
def test_sigmoid_choice_is_transformers_deepseek_v3_router(groups, topk_groups, renormalise):
    """16 experts, top 4, a bias large enough to change choices: the same experts and weights
    as transformers' router holding the same weight and bias; with groups the choice stays in
    the best groups."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = transformers.DeepseekV3Config(
        hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=groups,
        topk_group=topk_groups, norm_topk_prob=renormalise, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=generator) * 0.3)
        router.e_score_correction_bias.copy_(torch.randn(16, generator=generator) * 0.2)
    x = torch.randn(64, 32, generator=generator)
    logits, their_weights, their_experts = router(x)
    experts, weights, scores = sigmoid_choice(
        logits, top_k=4, bias=router.e_score_correction_bias, groups=groups,
        topk_groups=topk_groups, renormalise=renormalise, scaling=2.5)
    ours, theirs = _sorted(experts, weights), _sorted(their_experts, their_weights)
    assert torch.equal(ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-6, atol=0)
    unbiased, _, _ = sigmoid_choice(logits, top_k=4, groups=groups, topk_groups=topk_groups)
    assert not torch.equal(unbiased.sort(dim=-1).values, ours[0])  # the bias steers the choice
    if groups > 1:  # every chosen expert in one of the token's topk_groups groups
        assert all(len(set((row // (16 // groups)).tolist())) <= topk_groups for row in experts)
    assert torch.equal(scores, torch.sigmoid(logits))


def test_the_bias_moves_toward_balance_by_its_rate():
    """Over the mean load (5): down by the rate; under it: up; at it: unchanged."""
    bias = torch.tensor([0.0, 0.1, -0.1, 0.0])
    new = updated_expert_bias(bias, torch.tensor([9.0, 1.0, 5.0, 5.0]), rate=0.01)
    torch.testing.assert_close(new, torch.tensor([-0.01, 0.11, -0.1, 0.0]))


def _deepseek_moe(*more: str):
    from pretrain.config import load_config

    return load_config(None, ["model.preset=tiny", "model.family=deepseek_v3",
                              "model.num_kv_heads=4", "model.num_layers=3", "model.num_experts=8",
                              "model.experts_per_token=3", "model.moe_ffn_hidden_size=32",
                              "model.moe_router=sigmoid", "model.moe_groups=2",
                              "model.moe_topk_groups=1", "model.num_shared_experts=1",
                              "model.moe_first_dense_layers=1", *more]).model


def test_a_step_moves_each_experts_bias_by_the_rate_as_its_load_says():
    """DeepSeek-V3's layers from moe_first_dense_layers on are the mixture, with a shared
    expert and a zero fp32 bias buffer (kept fp32 in a bf16 model, not a parameter); after a
    step of two micro-batches' forwards `collect_stats` moves each layer's bias by -rate * sign(load -
    mean load) of that layer's counted choices, and a step without forwards moves nothing."""
    from pretrain.model.build import build_model
    from pretrain.model.moe import collect_stats, moe_layers

    cfg = _deepseek_moe()
    model = build_model(cfg, seed=3)
    layers = moe_layers(model)
    assert [layer.layer_index for layer in layers] == [1, 2]
    assert type(model.model.layers[0].mlp).__name__ == "MLP"
    assert all(layer.shared_experts.gate_proj.weight.shape == (32, 64) for layer in layers)
    names = dict(model.named_parameters())
    assert "model.layers.1.mlp.gate.e_score_correction_bias" not in names
    assert torch.equal(model.state_dict()["model.layers.1.mlp.gate.e_score_correction_bias"],
                       torch.zeros(8))
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        ids = torch.randint(0, 512, (2, 32), generator=gen)
        model(ids, labels=ids)  # training forwards count the choices
    rate = 0.01
    record = collect_stats(model, device="cpu", num_layers=3, num_experts=8,
                           bias_update_rate=rate)
    for layer, tokens in zip(layers, record["moe_expert_tokens"]):
        load = torch.tensor(tokens, dtype=torch.float32)
        expected = -rate * torch.sign(load - load.mean())
        assert expected.abs().sum() > 0  # not balanced: some bias moves
        assert torch.equal(layer.gate.e_score_correction_bias, expected), (tokens, expected)
    assert record["moe_expert_bias"] == [layer.gate.e_score_correction_bias.tolist()
                                         for layer in layers]  # reported after the step
    collect_stats(model, device="cpu", num_layers=3, num_experts=8, bias_update_rate=rate)
    assert torch.equal(layers[0].gate.e_score_correction_bias,
                       -rate * torch.sign(torch.tensor(record["moe_expert_tokens"][0]).float()
                                          - sum(record["moe_expert_tokens"][0]) / 8))
    model.to(torch.bfloat16)
    assert layers[0].gate.e_score_correction_bias.dtype == torch.float32
    assert layers[0].gate.weight.dtype == torch.bfloat16
