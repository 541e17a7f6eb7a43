"""The decoder of every model family (`pretrain.families`): `build_model(cfg, seed=...)` gives an
initialised `LlamaModel` of `cfg.family`.

- `llama.py`: the decoder, its loss, its seeded, layout-independent initial values, and the
  tensor-parallel layout of its parameters (`shard_of`, `gather_full_state_dict`),
- `pipeline.py`: the same model as DeepSpeed pipeline stages,
- `form.py`: flat or pipeline (`ModelForm`), parameters under Hugging Face names, and the one
  loop that copies full weights into this rank's shards (`copy_full_weights`, `init_weights`),
- `build.py`: initialised models of either form, the one for a run's layout, and their
  decoder layers compiled (`compile_blocks`),
- `layers.py`: RMSNorm, rotary embeddings, and the tensor-parallel swap points,
- `tensor_parallel.py`: Megatron-style collectives, sharded layers, vocab-parallel loss,
- `context_parallel.py`: the sequence in chunks over context ranks (DeepSpeed-Ulysses all-to-all),
- `qwen3.py`: the qwen3 family's attention (q/k RMSNorm per head),
- `hf.py`: conversion to and from each family's Hugging Face class.
"""
from __future__ import annotations

import torch

from pretrain.config import Precision
from pretrain.model.build import (build_flat_pipeline, build_for_layout, build_model,
                                  build_pipeline_model, compile_blocks, compile_report,
                                  construct_for_layout, tensor_parallel_group)
from pretrain.model.form import (ModelForm, canonical_buffers, canonical_parameters,
                                 copy_full_weights, init_weights)
from pretrain.model.layers import defer_sequence_parallel_grads
from pretrain.model.llama import (LlamaModel, causal_lm_loss, gather_full_state_dict, shard_of,
                                  tensor_partition_dim)

# The torch dtype of each training precision: the one table (training, telemetry, export).
DTYPES = {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16,
          Precision.FP16: torch.float16}

__all__ = ["DTYPES", "LlamaModel", "ModelForm", "build_flat_pipeline", "build_for_layout", "build_model",
           "build_pipeline_model", "canonical_buffers", "canonical_parameters", "causal_lm_loss", "compile_blocks",
           "compile_report", "construct_for_layout", "copy_full_weights",
           "defer_sequence_parallel_grads",
           "gather_full_state_dict", "init_weights", "shard_of", "tensor_parallel_group",
           "tensor_partition_dim"]
