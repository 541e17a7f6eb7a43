"""Resuming an engine checkpoint on another layout: tp, pp, dp, ZeRO stage, offload, precision.

A checkpoint saved on the run's own layout is loaded by DeepSpeed (`engine.load`), bitwise.
Any other is resharded here, online, by every rank of the new run, from the saved files alone:

- each parameter this rank holds (by Hugging Face name, so pipeline stages may move) gets the
  piece of the saved fp32 master weight and of Adam's two moments that this rank keeps: its new
  ZeRO partition of its new tensor-parallel shard (the whole shard at ZeRO-0), and only that is
  copied out of the saved files (`weights.engine_tensors(...).read_box`: ZeRO-1/2/3 flat
  partitions, ZeRO-0 per-parameter states, whichever saved tensor-parallel shards hold it);
- those go where the new engine keeps them: the fp32 master (ZeRO-1/2 and DeepSpeed's bf16
  optimizer through the parameter's `_hp_mapping` fragment, then the module weights all-gathered
  from the partitions as after a step; ZeRO-3 through its partition; bf16 at ZeRO-0 through the
  optimizer's fp32 groups; fp32 at ZeRO-0: the module's weight is the master) and the
  optimizer state of that master, created as the optimizer's own kernel keeps it;
- Adam's step count, the learning-rate schedule's position and the engine's step and sample
  counters are the saved ones; the trainer carries consumed samples and the global batch
  (gradient accumulation follows the new dp).

The result is the state the old layout held, to the last bit of every fp32 tensor: continuing
differs from the uninterrupted run only by the new layout's reduction order. RNG states are
carried where every rank keeps its role (same tp, pp and dp: a ZeRO-stage or offload change);
otherwise each rank's generators are seeded from (train.seed, step, rank), the same on every
restart of that layout. The model has no dropout, so losses do not depend on them.
"""
from __future__ import annotations

import math
import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pretrain.checkpoint.fsdp2_state import fsdp2_counters, is_fsdp2_checkpoint
from pretrain.checkpoint.weights import OPTIMIZER_NAMES, engine_tensors
from pretrain.checkpoint.zero_shards import load_checkpoint_file
from pretrain.config import Optimizer, RunConfig
from pretrain.errors import CheckpointError
from pretrain.model import canonical_buffers, canonical_parameters, tensor_parallel_group
from pretrain.model.form import shard_of_rank
from pretrain.model.llama import ShardRange, full_parameter_shape, shard_range
from pretrain.model.tensor_parallel import tp_rank, tp_world_size
from pretrain.training.muon import MOMENTUM_KEY, state_keys

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def _state_sources(step_dir: Path, cfg: RunConfig) -> dict[str, Any]:
    """The checkpoint's masters and each optimizer state key the run's parameters have (Adam's
    moments; under train.optimizer=muon Muon's momentum too), read lazily."""
    keys = ADAM_MOMENTS + ((MOMENTUM_KEY,) if cfg.train.optimizer is Optimizer.MUON else ())
    return {"master": engine_tensors(step_dir), **{key: engine_tensors(step_dir, key)
                                                   for key in keys}}


def optimizer_parameter_names(engine) -> list[list[str]] | None:
    """The module names of a ZeRO-0 optimizer's parameters, group by group in its order (saved
    with the checkpoint: a ZeRO-0 optimizer's state is indexed by that order alone); None when
    ZeRO partitions it (their files name the parameters)."""
    if engine.zero_optimization_stage() > 0:
        return None
    optimizer = engine.optimizer
    groups = getattr(optimizer, "fp16_groups", None)  # bf16 at ZeRO-0: the module's params
    if groups is None:
        groups = [group["params"] for group in optimizer.param_groups]
    names = {id(p): name for name, p in engine.module.named_parameters()}
    return [[names[id(p)] for p in group] for group in groups]


