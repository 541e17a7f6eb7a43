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
