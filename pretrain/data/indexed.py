"""Megatron-LM's ``MMIDIDX`` indexed dataset: token ids in ``.bin``, their layout in ``.idx``.

The files are byte-compatible with Megatron-LM (``megatron/core/datasets/indexed_dataset.py``),
so datasets preprocessed by either tool load in the other. Layout of ``prefix.idx``, little
endian::

    b"MMIDIDX\\x00\\x00"           9 bytes  magic
    version                      <Q       always 1
    dtype code                   <B       1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                                          6 float64, 7 float32, 8 uint16
    sequence count S             <Q
    document count D             <Q       number of documents + 1
    sequence lengths             int32[S] tokens per sequence
    sequence pointers            int64[S] byte offset of each sequence in .bin
    document indices             int64[D] sequence index where each document starts, then S

``prefix.bin`` is the sequences' tokens back to back in the dtype. Megatron can split a
document into several sequences (sentences); this writer stores one sequence per document,
so ``document_indices == [0, 1, ..., S]``. The reader accepts either.

Both files are memory-mapped: opening a 100 GB dataset reads only its index.
"""
from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import numpy as np

from pretrain import storage
from pretrain.errors import DataError
from pretrain.mounts import node_local_scratch

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
    5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_CODES.items()}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count


def best_dtype(vocab_size: int) -> np.dtype:
    """The smallest token dtype for `vocab_size` (Megatron's rule: uint16 below 65,500)."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def index_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


def data_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def encode_index(*, dtype: np.dtype, sequence_lengths: np.ndarray,
                 document_indices: np.ndarray) -> bytes:
    """The bytes of a ``.idx`` file; pointers follow from the lengths and the dtype's size."""
    lengths = np.asarray(sequence_lengths, dtype=np.int64)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1] * np.dtype(dtype).itemsize, out=pointers[1:])
    header = _HEADER.pack(INDEX_MAGIC, INDEX_VERSION, _CODE_OF_DTYPE[np.dtype(dtype)],
                          len(lengths), len(document_indices))
    return b"".join([header, lengths.astype("<i4").tobytes(), pointers.astype("<i8").tobytes(),
                     np.asarray(document_indices, dtype="<i8").tobytes()])


# A dataset in the object store is read from a node-local copy, in a cache of at most this many
# bytes (`PRETRAIN_STORE_CACHE_GB`, default 200) under the node's scratch directory.
STORE_CACHE = "pretrain-store-data"
STORE_CACHE_GB_ENV, STORE_CACHE_GB = "PRETRAIN_STORE_CACHE_GB", 200.0


