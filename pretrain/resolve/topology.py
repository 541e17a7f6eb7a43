"""The rank grid TP x CP x DP x PP (and its expert grid), its process groups, the `mpu` adapter.

`Topology(tensor=, pipeline=, world_size=, context=)` is built once at start-up and passed
down; there is no module-level parallel state. Its methods are pure arithmetic (usable without
torch.distributed, e.g. by the planner's dry run); `create_groups()` makes the process groups.

Rank order puts tensor parallelism innermost (consecutive ranks = the GPUs of one node, where
TP's per-layer all-reduces need NVLink), then context parallelism (its per-layer all-to-all
also wants the node's links), then data parallelism, then pipeline parallelism outermost (a
pipeline stage's point-to-point traffic is the cheapest to send across nodes)::

    rank = ((pipeline * data_size + data) * context_size + context) * tensor_size + tensor

Context parallelism (DeepSpeed-Ulysses, `parallel.context`) splits each sequence into
`context` chunks: its ranks hold the same parameters, like data-parallel replicas, and read
chunks of the same samples. DeepSpeed is told of them as data parallelism: its data-parallel
group (`data_groups`, ZeRO's partition and the gradient average) is every replica of a shard,
data x context ranks, indexed ``data * context_size + context``; the sample stream is split
over the `data` index only. With context 1 (the default) everything below is the TP x DP x PP
grid, rank for rank.

That is DeepSpeed's `PipeModelDataParallelTopology(num_pp, num_mp, num_dp=data x context)`
(axes pipe, data, model), so a `PipelineModule` given `Topology.deepspeed_topology()` places
its stages on the same ranks as our groups. The "model-parallel" group of a rank is every rank
holding a piece of the same model replica (its TP x PP ranks); DeepSpeed sums gradient norms
over it.

A worked example: 16 ranks (two nodes of eight GPUs) with tp=2, pp=2, hence dp=4.

>>> topo = Topology(tensor=2, pipeline=2, world_size=16)
>>> print(topo.describe())
tensor=2 x data=4 x pipeline=2 = 16 ranks; each cell is the tensor group of (data index, stage)
            stage 0    stage 1
    dp 0    [0, 1]     [8, 9]
    dp 1    [2, 3]     [10, 11]
    dp 2    [4, 5]     [12, 13]
    dp 3    [6, 7]     [14, 15]
>>> topo.tensor_groups()  # all-reduce activations every layer: inside a node
[[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
>>> topo.data_groups()  # all-reduce / reduce-scatter gradients (ZeRO) once per step
[[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
>>> topo.pipeline_groups()  # send activations stage to stage: across nodes
[[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
>>> topo.model_groups()  # one model replica (tp x pp): gradient-norm and overflow reductions
[[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
>>> topo.coords(13)
RankCoords(tensor=1, data=2, pipeline=1)

Context parallelism: 8 ranks with tp=2 and context=2, hence dp=2; the context group of a
rank is the ranks that hold the chunks of its sequences:

>>> topo = Topology(tensor=2, pipeline=1, world_size=8, context=2)
>>> print(topo.describe())
tensor=2 x context=2 x data=2 x pipeline=1 = 8 ranks; each cell is the tensor group of (data index, context index, stage)
                stage 0
    dp 0 cp 0   [0, 1]
    dp 0 cp 1   [2, 3]
    dp 1 cp 0   [4, 5]
    dp 1 cp 1   [6, 7]
>>> topo.context_groups()  # all-to-all of attention's q, k, v and output every layer
[[0, 2], [1, 3], [4, 6], [5, 7]]
>>> topo.data_groups()  # replicas of a shard: data x context (DeepSpeed's data parallelism)
[[0, 2, 4, 6], [1, 3, 5, 7]]
>>> topo.coords(6)
RankCoords(tensor=0, data=1, pipeline=0, context=1)

Expert parallelism (`parallel.expert`, `parallel.expert_tensor`) lays the ranks of one stage
(tensor x context x data of them, in rank order) out again for the MoE layers, as Megatron-Core
folds them: expert-tensor innermost (the ranks splitting each expert's matrices, 1 or the
tensor size), then expert (ranks holding different experts whole and swapping tokens by
all-to-all), then expert-data (the ranks holding the same experts: their gradients are reduced
and their ZeRO state partitioned over these). With expert = tensor and expert_tensor 1 the
expert groups are the tensor groups and the expert-data groups the data groups:

>>> topo = Topology(tensor=2, pipeline=1, world_size=4, expert=2)
>>> print(topo.describe())
tensor=2 x data=2 x pipeline=1 = 4 ranks; each cell is the tensor group of (data index, stage)
            stage 0
    dp 0    [0, 1]
    dp 1    [2, 3]
expert=2 x expert_tensor=1: expert groups [[0, 1], [2, 3]] (rank i of each holds experts [i*n/2, (i+1)*n/2) whole); expert-data groups [[0, 2], [1, 3]]
>>> topo.expert_groups()  # all-to-all of the routed tokens every MoE layer: inside a node
[[0, 1], [2, 3]]

Taken from the data ranks instead (tensor 1, 4 data ranks, 2 expert ranks), or with each
expert split over the tensor ranks (expert_tensor = tensor):

>>> Topology(tensor=1, pipeline=1, world_size=4, expert=2).expert_groups()
[[0, 1], [2, 3]]
>>> Topology(tensor=1, pipeline=1, world_size=4, expert=2).expert_data_groups()
[[0, 2], [1, 3]]
>>> topo = Topology(tensor=2, pipeline=1, world_size=4, expert=2, expert_tensor=2)
>>> topo.expert_groups(), topo.expert_data_groups(), topo.expert_tensor_groups()
([[0, 2], [1, 3]], [[0], [1], [2], [3]], [[0, 1], [2, 3]])
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pretrain.errors import ConfigError


@dataclass(frozen=True)
class RankCoords:
    """A rank's position in the grid: its index along each parallel dimension."""

    tensor: int
    data: int
    pipeline: int
    context: int = 0  # index along parallel.context (shown only when not 0)

    def __repr__(self) -> str:
        context = f", context={self.context}" if self.context else ""
        return (f"RankCoords(tensor={self.tensor}, data={self.data}, "
                f"pipeline={self.pipeline}{context})")


