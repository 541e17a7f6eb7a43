"""A model's whole weights, read from any checkpoint, and the one `final/` format.

`load_weights` is the one reader of every kind of checkpoint: a run dir (the engine checkpoint
`latest` names, else final/), an engine step dir of any layout, a final/ dir (also what
`convert-checkpoint --to fp32` and `import-hf` write), or a Hugging Face Llama directory.
`write_final` is the one writer of the final/ format: fp32 `model.safetensors` with Hugging Face
names, the run's `config.yaml` and the tokenizer, swapped in whole by `atomic_directory`.

Engine checkpoints are read offline, with no process group, so a checkpoint trained on hundreds
of ranks converts on one CPU machine, and lazily: `Weights.state` of an engine checkpoint reads a
tensor when it is asked for, so a writer going tensor by tensor holds one whole tensor at a time
(the files are memory-mapped):

- each model-parallel rank's weights: at ZeRO >= 1 the fp32 master weights of the optimizer
  shards (`zero_shards.ZeroMasters`, over the rank's data-parallel files; for bf16 training
  these are the exact fp32 masters, not the bf16 copies the module computes with), at ZeRO-0
  the module weights of `mp_rank_XX_model_states.pt` or of the pipeline's
  `layer_XX-model_YY-model_states.pt` files,
- pipeline parameter names ("3.mlp.up_proj.weight", "tied_modules.embed...") become Hugging Face
  names through `pipeline_to_canonical_name`; a model-parallel rank is stage * tp + tp_rank
  (DeepSpeed's model-parallel group, pipeline-major),
- tensor-parallel shards are concatenated along `tensor_partition_dim`, padded vocabulary rows
  dropped, and a tied lm_head stored once, as Hugging Face does.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from pretrain import storage
from pretrain.checkpoint.fsdp2_state import (carries_buffers, fsdp2_client_state, fsdp2_shards,
                                             is_fsdp2_checkpoint)
from pretrain.checkpoint.paths import (FINAL, FINAL_CONFIG, FINAL_TOKENIZER, FINAL_TOKENIZER_DIR,
                                       FINAL_WEIGHTS, MANIFEST, step_dirs, verify)
from pretrain.checkpoint.store import local_checkpoint, materialize
from pretrain.checkpoint.safetensors_stream import LazyTensors, SafetensorsWriter
from pretrain.checkpoint.zero_shards import ExpertFiles, ZeroMasters, load_checkpoint_file
from pretrain.config import ModelConfig, RunConfig, config_from_dict, load_config
from pretrain.data.tokenizer import copy_tokenizer
from pretrain.errors import CheckpointError
from pretrain.files import atomic_directory
from pretrain.families import family_of
from pretrain.model import mtp
from pretrain.model.mixtral import MixtralImport
from pretrain.model.hf import (EMBED, LM_HEAD, check_keys, check_same_architecture,
                               expected_hf_keys, model_fields_from_hf_config)
from pretrain.model.form import (canonical_buffers, canonical_parameters, copy_full_weights,
                                 copy_shards, shard_of_rank)
from pretrain.model.mup import parametrization_mismatch
from pretrain.model.llama import (ShardRange, full_parameter_shape, shard_range,
                                  tensor_partition_dim)
from pretrain.model.tensor_parallel import tp_rank, tp_world_size
from pretrain.model.pipeline import pipeline_to_canonical_name

# The client-state entry naming a ZeRO-0 optimizer's parameters, group by group, in its order.
OPTIMIZER_NAMES = "optimizer_parameter_names"
_LAYER_FILE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt$")


@dataclass
class Weights:
    """A model's whole weights, whatever checkpoint they came from."""

    model: ModelConfig
    # Hugging Face names, vocab_size rows, tied head once; safetensors sources are read lazily
    state: Mapping[str, torch.Tensor]
    tokenizer: Path | None  # sentencepiece .model file or Hugging Face tokenizer directory
    source: str  # what was read, for messages
    run_config: RunConfig | None = None  # the training run's config (None for Hugging Face dirs)
    step: int | None = None


