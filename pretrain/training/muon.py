"""Muon for a run's hidden matrices beside AdamW for everything else (`train.optimizer: muon`).

Which parameters: `pretrain.families.is_muon_matrix` (the family's table says): the attention
and MLP projections of every decoder layer (each expert's own), as separate matrices; AdamW keeps
the embeddings, the head, the norm gains and the MoE router. q/k/v and gate/up are separate
parameters even when the model runs them as one matmul (`model.fused_projections`), so each
projection is orthogonalised on its own, never the concatenation.

The update is `torch.optim.Muon`'s (the installed torch's functions, called, not copied):
momentum B <- mu B + (1 - mu) G, Nesterov's G + mu (B - G), Newton-Schulz on it (5 quintic steps
in bf16, the coefficients of torch's defaults; with train.muon_ns_dtype=fp32 the same steps in
fp32, `newton_schulz`), decoupled weight decay W <- W (1 - lr wd), then
W <- W - lr * sqrt(max(1, rows / cols)) * O (`adjust_lr_fn="original"`). The AdamW groups step
through `torch.optim.AdamW` (the same groups, one state table).

Newton-Schulz needs the whole matrix. A rank holds a piece of it: a tensor-parallel shard (rows
or columns, `partition_dim`), DeepSpeed's ZeRO-1/2 flat partition of a parameter group, ZeRO-3's
chunk of each parameter, or FSDP2's row shard (a DTensor). The momentum is kept per element on
the piece (sharded like Adam's moments, and saved with them); each step the Nesterov update's
pieces are all-gathered (the data-parallel group, then the tensor group), every rank of the group
orthogonalises the whole matrix - the same bits on each, in the same order - and applies its own
piece. That costs each rank the whole matrices' Newton-Schulz and one all-gather of the hidden
matrices per step, and gives every layout the update one process computes. Memory: the momentum
is one fp32 tensor per matrix (Adam's two moments for the rest); the gathers are transient,
one matrix at a time except at ZeRO-1/2, where the flat group of the stage's hidden matrices is
all-gathered whole (its fp32 size, once per step; the planner does not count it yet).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.optim._muon import (DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS, _adjust_lr,
                               _zeropower_via_newtonschulz)

from pretrain.families import is_muon_matrix

MOMENTUM = 0.95  # torch.optim.Muon's default
NS_COEFFICIENTS = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
ADJUST_LR = "original"  # sqrt(max(1, rows / cols)): torch.optim.Muon's default

MOMENTUM_KEY = "momentum_buffer"  # Muon's one state tensor per matrix (torch.optim.Muon's name)


def state_keys(name: str, optimizer) -> tuple[str, ...]:
    """The per-element optimizer state a parameter `name` has under train.optimizer
    `optimizer`: Muon's momentum for its matrices, Adam's two moments for the rest (what a
    checkpoint holds of it and resharding reads)."""
    if str(getattr(optimizer, "value", optimizer)) == "muon" and is_muon_matrix(name):
        return (MOMENTUM_KEY,)
    return ("exp_avg", "exp_avg_sq")


def split_groups(groups: list[dict[str, Any]], names: dict[int, str], *, muon_lr: float,
                 muon_weight_decay: float) -> list[dict[str, Any]]:
    """`groups` (`mup.optimizer_groups`: AdamW's, muP's rates included) with their Muon
    matrices moved into Muon groups at `muon_lr` and `muon_weight_decay` (`names`: id of a
    parameter -> its name). The AdamW groups come first (group 0's lr is the one a run logs);
    empty groups are left out. muP's per-group rates stay AdamW's: Muon's step is orthogonal, its
    size set by `adjust_lr` from the matrix's shape, not by the width multiplier."""
    adamw, muon = [], []
    for group in groups:
        hidden = [p for p in group["params"] if is_muon_matrix(names[id(p)])]
        rest = [p for p in group["params"] if not is_muon_matrix(names[id(p)])]
        if rest:
            adamw.append({**group, "params": rest})
        if hidden:
            muon.append({**group, "params": hidden, "lr": muon_lr,
                         "weight_decay": muon_weight_decay, "muon": True})
    # one Muon group: its hyper-parameters are the same for every matrix; the expert grid's
    # experts in one of their own (`engine.expert_param_groups`: DeepSpeed's MoE group,
    # partitioned over the expert-data ranks)
    merged: dict[Any, dict[str, Any]] = {}
    for group in muon:
        key = group.get("name") if group.get("moe") else None
        if key in merged:
            merged[key]["params"] = merged[key]["params"] + group["params"]
        else:
            merged[key] = group
    return adamw + list(merged.values())


def newton_schulz(update: torch.Tensor, dtype: str) -> torch.Tensor:
    """The orthogonalised `update`: torch.optim.Muon's own function in bf16, or its iteration
    (the same coefficients, steps, transpose and normalisation) in fp32."""
    if dtype == "bf16":
        return _zeropower_via_newtonschulz(update, NS_COEFFICIENTS, DEFAULT_NS_STEPS, EPS)
    a, b, c = NS_COEFFICIENTS
    tall = update.size(0) > update.size(1)
    x = update.float().T if tall else update.float()
    x = x / x.norm().clamp(min=EPS)
    for _ in range(DEFAULT_NS_STEPS):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


# ---- where a matrix's pieces are ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TensorShard:
    """A tensor-parallel shard: the whole matrix is the tensor group's shards concatenated
    along `dim` (equal shards)."""

    group: Any
    dim: int

    def whole(self, shard: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, shard.contiguous(), group=self.group)
        return torch.cat(parts, dim=self.dim)

    def mine(self, whole: torch.Tensor) -> torch.Tensor:
        size = dist.get_world_size(self.group)
        return whole.chunk(size, dim=self.dim)[dist.get_rank(self.group)]


def _tp_whole(tp: TensorShard | None, t: torch.Tensor) -> torch.Tensor:
    return t if tp is None else tp.whole(t)


def _tp_mine(tp: TensorShard | None, t: torch.Tensor) -> torch.Tensor:
    return t if tp is None else tp.mine(t)


@dataclasses.dataclass(frozen=True)
class Matrix:
    """One parameter inside the tensor an optimizer steps: `shape` (of this tensor-parallel rank's
    shard; `tp`: how the shards make the whole), where it starts in the data-parallel group's
    whole flat tensor (`start`) and its element count."""

    shape: torch.Size
    start: int
    tp: TensorShard | None


class Plain:
    """The stepped tensor is the parameter (one process, DeepSpeed's ZeRO-0): at most a
    tensor-parallel shard."""

    def __init__(self, tp: TensorShard | None):
        self.tp = tp

    def orthogonalised(self, update: torch.Tensor, ns) -> Iterator[tuple[slice, torch.Tensor, Any]]:
        whole = _tp_whole(self.tp, update)
        yield slice(0, update.numel()), _tp_mine(self.tp, ns(whole)).reshape(-1), whole.shape


class FlatPartition:
    """DeepSpeed's ZeRO-1/2: the stepped tensor is this rank's `partition_size` elements, from
    `rank * partition_size`, of a parameter group flattened; `matrices` its parameters."""

    def __init__(self, matrices: list[Matrix], *, group, partition_size: int):
        self.matrices, self.group, self.size = matrices, group, partition_size

    def orthogonalised(self, update: torch.Tensor, ns) -> Iterator[tuple[slice, torch.Tensor, Any]]:
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        flat = torch.empty(world * self.size, dtype=update.dtype, device=update.device)
        dist.all_gather_into_tensor(flat, update.contiguous(), group=self.group)
        mine = (rank * self.size, (rank + 1) * self.size)
        for m in self.matrices:
            numel = m.shape.numel()
            whole = _tp_whole(m.tp, flat[m.start:m.start + numel].view(m.shape))
            start, stop = max(m.start, mine[0]), min(m.start + numel, mine[1])
            o = _tp_mine(m.tp, ns(whole)).reshape(-1)
            if start < stop:  # this rank's piece of it
                yield (slice(start - mine[0], stop - mine[0]),
                       o[start - m.start:stop - m.start], whole.shape)


class Chunks:
    """DeepSpeed's ZeRO-3: the stepped tensor is this rank's chunk of each parameter of a
    sub-group, one after the other; a parameter of `numel` elements is its data-parallel
    ranks' chunks (`chunk` elements each, the last padded) concatenated."""

    def __init__(self, matrices: list[tuple[Matrix, int]], *, group):
        self.matrices, self.group = matrices, group  # (matrix, chunk size); start: in the tensor

    def orthogonalised(self, update: torch.Tensor, ns) -> Iterator[tuple[slice, torch.Tensor, Any]]:
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        for m, chunk in self.matrices:
            flat = torch.empty(world * chunk, dtype=update.dtype, device=update.device)
            dist.all_gather_into_tensor(flat, update[m.start:m.start + chunk].contiguous(),
                                        group=self.group)
            whole = _tp_whole(m.tp, flat[:m.shape.numel()].view(m.shape))
            o = torch.zeros(world * chunk, dtype=update.dtype, device=update.device)
            o[:m.shape.numel()] = _tp_mine(m.tp, ns(whole)).reshape(-1)
            yield slice(m.start, m.start + chunk), o[rank * chunk:(rank + 1) * chunk], whole.shape


class RowShard:
    """FSDP2: the stepped tensor is a DTensor, this rank's rows of its tensor-parallel shard."""

    def __init__(self, tp: TensorShard | None):
        self.tp = tp

    def orthogonalised(self, update, ns) -> Iterator[tuple[slice, torch.Tensor, Any]]:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        whole = _tp_whole(self.tp, update.full_tensor())
        o = _tp_mine(self.tp, ns(whole))
        shape, offset = compute_local_shape_and_global_offset(update.shape, update.device_mesh,
                                                              update.placements)
        piece = o[offset[0]:offset[0] + shape[0]].reshape(-1)
        yield slice(0, piece.numel()), piece, whole.shape


# ---- the optimizer ------------------------------------------------------------------------------

class MuonAdamW(torch.optim.Optimizer):
    """Muon over the groups marked "muon", torch's AdamW over the others; one `state` table.

    `pieces(t)` says where the whole matrices of a stepped tensor are (`Plain`, `FlatPartition`,
    `Chunks`, `RowShard`); `bind` sets it from the engine (DeepSpeed's ZeRO optimizer replaces
    the parameters with its flat partitions). DeepSpeed's own Muon paths switch on a parameter's
    `use_muon`, which this optimizer never sets: they stay off."""

    def __init__(self, groups: list[dict[str, Any]], *, betas: tuple[float, float], eps: float,
                 momentum: float = MOMENTUM, ns_dtype: str = "bf16"):
        for group in groups:
            group.setdefault("muon", False)
        super().__init__(groups, dict(lr=groups[0]["lr"], weight_decay=0.0, momentum=momentum,
                                      betas=betas, eps=eps))
        self.ns_dtype = ns_dtype
        adamw = [g for g in self.param_groups if not g["muon"]]
        self.adamw = torch.optim.AdamW(adamw, betas=betas, eps=eps)
        self.adamw.param_groups, self.adamw.state = adamw, self.state
        self.pieces: dict[int, Any] = {}

    def bind(self, pieces: dict[int, Any]) -> None:
        """Where each stepped tensor's matrices are (by `id`)."""
        self.pieces = dict(pieces)

    @torch.no_grad()
    def step(self, closure=None):
        """One step of every group in `param_groups` (DeepSpeed's ZeRO-1/2 step one group at a
        time by narrowing it)."""
        assert closure is None, "no closure: the engines compute the loss"
        adamw = [g for g in self.param_groups if not g["muon"]]
        if adamw:
            self.adamw.param_groups, self.adamw.state = adamw, self.state
            self.adamw.step()
        for group in self.param_groups:
            if group["muon"]:
                self._muon_step(group)

    def _muon_step(self, group: dict[str, Any]) -> None:
        lr, mu = float(group["lr"]), group["momentum"]

        def ns(whole: torch.Tensor) -> torch.Tensor:
            return newton_schulz(whole, self.ns_dtype)

        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - mu)
            update = p.grad.lerp(buf, mu)  # Nesterov
            pieces = self.pieces.get(id(p))
            if pieces is None:
                if p.dim() != 2:
                    raise RuntimeError(
                        f"Muon was handed a tensor of shape {tuple(p.shape)} that no layout "
                        "describes: this engine's optimizer wrapper is not one Muon knows")
                pieces = Plain(None)
            local = _local(p).view(-1)
            local.mul_(1 - lr * group["weight_decay"])
            for where, o, shape in pieces.orthogonalised(update, ns):
                local[where].add_(o.to(local.dtype), alpha=-_adjust_lr(lr, ADJUST_LR, shape))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


