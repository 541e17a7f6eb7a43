"""Building blocks of the Llama decoder: RMSNorm, rotary embeddings, and the linear-layer factories.

- `RMSNorm` normalises in fp32 and casts back, exactly like Hugging Face's `LlamaRMSNorm`, so a
  bf16 model matches its Hugging Face export and the statistics never overflow in half precision.
- `RotaryEmbedding` holds the cos/sin table for `seq_length` positions, computed once in fp32 in
  the non-interleaved layout of Hugging Face's `rotate_half` (the two halves of a head are the
  real and imaginary parts), so checkpoints convert without permuting q/k rows; its frequencies
  come from `inverse_frequencies` (plain, or Llama 3's `rope_scaling: llama3`), and
  `rotary_embedding(cfg)` is the one table of a config every model form builds.

The three factories `column_linear`, `row_linear` and `vocab_embedding` are the *swap points* for
tensor parallelism: with no group or a one-rank group they return plain `nn.Linear(bias=False)` /
`nn.Embedding`, with a larger group the Megatron-style layers of
`pretrain.model.tensor_parallel` (same parameter name `weight`, sharded rows or columns). The
model builds every projection through them and nothing else.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from pretrain.config import ModelConfig
from pretrain.model.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                            SequenceShardedWeightGrad, VocabParallelEmbedding,
                                            tp_world_size)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), no mean subtraction and no bias.

    The statistics are computed in fp32 and the normalised activations cast back to the input
    dtype *before* the weight multiply; this is Hugging Face's order of operations, which makes
    bf16 outputs bitwise comparable with a Hugging Face model holding the same weights.

    Under sequence parallelism the norm sees only this rank's T/tp tokens, so its weight
    gradient is a partial sum: pass the tensor-parallel group as `sequence_parallel_group` and
    the weight's gradient goes through a `SequenceShardedWeightGrad` hook (which sums the
    step's micro-batches and all-reduces once per step), so every rank (and DeepSpeed) sees
    the complete gradient of the replicated weight at the step's end.
    """

    def __init__(self, dim: int, eps: float = 1e-5, *, sequence_parallel_group=None) -> None:
        super().__init__()
        self.eps = eps
        self.sequence_parallel_group = sequence_parallel_group
        self.weight_grad = SequenceShardedWeightGrad(sequence_parallel_group)
        self.weight = nn.Parameter(torch.ones(dim))
        self.weight_grad.attach(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.type_as(x)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def defer_sequence_parallel_grads(module: nn.Module, *, micro_batches: int) -> int:
    """Reduce the sequence-parallel norms' gradients of `module` (and the tensor-parallel
    routers' of a mixture of experts) once per step of `micro_batches` backward passes (the
    engine's gradient accumulation); returns how many weights that concerns."""
    if micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches}: a step has at least one")
    # RMSNorms under sequence parallelism, and mixture-of-experts routers under tensor
    # parallelism (`pretrain.model.moe`): weights whose gradient is summed over the group
    hooks = [m.weight_grad for m in module.modules()
             if isinstance(getattr(m, "weight_grad", None), SequenceShardedWeightGrad)
             and tp_world_size(m.weight_grad.group) > 1]
    for hook in hooks:
        hook.micro_batches = micro_batches
    return len(hooks)


