"""Tokenize a corpus into an indexed dataset (``prefix.bin`` / ``prefix.idx``).

The main process reads documents in corpus order and hands chunks of them to a pool of
tokenizer processes; results are written back in submission order, so the output is
byte-identical for any number of workers. Every document ends with the tokenizer's eos id, the
boundary marker that packed training samples rely on.
"""
from __future__ import annotations

import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pretrain.data.corpus import DEFAULT_TEXT_FIELD, ReadStats, iter_documents
from pretrain.data.indexed import IndexedDatasetWriter, best_dtype
from pretrain.data.tokenizer import Tokenizer
from pretrain.errors import DataError

_CHUNK_CHARACTERS = 1 << 20  # ~1 MB of text per task: large enough to amortise the pickling
_CHUNK_DOCUMENTS = 512  # ... and bounded in count for corpora of many short documents
_TASKS_PER_WORKER = 2  # chunks in flight per worker: keeps workers busy, bounds memory
_ROW_SUFFIXES = (".jsonl", ".parquet")  # files holding many documents

Chunk = list[str]
Encoded = list[np.ndarray]


def preprocess(paths: Sequence[Path], *, tokenizer_path: str | Path, output_prefix: str | Path,
               workers: int = 1, text_field: str = DEFAULT_TEXT_FIELD, append_eod: bool = True,
               show_progress: bool = True) -> dict:
    """Tokenize the documents of `paths` (see `resolve_corpus`) into ``output_prefix.bin/.idx``.

    Returns ``{"documents", "tokens", "replaced_utf8_files", "replaced_utf8_documents",
    "seconds", "vocab_size", "eos"}`` (eos: the id and text of the end-of-document token
    appended, "" without). On any error the temporary files are removed and no ``.bin``/``.idx``
    is created. The progress bar shows documents/s and tokens/s.
    """
    if workers < 1:
        raise DataError(f"preprocessing workers must be >= 1, got {workers}")
    tokenizer = Tokenizer.load(tokenizer_path)
    if append_eod and tokenizer.eos_id < 0:
        raise DataError(f"tokenizer {str(tokenizer_path)!r} has no eos token to end documents "
                        "with: train one with `pretrain tokenizer` (eos id 2)")
    paths = [Path(path) for path in paths]
    read_stats = ReadStats()
    chunks = _chunk_documents(iter_documents(paths, text_field=text_field, stats=read_stats))
    # Each non-empty text file is one document; other inputs hold an unknown number of rows.
    total = None if any(not path.is_file() or path.suffix in _ROW_SUFFIXES for path in paths) \
        else sum(1 for path in paths if path.stat().st_size > 0)
    start = time.perf_counter()
    tokens = 0
    with IndexedDatasetWriter(output_prefix, dtype=best_dtype(tokenizer.vocab_size)) as writer, \
            _encoder(tokenizer, workers=workers, append_eod=append_eod) as encode, \
            tqdm(total=total, unit="doc", desc="tokenize", disable=not show_progress) as bar:
        for encoded in encode(chunks):
            for ids in encoded:
                writer.add_document(ids)
                tokens += len(ids)
            bar.update(len(encoded))
            bar.set_postfix_str(f"{tokens / max(time.perf_counter() - start, 1e-9):,.0f} tok/s",
                                refresh=False)
        if writer.num_documents == 0:
            raise DataError(f"no non-empty documents in the {len(paths)} corpus files: "
                            "check --corpus (JSONL documents need a non-empty \"text\")")
        documents = writer.num_documents
    return {"documents": documents, "tokens": tokens,
            "replaced_utf8_files": read_stats.replaced_utf8_files,
            "replaced_utf8_documents": read_stats.replaced_utf8_documents,
            "seconds": time.perf_counter() - start, "vocab_size": tokenizer.vocab_size,
            "eos": f"{tokenizer.eos_id} {tokenizer.token(tokenizer.eos_id)}" if append_eod else ""}


def _chunk_documents(documents: Iterable[str]) -> Iterator[Chunk]:
    """Group documents into chunks of about `_CHUNK_CHARACTERS`, in order."""
    chunk: Chunk = []
    size = 0
    for document in documents:
        chunk.append(document)
        size += len(document)
        if size >= _CHUNK_CHARACTERS or len(chunk) >= _CHUNK_DOCUMENTS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


@contextmanager
def _encoder(tokenizer: Tokenizer, *, workers: int,
             append_eod: bool) -> Iterator[Callable[[Iterable[Chunk]], Iterator[Encoded]]]:
    """A function mapping chunks to encoded chunks in order, in-process or with worker processes.

    Why not ``Pool.imap``: its feeder thread reads the whole corpus into memory ahead of the
    workers, and a worker that dies (out of memory, killed) makes it wait forever. Here a bounded
    window of futures is in flight, and a dead worker raises ``BrokenProcessPool``. Workers are
    spawned, not forked: forking a process that runs torch's or gloo's threads can deadlock.
    """
    if workers == 1:
        yield lambda chunks: (_encode_chunk(tokenizer, chunk, append_eod) for chunk in chunks)
        return
    # Workers get the model's path, not its bytes: spawn writes the initializer's arguments
    # into a pipe, which blocks on anything over 64 KB if the child dies before reading it.
    executor = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_worker,
                                   initargs=(str(tokenizer.path), tokenizer.sha256, append_eod))

    def encode(chunks: Iterable[Chunk]) -> Iterator[Encoded]:
        pending: deque[Future] = deque()
        try:
            for chunk in chunks:
                pending.append(executor.submit(_encode_in_worker, chunk))
                if len(pending) >= _TASKS_PER_WORKER * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        except BrokenProcessPool as error:
            raise RuntimeError(
                "a preprocessing worker failed to start or died (see the error above; out of "
                "memory? killed?); when calling preprocess(workers > 1) from a script, guard "
                "it with `if __name__ == \"__main__\":` (spawned workers import the script)"
            ) from error

    try:
        yield encode
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


def _encode_chunk(tokenizer: Tokenizer, chunk: Chunk, append_eod: bool) -> Encoded:
    """Token ids of each document (int32 arrays: compact to send back from a worker)."""
    suffix = [tokenizer.eos_id] if append_eod else []
    return [np.asarray(ids + suffix, dtype=np.int32) for ids in tokenizer.encode_batch(chunk)]


_worker_state: dict = {}  # per worker process: the tokenizer and append_eod, set once


def _init_worker(tokenizer_path: str, sha256: str, append_eod: bool) -> None:
    # One process per core already: a Rust tokenizer's own thread pool would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tokenizer = Tokenizer.load(tokenizer_path)
    if tokenizer.sha256 != sha256:
        raise DataError(f"tokenizer {tokenizer_path!r} changed while preprocessing: "
                        "do not train a tokenizer into the same path during a run")
    _worker_state.update(tokenizer=tokenizer, append_eod=append_eod)


def _encode_in_worker(chunk: Chunk) -> Encoded:
    return _encode_chunk(_worker_state["tokenizer"], chunk, _worker_state["append_eod"])
