"""Context parallelism (DeepSpeed-Ulysses; Jacobs et al. 2023): a sequence in contiguous chunks.

Each of the `N = parallel.context` ranks of a context group holds chunk c of every sequence of
the micro-batch: tokens c*T/N .. (c+1)*T/N (inputs, labels, every activation outside attention).
Everything per token (embedding, norms, projections, MLP, loss) needs nothing else. Attention
needs the whole sequence, so it swaps the split dimension:

    q, k, v (B, T/N, heads, hd) --all-to-all--> (B, T, heads/N, hd)
    causal attention over the whole sequence, for heads/N heads
    y (B, T, heads/N, hd)      --all-to-all--> (B, T/N, heads, hd)

With tensor parallelism, `heads` are already the rank's heads/tp: each rank attends with
heads/(tp x N) query heads and kv_heads/(tp x N) kv heads (contiguous runs of both, so grouped
query heads stay with their kv head). Rotary embeddings take global positions (chunk c starts
at c*T/N). The backward of each all-to-all is the other one.

The loss of a context rank is its chunk's mean (scaled when ignored labels make the chunks'
label counts differ), so that the average DeepSpeed takes over its data-parallel group (data x
context ranks, `pretrain.resolve.topology`) is the gradient of the whole sequence's mean.

All-gather context parallelism (`parallel.context_kind: allgather`; Llama 3's long-context
training, Dubey et al. 2024) needs no head count divisible by anything: each rank keeps its
queries and all heads, and the keys and values of the whole sequence are all-gathered over the
context group (one all-gather of (k, v) per layer forward; its backward reduce-scatters their
gradients, each rank getting the sum of every rank's gradient of its own keys and values):

    k, v (B, T/N, kv_heads, hd) --all-gather--> (B, T, kv_heads, hd)
    each local query attends the keys at global positions at or before its own

A contiguous cut would leave the last rank N times the causal work of the first, so the
sequence is cut into 2N chunks and rank r holds chunks r and 2N-1-r (head-tail balancing,
`pretrain.data.loader.context_chunks`): every rank then attends over 2N chunks of keys' worth
of pairs. The loader, the rotary positions (`token_positions`) and the mask all follow that
order; the gathered keys are put back in sequence order, and each of a rank's two query chunks
attends a prefix of them (lower-right causal: its own chunk's diagonal), the document mask
built from the whole sequence's document ids.

Nothing here holds state: layers take the context group they are given (None: no context
parallelism, and every function is the identity).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from pretrain.data.loader import context_positions
from pretrain.model.documents import masked_backends
from pretrain.model.tensor_parallel import all_gather_along, reduce_scatter_along

ULYSSES, ALLGATHER = "ulysses", "allgather"  # parallel.context_kind (`config.CONTEXT_KINDS`)


def cp_world_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def cp_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_to_all(x: torch.Tensor, group, *, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split `x` into N pieces along `scatter_dim`, send piece j to rank j of `group`, and
    concatenate the pieces received along `gather_dim` (in rank order)."""
    n = dist.get_world_size(group)
    if x.shape[scatter_dim] % n:
        raise ValueError(f"context parallelism: dimension {scatter_dim} of a {tuple(x.shape)} "
                         f"tensor is not divisible by the {n} context ranks")
    send = torch.stack(torch.tensor_split(x, n, dim=scatter_dim)).contiguous()  # (N, ...)
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """`_all_to_all` along (scatter_dim, gather_dim); backward the inverse exchange (the same
    along (gather_dim, scatter_dim))."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim=scatter_dim, gather_dim=gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad.contiguous(), ctx.group, scatter_dim=gather_dim,
                           gather_dim=scatter_dim), None, None, None


def sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's chunk of every head (B, T/N, H, hd) -> the whole sequence of its heads
    (B, T, H/N, hd): the c-th run of H/N heads on context rank c."""
    if cp_world_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, 2, 1)  # scatter heads, gather the sequence


def heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of `sequence_to_heads`: (B, T, H/N, hd) -> (B, T/N, H, hd)."""
    if cp_world_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, 1, 2)  # scatter the sequence, gather heads


def chunk_offset(tokens: int, group) -> int:
    """The global position of this rank's first token, given its chunk of `tokens` tokens."""
    return cp_rank(group) * tokens


def chunk_loss_scale(labels: torch.Tensor, group, ignore_index: int = -100) -> torch.Tensor | float:
    """The factor that turns this rank's mean loss (over its chunk's labels) into N x its share
    of the whole sequence's mean: N x (labels here) / (labels in the group). 1.0 (no
    collective) without context parallelism; 1.0 as well whenever no label is ignored."""
    n = cp_world_size(group)
    if n == 1:
        return 1.0
    kept = (labels != ignore_index).sum().to(torch.float64)
    total = kept.clone()
    dist.all_reduce(total, group=group)
    return (kept * n / total).float()


