"""The Llama decoder (Touvron et al. 2023), readable top to bottom.

Architecture choices:

- pre-norm residual blocks: x + attn(norm(x)), then x + mlp(norm(x)); a final RMSNorm,
- rotary position embeddings on q and k (non-interleaved halves, Hugging Face's layout),
- grouped-query attention (num_kv_heads <= num_heads) through PyTorch's fused
  `scaled_dot_product_attention(is_causal=True, enable_gqa=True)`: the kv heads are never
  materialised num_heads/num_kv_heads times (measured on CPU, torch 2.13: as fast as or faster
  than repeating them, and Hugging Face's SDPA path makes the same choice),
- SwiGLU MLP: down(silu(gate(x)) * up(x)),
- no biases, no dropout; optional tied input/output embeddings,
- a vocabulary padded to `cfg.padded_vocab_size(tp)` rows (a multiple of 128 x tp, for fast
  matmuls and equal tensor-parallel shards); the padded logit columns are cut off before the
  loss and before anything is returned, so they never affect training or generation,
- the loss is computed from the lm_head's input (`pretrain.model.loss`): with
  `cfg.loss_chunk_tokens` > 0 (the default) the lm_head matmul, the fp32 cross entropy and
  their gradients go `loss_chunk_tokens` tokens at a time, so the fp32 logits of a whole
  micro-batch (N x V: the largest activation of the model) never exist; 0 computes whole
  logits and their cross entropy, the same loss and gradients within fp32 rounding.

Tensor parallelism (Megatron-LM; `pretrain.model.tensor_parallel`), when a group of tp > 1
ranks is given:

- attention: each rank holds num_heads/tp query heads and num_kv_heads/tp kv heads (q/k/v
  column-parallel, o_proj row-parallel); SwiGLU: gate/up column-parallel, down row-parallel.
  A block's forward then has one all-reduce after attention and one after the MLP,
- embedding and lm_head are vocab-parallel (rows of the padded vocabulary); the loss is the
  vocab-parallel cross entropy (whole or chunked: the log-sum-exp's max and sums all-reduced),
  so the full logits are never gathered in training; a tied lm_head is the embedding's shard,
- sequence parallelism (Korthikanti et al. 2022): the residual stream and the norms hold T/tp
  tokens per rank; the all-reduces become an all-gather before each block's projections and a
  reduce-scatter after them (same bytes, 1/tp of the norm activations).

Parameter names are exactly those of Hugging Face's `LlamaForCausalLM` (`model.layers.0.self_attn
.q_proj.weight`, ...), so converting a checkpoint only drops or adds the padded vocabulary rows
(`pretrain.model.hf`); `gather_full_state_dict` turns tensor-parallel shards into that full
state dict. Every projection is built by the factories of `pretrain.model.layers`, except the
lm_head: a `pretrain.model.loss.LMHead` (the same `weight`, sharded the same way), whose
forward also gives the loss.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.nn.attention import SDPBackend, sdpa_kernel
from deepspeed.accelerator import get_accelerator

from pretrain.config import ModelConfig, Recompute
from pretrain.errors import ConfigError
import pretrain.model.mup as mup
import pretrain.model.documents as documents
from pretrain.model.context_parallel import (ALLGATHER, ULYSSES, allgather_attention,
                                             chunk_loss_scale, chunk_offset, cp_world_size,
                                             heads_to_sequence, lookahead, sequence_to_heads,
                                             token_positions)
from pretrain.model.documents import Boundaries, document_attention, document_positions
from pretrain.families import (ONES, RESIDUAL, ZEROS, check_tensor_split, family_of,
                               tensor_partition_dim_of)
from pretrain.model.hf import EMBED, LM_HEAD
from pretrain.model.layers import (RMSNorm, apply_rotary, column_linear, rotary_embedding,
                                   row_linear, vocab_embedding)
# the loss of whole logits lives with the chunked one; imported here for both model forms
from pretrain.model.loss import (IGNORE_INDEX, LMHead, causal_lm_loss, lm_loss,  # noqa: F401
                                 with_gradient_of)
from pretrain.model.moe import MoE
from pretrain.model.recompute import selective_checkpoint
from pretrain.model.tensor_parallel import (all_gather_along, column_parallel_input,
                                            gather_from_sequence, gather_from_tp, tp_rank,
                                            tp_world_size)


def torch_checkpoint(function, *args):
    """Default `LlamaModel.checkpoint_fn`: PyTorch's non-reentrant activation checkpointing.

    Non-reentrant because it supports inputs that do not require grad and nested autograd.
    The trainer may substitute `deepspeed.checkpointing.checkpoint` (same call signature).
    """
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


class _ConcatLinear(torch.autograd.Function):
    """x @ cat(weights)^T as one matmul, saving the weights themselves for backward.

    Autograd through `torch.cat` + `F.linear` would save the concatenation for the input
    gradient: a second copy of these weights held from each layer's forward to its backward
    (~65% of a Llama layer's parameters, every layer, unless recomputed), and under ZeRO-3 a
    copy of parameters DeepSpeed releases after the forward. Here backward concatenates them
    again (gathered again by ZeRO-3 before the module's backward, like any parameter of it).
    Gradients come out in the weights' dtype and the input's, also under autocast.
    """

    @staticmethod
    def forward(ctx, x, *weights):
        ctx.save_for_backward(x, *weights)
        return F.linear(x, torch.cat(weights))

    @staticmethod
    def backward(ctx, grad):
        x, *weights = ctx.saved_tensors
        w = torch.cat(weights).to(grad.dtype)  # (sum of outs, in)
        grad_x = (grad @ w).to(x.dtype) if ctx.needs_input_grad[0] else None
        if not any(ctx.needs_input_grad[1:]):
            return grad_x, *[None] * len(weights)
        # one (sum of outs, in) product over all tokens, split into each weight's rows
        grad_w = grad.flatten(0, -2).T @ x.flatten(0, -2).to(grad.dtype)
        split = grad_w.split([weight.shape[0] for weight in weights])
        return grad_x, *(g.to(weight.dtype) for g, weight in zip(split, weights))


def fused_projections(x: torch.Tensor, layers: list[nn.Module],
                      sizes: list[int]) -> tuple[torch.Tensor, ...]:
    """The outputs of several bias-free projections of the same x, computed as ONE matmul.

    The parameters stay separate (Hugging Face names and values in every checkpoint format,
    `shard_init`, resharding and ZeRO partitioning never see the fusion): each forward
    concatenates this rank's weight shards along the output rows - under tensor parallelism
    each rank's q/k/v rows are whole heads, so the cat is [q_local; k_local; v_local] - and
    splits the output by `sizes` (each layer's local output features). One larger matmul
    reads x once and keeps the cores busier than two or three thinner ones. The price is a copy
    of the weights per forward (and one per backward): weight elements against tokens x weight
    elements multiply-adds, about 1/tokens of the matmul's work.

    The weights are read without calling the layers: under ZeRO-3 DeepSpeed gathers a
    parameter read during another module's forward and registers it as that module's external
    parameter (gathered with it from then on, in forward and backward).
    """
    return _ConcatLinear.apply(x, *(layer.weight for layer in layers)).split(sizes, dim=-1)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings.

    `cfg.fused_projections`: q, k and v come out of one matmul (`fused_projections`); otherwise
    three. The parameters, their names and values are the same either way.
    """

    def __init__(self, cfg: ModelConfig, *, tp_group=None, sequence_parallel: bool = False,
                 cp_group=None, context_kind: str = ULYSSES) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.head_dim = hd
        # context parallelism: x is this rank's chunk of each sequence; q, k, v are exchanged for
        # the whole sequence of 1/N of the heads around the attention (Ulysses), or the keys and
        # values of the whole sequence are all-gathered for this chunk's queries (allgather:
        # `context_parallel`)
        self.cp_group, self.context_kind = cp_group, context_kind
        # None: SDPA's 1/sqrt(head_dim); muP: sqrt(base head dim) / head_dim (`mup.softmax_scale`)
        self.softmax_scale = mup.softmax_scale(cfg)
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        # q heads h*hd..(h+1)*hd are weight rows, so a row shard is a set of whole heads; rank r's
        # query heads use kv heads r*nkv/tp.. (query head i reads kv head i // (nh/nkv))
        self.q_proj = column_linear(h, cfg.num_heads * hd, tp_group=tp_group)
        self.k_proj = column_linear(h, cfg.num_kv_heads * hd, tp_group=tp_group)
        self.v_proj = column_linear(h, cfg.num_kv_heads * hd, tp_group=tp_group)
        self.o_proj = row_linear(cfg.num_heads * hd, h, tp_group=tp_group,
                                 sequence_parallel=sequence_parallel)
        self.fused = cfg.fused_projections
        self.project = fused_projections  # `compile_blocks` swaps in an eager one at ZeRO-3
        tp = tp_world_size(tp_group)  # local sizes: under ZeRO-3 a weight's shape is not its own
        self.qkv_sizes = [cfg.num_heads * hd // tp, *[cfg.num_kv_heads * hd // tp] * 2]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerCache | None = None,
                document_ids: torch.Tensor | None = None,
                boundaries: Boundaries | None = None) -> torch.Tensor:
        """`cache` (generation only): keys and values of the positions before x's, extended
        here; x is then the whole prompt (empty cache) or one new token. `document_ids` (B, T)
        of the whole sequence: attention stays inside each document (`documents`);
        `boundaries`: the micro-batch's `documents.document_boundaries` of them."""
        # (B, T, C) on every TP rank; under sequence parallelism gathered from (B, T/tp, C)
        x = column_parallel_input(x, self.tp_group, sequence_parallel=self.sequence_parallel)
        B, T, _ = x.shape
        if self.fused:
            q, k, v = self.project(x, [self.q_proj, self.k_proj, self.v_proj], self.qkv_sizes)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # -1 heads: under tensor parallelism each rank holds its share of the heads
        q = q.view(B, T, -1, self.head_dim)  # (B, T, nh, hd)
        k = k.view(B, T, -1, self.head_dim)  # (B, T, nkv, hd)
        v = v.view(B, T, -1, self.head_dim)  # (B, T, nkv, hd)
        q, k = self.heads_before_rotary(q, k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)  # cos/sin: x's positions
        if self.cp_group is not None and cache is not None:
            raise ValueError("context parallelism is for training: generate with context 1")
        if self.cp_group is not None and self.context_kind == ALLGATHER:
            # this chunk's queries over the gathered keys and values: (B, nh, T/N, hd)
            y = allgather_attention(q, k, v, self.cp_group, scale=self.softmax_scale,
                                    document_ids=document_ids)
            return self._output(y, B, T)
        if self.cp_group is not None:  # (B, T/N, heads, hd) -> (B, T, heads/N, hd)
            q, k, v = (sequence_to_heads(t, self.cp_group) for t in (q, k, v))
        q = q.transpose(1, 2)  # (B, nh, T, hd)
        k = k.transpose(1, 2)  # (B, nkv, T, hd)
        v = v.transpose(1, 2)  # (B, nkv, T, hd)
        if document_ids is not None:
            if cache is not None:
                raise ValueError("document masking is for training: a prompt is one document")
            y = document_attention(q, k, v, document_ids, scale=self.softmax_scale,
                                   boundaries=boundaries)
            return self._output(y, B, T)
        causal = True
        if cache is not None:
            k, v, causal = cache.extend(k, v)  # (B, nkv, past + T, hd)
        backends = attention_backends(q.device.type, q.dtype)
        with sdpa_kernel(backends) if backends else contextlib.nullcontext():
            y = F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                               enable_gqa=q.shape[1] != k.shape[1],
                                               scale=self.softmax_scale)  # (B, nh, T, hd)
        return self._output(y, B, T)

    def heads_before_rotary(self, q: torch.Tensor,
                            k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What a family does to the projected q (B, T, nh, hd) and k heads before the rotary
        embedding: nothing in Llama (Qwen3 normalises each head: `pretrain.model.qwen3`)."""
        return q, k

    def _output(self, y: torch.Tensor, B: int, T: int) -> torch.Tensor:
        """o_proj of the attention's output y (B, nh, T, hd), back in x's sequence layout."""
        y = y.transpose(1, 2)  # (B, T, nh, hd)
        if self.cp_group is not None and self.context_kind == ULYSSES:
            # (B, T, heads/N, hd) -> this chunk's (B, T/N, heads, hd)
            y = heads_to_sequence(y.contiguous(), self.cp_group)
        y = y.reshape(B, T, -1)  # (B, T, nh*hd)
        return self.o_proj(y)  # (B, T, C), or (B, T/tp, C) under sequence parallelism


class LayerCache:
    """One layer's keys and values (B, nkv, positions, hd) of the tokens generated so far."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(all keys, all values, causal mask needed) after appending the new positions."""
        if self.keys is None:  # the prompt: causal among its own positions
            self.keys, self.values = k, v
            return k, v, True
        if k.shape[2] != 1:
            raise ValueError("with a KV cache, decode one token at a time after the prompt")
        self.keys = torch.cat((self.keys, k), dim=2)
        self.values = torch.cat((self.values, v), dim=2)
        return self.keys, self.values, False  # one query sees every earlier position


def attention_backends(device_type: str, dtype: torch.dtype) -> list[SDPBackend] | None:
    """The SDPA kernels attention may use. On CUDA in 16 bits only the fused ones: a silent
    fallback to the math kernel (T x T scores in memory, several times slower) then fails
    loudly instead. Elsewhere (CPU, fp32) whatever SDPA picks: None."""
    if device_type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                SDPBackend.CUDNN_ATTENTION]
    return None


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): down(silu(gate(x)) * up(x)).

    `cfg.fused_projections`: gate and up come out of one matmul (`fused_projections`).
    """

    def __init__(self, cfg: ModelConfig, *, tp_group=None, sequence_parallel: bool = False) -> None:
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.gate_proj = column_linear(h, f, tp_group=tp_group)
        self.up_proj = column_linear(h, f, tp_group=tp_group)
        self.down_proj = row_linear(f, h, tp_group=tp_group, sequence_parallel=sequence_parallel)
        self.fused = cfg.fused_projections
        self.project = fused_projections  # `compile_blocks` swaps in an eager one at ZeRO-3
        self.gate_up_sizes = [f // tp_world_size(tp_group)] * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = column_parallel_input(x, self.tp_group, sequence_parallel=self.sequence_parallel)
        if self.fused:
            gate, up = self.project(x, [self.gate_proj, self.up_proj], self.gate_up_sizes)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)  # f/tp inner features


class DecoderLayer(nn.Module):
    """One pre-norm transformer block; attribute names follow Hugging Face's LlamaDecoderLayer.
    Its attention is the model family's (`Attention`, or a subclass the family names), its MLP
    the one the family gives layer `layer_index` (`Family.mlp_module`: `MLP` or `MoE`)."""

    def __init__(self, cfg: ModelConfig, *, tp_group=None, sequence_parallel: bool = False,
                 cp_group=None, expert_parallel: bool = False, layer_index: int = 0,
                 context_kind: str = ULYSSES) -> None:
        super().__init__()
        norm_group = tp_group if sequence_parallel else None
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps,
                                       sequence_parallel_group=norm_group)
        attention = family_of(cfg).module("attention")  # the family's (`pretrain.families`)
        self.self_attn = attention(cfg, tp_group=tp_group, sequence_parallel=sequence_parallel,
                                   cp_group=cp_group, context_kind=context_kind)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps,
                                                sequence_parallel_group=norm_group)
        # the family's MLP of this layer: a routed mixture of SwiGLU experts (`MoE`) or dense
        mlp = family_of(cfg).mlp_module(cfg, layer_index)
        if issubclass(mlp, MoE):
            self.mlp = mlp(cfg, tp_group=tp_group, sequence_parallel=sequence_parallel,
                           project=fused_projections, expert_parallel=expert_parallel,
                           cp_group=cp_group, layer_index=layer_index)
        else:
            self.mlp = mlp(cfg, tp_group=tp_group, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerCache | None = None,
                document_ids: torch.Tensor | None = None,
                boundaries: Boundaries | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, document_ids,
                               boundaries)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBackbone(nn.Module):
    """The `model.` prefix of Hugging Face's names: embeddings, blocks, final norm, rotary table.

    A container only; `LlamaModel` runs the layers so it can checkpoint them one by one.
    """

    def __init__(self, cfg: ModelConfig, *, padded_vocab_size: int, tp_group=None,
                 sequence_parallel: bool = False, cp_group=None,
                 expert_parallel: bool = False, context_kind: str = ULYSSES) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(padded_vocab_size, cfg.hidden_size, tp_group=tp_group,
                                            sequence_parallel=sequence_parallel)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, tp_group=tp_group, sequence_parallel=sequence_parallel,
                         cp_group=cp_group, expert_parallel=expert_parallel, layer_index=i,
                         context_kind=context_kind)
            for i in range(cfg.num_layers))
        if cfg.mtp_depth:  # after the decoder's, under DeepSeek-V3's names (`pretrain.model.mtp`)
            mtp = family_of(cfg).module("mtp")
            self.layers.extend(
                mtp(cfg, depth=k, tp_group=tp_group, sequence_parallel=sequence_parallel,
                    cp_group=cp_group, expert_parallel=expert_parallel, context_kind=context_kind)
                for k in range(cfg.mtp_depth))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps,
                            sequence_parallel_group=tp_group if sequence_parallel else None)
        self.rotary_emb = rotary_embedding(cfg)


class LlamaModel(nn.Module):
    """Llama causal language model with Hugging Face `LlamaForCausalLM` parameter names.

    `forward(input_ids)` gives logits (B, T, vocab_size); `forward(input_ids, labels)` the mean
    cross-entropy, from `lm_head(hidden, labels)` (chunked by cfg.loss_chunk_tokens). `checkpoint_fn(function, *args)` runs the layers chosen by
    `cfg.activation_checkpointing`; replace it to use DeepSpeed's activation checkpointing.
    Weights are left at PyTorch's defaults: call `form.init_weights` (or use `build_model`).

    `tp_group`: the tensor-parallel process group (None or one rank: no tensor parallelism);
    every rank of it gets the same input_ids and labels. `sequence_parallel` needs tp > 1 and
    sequence lengths divisible by tp.

    `expert_parallel`: the tp ranks hold whole experts of each MoE layer, an equal share each,
    and swap tokens by all-to-all (`pretrain.model.expert_parallel`; parallel.expert = tp); an
    `ExpertGroups`: the expert grid's ranks hold them (`expert_parallel.expert_groups_of`).

    `cp_group`: the context-parallel group (`pretrain.model.context_parallel`; None: none).
    Context rank c gets chunk c of every sequence (inputs and their labels, T/N tokens each);
    attention exchanges heads for the whole sequence, and the loss is the chunk's share of the
    whole sequence's mean, times N (DeepSpeed averages it over the context ranks).
    `context_kind` "allgather": context rank c gets chunks c and 2N-1-c of 2N instead
    (`data.loader.context_chunks`), and attention all-gathers the keys and values.
    """

    def __init__(self, cfg: ModelConfig, *, tp_group=None, sequence_parallel: bool = False,
                 cp_group=None, expert_parallel: bool = False,
                 context_kind: str = ULYSSES) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp_group = tp_group
        self.cp_group = cp_group if cp_world_size(cp_group) > 1 else None
        self.context_kind = context_kind
        self.tensor_parallel = tp_world_size(tp_group)
        check_tensor_split(cfg, self.tensor_parallel)
        self.tensor_parallel_rank = tp_rank(tp_group)
        self.sequence_parallel = sequence_parallel
        if sequence_parallel and self.tensor_parallel == 1:
            raise ConfigError("sequence_parallel=True needs a tensor-parallel group of more "
                              "than one rank: set parallel.tensor > 1 or "
                              "parallel.sequence_parallel=false")
        self.padded_vocab_size = cfg.padded_vocab_size(self.tensor_parallel)
        self.model = LlamaBackbone(cfg, padded_vocab_size=self.padded_vocab_size,
                                   tp_group=tp_group, sequence_parallel=sequence_parallel,
                                   cp_group=self.cp_group, expert_parallel=expert_parallel,
                                   context_kind=context_kind)
        # column-parallel rows of the vocabulary, like `column_linear`; its forward also gives the
        # loss, chunked by cfg.loss_chunk_tokens (ZeRO-3 gathers the weight for that forward)
        self.lm_head = LMHead(cfg.hidden_size, self.padded_vocab_size, vocab_size=cfg.vocab_size,
                              tp_group=tp_group, chunk_tokens=cfg.loss_chunk_tokens,
                              output_multiplier=mup.output_multiplier(cfg))
        if cfg.tie_embeddings:
            # one Parameter under two names: named_parameters() yields it once, as the embedding;
            # under TP both are the same (V/tp, C) row shard of the vocabulary
            self.lm_head.weight = self.model.embed_tokens.weight
        self.checkpoint_fn = (selective_checkpoint if cfg.activation_checkpointing
                              == Recompute.SELECTIVE else torch_checkpoint)

    def recomputes_layer(self, index: int) -> bool:
        """Whether layer `index` recomputes its activations in backward (cfg.activation_checkpointing)."""
        mode = self.cfg.activation_checkpointing
        if mode == Recompute.SELECTIVE:  # every layer, its matmuls' outputs kept (`recompute`)
            return True
        if mode == Recompute.FULL:
            return True
        if mode == Recompute.EVERY_K:
            return index % self.cfg.activation_checkpointing_interval == 0
        return False

    def hidden_states(self, input_ids: torch.Tensor,
                      cache: list[LayerCache] | None = None,
                      document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Final-norm hidden states (B, T, C) of token ids (B, T); under sequence parallelism
        this rank's shard (B, T/tp, C) of them. With `cache` (generation, one per layer) the ids
        continue the cached positions. `document_ids` (B, whole sequence; `documents`): positions
        restart and attention stays inside each document."""
        return self.model.norm(self._decoded(input_ids, cache, document_ids)[0])

    def _decoded(self, input_ids: torch.Tensor, cache: list[LayerCache] | None = None,
                 document_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple]:
        """(the last decoder layer's output before the final norm, (cos, sin, document_ids,
        boundaries): what the multi-token prediction modules run with)."""
        T = input_ids.shape[1]
        if self.sequence_parallel and T % self.tensor_parallel:
            raise ValueError(f"sequence parallelism splits each sequence over the "
                             f"{self.tensor_parallel} tensor-parallel ranks, but it has {T} "
                             f"tokens: use a sequence length divisible by {self.tensor_parallel}")
        x = self.model.embed_tokens(input_ids)  # (B, T, C), or (B, T/tp, C) under SP
        past = 0 if cache is None or cache[0].keys is None else cache[0].keys.shape[2]
        if self.cp_group is not None:  # T is this rank's chunk: global positions from its start
            past = chunk_offset(T, self.cp_group)
        if self.cp_group is not None and self.context_kind == ALLGATHER:
            # this rank's head and tail chunks: their global positions, or in their documents
            positions = token_positions(T, self.cp_group, ALLGATHER, x.device)  # (T,)
            if document_ids is not None:
                positions = document_positions(document_ids)[:, positions]  # (B, T)
            cos, sin = self.model.rotary_emb.at(positions, x.dtype)
        elif document_ids is None:
            cos, sin = self.model.rotary_emb(past + T, x.dtype)  # (past + T, hd) each
            cos, sin = cos[past:], sin[past:]
        else:  # this rank's tokens' positions inside their documents: (B, T, hd) each
            positions = document_positions(document_ids)[:, past:past + T]
            cos, sin = self.model.rotary_emb.at(positions, x.dtype)
        checkpointing = torch.is_grad_enabled()  # nothing to save for backward otherwise
        # the variable-length kernel's boundaries: once per micro-batch, not once per layer
        boundaries = (None if document_ids is None
                      else documents.document_boundaries(document_ids, x))
        masked = () if document_ids is None else (None, document_ids, boundaries)  # no cache
        for i, layer in enumerate(self.model.layers[:self.cfg.num_layers]):  # not the MTP's
            if checkpointing and self.recomputes_layer(i):
                x = self.checkpoint_fn(layer, x, cos, sin, *masked)
            else:
                x = layer(x, cos, sin, None if cache is None else cache[i], document_ids,
                          boundaries)
        return x, (cos, sin, document_ids, boundaries)

    def _mtp_loss(self, x: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor,
                  rope: tuple) -> torch.Tensor:
        """lambda / D x the sum of the multi-token prediction modules' cross entropies
        (`pretrain.model.mtp`), from the decoder's output x before the final norm. Under context
        parallelism the tokens k ahead of a chunk's last k positions are the next chunk's
        (`context_parallel.lookahead`), and each module's loss is its chunk's share as the main
        loss is (`chunk_loss_scale`)."""
        cos, sin, document_ids, boundaries = rope
        masked = () if document_ids is None else (document_ids, boundaries)
        checkpointing = torch.is_grad_enabled()
        length = input_ids.shape[1]
        ahead_ids, ahead_labels = lookahead(input_ids, labels, self.cfg.mtp_depth, self.cp_group,
                                            ignore_index=IGNORE_INDEX)
        total = None
        for module in self.model.layers[self.cfg.num_layers:]:
            k = module.depth + 1
            embedded = self.model.embed_tokens(ahead_ids[:, k:k + length])  # token i + k
            if checkpointing and self.recomputes_layer(self.cfg.num_layers + module.depth):
                x, head_input = self.checkpoint_fn(module, x, embedded, cos, sin, *masked)
            else:
                x, head_input = module(x, embedded, cos, sin, *masked)
            targets = ahead_labels[:, k:k + length]
            loss = self.lm_head(head_input, targets)
            if self.cp_group is not None:
                loss = loss * chunk_loss_scale(targets, self.cp_group)
            module.count(loss)
            total = loss if total is None else total + loss
        return total * (self.cfg.mtp_loss_weight / self.cfg.mtp_depth)

    def _last_hidden_recomputed(self, ids: torch.Tensor) -> torch.Tensor:
        """The last position's hidden state (B, C), the last `seq_length` tokens run again."""
        context = ids[:, -self.cfg.seq_length:]
        T = context.shape[1]
        if self.sequence_parallel:  # pad on the right to a multiple of tp: causal attention
            pad = -T % self.tensor_parallel  # keeps positions < T exact
            context = F.pad(context, (0, pad))
        hidden = self.hidden_states(context)
        if self.sequence_parallel:
            hidden = gather_from_sequence(hidden, self.tp_group)  # (B, T + pad, C)
        return hidden[:, T - 1]

    def vocab_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary shard (B, T, V_padded/tp) of the logits of `hidden_states`."""
        hidden = column_parallel_input(hidden, self.tp_group,
                                       sequence_parallel=self.sequence_parallel)  # (B, T, C)
        return self.lm_head(hidden)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The loss with labels, else the logits; `document_ids` (B, T of the whole sequence,
        `data.document_mask`) keep attention and positions inside each document."""
        decoded, rope = self._decoded(input_ids, document_ids=document_ids)
        hidden = self.model.norm(decoded)
        if labels is None:  # evaluation / generation: gather the vocabulary shards
            logits = self.vocab_logits(hidden)  # (B, T, V_padded/tp)
            return gather_from_tp(logits, self.tp_group)[..., :self.cfg.vocab_size]  # (B, T, V)
        hidden = column_parallel_input(hidden, self.tp_group,
                                       sequence_parallel=self.sequence_parallel)  # (B, T, C)
        # the loss from the head's input: with cfg.loss_chunk_tokens > 0 the logits of the
        # whole micro-batch never exist (`pretrain.model.loss`)
        if self.cp_group is None:
            loss = self.lm_head(hidden, labels)
        else:
            loss = self.lm_head(hidden, labels) * chunk_loss_scale(labels, self.cp_group)
        if self.cfg.mtp_depth and self.training and torch.is_grad_enabled():
            # training only; the returned loss stays the main head's (`pretrain.model.mtp`)
            loss = with_gradient_of(loss, self._mtp_loss(decoded, input_ids, labels, rope))
        return loss

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, *, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, generator: torch.Generator | None = None,
                 eos_id: int | None = None,
                 stop: Callable[[torch.Tensor], bool] | None = None) -> torch.Tensor:
        """Append up to `max_new_tokens` tokens to input_ids (B, T); returns (B, T + new).

        temperature 0 is greedy; otherwise sample from softmax(logits / temperature), restricted
        to the `top_k` most likely tokens if given. Keys and values are cached: the prompt is run
        once, then one token per step. Past `seq_length` tokens (the rotary table's length), and
        under sequence parallelism, each step recomputes the last `seq_length`. A row that produced
        `eos_id` keeps producing it; generation stops when every row has. Under tensor
        parallelism every rank of the group calls it with the same arguments (and generator
        state) and gets the same tokens. `stop(ids)`, called with the ids after each new token,
        ends generation when it says True (e.g. once every row decodes to a stop string).
        """
        vocab = self.cfg.vocab_size
        ids = input_ids
        finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        cache = None if self.sequence_parallel else [LayerCache()
                                                     for _ in range(self.cfg.num_layers)]
        cached = 0  # positions in the cache
        for _ in range(max_new_tokens):
            if cache is not None and ids.shape[1] <= self.cfg.seq_length:
                last = self.hidden_states(ids[:, cached:], cache)[:, -1]  # (B, C)
                cached = ids.shape[1]
            else:
                last = self._last_hidden_recomputed(ids)
            logits = gather_from_tp(self.lm_head(last), self.tp_group)[:, :vocab].float()  # (B, V)
            if temperature == 0.0:
                next_ids = logits.argmax(dim=-1)  # (B,)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, vocab), dim=-1).values[:, -1:]  # (B, 1)
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                next_ids = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # (B,)
            if eos_id is not None:
                next_ids = torch.where(finished, torch.full_like(next_ids, eos_id), next_ids)
                finished |= next_ids == eos_id
            ids = torch.cat((ids, next_ids[:, None]), dim=1)  # (B, T + 1)
            if eos_id is not None and bool(finished.all()):
                break
            if stop is not None and stop(ids):
                break
        return ids

    def num_parameters(self) -> int:
        """Unique parameters of the whole (unsharded) model without the padded vocabulary rows
        (equals `pretrain.arithmetic.num_parameters(cfg)`)."""
        # parameters() yields a tied weight once; a tensor-parallel shard stands for tp of them
        n = sum(p.numel() * (self.tensor_parallel if _is_sharded(p) else 1)
                for p in self.parameters())
        pad_rows = self.padded_vocab_size - self.cfg.vocab_size
        n -= pad_rows * self.cfg.hidden_size * (1 if self.cfg.tie_embeddings else 2)
        return n


