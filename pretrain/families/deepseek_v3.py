"""The deepseek_v3 family: DeepSeek-V3's decoder (`DeepseekV3ForCausalLM`), its layers dense for
now (the routed and shared experts come through the mixture-of-experts seam next).

Llama's pre-norm decoder whose attention is multi-head latent attention (DeepSeek-V2): the
queries come from a rank-`q_lora_rank` latent (`q_a_proj`, an RMSNorm, `q_b_proj`; one `q_proj`
when `q_lora_rank` is 0); keys and values from one `kv_lora_rank` latent per token
(`kv_a_proj_with_mqa`, whose last `qk_rope_head_dim` outputs are a rotary key shared by every
head, an RMSNorm, `kv_b_proj` expanding it into each head's non-rotary key and value). A head
scores over `qk_nope_head_dim + qk_rope_head_dim` features and returns `v_head_dim`. The rotary
features are DeepSeek's interleaved pairs (transformers' `rope_interleave: true`); the rotary
table is `qk_rope_head_dim` wide, which `model.head_dim` is in this family (as transformers'
`DeepseekV3Config.head_dim`). The two latent norms have their own epsilon, 1e-6, as
transformers builds them. No biases; the whole sequence attended.
"""
from __future__ import annotations

from typing import Any

from pretrain.config import ModelConfig
from pretrain.errors import CheckpointError
from pretrain.families.base import (HIDDEN, NORM, NORMAL, ONES, RESIDUAL, AttentionWidths,
                                    Family, Parameter)
from pretrain.families.llama import (ARCHITECTURE_FIELDS as LLAMA_FIELDS,
                                     MODULES, PARAMETERS as LLAMA_PARAMETERS,
                                     common_fields_from_hf, common_hf_fields, mlp_names)

LATENT_NORM_EPS = 1e-6  # q_a_layernorm's and kv_a_layernorm's (transformers' default, not rms_norm_eps)


def _qk(cfg: ModelConfig) -> int:
    return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim


def _queries(cfg: ModelConfig) -> int:
    return cfg.num_heads * _qk(cfg)


# llama's embeddings, norms and dense MLP, and the latent attention's projections: the
# per-head expansions (q_b_proj or q_proj, kv_b_proj) column-parallel by heads, o_proj
# row-parallel; the down-projections to the latents and their norms replicated (their gradients
# summed over the tensor group: `pretrain.model.mla`)
PARAMETERS: dict[str, Parameter] = {
    **{name: row for name, row in LLAMA_PARAMETERS.items()
       if name not in ("q_proj", "k_proj", "v_proj", "o_proj", "gate")},
    "q_proj": Parameter(lambda c: (_queries(c), c.hidden_size), 0, NORMAL, HIDDEN, muon=True),
    "q_a_proj": Parameter(lambda c: (c.q_lora_rank, c.hidden_size), None, NORMAL, HIDDEN, muon=True),
    "q_a_layernorm": Parameter(lambda c: (c.q_lora_rank,), None, ONES, NORM),
    "q_b_proj": Parameter(lambda c: (_queries(c), c.q_lora_rank), 0, NORMAL, HIDDEN, muon=True),
    "kv_a_proj_with_mqa": Parameter(lambda c: (c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size),
                                    None, NORMAL, HIDDEN, muon=True),
    "kv_a_layernorm": Parameter(lambda c: (c.kv_lora_rank,), None, ONES, NORM),
    "kv_b_proj": Parameter(lambda c: (c.num_heads * (c.qk_nope_head_dim + c.v_head_dim),
                                      c.kv_lora_rank), 0, NORMAL, HIDDEN, muon=True),
    "o_proj": Parameter(lambda c: (c.hidden_size, c.num_heads * c.v_head_dim), 1, RESIDUAL, HIDDEN,
                        muon=True),
}


