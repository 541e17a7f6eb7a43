"""Find the files of a text corpus and read them as documents.

A corpus is a list of specs, each one of:

- a file: one document per file, or one per line of a ``.jsonl`` file (its ``"text"`` field);
- a directory: every file below it, recursively (hidden entries and ``__pycache__`` skipped);
- a glob such as ``data/**/*.txt`` (``**`` crosses directories);
- ``python-stdlib``: the ``.py`` sources of the running interpreter's standard library, without
  ``site-packages``/``dist-packages`` (about 1,800 files, 31 MB on CPython 3.11): a real code
  corpus that every machine has, used by the tests, the examples and the benchmarks.

Paths are sorted within each spec and de-duplicated across specs, so the same specs give the same
document order on every machine, which the preprocessed dataset and the data order rely on.

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
_EXCLUDED_STDLIB_DIRS = frozenset({"site-packages", "dist-packages"})
_GLOB_CHARACTERS = set("*?[")


def resolve_corpus(specs: list[str]) -> list[Path]:
    """Expand corpus specs (files, directories, globs, ``python-stdlib``) into a list of files.

    Raises `DataError` when a spec matches nothing, or when every matched file is empty, so that
    a typo in a path fails here rather than as an empty dataset an hour later.
    """
    if isinstance(specs, (str, Path)):
        specs = [str(specs)]
    if not specs:
        raise DataError("corpus is empty: give at least one file, directory, glob or "
                        f"'{PYTHON_STDLIB}' (data.corpus in the run config)")
    files: list[Path] = []
    seen: set[Path] = set()
    for spec in specs:
        for path in _resolve_spec(str(spec)):
            key = path.resolve()
            if key not in seen:
                seen.add(key)
                files.append(path)
    if all(path.stat().st_size == 0 for path in files):
        raise DataError(f"corpus {specs!r} matched {len(files)} files but all are empty: "
                        "point data.corpus at files that contain text")
    return files


def _resolve_spec(spec: str) -> list[Path]:
    """The sorted files of one spec; `DataError` when there are none."""
    if spec == PYTHON_STDLIB:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = _walk(root, suffix=".py", skip_dirs=_EXCLUDED_STDLIB_DIRS)
        where = f"no .py files under {str(root)!r}"
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
    return sorted(files)


def _walk(root: Path, *, suffix: str = "", skip_dirs: frozenset[str] = frozenset()) -> list[Path]:
    """Regular files below `root` ending in `suffix`.

    Hidden entries (.git), __pycache__ (bytecode) and `skip_dirs` are pruned during the walk,
    not filtered afterwards: the stdlib's site-packages can hold far more files than the stdlib.
    """
    files = []
    for directory, dirnames, filenames in os.walk(root):
        dirnames[:] = [name for name in dirnames if not (
            name.startswith(".") or name == "__pycache__" or name in skip_dirs)]
        files.extend(Path(directory, name) for name in filenames
                     if name.endswith(suffix) and not name.startswith(".")
                     and os.path.isfile(os.path.join(directory, name)))
    return files


@dataclass
class ReadStats:
    """What `iter_documents` saw; filled in as the documents are consumed."""

    files: int = 0
    documents: int = 0
    replaced_utf8_files: int = 0  # files with bytes that are not UTF-8, decoded with U+FFFD


def iter_documents(paths: Iterable[Path], *, stats: ReadStats | None = None) -> Iterator[str]:
    """Yield the non-empty documents of `paths` in order: one per text file, one per JSONL line.

    Files are read as bytes and decoded without newline translation, so a text file's document
    is exactly its content (CRLF stays CRLF). When the iteration ends, one warning reports how
    many files had undecodable bytes. Pass `stats` to get the counts back.
    """
    stats = stats if stats is not None else ReadStats()
    for path in paths:
        path = Path(path)
        text, replaced = read_text(path)
        stats.files += 1
        stats.replaced_utf8_files += replaced
        documents = _jsonl_documents(path, text) if path.suffix == ".jsonl" else [text]
        for document in documents:
            if document:
                stats.documents += 1
                yield document
    if stats.replaced_utf8_files:
        warnings.warn(f"{stats.replaced_utf8_files} of {stats.files} corpus files are not valid "
                      "UTF-8; their bad bytes were replaced by U+FFFD", stacklevel=2)


def read_text(path: Path) -> tuple[str, bool]:
    """The text of `path` and whether any bytes had to be replaced (it was not valid UTF-8)."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise DataError(f"cannot read corpus file {str(path)!r}: {error.strerror}; "
                        "check that it exists and is readable") from error
    # Strict first: U+FFFD may legitimately occur in a file, so only a decode error tells.
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        return data.decode("utf-8", errors="replace"), True


def _jsonl_documents(path: Path, text: str) -> Iterator[str]:
    """The ``"text"`` field of each non-blank line of a JSONL file."""
    # split("\n"), not splitlines(): JSON strings may hold a raw U+2028, which splitlines splits.
    for line_number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{str(path)!r} line {line_number} is not valid JSON ({error.msg}): "
                            "each line of a .jsonl file must be one JSON object") from error
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            found = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise DataError(f"{str(path)!r} line {line_number} has no string \"text\" field "
                            f"(found {found}): write each document as {{\"text\": \"...\"}}")
        yield record["text"]
