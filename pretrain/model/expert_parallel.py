"""Expert parallelism (`parallel.expert`): the all-to-all token dispatch and combine of `MoE`.

The expert ranks of a layer are its tensor-parallel ranks (ARCHITECTURE.md says why): rank i of
the group holds experts [i * n / ep, (i + 1) * n / ep) whole, under their global names
(`mlp.experts.M.*`), and routes the tokens of its own sequence chunk: under sequence
parallelism the (B, T/tp, C) shard it already holds, otherwise the chunk it keeps of the
replicated (B, T, C) input (`scatter_tokens`; the output is gathered back, `gather_tokens`).
Under context parallelism T is already the context rank's chunk of each sequence, so each
expert rank routes its 1/ep of that; in a pipeline each stage's tensor ranks do the same for
the stage's layers.

A forward on one rank, its n tokens routed to E experts (L = E / ep of them local):

1. the kept (token, expert) assignments, sorted by expert (`Routing`), are grouped by the rank
   that holds the expert; the per-expert counts are exchanged first (one all-to-all of E
   integers) and read back with the rank's own in one `tolist` (`count_rows`: the forward's
   one host read), so every rank knows how many rows it sends to and receives from each peer;
2. `all_to_all` sends the rows (`torch.distributed.all_to_all_single`, through the collective
   log like every other collective); a rank's received rows are grouped by source rank, then by
   local expert, and are regrouped by expert (a stable sort: source order inside an expert);
3. each local expert runs one matmul over its rows, or all of them one grouped matmul
   (`MoE`'s choice; every local expert runs, with zero rows too: ZeRO-3 gathers the same
   parameters on every data rank);
4. the outputs go back to the rows' owners by the reverse `all_to_all`, in the order they were
   sent, and are combined there exactly as without expert parallelism.

`all_to_all` is an autograd function whose backward is the reverse exchange, so gradients reach
the tokens' owners and each expert's weight gradient sums over every token routed to it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

SEQUENCE_DIM = 1
_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.")


@dataclass(frozen=True)
class ExpertGroups:
    """Where a MoE layer's experts live when the expert ranks are not the tensor group
    (`parallel.expert` != `parallel.tensor`, or `parallel.expert_tensor` = tensor): `group`, the
    all-to-all's ranks (`ProcessGroups.expert`); `rank`, this rank's index in it (it holds
    experts [rank * n / size, (rank + 1) * n / size)); `split`: each expert's matrices are split
    over the tensor group like the dense MLP (expert_tensor = tensor), else whole."""

    group: object
    rank: int
    size: int
    split: bool


def expert_groups_of(groups) -> "ExpertGroups | bool":
    """What `MoE(expert_parallel=)` takes for a run's `ProcessGroups`: False without expert
    parallelism, True where the expert ranks are the tensor ranks (whole experts, the original
    design), else the `ExpertGroups` of the expert grid (`Topology.expert_groups`)."""
    topology = groups.topology
    if topology.expert == 1:
        return False
    if topology.expert == topology.tensor and topology.expert_tensor == 1:
        return True
    return ExpertGroups(group=groups.expert, rank=topology.expert_rank(topology.rank),
                        size=topology.expert, split=topology.expert_tensor > 1)


def expert_owner(name: str, cfg, *, expert: int) -> int | None:
    """The rank of the expert group holding parameter `name` whole under parallel.expert =
    `expert` (None: not an expert's, or no expert parallelism)."""
    match = _EXPERT.match(name) if expert > 1 else None
    return None if match is None else int(match[1]) // (cfg.num_experts // expert)


def _exchange(x: torch.Tensor, *, send: list[int], receive: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(receive), *x.shape[1:]))
    # looked up on the module at each call: the collective log wraps torch.distributed's names
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=receive,
                           input_split_sizes=send, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, receive, group):
        ctx.send, ctx.receive, ctx.group = send, receive, group
        return _exchange(x, send=send, receive=receive, group=group)

    @staticmethod
    def backward(ctx, grad):
        back = _exchange(grad, send=ctx.receive, receive=ctx.send, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, *, send: list[int], receive: list[int], group) -> torch.Tensor:
    """Rows of `x` (send[r] of them to rank r of `group`, in rank order) swapped for
    sum(receive) rows (receive[r] from rank r); backward sends the gradients back."""
    return _AllToAll.apply(x, send, receive, group)


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """Per-expert row counts (E,) of this rank -> (ep, L): row s holds what rank s sends to each
    of this rank's L local experts."""
    ep = dist.get_world_size(group)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received.view(ep, -1)


