"""Conversion between our model and Hugging Face's class of its family (`LlamaForCausalLM`,
`MixtralForCausalLM`, `Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`: `pretrain.families`).

The parameter names are already Hugging Face's (see `pretrain.model.llama`), so a conversion
only handles the two differences:

- our embedding and lm_head have `cfg.padded_vocab_size(tp)` rows; Hugging Face has exactly
  `vocab_size`: the padded rows are dropped on export and added back (zeros) on import,
- with tied embeddings, Hugging Face checkpoints store only `model.embed_tokens.weight`, while
  our state dict (like `LlamaForCausalLM.state_dict()`) also names it `lm_head.weight`.

The `config.json` each family writes and reads is its own (`Family.hf_config`,
`Family.from_hf_config`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pretrain.config import ModelConfig
from pretrain.errors import CheckpointError
from pretrain.families import FAMILIES, family_of, family_of_hf_config

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


def to_hf_config(cfg: ModelConfig, **overrides) -> "transformers.PretrainedConfig":  # noqa: F821
    """The transformers config of the same architecture, of the family's class (a
    `MixtralConfig` or `Qwen3MoeConfig` for a mixture of experts); `overrides` set extra fields
    (e.g. bos_token_id / eos_token_id from the tokenizer)."""
    import transformers

    config_class, fields = family_of(cfg).hf_config(cfg)
    fields.update(overrides)
    return getattr(transformers, config_class)(**fields)


def hf_architecture(cfg: ModelConfig) -> str:
    """The transformers model class a `config.json` of `cfg` names: its config class's
    (`MixtralConfig` -> `MixtralForCausalLM`)."""
    config_class, _ = family_of(cfg).hf_config(cfg)
    return config_class.removesuffix("Config") + "ForCausalLM"


def model_fields_from_hf_config(hf: dict, *, source: str) -> dict:
    """`ModelConfig` fields of a Hugging Face `config.json` (as a dict) of any family's class.

    `CheckpointError` when no family reads it, or it uses something our model lacks (biases,
    another activation, a rope scaling other than Llama 3's, sliding windows).
    """
    family = family_of_hf_config(hf)
    if family is None:
        known = ", ".join(a for f in FAMILIES.values() for a in f.hf_architectures)
        raise CheckpointError(f"{source} is of no model family here (model_type="
                              f"{hf.get('model_type')!r}, architectures={hf.get('architectures')}): "
                              f"give a directory saved from transformers' {known}")
    return family.from_hf_config(hf, source)


def check_same_architecture(found: ModelConfig, expected: ModelConfig, *, source: str) -> None:
    """`CheckpointError` naming every architecture field where the weights' config differs."""
    fields = family_of(expected).fields_to_agree(found, expected)
    diffs = [f"model.{name}: run {getattr(expected, name)!r}, weights {getattr(found, name)!r}"
             for name in fields if getattr(found, name) != getattr(expected, name)]
    if diffs:
        raise CheckpointError(f"the weights in {source} do not fit the run's model config ("
                              + "; ".join(diffs) + "): set these model fields to the weights' "
                              "values, or start from other weights")


def expected_hf_keys(cfg: ModelConfig) -> set[str]:
    """The parameter names of this config (tied: no lm_head.weight): those of a Hugging Face
    checkpoint of its family. A mixture of experts has its router, `mlp.gate.weight`, and 2-D
    experts `mlp.experts.M.{gate,up,down}_proj.weight` (`mixtral_from_ours` stacks them)."""
    return set(family_of(cfg).parameter_names(cfg))


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
