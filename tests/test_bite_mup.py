"""muP's base width and base head dimension as the model reads them, at values other than the
proxy width 64 every tests/test_mup.py model uses (a rule reading 64 instead passes there)."""
from __future__ import annotations

import math

import pytest

from pretrain.model import build_model
from pretrain.model import mup
from tests.test_mup import model_cfg


def test_the_base_width_and_base_head_dim_set_the_groups_and_the_attention_scale():
    cfg = model_cfg(128, "mup", base=32, mup_base_head_dim=16)  # m = 4; head_dim 32
    model = build_model(cfg, seed=0)
    groups = mup.optimizer_groups(model, lr=1e-2, weight_decay=0.1, cfg=cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    lrs = {names[id(p)]: g["lr"] for g in groups for p in g["params"]}
    assert lrs["model.layers.0.mlp.up_proj.weight"] == pytest.approx(1e-2 / 4)
    assert lrs["lm_head.weight"] == pytest.approx(1e-2)
    assert model.lm_head.output_multiplier == pytest.approx(1 / 4)
    scale = model.model.layers[0].self_attn.softmax_scale
    assert scale == pytest.approx(math.sqrt(16) / 32)  # not base 32 / 4 heads = 8