class _ScatterTokens(torch.autograd.Function):
    """(B, T, C) replicated over the group -> this rank's (B, T/ep, C); backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        chunk = x.shape[SEQUENCE_DIM] // size
        return x.narrow(SEQUENCE_DIM, rank * chunk, chunk).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group), None


class _GatherTokens(torch.autograd.Function):
    """This rank's (B, T/ep, C) -> (B, T, C) on every rank; backward keeps this rank's chunk (the
    consumer, the residual stream, is replicated: its gradient is the same on every rank)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        chunk = grad.shape[SEQUENCE_DIM] // size
        return grad.narrow(SEQUENCE_DIM, rank * chunk, chunk).contiguous(), None


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=SEQUENCE_DIM)


def scatter_tokens(x: torch.Tensor, group) -> torch.Tensor:
    return _ScatterTokens.apply(x, group)


def gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherTokens.apply(x, group)


@dataclass(frozen=True)
class RowCounts:
    """A forward's row counts, on the host: what this rank sends to each expert (`kept`, E) and
    what each source rank sends to each of its L local experts (`received`, ep x L, also on the
    device as `received_on_device`)."""

    kept: list[int]
    received: list[list[int]]
    received_on_device: torch.Tensor

    @property
    def send(self) -> list[int]:
        """Rows to each rank of the group (its experts' counts summed)."""
        local = len(self.received[0])
        return [sum(self.kept[r * local:(r + 1) * local]) for r in range(len(self.received))]

    @property
    def receive(self) -> list[int]:
        """Rows from each rank of the group."""
        return [sum(row) for row in self.received]

    @property
    def per_local_expert(self) -> list[int]:
        """Rows of each local expert, from every source."""
        return [sum(column) for column in zip(*self.received)]


def count_rows(kept: torch.Tensor, group) -> RowCounts:
    """Exchange the per-expert counts `kept` (E,) over `group` and read both back to the host
    with ONE `tolist`: the all-to-alls' split sizes and each expert's rows need them there."""
    received = exchange_counts(kept, group)  # (ep, L)
    ep, local = received.shape
    host = torch.cat([kept, received.reshape(-1)]).tolist()  # the forward's one host read
    experts = kept.numel()
    return RowCounts(kept=host[:experts],
                     received=[host[experts + r * local:experts + (r + 1) * local]
                               for r in range(ep)],
                     received_on_device=received)


def run_experts(compute, tokens: torch.Tensor, counts: RowCounts, group) -> torch.Tensor:
    """The outputs (M, C) of the experts each row of `tokens` (M, C) was routed to, in the rows'
    order; rows sorted by global expert, `counts.kept` (E,) of them each (`count_rows`).
    `compute(rows, sizes, sizes_on_device)`: this rank's L experts over rows grouped by local
    expert, sizes[i] of them for expert i (`MoE`'s grouped matmul or its loop)."""
    ep, local = dist.get_world_size(group), len(counts.received[0])
    send, receive = counts.send, counts.receive
    rows = all_to_all(tokens, send=send, receive=receive, group=group)
    # received rows: by source rank, then local expert -> by local expert, source order inside
    expert_of_row = torch.repeat_interleave(
        torch.arange(local, device=rows.device).repeat(ep),
        counts.received_on_device.reshape(-1), output_size=sum(receive))
    order = torch.argsort(expert_of_row, stable=True)
    grouped = rows.index_select(0, order)
    outputs = compute(grouped, counts.per_local_expert, counts.received_on_device.sum(dim=0))
    unsorted = outputs.index_select(0, torch.argsort(order))  # back to the received order
    return all_to_all(unsorted, send=receive, receive=send, group=group)