def saved_optimizer_step(step_dir: Path, *, default: int) -> int:
    """Adam's step count in a checkpoint (the same for every parameter; `default` when the
    optimizer had not stepped)."""
    if is_fsdp2_checkpoint(step_dir):
        return fsdp2_counters(step_dir)["adam_step"] or default
    for file in sorted(step_dir.glob("*optim_states.pt")):
        saved = load_checkpoint_file(file)["optimizer_state_dict"]
        state = saved.get("base_optimizer_state", saved.get("optimizer_state_dict", {}))
        return _step_of(state.get("state", {}), default)
    model_files = sorted(step_dir.glob("*mp_rank_*_model_states.pt"))
    optimizer = load_checkpoint_file(model_files[0]).get("optimizer") or {}
    return _step_of(optimizer.get("optimizer_state_dict", optimizer).get("state", {}), default)


def _step_of(state: dict, default: int) -> int:
    for entry in state.values():
        if "step" in entry:
            return int(entry["step"])
    return default


@dataclass(frozen=True)
class ReadVolume:
    """What a reshard read on this rank: tensor bytes copied out of the checkpoint's files, and
    the checkpoint's size on disk."""

    bytes_read: int
    checkpoint_bytes: int

    def __str__(self) -> str:
        return f"read {_size(self.bytes_read)} of {_size(self.checkpoint_bytes)}"


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


@torch.no_grad()
def load_resharded(engine, step_dir: Path, meta: dict[str, Any], *, cfg: RunConfig, groups,
                   rank: int) -> ReadVolume:
    """Set this rank's engine to the state of `step_dir`, saved on another layout (module
    weights, fp32 masters, Adam moments and step, lr schedule, step and sample counters).

    Each rank reads only its own piece of each master and moment: its ZeRO partition of its
    tensor-parallel shard (the whole shard at ZeRO-0); ZeRO-1/2 and the bf16 optimizer then
    all-gather the low-precision weights from the partitions, as after a step."""
    m = cfg.model
    tp_group = tensor_parallel_group(groups)
    tp_size, my_tp = tp_world_size(tp_group), tp_rank(tp_group)
    step = saved_optimizer_step(step_dir, default=int(meta["step"]))
    _create_adam_state(engine, step=step)
    sources = _state_sources(step_dir, cfg)
    # ZeRO partitions over every replica of a shard: data x context ranks
    topology = groups.topology
    targets = _Targets(engine, dp_rank=topology.replica_rank(topology.rank),
                       dp_size=topology.replicas)
    for name, param in canonical_parameters(engine.module, m):
        flat_range = targets.needed(param)
        if flat_range is None:  # ZeRO-1/2: outside this rank's partition
            continue
        where = shard_range(name, m, **shard_of_rank(param, tp_rank=my_tp, tp_size=tp_size))
        for what in ("master",) + state_keys(name, cfg.train.optimizer):
            source = sources[what]
            try:
                piece = read_shard_piece(source, name, where, flat_range, cfg=m)
            except KeyError:
                raise CheckpointError(f"{step_dir} holds no {what} of {name}") from None
            targets.set(param, piece, what)
            del piece
    with torch.no_grad():  # buffers (DeepSeek-V3's expert bias): whole on every rank, bitwise
        for name, buffer in canonical_buffers(engine.module, m):
            buffer.copy_(sources["master"][name].to(buffer.dtype))
    targets.finish()
    _set_schedule(engine, step_dir, meta)
    return ReadVolume(bytes_read=sum(source.bytes_read for source in sources.values()),
                      checkpoint_bytes=sum(f.stat().st_size for f in step_dir.rglob("*")
                                           if f.is_file()))


