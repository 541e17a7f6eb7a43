"""The Llama model: `build_model(cfg, seed=...)` gives an initialised `LlamaModel`.

- `llama.py`: the decoder, its loss and its seeded, layout-independent initialisation,
- `layers.py`: RMSNorm, rotary embeddings, and the tensor-parallel swap points,
- `hf.py`: conversion to and from Hugging Face's `LlamaForCausalLM`.
"""
from __future__ import annotations

from pretrain.config import ModelConfig
from pretrain.model.llama import LlamaModel, causal_lm_loss, init_weights


def build_model(cfg: ModelConfig, *, seed: int, tp_group=None) -> LlamaModel:
    """Construct a `LlamaModel` and initialise it from `seed` (see `init_weights`)."""
    model = LlamaModel(cfg, tp_group=tp_group)
    init_weights(model, seed)
    return model


__all__ = ["LlamaModel", "build_model", "causal_lm_loss", "init_weights"]
