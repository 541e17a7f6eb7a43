"""Tests of the data inputs: every corpus format, Hugging Face tokenizers, merging, bad input.

Single-process; each format is written from the same documents and must come back identical,
as text and as tokens.
"""
from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from pretrain.cli import main as pretrain_main
from pretrain.data import (
    HuggingFaceTokenizer,
    IndexedDataset,
    ReadStats,
    SentencePieceTokenizer,
    Tokenizer,
    iter_documents,
    preprocess,
    resolve_corpus,
    train_tokenizer,
)
from pretrain.data.tokenizer import copy_tokenizer, directory_sha256
from pretrain.errors import EXIT_USER_ERROR, DataError

DOCUMENTS = ["def f(x):\n\treturn 'é → 😀'\r\n", "  leading spaces", "second line\n\nthird",
             "中文 ünïcödé \u2028 ok", "x" * 3000, "last one\n"]


# ----------------------------------------------------------------------------- fixtures

def write_inputs(root: Path, documents: list[str], *, field: str = "body") -> dict[str, Path]:
    """The same documents as text files, JSONL, parquet and a saved `datasets` directory."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    text_dir = root / "text"
    text_dir.mkdir()
    for number, document in enumerate(documents):
        (text_dir / f"{number:03d}.txt").write_bytes(document.encode("utf-8"))
    jsonl = root / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({field: d, "id": i}) + "\n"
                             for i, d in enumerate(documents)), encoding="utf-8")
    parquet = root / "docs.parquet"
    # Two row groups: the reader must stream across them.
    pq.write_table(pa.table({"id": list(range(len(documents))), field: documents}), parquet,
                   row_group_size=4)
    saved = root / "saved"
    datasets.Dataset.from_dict({field: documents}).save_to_disk(str(saved))
    saved_dict = root / "saved_dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({field: documents}),
                          "test": datasets.Dataset.from_dict({field: ["held out"]})}
                         ).save_to_disk(str(saved_dict))
    return {"text": text_dir, "jsonl": jsonl, "parquet": parquet, "saved": saved,
            "saved_dict": saved_dict}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    return write_inputs(tmp_path_factory.mktemp("inputs"), DOCUMENTS)


@pytest.fixture(scope="module")
def sp_tokenizer(tmp_path_factory, inputs) -> SentencePieceTokenizer:
    prefix = tmp_path_factory.mktemp("sp") / "tok"
    return train_tokenizer(resolve_corpus([str(inputs["text"])]), model_prefix=prefix,
                           vocab_size=300)


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory) -> Path:
    """A tiny byte-level BPE saved as a Hugging Face tokenizer directory (offline)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    byte_level = ByteLevelBPETokenizer()
    byte_level.train_from_iterator(DOCUMENTS * 10, vocab_size=300, min_frequency=1,
                                   special_tokens=["<s>", "</s>"], show_progress=False)
    directory = tmp_path_factory.mktemp("hf_tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=byte_level._tokenizer, bos_token="<s>",
                            eos_token="</s>", clean_up_tokenization_spaces=False
                            ).save_pretrained(str(directory))
    return directory


def read_with_reference_reader(prefix: Path) -> list[list[int]]:
    """An independent MMIDIDX reader, straight from the format description, with `struct`."""
    index = Path(f"{prefix}.idx").read_bytes()
    magic, version, code, sequences, documents = struct.unpack_from("<9sQBQQ", index)
    assert (magic, version) == (b"MMIDIDX\x00\x00", 1)
    dtype = {4: "<i4", 8: "<u2"}[code]
    offset = struct.calcsize("<9sQBQQ")
    lengths = struct.unpack_from(f"<{sequences}i", index, offset)
    pointers = struct.unpack_from(f"<{sequences}q", index, offset + 4 * sequences)
    document_indices = struct.unpack_from(f"<{documents}q", index, offset + 12 * sequences)
    assert document_indices == tuple(range(sequences + 1))
    assert len(index) == offset + 12 * sequences + 8 * documents
    data = Path(f"{prefix}.bin").read_bytes()
    return [np.frombuffer(data, dtype=dtype, count=length, offset=pointer).tolist()
            for length, pointer in zip(lengths, pointers, strict=True)]


# ----------------------------------------------------------------------------- formats