def _is_sharded(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


# ---- initialisation and tensor-parallel layout ---------------------------------------------------

_VOCAB_MATRIX = (EMBED, LM_HEAD)


def parameter_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from (seed, canonical name), stable across processes and runs.

    hashlib, not hash(): Python salts str hashes per process (PYTHONHASHSEED).
    """
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def full_parameter_shape(name: str, cfg: ModelConfig) -> tuple[int, ...]:
    """Unsharded, unpadded shape of the parameter called `name` (a Hugging Face name), from
    the family's parameter table (`pretrain.families`)."""
    return family_of(cfg).parameter(name).shape(cfg)


# Initial values are drawn in blocks of this many rows (columns for column-split matrices) along
# a parameter's tensor-parallel dimension, each from its own generator: a rank draws only the
# blocks its shard overlaps. Fixed, never a function of the layout.
INIT_BLOCK = 128


def full_parameter_init(name: str, cfg: ModelConfig, *, seed: int) -> torch.Tensor:
    """The initial value of parameter `name`, unsharded and unpadded, in fp32 on the CPU: every
    tensor-parallel rank's `shard_init` is its `shard_of`, bitwise.

    As the family's table says (`pretrain.families`): norm weights are 1; every matrix is
    normal(0, init_std), except the output projections that write into the residual stream
    (Llama's o_proj and down_proj), whose std is init_std / sqrt(2 * num_layers): 2 * num_layers of them add up along the residual path, so this keeps its
    variance independent of depth (GPT-2, Megatron-LM's scaled init). Under muP the hidden
    matrices' std is also multiplied by `mup.init_std_multiplier` (1/sqrt(width multiplier)):
    a factor on the std, so the blocks stay layout-independent.
    """
    dim = tensor_partition_dim(name) or 0
    out = torch.empty(full_parameter_shape(name, cfg))
    _draw_init(name, cfg, seed=seed, dim=dim, start=0, out=out)
    return out


def shard_init(name: str, cfg: ModelConfig, *, seed: int, tp_rank: int, tp_size: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Tensor-parallel rank `tp_rank`'s shard of `full_parameter_init(name)` (padded vocabulary
    rows 0, like `shard_of`), drawing only the `INIT_BLOCK` blocks the shard overlaps: a rank of
    the 70B recipe draws its ~1/8 of a layer, not the whole of it. Written into `out` (e.g. the
    parameter itself, in its dtype) when given, so only one block is held besides it."""
    part = shard_range(name, cfg, tp_rank=tp_rank, tp_size=tp_size)
    if out is None:
        out = torch.empty(part.shape)
    elif tuple(out.shape) != part.shape:
        raise RuntimeError(f"{name}: local shape {tuple(out.shape)} differs from its "
                           f"tensor-parallel shard {part.shape}")
    real = part.real_stop - part.start
    out.narrow(part.dim, real, part.shape[part.dim] - real).zero_()
    if real > 0:
        _draw_init(name, cfg, seed=seed, dim=part.dim, start=part.start,
                   out=out.narrow(part.dim, 0, real))
    return out


@dataclass(frozen=True)
class ShardRange:
    """Where a tensor-parallel shard lies in its full tensor: indices start..stop along dim,
    of which those from real_stop on are padded vocabulary rows (zero, in no checkpoint)."""

    dim: int
    start: int
    stop: int
    real_stop: int
    shape: tuple[int, ...]  # the shard's


def shard_range(name: str, cfg: ModelConfig, *, tp_rank: int, tp_size: int) -> ShardRange:
    """`ShardRange` of rank `tp_rank`'s shard of parameter `name` (what `shard_of` cuts)."""
    dim = tensor_partition_dim(name)
    shape = list(full_parameter_shape(name, cfg))
    split = 1 if dim is None or tp_size == 1 else tp_size
    dim = dim or 0
    size = cfg.padded_vocab_size(tp_size) if name in _VOCAB_MATRIX else shape[dim]
    if size % split:
        raise ValueError(f"{name}: dimension {dim} of {tuple(shape)} does not split into "
                         f"{split} tensor-parallel shards")
    start = size // split * (tp_rank if split > 1 else 0)
    stop = start + size // split
    shape[dim] = stop - start
    real_stop = max(start, min(stop, full_parameter_shape(name, cfg)[dim]))  # all padding: start
    return ShardRange(dim=dim, start=start, stop=stop, real_stop=real_stop, shape=tuple(shape))


def _draw_init(name: str, cfg: ModelConfig, *, seed: int, dim: int, start: int,
               out: torch.Tensor) -> None:
    """Fill `out` with indices start..start + out.shape[dim] along `dim` of the unpadded
    initial value of `name`, block by block; block b comes from the generator seeded by (seed,
    name, b) and has `INIT_BLOCK` indices along `dim` (the last one fewer)."""
    init = family_of(cfg).parameter(name).init
    if init == ONES:
        out.fill_(1.0)
        return
    if init == ZEROS:
        out.zero_()
        return
    std = cfg.init_std
    if init == RESIDUAL:
        std = cfg.init_std / math.sqrt(2.0 * cfg.num_layers)
    multiplier = mup.init_std_multiplier(name, cfg)  # muP: 1/sqrt(m) on hidden matrices
    if multiplier != 1.0:
        std = std * multiplier
    full = list(full_parameter_shape(name, cfg))
    stop = start + out.shape[dim]
    for block in range(start // INIT_BLOCK, -(-stop // INIT_BLOCK)):
        first = block * INIT_BLOCK
        shape = full.copy()
        shape[dim] = min(INIT_BLOCK, full[dim] - first)
        generator = torch.Generator().manual_seed(parameter_seed(seed, f"{name}#{block}"))
        values = torch.empty(shape).normal_(0.0, std, generator=generator)
        lo, hi = max(start, first), min(stop, first + shape[dim])
        out.narrow(dim, lo - start, hi - lo).copy_(values.narrow(dim, lo - first, hi - lo))


def tensor_partition_dim(name: str) -> int | None:
    """The dimension of parameter `name` split over tensor-parallel ranks (None: replicated),
    from the families' parameter tables (a module name splits the same way in every family)."""
    if name in _VOCAB_MATRIX:
        return 0  # vocabulary rows
    module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else name.split(".")[0]
    try:
        return tensor_partition_dim_of(module)
    except KeyError:
        raise KeyError(f"unknown parameter name {name!r}: in no model family's table") from None


def shard_of(full: torch.Tensor, name: str, *, cfg: ModelConfig, tp_rank: int,
             tp_size: int) -> torch.Tensor:
    """Tensor-parallel rank `tp_rank`'s part of the full parameter `name` (a view when possible).

    Vocabulary matrices may come unpadded (vocab_size rows, e.g. from Hugging Face) or padded to
    `cfg.padded_vocab_size(tp_size)`; unpadded ones get zero rows appended first.
    """
    if name in _VOCAB_MATRIX:
        padded = cfg.padded_vocab_size(tp_size)
        if full.shape[0] not in (cfg.vocab_size, padded):
            raise ValueError(f"{name} has {full.shape[0]} rows; expected model.vocab_size="
                             f"{cfg.vocab_size} or the padded {padded} of tensor-parallel size "
                             f"{tp_size}")
        full = F.pad(full, (0, 0, 0, padded - full.shape[0]))
    dim = tensor_partition_dim(name)
    if dim is None or tp_size == 1:
        return full
    if full.shape[dim] % tp_size:
        raise ValueError(f"{name}: dimension {dim} of {tuple(full.shape)} does not split into "
                         f"{tp_size} tensor-parallel shards")
    return full.chunk(tp_size, dim=dim)[tp_rank]


@torch.no_grad()
def gather_full_state_dict(model: LlamaModel) -> dict[str, torch.Tensor]:
    """The full, unsharded state dict with Hugging Face names and `vocab_size` vocabulary rows.

    Collective over the model's tensor-parallel group (every rank calls it and every rank gets
    the result, on the CPU). Keys are those of `LlamaModel.state_dict()` at tp=1: a tied
    `lm_head.weight` is the embedding tensor itself. `pretrain.model.hf.to_hf_state_dict` turns
    it into a Hugging Face checkpoint. Parameters must be whole on each rank: under ZeRO-3 call
    it inside `deepspeed.zero.GatheredParameters`.
    """
    cfg = model.cfg
    if any(getattr(p, "expert_parallel", False) or getattr(p, "allreduce", True) is False
           for p in model.parameters()):
        raise ValueError("gather_full_state_dict: the ranks hold different experts "
                         "(expert parallelism); read the weights from `final/` or an engine "
                         "checkpoint (`pretrain.checkpoint.weights.load_weights`)")
    state = model.state_dict()
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    full = gather_tensor_parallel_state(state, cfg=cfg, tp_group=model.tp_group)
    if cfg.tie_embeddings:
        full["lm_head.weight"] = full["model.embed_tokens.weight"]
    return full


@torch.no_grad()
def gather_tensor_parallel_state(state: dict[str, torch.Tensor], *, cfg: ModelConfig,
                                 tp_group=None) -> dict[str, torch.Tensor]:
    """Whole CPU tensors, `vocab_size` rows, from a {Hugging Face name: local shard} dict.

    Collective over `tp_group`; used for the flat model and for each pipeline stage's
    `pipeline.stage_state_dict`.
    """
    device = torch.device(get_accelerator().current_device_name())  # NCCL gathers device tensors
    tensor_parallel = tp_world_size(tp_group)
    full: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        dim = tensor_partition_dim(name)
        gathered = dim is not None and tensor_parallel > 1
        if gathered:
            tensor = all_gather_along(tensor.to(device), tp_group, dim)
        if name in _VOCAB_MATRIX:
            tensor = tensor[:cfg.vocab_size]
        tensor = tensor.detach().cpu()
        # a gathered tensor is a new one (on the CPU, no copy); a local one is the parameter
        full[name] = tensor if gathered and tensor.is_contiguous() else tensor.clone()
    return full