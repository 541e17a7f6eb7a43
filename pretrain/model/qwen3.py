"""The qwen3 family's module (`pretrain.families.qwen3`): Llama's attention with an RMSNorm on
each q and k head before the rotary embedding, as `transformers.Qwen3Attention`.

The two gains (`self_attn.q_norm.weight`, `self_attn.k_norm.weight`, head_dim each) are shared
by every head of the layer. Under tensor parallelism a rank holds some of the heads, so its
gradient of a gain is a partial sum over them: the norms reduce it over the tensor group once
per step, as the sequence-parallel norms do (`RMSNorm(sequence_parallel_group=)`). Under
context parallelism a rank normalises the heads of its own chunk of the sequence, before the
all-to-all; its gradient is its chunk's, like every other weight's.
"""
from __future__ import annotations

import torch

from pretrain.config import ModelConfig
from pretrain.model.layers import RMSNorm
from pretrain.model.llama import Attention
from pretrain.model.tensor_parallel import tp_world_size


class Qwen3Attention(Attention):
    """`Attention` whose q and k heads are RMS-normalised (over head_dim) before RoPE."""

    def __init__(self, cfg: ModelConfig, *, tp_group=None, sequence_parallel: bool = False,
                 cp_group=None, context_kind: str = "ulysses") -> None:
        super().__init__(cfg, tp_group=tp_group, sequence_parallel=sequence_parallel,
                         cp_group=cp_group, context_kind=context_kind)
        heads_group = tp_group if tp_world_size(tp_group) > 1 else None  # heads split over it
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, sequence_parallel_group=heads_group)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, sequence_parallel_group=heads_group)

    def heads_before_rotary(self, q: torch.Tensor,
                            k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)
