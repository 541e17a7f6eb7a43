"""The qwen3 family: Qwen3's dense decoders (`Qwen3ForCausalLM`), and Qwen3-MoE
(`Qwen3MoeForCausalLM`), its mixture-of-experts form (`model.num_experts` > 0).

Llama's decoder with one difference in attention: q and k go through an RMSNorm over each
head's `head_dim` features (one gain vector per layer, shared by the heads) after their
projection and before the rotary embedding; and `model.head_dim` is its own setting (128 in
every published size, whatever hidden_size / num_heads is). Tied or untied embeddings; no
biases; the whole sequence attended (the published dense models use no sliding window).

Qwen3-MoE: the same attention; layer i's MLP is a routed mixture of `num_experts` fine-grained
SwiGLU experts of `moe_ffn_hidden_size` each when (i + 1) % `moe_layer_interval` == 0
(Hugging Face's `decoder_sparse_step`), else the dense SwiGLU of `ffn_hidden_size`; the router's
softmax top-k renormalised (`moe_norm_topk_prob`, Hugging Face's `norm_topk_prob`) or not. The
Hub's checkpoints name each expert's projections as ours (`mlp.experts.M.gate_proj.weight`);
transformers 5 stacks them as it loads them (`pretrain.model.mixtral.MixtralImport` reads both).
"""
from __future__ import annotations

from typing import Any

from pretrain.config import ModelConfig
from pretrain.errors import CheckpointError
from pretrain.families.llama import (ARCHITECTURE_FIELDS, ATTENTION, MODULES,
                                     PARAMETERS as LLAMA_PARAMETERS, common_fields_from_hf,
                                     common_hf_fields, mlp_names)
from pretrain.families.base import NORM, ONES, Family, Parameter


def _head_norm(cfg: ModelConfig) -> tuple[int, ...]:
    return (cfg.head_dim,)


# llama's table plus the per-head norms: replicated vectors of head_dim, initialised to 1
PARAMETERS: dict[str, Parameter] = {
    **LLAMA_PARAMETERS,
    "q_norm": Parameter(_head_norm, None, ONES, NORM),
    "k_norm": Parameter(_head_norm, None, ONES, NORM),
}


def moe_layer(cfg: ModelConfig, index: int) -> bool:
    """Qwen3-MoE: layer `index`'s MLP is the mixture every `moe_layer_interval` layers (the
    last of each run of that many), as transformers' `decoder_sparse_step`."""
    return cfg.num_experts > 0 and (index + 1) % cfg.moe_layer_interval == 0


def layer(cfg: ModelConfig, index: int) -> list[str]:
    return ["input_layernorm.weight", *ATTENTION, "self_attn.q_norm.weight",
            "self_attn.k_norm.weight", "post_attention_layernorm.weight",
            *mlp_names(cfg, moe_layer(cfg, index))]


def hf_config(cfg: ModelConfig) -> tuple[str, dict[str, Any]]:
    """`Qwen3Config` fields: the shared ones, full attention on every layer; with experts
    `Qwen3MoeConfig`'s."""
    fields = {**common_hf_fields(cfg), "use_sliding_window": False}
    if not cfg.num_experts:
        return "Qwen3Config", fields
    return "Qwen3MoeConfig", {
        **fields, "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.experts_per_token,
        "moe_intermediate_size": cfg.expert_ffn_hidden_size,
        "decoder_sparse_step": cfg.moe_layer_interval, "mlp_only_layers": [],
        "norm_topk_prob": cfg.moe_norm_topk_prob, "router_aux_loss_coef": cfg.moe_aux_loss_coeff,
        "output_router_logits": False}


def is_qwen3_moe(hf: dict) -> bool:
    return hf.get("model_type") == "qwen3_moe" or \
        "Qwen3MoeForCausalLM" in (hf.get("architectures") or [])


def from_hf_config(hf: dict, source: str) -> dict[str, Any]:
    """`ModelConfig` fields of a Qwen3 or Qwen3-MoE config.json; `CheckpointError` for
    sliding-window attention and dense layers listed by index (`mlp_only_layers`), which this
    model lacks."""
    if hf.get("use_sliding_window"):
        raise CheckpointError(f"{source} uses sliding-window attention (use_sliding_window="
                              "true); this model attends to the whole sequence")
    fields = {**common_fields_from_hf(hf, source), "family": "qwen3"}
    if not is_qwen3_moe(hf):
        return fields
    if hf.get("mlp_only_layers"):
        raise CheckpointError(f"{source} makes layers {hf['mlp_only_layers']} dense "
                              "(mlp_only_layers); this model places its mixture layers by "
                              "decoder_sparse_step only (model.moe_layer_interval)")
    try:
        fields.update(
            num_experts=int(hf.get("num_experts", hf.get("num_local_experts"))),
            experts_per_token=int(hf["num_experts_per_tok"]),
            moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
            moe_layer_interval=int(hf.get("decoder_sparse_step", 1)),
            moe_norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)))
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"{source} lacks a Qwen3-MoE config field ({exc}): num_experts, "
                              "num_experts_per_tok, moe_intermediate_size") from None
    return fields


QWEN3 = Family(
    name="qwen3",
    hf_architectures=("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
    hf_model_types=("qwen3", "qwen3_moe"),
    differs="RMSNorm on each q and k head before RoPE; head_dim independent of hidden/heads; "
            "Qwen3-MoE's fine-grained experts every moe_layer_interval layers",
    parameters=PARAMETERS,
    layer=layer,
    moe_layer=moe_layer,
    modules={**MODULES, "attention": "pretrain.model.qwen3:Qwen3Attention"},
    hf_config=hf_config,
    from_hf_config=from_hf_config,
    normed_projection_width=lambda cfg: (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim,
    query_scale="self_attn.q_norm.weight",  # q_proj's scale is normalised away
    architecture_fields=ARCHITECTURE_FIELDS,
)