@pytest.mark.parametrize("kind", ["text", "jsonl", "parquet", "saved", "saved_dict"])
def test_every_input_format_round_trips(tmp_path, inputs, sp_tokenizer, kind):
    files = resolve_corpus([str(inputs[kind])])
    assert list(iter_documents(files, text_field="body")) == DOCUMENTS

    stats = preprocess(files, tokenizer_path=sp_tokenizer.path, output_prefix=tmp_path / kind,
                       text_field="body", show_progress=False)
    assert stats["documents"] == len(DOCUMENTS)
    dataset = IndexedDataset(tmp_path / kind)
    assert [sp_tokenizer.decode(dataset[i]) for i in range(len(dataset))] == DOCUMENTS
    assert all(dataset[i][-1] == sp_tokenizer.eos_id for i in range(len(dataset)))
    # Ours, read by an independent reader: the same tokens.
    assert read_with_reference_reader(tmp_path / kind) == [dataset[i].tolist()
                                                           for i in range(len(dataset))]


def test_formats_give_byte_identical_datasets(tmp_path, inputs, sp_tokenizer):
    for kind in ("text", "parquet"):
        preprocess(resolve_corpus([str(inputs[kind])]), tokenizer_path=sp_tokenizer.path,
                   output_prefix=tmp_path / kind, text_field="body", workers=1,
                   show_progress=False)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"text{suffix}").read_bytes() == \
            (tmp_path / f"parquet{suffix}").read_bytes()


def test_a_saved_dataset_inside_a_directory_is_one_input(tmp_path, inputs):
    root = write_inputs(tmp_path / "tree", DOCUMENTS[:2])
    files = resolve_corpus([str(root["saved"].parent)])
    assert root["saved"] in files and root["saved_dict"] in files
    assert not any(path.suffix == ".arrow" for path in files)


def test_hub_datasets_are_streamed(monkeypatch):
    """Offline: `datasets.load_dataset` is replaced by rows; the call and the rows are checked."""
    import datasets

    calls = []

    def load_dataset(name, **kwargs):
        calls.append((name, kwargs))
        return iter([{"body": "first", "id": 1}, {"body": None}, {"body": "second"}])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    files = resolve_corpus(["hf:org/corpus:validation", "hf:org/other"])
    assert [str(p) for p in files] == ["hf:org/corpus:validation", "hf:org/other"]
    assert list(iter_documents(files, text_field="body")) == ["first", "second"] * 2
    assert calls == [("org/corpus", {"split": "validation", "streaming": True}),
                     ("org/other", {"split": "train", "streaming": True})]
    with pytest.raises(DataError, match=r"hub dataset 'org/other' has no text column 'text' "
                                        r"\(columns: \['body', 'id'\]\)"):
        list(iter_documents(files[1:]))


# ----------------------------------------------------------------------------- tokenizers

def test_vocab_size_auto_reads_a_hugging_face_tokenizer_directory(tmp_path, hf_tokenizer_dir):
    """`model.vocab_size: auto` with data.tokenizer a Hugging Face directory written in a config
    file (relative to it): the tokenizer's 300 tokens, before anything is sized."""
    from pretrain.config import load_config
    from pretrain.data.build import check_run_data

    (tmp_path / "run.yaml").write_text(
        f"model: {{preset: tiny, vocab_size: auto}}\n"
        f"data: {{tokenizer: {Path(hf_tokenizer_dir).name}, dataset: corpus}}\n")
    (tmp_path / Path(hf_tokenizer_dir).name).symlink_to(hf_tokenizer_dir)
    cfg = load_config(tmp_path / "run.yaml")
    warnings = check_run_data(cfg, required=False)
    assert cfg.model.vocab_size == 300
    assert [w.split(":")[0] for w in warnings] == ["data.dataset"]  # only the dataset is missing


def test_hugging_face_tokenizer_has_the_same_interface(tmp_path, hf_tokenizer_dir, inputs):
    tokenizer = Tokenizer.load(hf_tokenizer_dir)
    assert isinstance(tokenizer, HuggingFaceTokenizer)
    assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id) == (300, 0, 1)
    for document in DOCUMENTS:
        assert tokenizer.decode(tokenizer.encode(document)) == document
    assert tokenizer.encode_batch(DOCUMENTS[:2]) == [tokenizer.encode(d) for d in DOCUMENTS[:2]]
    assert tokenizer.sha256 == Tokenizer.load(hf_tokenizer_dir).sha256
    clone = pickle.loads(pickle.dumps(tokenizer))
    assert clone.encode(DOCUMENTS[0]) == tokenizer.encode(DOCUMENTS[0])

    preprocess(resolve_corpus([str(inputs["jsonl"])]), tokenizer_path=hf_tokenizer_dir,
               output_prefix=tmp_path / "hf", text_field="body", show_progress=False)
    dataset = IndexedDataset(tmp_path / "hf")
    assert dataset.dtype == np.uint16
    assert [tokenizer.decode(dataset[i]) for i in range(len(dataset))] == DOCUMENTS
    assert [dataset[i][-1] for i in range(len(dataset))] == [1] * len(DOCUMENTS)

    copy = Tokenizer.load(tokenizer.copy_to(tmp_path / "checkpoint"))
    assert copy.sha256 == tokenizer.sha256 and copy.path == tmp_path / "checkpoint" / "tokenizer"

    (hf_tokenizer_dir / "extra.txt").write_text("changed")
    try:
        with pytest.raises(DataError, match="changed .* do not modify a tokenizer"):
            pickle.loads(pickle.dumps(tokenizer))
    finally:
        (hf_tokenizer_dir / "extra.txt").unlink()


