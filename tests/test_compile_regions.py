"""`compile_blocks` at ZeRO-3: the layers' eager projections are one function, so dynamo's
guards (which check the identity of the function a layer calls) let every layer reuse the first
layer's compiled graph instead of compiling one graph per layer. No compile runs here: the
layers are only marked for compilation, which happens at their first forward."""
from __future__ import annotations

import torch

from pretrain.config import load_config
from pretrain.model import build_model, compile_blocks
from pretrain.model.llama import DecoderLayer, fused_projections


def test_zero3_layers_share_one_eager_projection(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    cfg = load_config(None, ["model.preset=tiny", "model.num_layers=3"]).model
    model = build_model(cfg, seed=0)
    for param in model.parameters():
        param.ds_id = 0  # what DeepSpeed's ZeRO-3 partitioning marks its parameters with
    assert compile_blocks(model, cache_dir=tmp_path / "cache") == 3
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    projections = {id(part.project) for layer in layers for part in (layer.self_attn, layer.mlp)}
    assert len(projections) == 1, "each layer got its own wrapper: dynamo compiles each again"
    (shared,) = {part.project for part in (layers[0].self_attn, layers[0].mlp)}
    assert shared is not fused_projections  # the eager wrapper, not the traced function
    x = torch.randn(2, 4, cfg.hidden_size)
    attn = layers[0].self_attn
    ours = shared(x, [attn.q_proj, attn.k_proj, attn.v_proj], attn.qkv_sizes)
    reference = fused_projections(x, [attn.q_proj, attn.k_proj, attn.v_proj], attn.qkv_sizes)
    assert all(torch.equal(a, b) for a, b in zip(ours, reference))
