"""`train.engine: fsdp2`: the run's model sharded by PyTorch's `fully_shard` (FSDP2) instead of
DeepSpeed's ZeRO, behind the methods the trainer calls on DeepSpeed's engine.

Each decoder layer is one `fully_shard` unit, and the root unit holds the embedding, the final
norm and the head (one unit: a tied head is the embedding's parameter). Units shard over the
data-parallel group - every replica of a tensor-parallel shard, data x context ranks, as ZeRO
partitions - so the stack's own tensor parallelism (plain tensors, sharded by name) composes
with it: each tensor-parallel rank's FSDP2 mesh is its data group, and the two form the 2-D
(tensor x data) grid. `pretrain.resolve.fsdp2_rules` says what the DeepSpeed JSON's ZeRO stage and
offload mean here and what is refused. Under sequence parallelism the norms' gradients are
partial sums over each tensor rank's tokens; the engine sums their shards over the tensor group
once per step (`_sum_sequence_parallel_grads`, through one accelerator buffer: under CPU offload
the shards live in host memory, which NCCL does not take), where DeepSpeed's engine has hooks on
the weights.

The model is built on the meta device and sharded before it has memory (`build_fsdp2_engine`):
each rank allocates only its FSDP2 shard of its tensor-parallel shard, where it lives, and draws
its rows of the block-seeded initial model there (`init_rows`), bitwise one process's - no rank
holds its whole tensor-parallel shard, as `deepspeed.zero.Init` keeps DeepSpeed's ranks from it.

HSDP (`train.fsdp2_replicas` > 1): the data group's ranks form a 2-D ("replicate", "shard")
mesh (`data_mesh`); each unit is sharded over a row of it and replicated over its columns, so
FSDP2 reduce-scatters a gradient in the row and all-reduces the shard over the column. The
replica groups hold the same shards: the gradient norm sums over one row, and the first row
alone writes checkpoints (files as at dp = the row's size).

The expert grid (expert ranks taken from the data ranks, `ProcessGroups.expert_data`): each MoE
layer's local experts (`moe.LocalExperts`, whose forward runs them, so FSDP2's hooks fire) are a
unit of their own over the expert-data ranks, inside the layer's unit over the data group
(`_shard_experts`); their gradients are divided by the data size, not the expert-data size. Each
expert element then lives on one rank of the stage, so the gradient norm and the checkpoint
files (rows by name, each expert in the files of the ranks holding it) need nothing new.

What a step does matches DeepSpeed's engine: the loss of each micro-batch is divided by the
gradient accumulation before backward, FSDP2 reduce-scatters the gradients (averaged over the
replicas, in fp32 under bf16's `MixedPrecisionPolicy`), and at the last micro-batch the
whole model's gradient norm (each element once across the grid) clips them; a non-finite norm
skips the update and the schedule, counted in `skipped_steps`. The optimizer is torch's AdamW
over `engine.param_groups` (muP's groups included), stepped on the fp32 shards; the schedule
`engine.schedule_factor` (train.lr_schedule).

Checkpoints (`save_checkpoint`/`load_checkpoint`, the `Saver`'s interface): every rank (of the
first replica group) writes one file, `fsdp2_rank<RANK>.pt`, of its pieces of each parameter and
of Adam's moments by Hugging Face name (rows of the tensor-parallel shard), with the schedule
and counters. `weights.engine_tensors` reads them back as whole tensors by name, which is what
resuming on any layout reads (`pretrain.checkpoint.fsdp2_state`, `reshard.load_into_fsdp2`).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as torch_dist
from deepspeed.accelerator import get_accelerator
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental import implicit_replication

from pretrain.config import ModelConfig, Optimizer, Precision, RunConfig
from pretrain.resolve.ds_config import zero_stage
from pretrain.resolve.fsdp2_rules import offloads_to_cpu, reshards_after_forward
from pretrain.model import canonical_buffers, canonical_parameters
from pretrain.model.build import construct_for_layout, tensor_parallel_group
from pretrain.model.layers import RotaryEmbedding, rotary_embedding
from pretrain.model.llama import INIT_BLOCK, DecoderLayer, _draw_init, shard_range
from pretrain.model.expert_parallel import ExpertGroups, expert_groups_of
from pretrain.model.moe import MoE
from pretrain.model.tensor_parallel import SequenceShardedWeightGrad, tp_rank, tp_world_size
from pretrain.resolve.topology import ProcessGroups
from pretrain.training import muon
from pretrain.training.pipeline_schedules import (PipelineDriver, PipelineStages, construct_stages,
                                                   tied_embedding_copies)

FILE = "fsdp2_rank{rank:05d}.pt"  # one per rank in a checkpoint's step directory


def shard_model(model: torch.nn.Module, mesh: DeviceMesh, *, reshard_after_forward: bool,
                bf16: bool, offload: bool, experts: tuple[DeviceMesh, int] | None = None
                ) -> torch.nn.Module:
    """`fully_shard` each decoder layer of `model`, then the model itself (embedding, final norm
    and head: the root unit), in place; returns it. A 2-D `mesh` ("replicate", "shard"): HSDP.
    Pipeline stages (`PipelineStages`): each stage is a root unit over its own layers.

    `experts` (the expert grid: (expert-data mesh, data-group size)): each MoE layer's local
    experts (`LocalExperts`, reduced apart) are a unit of their own first, sharded over the
    ranks holding the same experts, so the layer's unit leaves them out (`_shard_experts`)."""
    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if bf16:  # bf16 compute, fp32 reduce-scatter; the sharded fp32 parameters are the masters
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                    reduce_dtype=torch.float32)
    if offload:  # pinned host memory for the copies to the accelerator (none on CPU ranks)
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")
    if experts is not None:
        _shard_experts(model, *experts, options=options)
    for layer in (m for m in model.modules() if isinstance(m, DecoderLayer)):
        fully_shard(layer, **options)
    for root in (model.stages.values() if isinstance(model, PipelineStages) else [model]):
        fully_shard(root, **options)
    return model


