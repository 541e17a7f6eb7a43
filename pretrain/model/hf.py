"""Conversion between our Llama and Hugging Face's `LlamaForCausalLM`.

The parameter names are already Hugging Face's (see `pretrain.model.llama`), so a conversion
only handles the two differences:

- our embedding and lm_head have `cfg.padded_vocab_size(tp)` rows; Hugging Face has exactly
  `vocab_size`: the padded rows are dropped on export and added back (zeros) on import,
- with tied embeddings, Hugging Face checkpoints store only `model.embed_tokens.weight`, while
  our state dict (like `LlamaForCausalLM.state_dict()`) also names it `lm_head.weight`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pretrain.config import ModelConfig
from pretrain.errors import CheckpointError

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


def to_hf_config(cfg: ModelConfig, **overrides) -> "transformers.LlamaConfig":  # noqa: F821
    """A `transformers.LlamaConfig` of the same architecture (a `MixtralConfig` for a mixture
    of experts); `overrides` set extra fields (e.g. bos_token_id / eos_token_id from the
    tokenizer)."""
    import transformers

    from pretrain.model.mixtral import mixtral_config_fields

    fields = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.seq_length,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std,
        attention_bias=False,
        mlp_bias=False,
    )
    if cfg.num_experts:
        for llama_only in ("attention_bias", "mlp_bias"):
            del fields[llama_only]
        fields.update(mixtral_config_fields(cfg), **overrides)
        return transformers.MixtralConfig(**fields)
    fields.update(overrides)
    return transformers.LlamaConfig(**fields)


# LlamaConfig fields that change the function but that our model does not implement.
_UNSUPPORTED = {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu"}
ARCHITECTURE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                       "ffn_hidden_size", "tie_embeddings", "rope_theta", "norm_eps",
                       "num_experts", "experts_per_token")


def model_fields_from_hf_config(hf: dict, *, source: str) -> dict:
    """`ModelConfig` fields of a Hugging Face Llama `config.json` (as a dict).

    `CheckpointError` when it is not a Llama, or uses something our model lacks (biases, another
    activation, rope scaling, a head_dim other than hidden_size / num_heads).
    """
    from pretrain.model.mixtral import is_mixtral, moe_fields_from_hf_config

    mixtral = is_mixtral(hf)
    if hf.get("model_type") != "llama" and "LlamaForCausalLM" not in (hf.get("architectures") or []) \
            and not mixtral:
        raise CheckpointError(f"{source} is not a Llama checkpoint, nor a Mixtral one (model_type="
                              f"{hf.get('model_type')!r}, architectures={hf.get('architectures')}): "
                              "give a directory saved from transformers' LlamaForCausalLM or "
                              "MixtralForCausalLM")
    if mixtral and hf.get("sliding_window"):
        raise CheckpointError(f"{source} uses sliding-window attention (sliding_window="
                              f"{hf['sliding_window']}); this model attends to the whole sequence")
    for key, value in _UNSUPPORTED.items():
        if hf.get(key, value) != value:
            raise CheckpointError(f"{source} has {key}={hf[key]!r}; this model supports only "
                                  f"{key}={value!r}")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise CheckpointError(f"{source} uses rope scaling {rope!r}; only the default rotary "
                              "embedding is supported")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    try:
        fields = dict(
            vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
            num_layers=int(hf["num_hidden_layers"]), num_heads=int(hf["num_attention_heads"]),
            num_kv_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
            ffn_hidden_size=int(hf["intermediate_size"]),
            seq_length=int(hf.get("max_position_embeddings", 2048)), rope_theta=float(theta),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init_std=float(hf.get("initializer_range", 0.02)))
        if mixtral:
            fields.update(moe_fields_from_hf_config(hf))
    except KeyError as exc:
        raise CheckpointError(f"{source} lacks the config field {exc.args[0]!r}") from None
    head_dim = hf.get("head_dim") or fields["hidden_size"] // fields["num_heads"]
    if head_dim * fields["num_heads"] != fields["hidden_size"]:
        raise CheckpointError(f"{source} has head_dim={head_dim} x num_attention_heads="
                              f"{fields['num_heads']} != hidden_size={fields['hidden_size']}; "
                              "this model needs head_dim = hidden_size / num_heads")
    return fields


def check_same_architecture(found: ModelConfig, expected: ModelConfig, *, source: str) -> None:
    """`CheckpointError` naming every architecture field where the weights' config differs."""
    diffs = [f"model.{name}: run {getattr(expected, name)!r}, weights {getattr(found, name)!r}"
             for name in ARCHITECTURE_FIELDS if getattr(found, name) != getattr(expected, name)]
    if diffs:
        raise CheckpointError(f"the weights in {source} do not fit the run's model config ("
                              + "; ".join(diffs) + "): set these model fields to the weights' "
                              "values, or start from other weights")


def expected_hf_keys(cfg: ModelConfig) -> set[str]:
    """The parameter names of this config (tied: no lm_head.weight): those of a Hugging Face
    Llama checkpoint. A mixture of experts has its router, `mlp.gate.weight`, and 2-D experts
    `mlp.experts.M.{gate,up,down}_proj.weight` (`mixtral_from_ours` stacks them)."""
    keys = {EMBED, "model.norm.weight"}
    if not cfg.tie_embeddings:
        keys.add(LM_HEAD)
    mlp = ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    if cfg.num_experts:
        mlp = ["mlp.gate.weight"] + [f"mlp.experts.{e}.{name}_proj.weight"
                                     for e in range(cfg.num_experts)
                                     for name in ("gate", "up", "down")]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        keys.update(p + s for s in (
            "input_layernorm.weight", "post_attention_layernorm.weight",
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", *mlp))
    return keys


def check_keys(found: set[str], expected: set[str], what: str) -> None:
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{what} does not match the model config: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}; check model.num_layers / tie_embeddings against the checkpoint")


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our (unsharded) state dict -> Hugging Face's: padded vocab rows dropped, tied head dropped.

    Unchanged tensors are shared, not copied; the cut vocabulary matrices are fresh tensors
    (safetensors refuses views that share storage).
    """
    sd = {k: v for k, v in state_dict.items() if not (cfg.tie_embeddings and k == LM_HEAD)}
    check_keys(set(sd), expected_hf_keys(cfg), "state dict")
    for key in (EMBED, LM_HEAD):
        if key in sd:
            sd[key] = sd[key][:cfg.vocab_size].clone()
    return sd


def from_hf_state_dict(hf_state_dict: dict[str, torch.Tensor], cfg: ModelConfig, *,
                       tensor_parallel: int = 1) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict -> ours: vocab rows padded with zeros to
    `cfg.padded_vocab_size(tensor_parallel)`; with tied embeddings `lm_head.weight` is the
    embedding tensor itself, as in `LlamaModel.state_dict()`."""
    sd = {k: v for k, v in hf_state_dict.items() if not (cfg.tie_embeddings and k == LM_HEAD)}
    check_keys(set(sd), expected_hf_keys(cfg), "Hugging Face state dict")
    padded = cfg.padded_vocab_size(tensor_parallel)
    for key in (EMBED, LM_HEAD):
        if key in sd:
            rows = sd[key].shape[0]
            if rows != cfg.vocab_size:
                raise CheckpointError(f"{key} has {rows} rows but model.vocab_size is "
                                      f"{cfg.vocab_size}: set model.vocab_size={rows}")
            sd[key] = F.pad(sd[key], (0, 0, 0, padded - rows))
    if cfg.tie_embeddings:
        sd[LM_HEAD] = sd[EMBED]
    return sd
