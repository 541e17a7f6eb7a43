"""Megatron-style tensor parallelism (Shoeybi et al. 2019) and sequence parallelism
(Korthikanti et al. 2022): the collectives and the sharded layers (the vocab-parallel loss is
`pretrain.model.loss`'s).

Every collective is a small named autograd function, in matching pairs, and a no-op (the input
itself, no autograd node) when the group has one rank. Activations are (B, T, C); the sequence
dimension is 1. "Partial" means each rank holds a summand of the true value.

================================  =========================  ============================
function                          forward                    backward
================================  =========================  ============================
copy_to_tp                        identity                   all-reduce
reduce_from_tp                    all-reduce (partial->full) identity
scatter_to_sequence               keep own T/tp slice        all-gather along T
gather_from_sequence              all-gather along T         reduce-scatter along T
reduce_scatter_to_sequence        reduce-scatter along T     all-gather along T
scatter_to_tp                     keep own slice of dim -1   all-gather along dim -1
gather_from_tp                    all-gather along dim -1    keep own slice of dim -1
================================  =========================  ============================

A transformer block: the input of the column-parallel projections (q/k/v, gate/up) goes through
`column_parallel_input` once per block: `copy_to_tp`, or under sequence parallelism
`gather_from_sequence` (the residual stream and the norms then hold only T/tp tokens per rank).
A `RowParallelLinear` (o_proj, down_proj) ends the region with `reduce_from_tp`, or
`reduce_scatter_to_sequence` under sequence parallelism. So a block's forward has exactly one
all-reduce (or one all-gather + one reduce-scatter, the same bytes) per attention and per MLP.

Tensor-parallel parameters carry `tensor_model_parallel = True` (and Megatron's `partition_dim`,
`partition_stride`): DeepSpeed's `is_model_parallel_parameter` reads it and counts their
gradients in the global norm on every TP rank, while unmarked (replicated) parameters are
counted on TP rank 0 only; the norm is then summed over the model-parallel group.

Collectives are torch.distributed's tensor forms, `all_gather_single` / `reduce_scatter_single`
(their names since torch 2.13; `all_gather_into_tensor` / `reduce_scatter_tensor` before, which
2.13 deprecates). gloo has implemented both since late 2023 (before the torch 2.4 this
package requires; checked on torch 2.13) - its reduce-scatter is an all-reduce plus a slice,
twice NCCL's bytes, which only costs CPU test time - so no fallback is needed. What gloo lacked
until 2025 is the list form `dist.reduce_scatter`, which is not used here.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

SEQUENCE_DIM = 1  # activations are (B, T, C)

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def tp_world_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def tp_rank(group) -> int:
    if group is None:
        return 0
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the tensor-parallel group it was given: "
                         "pass the group from Topology.create_groups() of this rank")
    return rank


# ---- raw collectives (no autograd) -------------------------------------------------------------

def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    # out of place: a gradient may be the very tensor another branch of an add also receives
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=op, group=group)
    return out


def _check_divisible(x: torch.Tensor, dim: int, size: int, what: str) -> None:
    if x.shape[dim] % size:
        hint = (" (sequence parallelism: use a sequence length divisible by parallel.tensor)"
                if dim == SEQUENCE_DIM else "")
        raise ValueError(f"{what}: dimension {dim} of shape {tuple(x.shape)} is not divisible by "
                         f"the {size} tensor-parallel ranks{hint}")


def _split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    size = tp_world_size(group)
    _check_divisible(x, dim, size, "split")
    chunk = x.shape[dim] // size
    return x.narrow(dim, tp_rank(group) * chunk, chunk).contiguous()


def all_gather_along(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` (no autograd: for export and tests)."""
    size = tp_world_size(group)
    dim = dim % x.ndim
    x = x.contiguous()
    out = x.new_empty((size, *x.shape))  # rank-major: (tp, *x.shape)
    _all_gather_single(out.view(-1), x.view(-1), group=group)
    return out.movedim(0, dim).flatten(dim, dim + 1)  # concatenated along dim


def _reduce_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    size = tp_world_size(group)
    dim = dim % x.ndim
    _check_divisible(x, dim, size, "reduce-scatter")
    chunks = x.unflatten(dim, (size, -1)).movedim(dim, 0).contiguous()  # (tp, ..., n/tp, ...)
    out = chunks.new_empty(chunks.shape[1:])
    _reduce_scatter_single(out.view(-1), chunks.view(-1), group=group)
    return out