# ---- construction and binding ------------------------------------------------------------------

def _tensor_shard(param: torch.nn.Parameter, tp_group, dim: int | None = None) -> TensorShard | None:
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return None
    if getattr(param, "expert_parallel", False):  # a whole expert on its tensor rank
        return None
    if dim is None:
        if not getattr(param, "tensor_model_parallel", False):
            return None
        dim = param.partition_dim
    return TensorShard(tp_group, dim)


def build_optimizer(named: Iterable[tuple[str, torch.nn.Parameter]], groups: list[dict[str, Any]],
                    t) -> MuonAdamW:
    """The run's `MuonAdamW` over `groups` (`mup.optimizer_groups` of the model whose
    (name, parameter) pairs are `named`), with train.muon_lr and train.muon_weight_decay (null:
    train.weight_decay) and train.muon_ns_dtype for the Muon group, train.beta1/beta2/eps for
    AdamW's."""
    names = {id(p): name for name, p in named}
    decay = t.weight_decay if t.muon_weight_decay is None else t.muon_weight_decay
    return MuonAdamW(split_groups(groups, names, muon_lr=t.muon_lr, muon_weight_decay=decay),
                     betas=(t.beta1, t.beta2), eps=t.eps, ns_dtype=t.muon_ns_dtype)


def bind_to_deepspeed(engine, tp_group) -> None:
    """Tell the `MuonAdamW` inside DeepSpeed's `engine` where its stepped tensors' matrices
    are (`deepspeed_pieces` of the engine's optimizer wrapper)."""
    wrapper = engine.optimizer
    inner = wrapper if isinstance(wrapper, MuonAdamW) else wrapper.optimizer
    inner.bind(deepspeed_pieces(wrapper, tp_group))


