"""The deepseek_v3 family's attention (`pretrain.families.deepseek_v3`): multi-head latent
attention as `transformers.DeepseekV3Attention` computes it.

Per token: queries q = q_b_proj(norm(q_a_proj(x))) (or q_proj(x)), each head's
[nope | rope] features; one latent c = norm(kv_a_proj_with_mqa(x)[:kv_lora_rank]) and one
rotary key k_rope = kv_a_proj_with_mqa(x)[kv_lora_rank:], shared by every head; kv_b_proj(c)
gives each head's non-rotary key and its value. A head's score is q.[k_nope | k_rope] scaled by
1/sqrt(qk_nope_head_dim + qk_rope_head_dim); o_proj maps the heads' v_head_dim outputs back.

The rotary features are DeepSeek's interleaved pairs (x0, x1), (x2, x3), ...: they are taken
as evens then odds and rotated by halves with the model's rotary table (`apply_rotary`), which
is transformers' `apply_rotary_pos_emb_interleave` term for term (its output is in that order
too; q.k is the same sum either way).

Tensor parallelism: a rank holds num_heads/tp heads: q_b_proj (or q_proj) and kv_b_proj are
column-parallel by whole heads, o_proj row-parallel (one all-reduce, or a reduce-scatter under
sequence parallelism, after it). The down-projections to the latents (q_a_proj,
kv_a_proj_with_mqa) and their norms are replicated: every rank computes them whole from the
gathered input, but feeds only its heads with them, so its gradients of their weights are
partial sums, summed over the tensor group once per step (`SequenceShardedWeightGrad`, as
Qwen3's q/k norms), and the input's gradient is summed by `column_parallel_input`'s backward
like the column-parallel projections'. Context parallelism exchanges the expanded q, k, v for
the whole sequence of 1/N of the heads, as Llama's attention does.

Decoding caches the compressed form (`LayerCache`: its keys are the rotary keys (B, 1, S,
qk_rope_head_dim), its values the normalised latents (B, 1, S, kv_lora_rank)): kv_lora_rank +
qk_rope_head_dim elements a token and layer, whatever the heads; each step expands the cached
latents again through kv_b_proj.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from pretrain.config import ModelConfig
from pretrain.families.deepseek_v3 import LATENT_NORM_EPS
from pretrain.model.context_parallel import heads_to_sequence, sequence_to_heads
from pretrain.model.documents import Boundaries, document_attention
from pretrain.model.layers import RMSNorm, apply_rotary, column_linear, row_linear
from pretrain.model.llama import LayerCache, attention_backends
from pretrain.model.tensor_parallel import (SequenceShardedWeightGrad, column_parallel_input,
                                            tp_world_size)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Interleaved rotary pairs (x0, x1, x2, x3, ...) as (x0, x2, ..., x1, x3, ...)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class LatentAttention(nn.Module):
    """Causal multi-head latent attention (DeepSeek-V2/V3) with interleaved rotary features."""

    def __init__(self, cfg: ModelConfig, *, tp_group=None, sequence_parallel: bool = False,
                 cp_group=None, context_kind: str = "ulysses") -> None:
        super().__init__()
        if cp_group is not None and context_kind != "ulysses":  # the layout check refuses it
            raise ValueError(f"latent attention runs Ulysses context parallelism, not {context_kind}")
        h, heads = cfg.hidden_size, cfg.num_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        qk = self.nope + self.rope
        self.softmax_scale = qk ** -0.5
        self.tp_group, self.sequence_parallel, self.cp_group = tp_group, sequence_parallel, cp_group
        tp = tp_world_size(tp_group)
        heads_group = tp_group if tp > 1 else None  # the heads split over it
        replicated: list[nn.Linear] = []
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS,
                                         sequence_parallel_group=heads_group)
            self.q_b_proj = column_linear(cfg.q_lora_rank, heads * qk, tp_group=tp_group)
            replicated.append(self.q_a_proj)
        else:
            self.q_proj = column_linear(h, heads * qk, tp_group=tp_group)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, LATENT_NORM_EPS,
                                      sequence_parallel_group=heads_group)
        self.kv_b_proj = column_linear(self.kv_rank, heads * (self.nope + self.v_dim),
                                       tp_group=tp_group)
        self.o_proj = row_linear(heads * self.v_dim, h, tp_group=tp_group,
                                 sequence_parallel=sequence_parallel)
        replicated.append(self.kv_a_proj_with_mqa)
        for linear in replicated:  # partial gradients on each rank: summed once per step
            linear.weight_grad = SequenceShardedWeightGrad(heads_group)
            linear.weight_grad.attach(linear.weight)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerCache | None = None,
                document_ids: torch.Tensor | None = None,
                boundaries: Boundaries | None = None) -> torch.Tensor:
        """As `pretrain.model.llama.Attention.forward`; `cache` holds the latents and rotary
        keys of the earlier positions (see the module docstring)."""
        x = column_parallel_input(x, self.tp_group, sequence_parallel=self.sequence_parallel)
        B, T, _ = x.shape
        if hasattr(self, "q_a_proj"):
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(B, T, -1, self.nope + self.rope)  # (B, T, heads here, qk)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)  # (B, T, kv_lora_rank)
        q_rope = apply_rotary(_deinterleave(q_rope), cos, sin)  # cos/sin: x's positions
        k_rope = apply_rotary(_deinterleave(k_rope)[:, :, None], cos, sin)  # (B, T, 1, rope)
        causal = True
        if cache is not None:  # the compressed cache: (B, 1, positions, width)
            if self.cp_group is not None:
                raise ValueError("context parallelism is for training: generate with context 1")
            k_rope, latent, causal = cache.extend(k_rope.transpose(1, 2), latent[:, None])
            k_rope, latent = k_rope.transpose(1, 2), latent[:, 0]
        S = latent.shape[1]
        kv = self.kv_b_proj(latent).view(B, S, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # (B, S, heads here, .)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)), dim=-1)
        if self.cp_group is not None:  # (B, T/N, heads, .) -> (B, T, heads/N, .)
            q, k, v = (sequence_to_heads(t.contiguous(), self.cp_group) for t in (q, k, v))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, .)
        if document_ids is not None:
            if cache is not None:
                raise ValueError("document masking is for training: a prompt is one document")
            y = document_attention(q, k, v, document_ids, scale=self.softmax_scale,
                                   boundaries=boundaries)
        else:
            backends = attention_backends(q.device.type, q.dtype)
            with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                y = F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                   scale=self.softmax_scale)
        y = y.transpose(1, 2)  # (B, T, heads, v_head_dim)
        if self.cp_group is not None:
            y = heads_to_sequence(y.contiguous(), self.cp_group)
        return self.o_proj(y.reshape(B, T, -1))  # (B, T, C), or (B, T/tp, C) under SP