def _shard_experts(model: torch.nn.Module, mesh: DeviceMesh, data_size: int, *,
                   options: dict[str, Any]) -> None:
    """`fully_shard` the expert grid's local experts of every MoE layer over `mesh` (this rank's
    expert-data group), their gradients divided by `data_size` (the data x context ranks)
    instead of the mesh's size: each rank's expert gradient already sums what every token of
    its expert group gave through the all-to-all, so summed over the expert-data ranks it is
    the whole batch's, and / data is the mean over the data ranks' micro-batches that every
    other gradient is (DeepSpeed's scaling of its MoE groups)."""
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        if not getattr(moe.experts, "reduced_apart", False):
            continue
        unit = fully_shard(moe.experts, **{**options, "mesh": mesh})
        unit.set_gradient_divide_factor(float(data_size))
        if mesh.size() > 1:
            # sum, then divide: gloo has no PREMUL_SUM, which a factor other than the group's
            # size asks for otherwise (on one rank FSDP2 divides once by itself, and forcing
            # the sum there would divide twice)
            unit.set_force_sum_reduction_for_comms(True)


class FSDP2Engine:
    """The trainer's engine under `train.engine: fsdp2` (see the module docstring). The names
    are DeepSpeed's engine's, where the trainer, the step records, the non-finite guard and the
    checkpoint code call them."""

    name = "fsdp2"

    def __init__(self, cfg: RunConfig, ds_config: dict[str, Any], groups: ProcessGroups,
                 model: torch.nn.Module, *, param_groups: list[dict[str, Any]],
                 lr_factor: Callable[[int], float], tensor_parallel: set[str],
                 mesh: DeviceMesh, whole_experts: frozenset[str] = frozenset()) -> None:
        """`param_groups`: the optimizer's groups over the sharded parameters; `lr_factor(i)`:
        the schedule's factor of each group's lr after `i` updates; `tensor_parallel`: the
        names of the parameters that are tensor-parallel shards (fully_shard's replacements
        carry no `tensor_model_parallel`); `mesh`: the one `shard_model` sharded over;
        `whole_experts`: the names of the experts this rank holds whole under expert
        parallelism (in `tensor_parallel` too: the norm counts each on its one tensor rank),
        whose rows are those of the whole tensor, not of a tensor-parallel shard."""
        t = cfg.train
        self.cfg, self.groups, self.ds_config = cfg, groups, ds_config
        self.device = torch.device(get_accelerator().current_device_name())
        self.module = model
        self._micro_batches = int(ds_config["gradient_accumulation_steps"])
        # samples of one micro-batch over the data x context ranks (DeepSpeed's count)
        self._micro_samples = int(ds_config["train_batch_size"]) // self._micro_batches
        self._clip = float(t.grad_clip)
        self.offload = offloads_to_cpu(ds_config)
        if t.optimizer is Optimizer.MUON:  # Muon for the hidden matrices, whole (DTensor rows)
            named = list(canonical_parameters(model, cfg.model))
            self.optimizer = muon.build_optimizer(named, param_groups, t)
            self.optimizer.bind(muon.row_shard_pieces(named, tensor_parallel_group(groups),
                                                      tensor_parallel - whole_experts))
        else:
            self.optimizer = torch.optim.AdamW(param_groups, lr=t.lr, betas=(t.beta1, t.beta2),
                                               eps=t.eps, weight_decay=t.weight_decay)
        self.optimizer.overflow = False  # DeepSpeed's protocol: the guard reads, never wraps
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor)
        self.global_steps = self.global_samples = self.skipped_steps = 0
        self._micro = 0  # backward passes of the step being accumulated
        self._norm: float | None = None
        self.checkpoint_engine = None  # the Saver's writer, set before save_checkpoint
        self._tensor_parallel = tensor_parallel
        self.whole_experts = whole_experts
        self._sequence_parallel_norms = sequence_parallel_norms(model)
        hsdp = mesh.ndim == 2
        # HSDP's replica groups as built (the run record's `fsdp2_replicas`)
        self.replica_groups = mesh.size(0) if hsdp else 1
        self._shard_group = mesh.get_group("shard" if hsdp else 0)
        # HSDP's replica groups hold the same shards: the first one's ranks write checkpoints
        self._writes_checkpoints = not hsdp or mesh.get_local_rank("replicate") == 0
        # parallel.pipeline > 1: the schedule that runs this rank's stages
        self.pipeline = (PipelineDriver(cfg, model, groups, micro_batches=self._micro_batches,
                                        device=self.device)
                         if isinstance(model, PipelineStages) else None)
        # tied embeddings over a pipeline: the first stage's weight and the head's copy of it
        self._tied = tied_embedding_copies(model, cfg)
        self._tied_group = (_tied_pair_group(groups, self.pipeline)
                            if cfg.model.tie_embeddings and self.pipeline is not None else None)

    # ---- what DeepSpeed's engine answers ----------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    forward = __call__

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()

    def gradient_accumulation_steps(self) -> int:
        return self._micro_batches

    def train_batch_size(self) -> int:
        return self._micro_samples * self._micro_batches

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """The micro-batches of the next steps (train.batch_ramp), as DeepSpeed's engine takes
        it: `train_batch_size` counts data x context ranks' micro-batches."""
        if train_batch_size % self._micro_samples or self._micro != 0:
            raise ValueError(f"train batch {train_batch_size} is not whole micro-batches of "
                             f"{self._micro_samples} samples, or a step is half accumulated")
        self._micro_batches = train_batch_size // self._micro_samples

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's call; this engine counts its micro-batches from each step's start."""

    def fp16_enabled(self) -> bool:
        """No loss scaling (fp16 is refused): `moe.aux_loss_grad_scale` reads it."""
        return False

    def zero_optimization_stage(self) -> int:
        """3, or 2 where the JSON's ZeRO-1/2 keeps gathered weights from forward to backward
        (`fsdp2_rules`): gradients and optimizer state are sharded either way."""
        return 3 if reshards_after_forward(zero_stage(self.ds_config)) else 2

    def zero_use_cpu_optimizer(self) -> bool:
        return self.offload

    def zero_offload_param(self):
        return None  # `host_resident_state` reads `zero_use_cpu_optimizer` under offload

    def compute_dtypes(self) -> list[str]:
        """What forward computes in: the policy's bf16 (the shards stay fp32), else theirs."""
        if self.cfg.train.precision is Precision.BF16:
            return ["bfloat16"]
        return sorted({str(p.dtype).removeprefix("torch.") for p in self.module.parameters()})

    @torch.no_grad()
    def load_initial_weights(self) -> str:
        """Set the shards to the weights of `model.init_from` (`weights.load_initial_weights`,
        its checks included: each rank reads its tensor-parallel shard of one tensor at a time)
        and return the source read. Each tensor is handed to the sharded parameter as a plain
        tensor, which DTensor takes as replicated over the data group: copying it keeps this
        rank's rows, no collective."""
        from pretrain.checkpoint.weights import load_initial_weights

        with implicit_replication():
            return load_initial_weights(self.module, cfg=self.cfg.model,
                                        tp_group=tensor_parallel_group(self.groups))

    def host_resident_tensors(self):
        """(what, tensor) of each tensor this rank keeps in host memory on a GPU node: under
        CPUOffloadPolicy its FSDP2 shards, their gradients and Adam's moments (none without
        offload). What `pretrain.testing.nccl_strict` refuses to send through NCCL."""
        if not self.offload:
            return
        for name, p in canonical_parameters(self.module, self.cfg.model):
            yield f"the offloaded fp32 shard of {name}", _local(p.data)
            if p.grad is not None:
                yield f"the offloaded gradient shard of {name}", _local(p.grad)
            for key, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    yield f"the offloaded Adam {key} of {name}", _local(value)

    def offload_targets(self) -> tuple[str, str]:
        """(optimizer state, parameters) outside accelerator memory, as `metrics` reports
        DeepSpeed's: CPUOffloadPolicy keeps both (and the gradients) in host memory."""
        return ("cpu", "cpu") if self.offload else ("none", "none")

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The whole model's gradient norm of the last step, before clipping."""
        return self._norm

    # ---- a step -----------------------------------------------------------------------------
    def train_batch(self, data_iter) -> torch.Tensor:
        """A pipeline's step, as DeepSpeed's `PipelineEngine.train_batch`: the step's
        micro-batches ((inputs, labels) pairs of `data_iter`) through the schedule, then the
        update (`step`); returns the mean loss, on every rank."""
        pairs = [next(data_iter) for _ in range(self._micro_batches)]
        loss = self.pipeline.train_step(pairs)
        self._micro = self._micro_batches
        self.step()
        return loss

    def eval_batch(self, data_iter, *, num_micro_batches: int) -> torch.Tensor:
        """A pipeline's mean loss over the next `num_micro_batches` pairs of `data_iter`
        (forwards only), shape [1], on every rank, as DeepSpeed's `eval_batch`."""
        return self.pipeline.evaluate(data_iter, num_micro_batches)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self._micro_batches).backward()
        self._micro += 1

    def step(self) -> None:
        """At the step's last micro-batch: norm, clip, update (or skip), schedule, zero grads."""
        if self._micro < self._micro_batches:
            return
        self._micro = 0
        self._sum_sequence_parallel_grads()
        self._sum_tied_grads()
        self._norm = self.grad_norm()
        if math.isfinite(self._norm):
            if self._clip > 0 and self._norm > self._clip:
                scale = self._clip / (self._norm + 1e-6)
                for p in self._grads():
                    p.grad.mul_(scale)
            self.optimizer.step()
            self.lr_scheduler.step()
        else:  # the same verdict on every rank: the norm is reduced over the whole grid
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.global_steps += 1
        self.global_samples += self.train_batch_size()

    def _grads(self):
        return [p for p in self.module.parameters() if p.grad is not None]

    @torch.no_grad()
    def _sum_sequence_parallel_grads(self) -> None:
        """Sum the sequence-parallel norms' gradients over the tensor group, once per step.

        Each tensor rank's norm saw only its T/tp tokens, so its gradient is a partial sum; the
        hooks that reduce it under DeepSpeed (`SequenceShardedWeightGrad`) sat on the weights
        `fully_shard` replaced. FSDP2 has summed the step's micro-batches into this rank's shard
        (over the data group, the same rows on every tensor rank), and sums are linear, so one
        all-reduce of the shards over the tensor group gives each rank its rows of the totals.

        The shards are copied into one flat buffer on the accelerator, all-reduced there and
        copied back: under CPUOffloadPolicy they live in host memory, which NCCL does not take
        (moved after FSDP2's offload copy rather than reduced before it: FSDP2 has no hook
        between its reduce-scatter and that copy, and the norms are a few thousand values per
        layer - one collective for all of them, not one per norm)."""
        grads = [_local(norm.weight.grad) for norm in self._sequence_parallel_norms
                 if norm.weight.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1).to(self.device) for g in grads])  # a new device buffer
        torch_dist.all_reduce(flat, group=self.groups.tensor)
        for grad, total in zip(grads, flat.split([g.numel() for g in grads])):
            grad.copy_(total.view_as(grad))

    @torch.no_grad()
    def _sum_tied_grads(self) -> None:
        """Tied embeddings over a pipeline: the embedding's gradient (first stage) and its
        copy's (the head, last stage) summed into both, once per step, so both copies take the
        same update and stay equal. On one rank (the V schedules hold both ends) the two
        shards are added; across ranks the copy's shard is all-reduced with the embedding's
        over their pair of ranks (the same data coordinate, so the same FSDP2 rows), through
        an accelerator buffer (CPU offload keeps the shards in host memory)."""
        held = [p for p in self._tied if p is not None]
        if not held:
            return
        grads = [_local(p.grad) for p in held]
        total = grads[0].to(self.device, copy=True)
        for grad in grads[1:]:
            total += grad.to(self.device)
        if len(held) == 1:  # the other end is another rank's
            torch_dist.all_reduce(total, group=self._tied_group)
        for grad in grads:
            grad.copy_(total)

    @torch.no_grad()
    def grad_norm(self) -> float:
        """L2 norm of the whole model's gradient, each element counted once: this rank's FSDP2
        shard of each gradient summed over its shard group (the data group, or one HSDP replica
        group: the others hold the same shards); tensor-parallel shards on every tensor rank,
        replicated weights (norms) on tensor rank 0 only, summed over the tensor group
        (`metrics.global_grad_norm`'s rule)."""
        tp_rank0 = self.groups.topology.my_coords.tensor == 0
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for name, p in canonical_parameters(self.module, self.cfg.model):
            if p.grad is None or not (name in self._tensor_parallel or tp_rank0):
                continue
            if p is self._tied[1]:  # the tied head's copy: counted once, as the embedding
                continue
            total += _local(p.grad).float().pow(2).sum().to(self.device)
        if torch_dist.get_world_size(self._shard_group) > 1:
            torch_dist.all_reduce(total, group=self._shard_group)
        if self.groups.topology.tensor > 1:
            torch_dist.all_reduce(total, group=self.groups.tensor)
        if self.groups.topology.pipeline > 1:  # each stage's parameters, held by one rank
            torch_dist.all_reduce(total, group=self.groups.pipeline)
        return total.sqrt().item()

    # ---- checkpoints ------------------------------------------------------------------------
    def state_pieces(self) -> dict[str, Any]:
        """This rank's file of a checkpoint: by Hugging Face name, its rows of the tensor-parallel
        shard of each parameter ("master", fp32) and Adam's moments, where they start, and the
        shard's shape (an expert-parallel expert: of the whole expert, on its tensor rank);
        the buffers the weights carry (DeepSeek-V3's expert bias, whole); Adam's step, the
        schedule and the counters."""
        pieces: dict[str, dict[str, Any]] = {}
        adam_step = 0
        for name, p in canonical_parameters(self.module, self.cfg.model):
            if p is self._tied[1]:  # the tied head's copy: written once, as the embedding
                continue
            state = self.optimizer.state.get(p, {})
            entry = {"master": _local(p.detach()), "row": _first_row(p),
                     "shape": tuple(p.shape)}
            for key in muon.state_keys(name, self.cfg.train.optimizer):
                if key in state:
                    entry[key] = _local(state[key])
            if "step" in state:
                adam_step = int(state["step"])
            pieces[name] = entry
        # the buffers the weights carry (the expert bias), whole and the same on every rank
        buffers = {name: b.detach().clone()
                   for name, b in canonical_buffers(self.module, self.cfg.model)}
        return {"engine": self.name, "tensor_rank": self.groups.topology.my_coords.tensor,
                "tensors": pieces, "buffers": buffers, "adam_step": adam_step,
                "lr_scheduler": self.lr_scheduler.state_dict(),
                "global_steps": self.global_steps, "global_samples": self.global_samples,
                "skipped_steps": self.skipped_steps}

    def save_checkpoint(self, save_dir: str, *, tag: str, save_latest: bool = False,
                        client_state: dict[str, Any] | None = None) -> None:
        """This rank's file into `save_dir/tag` through `checkpoint_engine` (the Saver's
        writer: now or in the background), from the ranks of the first HSDP replica group only
        (every rank without HSDP); rank 0's carries `client_state`."""
        del save_latest  # the Saver writes `latest` once every rank's files are on disk
        step_dir = Path(save_dir) / tag
        rank = torch_dist.get_rank() if torch_dist.is_initialized() else 0
        if rank == 0:
            step_dir.mkdir(parents=True, exist_ok=True)
        if torch_dist.is_initialized():
            torch_dist.barrier()
        if not self._writes_checkpoints:
            return
        state = self.state_pieces()
        if rank == 0:
            state["client_state"] = client_state or {}
        self.checkpoint_engine.save(state, str(step_dir / FILE.format(rank=rank)))

    @torch.no_grad()
    def load_state(self, read, *, adam_step: int, schedule: dict[str, Any] | None,
                   counters: dict[str, int]) -> None:
        """Set every parameter's fp32 shard and Adam's moments (Muon's momentum:
        `muon.state_keys`) from `read(name, what, rows)` (`what`: "master" or a state key; `rows`: [start, stop) of the
        tensor-parallel shard, from `_first_row`), and each buffer the weights carry (whole:
        `read(name, "master", (0, length))`), then Adam's step, the schedule's position
        (`schedule`: a saved LambdaLR state) and the counters."""
        for name, p in canonical_parameters(self.module, self.cfg.model):
            local = _local(p.data)
            rows = (_first_row(p), _first_row(p) + (local.shape[0] if local.dim() else 1))
            local.copy_(read(name, "master", rows).view_as(local))
            state = self.optimizer.state[p]
            for key in muon.state_keys(name, self.cfg.train.optimizer):
                if key not in state:
                    state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
                _local(state[key]).copy_(read(name, key, rows).view_as(local))
            if "exp_avg" in state:  # Adam's count (Muon keeps none)
                state["step"] = torch.tensor(float(adam_step))
        for name, buffer in canonical_buffers(self.module, self.cfg.model):  # whole
            buffer.copy_(read(name, "master", (0, buffer.shape[0])).view_as(buffer))
        self.global_steps = int(counters["global_steps"])
        self.global_samples = int(counters["global_samples"])
        self.skipped_steps = int(counters["skipped_steps"])
        if schedule:  # the position only: the groups' base rates are this engine's
            from pretrain.checkpoint.reshard import _resume_schedule

            _resume_schedule(self.lr_scheduler, schedule, self.optimizer.param_groups)


