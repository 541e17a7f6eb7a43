"""Engine checkpoints: choosing the one to resume from, loading, the final export.

Saving is `pretrain.checkpoint.saver`: a save is complete when its manifest exists, and a crash
during a save leaves a directory without one, which resuming skips. Resuming checks every file of the manifest (present, same size, same CRC32),
and that the model and tokenizer match the run; automatic resume falls back to the previous
complete checkpoint and says why. A checkpoint of the run's layout is DeepSpeed's to load (or a
universal one, with `load_universal`); any other layout is resharded (`reshard`).

`save_final` writes the module's working weights as `final/` at the end of training, whatever
the layout (ZeRO-3 shards and tensor-parallel shards gathered, padded vocabulary rows dropped, a
tied lm_head stored once as Hugging Face does), so `transformers` can load `model.safetensors` as
a `LlamaForCausalLM`. With bf16 training these are the bf16 weights widened to fp32 (DeepSpeed
keeps the fp32 master weights in the optimizer state of the engine checkpoint, which is what
resuming uses). Rank 0 holds the whole model in CPU memory while writing it: for models that do
not fit, set `checkpoint.save_final: false` and convert the engine checkpoint instead.
"""
from __future__ import annotations

import contextlib
import random
import re
import time
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import deepspeed
import numpy as np
import torch
import torch.distributed as torch_dist
from torch.distributed.tensor import DTensor
from deepspeed.accelerator import get_accelerator
from deepspeed.checkpoint import ds_to_universal

import pretrain.checkpoint.safe_load as safe_load
from pretrain.checkpoint.paths import (FINAL, read_meta, step_dirs, verify, write_latest,
                                       write_manifest)
from pretrain.checkpoint.fsdp2_state import is_fsdp2_checkpoint
from pretrain.checkpoint.reshard import (_resume_schedule, derived_rng_seed, load_into_fsdp2,
                                         load_resharded, seed_generators)
from pretrain.checkpoint.weights import writing_final
from pretrain.config import RunConfig
from pretrain.data import Tokenizer
from pretrain.dist import gather_for_io, wait_for_io
from pretrain.errors import CheckpointError
from pretrain.model import canonical_buffers, canonical_parameters, tensor_parallel_group
from pretrain.model.hf import EMBED, LM_HEAD, expected_hf_keys
from pretrain.model.mup import comparable_model_fields
from pretrain.model.expert_parallel import expert_owner
from pretrain.model.llama import full_parameter_shape, gather_tensor_parallel_state
from pretrain.resolve.run import describe, expert_tensor, layout_change

# Model fields that do not change the saved tensors or their meaning: a resumed run may change
# its recompute mode, and the initial weights / init scale only mattered at step 0.
# `seq_length` and `rope_theta` change no tensor either: long-context continued pretraining
# resumes a run at a longer sequence (typically with parallel.context > 1) and a larger rotary
# base; the data stream then continues with samples of the new length.
RESUMABLE_MODEL_CHANGES = frozenset({"preset", "init_std", "init_from", "activation_checkpointing",
                                     "activation_checkpointing_interval", "compile",
                                     "fused_projections", "loss_chunk_tokens", "seq_length",
                                     "rope_theta"})


