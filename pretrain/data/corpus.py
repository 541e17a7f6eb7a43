"""Find the inputs of a text corpus and stream them as documents.

A corpus is a list of specs, each one of:

- a text file: one document per file;
- a JSON lines file (``.jsonl``): one document per line, its ``text_field`` (default ``"text"``);
- a parquet file (``.parquet``): one document per row, its ``text_field`` column;
- a Hugging Face ``datasets`` dataset saved with ``save_to_disk`` (a directory holding
  ``dataset_info.json`` or ``dataset_dict.json``; its ``train`` split when it holds several);
- ``hf:NAME`` or ``hf:NAME:SPLIT``: a dataset of the Hugging Face hub, streamed (online only);
- a directory: every file below it, recursively (hidden entries and ``__pycache__`` skipped);
- a glob such as ``data/**/*.txt`` (``**`` crosses directories);
- ``python-stdlib``: the ``.py`` sources of the running interpreter's standard library, without
  ``site-packages``/``dist-packages`` (about 1,800 files, 31 MB on CPython 3.11): a real code
  corpus that every machine has, used by the tests, the examples and the benchmarks.

Paths are sorted within each spec and de-duplicated across specs, so the same specs give the same
document order on every machine, which the preprocessed dataset and the data order rely on.

Everything is streamed: JSONL line by line, parquet by record batch, datasets row by row from
their memory-mapped Arrow files, so a corpus larger than memory works. Only a plain text file is
read whole (it is one document).

Text is decoded as UTF-8 with ``errors="replace"``: a corpus with a few Latin-1 files should not
stop a run, but the user is told how many files were damaged (one warning, with the count).
"""
from __future__ import annotations

import glob
import json
import os
import sysconfig
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pretrain.errors import DataError

PYTHON_STDLIB = "python-stdlib"
HUB_PREFIX = "hf:"  # a Hugging Face hub dataset, e.g. hf:roneneldan/TinyStories or hf:NAME:SPLIT
DEFAULT_TEXT_FIELD = "text"
_EXCLUDED_STDLIB_DIRS = frozenset({"site-packages", "dist-packages"})
_GLOB_CHARACTERS = set("*?[")
_SAVED_DATASET_MARKERS = ("dataset_info.json", "dataset_dict.json")  # `save_to_disk` outputs
_BATCH_ROWS = 1024  # rows per parquet / datasets batch: bounded memory, amortised overhead


def resolve_corpus(specs: list[str]) -> list[Path]:
    """Expand corpus specs (files, directories, globs, datasets, ``python-stdlib``) into inputs.

    Each input is a file, a saved ``datasets`` directory, or a ``hf:NAME`` hub name (kept as a
    `Path`, never opened as a file). Raises `DataError` when a spec matches nothing, or when
    every matched file is empty, so that a typo in a path fails here rather than as an empty
    dataset an hour later.
    """
    if isinstance(specs, (str, Path)):
        specs = [str(specs)]
    if not specs:
        raise DataError("corpus is empty: give at least one file, directory, glob or "
                        f"'{PYTHON_STDLIB}' (--corpus)")
    files: list[Path] = []
    seen: set[Path] = set()
    for spec in specs:
        for path in _resolve_spec(str(spec)):
            key = path if is_hub_name(path) else path.resolve()
            if key not in seen:
                seen.add(key)
                files.append(path)
    if all(path.is_file() and path.stat().st_size == 0 for path in files):
        raise DataError(f"corpus {specs!r} matched {len(files)} files but all are empty: "
                        "point --corpus at files that contain text")
    return files


def is_hub_name(path: Path) -> bool:
    return str(path).startswith(HUB_PREFIX)


def is_saved_dataset(path: Path) -> bool:
    """Whether `path` is a directory written by ``datasets``' ``save_to_disk``."""
    return path.is_dir() and any((path / name).is_file() for name in _SAVED_DATASET_MARKERS)


