"""Tests of the data pipeline: corpus, tokenizer, MMIDIDX format, preprocessing, packing, order.

Small and single-process (preprocessing with 2 workers spawns a pool). The tokenizer is trained
once per module on a few real standard-library files with a 400-token vocabulary.
"""
from __future__ import annotations

import importlib
import json
import pickle
import struct
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from pretrain.data import (
    DistributedPackedSampler,
    IndexedDataset,
    IndexedDatasetWriter,
    PackedSamples,
    Tokenizer,
    best_dtype,
    iter_documents,
    merge_datasets,
    micro_batch_indices,
    preprocess,
    resolve_corpus,
    split_documents,
    train_tokenizer,
)
from pretrain.data import samples as samples_module
from pretrain.errors import DataError

# The package re-exports the function `preprocess`, which hides the module of the same name.
preprocess_module = importlib.import_module("pretrain.data.preprocess")

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# Present in every CPython >= 3.10; together ~240 KB with "é", "→"-like symbols and more.
TRAINING_MODULES = ["shlex.py", "textwrap.py", "string.py", "heapq.py", "fractions.py",
                    "statistics.py", "difflib.py", "json/encoder.py"]
EDGE_CASES = ["\tdef f(x):\n\t\treturn 'é → 😀'\r\n", "  leading spaces", "trailing  \n\n\n",
              "\n", "x" * 5000, "中文 ünïcödé \u2028 \x00 ok"]
EOS = 2


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def corpus_files() -> list[Path]:
    return [STDLIB / name for name in TRAINING_MODULES]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, corpus_files) -> Tokenizer:
    prefix = tmp_path_factory.mktemp("tokenizer") / "tok"
    return train_tokenizer(corpus_files, model_prefix=prefix, vocab_size=400)


@pytest.fixture(scope="module")
def mixed_corpus(tmp_path_factory, corpus_files) -> list[Path]:
    """Real files, a JSONL file (with a blank line and an empty document) and a Latin-1 file."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "docs.jsonl").write_text(
        json.dumps({"text": "first jsonl doc\n\tindented é"}) + "\n\n"
        + json.dumps({"text": ""}) + "\n" + json.dumps({"text": "second → 😀", "id": 7}) + "\n",
        encoding="utf-8")
    (root / "latin1.txt").write_bytes("café crème\n".encode("latin-1"))
    return corpus_files[:4] + [root / "docs.jsonl", root / "latin1.txt"]


@pytest.fixture(scope="module")
def stdlib_dataset(tmp_path_factory, tokenizer, corpus_files) -> IndexedDataset:
    prefix = tmp_path_factory.mktemp("dataset") / "stdlib"
    preprocess(corpus_files, tokenizer_path=tokenizer.path, output_prefix=prefix,
               show_progress=False)
    return IndexedDataset(prefix)


def write_reference_dataset(prefix: Path, sequences: list[list[int]], *, dtype: np.dtype,
                            code: int, document_indices: list[int] | None = None) -> None:
    """An independent MMIDIDX writer, straight from the format description, with `struct`."""
    itemsize = np.dtype(dtype).itemsize
    document_indices = document_indices or list(range(len(sequences) + 1))
    pointers, position = [], 0
    for sequence in sequences:
        pointers.append(position)
        position += len(sequence) * itemsize
    index = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    index += struct.pack("<Q", len(sequences)) + struct.pack("<Q", len(document_indices))
    index += struct.pack(f"<{len(sequences)}i", *(len(s) for s in sequences))
    index += struct.pack(f"<{len(sequences)}q", *pointers)
    index += struct.pack(f"<{len(document_indices)}q", *document_indices)
    Path(f"{prefix}.idx").write_bytes(index)
    Path(f"{prefix}.bin").write_bytes(b"".join(np.asarray(s, dtype=dtype).tobytes()
                                               for s in sequences))


def random_documents(count: int, *, seed: int, high: int = 300) -> list[list[int]]:
    """Documents of random length whose tokens avoid eos, each ending with eos."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, high, size=int(rng.integers(1, 40))).tolist() + [EOS]
            for _ in range(count)]


def write_dataset(prefix: Path, documents: list[list[int]], dtype=np.uint16) -> IndexedDataset:
    with IndexedDatasetWriter(prefix, dtype=dtype) as writer:
        for document in documents:
            writer.add_document(document)
    return IndexedDataset(prefix)