class IndexedDatasetWriter:
    """Write ``prefix.bin`` / ``prefix.idx``, one sequence per document, all or nothing.

    Tokens stream to ``prefix.bin.tmp``; `finalize` writes ``prefix.idx.tmp`` and renames both
    (``.bin`` first, so an ``.idx`` is never newer than its data). A prefix at ``s3://`` is
    written into the node's cache of the store's datasets (`store_copy`), then uploaded,
    ``.bin`` first for the same reason. Leaving the ``with`` block
    normally finalizes; an exception (or `abort`) deletes the temporary files, so a failed run
    leaves nothing that looks like a dataset::

        with IndexedDatasetWriter("runs/data/stdlib", dtype=best_dtype(tok.vocab_size)) as w:
            for ids in documents:
                w.add_document(ids)
    """

    def __init__(self, prefix: str | Path, *, dtype: np.dtype | type) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF_DTYPE:
            raise DataError(f"token dtype {self.dtype} is not in the MMIDIDX format: use one of "
                            f"{', '.join(str(d) for d in DTYPE_CODES.values())}")
        # a dataset for the store is written into the node's cache of it, then uploaded
        self.url = str(prefix) if storage.is_remote(str(prefix)) else None
        if self.url is not None:
            prefix = node_local_scratch() / STORE_CACHE / self.url[len(storage.SCHEME) + 3:]
        self.prefix = Path(prefix)
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self._tmp_bin = Path(f"{data_path(prefix)}.tmp")
        self._tmp_idx = Path(f"{index_path(prefix)}.tmp")
        self._bin = open(self._tmp_bin, "wb")
        self._lengths: list[int] = []
        self._document_indices: list[int] = [0]
        self._limits = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        self._done = False

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._done:
            return
        if exc_type is None:
            self.finalize()
        else:
            self.abort()

    @property
    def num_documents(self) -> int:
        return len(self._lengths)

    def add_document(self, ids: Sequence[int] | np.ndarray) -> None:
        """Append one document (one sequence) of token ids."""
        array = np.asarray(ids)
        if array.ndim != 1:
            raise DataError(f"a document must be a 1-d sequence of token ids, got shape "
                            f"{array.shape}")
        if array.size and self._limits is not None:
            if array.dtype.kind not in "iu":
                raise DataError(f"token ids must be integers, got {array.dtype}")
            low, high = int(array.min()), int(array.max())
            if low < self._limits.min or high > self._limits.max:
                raise DataError(f"token id {high if high > self._limits.max else low} does not "
                                f"fit in {self.dtype}: write with dtype=best_dtype(vocab_size)")
        if array.size > np.iinfo(np.int32).max:
            raise DataError(f"a document of {array.size} tokens exceeds the format's int32 "
                            "length: split it into smaller documents")
        self._bin.write(array.astype(self.dtype, copy=False).tobytes())
        self._lengths.append(int(array.size))
        self._document_indices.append(len(self._lengths))

    def append_dataset(self, dataset: IndexedDataset) -> None:
        """Append all sequences and documents of another dataset of the same dtype."""
        if dataset.dtype != self.dtype:
            raise DataError(f"cannot merge {str(dataset.prefix)!r} ({dataset.dtype}) into a "
                            f"{self.dtype} dataset: re-run preprocessing with one tokenizer")
        first = len(self._lengths)
        with open(data_path(dataset.prefix), "rb") as source:
            shutil.copyfileobj(source, self._bin, length=1 << 24)
        self._lengths.extend(dataset.sizes.tolist())
        self._document_indices.extend((dataset.document_indices[1:] + first).tolist())

    def finalize(self) -> None:
        """Write the index and move both files into place."""
        if self._done:
            raise RuntimeError(f"dataset writer for {str(self.prefix)!r} is already closed")
        try:
            self._bin.close()
            self._tmp_idx.write_bytes(encode_index(
                dtype=self.dtype, sequence_lengths=np.asarray(self._lengths, dtype=np.int64),
                document_indices=np.asarray(self._document_indices, dtype=np.int64)))
            os.replace(self._tmp_bin, data_path(self.prefix))
            os.replace(self._tmp_idx, index_path(self.prefix))
        except BaseException:
            self.abort()
            raise
        self._done = True
        if self.url is not None:
            try:
                for local in (data_path(self.prefix), index_path(self.prefix)):
                    storage.put_file(local, f"{self.url}{local.suffix}")
            except Exception as exc:  # noqa: BLE001 - the store's errors have no common base
                raise DataError(f"{self.url}.bin/.idx could not be uploaded ({type(exc).__name__}"
                                f": {(str(exc).splitlines() or [''])[0][:200]}); the dataset "
                                f"is in {self.prefix}.bin/.idx") from None

    def abort(self) -> None:
        """Close and delete the temporary files; nothing is left behind."""
        self._bin.close()
        for path in (self._tmp_bin, self._tmp_idx):
            path.unlink(missing_ok=True)
        self._done = True


def store_copy(prefix: str) -> Path:
    """The local prefix of the node's copy of the dataset `prefix` (`s3://bucket/key`): its
    .idx and .bin downloaded once per node into a bounded cache (`storage.local_copies`), so
    every rank reads the same bytes as from local files; the sample indices are cached beside
    the copy."""
    limit = float(os.environ.get(STORE_CACHE_GB_ENV) or STORE_CACHE_GB)
    try:
        idx, _ = storage.local_copies([f"{prefix}.idx", f"{prefix}.bin"],
                                      cache_dir=node_local_scratch() / STORE_CACHE,
                                      max_bytes=int(limit * 2**30))
    except storage.StoreError as error:
        raise DataError(f"indexed dataset {prefix!r}: {error}") from None
    return idx.with_suffix("")