def _resolve_spec(spec: str) -> list[Path]:
    """The sorted inputs of one spec; `DataError` when there are none."""
    if spec == PYTHON_STDLIB:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = _walk(root, suffix=".py", skip_dirs=_EXCLUDED_STDLIB_DIRS)
        where = f"no .py files under {str(root)!r}"
    elif spec.startswith(HUB_PREFIX):
        return [Path(spec)]
    elif any(char in _GLOB_CHARACTERS for char in spec):
        files = []
        for match in sorted(glob.glob(spec, recursive=True)):
            path = Path(match)
            files.extend(_walk(path) if path.is_dir() else [path] if path.is_file() else [])
        where = "the glob matched no files"
    else:
        path = Path(spec)
        if not path.exists():
            raise DataError(f"corpus {spec!r} matched no files: the path does not exist; "
                            "check the spelling or use an absolute path")
        files = _walk(path) if path.is_dir() else [path]
        where = "the directory holds no files (hidden files and __pycache__ are skipped)"
    if not files:
        raise DataError(f"corpus {spec!r} matched no files: {where}")
    return sorted(set(files))


def _walk(root: Path, *, suffix: str = "", skip_dirs: frozenset[str] = frozenset()) -> list[Path]:
    """Regular files below `root` ending in `suffix`, and saved datasets as one entry each.

    Hidden entries (.git), __pycache__ (bytecode) and `skip_dirs` are pruned during the walk,
    not filtered afterwards: the stdlib's site-packages can hold far more files than the stdlib.
    """
    files = []
    for directory, dirnames, filenames in os.walk(root):
        if is_saved_dataset(Path(directory)):  # its Arrow files are rows, not text documents
            files.append(Path(directory))
            dirnames[:] = []
            continue
        dirnames[:] = [name for name in dirnames if not (
            name.startswith(".") or name == "__pycache__" or name in skip_dirs)]
        files.extend(Path(directory, name) for name in filenames
                     if name.endswith(suffix) and not name.startswith(".")
                     and os.path.isfile(os.path.join(directory, name)))
    return files


@dataclass
class ReadStats:
    """What `iter_documents` saw; filled in as the documents are consumed."""

    files: int = 0  # inputs opened (files, datasets)
    documents: int = 0
    replaced_utf8_files: int = 0  # inputs with bytes that are not UTF-8, decoded with U+FFFD
    replaced_utf8_documents: int = 0  # documents among them that hold a replacement


def iter_documents(paths: Iterable[Path], *, text_field: str = DEFAULT_TEXT_FIELD,
                   stats: ReadStats | None = None) -> Iterator[str]:
    """Yield the non-empty documents of `paths` in order (see the module docstring for formats).

    Text files are read as bytes and decoded without newline translation, so a text file's
    document is exactly its content (CRLF stays CRLF). When the iteration ends, one warning
    reports how many inputs had undecodable bytes. Pass `stats` to get the counts back.
    """
    stats = stats if stats is not None else ReadStats()
    for path in paths:
        path = Path(path)
        stats.files += 1
        replaced_before = stats.replaced_utf8_documents
        for document in _documents_of(path, text_field=text_field, stats=stats):
            if document:
                stats.documents += 1
                yield document
        stats.replaced_utf8_files += stats.replaced_utf8_documents > replaced_before
    if stats.replaced_utf8_files:
        warnings.warn(f"{stats.replaced_utf8_files} of {stats.files} corpus files are not valid "
                      f"UTF-8 ({stats.replaced_utf8_documents} documents); their bad bytes were "
                      "replaced by U+FFFD", stacklevel=2)


def _documents_of(path: Path, *, text_field: str, stats: ReadStats) -> Iterator[str]:
    """The documents of one input, by its kind."""
    if is_hub_name(path):
        yield from _hub_documents(str(path)[len(HUB_PREFIX):], text_field=text_field)
    elif path.is_dir():
        yield from _saved_dataset_documents(path, text_field=text_field)
    elif path.suffix == ".jsonl":
        yield from _jsonl_documents(path, text_field=text_field, stats=stats)
    elif path.suffix == ".parquet":
        yield from _parquet_documents(path, text_field=text_field)
    else:
        text, replaced = read_text(path)
        stats.replaced_utf8_documents += replaced
        yield text