def leftovers(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir()
                  if path.name.endswith((".bin", ".idx", ".tmp")))


# ----------------------------------------------------------------------------- corpus

def test_python_stdlib_corpus_is_sorted_sources_without_site_packages():
    files = resolve_corpus(["python-stdlib"])
    assert len(files) > 1000
    assert files == sorted(files)
    assert all(path.suffix == ".py" for path in files)
    assert not any({"site-packages", "dist-packages"} & set(path.parts) for path in files)
    assert STDLIB / "textwrap.py" in files


def test_corpus_specs_file_dir_glob_deduplicated(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("b")
    (tmp_path / "a.txt").write_bytes(b"a\r\n\tb\n")
    (tmp_path / ".hidden").write_text("secret")
    files = resolve_corpus([str(tmp_path / "a.txt"), str(tmp_path), str(tmp_path / "**/*.txt")])
    assert [path.name for path in files] == ["a.txt", "b.txt"]
    assert list(iter_documents(files)) == ["a\r\n\tb\n", "b"]  # no newline translation


def test_corpus_errors_name_the_spec_and_the_fix(tmp_path):
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match="'.*empty_dir' matched no files: the directory holds no"):
        resolve_corpus([str(tmp_path / "empty_dir")])
    with pytest.raises(DataError, match="matched no files: the path does not exist; check"):
        resolve_corpus([str(tmp_path / "missing.txt")])
    with pytest.raises(DataError, match="matched no files: the glob matched no files"):
        resolve_corpus([str(tmp_path / "*.parquet")])
    (tmp_path / "empty_dir" / "blank.txt").write_text("")
    with pytest.raises(DataError, match="matched 1 files but all are empty"):
        resolve_corpus([str(tmp_path / "empty_dir")])
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(DataError, match="broken.jsonl' line 2 is not valid JSON"):
        list(iter_documents([tmp_path / "broken.jsonl"]))


def test_iter_documents_jsonl_and_replaced_utf8(mixed_corpus):
    with pytest.warns(UserWarning, match="1 of 6 corpus files are not valid UTF-8"):
        documents = list(iter_documents(mixed_corpus))
    assert documents[4:] == ["first jsonl doc\n\tindented é", "second → 😀",
                             "caf\ufffd cr\ufffdme\n"]
    assert documents[0] == (STDLIB / TRAINING_MODULES[0]).read_text(encoding="utf-8")


# ----------------------------------------------------------------------------- tokenizer

def test_tokenizer_round_trips_code_exactly(tokenizer, corpus_files):
    texts = [path.read_text(encoding="utf-8") for path in corpus_files]
    texts.append(texts[1].replace("    ", "\t"))  # real code indented with tabs
    texts += EDGE_CASES
    assert any("é" in text for text in texts) and any(ord(c) > 0xFFFF for c in "".join(texts))
    for text in texts:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        assert tokenizer.decode(np.asarray(ids, dtype=np.uint16)) == text
    assert tokenizer.encode_batch(texts) == [tokenizer.encode(text) for text in texts]


def test_tokenizer_special_ids_hash_and_pickle(tokenizer):
    assert (tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 1, 2)
    assert tokenizer.vocab_size == 400
    assert tokenizer.sha256 == Tokenizer.load(tokenizer.path).sha256
    assert len(tokenizer.encode("\n\n")) == 2  # "\n" is one token
    clone = pickle.loads(pickle.dumps(tokenizer))
    assert clone.encode(EDGE_CASES[0]) == tokenizer.encode(EDGE_CASES[0])


def test_tokenizer_training_is_deterministic_and_atomic(tmp_path, corpus_files, tokenizer):
    again = train_tokenizer(corpus_files, model_prefix=tmp_path / "again", vocab_size=400)
    assert again.sha256 == tokenizer.sha256
    assert sorted(path.name for path in tmp_path.iterdir()) == ["again.model"]
    (tmp_path / "plain").touch()  # the temporary file kept the usual umask permissions
    assert (tmp_path / "again.model").stat().st_mode == (tmp_path / "plain").stat().st_mode