def attention_names(cfg: ModelConfig) -> list[str]:
    """The latent attention's parameters, in the module's order."""
    queries = (["q_a_proj", "q_a_layernorm", "q_b_proj"] if cfg.q_lora_rank else ["q_proj"])
    return [f"self_attn.{name}.weight" for name in
            (*queries, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")]


def layer(cfg: ModelConfig, index: int) -> list[str]:
    """Decoder layer `index`'s parameters: every layer's MLP dense for now."""
    return ["input_layernorm.weight", *attention_names(cfg), "post_attention_layernorm.weight",
            *mlp_names(cfg, False)]


def attention_widths(cfg: ModelConfig) -> AttentionWidths:
    """Every head scores over qk_nope + qk_rope features (its own key, expanded from the
    latent) and returns v_head_dim; a token caches its key-value latent and its rotary key
    (`pretrain.model.mla`), the same for every head; no projection fused."""
    values = cfg.num_heads * cfg.v_head_dim
    return AttentionWidths(queries=_queries(cfg), keys=_queries(cfg), values=values,
                           outputs=values, cached=cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                           concatenated=0)


def hf_config(cfg: ModelConfig) -> tuple[str, dict[str, Any]]:
    """`DeepseekV3Config` fields: every layer dense (`first_k_dense_replace` = the layers), no
    multi-token prediction layer, the interleaved rotary layout; transformers sets head_dim."""
    fields = common_hf_fields(cfg)
    fields.pop("head_dim")
    return "DeepseekV3Config", {
        **fields, "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim, "first_k_dense_replace": cfg.num_layers,
        "num_nextn_predict_layers": 0, "rope_interleave": True}


def from_hf_config(hf: dict, source: str) -> dict[str, Any]:
    """`ModelConfig` fields of a DeepSeek-V3 config.json; `CheckpointError` for what this
    family does not implement yet: mixture-of-experts layers, the non-interleaved rotary
    layout."""
    layers = int(hf.get("num_hidden_layers", 0))
    first_dense = hf.get("first_k_dense_replace", 3)
    if first_dense is not None and int(first_dense) < layers and hf.get("n_routed_experts"):
        raise CheckpointError(f"{source} has mixture-of-experts layers (first_k_dense_replace="
                              f"{first_dense} < num_hidden_layers={layers}); deepseek_v3's "
                              "experts are not implemented yet: only all-dense models import")
    if not hf.get("rope_interleave", True):
        raise CheckpointError(f"{source} uses rope_interleave=false; deepseek_v3 rotates "
                              "DeepSeek's interleaved pairs only")
    fields = common_fields_from_hf(hf, source)
    try:
        fields.update(
            q_lora_rank=int(hf.get("q_lora_rank") or 0), kv_lora_rank=int(hf["kv_lora_rank"]),
            qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
            qk_rope_head_dim=int(hf["qk_rope_head_dim"]), v_head_dim=int(hf["v_head_dim"]))
    except KeyError as exc:
        raise CheckpointError(f"{source} lacks the config field {exc.args[0]!r}") from None
    fields.update(family="deepseek_v3", head_dim=fields["qk_rope_head_dim"])
    return fields


ARCHITECTURE_FIELDS = (*LLAMA_FIELDS, "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                       "qk_rope_head_dim", "v_head_dim")

DEEPSEEK_V3 = Family(
    name="deepseek_v3",
    hf_architectures=("DeepseekV3ForCausalLM",),
    hf_model_types=("deepseek_v3",),
    differs="multi-head latent attention (low-rank q and kv latents, a shared rotary key, the "
            "latent cached); experts not yet (dense layers)",
    parameters=PARAMETERS,
    layer=layer,
    modules={**MODULES, "attention": "pretrain.model.mla:LatentAttention"},
    moe_layer=lambda cfg, index: False,  # the experts come through the seam next
    hf_config=hf_config,
    from_hf_config=from_hf_config,
    query_scale="self_attn.q_b_proj.weight",  # muP's fold: unused, the family refuses muP
    architecture_fields=ARCHITECTURE_FIELDS,
    attention_widths=attention_widths,
)
