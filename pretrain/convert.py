"""`pretrain convert-checkpoint`: one consolidated fp32 state dict from any checkpoint layout.

Weights are read offline, with no process group, so a checkpoint trained on hundreds of ranks
converts on one CPU machine. From a DeepSpeed engine checkpoint (`run_dir/checkpoints/step<N>/`):

- each model-parallel rank's weights come from DeepSpeed's own readers: at ZeRO >= 1 the fp32
  master weights of the optimizer shards (`deepspeed.utils.zero_to_fp32`, run once per
  model-parallel rank over its data-parallel shards; for bf16 training these are the exact fp32
  masters, not the bf16 copies the module computes with), at ZeRO-0 the module weights of
  `mp_rank_XX_model_states.pt` or of the pipeline's `layer_XX-model_YY-model_states.pt` files,
- pipeline parameter names ("3.mlp.up_proj.weight", "tied_modules.embed...") become Hugging Face
  names through `pipeline_to_canonical_name`; a model-parallel rank is stage * tp + tp_rank
  (DeepSpeed's model-parallel group, pipeline-major),
- tensor-parallel shards are concatenated along `tensor_partition_dim`, padded vocabulary rows
  dropped, and a tied lm_head stored once, as Hugging Face does.

`load_weights` is the one reader of every kind of checkpoint (engine step dir, run dir, final/,
`convert-checkpoint` output, Hugging Face directory); `export-hf`, `generate` and
`model.init_from` use it. `--to universal` wraps `pretrain.checkpoint.to_universal` (DeepSpeed's
universal checkpoint, for resuming on another layout).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from pretrain.config import ModelConfig, RunConfig, config_from_dict
from pretrain.errors import CheckpointError

_LAYER_FILE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt$")


@dataclass
class Weights:
    """A model's whole weights, whatever checkpoint they came from."""

    model: ModelConfig
    state: dict[str, torch.Tensor]  # Hugging Face state dict: vocab_size rows, tied head once
    tokenizer: Path | None  # sentencepiece .model file or Hugging Face tokenizer directory
    source: str  # what was read, for messages
    run_config: RunConfig | None = None  # the training run's config (None for Hugging Face dirs)
    step: int | None = None


def load_weights(src: str | Path) -> Weights:
    """Weights of a run dir (its latest engine checkpoint, else final/), an engine step dir, a
    final/ or `convert-checkpoint --to fp32` dir, an `import-hf` dir, or a Hugging Face dir."""
    from pretrain.checkpoint import FINAL_WEIGHTS

    path = Path(src)
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist: pass a run directory, "
                              "a checkpoints/step<N> directory, a final/ directory or a Hugging "
                              "Face model directory")
    if (path / "config.json").is_file():
        from pretrain.interop import read_hf_dir

        return read_hf_dir(path)
    step_dir = engine_step_dir(path)
    if step_dir is not None:
        from pretrain.checkpoint import MANIFEST, verify

        problem = verify(step_dir) if (step_dir / MANIFEST).is_file() else None
        if problem:  # a truncated or missing shard, found from the manifest without reading it
            raise CheckpointError(f"checkpoint {step_dir} is damaged: {problem}")
        return consolidate_engine_checkpoint(step_dir)
    if (path / "final" / FINAL_WEIGHTS).is_file() or (path / FINAL_WEIGHTS).is_file():
        return _load_final_dir(path)
    raise CheckpointError(f"{str(path)!r} holds no checkpoint (no checkpoints/latest, no "
                          f"*_model_states.pt, no {FINAL_WEIGHTS}, no config.json): pass a run "
                          "directory, a step directory, final/ or a Hugging Face directory")


def _load_final_dir(path: Path) -> Weights:
    from pretrain.checkpoint import load_final

    cfg, state, tokenizer = load_final(path)
    if not tokenizer.exists() and (tokenizer.parent / "tokenizer").is_dir():
        tokenizer = tokenizer.parent / "tokenizer"  # `import-hf` of a non-sentencepiece tokenizer
    return Weights(model=cfg.model, state=state, run_config=cfg, source=str(path),
                   tokenizer=tokenizer if tokenizer.exists() else None)


def engine_step_dir(path: Path) -> Path | None:
    """The engine checkpoint directory that `path` names: itself, or the tag named by `latest`
    in `path/checkpoints` or `path`; None when it names none."""
    if any(path.glob("*mp_rank_*_model_states.pt")):
        return path
    for ckpt_dir in (path / "checkpoints", path):
        latest = ckpt_dir / "latest"
        if latest.is_file():
            step = ckpt_dir / latest.read_text().strip()
            if not step.is_dir():
                raise CheckpointError(f"{latest} names {step.name!r}, which does not exist: "
                                      "pass a checkpoints/step<N> directory instead")
            return step
    return None


