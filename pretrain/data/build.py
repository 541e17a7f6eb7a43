"""The datasets of a run, from its `DataConfig`: one indexed dataset or a weighted blend.

`build_datasets` is what the trainer calls; it reads only the config's data section, so the
same samples come out of every process of every layout.
"""
from __future__ import annotations

from collections.abc import Callable

from pretrain.config import DataConfig, parse_blend
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


def check_data(data: DataConfig, *, vocab_size: int) -> list[str]:
    """What this machine lacks of a run's data: the tokenizer and every dataset's .bin/.idx pair
    (opened, headers checked), one message per field unset or file missing or unreadable.
    Raises ConfigError for a tokenizer whose vocabulary is not model.vocab_size.

    `pretrain train` turns the messages into errors before any process group starts; `pretrain
    plan` prints them as warnings (the job's nodes may see other files than a login node).
    """
    missing = []
    if not data.tokenizer:
        missing.append("data.tokenizer is empty: set it to the .model file written by `pretrain "
                       "tokenizer` (or a Hugging Face tokenizer directory)")
    else:
        try:
            tokenizer = Tokenizer.load(data.tokenizer)
        except DataError as error:
            missing.append(f"data.tokenizer: {error}")
        else:
            if tokenizer.vocab_size != vocab_size:
                raise ConfigError(f"model.vocab_size={vocab_size} but the tokenizer "
                                  f"{data.tokenizer!r} has {tokenizer.vocab_size} tokens: set "
                                  f"model.vocab_size={tokenizer.vocab_size}")
    if not data.dataset and not data.blend:
        missing.append("data.dataset and data.blend are both empty: set data.dataset to the "
                       "prefix written by `pretrain preprocess --output-prefix PREFIX`, or "
                       "data.blend to weighted prefixes")
    field = "data.dataset" if data.dataset else "data.blend"
    prefixes = [data.dataset] if data.dataset else [e.prefix for e in parse_blend(data.blend)]
    for prefix in prefixes:
        try:
            IndexedDataset(prefix)
        except DataError as error:
            missing.append(f"{field}: {error}")
    return missing


def require_data(data: DataConfig, *, vocab_size: int) -> None:
    """`check_data`, with whatever is missing as one DataError (exit 2)."""
    missing = check_data(data, vocab_size=vocab_size)
    if missing:
        raise DataError("; ".join(missing))