def load_weights(src: str | Path) -> Weights:
    """Weights of a run dir (its latest engine checkpoint, else final/), an engine step dir, a
    final/ or `convert-checkpoint --to fp32` dir, an `import-hf` dir, or a Hugging Face dir;
    any of the first four at `s3://...` is read from its node-local copy (`store`)."""
    if storage.is_remote(str(src)):
        src = local_checkpoint(str(src))
    path = Path(src)
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist: pass a run directory, "
                              "a checkpoints/step<N> directory, a final/ directory or a Hugging "
                              "Face model directory")
    if (path / "config.json").is_file():
        return read_hf_dir(path)
    for step_dir in step_dirs(path, follow_latest=True):
        problem = verify(step_dir) if (step_dir / MANIFEST).is_file() else None
        if problem:  # a truncated or missing shard, found from the manifest without reading it
            raise CheckpointError(f"checkpoint {step_dir} is damaged: {problem}")
        return consolidate_engine_checkpoint(step_dir)
    if (path / FINAL / FINAL_WEIGHTS).is_file() or (path / FINAL_WEIGHTS).is_file():
        return load_final(path)
    raise CheckpointError(f"{str(path)!r} holds no checkpoint (no checkpoints/latest, no "
                          f"*_model_states.pt, no {FINAL_WEIGHTS}, no config.json): pass a run "
                          "directory, a step directory, final/ or a Hugging Face directory")


# ---- final/ ------------------------------------------------------------------------------------
def write_final(weights: Weights, out: Path) -> Path:
    """Write `weights` as a final/ directory: model.safetensors in fp32 with Hugging Face names,
    config.yaml (the run's, or one with just the model section), the tokenizer; atomic."""
    shapes = {name: tensor_shape(weights.state, name) for name in weights.state}
    with writing_final(out, shapes=shapes, run_config=weights.run_config or
                       RunConfig(model=weights.model), tokenizer=weights.tokenizer,
                       step=weights.step, source=weights.source) as writer:
        for name in shapes:  # one tensor read at a time
            writer.write(name, weights.state[name])
    return out


@contextlib.contextmanager
def writing_final(out: Path, *, shapes: dict[str, tuple[int, ...]], run_config: RunConfig,
                  tokenizer: Path | None, step: int | None,
                  source: str) -> Iterator[SafetensorsWriter]:
    """The one writer of final/: yields the fp32 model.safetensors writer (`shapes` in the order
    the caller writes them), then adds config.yaml and the tokenizer; the directory appears
    whole (`atomic_directory`) when the block ends without an error."""
    with atomic_directory(out) as tmp:
        with SafetensorsWriter(tmp / FINAL_WEIGHTS, shapes,
                               metadata={"step": str(step), "source": source}) as writer:
            yield writer
        run_config.save(tmp / FINAL_CONFIG)
        if tokenizer is not None:
            copy_tokenizer(tokenizer, tmp)


def load_final(path: str | Path) -> Weights:
    """The weights of a final/ directory, or of a run directory's final/."""
    path = Path(path)
    if (path / FINAL).is_dir():
        path = path / FINAL
    weights = path / FINAL_WEIGHTS
    if not weights.is_file() or not (path / FINAL_CONFIG).is_file():
        raise CheckpointError(f"{str(path)!r} is not a final checkpoint (no {FINAL_WEIGHTS} and "
                              f"{FINAL_CONFIG}): pass <run_dir> or <run_dir>/final of a "
                              "finished run")
    cfg = load_config(path / FINAL_CONFIG)
    state = _lazy_tensors([weights])
    tokenizer = next((p for p in (path / FINAL_TOKENIZER, path / FINAL_TOKENIZER_DIR)
                      if p.exists()), None)
    return Weights(model=cfg.model, state=state, run_config=cfg, source=str(path),
                   tokenizer=tokenizer)


