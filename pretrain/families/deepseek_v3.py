"""The deepseek_v3 family: DeepSeek-V3's decoder (`DeepseekV3ForCausalLM`), dense or with
DeepSeek-V3's experts (`model.num_experts` > 0).

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

Experts (DeepSeek-V3's MoE): every layer from `moe_first_dense_layers` on (transformers'
`first_k_dense_replace`) has a routed mixture of `num_experts` SwiGLU experts of
`moe_ffn_hidden_size` (`mlp.experts.M.*`) and one shared SwiGLU of `num_shared_experts` x that
width (`mlp.shared_experts.*`, tensor-parallel as the dense MLP) every token goes through. The
router (`model.moe_router: sigmoid`, `pretrain.model.moe.sigmoid_choice`) scores experts by
sigmoid; its per-expert bias `mlp.gate.e_score_correction_bias` (a buffer, fp32) only steers the
group-limited top-k and is moved after each step outside the gradient
(`model.moe_bias_update_rate`). Checkpoints on the Hub name experts one by one; transformers 5
stacks them as it loads them (`pretrain.model.mixtral.MixtralImport` reads both).
"""
from __future__ import annotations

from typing import Any

from pretrain.config import ModelConfig
from pretrain.errors import CheckpointError
from pretrain.families.base import (HIDDEN, NORM, NORMAL, ONES, RESIDUAL, ZEROS,
                                    AttentionWidths, Family, Parameter)
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
       if name not in ("q_proj", "k_proj", "v_proj", "o_proj")},
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
    # the router and experts (llama's rows), the shared experts (one SwiGLU of
    # num_shared_experts x moe_ffn_hidden_size, split as the dense MLP), the router's bias
    "gate": LLAMA_PARAMETERS["gate"],
    "shared_experts.gate_proj": Parameter(lambda c: (_shared(c), c.hidden_size), 0, NORMAL, HIDDEN,
                                          muon=True),
    "shared_experts.up_proj": Parameter(lambda c: (_shared(c), c.hidden_size), 0, NORMAL, HIDDEN,
                                        muon=True),
    "shared_experts.down_proj": Parameter(lambda c: (c.hidden_size, _shared(c)), 1, RESIDUAL,
                                          HIDDEN, muon=True),
    "e_score_correction_bias": Parameter(lambda c: (c.num_experts,), None, ZEROS, NORM),
    # a multi-token prediction module's own (`pretrain.model.mtp`): the norms of the token's
    # embedding and of the hidden state it continues, and their projection [e; h] -> h,
    # replicated (its output enters a decoder layer whole, as the residual stream does); its
    # head's norm, `shared_head.norm`, is the final norm's row
    "enorm": Parameter(lambda c: (c.hidden_size,), None, ONES, NORM),
    "hnorm": Parameter(lambda c: (c.hidden_size,), None, ONES, NORM),
    "eh_proj": Parameter(lambda c: (c.hidden_size, 2 * c.hidden_size), None, NORMAL, HIDDEN,
                         muon=True),
}

MTP_NAMES = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def _shared(cfg: ModelConfig) -> int:
    return cfg.num_shared_experts * cfg.expert_ffn_hidden_size


def moe_layer(cfg: ModelConfig, index: int) -> bool:
    """Layer `index`'s MLP is the mixture from `moe_first_dense_layers` on (transformers'
    `first_k_dense_replace`) when the model has experts."""
    return cfg.num_experts > 0 and index >= cfg.moe_first_dense_layers