def reduce_scatter_along(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Sum every rank's `x` and keep this rank's part along `dim` (no autograd: for the
    backward of gathers outside this module, e.g. all-gather context parallelism)."""
    return _reduce_scatter(x, group, dim)


# ---- autograd functions, in pairs -------------------------------------------------------------

class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group, SEQUENCE_DIM)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, ctx.group, SEQUENCE_DIM), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_along(x, group, SEQUENCE_DIM)

    @staticmethod
    def backward(ctx, grad):
        # the consumers are tensor-parallel: each rank's grad is a partial sum
        return _reduce_scatter(grad, ctx.group, SEQUENCE_DIM), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group, SEQUENCE_DIM)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, ctx.group, SEQUENCE_DIM), None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group, x.ndim - 1)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, ctx.group, grad.ndim - 1), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_along(x, group, x.ndim - 1)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.group, grad.ndim - 1), None


def _apply(function, x: torch.Tensor, group) -> torch.Tensor:
    return x if tp_world_size(group) == 1 else function.apply(x, group)


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; backward all-reduces the partial gradients of the TP consumers."""
    return _apply(_CopyToTP, x, group)


class SequenceShardedWeightGrad:
    """The gradient of a weight every tensor-parallel rank holds whole while its input is a
    sequence shard (RMSNorm under sequence parallelism): each rank's gradient is a partial sum
    over its T/tp tokens, and the weight needs the sum over the group.

    `copy_to_tp` would all-reduce it in the backward of every micro-batch: for a 70B stage of 20
    layers and 64 micro-batches, 2,560 tiny all-reduces per step. Sums are linear, so instead the
    partial gradients of a step's micro-batches are summed here in fp32 and all-reduced once, in
    the backward of the step's last micro-batch (as Megatron reduces its norms once per step);
    the earlier micro-batches hand zeros to the optimizer's accumulation. The total DeepSpeed
    accumulates is the same, for every ZeRO stage and the pipeline engine alike, which call the
    backward of each micro-batch once. `micro_batches` is the gradient-accumulation count of a
    step (`defer_sequence_parallel_grads` sets it from the engine; 1 reduces every backward).

    It is a hook on the weight (`attach`), run by autograd before the gradient is accumulated,
    not a function in the forward: the forward stays free of Python state, so a compiled block
    traces as one graph, and the hook runs eagerly after the compiled backward hands the
    gradient back.
    """

    def __init__(self, group) -> None:
        self.group = group
        self.micro_batches = 1
        self.reductions = 0  # all-reduces issued, for tests and telemetry
        self._seen = 0
        self._partial: torch.Tensor | None = None

    def attach(self, weight: nn.Parameter) -> None:
        """Sum `weight`'s gradient over the group as described (nothing when tp is 1)."""
        if tp_world_size(self.group) > 1:
            weight.register_hook(self.backward)

    def backward(self, grad: torch.Tensor) -> torch.Tensor:
        if self._partial is None:
            self._partial = grad.to(torch.float32, copy=True)
        else:
            self._partial.add_(grad)
        self._seen += 1
        if self._seen < self.micro_batches:
            return torch.zeros_like(grad)
        total, self._seen, self._partial = self._partial, 0, None
        self.reductions += 1
        dist.all_reduce(total, group=self.group)
        return total.to(grad.dtype)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """All-reduce the partial sums of a row-parallel product; identity backward."""
    return _apply(_ReduceFromTP, x, group)


def scatter_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T, C) replicated -> this rank's (B, T/tp, C); backward all-gathers."""
    return _apply(_ScatterToSequence, x, group)


def gather_from_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T/tp, C) shards -> (B, T, C) for a tensor-parallel consumer; backward reduce-scatters."""
    return _apply(_GatherFromSequence, x, group)


def reduce_scatter_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T, C) partial sums -> this rank's (B, T/tp, C) of the total; backward all-gathers."""
    return _apply(_ReduceScatterToSequence, x, group)


def scatter_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's slice of the last dimension; backward all-gathers."""
    return _apply(_ScatterToTP, x, group)


def gather_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate the ranks' slices of the last dimension (e.g. logits over the vocabulary);
    backward keeps this rank's slice."""
    return _apply(_GatherFromTP, x, group)


