"""The data pipeline: corpus -> tokenizer -> indexed dataset (.bin/.idx) -> packed samples.

A short recipe (what `pretrain tokenizer`, `pretrain preprocess` and `pretrain train` do)::

    files = resolve_corpus(["python-stdlib"])
    tokenizer = train_tokenizer(files, model_prefix="runs/data/tokenizer", vocab_size=8192)
    preprocess(files, tokenizer_path=tokenizer.path, output_prefix="runs/data/stdlib", workers=2)
    train = PackedSamples("runs/data/stdlib", seq_length=256, split="train",
                          valid_fraction=0.01, seed=1234)  # or build_datasets(cfg.data, ...)
    sampler = DistributedPackedSampler(len(train), micro_batch_size=8, dp_rank=0, dp_size=1)
    loader = DataLoader(train, batch_sampler=sampler, num_workers=1, pin_memory=True)

Blends of several datasets: `pretrain.data.blend`; the datasets of a run config:
`pretrain.data.build.build_datasets`. The torch-based names (`pretrain.data.samples`,
`pretrain.data.build`) are imported on first use: every
preprocessing worker imports this package, and torch would cost each of them ~2 s and ~250 MB.
"""
from pretrain.data.blend import (
    BlendedSamples,
    blend_counts,
    blend_schedule,
)
from pretrain.data.corpus import PYTHON_STDLIB, ReadStats, iter_documents, resolve_corpus
from pretrain.data.indexed import (
    IndexedDataset,
    IndexedDatasetWriter,
    best_dtype,
    merge_datasets,
)
from pretrain.data.preprocess import preprocess
from pretrain.data.tokenizer import (
    HuggingFaceTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    train_tokenizer,
)

_SAMPLES_NAMES = ("DistributedPackedSampler", "PackedSamples", "micro_batch_indices",
                  "seeded_permutation", "split_documents")
_BUILD_NAMES = ("build_datasets", "build_split", "check_run_data")

__all__ = [
    "PYTHON_STDLIB", "ReadStats", "iter_documents", "resolve_corpus",
    "IndexedDataset", "IndexedDatasetWriter", "best_dtype", "merge_datasets",
    "preprocess",
    "HuggingFaceTokenizer", "SentencePieceTokenizer", "Tokenizer", "train_tokenizer",
    "BlendedSamples", "blend_counts", "blend_schedule",
    *_SAMPLES_NAMES, *_BUILD_NAMES,
]


def __getattr__(name: str):
    if name in _SAMPLES_NAMES:
        from pretrain.data import samples

        return getattr(samples, name)
    if name in _BUILD_NAMES:
        from pretrain.data import build

        return getattr(build, name)
    raise AttributeError(f"module 'pretrain.data' has no attribute {name!r}")