class RotaryEmbedding(nn.Module):
    """The cos/sin table of rotary position embeddings (Su et al. 2021, RoFormer).

    Computed once for `seq_length` positions instead of every step. The buffers are
    non-persistent: they are a pure function of the config, so they stay out of checkpoints and
    the state dict keeps Hugging Face's key set. A `.to(bf16)` casts them, which gives the same
    values Hugging Face uses (it computes in fp32 and casts to the activation dtype).

    Hugging Face rotates with ``x * cos + rotate_half(x) * sin`` where
    ``rotate_half(x1, x2) = (-x2, x1)``. We store ``sin_signed = (-sin, sin)`` over the two
    halves instead, so that ``rotate_half(x) * sin == roll(x, hd/2) * sin_signed`` exactly (a
    sign flip is exact): one kernel less per q and k, forward and backward, same bits.
    """

    def __init__(self, seq_length: int, *, inv_freq: torch.Tensor) -> None:
        """`inv_freq`: the head_dim/2 frequencies (`inverse_frequencies`)."""
        super().__init__()
        positions = torch.arange(seq_length, dtype=torch.float)
        freqs = torch.outer(positions, inv_freq)  # (T, hd/2)
        sin = freqs.sin()
        # both halves of a head share the frequencies (non-interleaved layout)
        self.register_buffer("cos", torch.cat((freqs.cos(), freqs.cos()), dim=-1),
                             persistent=False)  # (T, hd)
        self.register_buffer("sin_signed", torch.cat((-sin, sin), dim=-1),
                             persistent=False)  # (T, hd)

    def forward(self, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_signed of shape (T, hd) for the first `seq_len` positions, in `dtype`."""
        if seq_len > self.cos.shape[0]:
            raise ValueError(f"sequence of {seq_len} tokens is longer than the rotary table "
                             f"({self.cos.shape[0]} = model.seq_length): truncate the input")
        return self.cos[:seq_len].to(dtype), self.sin_signed[:seq_len].to(dtype)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_signed (B, T, hd) of per-token positions (B, T), e.g. each token's position
        inside its document (`pretrain.model.documents`), in `dtype`."""
        return self.cos[positions].to(dtype), self.sin_signed[positions].to(dtype)


def rotary_embedding(cfg: ModelConfig) -> RotaryEmbedding:
    """The rotary table of `cfg` (its head width, seq_length positions, frequencies)."""
    return RotaryEmbedding(cfg.seq_length, inv_freq=inverse_frequencies(cfg))


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """The head_dim/2 rotary frequencies of `cfg` in fp32: theta^(-2i/head_dim), and under
    `rope_scaling: llama3` Llama 3.1's rescaling of them (as transformers' `llama3` rope type,
    operation for operation): a frequency whose wavelength exceeds original_max_positions /
    low_freq_factor is divided by the factor, one under original / high_freq_factor is kept,
    and those between are blended linearly in original / wavelength."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
    if cfg.rope_scaling == "none":
        return inv_freq
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    original = cfg.rope_original_max_positions
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelength < original / high) * ~(wavelength > original / low)
    return torch.where(medium, blended, scaled)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate each head of x (B, T, nh, hd) by its position's angle; tables are (T, hd), or
    (B, T, hd) for per-sample positions (document masking).

    Equals Hugging Face's ``x * cos + rotate_half(x) * sin`` bit for bit (see RotaryEmbedding).
    """
    # .to: a no-op normally; under autocast q/k are bf16 while the tables are fp32
    cos = cos.to(x.dtype).unsqueeze(-2)  # (T, 1, hd) or (B, T, 1, hd): broadcast over heads
    sin_signed = sin_signed.to(x.dtype).unsqueeze(-2)
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


# ---- tensor-parallel swap points ---------------------------------------------------------------

def column_linear(in_features: int, out_features: int, *, tp_group=None,
                  device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None) -> nn.Module:
    """A bias-free linear layer whose *output* features are sharded over `tp_group`.

    Used for q/k/v, gate/up and the lm_head. With tensor parallelism each rank holds
    out_features / tp rows of the weight and produces its share of the outputs; its input must
    come through `tensor_parallel.column_parallel_input` (see `ColumnParallelLinear`).
    """
    if tp_world_size(tp_group) == 1:
        return nn.Linear(in_features, out_features, bias=False, device=device, dtype=dtype)
    return ColumnParallelLinear(in_features, out_features, tp_group=tp_group, device=device,
                                dtype=dtype)


def row_linear(in_features: int, out_features: int, *, tp_group=None,
               sequence_parallel: bool = False, device: torch.device | str | None = None,
               dtype: torch.dtype | None = None) -> nn.Module:
    """A bias-free linear layer whose *input* features are sharded over `tp_group`.

    Used for o_proj and down_proj, which consume a column-parallel output; with tensor
    parallelism each rank multiplies its input shard and the partial sums are all-reduced
    (reduce-scattered along the sequence under sequence parallelism).
    """
    if tp_world_size(tp_group) == 1:
        return nn.Linear(in_features, out_features, bias=False, device=device, dtype=dtype)
    return RowParallelLinear(in_features, out_features, tp_group=tp_group,
                             sequence_parallel=sequence_parallel, device=device, dtype=dtype)


def vocab_embedding(num_embeddings: int, dim: int, *, tp_group=None,
                    sequence_parallel: bool = False, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> nn.Module:
    """A token embedding whose rows (the vocabulary) are sharded over `tp_group`.

    `num_embeddings` is the padded vocabulary (`ModelConfig.padded_vocab_size`), a multiple of
    the tensor-parallel size so every rank holds an equal slice.
    """
    if tp_world_size(tp_group) == 1:
        return nn.Embedding(num_embeddings, dim, device=device, dtype=dtype)
    return VocabParallelEmbedding(num_embeddings, dim, tp_group=tp_group,
                                  sequence_parallel=sequence_parallel, device=device, dtype=dtype)