@torch.no_grad()
def load_into_fsdp2(engine, step_dir: Path, meta: dict[str, Any], *, cfg: RunConfig,
                    groups) -> ReadVolume:
    """Set an fsdp2 engine (`pretrain.training.fsdp2.FSDP2Engine`) to the state of `step_dir`, saved
    by fsdp2 or DeepSpeed on any layout: each rank copies out its FSDP2 rows of its
    tensor-parallel shard of every master and Adam moment (`engine.load_state`); Adam's step,
    the schedule's position and the counters are the saved ones."""
    m = cfg.model
    sources = _state_sources(step_dir, cfg)
    if is_fsdp2_checkpoint(step_dir):
        counters = fsdp2_counters(step_dir)
    else:
        saved = load_checkpoint_file(sorted(step_dir.glob("*mp_rank_*_model_states.pt"))[0])
        counters = {"adam_step": saved_optimizer_step(step_dir, default=int(meta["step"])),
                    "lr_scheduler": saved.get("lr_scheduler"),
                    "global_steps": int(saved.get("global_steps", meta["step"])),
                    "global_samples": int(saved.get("global_samples", meta["consumed_samples"])),
                    "skipped_steps": int(saved.get("skipped_steps", 0))}
    coords, tp_size = groups.topology.my_coords, groups.topology.tensor

    def read(name: str, what: str, rows: tuple[int, int]) -> torch.Tensor:
        whole = name in engine.whole_experts  # an expert-parallel expert: the whole tensor
        where = shard_range(name, m, tp_rank=0 if whole else coords.tensor,
                            tp_size=1 if whole else tp_size)
        width = math.prod(where.shape[1:])
        if rows[1] <= rows[0]:  # an FSDP2 shard without rows (more ranks than rows)
            return torch.zeros(0)
        try:
            return read_shard_piece(sources[what], name, where, (rows[0] * width,
                                                                 rows[1] * width), cfg=m)
        except KeyError:
            raise CheckpointError(f"{step_dir} holds no {what} of {name}") from None

    engine.load_state(read, adam_step=counters["adam_step"], schedule=counters["lr_scheduler"],
                      counters=counters)
    return ReadVolume(bytes_read=sum(source.bytes_read for source in sources.values()),
                      checkpoint_bytes=sum(f.stat().st_size for f in step_dir.rglob("*")
                                           if f.is_file()))


def read_shard_piece(source, name: str, where: ShardRange, flat_range: tuple[int, int], *,
                     cfg) -> torch.Tensor:
    """Elements [start, stop) of the flattened tensor-parallel shard `where` of `name`, read
    from `source` (`weights.MergedShards`) block by block: at most a partial row, whole rows and
    a partial row. Padded vocabulary rows are zero (no checkpoint holds them)."""
    start, stop = flat_range
    rows = where.shape[0]
    width = math.prod(where.shape[1:])
    pieces = []
    for (r0, r1), cols in _row_blocks(start, stop, width=width):
        box = [(r0, r1), cols][:len(where.shape)]
        box[where.dim] = (box[where.dim][0] + where.start, box[where.dim][1] + where.start)
        real = full_parameter_shape(name, cfg)[where.dim]
        lo, hi = box[where.dim]
        block = torch.zeros([b - a for a, b in box])
        if min(hi, real) > lo:  # the rows (or columns) past `real` are vocabulary padding
            read = list(box)
            read[where.dim] = (lo, min(hi, real))
            block.narrow(where.dim, 0, min(hi, real) - lo).copy_(source.read_box(name,
                                                                                tuple(read)))
        pieces.append(block.reshape(-1))
    assert rows * width >= stop
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _row_blocks(start: int, stop: int, *, width: int):
    """((row range), (column range)) blocks covering flat elements [start, stop) of a matrix
    `width` columns wide, in order: a partial first row, whole rows, a partial last row."""
    (r_start, c_start), (r_stop, c_stop) = divmod(start, width), divmod(stop, width)
    if r_start == r_stop:
        if c_start < c_stop:
            yield (r_start, r_start + 1), (c_start, c_stop)
        return
    if c_start:
        yield (r_start, r_start + 1), (c_start, width)
        r_start += 1
    if r_start < r_stop:
        yield (r_start, r_stop), (0, width)
    if c_stop:
        yield (r_stop, r_stop + 1), (0, c_stop)


