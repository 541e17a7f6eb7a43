"""Tests of splits, blends and the order in which ranks read them (resume, dp independence).

Single-process except one short training run of the tiny model on a blend.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from pretrain.testing.runs import train
from pretrain.config import DataConfig, load_config, parse_blend
from pretrain.data import (
    BlendedSamples,
    IndexedDatasetWriter,
    PackedSamples,
    blend_counts,
    blend_schedule,
    build_datasets,
    build_split,
    preprocess,
    split_documents,
)
from pretrain.data.loader import micro_batches
from pretrain.errors import ConfigError, DataError

EOS = 2


def write_dataset(prefix: Path, *, documents: int, seed: int, low: int = 3) -> str:
    """Random documents whose tokens come from [low, low + 100), so blends tell sources apart."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
        for _ in range(documents):
            writer.add_document(rng.integers(low, low + 100, size=int(rng.integers(5, 60))).tolist()
                                + [EOS])
    return str(prefix)


@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("blend")
    return (write_dataset(root / "code", documents=200, seed=1, low=3),
            write_dataset(root / "prose", documents=120, seed=2, low=200))


# ----------------------------------------------------------------------------- splits

def test_train_valid_test_split_is_a_partition():
    parts = {split: split_documents(200, split=split, valid_fraction=0.05, test_fraction=0.1,
                                    seed=3) for split in ("train", "valid", "test")}
    assert [len(parts[s]) for s in ("train", "valid", "test")] == [170, 10, 20]
    assert sorted(np.concatenate(list(parts.values())).tolist()) == list(range(200))
    # Adding a test split leaves the validation documents' order before it unchanged.
    without_test = split_documents(200, split="train", valid_fraction=0.05, seed=3)
    assert parts["train"].tolist() == without_test[:170].tolist()
    assert [split_documents(3, split=s, valid_fraction=0.3, test_fraction=0.3, seed=0).size
            for s in ("train", "valid", "test")] == [1, 1, 1]
    with pytest.raises(DataError, match="leave documents for training"):
        split_documents(10, split="train", valid_fraction=0.5, test_fraction=0.5, seed=0)


def test_test_split_through_the_config(two_datasets):
    data = DataConfig(dataset=two_datasets[0], valid_fraction=0.05, test_fraction=0.1, seed=9)
    test = build_split(data, split="test", seq_length=16)
    train = build_split(data, split="train", seq_length=16)
    assert set(test.documents.tolist()).isdisjoint(train.documents.tolist())
    assert len(test.documents) == 20
    with pytest.raises(ConfigError, match=r"valid_fraction \+ test_fraction=1.0: must be < 1"):
        DataConfig(dataset="x", valid_fraction=0.5, test_fraction=0.5)


# ----------------------------------------------------------------------------- blending

@pytest.mark.parametrize("weights", [[0.7, 0.3], [5, 1, 1], [0.001, 0.999], [1, 1, 1]])
@pytest.mark.parametrize("num_samples", [1, 10, 997, 20000])
def test_blend_counts_are_within_one_sample_of_the_request(weights, num_samples):
    targets = np.asarray(weights) / sum(weights) * num_samples
    datasets, within = blend_schedule(weights, num_samples)
    counts = np.bincount(datasets, minlength=len(weights))
    assert counts.tolist() == blend_counts(weights, num_samples).tolist()
    assert counts.sum() == num_samples and np.all(np.abs(counts - targets) < 1)
    for d in range(len(weights)):  # each dataset's samples are taken in its own order
        assert within[datasets == d].tolist() == list(range(counts[d]))
    # Every prefix of the stream stays close to the weights (no long runs of one dataset).
    running = np.cumsum(np.eye(len(weights))[datasets], axis=0)
    ideal = np.outer(np.arange(1, num_samples + 1), np.asarray(weights) / sum(weights))
    assert np.abs(running - ideal).max() <= 1.0 + 1e-9