def test_tokenizer_errors(tmp_path, corpus_files):
    with pytest.raises(DataError, match="not found: train one"):
        Tokenizer.load(tmp_path / "missing.model")
    (tmp_path / "bad.model").write_bytes(b"not a protobuf at all")
    with pytest.raises(DataError, match="not a sentencepiece model"):
        Tokenizer.load(tmp_path / "bad.model")
    with pytest.raises(DataError, match="Increase vocab_size"):
        train_tokenizer(corpus_files[:1], model_prefix=tmp_path / "small", vocab_size=270)
    assert not list(tmp_path.glob("small*"))


# ----------------------------------------------------------------------------- indexed format

@pytest.mark.parametrize("dtype, code, high", [(np.uint16, 8, 65000), (np.int32, 4, 2**31 - 1)])
def test_indexed_round_trip_and_byte_compatibility(tmp_path, dtype, code, high):
    documents = random_documents(25, seed=1, high=high) + [[]]
    ours = write_dataset(tmp_path / "ours", documents, dtype=dtype)
    assert ours.dtype == np.dtype(dtype) and len(ours) == len(documents)
    assert [ours[i].tolist() for i in range(len(ours))] == documents
    assert ours.num_tokens == sum(map(len, documents))
    assert ours.sizes.tolist() == [len(d) for d in documents]
    assert ours.document_indices.tolist() == list(range(len(documents) + 1))
    assert ours.get(3, offset=1, length=2).tolist() == documents[3][1:3]

    write_reference_dataset(tmp_path / "ref", documents, dtype=dtype, code=code)
    reference = IndexedDataset(tmp_path / "ref")
    assert [reference[i].tolist() for i in range(len(reference))] == documents
    for suffix in (".idx", ".bin"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"ref{suffix}").read_bytes()


def test_best_dtype_and_overflow(tmp_path):
    assert best_dtype(8192) == np.uint16 and best_dtype(128256) == np.int32
    with pytest.raises(DataError, match="does not fit in uint16"):
        with IndexedDatasetWriter(tmp_path / "x", dtype=np.uint16) as writer:
            writer.add_document([1, 70000])
    assert leftovers(tmp_path) == []


def test_merge_equals_writing_everything_at_once(tmp_path):
    first, second = random_documents(5, seed=2), random_documents(7, seed=3)
    write_dataset(tmp_path / "a", first)
    write_dataset(tmp_path / "b", second)
    write_dataset(tmp_path / "all", first + second)
    merged = merge_datasets([tmp_path / "a", tmp_path / "b"], tmp_path / "merged")
    assert [merged[i].tolist() for i in range(len(merged))] == first + second
    for suffix in (".idx", ".bin"):
        assert (tmp_path / f"merged{suffix}").read_bytes() == \
            (tmp_path / f"all{suffix}").read_bytes()


def test_indexed_dataset_pickles_by_path(tmp_path):
    dataset = write_dataset(tmp_path / "p", random_documents(3, seed=4))
    clone = pickle.loads(pickle.dumps(dataset))
    assert len(pickle.dumps(dataset)) < 500
    assert clone[2].tolist() == dataset[2].tolist()


def corrupt(prefix: Path, *, offset: int, data: bytes) -> None:
    index = bytearray(Path(f"{prefix}.idx").read_bytes())
    index[offset:offset + len(data)] = data
    Path(f"{prefix}.idx").write_bytes(bytes(index))


def test_indexed_dataset_validation_errors(tmp_path):
    prefix = tmp_path / "d"
    with pytest.raises(DataError, match="run `pretrain preprocess` first"):
        IndexedDataset(prefix)
    write_dataset(prefix, random_documents(4, seed=5))
    size = Path(f"{prefix}.bin").stat().st_size
    with open(f"{prefix}.bin", "r+b") as data:
        data.truncate(size - 2)
    with pytest.raises(DataError, match=f"has {size - 2} bytes but its index describes {size}"):
        IndexedDataset(prefix)

    write_dataset(prefix, random_documents(4, seed=5))
    corrupt(prefix, offset=34 + 4 * 4 + 8 * 3, data=struct.pack("<q", 2))  # last pointer
    with pytest.raises(DataError, match="inconsistent pointers"):
        IndexedDataset(prefix)
    corrupt(prefix, offset=17, data=bytes([42]))
    with pytest.raises(DataError, match="unknown dtype code 42"):
        IndexedDataset(prefix)
    corrupt(prefix, offset=9, data=struct.pack("<Q", 2))
    with pytest.raises(DataError, match="index version 2; only version 1"):
        IndexedDataset(prefix)
    corrupt(prefix, offset=0, data=b"NOTMAGIC!")
    with pytest.raises(DataError, match="not an MMIDIDX index"):
        IndexedDataset(prefix)


