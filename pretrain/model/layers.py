"""Building blocks of the Llama decoder: RMSNorm, rotary embeddings, and the linear-layer factories.

- `RMSNorm` normalises in fp32 and casts back, exactly like Hugging Face's `LlamaRMSNorm`, so a
  bf16 model matches its Hugging Face export and the statistics never overflow in half precision.
- `RotaryEmbedding` holds the cos/sin table for `seq_length` positions, computed once in fp32 in
  the non-interleaved layout of Hugging Face's `rotate_half` (the two halves of a head are the
  real and imaginary parts), so checkpoints convert without permuting q/k rows.

The three factories `column_linear`, `row_linear` and `vocab_embedding` are the *swap points* for
tensor parallelism. Today they return plain `nn.Linear(bias=False)` / `nn.Embedding` and refuse a
tensor-parallel group of more than one rank; the tensor-parallel issue makes them return
Megatron-style column-, row- and vocab-parallel layers (same parameter names, sharded rows or
columns). The model builds every projection through them and nothing else, so that change touches
this file only.
"""
from __future__ import annotations

import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), no mean subtraction and no bias.

    The statistics are computed in fp32 and the normalised activations cast back to the input
    dtype *before* the weight multiply; this is Hugging Face's order of operations, which makes
    bf16 outputs bitwise comparable with a Hugging Face model holding the same weights.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.type_as(x)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


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

    def __init__(self, head_dim: int, seq_length: int, theta: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
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


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate each head of x (B, T, nh, hd) by its position's angle; tables are (T, hd).

    Equals Hugging Face's ``x * cos + rotate_half(x) * sin`` bit for bit (see RotaryEmbedding).
    """
    # .to: a no-op normally; under autocast q/k are bf16 while the tables are fp32
    cos = cos.to(x.dtype).unsqueeze(1)  # (T, 1, hd): broadcast over heads
    sin_signed = sin_signed.to(x.dtype).unsqueeze(1)
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


# ---- tensor-parallel swap points ---------------------------------------------------------------

def _require_single_rank(tp_group, what: str) -> None:
    if tp_group is None:
        return
    import torch.distributed as dist

    size = dist.get_world_size(tp_group)
    if size != 1:
        raise NotImplementedError(
            f"{what} with a tensor-parallel group of {size} ranks: tensor-parallel layers are not "
            "implemented yet; run with parallel.tensor=1")


def column_linear(in_features: int, out_features: int, *, tp_group=None,
                  device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None) -> nn.Module:
    """A bias-free linear layer whose *output* features will be sharded over `tp_group`.

    Used for q/k/v, gate/up and the lm_head. With tensor parallelism each rank will hold
    out_features / tp rows of the weight and produce its share of the outputs.
    """
    _require_single_rank(tp_group, "column_linear")
    return nn.Linear(in_features, out_features, bias=False, device=device, dtype=dtype)


def row_linear(in_features: int, out_features: int, *, tp_group=None,
               device: torch.device | str | None = None,
               dtype: torch.dtype | None = None) -> nn.Module:
    """A bias-free linear layer whose *input* features will be sharded over `tp_group`.

    Used for o_proj and down_proj, which consume a column-parallel output; with tensor
    parallelism each rank multiplies its input shard and the partial sums are all-reduced.
    """
    _require_single_rank(tp_group, "row_linear")
    return nn.Linear(in_features, out_features, bias=False, device=device, dtype=dtype)


def vocab_embedding(num_embeddings: int, dim: int, *, tp_group=None,
                    device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> nn.Module:
    """A token embedding whose rows (the vocabulary) will be sharded over `tp_group`.

    `num_embeddings` is the padded vocabulary (`ModelConfig.padded_vocab_size`), a multiple of
    the tensor-parallel size so every rank holds an equal slice.
    """
    _require_single_rank(tp_group, "vocab_embedding")
    return nn.Embedding(num_embeddings, dim, device=device, dtype=dtype)