class _Targets:
    """Where the new engine keeps a parameter's module weight, fp32 master and Adam moments."""

    def __init__(self, engine, *, dp_rank: int, dp_size: int) -> None:
        self.wrapper = engine.optimizer
        self.base = getattr(engine.optimizer, "optimizer", engine.optimizer)
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.masters: dict[int, torch.Tensor] = {}
        self.partitioned = False  # ZeRO-1/2 or the bf16 optimizer: low-precision from masters
        if hasattr(self.wrapper, "fp16_groups") and hasattr(self.wrapper, "fp32_groups"):
            for low_group, master_group in zip(self.wrapper.fp16_groups, self.wrapper.fp32_groups):
                self.masters.update({id(low): master for low, master in zip(low_group,
                                                                             master_group)})

    def needed(self, param: torch.nn.Parameter) -> tuple[int, int] | None:
        """The elements [start, stop) of the flattened shard this rank keeps (None: none)."""
        if hasattr(param, "ds_id"):  # ZeRO-3: this rank's piece of the flat parameter
            size = param.ds_tensor.numel()
            start = min(self.dp_rank * size, param.ds_numel)
            return start, min(start + size, param.ds_numel)
        if hasattr(param, "_hp_mapping"):  # ZeRO-1/2: this rank's fragment, if any
            self.partitioned = True
            mapping = param._hp_mapping
            if mapping is None:
                return None
            start = mapping.lp_fragment_address.start
            return start, start + mapping.lp_fragment_address.numel
        return 0, param.numel()  # ZeRO-0: all of it

    def set(self, param: torch.nn.Parameter, piece: torch.Tensor, what: str) -> None:
        """Store `piece` (the elements `needed` names) as `what` of `param`."""
        if hasattr(param, "ds_id"):
            self._set_zero3(param, piece, what)
        elif hasattr(param, "_hp_mapping"):
            target = (param._hp_mapping.hp_fragment if what == "master" else
                      param._hp_mapping.get_hp_fragment(optim_state_key=what))
            target.data.copy_(piece)
        else:  # ZeRO-0: per-parameter masters and state
            value = piece.view_as(param)
            master = self.masters.get(id(param), param)
            if what == "master":
                param.data.copy_(value)
                master.data.copy_(value)
            else:
                self.base.state[master][what].copy_(value)

    def finish(self) -> None:
        """ZeRO-1/2 and the bf16 optimizer: every rank's module weights from the masters'
        partitions (collective over the data-parallel ranks)."""
        if self.partitioned:
            self.wrapper.update_lp_params()

    def _set_zero3(self, param, piece: torch.Tensor, what: str) -> None:
        from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

        padded = torch.zeros(param.ds_tensor.numel(), dtype=torch.float32)
        padded[:piece.numel()] = piece  # the last rank's piece ends in padding
        if what == "master":
            param.ds_tensor.data.copy_(padded.view_as(param.ds_tensor))
            safe_set_local_fp32_param(param, padded)
        else:
            safe_set_local_optimizer_state(param, padded, what)


def _create_adam_state(engine, *, step: int) -> None:
    """Give every tensor the optimizer updates Adam's state (zero moments where it has none
    yet, as DeepSpeed's bf16 optimizer and torch's AdamW before their first step) at step count
    `step`, and link DeepSpeed's per-parameter views of that state."""
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    # torch keeps the count as a tensor (Muon's AdamW groups step through torch's AdamW)
    as_tensor = isinstance(getattr(base, "adamw", base), torch.optim.Adam)
    for group, updated in _updated_tensors(engine.optimizer, base):
        for p in updated:
            state = base.state[p]
            if group.get("muon"):  # Muon's one state tensor, no count
                state.setdefault(MOMENTUM_KEY, torch.zeros_like(p))
                continue
            for key in ADAM_MOMENTS:
                if key not in state:  # on the master's device, in its dtype: what Adam creates
                    state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] = (adam_step_tensor(step, param=p, group=group) if as_tensor
                             else step)  # DeepSpeed's CPU Adam counts with an int
    for group in base.param_groups:
        if "step" in group:  # optimizers that count per group (DeepSpeed's fused Adam)
            group["step"] = step
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:  # ZeRO-1/2 and the bf16 optimizer link their state views lazily
        link()


