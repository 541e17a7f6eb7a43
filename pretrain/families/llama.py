"""The llama family: Llama 2 and 3 (`LlamaForCausalLM`), and Mixtral (`MixtralForCausalLM`),
its mixture-of-experts form (`model.num_experts` > 0).

Pre-norm decoder layers of grouped-query attention with rotary embeddings (plain, or Llama 3's
`rope_scaling: llama3`) and a SwiGLU MLP; RMSNorm; no biases.
"""
from __future__ import annotations

from typing import Any

from pretrain.config import ModelConfig
from pretrain.errors import CheckpointError
from pretrain.families.base import (EMBEDDING, HIDDEN, NORM, NORMAL, ONES, OUTPUT, RESIDUAL,
                                    Family, Parameter)


def _norm(cfg: ModelConfig) -> tuple[int, ...]:
    return (cfg.hidden_size,)


def _vocab(cfg: ModelConfig) -> tuple[int, ...]:
    return (cfg.vocab_size, cfg.hidden_size)


# dimension split over tensor-parallel ranks: output rows of column-parallel projections, input
# columns of row-parallel ones, vocabulary rows; norms and a mixture of experts' router whole
PARAMETERS: dict[str, Parameter] = {
    "embed_tokens": Parameter(_vocab, 0, NORMAL, EMBEDDING),
    "lm_head": Parameter(_vocab, 0, NORMAL, OUTPUT),
    "norm": Parameter(_norm, None, ONES, NORM),
    "input_layernorm": Parameter(_norm, None, ONES, NORM),
    "post_attention_layernorm": Parameter(_norm, None, ONES, NORM),
    "q_proj": Parameter(lambda c: (c.num_heads * c.head_dim, c.hidden_size), 0, NORMAL, HIDDEN, muon=True),
    "k_proj": Parameter(lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size), 0, NORMAL, HIDDEN, muon=True),
    "v_proj": Parameter(lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size), 0, NORMAL, HIDDEN, muon=True),
    "o_proj": Parameter(lambda c: (c.hidden_size, c.num_heads * c.head_dim), 1, RESIDUAL, HIDDEN, muon=True),
    "gate_proj": Parameter(lambda c: (c.ffn_hidden_size, c.hidden_size), 0, NORMAL, HIDDEN, muon=True),
    "up_proj": Parameter(lambda c: (c.ffn_hidden_size, c.hidden_size), 0, NORMAL, HIDDEN, muon=True),
    "down_proj": Parameter(lambda c: (c.hidden_size, c.ffn_hidden_size), 1, RESIDUAL, HIDDEN, muon=True),
    # a mixture of experts' router, mlp.gate.weight (E, h): replicated
    "gate": Parameter(lambda c: (c.num_experts, c.hidden_size), None, NORMAL, HIDDEN),
    # an expert's projections (mlp.experts.M.*): SwiGLU's, of the experts' inner size (Mixtral:
    # ffn_hidden_size; Qwen3-MoE's fine-grained experts: moe_ffn_hidden_size)
    "experts.gate_proj": Parameter(lambda c: (c.expert_ffn_hidden_size, c.hidden_size), 0, NORMAL, HIDDEN, muon=True),
    "experts.up_proj": Parameter(lambda c: (c.expert_ffn_hidden_size, c.hidden_size), 0, NORMAL, HIDDEN, muon=True),
    "experts.down_proj": Parameter(lambda c: (c.hidden_size, c.expert_ffn_hidden_size), 1, RESIDUAL, HIDDEN, muon=True),
}

ATTENTION = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "self_attn.o_proj.weight")


def mlp_names(cfg: ModelConfig, moe: bool) -> list[str]:
    """The MLP's parameters: SwiGLU's three, or (`moe`) a router and every expert's three (2-D,
    named like the dense MLP's: `mlp.experts.M.gate_proj.weight`)."""
    if not moe:
        return ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    return ["mlp.gate.weight"] + [f"mlp.experts.{e}.{p}_proj.weight"
                                  for e in range(cfg.num_experts) for p in ("gate", "up", "down")]


def every_layer_moe(cfg: ModelConfig, index: int) -> bool:
    """Mixtral: every layer's MLP is the mixture when the model has experts."""
    return cfg.num_experts > 0


def layer(cfg: ModelConfig, index: int) -> list[str]:
    return ["input_layernorm.weight", *ATTENTION, "post_attention_layernorm.weight",
            *mlp_names(cfg, every_layer_moe(cfg, index))]


def rope_config(cfg: ModelConfig) -> dict[str, Any]:
    """transformers' `rope_parameters` of the config."""
    if cfg.rope_scaling == "llama3":
        return {"rope_type": "llama3", "rope_theta": cfg.rope_theta,
                "factor": cfg.rope_scaling_factor, "low_freq_factor": cfg.rope_low_freq_factor,
                "high_freq_factor": cfg.rope_high_freq_factor,
                "original_max_position_embeddings": cfg.rope_original_max_positions}
    return {"rope_type": "default", "rope_theta": cfg.rope_theta}


