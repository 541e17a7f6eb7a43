"""Hugging Face interop: `pretrain export-hf`, `pretrain import-hf`, and a run's initial weights.

- export-hf: any checkpoint `convert.load_weights` reads (run dir, step dir of any layout,
  final/) -> a `LlamaForCausalLM` directory: config.json, safetensors (sharded with
  model.safetensors.index.json past --max-shard-size), and the tokenizer as a `tokenizers` BPE
  (or Unigram) built from the sentencepiece model, so `AutoTokenizer` loads it offline. The
  tokenizer is converted here rather than by transformers' Llama converter because ours has
  no dummy prefix, no normalisation and split digits (the Llama converter assumes Llama's own
  settings and gives other ids); the export checks that both encode sample texts identically.
- import-hf: a local Hugging Face Llama directory (GQA, tied or untied) -> a final/-format
  directory (fp32 model.safetensors, config.yaml with the model section, tokenizer) that a
  run starts from with `model.init_from=DIR`; `generate` reads it too.
- `load_initial_weights`: copies whole weights into any layout's module before DeepSpeed
  wraps it (each tensor-parallel rank takes its `shard_of`, each pipeline stage its layers),
  after checking the architecture fits the run's config.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from pretrain.config import ModelConfig, RunConfig
from pretrain.convert import Weights, copy_tokenizer, load_weights, write_weights_dir
from pretrain.errors import CheckpointError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Encoded by both tokenizers after conversion: code, indentation, digits, a newline run, bytes.
_TOKENIZER_PROBES = ("def f(x):\n    return x  # 12345\n\n\tü 😀 é", "hello world", " a  b   c\n")


# ---- tokenizer ---------------------------------------------------------------------------------

def sentencepiece_to_hf(model_path: Path) -> "transformers.PreTrainedTokenizerFast":  # noqa: F821
    """A fast tokenizer that encodes exactly as the sentencepiece model at `model_path`."""
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import generate_merges

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(model_path).read_bytes())
    spec, norm = proto.trainer_spec, proto.normalizer_spec
    if norm.name not in ("identity", "") or norm.remove_extra_whitespaces \
            or spec.treat_whitespace_as_suffix:
        raise CheckpointError(f"{model_path}: sentencepiece normalisation {norm.name!r} (remove_"
                              f"extra_whitespaces={norm.remove_extra_whitespaces}) cannot be "
                              "converted exactly; train the tokenizer with `pretrain tokenizer`")
    pieces = [(p.piece, p.score) for p in proto.pieces]
    unk = pieces[spec.unk_id][0]
    if spec.model_type == 1:  # unigram
        model = models.Unigram(pieces, unk_id=spec.unk_id, byte_fallback=spec.byte_fallback)
    else:
        vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
        merges = generate_merges(vocab, dict(pieces))  # merge order = sentencepiece's scores
        model = models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                           byte_fallback=spec.byte_fallback)
    tok = Tokenizer(model)
    steps = [normalizers.Prepend("▁")] if norm.add_dummy_prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    if spec.split_digits:
        tok.pre_tokenizer = pre_tokenizers.Digits(individual_digits=True)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if norm.add_dummy_prefix else []))
    # user-defined symbols (type 4, e.g. "\n") are plain added tokens; control ones special
    tok.add_tokens([AddedToken(p.piece, normalized=False, special=False)
                    for p in proto.pieces if p.type == 4])
    tok.add_special_tokens([AddedToken(p.piece, normalized=False, special=True)
                            for p in proto.pieces if p.type in (2, 3)])

    def piece(index: int) -> str | None:
        return pieces[index][0] if 0 <= index < len(pieces) else None

    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=unk,
                                   bos_token=piece(spec.bos_id), eos_token=piece(spec.eos_id))


def check_tokenizer_round_trip(ours, theirs, *, texts=_TOKENIZER_PROBES) -> None:
    """`CheckpointError` unless the Hugging Face tokenizer gives our ids for every text."""
    for text in texts:
        a, b = ours.encode(text), theirs(text, add_special_tokens=False)["input_ids"]
        if a != b:
            raise CheckpointError(f"the converted tokenizer encodes {text[:30]!r} as {b[:12]}..., "
                                  f"ours as {a[:12]}...: this tokenizer cannot be exported exactly")


# ---- export ------------------------------------------------------------------------------------

def export_hf(weights: Weights, out: Path, *, dtype: str = "bf16",
              max_shard_size: str = "5GB") -> Path:
    """Write a `LlamaForCausalLM` directory (see the module docstring); atomic."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    from pretrain.data import Tokenizer
    from pretrain.model.hf import to_hf_config

    if weights.tokenizer is None:
        raise CheckpointError(f"no tokenizer found for {weights.source}: pass --tokenizer "
                              "with the run's sentencepiece .model file")
    ours = Tokenizer.load(weights.tokenizer)
    state = {k: v.to(DTYPES[dtype]).contiguous() for k, v in weights.state.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent.resolve()))
    try:
        split = split_torch_state_dict_into_shards(
            state, max_shard_size=max_shard_size, filename_pattern="model{suffix}.safetensors")
        for filename, names in split.filename_to_tensors.items():
            save_file({n: state[n] for n in names}, str(tmp / filename), metadata={"format": "pt"})
        if split.is_sharded:
            index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        ids = {k: (v if v >= 0 else None) for k, v in
               (("bos_token_id", ours.bos_id), ("eos_token_id", ours.eos_id))}
        config = to_hf_config(weights.model, architectures=["LlamaForCausalLM"],
                              dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype], **ids)
        config.save_pretrained(tmp)
        if weights.tokenizer.is_dir():
            copy_tokenizer(weights.tokenizer, tmp)
        else:
            theirs = sentencepiece_to_hf(weights.tokenizer)
            check_tokenizer_round_trip(ours, theirs)
            if type(theirs.backend_tokenizer.model).__name__ == "Unigram":
                # measured: 4 of 60 stdlib files differ, in the order of equal-score pieces
                # of long whitespace runs (Viterbi ties); BPE models convert exactly
                print("[export-hf] note: a unigram tokenizer converts with rare differences "
                      "in tie-breaking between equally likely segmentations")
            theirs.save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="a run directory, a checkpoints/step<N> directory of any "
                                    "layout, or a final/ directory")
    parser.add_argument("--output", required=True, help="the Hugging Face directory to write")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="largest safetensors file (default %(default)s); larger models "
                             "are sharded with model.safetensors.index.json")
    parser.add_argument("--tokenizer", default=None,
                        help="the run's sentencepiece .model, if the checkpoint's has moved")