def test_a_tokenizer_copied_into_a_checkpoint_leaves_a_models_weights_behind(hf_tokenizer_dir,
                                                                            tmp_path):
    """A Hugging Face model directory is also a tokenizer directory: its copy in a checkpoint
    holds the tokenizer's files only, whoever copies it."""
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(hf_tokenizer_dir, model_dir)
    (model_dir / "model.safetensors").write_bytes(b"weights")
    (model_dir / "config.json").write_text("{}")
    copy = Tokenizer.load(model_dir).copy_to(tmp_path / "checkpoint")
    assert copy == tmp_path / "checkpoint" / "tokenizer"
    names = sorted(p.name for p in hf_tokenizer_dir.iterdir())
    assert sorted(p.name for p in copy.iterdir()) == names
    assert Tokenizer.load(copy).sha256 == Tokenizer.load(hf_tokenizer_dir).sha256
    assert copy_tokenizer(model_dir, tmp_path / "final") == tmp_path / "final" / "tokenizer"
    assert directory_sha256(tmp_path / "final" / "tokenizer") == directory_sha256(copy)


def test_sentencepiece_unigram_load_and_copy(tmp_path):
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text(encoding="utf-8") for name in ("textwrap.py", "shlex.py")]
    jsonl = tmp_path / "code.jsonl"
    jsonl.write_text("".join(json.dumps({"body": text}) + "\n" for text in texts + DOCUMENTS))
    unigram = train_tokenizer([jsonl], model_prefix=tmp_path / "uni", vocab_size=600,
                              model_type="unigram", text_field="body")
    loaded = Tokenizer.load(tmp_path / "uni.model")
    assert isinstance(loaded, SentencePieceTokenizer) and loaded.sha256 == unigram.sha256
    copy = loaded.copy_to(tmp_path / "checkpoint")
    assert copy == tmp_path / "checkpoint" / "tokenizer.model"
    assert Tokenizer.load(copy).sha256 == loaded.sha256
    for document in DOCUMENTS:  # byte fallback: characters outside the vocabulary survive
        assert loaded.decode(loaded.encode(document)) == document


def test_not_a_tokenizer_directory(tmp_path):
    with pytest.raises(DataError, match="is not a Hugging Face tokenizer directory"):
        Tokenizer.load(tmp_path)


# ----------------------------------------------------------------------------- merge command