def attention_names(cfg: ModelConfig) -> list[str]:
    """The latent attention's parameters, in the module's order."""
    queries = (["q_a_proj", "q_a_layernorm", "q_b_proj"] if cfg.q_lora_rank else ["q_proj"])
    return [f"self_attn.{name}.weight" for name in
            (*queries, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")]


def layer(cfg: ModelConfig, index: int) -> list[str]:
    """Decoder layer `index`'s tensors: the dense MLP's, or the router (and its bias), the
    routed experts and the shared experts."""
    names = ["input_layernorm.weight", *attention_names(cfg), "post_attention_layernorm.weight"]
    if not moe_layer(cfg, index):
        return names + mlp_names(cfg, False)
    shared = [f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")] \
        if cfg.num_shared_experts else []
    return names + mlp_names(cfg, True) + ["mlp.gate.e_score_correction_bias"] + shared


def mtp_layer(cfg: ModelConfig, depth: int) -> list[str]:
    """Multi-token prediction module `depth`'s tensors: a decoder layer's (numbered after
    the decoder's: DeepSeek-V3's MTP block is a mixture when the model has experts) and its own
    norms, projection and head norm. Its embedding and head are the model's (DeepSeek-V3's
    checkpoints carry copies, `embed_tokens` and `shared_head.head`: written on export, skipped
    on import)."""
    return [*layer(cfg, cfg.num_layers + depth), *MTP_NAMES]


def attention_widths(cfg: ModelConfig) -> AttentionWidths:
    """Every head scores over qk_nope + qk_rope features (its own key, expanded from the
    latent) and returns v_head_dim; a token caches its key-value latent and its rotary key
    (`pretrain.model.mla`), the same for every head; no projection fused."""
    values = cfg.num_heads * cfg.v_head_dim
    return AttentionWidths(queries=_queries(cfg), keys=_queries(cfg), values=values,
                           outputs=values, cached=cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                           concatenated=0)


def hf_config(cfg: ModelConfig) -> tuple[str, dict[str, Any]]:
    """`DeepseekV3Config` fields: without experts every layer dense (`first_k_dense_replace` =
    the layers); `num_nextn_predict_layers` the multi-token prediction modules (`model.mtp_depth`:
    transformers builds none and skips their weights), the interleaved rotary layout;
    transformers sets head_dim."""
    fields = common_hf_fields(cfg)
    fields.pop("head_dim")
    experts = {"first_k_dense_replace": cfg.num_layers}
    if cfg.num_experts:
        experts = {
            "first_k_dense_replace": cfg.moe_first_dense_layers,
            "n_routed_experts": cfg.num_experts, "num_experts_per_tok": cfg.experts_per_token,
            "moe_intermediate_size": cfg.expert_ffn_hidden_size,
            "n_shared_experts": cfg.num_shared_experts, "n_group": cfg.moe_groups,
            "topk_group": cfg.moe_topk_groups,
            "routed_scaling_factor": cfg.moe_routed_scaling_factor,
            "norm_topk_prob": cfg.moe_norm_topk_prob}
    return "DeepseekV3Config", {
        **fields, "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim, **experts,
        "num_nextn_predict_layers": cfg.mtp_depth, "rope_interleave": True}


def from_hf_config(hf: dict, source: str) -> dict[str, Any]:
    """`ModelConfig` fields of a DeepSeek-V3 config.json (its experts when a layer has them);
    `CheckpointError` for the non-interleaved rotary layout."""
    layers = int(hf.get("num_hidden_layers", 0))
    first_dense = int(hf.get("first_k_dense_replace") or 0)
    experts = int(hf.get("n_routed_experts", hf.get("num_local_experts")) or 0)
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
    # the modules config.json counts; `read_hf_dir` keeps those whose weights are there
    # (transformers' config counts one by default and saves none)
    fields.update(family="deepseek_v3", head_dim=fields["qk_rope_head_dim"],
                  mtp_depth=int(hf.get("num_nextn_predict_layers") or 0))
    if experts and first_dense < layers:
        try:
            fields.update(
                num_experts=experts, experts_per_token=int(hf["num_experts_per_tok"]),
                moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
                num_shared_experts=int(hf.get("n_shared_experts") or 0),
                moe_groups=int(hf.get("n_group") or 1),
                moe_topk_groups=int(hf.get("topk_group") or 1),
                moe_routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                moe_norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                moe_first_dense_layers=first_dense, moe_router="sigmoid",
                moe_aux_loss_coeff=0.0)
        except KeyError as exc:
            raise CheckpointError(f"{source} lacks the config field {exc.args[0]!r}") from None
    return fields


ARCHITECTURE_FIELDS = (*LLAMA_FIELDS, "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                       "qk_rope_head_dim", "v_head_dim", "moe_router", "num_shared_experts",
                       "moe_groups", "moe_topk_groups", "moe_routed_scaling_factor",
                       "moe_first_dense_layers", "mtp_depth")

DEEPSEEK_V3 = Family(
    name="deepseek_v3",
    hf_architectures=("DeepseekV3ForCausalLM",),
    hf_model_types=("deepseek_v3",),
    differs="multi-head latent attention (low-rank q and kv latents, a shared rotary key, the "
            "latent cached); DeepSeek-V3's experts: shared ones, sigmoid group-limited routing "
            "with a balancing bias, the first layers dense",
    parameters=PARAMETERS,
    layer=layer,
    modules={**MODULES, "attention": "pretrain.model.mla:LatentAttention",
             "mtp": "pretrain.model.mtp:MultiTokenPrediction"},
    moe_layer=moe_layer,
    buffers=("e_score_correction_bias",),
    hf_config=hf_config,
    from_hf_config=from_hf_config,
    query_scale="self_attn.q_b_proj.weight",  # muP's fold: unused, the family refuses muP
    architecture_fields=ARCHITECTURE_FIELDS,
    attention_widths=attention_widths,
    mtp_layer=mtp_layer,
)
