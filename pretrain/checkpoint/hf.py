"""Hugging Face interop: export any checkpoint as a directory of its family's class
(`LlamaForCausalLM`, `MixtralForCausalLM`, `Qwen3ForCausalLM`), import one.

- `export_hf`: weights `load_weights` read (run dir, step dir of any layout, final/) -> config.json,
  safetensors (sharded with model.safetensors.index.json past `max_shard_size`), and the tokenizer
  as a `tokenizers` BPE (or Unigram) built from the sentencepiece model, so `AutoTokenizer` loads
  it offline. The tokenizer is converted here rather than by transformers' Llama converter
  because ours has no dummy prefix, no normalisation and split digits (the Llama converter
  assumes Llama's own settings and gives other ids); the export checks that both encode sample
  texts identically. A muP model's multipliers are folded into its weights
  (`mup.fold_for_export`: q_proj carries the attention scale, an untied lm_head the 1/m of the
  logits), so `transformers` computes the same logits; a tied muP model is refused.
- `import_hf`: a local Hugging Face directory of any family (GQA, tied or untied) -> a final/ directory
  (fp32 model.safetensors, config.yaml with the model section, tokenizer) that a run starts from
  with `model.init_from=DIR`; `generate` reads it too.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from sentencepiece import sentencepiece_model_pb2
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.tokenization_utils_base import generate_merges

from pretrain.checkpoint.safetensors_stream import SafetensorsWriter
from pretrain.checkpoint.weights import Weights, read_hf_dir, tensor_shape, write_final
from pretrain.config import Precision, RunConfig
from pretrain.data import Tokenizer as OurTokenizer
from pretrain.data.tokenizer import copy_tokenizer_files
from pretrain.errors import CheckpointError
from pretrain.families import family_of
from pretrain.files import atomic_directory
from pretrain.model import DTYPES, mtp
from pretrain.model.hf import hf_architecture, to_hf_config
from pretrain.model.mup import check_exportable, fold_for_export

# Encoded by both tokenizers after conversion: code, indentation, digits, a newline run, bytes.
_TOKENIZER_PROBES = ("def f(x):\n    return x  # 12345\n\n\tü 😀 é", "hello world", " a  b   c\n")


# ---- tokenizer ---------------------------------------------------------------------------------

def sentencepiece_to_hf(model_path: Path) -> PreTrainedTokenizerFast:
    """A fast tokenizer that encodes exactly as the sentencepiece model at `model_path`."""
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
    """Write a Hugging Face directory of the model's family (`LlamaForCausalLM`,
    `Qwen3ForCausalLM`, ...; see the module docstring); atomic."""
    if weights.tokenizer is None:
        raise CheckpointError(f"no tokenizer found for {weights.source}: pass --tokenizer "
                              "with the run's sentencepiece .model file")
    try:  # muP's multipliers go into the weights; a tied muP head cannot take them
        check_exportable(weights.model)
    except ValueError as e:
        raise CheckpointError(f"{weights.source}: {e}") from None
    model = weights.model
    if model.num_experts and model.moe_capacity_factor:
        print(f"[export-hf] note: model.moe_capacity_factor={model.moe_capacity_factor} drops "
              f"tokens over an expert's capacity; transformers' {hf_architecture(model)} is "
              "dropless, so its logits differ wherever a token was dropped here")
    ours = OurTokenizer.load(weights.tokenizer)
    torch_dtype = DTYPES[Precision(dtype)]
    # a mixture of experts under its family's checkpoint names (Mixtral's differ from ours)
    family = family_of(model)
    state = family.module("hf_export")(weights.state, model) \
        if model.num_experts and "hf_export" in family.modules else weights.state
    if model.mtp_depth:  # each prediction module's copy of the embedding and head
        copies = mtp.checkpoint_copies(model)
        state = _WithCopies(state, copies)
    shapes = {name: tensor_shape(state, name) for name in sorted(state)}
    shards = _shards(shapes, itemsize=torch_dtype.itemsize, max_bytes=parse_size(max_shard_size))
    with atomic_directory(out) as tmp:
        weight_map = {}
        for number, names in enumerate(shards, 1):
            filename = "model.safetensors" if len(shards) == 1 else \
                f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            with SafetensorsWriter(tmp / filename, {n: shapes[n] for n in names},
                                   dtype=torch_dtype, metadata={"format": "pt"}) as writer:
                for name in names:  # one tensor in memory at a time (lazy sources)
                    writer.write(name, fold_for_export(name, state[name], model))
            weight_map.update(dict.fromkeys(names, filename))
        if len(shards) > 1:
            total = sum(math.prod(shape) for shape in shapes.values()) * torch_dtype.itemsize
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        ids = {k: (v if v >= 0 else None) for k, v in
               (("bos_token_id", ours.bos_id), ("eos_token_id", ours.eos_id))}
        config = to_hf_config(model, architectures=[hf_architecture(model)],
                              dtype=str(torch_dtype).removeprefix("torch."), **ids)
        config.save_pretrained(tmp)
        _export_tokenizer(weights.tokenizer, ours, tmp)
    return out


class _WithCopies(Mapping):
    """`state` and, under more names, some of its tensors (`copies`: {name: its source}),
    read when asked as `state`'s are."""

    def __init__(self, state: Mapping, copies: dict[str, str]) -> None:
        self.state, self.copies = state, copies

    def __getitem__(self, name: str):
        return self.state[self.copies.get(name, name)]

    def __iter__(self):
        yield from self.state
        yield from self.copies

    def __len__(self) -> int:
        return len(self.state) + len(self.copies)

    def shape(self, name: str) -> tuple[int, ...]:
        return tensor_shape(self.state, self.copies.get(name, name))


def parse_size(text: str) -> int:
    """Bytes of "5GB" (10^9, Hugging Face's convention), "500MiB" (2^20), "100KB", "123"."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", text, flags=re.IGNORECASE)
    if match is None:
        raise CheckpointError(f"--max-shard-size {text!r}: expected a size like 5GB or 500MiB")
    unit = (match.group(2) or "B").upper()
    scale = 1 if unit == "B" else (1024 if "I" in unit else 1000) ** ("KMGT".index(unit[0]) + 1)
    return int(float(match.group(1)) * scale)


def _shards(shapes: dict[str, tuple[int, ...]], *, itemsize: int,
            max_bytes: int) -> list[list[str]]:
    """Names in order, cut into files of at most `max_bytes` (a larger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _export_tokenizer(path: Path, ours: OurTokenizer, out: Path) -> None:
    """Copy a Hugging Face tokenizer as it is; convert a sentencepiece one, checked."""
    if path.is_dir():
        copy_tokenizer_files(path, out)
        return
    theirs = sentencepiece_to_hf(path)
    check_tokenizer_round_trip(ours, theirs)
    if type(theirs.backend_tokenizer.model).__name__ == "Unigram":
        # measured: 4 of 60 stdlib files differ, in the order of equal-score pieces
        # of long whitespace runs (Viterbi ties); BPE models convert exactly
        print("[export-hf] note: a unigram tokenizer converts with rare differences "
              "in tie-breaking between equally likely segmentations")
    theirs.save_pretrained(out)


def import_hf(src: Path, out: Path) -> Weights:
    """Write the Hugging Face directory `src` (of any family's class) as a final/ directory
    `out`; its weights."""
    if not (src / "config.json").is_file():
        raise CheckpointError(f"{str(src)!r} is not a Hugging Face model directory (no "
                              "config.json): give a directory written by save_pretrained")
    weights = read_hf_dir(src)
    weights.run_config = RunConfig(model=weights.model)
    write_final(weights, out)
    return weights