def plain_pieces(params: Iterable[torch.nn.Parameter], tp_group) -> dict[int, Any]:
    """`Plain` of every matrix parameter (one process, ZeRO-0)."""
    return {id(p): Plain(_tensor_shard(p, tp_group)) for p in params if p.dim() == 2}


def row_shard_pieces(named: Iterable[tuple[str, torch.nn.Parameter]], tp_group,
                     tensor_parallel: set[str]) -> dict[int, Any]:
    """FSDP2's `RowShard`s (`tensor_parallel`: the names of tensor-parallel shards, whose
    `partition_dim` fully_shard's replacements do not carry; `model.tensor_partition_dim`)."""
    from pretrain.model import tensor_partition_dim

    return {id(p): RowShard(_tensor_shard(p, tp_group, tensor_partition_dim(name))
                            if name in tensor_parallel else None)
            for name, p in named if is_muon_matrix(name)}


def deepspeed_pieces(wrapper, tp_group) -> dict[int, Any]:
    """Where the matrices of each tensor DeepSpeed's ZeRO optimizer `wrapper` steps are: its
    ZeRO-1/2 flat partitions (`FlatPartition`), ZeRO-3 sub-groups (`Chunks`), or the
    parameters themselves (no wrapper, ZeRO-0 in fp32). Raises for a wrapper it cannot read."""
    name = type(wrapper).__name__
    if name == "DeepSpeedZeroOptimizer":  # ZeRO-1/2
        pieces = {}
        for i, params in enumerate(wrapper.round_robin_bit16_groups):
            flat = wrapper.bit16_groups_flat[i]
            matrices = [Matrix(p.shape, (p.data.data_ptr() - flat.data_ptr()) // p.element_size(),
                               _tensor_shard(p, tp_group)) for p in params]
            pieces[id(wrapper.single_partition_of_fp32_groups[i])] = FlatPartition(
                matrices, group=wrapper.real_dp_process_group[i],
                partition_size=int(wrapper.partition_size[i]))
        return pieces
    if name == "DeepSpeedZeroOptimizer_Stage3":
        pieces = {}
        for i, params in enumerate(wrapper.fp16_groups):
            matrices, start = [], 0
            for p in params:
                chunk = p.ds_tensor.ds_numel
                matrices.append((Matrix(torch.Size(p.ds_shape), start,
                                        _tensor_shard(p, tp_group)), chunk))
                start += chunk
            pieces[id(wrapper.fp32_partitioned_groups_flat[i])] = Chunks(
                matrices, group=wrapper.dp_process_group)
        return pieces
    if isinstance(wrapper, MuonAdamW):
        return plain_pieces((p for g in wrapper.param_groups for p in g["params"]), tp_group)
    raise NotImplementedError(
        f"train.optimizer=muon under DeepSpeed's {name}: only fp32 ZeRO-0, ZeRO-1/2 "
        "(DeepSpeedZeroOptimizer) and ZeRO-3 say where each matrix's pieces are")