def checkpoint_meta(cfg: RunConfig, *, step: int, consumed_samples: int, global_batch: int,
                    tokenizer: Tokenizer, git_commit: str,
                    layout: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(client_state, meta) of a save: what DeepSpeed stores with the engine state, and the
    `meta.json` that resuming and the readers check without loading tensors; `layout` is
    `pretrain.resolve.run.ResolvedRun.checkpoint_layout`."""
    state = {"step": step, "consumed_samples": consumed_samples, "config": cfg.to_dict(),
             "tokenizer": {"path": str(tokenizer.path), "sha256": tokenizer.sha256}}
    meta = {**state, "global_batch": global_batch, "git_commit": git_commit,
            "layout": layout,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    return state, meta


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "accelerator" in state:
        get_accelerator().set_rng_state(state["accelerator"])


# ---- resume ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResumePoint:
    path: Path  # the step<N> directory
    meta: dict[str, Any]

    @property
    def universal(self) -> bool:
        return bool(self.meta.get("universal"))

    @property
    def step(self) -> int:
        return int(self.meta["step"])


def resume_mismatch(meta: dict[str, Any], cfg: RunConfig) -> str | None:
    """Why a checkpoint cannot be loaded into this run (None: it can): another model or another
    tokenizer. Another layout can (`reshard`)."""
    # an older checkpoint without the parametrization fields is standard; muP's base fields
    # count only under muP (`mup.comparable_model_fields`)
    saved_model = comparable_model_fields(meta["config"]["model"])
    model = comparable_model_fields(cfg.to_dict()["model"])
    diff = {k: (saved_model.get(k), v) for k, v in model.items()
            if k not in RESUMABLE_MODEL_CHANGES and saved_model.get(k) != v}
    if diff:
        return ("it was written for another model: " +
                ", ".join(f"model.{k}={a!r} there, {b!r} here" for k, (a, b) in diff.items()) +
                "; use the run's own config or start a new run_dir")
    saved_sha = meta.get("tokenizer", {}).get("sha256")
    if saved_sha and cfg.data.tokenizer:
        sha = Tokenizer.load(cfg.data.tokenizer).sha256
        if sha != saved_sha:
            return (f"it was trained with the tokenizer {meta['tokenizer'].get('path')!r} (sha256 "
                    f"{saved_sha[:12]}...), data.tokenizer={cfg.data.tokenizer!r} has sha256 "
                    f"{sha[:12]}...: point data.tokenizer at the run's tokenizer")
    return None


def find_resume(cfg: RunConfig, *, resume_from: str | None, log: Callable[[str], None],
                damaged: dict[Path, str] | None = None,
                own_first: bool = False) -> ResumePoint | None:
    """The checkpoint this run starts from, read from files only (runs before any collective).

    `resume_from` None: the newest complete checkpoint of `<run_dir>/checkpoints` (None when
    there is none); damaged ones (a missing or truncated file, or one of `damaged`, whose
    content `confirm_content` found wrong) are skipped with a message. With `resume_from` (a run
    dir, a checkpoints dir or a step dir) a damaged checkpoint is an error when it is the only
    one. `own_first` (`--start-from`): `resume_from` is where the run starts, and once run_dir
    has a complete checkpoint of its own that one is resumed instead (a requeued job repeats its
    command: an anneal goes on mid-decay, not from its start again). A checkpoint of another
    model or tokenizer is always an error: falling back would not fix the config. File sizes
    are checked here; contents, by every rank's share, once the process group exists
    (`confirm_content`).
    """
    damaged = damaged or {}
    explicit = resume_from is not None
    root = Path(resume_from) if explicit else Path(cfg.run_dir) / "checkpoints"
    if explicit and own_first:
        own = find_resume(cfg, resume_from=None, log=log, damaged=damaged)
        if own is not None:
            log(f"[resume] {cfg.run_dir} holds this run's own checkpoint {own.path.name}: "
                f"resuming it, not --start-from {resume_from} (where the run started)")
            return own
    candidates = step_dirs(root)
    if explicit and not candidates:
        raise CheckpointError(f"--resume-from {str(root)!r} holds no checkpoint: pass a run "
                              "directory, its checkpoints/ directory or a checkpoints/step<N> one")
    problems = []
    for tag_dir in candidates:
        problem = damaged.get(tag_dir) or verify(tag_dir)
        if problem is not None:
            problems.append(f"{tag_dir.name}: {problem}")
            if explicit and len(candidates) == 1:
                raise CheckpointError(f"checkpoint {str(tag_dir)!r} is damaged: {problem}")
            log(f"[resume] skipping {tag_dir}: {problem}; trying the previous checkpoint")
            continue
        meta = read_meta(tag_dir)
        mismatch = resume_mismatch(meta, cfg)
        if mismatch:
            raise CheckpointError(f"checkpoint {str(tag_dir)!r} does not match this run: {mismatch}")
        if problems:
            log(f"[resume] falling back to {tag_dir} (newer ones are damaged or incomplete)")
        return ResumePoint(tag_dir, meta)
    if any("incomplete" not in p for p in problems):
        raise CheckpointError(f"no usable checkpoint under {str(root)!r} ({'; '.join(problems)}): "
                              "restore the files, or move the directory away to start over")
    if problems:
        log(f"[resume] no complete checkpoint under {root}: starting from step 0")
    return None


def confirm_content(point: ResumePoint | None, cfg: RunConfig, *, resume_from: str | None,
                    log: Callable[[str], None], own_first: bool = False) -> ResumePoint | None:
    """`point`, once the CRC32 of every file matches its manifest, else the newest checkpoint
    that passes (as `find_resume` chooses, the damaged ones skipped). Collective: each rank reads
    its share of the files, and all see every rank's findings, so they choose alike."""
    rank, world = ((torch_dist.get_rank(), torch_dist.get_world_size())
                   if torch_dist.is_initialized() else (0, 1))
    damaged: dict[Path, str] = {}
    while point is not None:
        found = [p for p in gather_for_io(verify(point.path, content=True, share=(rank, world)))
                 if p is not None]
        if not found:
            return point
        damaged[point.path] = found[0]
        point = find_resume(cfg, resume_from=resume_from, log=log, damaged=damaged,
                            own_first=own_first)
    return None


def load(engine, point: ResumePoint, *, cfg: RunConfig, groups, layout: dict[str, Any],
         rank: int) -> str | None:
    """Load a checkpoint into the engine (collective) and this rank's RNG states; returns the
    layout change and what this rank read of the checkpoint when it was resharded
    (`tp2 pp1 dp1 ZeRO-1 -> tp1 pp1 dp2 ZeRO-3, read 1.2 GB of 9.6 GB`).

    A checkpoint of this run's `layout` (or a universal one) is DeepSpeed's to load; any other,
    and any on the expert grid (whose experts differ between data ranks), is resharded
    (`reshard.load_resharded`). RNG states are carried where every rank keeps its
    role (the same tp, pp and dp); otherwise each rank's generators are seeded from
    (train.seed, step, rank) (the model has no dropout: losses do not depend on them).
    """
    deepspeed_grid = (expert_grid_layout(layout)
                      and layout.get("engine", "deepspeed") == "deepspeed")
    if point.universal and deepspeed_grid:
        raise CheckpointError(
            f"checkpoint {str(point.path)!r} is a universal checkpoint, and DeepSpeed's "
            f"universal loader does not place the experts of parallel.expert={layout['expert']} "
            "beyond the tensor group (the expert grid: our MoE groups, not DeepSpeed's MoE "
            "layers); resume from the engine checkpoint it was converted from, which is "
            "resharded onto any layout")
    change = None if point.universal else layout_change(point.meta["layout"], layout)
    if change is None and not point.universal and deepspeed_grid:
        # DeepSpeed's own load reads the module states of the first data rank into every rank,
        # whose experts are not the others'; the resharder reads each rank's from its files
        change = f"{describe(layout)}, its own layout"
    try:
        if getattr(engine, "name", None) == "fsdp2":  # its own files or DeepSpeed's, any layout
            volume = load_into_fsdp2(engine, point.path, point.meta, cfg=cfg, groups=groups)
            change, path = (f"{change}, {volume}" if change else None), point.path
        elif change:
            volume = load_resharded(engine, point.path, point.meta, cfg=cfg, groups=groups,
                                    rank=rank)
            change, path = f"{change}, {volume}", point.path
        else:
            with safe_load.loading_safely():  # DeepSpeed's reads, universal files included
                path, _ = engine.load_checkpoint(str(point.path.parent), tag=point.path.name,
                                                 load_module_strict=True)
            if path is not None and engine.lr_scheduler is not None:
                # each group's lr from this run's schedule at the saved step, not the saved
                # lr: a run with another schedule (annealing a checkpoint: train.steps and
                # decay_start_step moved) goes on along its own; the same schedule, bit for bit
                _resume_schedule(engine.lr_scheduler, engine.lr_scheduler.state_dict(),
                                 engine.optimizer.param_groups)
    except (RuntimeError, OSError, KeyError, ValueError, EOFError) as exc:
        raise CheckpointError(f"checkpoint {str(point.path)!r} cannot be loaded ({exc}); "
                              "move it away to resume from an older one") from None
    if path is None:
        raise CheckpointError(f"DeepSpeed found no checkpoint in {str(point.path)!r}: its "
                              "model_states files are missing")
    saved = point.meta["layout"]
    same_roles = all(saved.get(k, 1) == layout.get(k, 1)
                     for k in ("tensor", "pipeline", "data", "context", "expert")) and \
        expert_tensor(saved) == expert_tensor(layout)
    rng = point.path / f"rng_rank{rank:05d}.pt"
    if same_roles and rng.is_file():
        _set_rng_state(safe_load.load(rng))
    elif not same_roles:
        seed_generators(derived_rng_seed(cfg, step=point.step, rank=rank))
    return change


# ---- universal ---------------------------------------------------------------------------------
def expert_grid_layout(layout: dict[str, Any]) -> bool:
    """Whether a checkpoint's recorded layout put experts beyond the tensor group."""
    expert = layout.get("expert", 1)
    return expert > 1 and (expert != layout.get("tensor", 1) or expert_tensor(layout) > 1)


def to_universal(src: Path, dst: Path) -> Path:
    """Convert a checkpoint (run dir, checkpoints dir or step dir) to DeepSpeed's universal
    format in `dst/step<N>`, for tools that read it; returns that directory. (Resuming on
    another layout needs no conversion: `reshard`.)

    `pretrain train --resume-from DST` then resumes with DeepSpeed's `checkpoint.load_universal`
    setting, keeping the saved global batch (gradient accumulation is recomputed for the new dp).
    """
    candidates = [p for p in step_dirs(src) if verify(p) is None]
    if not candidates:
        raise CheckpointError(f"no complete checkpoint under {str(src)!r} to convert")
    tag_dir = candidates[0]
    meta = read_meta(tag_dir)
    _check_convertible(tag_dir, meta)
    out = Path(dst) / tag_dir.name
    if out.exists():
        raise CheckpointError(f"{str(out)!r} exists: remove it or choose another destination")
    out.parent.mkdir(parents=True, exist_ok=True)
    with safe_load.loading_safely():  # DeepSpeed's reads of the source files
        ds_to_universal.main(Namespace(input_folder=str(tag_dir), output_folder=str(out),
                                       num_extract_workers=1, num_merge_workers=1,
                                       keep_temp_folder=False, strict=True,
                                       inject_missing_state=False))
    write_manifest(out, {**meta, "universal": True, "converted_from": str(tag_dir.resolve())})
    write_latest(out.parent, out.name)
    return out


def _check_convertible(tag_dir: Path, meta: dict[str, Any]) -> None:
    """`CheckpointError` when DeepSpeed's universal conversion cannot handle this checkpoint."""
    if meta.get("universal"):
        raise CheckpointError(f"{str(tag_dir)!r} is already a universal checkpoint")
    if meta["layout"].get("engine", "deepspeed") != "deepspeed":
        raise CheckpointError(
            f"{str(tag_dir)!r} was saved by train.engine={meta['layout']['engine']}, whose files "
            "DeepSpeed's universal conversion cannot read; it needs none: `pretrain train "
            "--resume-from` resumes it on any layout and under either engine, and export-hf "
            "reads it")
    if expert_grid_layout(meta["layout"]):
        raise CheckpointError(
            f"{str(tag_dir)!r} was saved with parallel.expert={meta['layout']['expert']} beyond "
            "the tensor group (the expert grid): DeepSpeed's universal conversion reads the "
            "first data rank's module states and expert groups only, and each expert rank's "
            "differ; it needs none: `pretrain train --resume-from` resumes it on any layout, "
            "and export-hf reads it")
    if meta["layout"]["zero_stage"] == 0:
        raise CheckpointError(
            f"{str(tag_dir)!r} was saved with ZeRO-0, which DeepSpeed cannot convert to a universal "
            "checkpoint (it is built from ZeRO optimizer partitions); to resume it on another "
            "layout no conversion is needed: pass it to `pretrain train --resume-from`")
    if meta["layout"]["tensor"] > 1:  # expert parallelism is over the tensor ranks too
        raise CheckpointError(
            f"{str(tag_dir)!r} has tensor parallel {meta['layout']['tensor']}: our tensor-parallel "
            "layers do not declare DeepSpeed's merge patterns, so the universal conversion would "
            "merge their shards wrongly; to resume it on another layout no conversion is "
            "needed: pass it to `pretrain train --resume-from`")


# ---- final weights -----------------------------------------------------------------------------
def save_final(engine, *, cfg: RunConfig, groups, tokenizer, run_dir: Path, step: int,
               main: bool) -> Path:
    """Write `<run_dir>/final/` with the module weights, one tensor at a time (collective).

    For each parameter in turn: under ZeRO-3 its data-parallel ranks gather it, the first
    replica's tensor-parallel ranks of the stage holding it gather its shards, and that stage's
    first rank sends the whole tensor to rank 0, which appends it to the file (fp32) and drops
    it. No rank holds more than one whole tensor beyond its shard, and only tensors travel
    (point-to-point, on the accelerator under NCCL); the stages' lists of names are the only
    objects exchanged.

    The tensors go in stage and layer order (`export_order`), and before each one every rank
    meets rank 0 at `wait_for_io` once it has written the previous one: the long waits (the
    later stages' while rank 0 writes the earlier ones, hundreds of GB at 70B) are on the
    file-work group, whose timeout is train.io_timeout_minutes; a gather, send or receive then
    waits only for peers that are already on their way, never for a write (NCCL's watchdog
    aborts a collective that waits longer than its timeout).
    """
    m = cfg.model
    local = dict(canonical_parameters(engine.module, m))
    local.update(canonical_buffers(engine.module, m))  # whole on every rank (the expert bias)
    names = export_order(expected_hf_keys(m))
    coords, topology = groups.topology.my_coords, groups.topology
    holder = _holding_stages(local, [n for n in names if expert_owner(
        n, m, expert=topology.expert) is None], groups)  # experts: on their tensor rank
    zero3 = hasattr(next(iter(local.values())), "ds_id")
    dtype = next(iter(local.values())).dtype  # fsdp2 under bf16: its fp32 shards
    device = torch.device(get_accelerator().current_device_name())
    writing = writing_final(run_dir / FINAL, shapes={n: full_parameter_shape(n, m) for n in names},
                            run_config=cfg, tokenizer=Path(tokenizer.path), step=step,
                            source=str(run_dir)) if main else contextlib.nullcontext()
    with writing as writer:
        for name in names:
            wait_for_io()  # rank 0 is done with the previous tensor
            owner = expert_owner(name, m, expert=topology.expert)
            if owner is not None:  # on one expert rank of the stage holding its router
                stage = holder[_router_of(name)]
                _final_expert(local.get(name), name, m, owner=(owner, stage), groups=groups,
                              zero3=zero3, writer=writer if main else None, dtype=dtype,
                              device=device)
            elif coords.pipeline == holder[name]:
                full = _whole_tensor(local[name], name, m, groups=groups, zero3=zero3,
                                     first_replica=coords.data == 0 and coords.context == 0)
                if main:
                    writer.write(name, full)
                elif full is not None and coords.tensor == 0:
                    torch_dist.send(full.to(device), dst=0)
                del full  # not alive while the next one is gathered
            elif main:
                received = torch.empty(full_parameter_shape(name, m), dtype=dtype, device=device)
                torch_dist.recv(received, src=topology.rank_of(tensor=0, data=0,
                                                               pipeline=holder[name]))
                writer.write(name, received)
                del received
    wait_for_io()
    return run_dir / FINAL


def export_order(names) -> list[str]:
    """`names` in the order the pipeline stages hold them: the embedding, the decoder layers
    by number (0, 1, 2, ..., 10, not 0, 1, 10, 2: within a layer by name), the final norm, the
    output head. Rank 0 (stage 0) writes its own tensors first, and each later stage's come
    after the earlier stages', so no stage waits for a tensor of a stage after it."""
    def position(name: str) -> tuple[int, int, str]:
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        if layer:
            return 1, int(layer[1]), name
        return {EMBED: 0, LM_HEAD: 3}.get(name, 2), 0, name
    return sorted(names, key=position)


def _router_of(expert: str) -> str:
    """The router of an expert's layer, held by the pipeline stage holding the expert."""
    return expert[:expert.index(".mlp.experts.")] + ".mlp.gate.weight"


def _final_expert(param, name: str, m, *, owner: tuple[int, int], groups, zero3: bool, writer,
                  dtype, device) -> None:
    """Rank 0 writes expert `name`, held by the ranks of expert rank `owner[0]` on pipeline
    stage `owner[1]` (`Topology.expert_rank`; whole, or split over their tensor group at
    expert_tensor = tensor, gathered there), from which the first expert-data replica's
    first rank sends it (gathered over data parallel under ZeRO-3, every replica joining)."""
    topology = groups.topology
    expert, stage = owner
    stage_size = topology.tensor * topology.context * topology.data

    def grid(rank: int) -> tuple[int, int, int]:  # (expert-tensor, expert, expert-data) index
        return topology.expert_coords(rank)

    holders = [r for r in range(topology.world_size)
               if r // stage_size == stage and grid(r)[1] == expert]
    sender = next(r for r in holders if grid(r)[0] == 0 and grid(r)[2] == 0)
    full = None
    if topology.rank in holders:
        if isinstance(param, DTensor):  # fsdp2: all-gathered over its (expert-)data group
            full = param.detach().full_tensor()
        else:
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None) if zero3 \
                    else contextlib.nullcontext():
                full = param.detach().clone()
        if topology.expert_tensor > 1 and topology.expert > 1:  # split over the tensor group
            full = (gather_tensor_parallel_state({name: full}, cfg=m,
                                                 tp_group=tensor_parallel_group(groups))[name]
                    if grid(topology.rank)[2] == 0 else None)
    if writer is not None and sender == topology.rank:
        writer.write(name, full)
    elif writer is not None:
        received = torch.empty(full_parameter_shape(name, m), dtype=dtype, device=device)
        torch_dist.recv(received, src=sender)
        writer.write(name, received)
    elif topology.rank == sender:
        torch_dist.send(full.to(device), dst=0)


def _holding_stages(local: dict[str, torch.Tensor], names: list[str], groups) -> dict[str, int]:
    """The first pipeline stage holding each name (a tied embedding is on the first and the
    last): the stages' name lists are gathered over the pipeline group, a few KB."""
    held: list[list[str]] = [[] for _ in range(groups.topology.pipeline)]
    if groups.topology.pipeline > 1:
        torch_dist.all_gather_object(held, sorted(local), group=groups.pipeline)
    else:
        held = [sorted(local)]
    holder = {}
    for stage, stage_names in enumerate(held):
        for name in stage_names:
            holder.setdefault(name, stage)
    missing = [n for n in names if n not in holder]
    if missing:
        raise RuntimeError(f"no pipeline stage holds {missing[:3]}")
    return holder


def _whole_tensor(param: torch.Tensor, name: str, m, *, groups, zero3: bool,
                  first_replica: bool) -> torch.Tensor | None:
    """The unsharded tensor of `name` on the first replica's ranks of its stage (None on the
    others): gathered over data parallel under ZeRO-3 (every replica joins), then over tensor
    parallel (the first replica only)."""
    if zero3 and hasattr(param, "ds_id"):  # a buffer is whole
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            shard = param.detach().clone()
    elif isinstance(param, DTensor):  # fsdp2: all-gathered over the data group (every replica)
        shard = param.detach().full_tensor()
    else:
        shard = param.detach()
    if not first_replica:
        return None
    return gather_tensor_parallel_state({name: shard}, cfg=m,
                                        tp_group=tensor_parallel_group(groups))[name]