def _tied_pair_group(groups: ProcessGroups, driver: PipelineDriver):
    """The process group of this rank's pair of tied-embedding ranks (the first stage's and the
    last stage's in its pipeline), None where one rank holds both (the V schedules). Collective:
    every rank creates every pair's group, in the same order (a pair that is already a group,
    the pipeline of 2 ranks, reuses it)."""
    last = driver.owner(driver.num_stages - 1)
    if last == driver.owner(0):
        return None
    mine = None
    for ranks in groups.topology.pipeline_groups():
        key = tuple(sorted((ranks[driver.owner(0)], ranks[last])))
        group = groups.by_ranks.get(key) or torch_dist.new_group(ranks=list(key))
        if torch_dist.get_rank() in key:
            mine = group
    return mine


def sequence_parallel_norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model` whose `weight` is whole on every tensor rank while each rank's
    gradient of it is a partial sum (RMSNorms under sequence parallelism, seeing T/tp tokens;
    a mixture of experts' router, whose combine weights get partial gradients on each tensor
    rank, `pretrain.model.moe`): their gradients need the sum over the tensor group. The
    router's module is its `gate`, where its `SequenceShardedWeightGrad` hangs on `MoE`."""
    return [m.gate if isinstance(m, MoE) else m for m in model.modules()
            if isinstance(getattr(m, "weight_grad", None), SequenceShardedWeightGrad)
            and tp_world_size(m.weight_grad.group) > 1]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _first_row(param: torch.Tensor) -> int:
    """The row of the tensor-parallel shard this rank's FSDP2 shard starts at (`Shard(0)` over
    the mesh's shard dimension, replicated over HSDP's other one: torch.chunk's split, the last
    ranks' pieces shorter or empty)."""
    if not isinstance(param, DTensor) or param.dim() == 0:
        return 0
    mesh = param.device_mesh
    dim = next(i for i, p in enumerate(param.placements) if isinstance(p, Shard))
    rows, ranks = param.shape[0], mesh.size(dim)
    chunk = -(-rows // ranks)
    return min(chunk * mesh.get_local_rank(dim), rows)


def data_mesh(groups: ProcessGroups, *, replicas: int, device_type: str) -> DeviceMesh:
    """FSDP2's mesh over this rank's data group (data x context ranks): 1-D at one replica
    group; for HSDP (`replicas` > 1) 2-D ("replicate", "shard"), the group's ranks in order
    split into `replicas` rows of consecutive ranks, each row a shard group, each column a
    replicate group. Collective: every rank creates every data group's groups, in order."""
    if replicas == 1:
        return DeviceMesh.from_group(groups.data, device_type=device_type)
    known = dict(groups.by_ranks)  # a rank list create_groups made keeps its communicator
    rank, mine = torch_dist.get_rank(), {}
    for data_ranks in groups.topology.data_groups():
        shards = len(data_ranks) // replicas
        grid = [data_ranks[row * shards:(row + 1) * shards] for row in range(replicas)]
        for kind, lists in (("shard", grid), ("replicate", [list(c) for c in zip(*grid)])):
            for ranks in lists:
                key = tuple(sorted(ranks))
                if key not in known:
                    known[key] = torch_dist.new_group(ranks=ranks)
                if rank in ranks:
                    mine[kind] = known[key]
        if rank in data_ranks:
            mine["grid"] = grid
    return DeviceMesh.from_group([mine["replicate"], mine["shard"]], device_type=device_type,
                                 mesh=torch.tensor(mine["grid"]),
                                 mesh_dim_names=("replicate", "shard"))


def build_fsdp2_engine(cfg: RunConfig, ds_config: dict[str, Any], groups: ProcessGroups, *,
                       optimizer_groups: Callable[[torch.nn.Module], list[dict[str, Any]]],
                       lr_factor: Callable[[int], float]) -> FSDP2Engine:
    """This rank's FSDP2 engine over the run's model, sharded before it has any memory.

    The model is constructed on the meta device (`construct_for_layout`: nothing allocated),
    `fully_shard`ed, and only then given storage (`to_empty`): each rank its FSDP2 shard of its
    tensor-parallel shard, on the accelerator or, under CPUOffloadPolicy, in host memory, which
    `init_shards` fills with its rows of the seeded initial model - bitwise those `init_weights`
    gives one process, so every layout starts from the same model. No rank holds its whole
    tensor-parallel shard at any time (what `deepspeed.zero.Init` gives DeepSpeed's engine);
    `optimizer_groups(model)` gives the optimizer's groups once it is sharded. `model.init_from`
    is read afterwards (`FSDP2Engine.load_initial_weights`). Collective."""
    offload = offloads_to_cpu(ds_config)
    device = torch.device(get_accelerator().current_device_name())
    with torch.device("meta"):
        model = (construct_stages(cfg, groups) if cfg.parallel.pipeline > 1
                 else construct_for_layout(cfg, groups))
    mesh = data_mesh(groups, replicas=cfg.train.fsdp2_replicas, device_type=device.type)
    tensor_parallel = {name for name, p in canonical_parameters(model, cfg.model)
                       if getattr(p, "tensor_model_parallel", False)}
    whole_experts = frozenset(name for name, p in canonical_parameters(model, cfg.model)
                              if getattr(p, "expert_parallel", False))
    experts = None
    if isinstance(expert_groups_of(groups), ExpertGroups):  # experts beyond the tensor group
        experts = (DeviceMesh.from_group(groups.expert_data, device_type=device.type),
                   torch_dist.get_world_size(groups.data))
    shard_model(model, mesh, reshard_after_forward=reshards_after_forward(zero_stage(ds_config)),
                bf16=cfg.train.precision is Precision.BF16, offload=offload, experts=experts)
    # under CPUOffloadPolicy the shards live in host memory, the buffers beside the compute
    model.to_empty(device=torch.device("cpu") if offload else device)
    for name, p in canonical_parameters(model, cfg.model):  # the parameters now held: whole
        if name in whole_experts:  # for `form.shard_of_rank` (model.init_from) too
            p.expert_parallel = True
    rotary_tables(model, cfg.model, device=device)
    tp_group = tensor_parallel_group(groups)
    init_shards(model, cfg.model, seed=cfg.train.seed, tp_rank=tp_rank(tp_group),
                tp_size=tp_world_size(tp_group), whole=whole_experts)
    return FSDP2Engine(cfg, ds_config, groups, model, param_groups=optimizer_groups(model),
                       lr_factor=lr_factor, tensor_parallel=tensor_parallel, mesh=mesh,
                       whole_experts=whole_experts)


@torch.no_grad()
def init_shards(model: torch.nn.Module, cfg: ModelConfig, *, seed: int, tp_rank: int,
                tp_size: int, whole: frozenset[str] = frozenset()) -> None:
    """Fill each parameter's FSDP2 shard (its `to_local()` rows, from `_first_row`) with its
    rows of tensor-parallel rank `tp_rank`'s seeded initial shard (`init_rows`); the names in
    `whole` (expert-parallel experts) with their rows of the whole tensor. The buffers the
    weights carry (the expert bias) are set to their initial value, whole."""
    for name, p in canonical_parameters(model, cfg):
        rank, size = (0, 1) if name in whole else (tp_rank, tp_size)
        init_rows(name, cfg, seed=seed, tp_rank=rank, tp_size=size,
                  first_row=_first_row(p), out=_local(p.data))
    for name, buffer in canonical_buffers(model, cfg):
        init_rows(name, cfg, seed=seed, tp_rank=0, tp_size=1, first_row=0, out=buffer)


def init_rows(name: str, cfg: ModelConfig, *, seed: int, tp_rank: int, tp_size: int,
              first_row: int, out: torch.Tensor) -> None:
    """Rows `first_row` .. `first_row + len(out)` of `llama.shard_init(name, ...)` (rank
    `tp_rank`'s tensor-parallel shard of the seeded initial value) into `out`, on its device:
    bitwise those rows, drawn from the same `INIT_BLOCK` blocks. A shard split along its rows
    (vocabulary, column-parallel projections, norms) draws only the blocks `out` overlaps
    (padded vocabulary rows 0); a matrix split along its columns (o_proj, down_proj) is drawn
    one block of columns at a time, whole rows, of which `out`'s are kept: one block in memory
    besides `out`."""
    if out.numel() == 0:  # more data-parallel ranks than rows
        return
    part = shard_range(name, cfg, tp_rank=tp_rank, tp_size=tp_size)
    rows = out.shape[0]
    if part.dim == 0:
        start = part.start + first_row
        real = min(max(part.real_stop - start, 0), rows)
        out.narrow(0, real, rows - real).zero_()
        if real:
            _draw_init(name, cfg, seed=seed, dim=0, start=start, out=out.narrow(0, 0, real))
        return
    column = part.start
    while column < part.stop:
        stop = min(part.stop, (column // INIT_BLOCK + 1) * INIT_BLOCK)
        block = torch.empty(part.shape[0], stop - column)
        _draw_init(name, cfg, seed=seed, dim=1, start=column, out=block)
        out.narrow(1, column - part.start, stop - column).copy_(block.narrow(0, first_row, rows))
        column = stop


def rotary_tables(model: torch.nn.Module, cfg: ModelConfig, *, device: torch.device) -> None:
    """Compute the rotary tables (a function of the config) of a model constructed on the meta
    device, onto `device`; an error for any buffer but those and the ones the weights carry
    (`canonical_buffers`, the expert bias: `init_shards` sets them)."""
    carried = {id(b) for _, b in canonical_buffers(model, cfg)}
    for module in model.modules():
        buffers = {key: b for key, b in module.named_buffers(recurse=False)
                   if id(b) not in carried}
        if not buffers:
            continue
        if not isinstance(module, RotaryEmbedding):
            raise RuntimeError(f"{type(module).__name__} holds buffers {sorted(buffers)}: "
                               "build_fsdp2_engine computes only the rotary tables")
        table = rotary_embedding(cfg)
        for key, value in table.named_buffers():
            if value.shape != buffers[key].shape:
                raise RuntimeError(f"rotary table {key}: {tuple(buffers[key].shape)} built, "
                                   f"{tuple(value.shape)} computed")
            setattr(module, key, value.to(device))