# ----------------------------------------------------------------------------- preprocess

def test_preprocess_is_worker_independent_and_lossless(tmp_path, tokenizer, mixed_corpus):
    stats = {}
    for workers in (1, 2):
        with pytest.warns(UserWarning, match="not valid UTF-8"):
            stats[workers] = preprocess(mixed_corpus, tokenizer_path=tokenizer.path,
                                        output_prefix=tmp_path / f"w{workers}", workers=workers,
                                        show_progress=workers == 2)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"w1{suffix}").read_bytes() == (tmp_path / f"w2{suffix}").read_bytes()
    with pytest.warns(UserWarning):
        documents = list(iter_documents(mixed_corpus))
    dataset = IndexedDataset(tmp_path / "w1")
    assert dataset.dtype == np.uint16 and len(dataset) == len(documents)
    for i, document in enumerate(documents):
        ids = dataset[i]
        assert ids[-1] == tokenizer.eos_id and tokenizer.eos_id not in ids[:-1]
        assert tokenizer.decode(ids[:-1]) == document
    assert stats[1]["documents"] == len(documents) and stats[1]["tokens"] == dataset.num_tokens
    assert stats[1]["replaced_utf8_files"] == 1 and stats[1]["seconds"] > 0
    assert leftovers(tmp_path) == ["w1.bin", "w1.idx", "w2.bin", "w2.idx"]


def test_preprocessing_workers_do_not_import_torch():
    """Each spawned worker imports pretrain.data; torch would add ~2 s and ~250 MB to each."""
    code = "import sys, pretrain.data.preprocess; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("workers", [1, 2])
def test_failed_preprocess_leaves_nothing_behind(tmp_path, monkeypatch, tokenizer,
                                                 corpus_files, workers):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(DataError, match="not found"):
        preprocess(corpus_files, tokenizer_path=tmp_path / "nope.model",
                   output_prefix=out / "d", show_progress=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "typo"}\n')
    # One document per chunk, so that documents are written before the error arrives.
    monkeypatch.setattr(preprocess_module, "_CHUNK_DOCUMENTS", 1)
    written = []
    add_document = IndexedDatasetWriter.add_document
    monkeypatch.setattr(IndexedDatasetWriter, "add_document",
                        lambda self, ids: (written.append(len(ids)), add_document(self, ids)))
    with pytest.raises(DataError, match=r"bad.jsonl' line 2 has no string \"text\" field"):
        preprocess(corpus_files + [bad], tokenizer_path=tokenizer.path, output_prefix=out / "d",
                   workers=workers, show_progress=False)
    assert len(written) >= 2
    assert leftovers(out) == []


# ----------------------------------------------------------------------------- packed samples

def test_packed_samples_cover_the_stream_and_split_documents(stdlib_dataset):
    seq_length = 64
    train = PackedSamples(stdlib_dataset, seq_length=seq_length, split="train",
                          valid_fraction=0.25, seed=7)
    valid = PackedSamples(stdlib_dataset, seq_length=seq_length, split="valid",
                          valid_fraction=0.25, seed=7)
    assert set(train.documents).isdisjoint(valid.documents)
    assert sorted([*train.documents, *valid.documents]) == list(range(len(stdlib_dataset)))
    assert len(valid.documents) == 2  # ceil(0.25 * 8)

    for samples in (train, valid):
        stream = np.concatenate([stdlib_dataset[d] for d in samples.documents])
        document_of = np.repeat(samples.documents,
                                [len(stdlib_dataset[d]) for d in samples.documents])
        assert len(samples) == (len(stream) - 1) // seq_length
        rebuilt = []
        for i in range(len(samples)):
            item = samples[int(np.flatnonzero(samples.order == i)[0])]
            tokens = samples.sample_tokens(i)
            assert item["input_ids"].tolist() == tokens[:-1].tolist()
            assert item["input_ids"].dtype == torch.long and len(tokens) == seq_length + 1
            assert torch.equal(item["input_ids"][1:], item["labels"][:-1])
            assert tokens.tolist() == stream[i * seq_length:(i + 1) * seq_length + 1].tolist()
            # Where the tokens pass from one document to the next, the last one is eos.
            documents = document_of[i * seq_length:(i + 1) * seq_length + 1]
            assert all(tokens[np.flatnonzero(documents[1:] != documents[:-1])] == EOS)
            rebuilt.append(tokens[:-1])
        rebuilt.append(tokens[-1:])
        assert np.concatenate(rebuilt).tolist() == stream[:len(samples) * seq_length + 1].tolist()