def run_export(args: argparse.Namespace) -> None:
    weights = load_weights(args.src)
    if args.tokenizer:
        weights.tokenizer = Path(args.tokenizer)
    out = export_hf(weights, Path(args.output), dtype=args.dtype,
                    max_shard_size=args.max_shard_size)
    n = sum(t.numel() for t in weights.state.values())
    print(f"[export-hf] {n / 1e6:.2f}M parameters ({args.dtype}) from {weights.source} -> {out}")


# ---- import ------------------------------------------------------------------------------------

def read_hf_dir(path: Path) -> Weights:
    """The weights, model config and tokenizer of a Hugging Face Llama directory."""
    from pretrain.model.hf import LM_HEAD, model_fields_from_hf_config

    try:
        hf_config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path / 'config.json'} cannot be read: {exc}") from None
    cfg = ModelConfig(**model_fields_from_hf_config(hf_config, source=str(path)))
    state = {k: v for k, v in _read_hf_tensors(path).items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_embeddings:
        state.pop(LM_HEAD, None)  # some tied checkpoints store the head too: it is the embedding
    _check_shapes(state, cfg, source=str(path))
    tokenizer = path / "tokenizer.model" if (path / "tokenizer.model").is_file() else (
        path if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
        else None)
    return Weights(model=cfg, state=state, tokenizer=tokenizer, source=str(path))


def _read_hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{path} has no model.safetensors or model.safetensors.index.json: "
                              "save the model with save_pretrained(safe_serialization=True)")
    state = {}
    for name in files:
        try:
            state.update(load_file(str(path / name)))
        except Exception as exc:  # safetensors raises its own error types for damaged files
            raise CheckpointError(f"{path / name} cannot be read ({exc})") from None
    return state


def _check_shapes(state: dict[str, torch.Tensor], cfg: ModelConfig, *, source: str) -> None:
    from pretrain.model.hf import check_keys, expected_hf_keys
    from pretrain.model.llama import full_parameter_shape

    check_keys(set(state), expected_hf_keys(cfg), source)
    for name, tensor in state.items():
        if tuple(tensor.shape) != full_parameter_shape(name, cfg):
            raise CheckpointError(f"{source}: {name} has shape {tuple(tensor.shape)} but its "
                                  f"config gives {full_parameter_shape(name, cfg)}")


def add_import_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="a local Hugging Face Llama directory (config.json + "
                                    "safetensors)")
    parser.add_argument("--output", required=True,
                        help="directory to write; train from it with --set model.init_from=DIR")


def run_import(args: argparse.Namespace) -> None:
    src = Path(args.src)
    if not (src / "config.json").is_file():
        raise CheckpointError(f"{str(src)!r} is not a Hugging Face model directory (no "
                              "config.json): give a directory written by save_pretrained")
    weights = read_hf_dir(src)
    weights.run_config = RunConfig(model=weights.model)
    out = write_weights_dir(weights, Path(args.output))
    m = weights.model
    fields = " ".join(f"--set model.{k}={getattr(m, k)}" for k in (
        "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
        "ffn_hidden_size", "tie_embeddings", "rope_theta", "norm_eps"))
    print(f"[import-hf] {m.num_parameters() / 1e6:.2f}M parameters from {src} -> {out}\n"
          f"train from them with: pretrain train --config <yours> --set model.init_from={out} "
          f"{fields}")


# ---- initial weights of a run ------------------------------------------------------------------

@torch.no_grad()
def load_initial_weights(model: torch.nn.Module, *, cfg: ModelConfig, tp_group=None) -> str:
    """Copy the weights of `cfg.init_from` into this rank's part of `model` (a `LlamaModel` or
    a pipeline stage); returns the source read. Every rank reads the whole checkpoint."""
    from pretrain.model.hf import EMBED, LM_HEAD, check_same_architecture
    from pretrain.model.llama import shard_of
    from pretrain.model.pipeline import pipeline_to_canonical_name
    from pretrain.model.tensor_parallel import tp_rank, tp_world_size

    weights = load_weights(cfg.init_from)
    check_same_architecture(weights.model, cfg, source=weights.source)
    _check_shapes(weights.state, cfg, source=weights.source)
    flat = hasattr(model, "tensor_parallel")  # LlamaModel; otherwise a pipeline stage
    tp, rank = tp_world_size(tp_group), tp_rank(tp_group)
    for name, param in model.named_parameters():
        canonical = name if flat else pipeline_to_canonical_name(name, num_layers=cfg.num_layers)
        if cfg.tie_embeddings and canonical == LM_HEAD:
            canonical = EMBED
        local = shard_of(weights.state[canonical].float(), canonical, cfg=cfg, tp_rank=rank,
                         tp_size=tp)
        param.copy_(local)
    return weights.source
