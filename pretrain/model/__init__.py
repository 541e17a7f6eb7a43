"""The Llama model: `build_model(cfg, seed=...)` gives an initialised `LlamaModel`.

- `llama.py`: the decoder, its loss, its seeded, layout-independent initialisation, and the
  tensor-parallel layout of its parameters (`shard_of`, `gather_full_state_dict`),
- `layers.py`: RMSNorm, rotary embeddings, and the tensor-parallel swap points,
- `tensor_parallel.py`: Megatron-style collectives, sharded layers, vocab-parallel loss,
- `hf.py`: conversion to and from Hugging Face's `LlamaForCausalLM`.
"""
from __future__ import annotations

from pretrain.config import ModelConfig
from pretrain.model.llama import (LlamaModel, causal_lm_loss, gather_full_state_dict,
                                  init_weights, shard_of, tensor_partition_dim)


def build_model(cfg: ModelConfig, *, seed: int, tp_group=None,
                sequence_parallel: bool = False) -> LlamaModel:
    """Construct a `LlamaModel` and initialise it from `seed` (see `init_weights`): every
    tensor-parallel layout of the same seed holds shards of bitwise the same model."""
    model = LlamaModel(cfg, tp_group=tp_group, sequence_parallel=sequence_parallel)
    init_weights(model, seed)
    return model


__all__ = ["LlamaModel", "build_model", "causal_lm_loss", "gather_full_state_dict",
           "init_weights", "shard_of", "tensor_partition_dim"]
