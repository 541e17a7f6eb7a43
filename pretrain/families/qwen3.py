"""The qwen3 family: Qwen3's dense decoders (`Qwen3ForCausalLM`).

Llama's decoder with one difference in attention: q and k go through an RMSNorm over each
head's `head_dim` features (one gain vector per layer, shared by the heads) after their
projection and before the rotary embedding; and `model.head_dim` is its own setting (128 in
every published size, whatever hidden_size / num_heads is). Tied or untied embeddings; no
biases; the whole sequence attended (the published dense models use no sliding window).
"""
from __future__ import annotations

from typing import Any

from pretrain.config import ModelConfig
from pretrain.errors import CheckpointError
from pretrain.families.llama import (ARCHITECTURE_FIELDS, ATTENTION, PARAMETERS as LLAMA_PARAMETERS,
                                     common_fields_from_hf, common_hf_fields, mlp_names)
from pretrain.families.base import NORM, ONES, Family, Parameter


def _head_norm(cfg: ModelConfig) -> tuple[int, ...]:
    return (cfg.head_dim,)


# llama's table plus the per-head norms: replicated vectors of head_dim, initialised to 1
PARAMETERS: dict[str, Parameter] = {
    **LLAMA_PARAMETERS,
    "q_norm": Parameter(_head_norm, None, ONES, NORM),
    "k_norm": Parameter(_head_norm, None, ONES, NORM),
}


def layer(cfg: ModelConfig) -> list[str]:
    return ["input_layernorm.weight", *ATTENTION, "self_attn.q_norm.weight",
            "self_attn.k_norm.weight", "post_attention_layernorm.weight", *mlp_names(cfg)]


def hf_config(cfg: ModelConfig) -> tuple[str, dict[str, Any]]:
    """`Qwen3Config` fields: the shared ones, full attention on every layer."""
    return "Qwen3Config", {**common_hf_fields(cfg), "use_sliding_window": False}


def from_hf_config(hf: dict, source: str) -> dict[str, Any]:
    """`ModelConfig` fields of a Qwen3 config.json; `CheckpointError` for sliding-window
    attention, which this model lacks."""
    if hf.get("use_sliding_window"):
        raise CheckpointError(f"{source} uses sliding-window attention (use_sliding_window="
                              "true); this model attends to the whole sequence")
    return {**common_fields_from_hf(hf, source), "family": "qwen3"}


QWEN3 = Family(
    name="qwen3",
    hf_architectures=("Qwen3ForCausalLM",),
    hf_model_types=("qwen3",),
    differs="RMSNorm on each q and k head before RoPE; head_dim independent of hidden/heads",
    parameters=PARAMETERS,
    layer=layer,
    modules={"attention": "pretrain.model.qwen3:Qwen3Attention"},
    hf_config=hf_config,
    from_hf_config=from_hf_config,
    normed_projection_width=lambda cfg: (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim,
    query_scale="self_attn.q_norm.weight",  # q_proj's scale is normalised away
    architecture_fields=ARCHITECTURE_FIELDS,
)