def test_blended_samples_follow_the_schedule_deterministically(two_datasets):
    data = DataConfig(blend=[f"0.7 {two_datasets[0]}", {"weight": 0.3, "prefix": two_datasets[1]}],
                      valid_fraction=0.1, seed=5)
    blend = build_split(data, split="train", seq_length=16, num_samples=1000)
    assert isinstance(blend, BlendedSamples) and len(blend) == 1000
    assert blend.counts().tolist() == [700, 300]
    code, prose = blend.datasets
    for i in (0, 1, 2, 3, 500, 999):
        d, j = int(blend.dataset_index[i]), int(blend.dataset_sample_index[i])
        source = (code, prose)[d]
        assert blend[i]["input_ids"].tolist() == source[j % len(source)]["input_ids"].tolist()
        # Tokens tell the sources apart: code uses ids below 103, prose 200 and above.
        tokens = blend[i]["input_ids"][blend[i]["input_ids"] != EOS]
        assert bool((tokens >= 200).all()) == (d == 1) and bool((tokens < 103).all()) == (d == 0)
    again = build_split(data, split="train", seq_length=16, num_samples=1000)
    assert all(again[i]["input_ids"].tolist() == blend[i]["input_ids"].tolist()
               for i in range(0, 1000, 37))
    reseeded = build_split(DataConfig(blend=data.blend, valid_fraction=0.1, seed=6),
                           split="train", seq_length=16, num_samples=1000)
    assert any(reseeded[i]["input_ids"].tolist() != blend[i]["input_ids"].tolist()
               for i in range(10))


def test_blend_valid_split_and_build_datasets(two_datasets):
    data = DataConfig(blend=[f"1 {two_datasets[0]}", f"1 {two_datasets[1]}"],
                      valid_fraction=0.1, seed=5)
    train, valid = build_datasets(data, seq_length=16, train_samples=64, with_valid=True)
    assert len(train) == 64 and train.counts().tolist() == [32, 32]
    assert len(valid) == sum(len(d) for d in valid.datasets)
    train_documents = set(train.datasets[0].documents.tolist())
    assert train_documents.isdisjoint(valid.datasets[0].documents.tolist())
    messages = []
    tiny = DataConfig(dataset=two_datasets[0], valid_fraction=0.001, seed=5)
    _, none = build_datasets(tiny, seq_length=200, train_samples=8, with_valid=True,
                             log=messages.append)
    assert none is None and messages[0].startswith("[data] no validation: the valid split")


@pytest.mark.parametrize("entry, message", [
    ("0.7", "is not a weight and a prefix"),
    ("seven runs/data/code", "weight 'seven' is not a number"),
    ("-1 runs/data/code", "weight -1.0 must be a positive finite number"),
    ("nan runs/data/code", "weight nan must be a positive finite number"),
    ({"weight": 1}, "must have exactly the keys weight and prefix"),
    ({"weight": "x", "prefix": "p"}, "weight 'x' is not a number"),
    (3, "is not a weight and a prefix"),
])
def test_blend_weights_that_do_not_parse(entry, message):
    with pytest.raises(DataError, match=message):
        parse_blend([entry])
    with pytest.raises(ConfigError, match=f"^data.blend=.*{message}") as error:
        DataConfig(blend=[entry])
    assert "\n" not in str(error.value)


def test_blend_through_a_config_override_and_with_dataset():
    cfg = load_config("configs/tiny.yaml", ['data.blend=["0.25 a/code", "0.75 b/prose"]'])
    assert [(e.weight, e.prefix) for e in parse_blend(cfg.data.blend)] == \
        [(0.25, str(Path.cwd() / "a/code")), (0.75, str(Path.cwd() / "b/prose"))]  # --set: cwd
    with pytest.raises(ConfigError, match="give data.dataset or data.blend, not both"):
        load_config("configs/tiny.yaml", ["data.dataset=x", 'data.blend=["1 a"]'])


# ----------------------------------------------------------------------------- order

def read_stream(samples, *, micro_batch_size: int, dp_size: int, micro_steps: int,
                consumed: int = 0, workers: int = 1) -> list[list[int]]:
    """The samples read by all dp ranks, micro-step by micro-step, in (micro-step, rank) order,
    through the trainer's loader (`micro_batches`, a DataLoader with workers)."""
    loaders = [micro_batches(samples, micro_batch_size=micro_batch_size, dp_rank=rank,
                             dp_size=dp_size, consumed_samples=consumed, workers=workers)
               for rank in range(dp_size)]
    stream = []
    for _ in range(micro_steps):
        for loader in loaders:
            batch = next(loader)
            assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
            stream.extend(row.tolist() for row in batch["input_ids"])
    return stream


@pytest.fixture(scope="module")
def blend(two_datasets) -> BlendedSamples:
    data = DataConfig(blend=[f"0.6 {two_datasets[0]}", f"0.4 {two_datasets[1]}"],
                      valid_fraction=0.0, seed=11)
    return build_split(data, split="train", seq_length=8, num_samples=40)