def common_hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json fields every family of this stack writes alike."""
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, hidden_act="silu", max_position_embeddings=cfg.seq_length,
        rms_norm_eps=cfg.norm_eps, rope_parameters=rope_config(cfg),
        tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std,
        attention_bias=False)


def hf_config(cfg: ModelConfig) -> tuple[str, dict[str, Any]]:
    """(transformers config class, its fields): `LlamaConfig`, or `MixtralConfig` for a
    mixture of experts."""
    if cfg.num_experts:
        return "MixtralConfig", {**common_hf_fields(cfg), **mixtral_config_fields(cfg)}
    return "LlamaConfig", {**common_hf_fields(cfg), "mlp_bias": False}


def mixtral_config_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The `transformers.MixtralConfig` fields beyond the shared ones (no biases to name)."""
    return dict(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                router_aux_loss_coef=cfg.moe_aux_loss_coeff, router_jitter_noise=0.0,
                sliding_window=None, output_router_logits=False)


def is_mixtral(hf: dict) -> bool:
    return hf.get("model_type") == "mixtral" or \
        "MixtralForCausalLM" in (hf.get("architectures") or [])


# config.json fields that change the function but that our model does not implement
UNSUPPORTED = {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu"}


def rope_fields(hf: dict, source: str) -> dict[str, Any]:
    """`ModelConfig`'s rotary fields of a config.json: the default rotary embedding or Llama
    3's `llama3` scaling; `CheckpointError` for another scaling."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    fields: dict[str, Any] = {
        "rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if kind == "llama3":
        fields.update(rope_scaling="llama3", rope_scaling_factor=float(rope["factor"]),
                      rope_low_freq_factor=float(rope["low_freq_factor"]),
                      rope_high_freq_factor=float(rope["high_freq_factor"]),
                      rope_original_max_positions=int(rope["original_max_position_embeddings"]))
    elif kind != "default":
        raise CheckpointError(f"{source} uses rope scaling {rope!r}; supported: the default "
                              "rotary embedding and Llama 3's llama3 scaling")
    return fields


def common_fields_from_hf(hf: dict, source: str) -> dict[str, Any]:
    """The `ModelConfig` fields every family reads alike from a config.json."""
    for key, value in UNSUPPORTED.items():
        if hf.get(key, value) != value:
            raise CheckpointError(f"{source} has {key}={hf[key]!r}; this model supports only "
                                  f"{key}={value!r}")
    try:
        fields = dict(
            vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
            num_layers=int(hf["num_hidden_layers"]), num_heads=int(hf["num_attention_heads"]),
            num_kv_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
            ffn_hidden_size=int(hf["intermediate_size"]),
            seq_length=int(hf.get("max_position_embeddings", 2048)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init_std=float(hf.get("initializer_range", 0.02)))
        fields.update(rope_fields(hf, source))
    except KeyError as exc:
        raise CheckpointError(f"{source} lacks the config field {exc.args[0]!r}") from None
    fields["head_dim"] = int(hf.get("head_dim") or fields["hidden_size"] // fields["num_heads"])
    return fields


def from_hf_config(hf: dict, source: str) -> dict[str, Any]:
    """`ModelConfig` fields of a Llama or Mixtral config.json."""
    fields = common_fields_from_hf(hf, source)
    if is_mixtral(hf):
        if hf.get("sliding_window"):
            raise CheckpointError(f"{source} uses sliding-window attention (sliding_window="
                                  f"{hf['sliding_window']}); this model attends to the whole "
                                  "sequence")
        try:
            fields.update(num_experts=int(hf["num_local_experts"]),
                          experts_per_token=int(hf.get("num_experts_per_tok", 2)),
                          moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)))
        except KeyError as exc:
            raise CheckpointError(f"{source} lacks the config field {exc.args[0]!r}") from None
    return fields


# fields the weights of a checkpoint and the run that reads them must agree on
ARCHITECTURE_FIELDS = ("family", "vocab_size", "hidden_size", "num_layers", "num_heads",
                       "num_kv_heads", "head_dim", "ffn_hidden_size", "tie_embeddings",
                       "rope_theta", "rope_scaling", "norm_eps", "num_experts",
                       "experts_per_token", "moe_ffn_hidden_size", "moe_layer_interval",
                       "moe_norm_topk_prob")

# the building blocks: attention, the dense SwiGLU MLP, the routed mixture of SwiGLU experts
MODULES = {"attention": "pretrain.model.llama:Attention", "mlp": "pretrain.model.llama:MLP",
           "moe": "pretrain.model.moe:MoE"}
# the building blocks and Mixtral's checkpoint names of its experts (`export-hf`)
LLAMA_MODULES = {**MODULES, "hf_export": "pretrain.model.mixtral:MixtralExport"}

LLAMA = Family(
    name="llama",
    hf_architectures=("LlamaForCausalLM", "MixtralForCausalLM"),
    hf_model_types=("llama", "mixtral"),
    differs="the reference: GQA, RoPE (Llama 3's llama3 scaling), SwiGLU; Mixtral's experts",
    parameters=PARAMETERS,
    layer=layer,
    modules=LLAMA_MODULES,
    hf_config=hf_config,
    from_hf_config=from_hf_config,
    architecture_fields=ARCHITECTURE_FIELDS,
    moe_layer=every_layer_moe,
)
