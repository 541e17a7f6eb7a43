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
    """A `transformers.LlamaConfig` of the same architecture; `overrides` set extra fields
    (e.g. bos_token_id / eos_token_id from the tokenizer)."""
    import transformers

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
    fields.update(overrides)
    return transformers.LlamaConfig(**fields)


def expected_hf_keys(cfg: ModelConfig) -> set[str]:
    """The keys of a Hugging Face Llama checkpoint of this config (tied: no lm_head.weight)."""
    keys = {EMBED, "model.norm.weight"}
    if not cfg.tie_embeddings:
        keys.add(LM_HEAD)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        keys.update(p + s for s in (
            "input_layernorm.weight", "post_attention_layernorm.weight",
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
            "mlp.down_proj.weight"))
    return keys


def _check_keys(found: set[str], expected: set[str], what: str) -> None:
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
    _check_keys(set(sd), expected_hf_keys(cfg), "state dict")
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
    _check_keys(set(sd), expected_hf_keys(cfg), "Hugging Face state dict")
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
