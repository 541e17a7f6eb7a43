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

Nothing here holds state: layers take the context group they are given (None: no context
parallelism, and every function is the identity).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


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
