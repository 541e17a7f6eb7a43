"""The datasets of a run, from its `DataConfig`: one indexed dataset or a weighted blend.

`build_datasets` is what the trainer calls; it reads only the config's data section, so the
same samples come out of every process of every layout.
"""
from __future__ import annotations

from collections.abc import Callable

from pretrain.config import MODEL_PRESETS, VOCAB_AUTO, DataConfig, RunConfig, parse_blend
from pretrain.data.blend import BlendedSamples
from pretrain.data.indexed import IndexedDataset
from pretrain.data.samples import PackedSamples
from pretrain.data.tokenizer import Tokenizer
from pretrain.errors import ConfigError, DataError

Samples = PackedSamples | BlendedSamples


def build_split(data: DataConfig, *, split: str, seq_length: int,
                num_samples: int | None = None) -> Samples:
    """The samples of `split` ("train", "valid" or "test").

    For a blend, `num_samples` is the length of the blended stream (the run's
    ``steps * global_batch_size`` for training); by default it is the components' total.
    """
    if not data.dataset and not data.blend:
        raise ConfigError("data.dataset and data.blend are both empty: set data.dataset to the "
                          "prefix written by `pretrain preprocess --output-prefix PREFIX`, or "
                          "data.blend to weighted prefixes")

    def samples(prefix: str) -> PackedSamples:
        return PackedSamples(IndexedDataset(prefix), seq_length=seq_length, split=split,
                             valid_fraction=data.valid_fraction,
                             test_fraction=data.test_fraction, seed=data.seed)

    if not data.blend:
        return samples(data.dataset)
    entries = parse_blend(data.blend)
    components = [samples(entry.prefix) for entry in entries]
    total = num_samples if num_samples is not None else sum(map(len, components))
    return BlendedSamples(components, weights=[entry.weight for entry in entries],
                          num_samples=total)


def build_datasets(data: DataConfig, *, seq_length: int, train_samples: int, with_valid: bool,
                   log: Callable[[str], None] = print) -> tuple[Samples, Samples | None]:
    """(train, valid) samples; valid is None when not wanted or when the split is too small
    (then `log` says why: a run without validation is still a run)."""
    train = build_split(data, split="train", seq_length=seq_length, num_samples=train_samples)
    valid = None
    if with_valid and data.valid_fraction > 0:
        try:
            valid = build_split(data, split="valid", seq_length=seq_length)
        except DataError as error:
            log(f"[data] no validation: {error}")
    return train, valid


def check_run_data(cfg: RunConfig, *, required: bool) -> list[str]:
    """What this machine lacks of a run's data, checked before its process group in `train`,
    `plan` and the Slurm pre-flight (and again by the trainer): the tokenizer and every
    dataset's .bin/.idx pair (opened, headers checked), one message per field unset or file
    missing or unreadable. Settles `model.vocab_size: auto` to the tokenizer's vocabulary (in
    `cfg`); a vocabulary smaller than the tokenizer's is a ConfigError (`vocab_size_for`).
    `required` (train): what is missing is one DataError. Otherwise (plan, whose login node may
    not see the files) it comes back as warnings, and `auto` with no tokenizer to read plans
    with the preset's vocabulary, saying so; without a preset it is an error."""
    tokenizer_size, problem = _tokenizer_vocab_size(cfg.data)
    model = cfg.model
    notes = []
    if model.vocab_size == VOCAB_AUTO and problem and not required and model.preset:
        model.vocab_size = MODEL_PRESETS[model.preset]["vocab_size"]
        notes.append(f"model.vocab_size=auto planned with preset {model.preset}'s "
                     f"{model.vocab_size} tokens (set model.vocab_size to plan with the "
                     "tokenizer's): data.tokenizer cannot be read")
    model.vocab_size = vocab_size_for(cfg.data, vocab_size=model.vocab_size,
                                      tokenizer_size=tokenizer_size, problem=problem)
    missing = ([problem] if problem else []) + _missing_datasets(cfg.data)
    if required and missing:
        raise DataError("; ".join(missing))
    return notes + missing


def vocab_size_for(data: DataConfig, *, vocab_size: int | str, tokenizer_size: int | None,
                   problem: str | None) -> int:
    """The vocabulary the model is built with: the tokenizer's for `auto`; an explicit size may
    exceed it (padding rows no token reaches) but not fall short of it, since a token id past
    the embedding fails only in the first forward pass, after the process group started."""
    if vocab_size == VOCAB_AUTO:
        if tokenizer_size is None:
            raise ConfigError(f"model.vocab_size=auto reads the vocabulary of data.tokenizer, but "
                              f"{problem}: make the tokenizer readable here or set "
                              "model.vocab_size to its vocabulary size")
        return tokenizer_size
    if tokenizer_size is not None and vocab_size < tokenizer_size:
        raise ConfigError(f"model.vocab_size={vocab_size} is smaller than the {tokenizer_size} "
                          f"tokens of the tokenizer {data.tokenizer!r}: token ids from "
                          f"{vocab_size} up would index past the embedding; set "
                          f"model.vocab_size={tokenizer_size} or auto")
    return vocab_size


def _tokenizer_vocab_size(data: DataConfig) -> tuple[int | None, str | None]:
    """(the vocabulary of data.tokenizer, None), or (None, why this machine cannot read it)."""
    if not data.tokenizer:
        return None, ("data.tokenizer is empty: set it to the .model file written by `pretrain "
                      "tokenizer` (or a Hugging Face tokenizer directory)")
    try:
        return Tokenizer.load(data.tokenizer).vocab_size, None
    except DataError as error:
        return None, f"data.tokenizer: {error}"


def _missing_datasets(data: DataConfig) -> list[str]:
    """One message per dataset of data.dataset / data.blend that this machine cannot open."""
    if not data.dataset and not data.blend:
        return ["data.dataset and data.blend are both empty: set data.dataset to the prefix "
                "written by `pretrain preprocess --output-prefix PREFIX`, or data.blend to "
                "weighted prefixes"]
    field = "data.dataset" if data.dataset else "data.blend"
    prefixes = [data.dataset] if data.dataset else [e.prefix for e in parse_blend(data.blend)]
    missing = []
    for prefix in prefixes:
        try:
            IndexedDataset(prefix)
        except DataError as error:
            missing.append(f"{field}: {error}")
    return missing