@dataclass(frozen=True)
class Topology:
    """The TP x CP x DP x PP grid of `world_size` ranks; `rank` is this process (for
    `my_coords`)."""

    tensor: int
    pipeline: int
    world_size: int
    rank: int = 0
    context: int = 1
    expert: int = 1  # expert-parallel ranks: each holds 1/expert of a MoE layer's experts
    expert_tensor: int = 0  # ranks splitting each expert's matrices: 1 or tensor; 0: tensor
    # when expert is 1, else 1 (settled in __post_init__)

    def __post_init__(self) -> None:
        for name in ("tensor", "pipeline", "world_size", "context", "expert"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"topology {name}={value!r}: must be a positive integer")
        model_parallel = self.tensor * self.pipeline * self.context
        if self.world_size % model_parallel:
            sizes = {"tensor": self.tensor, "context": self.context, "pipeline": self.pipeline}
            if self.context == 1:  # named only where it is used
                del sizes["context"]
            raise ConfigError(
                f"world size {self.world_size} is not divisible by "
                f"{' x '.join(f'parallel.{name}' for name in sizes)} = "
                f"{' x '.join(map(str, sizes.values()))} = {model_parallel}: launch a multiple "
                f"of {model_parallel} ranks or change parallel.{'/'.join(sizes)}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside the world of {self.world_size} ranks")
        if self.expert_tensor == 0:
            object.__setattr__(self, "expert_tensor", self.tensor if self.expert == 1 else 1)
        etp, ep = self.expert_tensor, self.expert
        if etp not in (1, self.tensor):
            raise ConfigError(f"parallel.expert_tensor={etp}: must be 1 (whole experts on each "
                              f"rank) or parallel.tensor={self.tensor} (each expert split over the "
                              "tensor ranks, as the dense MLP)")
        if ep == 1 and etp != self.tensor:
            raise ConfigError(f"parallel.expert_tensor={etp} with parallel.expert=1 and "
                              f"parallel.tensor={self.tensor}: without expert parallelism the "
                              "experts are split over the tensor ranks like the dense MLP; set "
                              f"parallel.expert_tensor={self.tensor} (or 0)")
        stage = self.tensor * self.context * self.data
        if stage % (ep * etp):
            raise ConfigError(
                f"parallel.expert x parallel.expert_tensor = {ep} x {etp} = {ep * etp} must divide "
                f"the ranks of a pipeline stage, tensor x context x data = {self.tensor} x "
                f"{self.context} x {self.data} = {stage}")

    @classmethod
    def from_parallel_config(cls, parallel: Any, *, world_size: int, rank: int = 0) -> "Topology":
        """From `RunConfig.parallel` (a `ParallelConfig`)."""
        return cls(tensor=parallel.tensor, pipeline=parallel.pipeline, world_size=world_size,
                   rank=rank, context=getattr(parallel, "context", 1),
                   expert=getattr(parallel, "expert", 1),
                   expert_tensor=getattr(parallel, "expert_tensor", 0))

    # ---- arithmetic ------------------------------------------------------------------------
    @property
    def data(self) -> int:
        """Data-parallel size (sample streams): world / (tensor x context x pipeline)."""
        return self.world_size // (self.tensor * self.context * self.pipeline)

    @property
    def replicas(self) -> int:
        """Ranks holding the same shard of the same stage: data x context. DeepSpeed's
        data-parallel size (ZeRO partitions and averages gradients over them)."""
        return self.data * self.context

    def rank_of(self, *, tensor: int, data: int, pipeline: int, context: int = 0) -> int:
        return ((pipeline * self.data + data) * self.context + context) * self.tensor + tensor

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")
        rest = rank // self.tensor
        return RankCoords(tensor=rank % self.tensor, context=rest % self.context,
                          data=(rest // self.context) % self.data,
                          pipeline=rank // (self.tensor * self.context * self.data))

    def replica_rank(self, rank: int) -> int:
        """`rank`'s index in its data group (`data_groups`): data x context + context."""
        c = self.coords(rank)
        return c.data * self.context + c.context

    @property
    def my_coords(self) -> RankCoords:
        return self.coords(self.rank)

    def _replica_coords(self) -> list[tuple[int, int]]:
        """(data, context) of each replica index, in rank order."""
        return [(d, c) for d in range(self.data) for c in range(self.context)]

    def tensor_groups(self) -> list[list[int]]:
        """Ranks that share one layer's shards (same data, context and pipeline index)."""
        return [[self.rank_of(tensor=t, data=d, pipeline=p, context=c) for t in range(self.tensor)]
                for p in range(self.pipeline) for d, c in self._replica_coords()]

    def context_groups(self) -> list[list[int]]:
        """Ranks holding the chunks of the same sequences (same tensor, data and pipeline
        index): attention's all-to-all. One rank each at context 1."""
        return [[self.rank_of(tensor=t, data=d, pipeline=p, context=c)
                 for c in range(self.context)]
                for p in range(self.pipeline) for d in range(self.data) for t in range(self.tensor)]

    def data_groups(self) -> list[list[int]]:
        """Replicas of the same shard of the same stage (same tensor and pipeline index): the
        data-parallel ranks and, with context > 1, their context ranks, which hold the same
        parameters too. DeepSpeed's data-parallel group."""
        return [[self.rank_of(tensor=t, data=d, pipeline=p, context=c)
                 for d, c in self._replica_coords()]
                for p in range(self.pipeline) for t in range(self.tensor)]

    def expert_coords(self, rank: int) -> tuple[int, int, int]:
        """(expert_tensor, expert, expert_data) index of `rank` in its stage's expert grid."""
        i = rank % (self.tensor * self.context * self.data)  # its index inside the stage
        etp, ep = self.expert_tensor, self.expert
        return i % etp, (i // etp) % ep, i // (etp * ep)

    def _expert_lists(self, axis: int) -> list[list[int]]:
        """The ranks varying along one axis of the expert grid (0: expert_tensor, 1: expert,
        2: expert_data), the others fixed, in rank order of their first rank."""
        lists: dict[tuple, list[int]] = {}
        stage = self.tensor * self.context * self.data
        for rank in range(self.world_size):
            grid = self.expert_coords(rank)
            key = (rank // stage,) + grid[:axis] + grid[axis + 1:]
            lists.setdefault(key, []).append(rank)
        return sorted(lists.values())

    def expert_groups(self) -> list[list[int]]:
        """Ranks that split one layer's experts between them and swap tokens by all-to-all
        (one rank each at parallel.expert 1): rank i of a group holds experts
        [i * n / expert, (i + 1) * n / expert)."""
        return self._expert_lists(1)

    def expert_data_groups(self) -> list[list[int]]:
        """Ranks holding the same experts (the same shard of them): the experts' gradients are
        reduced, and their ZeRO/FSDP state partitioned, over these."""
        return self._expert_lists(2)

    def expert_tensor_groups(self) -> list[list[int]]:
        """Ranks splitting each of their experts' matrices between them (the tensor groups at
        expert_tensor = tensor, one rank each at 1)."""
        return self._expert_lists(0)

    def expert_rank(self, rank: int) -> int:
        """`rank`'s index in its expert group: which 1/expert of the experts it holds."""
        return self.expert_coords(rank)[1]

    def pipeline_groups(self) -> list[list[int]]:
        """The stages of one pipeline (same tensor, context and data index)."""
        return [[self.rank_of(tensor=t, data=d, pipeline=p, context=c)
                 for p in range(self.pipeline)]
                for d, c in self._replica_coords() for t in range(self.tensor)]

    def model_groups(self) -> list[list[int]]:
        """All ranks holding one model replica (TP x PP, same data and context index), in rank
        order."""
        return [sorted(self.rank_of(tensor=t, data=d, pipeline=p, context=c)
                       for p in range(self.pipeline) for t in range(self.tensor))
                for d, c in self._replica_coords()]

    def describe(self) -> str:
        """The grid as a table: one row per data-parallel (and context) index, one column per
        stage."""
        rows = self._replica_coords()
        cells = [[str([self.rank_of(tensor=t, data=d, pipeline=p, context=c)
                       for t in range(self.tensor)])
                  for p in range(self.pipeline)] for d, c in rows]
        width = max(len(c) for row in cells for c in row + [f"stage {self.pipeline - 1}"]) + 3
        if self.context == 1:
            head = (f"tensor={self.tensor} x data={self.data} x pipeline={self.pipeline} = "
                    f"{self.world_size} ranks; each cell is the tensor group of "
                    "(data index, stage)")
            names = [f"    dp {d}" for d, _ in rows]
        else:
            head = (f"tensor={self.tensor} x context={self.context} x data={self.data} x "
                    f"pipeline={self.pipeline} = {self.world_size} ranks; each cell is the tensor "
                    "group of (data index, context index, stage)")
            names = [f"    dp {d} cp {c}" for d, c in rows]
        margin = max(12, max(len(n) for n in names) + 3)
        lines = [head, " " * margin + "".join(f"stage {p}".ljust(width)
                                              for p in range(self.pipeline))]
        for name, row in zip(names, cells):
            lines.append(name.ljust(margin) + "".join(c.ljust(width) for c in row))
        if self.expert > 1:
            whole = "whole" if self.expert_tensor == 1 else f"split over expert-tensor groups " \
                f"{self.expert_tensor_groups()}"
            lines.append(f"expert={self.expert} x expert_tensor={self.expert_tensor}: expert "
                         f"groups {self.expert_groups()} (rank i of each holds experts "
                         f"[i*n/{self.expert}, (i+1)*n/{self.expert}) {whole}); expert-data "
                         f"groups {self.expert_data_groups()}")
        return "\n".join(line.rstrip() for line in lines)

    def deepspeed_topology(self):
        """DeepSpeed's `PipeModelDataParallelTopology` of the same grid (for `PipelineModule`):
        its data axis is our data x context (index ``data * context_size + context``)."""
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        return PipeModelDataParallelTopology(num_pp=self.pipeline, num_mp=self.tensor,
                                             num_dp=self.replicas)

    # ---- process groups --------------------------------------------------------------------
    def create_groups(self) -> "ProcessGroups":
        """Create every TP, DP, PP, model-parallel and (context > 1) context group; return this
        rank's.

        `torch.distributed.new_group` is collective over the whole world and NCCL needs every
        rank to create every group in the same order, including groups it is not part of:
        all ranks therefore run the same loops and keep only their own groups. A rank list
        that two kinds share gets one group (one communicator).
        """
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("create_groups needs torch.distributed: initialise the default "
                               "process group first (pretrain.dist.init_distributed)")
        if dist.get_world_size() != self.world_size or dist.get_rank() != self.rank:
            raise ConfigError(
                f"topology built for rank {self.rank} of {self.world_size}, but this process is "
                f"rank {dist.get_rank()} of {dist.get_world_size()}: build the Topology from the "
                "launcher's RANK and WORLD_SIZE")
        mine, by_ranks = {}, {}
        kinds = [("tensor", self.tensor_groups()), ("data", self.data_groups()),
                 ("pipeline", self.pipeline_groups()), ("model", self.model_groups())]
        if self.context > 1:  # context 1 creates exactly the groups it created before
            kinds.append(("context", self.context_groups()))
        if self.expert > 1:  # expert = tensor, expert_tensor 1: the tensor and data groups again
            kinds += [("expert", self.expert_groups()), ("expert_data", self.expert_data_groups()),
                      ("expert_tensor", self.expert_tensor_groups())]
        for kind, lists in kinds:
            for ranks in lists:
                key = tuple(sorted(ranks))  # one group per rank list: at tp 1 the model
                if key not in by_ranks:     # groups are the pipeline groups
                    by_ranks[key] = dist.new_group(ranks=ranks)
                group = by_ranks[key]
                if self.rank in ranks:
                    mine[kind] = (group, ranks)
        return ProcessGroups(topology=self, tensor=mine["tensor"][0], data=mine["data"][0],
                             pipeline=mine["pipeline"][0], model=mine["model"][0],
                             data_ranks=tuple(mine["data"][1]), by_ranks=by_ranks,
                             context=mine["context"][0] if "context" in mine else None,
                             expert=mine.get("expert", (None,))[0],
                             expert_data=mine.get("expert_data", (None,))[0],
                             expert_tensor=mine.get("expert_tensor", (None,))[0])


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's process groups, from `Topology.create_groups()`; `.mpu` for DeepSpeed."""

    topology: Topology
    tensor: Any  # torch.distributed.ProcessGroup of the tp ranks
    data: Any  # every replica of this rank's shard: data x context ranks
    pipeline: Any
    model: Any  # tp x pp ranks of one replica
    data_ranks: tuple[int, ...]
    # every group create_groups made (this rank's or not), by its sorted ranks: DeepSpeed's
    # pipeline grid is handed these instead of creating the same communicators again
    by_ranks: dict[tuple[int, ...], Any] = field(default_factory=dict, compare=False, repr=False)
    context: Any = None  # the context-parallel group (attention's all-to-all); None at context 1
    # the expert grid's groups (None at parallel.expert 1): the all-to-all of routed tokens, the
    # ranks holding the same experts (their gradients' reduction), the ranks splitting each expert
    expert: Any = None
    expert_data: Any = None
    expert_tensor: Any = None

    @property
    def mpu(self) -> "DeepSpeedMPU":
        return DeepSpeedMPU(self)


class DeepSpeedMPU:
    """The model-parallel unit `deepspeed.initialize(..., mpu=)` expects, over our groups.

    DeepSpeed 0.19.8 calls (grep of the installed package for ``mpu.``):

    - `get_data_parallel_{rank,world_size,group,group_ranks}`: ZeRO's partitioning and gradient
      all-reduce group, the batch-size arithmetic (`train_batch_size = micro x accum x dp`), the
      data sampler, the broadcast of initial weights;
    - `get_model_parallel_{rank,world_size,group}` (TP x PP of one replica): the gradient-norm
      and overflow all-reduces, checkpoint file names (`mp_rank_XX`);
    - `get_tensor_model_parallel_{rank,world_size,group}` (+ the older `get_slice_parallel_*`
      spelling, which the universal-checkpoint loader prefers): a gradient is counted in the
      norm if its parameter is tensor-parallel (`param.tensor_model_parallel`) or this is TP
      rank 0, so replicated weights (norms) are counted once per replica;
    - `get_pipeline_model_parallel_*` / `get_pipe_parallel_*`: checkpoint metadata, MoE norms.

    Deliberately absent: `initialize_sequence_parallel` and `get_sequence_parallel_*` /
    `get_sequence_data_parallel_*`. DeepSpeed's "sequence parallel" is Ulysses (the sequence
    split over extra data-parallel-like ranks, ZeRO sharding over both); its mere presence
    (`hasattr`) switches the engine to that mode and disables the model-parallel grad-norm
    reduction (wrong under tensor parallelism). Our context parallelism is that same Ulysses
    split, told to DeepSpeed as data parallelism instead: the data-parallel group here is every
    replica of a shard (data x context ranks), over which ZeRO partitions and DeepSpeed averages
    gradients; each context rank's loss is its chunk's mean, so the average over data x context
    is the gradient of the global mean (equal chunks). Megatron sequence parallelism lives
    inside the TP group and DeepSpeed never needs to know about it.
    """

    def __init__(self, groups: ProcessGroups) -> None:
        self._groups = groups
        self._topo = groups.topology
        self._coords = groups.topology.my_coords

    def get_global_rank(self) -> int:
        return self._topo.rank

    # data parallel
    def get_data_parallel_rank(self) -> int:
        return self._topo.replica_rank(self._topo.rank)

    def get_data_parallel_world_size(self) -> int:
        return self._topo.replicas

    def get_data_parallel_group(self):
        return self._groups.data

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self._groups.data_ranks)

    # model parallel = tensor x pipeline (DeepSpeed's PipelineParallelGrid convention)
    def get_model_parallel_rank(self) -> int:
        return self._coords.pipeline * self._topo.tensor + self._coords.tensor

    def get_model_parallel_world_size(self) -> int:
        return self._topo.tensor * self._topo.pipeline

    def get_model_parallel_group(self):
        return self._groups.model

    # tensor parallel
    def get_tensor_model_parallel_rank(self) -> int:
        return self._coords.tensor

    def get_tensor_model_parallel_world_size(self) -> int:
        return self._topo.tensor

    def get_tensor_model_parallel_group(self):
        return self._groups.tensor

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of TP rank 0 in this rank's tensor group."""
        return self._topo.rank - self._coords.tensor

    get_slice_parallel_rank = get_tensor_model_parallel_rank
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size
    get_slice_parallel_group = get_tensor_model_parallel_group

    # pipeline parallel
    def get_pipeline_model_parallel_rank(self) -> int:
        return self._coords.pipeline

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self._topo.pipeline

    def get_pipeline_model_parallel_group(self):
        return self._groups.pipeline

    get_pipe_parallel_rank = get_pipeline_model_parallel_rank
    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size
    get_pipe_parallel_group = get_pipeline_model_parallel_group

    def __repr__(self) -> str:
        c = self._coords
        context = (f", context={c.context}/{self._topo.context}" if self._topo.context > 1
                   else "")
        return (f"DeepSpeedMPU(rank={self._topo.rank}, tensor={c.tensor}/{self._topo.tensor}, "
                f"data={c.data}/{self._topo.data}{context}, "
                f"pipeline={c.pipeline}/{self._topo.pipeline})")