class IndexedDataset:
    """A read-only, memory-mapped ``prefix.bin`` / ``prefix.idx`` pair.

    ``dataset[i]`` is sequence i (one document, for data written by this package) as a NumPy
    array that views the mapped file. Opening checks the header and that the ``.bin`` size
    matches the index, so a truncated copy fails here with both numbers instead of returning
    garbage tokens mid-run.
    """

    def __init__(self, prefix: str | Path) -> None:
        if storage.is_remote(str(prefix)):  # s3://...: the node's copy (`store_copy`)
            prefix = store_copy(str(prefix))
        self.prefix = Path(prefix)
        idx, bin_ = index_path(prefix), data_path(prefix)
        for path in (idx, bin_):
            if not path.is_file():
                raise DataError(f"indexed dataset file {str(path)!r} not found: run `pretrain "
                                "preprocess` first (data.dataset is the path without .bin/.idx)")
        if idx.stat().st_size < _HEADER.size:
            raise DataError(f"{str(idx)!r} is not an MMIDIDX index: {idx.stat().st_size} bytes "
                            f"is shorter than its {_HEADER.size}-byte header; re-run "
                            "`pretrain preprocess`")
        index = np.memmap(idx, dtype=np.uint8, mode="r")
        self.dtype, sequence_count, document_count = _read_header(index, idx)
        lengths_end = _HEADER.size + 4 * sequence_count
        pointers_end = lengths_end + 8 * sequence_count
        documents_end = pointers_end + 8 * document_count
        if index.size < documents_end:
            raise DataError(f"index {str(idx)!r} is truncated: {index.size} bytes, the header "
                            f"announces {documents_end}; re-run `pretrain preprocess`")
        self.sizes = index[_HEADER.size:lengths_end].view("<i4")
        self._pointers = index[lengths_end:pointers_end].view("<i8")
        self.document_indices = index[pointers_end:documents_end].view("<i8")
        self.num_tokens = int(self.sizes.sum(dtype=np.int64))

        expected = self.num_tokens * self.dtype.itemsize
        actual = bin_.stat().st_size
        if actual != expected:
            raise DataError(f"{str(bin_)!r} has {actual} bytes but its index describes "
                            f"{expected} ({self.num_tokens} tokens of {self.dtype}): the files "
                            "are truncated or from different runs; re-run `pretrain preprocess`")
        # Cheap consistency checks (O(1)): a damaged index fails here, not as garbage samples.
        last_end = (int(self._pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize
                    if sequence_count else 0)
        if last_end != expected or document_count == 0 or self.document_indices[0] != 0 \
                or self.document_indices[-1] != sequence_count:
            raise DataError(f"index {str(idx)!r} has inconsistent pointers or document "
                            "indices: the file is damaged; re-run `pretrain preprocess`")
        # np.memmap cannot map an empty file; an empty dataset has no tokens to view anyway.
        self._tokens = (np.memmap(bin_, dtype=self.dtype, mode="r") if actual
                        else np.zeros(0, dtype=self.dtype))

    def __getstate__(self) -> dict:
        # Pickle the path, not the mapped arrays: DataLoader workers re-open the files.
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])

    def __len__(self) -> int:
        """The number of sequences (= documents for data written by this package)."""
        return len(self.sizes)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence `index` (to its end by default)."""
        size = len(self.sizes)
        if not -size <= index < size:
            raise IndexError(f"sequence {index} out of range for {size} sequences")
        index %= size
        sequence_length = int(self.sizes[index])
        length = sequence_length - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > sequence_length:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence "
                             f"{index} of length {sequence_length}")
        start = int(self._pointers[index]) // self.dtype.itemsize + offset
        return self._tokens[start:start + length]

    def __repr__(self) -> str:
        return (f"IndexedDataset({str(self.prefix)!r}, sequences={len(self)}, "
                f"tokens={self.num_tokens}, dtype={self.dtype})")


def _read_header(index: np.ndarray, path: Path) -> tuple[np.dtype, int, int]:
    """Check magic, version and dtype; return (dtype, sequence count, document count)."""
    if bytes(index[:len(INDEX_MAGIC)]) != INDEX_MAGIC:
        raise DataError(f"{str(path)!r} is not an MMIDIDX index (magic "
                        f"{bytes(index[:len(INDEX_MAGIC)])!r}, expected {INDEX_MAGIC!r}): "
                        "point data.dataset at the prefix written by `pretrain preprocess`")
    _, version, code, sequence_count, document_count = _HEADER.unpack(
        bytes(index[:_HEADER.size]))
    if version != INDEX_VERSION:
        raise DataError(f"{str(path)!r} has index version {version}; only version "
                        f"{INDEX_VERSION} is supported: re-run `pretrain preprocess`")
    if code not in DTYPE_CODES:
        raise DataError(f"{str(path)!r} has unknown dtype code {code} (known: "
                        f"{sorted(DTYPE_CODES)}): the file is damaged; "
                        "re-run `pretrain preprocess`")
    return DTYPE_CODES[code], sequence_count, document_count


def merge_datasets(prefixes: Sequence[str | Path], output_prefix: str | Path) -> IndexedDataset:
    """Concatenate datasets (e.g. shards preprocessed separately) into one, in the given order."""
    if not prefixes:
        raise DataError("merge_datasets needs at least one dataset prefix")
    datasets = [IndexedDataset(prefix) for prefix in prefixes]
    with IndexedDatasetWriter(output_prefix, dtype=datasets[0].dtype) as writer:
        for dataset in datasets:
            writer.append_dataset(dataset)
    return IndexedDataset(output_prefix)