def column_parallel_input(x: torch.Tensor, group, *, sequence_parallel: bool) -> torch.Tensor:
    """The full (B, T, C) input of column-parallel projections, once for all that share it:
    `copy_to_tp(x)`, or under sequence parallelism the all-gather of the (B, T/tp, C) shards."""
    return gather_from_sequence(x, group) if sequence_parallel else copy_to_tp(x, group)


# ---- layers -----------------------------------------------------------------------------------

def mark_tensor_parallel(param: nn.Parameter, *, partition_dim: int) -> nn.Parameter:
    """Tag a sharded parameter the way Megatron does and DeepSpeed's grad-norm code reads."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = 1
    return param


def _shard_size(total: int, group, what: str) -> int:
    size = tp_world_size(group)
    if total % size:
        raise ValueError(f"{what}={total} is not divisible by the {size} tensor-parallel ranks: "
                         "choose parallel.tensor dividing it")
    return total // size


class ColumnParallelLinear(nn.Module):
    """y_shard = x @ W_shard^T: a bias-free linear whose output features are split over TP.

    weight is (out_features / tp, in_features): rows [rank * out/tp, (rank + 1) * out/tp) of the
    full weight. The input must be the full activations from `column_parallel_input` (taken once
    by the caller for all projections that share it); the output is this rank's feature slice.
    """

    def __init__(self, in_features: int, out_features: int, *, tp_group,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.tp_group = tp_group
        local = _shard_size(out_features, tp_group, "out_features")
        self.weight = nn.Parameter(torch.empty(local, in_features, device=device, dtype=dtype))
        mark_tensor_parallel(self.weight, partition_dim=0)
        _uniform_like_linear(self.weight, fan_in=in_features)
        self.linear = F.linear  # the local matmul; `fp8.convert_to_fp8` swaps in FP8's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.weight)  # (..., out/tp)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"local={tuple(self.weight.shape)}")


class RowParallelLinear(nn.Module):
    """y = sum_r x_r @ W_r^T: a bias-free linear whose input features are split over TP.

    weight is (out_features, in_features / tp); the input is this rank's feature slice (a
    column-parallel output). The partial products are all-reduced, or under sequence
    parallelism reduce-scattered to this rank's (B, T/tp, C) sequence shard.
    """

    def __init__(self, in_features: int, out_features: int, *, tp_group,
                 sequence_parallel: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        local = _shard_size(in_features, tp_group, "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, local, device=device, dtype=dtype))
        mark_tensor_parallel(self.weight, partition_dim=1)
        _uniform_like_linear(self.weight, fan_in=in_features)
        self.linear = F.linear  # the local matmul; `fp8.convert_to_fp8` swaps in FP8's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.linear(x, self.weight)  # (B, T, out): this rank's summand
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(partial, self.tp_group)  # (B, T/tp, out)
        return reduce_from_tp(partial, self.tp_group)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"local={tuple(self.weight.shape)}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows (the padded vocabulary) are split over TP.

    Rank r holds rows [r * V/tp, (r + 1) * V/tp). Ids outside the shard look up row 0 and are
    zeroed, so each rank contributes only its own tokens; the partial embeddings are all-reduced
    (or reduce-scattered along the sequence under sequence parallelism).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group,
                 sequence_parallel: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.num_local = _shard_size(num_embeddings, tp_group, "num_embeddings (padded vocab)")
        self.vocab_start = tp_rank(tp_group) * self.num_local
        self.weight = nn.Parameter(torch.empty(self.num_local, embedding_dim, device=device,
                                               dtype=dtype))
        mark_tensor_parallel(self.weight, partition_dim=0)
        nn.init.normal_(self.weight)  # nn.Embedding's default; init_weights replaces it

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_local)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, C)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(x, self.tp_group)  # (B, T/tp, C)
        return reduce_from_tp(x, self.tp_group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, local rows "
                f"[{self.vocab_start}, {self.vocab_start + self.num_local})")


def _uniform_like_linear(weight: torch.Tensor, *, fan_in: int) -> None:
    # nn.Linear's default bound 1/sqrt(fan_in) of the full layer; init_weights replaces it
    bound = 1.0 / math.sqrt(fan_in)
    with torch.no_grad():
        weight.uniform_(-bound, bound)