def lookahead(input_ids: torch.Tensor, labels: torch.Tensor, depth: int, group, *,
              ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's contiguous chunk (Ulysses) of input_ids and labels (B, L) with the `depth`
    positions after it appended (B, L + depth): the first `depth` of the next context rank's
    chunk, on the last rank (and without context parallelism) 0 and `ignore_index`, the
    sequence's end. `x[:, k:k + L]` is then x k positions ahead of every position of the chunk,
    across the chunks (multi-token prediction's inputs and targets). One all-gather of the
    chunks' heads (2 x B x depth integers) over the group; `depth` <= L
    (`resolve.layout.check_mtp`)."""
    B = input_ids.shape[0]
    ends = (input_ids.new_zeros(B, depth), labels.new_full((B, depth), ignore_index))
    n = cp_world_size(group)
    if n == 1:
        return tuple(torch.cat((x, end), dim=1) for x, end in zip((input_ids, labels), ends))
    head = torch.stack((input_ids[:, :depth], labels[:, :depth]))  # (2, B, depth)
    heads = [torch.empty_like(head) for _ in range(n)]
    dist.all_gather(heads, head.contiguous(), group=group)
    rank = cp_rank(group)
    after = heads[rank + 1] if rank + 1 < n else torch.stack(ends)
    return torch.cat((input_ids, after[0]), dim=1), torch.cat((labels, after[1]), dim=1)


# ---- all-gather context parallelism --------------------------------------------------------------

def token_positions(tokens: int, group, kind: str, device=None) -> torch.Tensor:
    """The global positions (tokens,) int64 of this rank's `tokens` tokens, in the order it
    holds them: its contiguous chunk (Ulysses) or its head and tail chunks (all-gather)."""
    n = cp_world_size(group)
    positions = context_positions(tokens * n, rank=cp_rank(group), size=n,
                                  head_tail=kind == ALLGATHER)
    return torch.from_numpy(positions).to(device)


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence dimension `dim` over the context group (rank-major);
    backward reduce-scatters: rank r gets the sum over the ranks of the gradient of its part."""

    @staticmethod
    def forward(ctx, x, group, dim: int):
        ctx.group, ctx.dim = group, dim
        return all_gather_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_along(grad, ctx.group, ctx.dim), None, None


def _in_sequence_order(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """Gathered head-tail chunks (rank-major along `dim`: rank r's chunks r, 2n-1-r) put back in
    sequence order: chunk j < n is rank j's first, chunk j >= n rank 2n-1-j's second."""
    pieces = x.unflatten(dim, (n, 2, -1))  # (..., rank, which, piece, ...)
    heads = pieces.select(dim + 1, 0)  # chunks 0 .. n-1
    tails = pieces.select(dim + 1, 1).flip(dim)  # chunks n .. 2n-1
    return torch.cat((heads, tails), dim=dim).flatten(dim, dim + 1)


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *,
                        scale: float | None,
                        document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries q (B, T/N, nh, hd) over the keys and values of
    the whole sequence, all-gathered from each rank's k, v (B, T/N, nkv, hd) (rotated, global
    positions); returns (B, nh, T/N, hd). The rank's tokens are its head and tail chunks
    (`context_chunks`). `document_ids` (B, T) of the whole sequence: keys of the query's own
    document only."""
    n, rank = cp_world_size(group), cp_rank(group)
    local = q.shape[1]
    if local % 2:
        raise ValueError(f"all-gather context parallelism: {local} tokens per rank do not make "
                         "two equal head and tail chunks")
    piece = local // 2
    kv = _GatherSequence.apply(torch.stack((k, v)), group, 2)  # (2, B, T, nkv, hd)
    k, v = _in_sequence_order(kv, n, 2).transpose(2, 3).unbind(0)  # (B, nkv, T, hd) each
    q = q.transpose(1, 2)  # (B, nh, T/N, hd)
    gqa = q.shape[1] != k.shape[1]
    outputs = []
    for which, chunk in enumerate((rank, 2 * n - 1 - rank)):
        start, end = chunk * piece, (chunk + 1) * piece  # the query chunk's global positions
        queries = q[:, :, which * piece:(which + 1) * piece]
        keys, values = k[:, :, :end], v[:, :, :end]  # every key at or before the chunk's last
        if document_ids is None:  # the chunk's own keys causal, every earlier key seen
            y = F.scaled_dot_product_attention(queries, keys, values,
                                               attn_mask=causal_lower_right(piece, end),
                                               enable_gqa=gqa, scale=scale)
        else:  # and only keys of the query's own document (ids of the whole sequence)
            ids = document_ids[:, :end]
            mask = (ids[:, start:end, None] == ids[:, None, :]) \
                & torch.ones(piece, end, dtype=torch.bool, device=ids.device).tril(start)
            backends = masked_backends(q.device.type, q.dtype)
            with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                y = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask[:, None],
                                                   enable_gqa=gqa, scale=scale)
        outputs.append(y)
    return torch.cat(outputs, dim=2)