def _torch_load(path: Path) -> dict:
    try:  # DeepSpeed's files hold config dicts and numpy values: not weights_only-loadable
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # truncated or foreign files raise many different types
        raise CheckpointError(f"{str(path)!r} cannot be read ({type(exc).__name__}: "
                              f"{str(exc)[:200]}): the checkpoint is damaged or incomplete") from None


def consolidate_engine_checkpoint(step_dir: Path) -> Weights:
    """The whole model of a DeepSpeed engine checkpoint, in fp32 (see the module docstring)."""
    model_files = sorted(step_dir.glob("*mp_rank_*_model_states.pt"))
    if not model_files:
        raise CheckpointError(f"{str(step_dir)!r} holds no *_model_states.pt files: not a "
                              "DeepSpeed checkpoint of `pretrain train`")
    meta = _torch_load(model_files[0])
    if "config" not in meta:
        raise CheckpointError(f"{str(model_files[0])!r} holds no run config (client_state "
                              "'config'): it was not written by `pretrain train`")
    run_cfg = config_from_dict(meta["config"])
    cfg, tp, pp = run_cfg.model, run_cfg.parallel.tensor, run_cfg.parallel.pipeline
    zero = int(meta.get("ds_config", {}).get("zero_optimization", {}).get("stage", 0))
    if meta.get("mp_world_size", tp * pp) != tp * pp:
        raise CheckpointError(f"{step_dir}: mp_world_size {meta['mp_world_size']} differs from "
                              f"parallel.tensor x parallel.pipeline = {tp} x {pp} of its config")
    shards: dict[str, dict[int, torch.Tensor]] = {}  # name -> {tp rank: shard}
    for mp_rank in range(tp * pp):
        tp_rank = mp_rank % tp
        if zero >= 1:
            local = _zero_fp32_weights(step_dir, mp_rank=mp_rank, zero=zero)
        elif pp > 1:
            if mp_rank >= tp:  # layer files of every stage are read with the first stage's ranks
                continue
            local = _pipeline_layer_weights(step_dir, tp_rank=tp_rank)
        else:
            local = _torch_load(step_dir / f"mp_rank_{mp_rank:02d}_model_states.pt")["module"]
        for name, tensor in local.items():
            canonical = _canonical(name, cfg=cfg, pipelined=pp > 1)
            if canonical is not None:  # a tied weight is on two stages: both copies are equal
                shards.setdefault(canonical, {}).setdefault(tp_rank, tensor)
    state = _merge_tensor_parallel(shards, cfg=cfg, tp=tp, source=str(step_dir))
    tokenizer = _engine_tokenizer(meta.get("tokenizer") or {}, step_dir=step_dir, cfg=run_cfg)
    return Weights(model=cfg, state=state, tokenizer=tokenizer, source=str(step_dir),
                   run_config=run_cfg, step=meta.get("step"))


def _canonical(name: str, *, cfg: ModelConfig, pipelined: bool) -> str | None:
    """Hugging Face name of a module parameter; None for buffers and the tied head's alias."""
    from pretrain.model.hf import LM_HEAD, expected_hf_keys
    from pretrain.model.pipeline import pipeline_to_canonical_name

    if pipelined:
        try:
            name = pipeline_to_canonical_name(name, num_layers=cfg.num_layers)
        except KeyError:
            return None
        if cfg.tie_embeddings and name == LM_HEAD:
            return "model.embed_tokens.weight"  # the head stage's copy of the tied embedding
    return name if name in expected_hf_keys(cfg) else None


def _zero_fp32_weights(step_dir: Path, *, mp_rank: int, zero: int) -> dict[str, torch.Tensor]:
    """fp32 master weights of one model-parallel rank, merged over its data-parallel shards by
    DeepSpeed's zero_to_fp32 (which reads only the files given to it)."""
    from deepspeed.utils import zero_to_fp32 as z

    tag = f"mp_rank_{mp_rank:02d}"
    model_files = sorted(step_dir.glob(f"*{tag}_model_states.pt"), key=lambda p: z.natural_keys(p.name))
    optim_files = sorted(step_dir.glob(f"*{tag}_optim_states.pt"), key=lambda p: z.natural_keys(p.name))
    if not model_files or not optim_files:
        raise CheckpointError(f"{step_dir} lacks the {tag} model or optimizer states of a "
                              f"ZeRO-{zero} checkpoint: a rank's files are missing")
    model_states = []
    for file in model_files:
        sd = _torch_load(file)
        # pipeline stages save module=None (their weights are in layer files): no buffers here
        model_states.append(z.zero_model_state(
            buffers={}, param_shapes=sd["param_shapes"], shared_params=[],
            ds_version=sd.get("ds_version"), frozen_param_shapes=sd.get("frozen_param_shapes"),
            frozen_param_fragments=sd.get("frozen_param_fragments")))
    quiet = io.StringIO()  # zero_to_fp32 prints and draws progress bars for every file
    with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        try:
            stage, world, flat_groups, paddings = z.parse_optim_states(
                [str(f) for f in optim_files], str(step_dir))
        except ValueError as exc:
            raise CheckpointError(f"{step_dir} ({tag}): {exc}") from None
        if stage <= 2:
            state = z._get_fp32_state_dict_from_zero2_checkpoint(
                world, flat_groups, model_states, False, paddings)
        else:
            state = z._get_fp32_state_dict_from_zero3_checkpoint(
                world, flat_groups, model_states, False)
    return {k: v.float() for k, v in z.to_torch_tensor(state).items()}