@pytest.mark.parametrize("command", ["tokenizer", "preprocess", "merge-datasets"])
def test_help_of_the_data_commands(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        pretrain_main([command, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: pretrain {command}" in capsys.readouterr().out


def test_merge_datasets_command(tmp_path, inputs, sp_tokenizer, capsys):
    text_files = resolve_corpus([str(inputs["text"])])
    for name, shard in (("a", text_files[:2]), ("b", text_files[2:]), ("all", text_files)):
        preprocess(shard, tokenizer_path=sp_tokenizer.path, output_prefix=tmp_path / name,
                   show_progress=False)
    pretrain_main(["merge-datasets", "--inputs", str(tmp_path / "a"), str(tmp_path / "b"),
                   "--output-prefix", str(tmp_path / "merged" / "m")])
    assert "2 datasets, 6 documents" in capsys.readouterr().out
    for suffix in (".bin", ".idx"):
        assert (tmp_path / "merged" / f"m{suffix}").read_bytes() == \
            (tmp_path / f"all{suffix}").read_bytes()

    with pytest.raises(SystemExit) as exit_info:
        pretrain_main(["merge-datasets", "--inputs", str(tmp_path / "a"), str(tmp_path / "nope"),
                       "--output-prefix", str(tmp_path / "bad")])
    assert exit_info.value.code == EXIT_USER_ERROR
    error = capsys.readouterr().err
    assert error.startswith("error: indexed dataset file") and error.count("\n") == 1
    assert not list(tmp_path.glob("bad*"))


# ----------------------------------------------------------------------------- bad input

def leftovers(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir()
                  if path.name.endswith((".bin", ".idx", ".tmp")))


@pytest.mark.parametrize("kind, message", [
    ("jsonl", r"line 1 has no string \"content\" field \(found \['body', 'id'\]\)"),
    ("parquet", r"has no text column 'content' \(columns: \['id', 'body'\]\)"),
    ("saved", r"has no text column 'content' \(columns: \['body'\]\)"),
])
def test_missing_text_field_is_one_line_and_writes_nothing(tmp_path, inputs, sp_tokenizer,
                                                           capsys, kind, message):
    with pytest.raises(SystemExit) as exit_info:
        pretrain_main(["preprocess", "--corpus", str(inputs[kind]), "--text-field", "content",
                       "--tokenizer", str(sp_tokenizer.path), "--workers", "1",
                       "--output-prefix", str(tmp_path / "out")])
    assert exit_info.value.code == EXIT_USER_ERROR
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: ")
    import re
    assert re.search(message, error), error
    assert leftovers(tmp_path) == []


def test_empty_inputs(tmp_path, sp_tokenizer):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="matched 1 files but all are empty"):
        resolve_corpus([str(tmp_path / "empty.txt")])
    (tmp_path / "blank.jsonl").write_text("\n\n" + json.dumps({"text": ""}) + "\n")
    with pytest.raises(DataError, match="no non-empty documents in the 1 corpus files"):
        preprocess(resolve_corpus([str(tmp_path / "blank.jsonl")]),
                   tokenizer_path=sp_tokenizer.path, output_prefix=tmp_path / "out",
                   show_progress=False)
    assert leftovers(tmp_path) == []


def test_invalid_utf8_is_replaced_counted_and_warned(tmp_path, sp_tokenizer):
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n{"text": "\xff\xfe two"}\n')
    (tmp_path / "good.txt").write_text("fine")
    files = [jsonl, tmp_path / "good.txt"]
    stats = ReadStats()
    with pytest.warns(UserWarning, match=r"1 of 2 corpus files are not valid UTF-8 \(2 documents"):
        documents = list(iter_documents(files, stats=stats))
    assert documents == ["ok", "caf\ufffd", "\ufffd\ufffd two", "fine"]
    assert (stats.replaced_utf8_files, stats.replaced_utf8_documents) == (1, 2)
    with pytest.warns(UserWarning, match="not valid UTF-8"):
        result = preprocess(files, tokenizer_path=sp_tokenizer.path,
                            output_prefix=tmp_path / "out", show_progress=False)
    assert (result["replaced_utf8_files"], result["replaced_utf8_documents"]) == (1, 2)


def test_wrong_column_type_and_unreadable_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    with pytest.raises(DataError, match="column 'text' holds int values, not text"):
        list(iter_documents([tmp_path / "ints.parquet"]))
    (tmp_path / "fake.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="is not a readable parquet file"):
        list(iter_documents([tmp_path / "fake.parquet"]))


# ----------------------------------------------------------------------------- end to end

def _directory_sha256(directory: Path) -> str:
    """The tokenizer directory's hash as documented: sha256 over each file's relative name and
    the sha256 of its bytes, in sorted order (written out here, not imported)."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(directory)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


@pytest.mark.slow
def test_training_with_a_hugging_face_tokenizer(tmp_path, hf_tokenizer_dir):
    """The run trains on the tokenizer's ids with its 300-token vocabulary (the first loss is
    ln 300 of a near-uniform start, not the tiny preset's ln 512) and its checkpoint records
    that tokenizer directory and its hash."""
    import math
    import sysconfig

    from pretrain.testing.runs import train

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted((stdlib / "json").glob("*.py"))
    preprocess(files, tokenizer_path=hf_tokenizer_dir, output_prefix=tmp_path / "hf",
               show_progress=False)
    run = train(tmp_path, {"tokenizer": str(hf_tokenizer_dir), "dataset": str(tmp_path / "hf")},
                overrides=["model.vocab_size=300", "train.steps=3"])
    assert len(run.losses) == 3 and all(np.isfinite(run.losses))
    assert abs(run.losses[0] - math.log(300)) < 0.05, run.losses
    meta = json.loads((run.run_dir / "checkpoints" / "step3" / "meta.json").read_text())
    assert meta["tokenizer"] == {"path": str(hf_tokenizer_dir),
                                 "sha256": _directory_sha256(hf_tokenizer_dir)}
