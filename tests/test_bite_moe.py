"""Mixture of experts where tests/test_moe.py's numbers let a broken line pass: a capacity that
is not a whole number of places, and the z-loss without the balance loss."""
from __future__ import annotations

import dataclasses
import math

import torch

from tests.test_moe import CFG, _assert_close, _layer, _reference


def test_a_fractional_capacity_rounds_up():
    """factor 0.3 of 64 assignments over 4 experts: 4.8 places, so 5 (ceil), not 4; the per-token
    reference drops exactly the assignments past the fifth of each expert."""
    cfg = dataclasses.replace(CFG, moe_capacity_factor=0.3)
    layer, x = _layer(cfg, seed=3), torch.randn(1, 32, 64, generator=torch.Generator().manual_seed(2))
    capacity = math.ceil(0.3 * 32 * 2 / 4)
    assert capacity == 5
    with torch.no_grad():
        out = layer(x)
        ref_out, _, _, dropped = _reference(layer, x, k=2, capacity=capacity)
        _, _, _, dropped_at_4 = _reference(layer, x, k=2, capacity=4)
    assert 0 < dropped < dropped_at_4  # the two capacities drop different assignments
    _assert_close(out, ref_out, "output")
    assert layer.stats[3].item() == dropped


def test_the_z_loss_alone_reaches_the_router_gradient():
    """moe_aux_loss_coeff 0 and moe_z_loss_coeff > 0: the router's gradient still holds the
    z-loss's part (the per-token reference's, differentiated through the same weights)."""
    cfg = dataclasses.replace(CFG, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.5)
    layer, ref_layer = _layer(cfg), _layer(cfg)
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(4))
    g = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(5))
    (layer(x) * g).sum().backward()
    ref_out, _, z_loss, _ = _reference(ref_layer, x, k=2)
    ((ref_out * g).sum() + 0.5 * z_loss).backward()
    _assert_close(layer.gate.weight.grad, ref_layer.gate.weight.grad, "router")