def test_dp2_and_dp1_read_the_same_global_order_of_a_blend(blend):
    one = read_stream(blend, micro_batch_size=4, dp_size=1, micro_steps=12)
    two = read_stream(blend, micro_batch_size=2, dp_size=2, micro_steps=12)
    assert one == two
    assert one[:40] == [blend[i]["input_ids"].tolist() for i in range(40)]
    assert one[40:] == one[:8]  # the stream wraps around after the run's 40 samples


@pytest.mark.parametrize("resume_dp", [1, 2])
def test_resume_at_step_k_reads_the_same_samples(blend, resume_dp):
    global_batch, k = 4, 3
    uninterrupted = read_stream(blend, micro_batch_size=4, dp_size=1, micro_steps=10)
    resumed = read_stream(blend, micro_batch_size=4 // resume_dp, dp_size=resume_dp,
                          micro_steps=10 - k, consumed=k * global_batch)
    assert resumed == uninterrupted[k * global_batch:]


def test_packed_samples_resume_too(two_datasets):
    samples = PackedSamples(two_datasets[1], seq_length=8, split="train", valid_fraction=0.1,
                            seed=2)
    uninterrupted = read_stream(samples, micro_batch_size=2, dp_size=2, micro_steps=8, workers=0)
    resumed = read_stream(samples, micro_batch_size=4, dp_size=1, micro_steps=3, consumed=20,
                          workers=2)
    assert resumed == uninterrupted[20:32]


# ----------------------------------------------------------------------------- end to end

def _train_documents_of_samples(samples: PackedSamples, indices) -> set[int]:
    """The documents whose tokens the samples `indices` (in served order) hold: every document
    a sample's ``seq_length + 1`` tokens run through, read from the sample index."""
    document_of = np.searchsorted(samples.dataset.document_indices, samples._sequences,
                                  side="right") - 1  # the document of each sequence position
    documents = set()
    for index in indices:
        position, offset = (int(v) for v in samples._index[int(samples.order[index])])
        needed = samples.seq_length + 1
        while needed > 0:
            documents.add(int(document_of[position]))
            needed -= int(samples._sequence_sizes[position]) - offset
            position, offset = position + 1, 0
    return documents


@pytest.mark.slow
def test_training_on_a_blend_with_a_test_split(tmp_path, tiny_data):
    """The run draws 16 samples, 11 and 5 from the two sources (0.7 and 0.3 of 16 by largest
    remainder: 11.2 and 4.8), reported by the run itself; it split `other` with the test
    fraction (the sample indices it cached beside `other` are those of that split, nothing
    else), and the samples it read hold no test-split document."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    other = tmp_path / "other"
    preprocess(sorted((stdlib / "xml").rglob("*.py")), tokenizer_path=tiny_data["tokenizer"],
               output_prefix=other, show_progress=False)
    run = train(tmp_path, tiny_data, overrides=[
        "data.dataset=''", f'data.blend=["0.7 {tiny_data["dataset"]}", "0.3 {other}"]',
        "data.test_fraction=0.05", "train.steps=4", "train.eval_interval=2"])
    losses = run.losses
    assert len(losses) == 4 and all(np.isfinite(losses))
    assert [r["step"] for r in run.records if r["kind"] == "eval"] == [2, 4]
    head = run.records[0]
    assert (head["train_samples"], head["train_samples_per_source"]) == (16, [11, 5])
    assert [r for r in run.records if r["kind"] == "train"][-1]["consumed_samples"] == 16
    cached = sorted(p.name for p in tmp_path.glob("other.*.npy"))  # before the checks add any

    cfg = load_config(run.run_dir / "config.yaml")
    assert cfg.data.test_fraction == 0.05
    fractions = dict(seq_length=cfg.model.seq_length, valid_fraction=cfg.data.valid_fraction,
                     test_fraction=cfg.data.test_fraction, seed=cfg.data.seed)
    splits = {split: PackedSamples(str(other), split=split, **fractions)
              for split in ("train", "valid", "test")}
    assert cached == sorted(name for split in ("train", "valid") for name in (
        splits[split].cache_path.name, splits[split].cache_path.with_suffix(".order.npy").name))
    blend = BlendedSamples([PackedSamples(tiny_data["dataset"], split="train", **fractions),
                            splits["train"]], weights=[0.7, 0.3], num_samples=16)
    for source, samples in enumerate(blend.datasets):
        test = PackedSamples(samples.dataset, split="test", **fractions).documents
        assert len(test) > 0
        read = blend.dataset_sample_index[blend.dataset_index == source] % len(samples)
        assert _train_documents_of_samples(samples, read).isdisjoint(test.tolist())
