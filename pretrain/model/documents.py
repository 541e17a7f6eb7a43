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

Kernels (`document_attention`, which `document_kernel` names):
- CPU, or fp32: `scaled_dot_product_attention` with a boolean (B, 1, T, T) mask - exact; the
  masked scores are -inf, so a query's softmax and output involve its own document only.
- CUDA in 16 bits: `torch.nn.attention.varlen.varlen_attn` (FlashAttention's variable-length
  kernel) over the batch's documents laid end to end, described by int32 cumulative lengths on
  the device (`varlen_boundaries`); no T x T mask exists. The boundaries cost two host syncs
  (the documents' count, the longest one), so the model computes them once per micro-batch
  where it prepares its inputs (`LlamaModel.hidden_states`; a pipeline stage's first decoder
  layer, carried in `StageActivations` to the stage's other layers) and hands them to every
  layer; a layer called alone computes its own.

`varlen_attn`'s signature changed between torch releases (2.10: `is_causal`, no scale, no
GQA; 2.11: keyword-only `scale` and `window_size`, no GQA; 2.12 on: also `enable_gqa`), so the
installed function is bound once, at import, against its signature (`bind_varlen`): causal by
the keyword that release has (`window_size=(-1, 0)`, else `is_causal=True`), grouped-query
attention by `enable_gqa` or else by repeating each kv head for its query heads, and muP's
softmax scale by `scale` or else folded into q (the kernel's default is 1/sqrt(head_dim)).
When it cannot be bound (missing from this torch, or a signature with no causal keyword) the
masked path runs instead on CUDA too, with one warning naming why, on SDPA's kernels that take
a mask (memory-efficient, cuDNN), so a fallback to the math kernel fails loudly, as
`llama.attention_backends` pins them unmasked. Nothing is refused: the masked path computes
the same attention, with a T x T mask in memory.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - depends on the torch build
    varlen_attn = None

# (cumulative document lengths (documents + 1,) int32 on the ids' device, longest document)
Boundaries = tuple[torch.Tensor, int]


@dataclass(frozen=True)
class VarlenBinding:
    """How to call one `varlen_attn` causally: the keywords its signature takes."""

    function: Callable[..., torch.Tensor] | None
    causal: dict[str, Any] = field(default_factory=dict)  # the release's causal keyword
    takes_scale: bool = False
    takes_gqa: bool = False
    problem: str | None = None  # why it cannot be used; None: usable

    def keywords(self, *, scale: float | None, gqa: bool) -> dict[str, Any]:
        """The keyword arguments of a causal call (scale and GQA only where taken)."""
        kwargs = dict(self.causal)
        if self.takes_scale:
            kwargs["scale"] = scale
        if self.takes_gqa:
            kwargs["enable_gqa"] = gqa
        return kwargs


def bind_varlen(function: Callable[..., torch.Tensor] | None) -> VarlenBinding:
    """Bind `function` (a `varlen_attn` of any torch release, or None) against its signature:
    the causal keyword it has, whether it takes `scale` and `enable_gqa`, and every keyword of
    the call accepted (`inspect.Signature.bind`), else the problem."""
    if function is None:
        return VarlenBinding(None, problem=f"torch {torch.__version__} has no "
                                           "torch.nn.attention.varlen.varlen_attn")
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError) as exc:
        return VarlenBinding(None, problem=f"varlen_attn's signature cannot be read: {exc}")
    names = signature.parameters
    if "window_size" in names:
        causal: dict[str, Any] = {"window_size": (-1, 0)}
    elif "is_causal" in names:
        causal = {"is_causal": True}
    else:
        return VarlenBinding(None, problem=f"varlen_attn{signature} takes neither window_size "
                                           "nor is_causal: no causal mask")
    binding = VarlenBinding(function, causal, takes_scale="scale" in names,
                            takes_gqa="enable_gqa" in names)
    try:  # q, k, v, cu_seq_q, cu_seq_k, max_q, max_k and the keywords of the call
        signature.bind(*range(7), **binding.keywords(scale=1.0, gqa=True))
    except TypeError as exc:
        return VarlenBinding(None, problem=f"varlen_attn{signature} refuses the call: {exc}")
    return binding


VARLEN = bind_varlen(varlen_attn)  # the installed function, bound once
_warned = False  # the masked fallback on CUDA warns once per process


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


def varlen_boundaries(document_ids: torch.Tensor) -> Boundaries:
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
    """Whether `document_attention` takes the variable-length kernel (CUDA, 16 bits, a
    `varlen_attn` bound)."""
    return (VARLEN.problem is None and device_type == "cuda"
            and dtype in (torch.bfloat16, torch.float16))


def document_kernel(device_type: str, dtype: torch.dtype) -> str:
    """"varlen" or "masked": the kernel `document_attention` takes on this device and dtype.
    Where CUDA in 16 bits would take the variable-length one but the installed `varlen_attn`
    cannot be bound, warns once (per process) why the masked path runs instead."""
    global _warned
    if uses_varlen(device_type, dtype):
        return "varlen"
    if (device_type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and VARLEN.problem is not None and not _warned):
        _warned = True
        warnings.warn(f"document masking runs the masked SDPA path (a T x T mask, memory-"
                      f"efficient or cuDNN kernel): {VARLEN.problem}", RuntimeWarning,
                      stacklevel=2)
    return "masked"


def masked_backends(device_type: str, dtype: torch.dtype) -> list[SDPBackend] | None:
    """The SDPA kernels the masked path may use: on CUDA in 16 bits only the fused ones that
    take a mask (FlashAttention does not); elsewhere whatever SDPA picks (None)."""
    if device_type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    return None


def document_boundaries(document_ids: torch.Tensor, like: torch.Tensor) -> Boundaries | None:
    """The micro-batch's `varlen_boundaries` when attention on tensors like `like` (device,
    dtype) takes the variable-length kernel, else None: computed once, handed to every layer."""
    if uses_varlen(like.device.type, like.dtype):
        return varlen_boundaries(document_ids)
    return None


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, boundaries: Boundaries,
                     *, scale: float | None, binding: VarlenBinding | None = None) -> torch.Tensor:
    """Causal attention of q (B, nh, T, hd) over k, v (B, nkv, T, hd) within each document of
    `boundaries`, by `binding`'s `varlen_attn` (the installed one by default); (B, nh, T, hd)."""
    binding = VARLEN if binding is None else binding
    B, nh, T, hd = q.shape
    gqa = k.shape[1] != nh
    if gqa and not binding.takes_gqa:  # query head i reads kv head i // (nh / nkv)
        k, v = (t.repeat_interleave(nh // t.shape[1], dim=1) for t in (k, v))
    if scale is not None and not binding.takes_scale:  # the kernel scales by 1/sqrt(hd)
        q = q * (scale * math.sqrt(hd))
    cumulative, longest = boundaries
    packed = [t.transpose(1, 2).reshape(B * T, t.shape[1], hd) for t in (q, k, v)]
    y = binding.function(*packed, cumulative, cumulative, longest, longest,
                         **binding.keywords(scale=scale, gqa=gqa))
    return y.reshape(B, T, nh, hd).transpose(1, 2)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       document_ids: torch.Tensor, *, scale: float | None,
                       boundaries: Boundaries | None = None) -> torch.Tensor:
    """Attention of q (B, nh, T, hd) over k, v (B, nkv, T, hd) within each document of the
    ids (B, T); returns (B, nh, T, hd). `boundaries`: the micro-batch's `document_boundaries`
    (computed here when None and the variable-length kernel runs)."""
    if document_kernel(q.device.type, q.dtype) == "varlen":
        if boundaries is None:
            boundaries = varlen_boundaries(document_ids)
        return varlen_attention(q, k, v, boundaries, scale=scale)
    backends = masked_backends(q.device.type, q.dtype)
    with sdpa_kernel(backends) if backends else contextlib.nullcontext():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(document_ids),
                                              enable_gqa=q.shape[1] != k.shape[1], scale=scale)