def read_text(path: Path) -> tuple[str, bool]:
    """The text of `path` and whether any bytes had to be replaced (it was not valid UTF-8)."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise _unreadable(path, error) from error
    return decode_utf8(data)


def decode_utf8(data: bytes) -> tuple[str, bool]:
    """`data` as text, and whether bytes that are not UTF-8 were replaced by U+FFFD."""
    # Strict first: U+FFFD may legitimately occur in a file, so only a decode error tells.
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        return data.decode("utf-8", errors="replace"), True


def _unreadable(path: Path, error: OSError) -> DataError:
    return DataError(f"cannot read corpus file {str(path)!r}: {error.strerror}; "
                     "check that it exists and is readable")


def _jsonl_documents(path: Path, *, text_field: str, stats: ReadStats) -> Iterator[str]:
    """The `text_field` of each non-blank line of a JSONL file, read one line at a time."""
    try:
        source = open(path, "rb")
    except OSError as error:
        raise _unreadable(path, error) from error
    with source:
        # Binary lines split on b"\n" only: JSON strings may hold a raw U+2028, which
        # text-mode line splitting would treat as a line end.
        for line_number, raw in enumerate(source, start=1):
            line, replaced = decode_utf8(raw)
            if not line.strip():
                continue
            stats.replaced_utf8_documents += replaced
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{str(path)!r} line {line_number} is not valid JSON "
                                f"({error.msg}): each line of a .jsonl file must be one JSON "
                                "object") from error
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                found = sorted(record) if isinstance(record, dict) else type(record).__name__
                strings = [k for k, v in record.items() if isinstance(v, str)] \
                    if isinstance(record, dict) else []
                raise DataError(f"{str(path)!r} line {line_number} has no string "
                                f"\"{text_field}\" field (found {found}): write each document "
                                f"as {{\"{text_field}\": \"...\"}} or name the field with "
                                f"{_TEXT_FIELD_OPTION.format(strings[0] if strings else 'FIELD')}")
            yield record[text_field]


# The one option that chooses the text field (there is no config key: the field is read only
# when the corpus is tokenized).
_TEXT_FIELD_OPTION = "`--text-field {}` (of `pretrain preprocess` and `pretrain tokenizer`)"


def _missing_field(where: str, *, text_field: str, columns: list[str]) -> DataError:
    return DataError(f"{where} has no text column {text_field!r} (columns: {columns}): name "
                     f"it with {_TEXT_FIELD_OPTION.format(columns[0] if columns else 'FIELD')}")


def _parquet_documents(path: Path, *, text_field: str) -> Iterator[str]:
    """The `text_field` column of a parquet file, one record batch at a time."""
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{str(path)!r} is not a readable parquet file ({error}); "
                        "check the file or give its text another extension") from error
    columns = parquet.schema_arrow.names
    if text_field not in columns:
        raise _missing_field(repr(str(path)), text_field=text_field, columns=columns)
    for batch in parquet.iter_batches(batch_size=_BATCH_ROWS, columns=[text_field]):
        yield from _strings(batch.column(0).to_pylist(), where=str(path), text_field=text_field)


def _saved_dataset_documents(path: Path, *, text_field: str) -> Iterator[str]:
    """Rows of a ``save_to_disk`` directory (memory-mapped Arrow: nothing is loaded whole)."""
    import datasets

    if not is_saved_dataset(path):
        raise DataError(f"{str(path)!r} is a directory but not a saved `datasets` dataset "
                        f"(no {' or '.join(_SAVED_DATASET_MARKERS)}): give its files instead")
    dataset = datasets.load_from_disk(str(path))
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise DataError(f"{str(path)!r} holds the splits {sorted(dataset)} and no 'train': "
                            "save the split to use with `dataset[split].save_to_disk(...)`")
        dataset = dataset["train"]
    if text_field not in dataset.column_names:
        raise _missing_field(repr(str(path)), text_field=text_field,
                             columns=dataset.column_names)
    for batch in dataset.select_columns([text_field]).iter(batch_size=_BATCH_ROWS):
        yield from _strings(batch[text_field], where=str(path), text_field=text_field)


def _hub_documents(name: str, *, text_field: str) -> Iterator[str]:
    """Rows of a hub dataset, streamed (nothing is downloaded ahead of the reader)."""
    import datasets

    name, _, split = name.partition(":")
    dataset = datasets.load_dataset(name, split=split or "train", streaming=True)
    for row in dataset:
        if text_field not in row:
            raise _missing_field(f"hub dataset {name!r}", text_field=text_field,
                                 columns=sorted(row))
        yield from _strings([row[text_field]], where=name, text_field=text_field)


def _strings(values: list, *, where: str, text_field: str) -> Iterator[str]:
    """The non-null values of a text column; a column of another type is an error."""
    for value in values:
        if value is None:
            continue
        if not isinstance(value, str):
            raise DataError(f"{where!r} column {text_field!r} holds {type(value).__name__} "
                            "values, not text: choose a string column with --text-field")
        yield value