def test_samples_are_served_in_a_seeded_shuffled_order(stdlib_dataset):
    kwargs = dict(seq_length=32, split="train", valid_fraction=0.25)
    shuffled = PackedSamples(stdlib_dataset, seed=7, **kwargs)
    again = PackedSamples(stdlib_dataset, seed=7, **kwargs)
    plain = PackedSamples(stdlib_dataset, seed=7, shuffle=False, **kwargs)
    other_seed = PackedSamples(stdlib_dataset, seed=8, **kwargs)
    n = len(shuffled)
    assert sorted(shuffled.order.tolist()) == list(range(n))  # a permutation
    assert shuffled.order.tolist() == again.order.tolist()  # deterministic for the seed
    assert shuffled.order.tolist() != list(range(n))
    assert plain.order.tolist() == list(range(n))
    assert other_seed.order[:20].tolist() != shuffled.order[:20].tolist()
    served = sorted(tuple(shuffled[i]["input_ids"].tolist()) for i in range(n))
    stream = sorted(tuple(plain[i]["input_ids"].tolist()) for i in range(n))
    assert served == stream  # the same samples, in another order


def test_split_sizes():
    assert len(split_documents(30, split="valid", valid_fraction=0.1, seed=0)) == 3
    assert len(split_documents(10, split="valid", valid_fraction=0.01, seed=0)) == 1
    assert len(split_documents(2, split="train", valid_fraction=0.9, seed=0)) == 1
    assert len(split_documents(10, split="valid", valid_fraction=0.0, seed=0)) == 0
    assert split_documents(50, split="train", valid_fraction=0.1, seed=1).tolist() != \
        split_documents(50, split="train", valid_fraction=0.1, seed=2).tolist()


def test_sample_index_cache_is_written_once_and_keyed(tmp_path, monkeypatch):
    dataset = write_dataset(tmp_path / "d", random_documents(40, seed=6))
    first = PackedSamples(dataset, seq_length=16, split="train", valid_fraction=0.1, seed=1)
    assert first.cache_path.is_file() and first.cache_path.name.startswith("d.train_")
    mtime = first.cache_path.stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("the cached sample index should have been loaded")

    monkeypatch.setattr(samples_module, "build_sample_index", fail)
    second = PackedSamples(tmp_path / "d", seq_length=16, split="train", valid_fraction=0.1,
                           seed=1)
    assert second.cache_path == first.cache_path and second.cache_path.stat().st_mtime_ns == mtime
    assert isinstance(second.order, np.memmap)  # the shuffle order is cached too
    assert np.array_equal(second.order, first.order)
    assert all(np.array_equal(first.sample_tokens(i), second.sample_tokens(i))
               for i in range(len(first)))
    monkeypatch.undo()
    other = PackedSamples(dataset, seq_length=17, split="train", valid_fraction=0.1, seed=1)
    assert other.cache_path != first.cache_path and other.cache_path.is_file()
    assert leftovers(tmp_path) == ["d.bin", "d.idx"]
    assert len(list(tmp_path.glob("d.train_*.npy"))) == 4  # index + order, for two seq_lengths