# ---- Hugging Face directories ------------------------------------------------------------------
def read_hf_dir(path: Path) -> Weights:
    """The weights (read lazily), model config and tokenizer of a Hugging Face Llama directory."""
    try:
        hf_config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path / 'config.json'} cannot be read: {exc}") from None
    cfg = ModelConfig(**model_fields_from_hf_config(hf_config, source=str(path)))
    # some tied checkpoints store the head too: it is the embedding
    state = _lazy_tensors([path / f for f in _hf_weight_files(path)],
                          skip=lambda k: k.endswith("rotary_emb.inv_freq")
                          or (cfg.tie_embeddings and k == LM_HEAD) or mtp.is_checkpoint_copy(k))
    if cfg.mtp_depth:  # the multi-token prediction modules whose weights are there
        cfg = dataclasses.replace(cfg, mtp_depth=mtp.depth_present(set(state), cfg))
    if cfg.num_experts:  # Mixtral's stacked experts under our per-expert names
        state = MixtralImport(state, cfg)
    check_shapes(state, cfg, source=str(path))
    tokenizer = path / "tokenizer.model" if (path / "tokenizer.model").is_file() else (
        path if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
        else None)
    return Weights(model=cfg, state=state, tokenizer=tokenizer, source=str(path))


def _hf_weight_files(path: Path) -> list[str]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if (path / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise CheckpointError(f"{path} has no model.safetensors or model.safetensors.index.json: "
                          "save the model with save_pretrained(safe_serialization=True)")


def _lazy_tensors(files: list[Path], **options) -> LazyTensors:
    try:
        return LazyTensors(files, **options)
    except Exception as exc:  # safetensors raises its own error types for damaged files
        raise CheckpointError(f"{', '.join(map(str, files))} cannot be read ({exc}): damaged "
                              "or incomplete") from None


def tensor_shape(state: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    """The shape of `state[name]`, without reading it when `state` is lazy."""
    return tuple(state.shape(name)) if hasattr(state, "shape") else tuple(state[name].shape)


def check_shapes(state: Mapping[str, torch.Tensor], cfg: ModelConfig, *, source: str) -> None:
    """`CheckpointError` unless `state` has exactly the tensors of `cfg`, with their shapes
    (read from the headers when `state` is lazy)."""
    check_keys(set(state), expected_hf_keys(cfg), source)
    for name in state:
        shape = tensor_shape(state, name)
        if shape != full_parameter_shape(name, cfg):
            raise CheckpointError(f"{source}: {name} has shape {shape} but its "
                                  f"config gives {full_parameter_shape(name, cfg)}")


# ---- engine checkpoints ------------------------------------------------------------------------
def consolidate_engine_checkpoint(step_dir: Path) -> Weights:
    """The whole model of a DeepSpeed engine checkpoint, in fp32 (see the module docstring)."""
    meta, run_cfg = _engine_checkpoint_config(step_dir)
    tokenizer = _engine_tokenizer(meta.get("tokenizer") or {}, step_dir=step_dir, cfg=run_cfg)
    return Weights(model=run_cfg.model, state=engine_tensors(step_dir), tokenizer=tokenizer,
                   source=str(step_dir), run_config=run_cfg, step=meta.get("step"))


def _engine_checkpoint_config(step_dir: Path) -> tuple[dict, RunConfig]:
    """(the first model-states file's contents, memory-mapped; the run config it holds)."""
    if is_fsdp2_checkpoint(step_dir):  # rank 0's file carries the run's client state
        meta = fsdp2_client_state(step_dir)
        return meta, config_from_dict(meta["config"])
    model_files = sorted(step_dir.glob("*mp_rank_*_model_states.pt"))
    if not model_files:
        raise CheckpointError(f"{str(step_dir)!r} holds no *_model_states.pt files: not a "
                              "DeepSpeed checkpoint of `pretrain train`")
    meta = load_checkpoint_file(model_files[0])
    if "config" not in meta:
        raise CheckpointError(f"{str(model_files[0])!r} holds no run config (client_state "
                              "'config'): it was not written by `pretrain train`")
    return meta, config_from_dict(meta["config"])


def engine_tensors(step_dir: Path, key: str | None = None) -> "MergedShards":
    """{Hugging Face name: whole fp32 tensor} of an engine checkpoint, read lazily: the fp32
    master weights (`key` None), or the optimizer state `key` ("exp_avg", "exp_avg_sq") of each
    parameter, whatever the layout that saved it (and whichever engine: `fsdp2_state`)."""
    meta, run_cfg = _engine_checkpoint_config(step_dir)
    buffers = family_of(run_cfg.model).buffers if run_cfg.model.num_experts else ()
    fsdp2 = is_fsdp2_checkpoint(step_dir)
    if buffers and fsdp2 and not carries_buffers(step_dir):  # written before fsdp2 saved them
        raise CheckpointError(
            f"{step_dir}: a {run_cfg.model.family} checkpoint with experts carries buffers "
            f"({', '.join(buffers)}) that this fsdp2 checkpoint does not hold: resume it on the "
            "layout that saved it, or export its run's final/")
    if fsdp2:  # rows of each tensor rank's shard, in every rank's file; the buffers whole
        shards = fsdp2_shards(step_dir, key)
        return MergedShards(shards, cfg=run_cfg.model, tp=run_cfg.parallel.tensor,
                            source=str(step_dir) if key is None else f"{step_dir} ({key})",
                            whole_experts=whole_experts(run_cfg.parallel))
    cfg, tp, pp = run_cfg.model, run_cfg.parallel.tensor, run_cfg.parallel.pipeline
    zero = int(meta.get("ds_config", {}).get("zero_optimization", {}).get("stage", 0))
    if meta.get("mp_world_size", tp * pp) != tp * pp:
        raise CheckpointError(f"{step_dir}: mp_world_size {meta['mp_world_size']} differs from "
                              f"parallel.tensor x parallel.pipeline = {tp} x {pp} of its config")
    # name -> {tp rank: (the mp rank's tensors, local name)}; nothing is read yet
    shards: dict[str, dict[int, tuple[Mapping[str, torch.Tensor], str]]] = {}
    for mp_rank in range(tp * pp):
        tp_index = mp_rank % tp
        if zero >= 1:
            # each replica of the shard (data x context) wrote one optimizer file
            replicas = len(list(step_dir.glob(f"*mp_rank_{mp_rank:02d}_optim_states.pt")))
            local = ZeroMasters(step_dir, mp_rank=mp_rank, key=key,
                                experts=expert_files(run_cfg, mp_rank=mp_rank, replicas=replicas))
        else:
            local = _zero0_optimizer_tensors(step_dir, mp_rank=mp_rank, key=key,
                                             pipelined=pp > 1)
            if local is None and pp > 1:  # fp32: the masters are the module's weights
                if mp_rank >= tp:  # layer files of every stage: read with the first stage's ranks
                    continue
                local = _pipeline_layer_weights(step_dir, tp_rank=tp_index)
            elif local is None:
                local = load_checkpoint_file(
                    step_dir / f"mp_rank_{mp_rank:02d}_model_states.pt")["module"]
        for name in local:
            canonical = _canonical(name, cfg=cfg, pipelined=pp > 1)
            if canonical is not None:  # a tied weight is on two stages: both copies are equal
                shards.setdefault(canonical, {}).setdefault(tp_index, (local, name))
    if buffers:  # (the expert bias) in the module states only, whole and the same on every
        # rank: the first tensor rank's, for every key (a buffer has no optimizer state; it is
        # listed with the parameters so that every name is there)
        module = (_pipeline_layer_weights(step_dir, tp_rank=0) if pp > 1 else
                  load_checkpoint_file(step_dir / "mp_rank_00_model_states.pt")["module"])
        for name in module:
            canonical = _canonical(name, cfg=cfg, pipelined=pp > 1)
            if canonical is not None and name.rsplit(".", 1)[-1] in buffers:
                shards[canonical] = {tp_index: (module, name) for tp_index in range(tp)}
    what = str(step_dir) if key is None else f"{step_dir} ({key})"
    return MergedShards(shards, cfg=cfg, tp=tp, source=what,
                        whole_experts=whole_experts(run_cfg.parallel))


def whole_experts(parallel) -> bool:
    """Whether a run's experts are whole on one rank each (expert parallelism with
    parallel.expert_tensor 1), not split over the tensor ranks like the dense MLP."""
    return parallel.expert > 1 and parallel.expert_tensor in (0, 1)


def expert_files(run_cfg: RunConfig, *, mp_rank: int, replicas: int) -> ExpertFiles | None:
    """Where the optimizer files of model-parallel rank `mp_rank` of a checkpoint saved on the
    expert grid keep the experts (None: the experts, if any, are the data ranks' alike): each
    file (data-parallel rank d, DeepSpeed's order of the stage's replicas) is global rank
    `data_groups()[mp_rank][d]`, whose place in the grid (`Topology.expert_coords`) says which
    experts it holds. Rank d = 0 wrote the model states, whose `param_shapes` name its experts."""
    from pretrain.resolve.run import saved_topology

    p = run_cfg.parallel
    if p.expert == 1 or (p.expert == p.tensor and p.expert_tensor in (0, 1)):
        return None
    topology = saved_topology(run_cfg, world_size=p.tensor * p.pipeline * replicas)
    coords = [topology.expert_coords(rank) for rank in topology.data_groups()[mp_rank]]
    local = run_cfg.model.num_experts // p.expert
    return ExpertFiles(expert=tuple((etp, ep) for etp, ep, _ in coords),
                       position=tuple(edp for _, _, edp in coords),
                       shift=tuple((ep - coords[0][1]) * local for _, ep, _ in coords))


def _zero0_optimizer_tensors(step_dir: Path, *, mp_rank: int, key: str | None,
                             pipelined: bool) -> dict[str, torch.Tensor] | None:
    """{module parameter name: tensor} from a ZeRO-0 optimizer's state: its fp32 masters (`key`
    None; None when the optimizer keeps none, in fp32 training, where the module's weights are
    the masters) or its per-parameter state `key`. Parameters are named by the optimizer's order
    of them, saved as OPTIMIZER_NAMES; checkpoints saved without it name a flat model's by the
    grouping `pretrain.training.engine.param_groups` makes (matrices, then vectors, in module order)."""
    state = load_checkpoint_file(step_dir / f"mp_rank_{mp_rank:02d}_model_states.pt")
    optimizer = state.get("optimizer")
    if key is None and "fp32_groups" not in (optimizer or {}):
        return None
    if not optimizer:
        raise CheckpointError(f"{step_dir}: mp rank {mp_rank} saved no optimizer state")
    names = state.get(OPTIMIZER_NAMES)
    if names is None and not pipelined:
        module = state["module"]
        names = [[n for n, t in module.items() if t.dim() >= 2],
                 [n for n, t in module.items() if t.dim() < 2]]
    if names is None:
        raise CheckpointError(f"{step_dir} (a ZeRO-0 pipeline checkpoint) does not name its "
                              "optimizer's parameters (saved by an older version): resume it on "
                              "its own layout")
    flat = [name for group in names for name in group]
    if key is None:  # bf16 at ZeRO-0: the fp32 masters, group by group
        tensors = [t for group in optimizer["fp32_groups"] for t in group]
    else:
        per_param = optimizer.get("optimizer_state_dict", optimizer)["state"]
        if len(per_param) != len(flat) or not any(key in per_param[i] for i in per_param):
            raise CheckpointError(f"{step_dir}: mp rank {mp_rank}'s optimizer holds no {key!r} "
                                  f"for its {len(flat)} parameters")
        # train.optimizer=muon: Muon's matrices hold its momentum, the rest Adam's moments
        return {name: per_param[i][key] for i, name in enumerate(flat) if key in per_param[i]}
    if len(tensors) != len(flat):
        raise CheckpointError(f"{step_dir}: {len(tensors)} optimizer tensors for {len(flat)} "
                              "named parameters: the checkpoint is inconsistent")
    return dict(zip(flat, tensors))


def _canonical(name: str, *, cfg: ModelConfig, pipelined: bool) -> str | None:
    """Hugging Face name of a module parameter; None for buffers and the tied head's alias."""
    if pipelined:
        try:
            name = pipeline_to_canonical_name(name, num_layers=cfg.num_layers)
        except KeyError:
            return None
        if cfg.tie_embeddings and name == LM_HEAD:
            return EMBED  # the head stage's copy of the tied embedding
    return name if name in expected_hf_keys(cfg) else None


def _pipeline_layer_weights(step_dir: Path, *, tp_rank: int) -> dict[str, torch.Tensor]:
    """{pipeline name: tensor} of every layer file of one tensor-parallel rank (ZeRO-0)."""
    weights = {}
    for file in sorted(step_dir.glob("layer_*-model_*-model_states.pt")):
        index, rank = map(int, _LAYER_FILE.search(file.name).groups())
        if rank == tp_rank:
            weights.update({f"{index}.{k}": v for k, v in load_checkpoint_file(file).items()})
    return weights


class MergedShards(Mapping):
    """{Hugging Face name: whole fp32 tensor} over the model-parallel ranks of an engine
    checkpoint: an item is read (from every tensor-parallel rank's source), concatenated along
    `tensor_partition_dim`, stripped of padded vocabulary rows, when asked for, so a reader
    going tensor by tensor holds one whole tensor at a time. No lm_head when tied.

    `whole_experts` (saved with parallel.expert > 1): each expert is whole on the one
    tensor-parallel rank that held it, under its global name."""

    def __init__(self, shards: dict[str, dict[int, tuple[Mapping[str, torch.Tensor], str]]], *,
                 cfg: ModelConfig, tp: int, source: str, whole_experts: bool = False) -> None:
        check_keys(set(shards), expected_hf_keys(cfg), f"checkpoint {source}")
        self._whole = {name for name in shards if whole_experts and ".mlp.experts." in name}
        for name, by_rank in shards.items():
            if name in self._whole:
                if len(by_rank) != 1:
                    raise CheckpointError(f"{source}: expert {name} is held by tensor-parallel "
                                          f"ranks {sorted(by_rank)}; expected one")
                continue
            if sorted(by_rank) != list(range(tp)):
                raise CheckpointError(f"{source}: {name} has tensor-parallel shards "
                                      f"{sorted(by_rank)} of {tp}: a rank's files are missing")
        self._shards, self._cfg, self._tp = shards, cfg, tp
        self.bytes_read = 0  # by read_box

    def _split_dim(self, name: str) -> int | None:
        """The dimension `name` is split along over the saved ranks (None: one holds it whole)."""
        return None if name in self._whole or self._tp == 1 else tensor_partition_dim(name)

    def _holder(self, name: str) -> tuple[Mapping[str, torch.Tensor], str]:
        """(tensors, local name) of a rank holding `name` whole (the first, when replicated)."""
        by_rank = self._shards[name]
        return by_rank[min(by_rank)]

    def __getitem__(self, name: str) -> torch.Tensor:
        dim = self._split_dim(name)
        if dim is None:
            source, local = self._holder(name)
            tensor = materialize(source[local])
        else:  # each shard copied into its place as it is read: the whole tensor and one shard
            shape = list(full_parameter_shape(name, self._cfg))
            shape[dim] = shard_range(name, self._cfg, tp_rank=0, tp_size=self._tp).shape[dim] \
                * self._tp  # padded vocabulary rows included
            tensor, filled = torch.empty(shape), 0
            for rank in range(self._tp):
                source, local = self._shards[name][rank]
                shard = materialize(source[local])
                tensor.narrow(dim, filled, shard.shape[dim]).copy_(shard)
                filled += shard.shape[dim]
                del shard
        if name in (EMBED, LM_HEAD):
            tensor = tensor[:self._cfg.vocab_size]
        return tensor.float().contiguous()

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._shards:
            raise KeyError(name)
        return full_parameter_shape(name, self._cfg)

    def read_box(self, name: str, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """The block [start, stop) along each dimension of the whole (unpadded) tensor `name`,
        in fp32, read from the shards that hold it and, within a shard, only its elements (the
        ZeRO partitions through `ZeroMasters.read_runs`; other files are memory-mapped, so a
        slice reads its pages). `bytes_read` counts the tensor bytes copied out."""
        dim = self._split_dim(name)
        if dim is None:
            blocks = [(self._holder(name), box)]
        else:
            size = shard_range(name, self._cfg, tp_rank=0, tp_size=self._tp).shape[dim]
            blocks = []
            for rank in range(self._tp):
                lo, hi = max(box[dim][0], rank * size), min(box[dim][1], (rank + 1) * size)
                if lo < hi:
                    local = list(box)
                    local[dim] = (lo - rank * size, hi - rank * size)
                    blocks.append((self._shards[name][rank], tuple(local)))
        parts = [_read_block(source, local, block) for (source, local), block in blocks]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
        self.bytes_read += out.numel() * out.element_size()
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self._shards)

    def __len__(self) -> int:
        return len(self._shards)


def _read_block(source: Mapping[str, torch.Tensor], local: str,
                block: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """`block` of tensor `local` of one shard's `source`, fp32, reading only its elements."""
    shape = tuple(hi - lo for lo, hi in block)
    if isinstance(source, ZeroMasters):
        full = source.shape(local)
        (r0, r1), cols = block[0], block[1:]
        if not cols or cols[0] == (0, full[1]):  # whole rows: one run
            width = math.prod(full[1:])
            runs = [(r0 * width, r1 * width)]
        else:
            (c0, c1), width = cols[0], full[1]
            runs = [(r * width + c0, r * width + c1) for r in range(r0, r1)]
        return source.read_runs(local, runs).view(shape)
    tensor = source[local]  # memory-mapped (or in the store): only the block's bytes are read
    return materialize(tensor[tuple(slice(lo, hi) for lo, hi in block)]).float().clone()


def _engine_tokenizer(info: dict, *, step_dir: Path, cfg: RunConfig) -> Path | None:
    """The run's tokenizer: as recorded in the checkpoint, else final/'s copy, else the config's."""
    final = step_dir.parent.parent / FINAL
    for candidate in (info.get("path"), final / FINAL_TOKENIZER, final / FINAL_TOKENIZER_DIR,
                      cfg.data.tokenizer):
        if candidate and Path(candidate).exists():
            return Path(candidate)
    return None


# ---- initial weights of a run ------------------------------------------------------------------
@torch.no_grad()
def load_initial_weights(model: torch.nn.Module, *, cfg: ModelConfig, tp_group=None) -> str:
    """Copy the weights of `cfg.init_from` into this rank's part of `model` (a `LlamaModel` or
    a pipeline stage) before DeepSpeed wraps it, after checking the architecture fits the run's
    config; returns the source read. From a safetensors source (final/, a Hugging Face
    directory) each rank reads only its tensor-parallel shard of each tensor; an engine
    checkpoint is consolidated first."""
    weights = load_weights(cfg.init_from)
    check_same_architecture(weights.model, cfg, source=weights.source)
    problem = parametrization_mismatch(weights.model, cfg)
    if problem:
        raise CheckpointError(f"model.init_from={cfg.init_from}: {problem}; set "
                              "model.parametrization (and model.mup_base_*) to the weights' values")
    check_shapes(weights.state, cfg, source=weights.source)
    if isinstance(weights.state, LazyTensors):  # read only this rank's rows or columns
        tp_size, rank = tp_world_size(tp_group), tp_rank(tp_group)
        params = dict(canonical_parameters(model, cfg))  # an expert-parallel expert is whole
        copy_shards(model, cfg, lambda name: _read_shard(weights.state, name, shard_range(
            name, cfg, **shard_of_rank(params[name], tp_rank=rank, tp_size=tp_size))))
        for name, buffer in canonical_buffers(model, cfg):  # whole (the expert bias)
            buffer.copy_(weights.state[name])
    else:
        copy_full_weights(model, cfg, lambda name: weights.state[name].float(),
                          tp_group=tp_group)
    return weights.source


def _read_shard(state: LazyTensors, name: str, part: ShardRange) -> torch.Tensor:
    """A tensor-parallel shard read from its file (padded vocabulary rows zero)."""
    out = torch.zeros(part.shape)
    if part.real_stop > part.start:
        out.narrow(part.dim, 0, part.real_stop - part.start).copy_(
            state.slice(name, dim=part.dim, start=part.start, stop=part.real_stop))
    return out
