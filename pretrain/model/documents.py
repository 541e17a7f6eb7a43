"""Document masking: attention and rotary positions that stay inside each packed document.

A packed sample joins documents, each ended by the tokenizer's end-of-document (eod) token
(`pretrain.data.preprocess`). With `data.document_mask: true` the loader sends, with every
micro-batch, the document id of each input position of the *whole* sample
(`pretrain.data.samples.document_ids`): the number of eod tokens before it, so the eod token
belongs to the document it ends (it is that document's last token, and the next document starts
after it). The first document of a sample may be the tail of a longer one: its positions start
at 0 at the sample's start, as Megatron-LM's `--reset-position-ids` does.

From the ids the model derives, per token, its position inside its document (the rotary
angle: `document_positions`) and, per attention, which keys a query may see: keys of its own
document at or before it (`block_causal_mask`). The loss is unchanged: every label still
counts, including the prediction made at an eod (of the next document's first token).

Every parallel layout gets the ids of the whole sequence: under sequence and context
parallelism attention sees every position of the sequence for its share of the heads, and the
pipeline sends the ids to each stage beside the activations.

Kernels (`document_attention`):
- CPU, or fp32: `scaled_dot_product_attention` with a boolean (B, 1, T, T) mask - exact; the
  masked scores are -inf, so a query's softmax and output involve its own document only.
- CUDA in 16 bits: `torch.nn.attention.varlen.varlen_attn` (FlashAttention's variable-length
  kernel) over the batch's documents laid end to end, described by int32 cumulative lengths on
  the device (`varlen_boundaries`); no T x T mask exists. Where that function is missing (older
  torch) the mask path runs with SDPA's kernels that take a mask (memory-efficient, cuDNN), so
  a fallback to the math kernel fails loudly, as `llama.attention_backends` pins them unmasked.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - depends on the torch build
    varlen_attn = None


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position inside its document (B, T), int64, from the ids (B, T)."""
    T = document_ids.shape[-1]
    index = torch.arange(T, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first


def block_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool, True where query t may attend key s: same document and s <= t."""
    T = document_ids.shape[-1]
    same = document_ids[:, :, None] == document_ids[:, None, :]  # (B, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
    return (same & causal)[:, None]


def varlen_boundaries(document_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cumulative document lengths, longest document) of the batch's documents end to end:
    int32 offsets (documents + 1,) on the ids' device, as `varlen_attn` takes them. A document
    never spans two rows of the batch."""
    B, T = document_ids.shape
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    offsets = starts.flatten().nonzero().flatten()  # each document's first flat position
    total = torch.tensor([B * T], device=document_ids.device)
    boundaries = torch.cat((offsets, total)).to(torch.int32)
    return boundaries, int((boundaries[1:] - boundaries[:-1]).max())


def uses_varlen(device_type: str, dtype: torch.dtype) -> bool:
    """Whether `document_attention` takes the variable-length kernel (CUDA, 16 bits)."""
    return (varlen_attn is not None and device_type == "cuda"
            and dtype in (torch.bfloat16, torch.float16))


def masked_backends(device_type: str, dtype: torch.dtype) -> list[SDPBackend] | None:
    """The SDPA kernels the masked path may use: on CUDA in 16 bits only the fused ones that
    take a mask (FlashAttention does not); elsewhere whatever SDPA picks (None)."""
    if device_type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    return None


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       document_ids: torch.Tensor, *, scale: float | None) -> torch.Tensor:
    """Attention of q (B, nh, T, hd) over k, v (B, nkv, T, hd) within each document of the
    ids (B, T); returns (B, nh, T, hd)."""
    gqa = q.shape[1] != k.shape[1]
    if uses_varlen(q.device.type, q.dtype):
        B, nh, T, hd = q.shape
        boundaries, longest = varlen_boundaries(document_ids)
        packed = [t.transpose(1, 2).reshape(B * T, t.shape[1], hd) for t in (q, k, v)]
        y = varlen_attn(*packed, boundaries, boundaries, longest, longest, scale=scale,
                        window_size=(-1, 0), enable_gqa=gqa)  # causal within each document
        return y.reshape(B, T, nh, hd).transpose(1, 2)
    backends = masked_backends(q.device.type, q.dtype)
    with sdpa_kernel(backends) if backends else contextlib.nullcontext():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(document_ids),
                                              enable_gqa=gqa, scale=scale)