def _updated_tensors(wrapper, base) -> list[tuple[dict, list[torch.Tensor]]]:
    """(param group, the tensors Adam updates in it) of the base optimizer."""
    found = [(group, list(group["params"])) for group in base.param_groups]
    # ZeRO-3 hands its flat fp32 partitions to the optimizer only while it steps
    flat = getattr(wrapper, "fp32_partitioned_groups_flat", [])
    group_of = getattr(wrapper, "sub_group_to_group_id", {})
    for sub_group, partition in enumerate(flat):
        found.append((base.param_groups[group_of.get(sub_group, 0)], [partition]))
    return found


def adam_step_tensor(step: int, *, param: torch.Tensor, group: dict) -> torch.Tensor:
    """Adam's step count as torch's Adam/AdamW would hold it for `param` in `group`: its fused
    and capturable kernels (the fused AdamW the configs select on GPUs) take an fp32 count on the
    parameter's device and refuse any other; the for-each and single-tensor ones a CPU scalar of
    the default float dtype (torch.optim.Adam._init_group's rule)."""
    from torch.optim.optimizer import _get_scalar_dtype

    if group.get("fused") or group.get("capturable"):
        return torch.tensor(float(step), dtype=_get_scalar_dtype(is_fused=group.get("fused")),
                            device=param.device)
    return torch.tensor(float(step), dtype=_get_scalar_dtype(), device="cpu")


def _set_schedule(engine, step_dir: Path, meta: dict[str, Any]) -> None:
    """The learning-rate schedule where it was (and the optimizer's lr with it), and the
    engine's counters."""
    if is_fsdp2_checkpoint(step_dir):  # the same entries, from fsdp2's first rank file
        saved = fsdp2_counters(step_dir)
    else:
        saved = load_checkpoint_file(sorted(step_dir.glob("*mp_rank_*_model_states.pt"))[0])
    if engine.lr_scheduler is not None and saved.get("lr_scheduler"):
        _resume_schedule(engine.lr_scheduler, saved["lr_scheduler"],
                         engine.optimizer.param_groups)
    engine.global_steps = int(saved.get("global_steps", meta["step"]))
    engine.global_samples = int(saved.get("global_samples", meta["consumed_samples"]))
    engine.skipped_steps = int(saved.get("skipped_steps", 0))


def _resume_schedule(scheduler, saved: dict[str, Any], param_groups: list[dict]) -> None:
    """Move `scheduler` to the saved schedule's position and set each group's lr there.

    Only the position is taken from the file: the groups' base learning rates are this engine's
    own. The file is the first model-parallel rank's, whose groups need not be this rank's (a
    muP middle pipeline stage holds neither embedding nor head; its groups are cut differently),
    and the rates of its groups would land on the wrong ones."""
    state = scheduler.state_dict()
    state.update({key: saved[key] for key in ("last_epoch", "_step_count") if key in saved})
    scheduler.load_state_dict(state)
    with warnings.catch_warnings():  # get_lr() outside step() warns; it is the closed form here
        warnings.simplefilter("ignore")
        lrs = scheduler.get_lr()
    for group, lr in zip(param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = list(lrs)  # what get_last_lr() returns, as after a step


def derived_rng_seed(cfg: RunConfig, *, step: int, rank: int) -> int:
    """The seed of a rank's generators after a reshard: fixed by (train.seed, step, rank)."""
    return (cfg.train.seed * 1_000_003 + step * 8191 + rank) % (2 ** 31)


def seed_generators(seed: int) -> None:
    from deepspeed.accelerator import get_accelerator

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if get_accelerator().device_name() != "cpu":
        get_accelerator().manual_seed(seed)