def test_multi_sequence_documents_stay_together(tmp_path):
    """Megatron datasets may split a document into sentences; splits assign whole documents."""
    sequences = [[5, 6], [7, EOS], [8, EOS], [9, 10, 11], [12, EOS]]
    write_reference_dataset(tmp_path / "m", sequences, dtype=np.uint16, code=8,
                            document_indices=[0, 2, 3, 5])
    dataset = IndexedDataset(tmp_path / "m")
    assert dataset.num_documents == 3
    valid = PackedSamples(dataset, seq_length=2, split="valid", valid_fraction=0.3, seed=0)
    (document,) = valid.documents
    expected = {0: [5, 6, 7, EOS], 1: [8, EOS], 2: [9, 10, 11, 12, EOS]}[int(document)]
    assert np.concatenate([valid.sample_tokens(i)[:-1] for i in range(len(valid))]).tolist() \
        == expected[:len(valid) * 2]


def test_packed_samples_errors(tmp_path):
    dataset = write_dataset(tmp_path / "tiny", [[3, 4, EOS]] * 4)
    with pytest.raises(DataError, match="valid split .* has 3 tokens in 1 documents, and one "
                                        "sample of seq_length 64 needs 65"):
        PackedSamples(dataset, seq_length=64, split="valid", valid_fraction=0.25, seed=0)
    with pytest.raises(DataError, match="valid split of .* has no documents: 1 documents"):
        PackedSamples(write_dataset(tmp_path / "one", [[3, 4, EOS]]), seq_length=2,
                      split="valid", valid_fraction=0.5, seed=0)
    with pytest.raises(DataError, match="split 'eval' is not one of train, valid, test"):
        PackedSamples(dataset, seq_length=2, split="eval", valid_fraction=0.25, seed=0)
    with pytest.raises(DataError, match="test split of .* has no documents: .* test_fraction 0.0"):
        PackedSamples(dataset, seq_length=2, split="test", valid_fraction=0.25, seed=0)


def test_packed_samples_with_dataloader_and_pickle(tmp_path):
    samples = PackedSamples(write_dataset(tmp_path / "d", random_documents(30, seed=8)),
                            seq_length=8, split="train", valid_fraction=0.1, seed=0)
    clone = pickle.loads(pickle.dumps(samples))
    assert np.array_equal(clone.sample_tokens(5), samples.sample_tokens(5))
    sampler = DistributedPackedSampler(len(samples), micro_batch_size=3, dp_rank=1, dp_size=2)
    batch = next(iter(DataLoader(samples, batch_sampler=sampler)))
    assert batch["input_ids"].shape == (3, 8) and batch["labels"].shape == (3, 8)
    assert torch.equal(batch["input_ids"][0], samples[3]["input_ids"])


# ----------------------------------------------------------------------------- global order

def global_order(*, steps, micro_batch_size, dp_size, grad_accum, start_sample=0):
    """Per step, the samples of all micro-steps and ranks in (micro-step, rank) order."""
    return [[index for micro_step in range(grad_accum) for rank in range(dp_size)
             for index in micro_batch_indices(
                 step=step, micro_step=micro_step, dp_rank=rank, micro_batch_size=micro_batch_size,
                 dp_size=dp_size, grad_accum=grad_accum, start_sample=start_sample)]
            for step in range(steps)]


def test_global_order_does_not_depend_on_dp_size():
    one_rank = global_order(steps=4, micro_batch_size=4, dp_size=1, grad_accum=3)
    two_ranks = global_order(steps=4, micro_batch_size=2, dp_size=2, grad_accum=3)
    assert one_rank == two_ranks
    assert [sorted(step) for step in two_ranks] == [list(range(s * 12, (s + 1) * 12))
                                                    for s in range(4)]


def take(sampler, count):
    iterator = iter(sampler)
    return [next(iterator) for _ in range(count)]


def test_sampler_follows_global_order_wraps_and_resumes_exactly():
    num_samples, micro, dp = 23, 2, 2
    ranks = [DistributedPackedSampler(num_samples, micro_batch_size=micro, dp_rank=r, dp_size=dp)
             for r in range(dp)]
    batches = [take(sampler, 20) for sampler in ranks]
    interleaved = [i for step in zip(*batches, strict=True) for batch in step for i in batch]
    assert interleaved == [i % num_samples for i in range(20 * micro * dp)]

    consumed = 7 * micro * dp
    for rank in range(dp):
        resumed = DistributedPackedSampler(num_samples, micro_batch_size=micro, dp_rank=rank,
                                           dp_size=dp, consumed_samples=consumed)
        assert take(resumed, 13) == batches[rank][7:]