def _pipeline_layer_weights(step_dir: Path, *, tp_rank: int) -> dict[str, torch.Tensor]:
    """{pipeline name: tensor} of every layer file of one tensor-parallel rank (ZeRO-0)."""
    weights = {}
    for file in sorted(step_dir.glob("layer_*-model_*-model_states.pt")):
        index, rank = map(int, _LAYER_FILE.search(file.name).groups())
        if rank == tp_rank:
            weights.update({f"{index}.{k}": v.float() for k, v in _torch_load(file).items()})
    return weights


def _merge_tensor_parallel(shards: dict[str, dict[int, torch.Tensor]], *, cfg: ModelConfig,
                           tp: int, source: str) -> dict[str, torch.Tensor]:
    """Whole tensors with Hugging Face names and vocab_size rows (no lm_head when tied)."""
    from pretrain.model.hf import check_keys, expected_hf_keys
    from pretrain.model.llama import tensor_partition_dim

    check_keys(set(shards), expected_hf_keys(cfg), f"checkpoint {source}")
    state = {}
    for name, by_rank in shards.items():
        if sorted(by_rank) != list(range(tp)):
            raise CheckpointError(f"{source}: {name} has tensor-parallel shards {sorted(by_rank)} "
                                  f"of {tp}: a rank's files are missing")
        dim = tensor_partition_dim(name)
        tensor = by_rank[0] if dim is None else torch.cat([by_rank[r] for r in range(tp)], dim)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            tensor = tensor[:cfg.vocab_size]
        state[name] = tensor.float().contiguous()
    return state


def _engine_tokenizer(info: dict, *, step_dir: Path, cfg: RunConfig) -> Path | None:
    """The run's tokenizer: as recorded in the checkpoint, else final/'s copy, else the config's."""
    run_dir = step_dir.parent.parent
    for candidate in (info.get("path"), run_dir / "final" / "tokenizer.model",
                      run_dir / "final" / "tokenizer", cfg.data.tokenizer):
        if candidate and Path(candidate).exists():
            return Path(candidate)
    return None


# The files of a Hugging Face tokenizer (a model directory also holds weights: not these).
_TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*",
                    "merges.txt", "chat_template*")


def copy_tokenizer(src_dir: Path, dst_dir: Path) -> None:
    """Copy the tokenizer files of a Hugging Face directory into `dst_dir`."""
    dst_dir.mkdir(parents=True, exist_ok=True)
    for pattern in _TOKENIZER_FILES:
        for file in src_dir.glob(pattern):
            if file.is_file():
                shutil.copyfile(file, dst_dir / file.name)


def write_weights_dir(weights: Weights, out: Path) -> Path:
    """Write `weights` as a final/-format directory (model.safetensors in fp32 with Hugging Face
    names, config.yaml, the tokenizer); atomic: readers never see a half-written directory."""
    from safetensors.torch import save_file

    from pretrain.checkpoint import FINAL_WEIGHTS

    cfg = weights.run_config or RunConfig(model=weights.model)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent.resolve()))
    try:
        tensors = {k: v.float().contiguous() for k, v in weights.state.items()}
        save_file(tensors, str(tmp / FINAL_WEIGHTS),
                  metadata={"step": str(weights.step), "source": weights.source})
        cfg.save(tmp / "config.yaml")
        if weights.tokenizer is not None and weights.tokenizer.is_dir():
            copy_tokenizer(weights.tokenizer, tmp / "tokenizer")
        elif weights.tokenizer is not None:
            shutil.copyfile(weights.tokenizer, tmp / "tokenizer.model")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="a run directory, a checkpoints/step<N> directory or final/")
    parser.add_argument("--to", choices=["fp32", "universal"], required=True,
                        help="fp32: one consolidated state dict (safetensors, Hugging Face names); "
                             "universal: DeepSpeed's universal checkpoint, to resume on another "
                             "layout")
    parser.add_argument("--output", required=True, help="directory to write")


def run(args: argparse.Namespace) -> None:
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.to == "universal":
        from pretrain.checkpoint import to_universal  # issue 5's converter

        step_dir = to_universal(Path(args.src), out)  # ZeRO >= 1 checkpoints only (DeepSpeed)
        print(f"[convert] universal checkpoint in {step_dir}; resume with --resume-from {out}")
        return
    weights = load_weights(args.src)
    write_weights_dir(weights, out)
    n = sum(t.numel() for t in weights.state.values())
    print(f"[convert] {n / 1e6:.2f}M fp32 parameters from {weights.source} -> {out}")
