"""Packed training samples and the global order in which data-parallel ranks read them.

Packing (Megatron-style, no padding):

- Documents are split into train/valid/test by a seeded permutation of document ids: the
  permutation is cut into [train | valid | test], with ``ceil(valid_fraction * N)`` validation
  and ``ceil(test_fraction * N)`` test documents (at least one each when its fraction is > 0,
  and never all of them: train keeps at least one). With ``test_fraction = 0`` the split is
  what it was before the test split existed. The permutation is a hash of
  (document id, seed), not NumPy's RNG, so the split and the order never change with a NumPy
  upgrade, which would silently break exact resume.
- A split's documents, in permuted order, form one token stream. Sample i is
  ``stream[i*L : i*L + L + 1]`` for ``L = seq_length``: inputs are its first L tokens and labels
  its last L, so consecutive samples share one token. There are ``(tokens - 1) // L`` samples.
- Every document ends with eos (see `pretrain.data.preprocess`), so a sample only crosses a
  document boundary through an eos token.
- The (sequence position, offset) of each sample's first token is computed with NumPy
  (cumulative sizes + searchsorted) and cached as ``prefix.<split>_<key>.npy``, keyed by the
  dataset's sizes and every parameter above, so a changed seq_length never reuses a stale index.
- Samples are served in a seeded shuffled order (``PackedSamples.order``, cached beside the
  index as ``prefix.<split>_<key>.order.npy``), so a batch holds samples from all over the
  corpus; ``sample_tokens(i)`` is the i-th sample of the unshuffled stream.

Global order (`micro_batch_indices`): optimizer step s consumes samples ``[s*G, (s+1)*G)`` with
``G = micro_batch_size * grad_accum * dp_size``; micro-step a of step s reads the block of
``micro_batch_size * dp_size`` samples at ``s*G + a*micro_batch_size*dp_size``, and dp rank r
takes the r-th slice of it. The sequence of samples is therefore the same for every dp size, and
resuming from ``consumed_samples`` continues it exactly. Past the end of the split the index
wraps around (modulo the number of samples): later epochs repeat the first one's order.

Excluded samples (`stream_numbers`): a run may leave global sample numbers out of its stream
(``data.exclude_samples``, and the quarantine a loss-spike rollback keeps in checkpoints). The
k-th sample the run trains on is then the k-th number not excluded, so ``consumed_samples``
still counts samples trained on and every layout reads the same stream.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from pretrain.data.indexed import IndexedDataset
from pretrain.errors import DataError
from pretrain.files import atomic_file

SPLITS = ("train", "valid", "test")
SAMPLE_INDEX_VERSION = 1  # bump when the index layout or its derivation changes


def seeded_permutation(n: int, *, seed: int) -> np.ndarray:
    """A permutation of ``range(n)``: ids sorted by a splitmix64 hash of (id, seed).

    Defined here rather than by ``np.random`` so that it is fixed forever: NumPy does not
    promise the same stream from one version to the next.
    """
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as splitmix64 intends
        # The i-th output of splitmix64 seeded with `seed`, for i = 1..n.
        z = np.uint64(seed % 2**64) + np.arange(1, n + 1, dtype=np.uint64) \
            * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return np.argsort(z, kind="stable").astype(np.int64)


def split_documents(num_documents: int, *, split: str, valid_fraction: float,
                    test_fraction: float = 0.0, seed: int) -> np.ndarray:
    """The document ids of `split`, in the order they are packed into its token stream."""
    if split not in SPLITS:
        raise DataError(f"split {split!r} is not one of {', '.join(SPLITS)}")
    if not (0.0 <= valid_fraction < 1.0 and 0.0 <= test_fraction < 1.0
            and valid_fraction + test_fraction < 1.0):
        raise DataError(f"valid_fraction {valid_fraction} and test_fraction {test_fraction} "
                        "must each be in [0, 1) and leave documents for training")
    num_valid = _held_out(valid_fraction, num_documents, available=num_documents - 1)
    num_test = _held_out(test_fraction, num_documents, available=num_documents - 1 - num_valid)
    num_train = num_documents - num_valid - num_test
    bounds = {"train": (0, num_train), "valid": (num_train, num_train + num_valid),
              "test": (num_train + num_valid, num_documents)}[split]
    return seeded_permutation(num_documents, seed=seed)[bounds[0]:bounds[1]]


def _held_out(fraction: float, num_documents: int, *, available: int) -> int:
    """Documents held out for a fraction: ceil(fraction * N), at least 1, at most `available`."""
    if fraction <= 0 or available < 1:
        return 0
    # The epsilon keeps float noise (0.1 * 30 = 3.0000000000000004) from adding a document.
    return min(max(math.ceil(fraction * num_documents - 1e-9), 1), available)


class PackedSamples(Dataset):
    """Samples of ``seq_length + 1`` tokens packed from one split of an indexed dataset.

    ``samples[i]`` is ``{"input_ids": LongTensor[seq_length], "labels": LongTensor[seq_length]}``
    with labels = inputs shifted by one token.
    """

    def __init__(self, dataset: IndexedDataset | str | Path, *, seq_length: int, split: str,
                 valid_fraction: float, test_fraction: float = 0.0, seed: int,
                 shuffle: bool = True) -> None:
        self.dataset = dataset if isinstance(dataset, IndexedDataset) else IndexedDataset(dataset)
        if seq_length < 1:
            raise DataError(f"seq_length must be >= 1, got {seq_length}")
        self.seq_length = seq_length
        self.split = split
        self.documents = split_documents(self.dataset.num_documents, split=split,
                                         valid_fraction=valid_fraction,
                                         test_fraction=test_fraction, seed=seed)
        self._sequences = _sequences_of(self.dataset.document_indices, self.documents)
        self._sequence_sizes = self.dataset.sizes[self._sequences].astype(np.int64)
        self.num_tokens = int(self._sequence_sizes.sum())
        if len(self.documents) == 0:
            raise DataError(
                f"the {split} split of {str(self.dataset.prefix)!r} has no documents: "
                f"{self.dataset.num_documents} documents with valid_fraction {valid_fraction} "
                f"and test_fraction {test_fraction} leave none for it; use more documents or "
                f"a {split}_fraction in (0, 1)")
        num_samples = max(self.num_tokens - 1, 0) // seq_length
        if num_samples < 1:
            raise DataError(
                f"the {split} split of {str(self.dataset.prefix)!r} has {self.num_tokens} tokens "
                f"in {len(self.documents)} documents, and one sample of seq_length {seq_length} "
                f"needs {seq_length + 1}: use a shorter seq_length, more data"
                + (f" or a larger {split}_fraction" if split != "train" else ""))
        key = _cache_key(self.dataset, seq_length=seq_length, split=split,
                         fractions=(valid_fraction, test_fraction), seed=seed)
        self.cache_path = Path(f"{self.dataset.prefix}.{split}_{key[:16]}.npy")
        self._index = _load_or_build(
            self.cache_path, shape=(num_samples, 2),
            build=lambda: build_sample_index(self._sequence_sizes, seq_length=seq_length,
                                             num_samples=num_samples))

        # Sample i of the dataset is stream sample order[i]: a batch mixes samples from all over
        # the corpus instead of consecutive chunks of a few files (Megatron's shuffle index).
        # A seeded hash permutation, like the document order, so it never changes with NumPy;
        # cached too: sorting hundreds of millions of hashes takes minutes.
        self.order = _load_or_build(
            self.cache_path.with_suffix(".order.npy"), shape=(num_samples,),
            build=lambda: seeded_permutation(num_samples, seed=seed + 1)) if shuffle \
            else np.arange(num_samples, dtype=np.int64)
        self._arguments = dict(seq_length=seq_length, split=split, valid_fraction=valid_fraction,
                               test_fraction=test_fraction, seed=seed, shuffle=shuffle)

    def __getstate__(self) -> dict:
        # The arguments, not the arrays: a spawned DataLoader worker reloads the cached index
        # (memory-mapped) instead of receiving a copy of it through a pipe.
        return {"dataset": self.dataset, **self._arguments}

    def __setstate__(self, state: dict) -> None:
        dataset = state.pop("dataset")
        self.__init__(dataset, **state)

    def __len__(self) -> int:
        return len(self._index)

    def sample_tokens(self, index: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens of sample `index`, gathered across documents."""
        if not 0 <= index < len(self._index):
            raise IndexError(f"sample {index} out of range for {len(self._index)} samples")
        position, offset = (int(value) for value in self._index[index])
        needed = self.seq_length + 1
        pieces = []
        while needed > 0:
            sequence = int(self._sequences[position])
            take = min(int(self._sequence_sizes[position]) - offset, needed)
            pieces.append(self.dataset.get(sequence, offset=offset, length=take))
            needed -= take
            position, offset = position + 1, 0
        return np.concatenate(pieces)

    def tokens(self, index: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens of sample `index` in shuffled order (what
        ``self[index]`` holds; `sample_tokens` indexes the unshuffled stream)."""
        return self.sample_tokens(int(self.order[index]))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return inputs_and_labels(torch.from_numpy(self.tokens(index).astype(np.int64)))


def inputs_and_labels(tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Samples of ``seq_length + 1`` tokens (last dimension) as model inputs and labels."""
    return {"input_ids": tokens[..., :-1], "labels": tokens[..., 1:]}


def document_ids(tokens: np.ndarray, *, eod: int) -> np.ndarray:
    """The document id of each input position of samples of ``seq_length + 1`` tokens (last
    axis): the number of `eod` tokens before it in the sample, so an eod belongs to the
    document it ends and the next one starts after it (``data.document_mask``). Shape: the
    tokens' with the last axis one shorter (the inputs'); int64."""
    inputs = tokens[..., :-1]
    ends = np.cumsum(inputs == eod, axis=-1, dtype=np.int64)
    return np.concatenate((np.zeros_like(ends[..., :1]), ends[..., :-1]), axis=-1)


def _sequences_of(document_indices: np.ndarray, documents: np.ndarray) -> np.ndarray:
    """The sequence ids of `documents`, in order (each document spans a run of sequences)."""
    starts = document_indices[documents].astype(np.int64)
    counts = document_indices[documents + 1].astype(np.int64) - starts
    run_offsets = np.repeat(starts - (np.cumsum(counts) - counts), counts)
    return np.arange(int(counts.sum()), dtype=np.int64) + run_offsets


def build_sample_index(sizes: np.ndarray, *, seq_length: int, num_samples: int) -> np.ndarray:
    """Row i = (position in the split's sequence order, token offset) where sample i starts."""
    stream_starts = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=stream_starts[1:])
    first_tokens = np.arange(num_samples, dtype=np.int64) * seq_length
    # side="right" picks the last sequence starting at or before the token: skips empty ones.
    positions = np.searchsorted(stream_starts, first_tokens, side="right") - 1
    return np.stack([positions, first_tokens - stream_starts[positions]], axis=1)


def _cache_key(dataset: IndexedDataset, *, seq_length: int, split: str,
               fractions: tuple[float, float], seed: int) -> str:
    """A sha256 over everything the sample index depends on."""
    sizes_hash = hashlib.sha256(np.ascontiguousarray(dataset.sizes).tobytes())
    sizes_hash.update(np.ascontiguousarray(dataset.document_indices).tobytes())
    fields = {"version": SAMPLE_INDEX_VERSION, "documents": dataset.num_documents,
              "sizes": sizes_hash.hexdigest(), "seq_length": seq_length, "seed": seed,
              "fractions": [repr(float(f)) for f in fractions], "split": split}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _load_or_build(path: Path, *, shape: tuple[int, ...],
                   build: Callable[[], np.ndarray]) -> np.ndarray:
    """Load a cached array (memory-mapped), or build it and write it atomically beside the data.

    Several ranks may build at once: each writes its own temporary file and renames it over
    the same name with identical contents, so no barrier is needed.
    """
    if path.is_file():
        array = np.load(path, mmap_mode="r")
        if array.shape == shape:
            return array
    array = build()
    try:
        with atomic_file(path) as out:
            np.save(out, array)
    except OSError as error:
        warnings.warn(f"cannot cache the sample index at {str(path)!r} ({error.strerror}); "
                      "it will be rebuilt on every start", stacklevel=3)
    return array


def micro_batch_indices(*, step: int, micro_step: int, dp_rank: int, micro_batch_size: int,
                        dp_size: int, grad_accum: int, start_sample: int = 0) -> list[int]:
    """Global sample numbers read by `dp_rank` at (step, micro_step); see the module docstring.

    The numbers count from the start of training (`start_sample` shifts the origin) and are not
    wrapped: take them modulo the number of samples to index a `PackedSamples`.
    """
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
    if not 0 <= micro_step < grad_accum:
        raise ValueError(f"micro_step {micro_step} out of range for grad_accum {grad_accum}")
    block = micro_batch_size * dp_size  # samples read by all ranks in one micro-step
    first = start_sample + (step * grad_accum + micro_step) * block + dp_rank * micro_batch_size
    return list(range(first, first + micro_batch_size))


def _kept_number(k: int, skip: list[int]) -> int:
    """The k-th (from 0) number not in the sorted list `skip`: the least n with
    n = k + #(skip <= n), found by iterating that map upwards from k (each round adds the
    excluded numbers passed, so it stops after at most len(skip) + 1 rounds)."""
    n = k
    while True:
        moved = k + bisect.bisect_right(skip, n)
        if moved == n:
            return n
        n = moved


def stream_numbers(first: int, count: int, *, skip: list[int] | tuple[int, ...] = ()) -> list[int]:
    """The global sample numbers of the run's samples `first` .. `first + count - 1` (counted
    as ``consumed_samples`` counts: samples trained on) when the numbers in the sorted list
    `skip` are left out of the stream; without `skip`, ``range(first, first + count)``."""
    if not skip:
        return list(range(first, first + count))
    skip = list(skip)
    number = _kept_number(first, skip)
    at = bisect.bisect_left(skip, number)
    numbers = []
    while len(numbers) < count:
        if at < len(skip) and skip[at] == number:
            at += 1
        else:
            numbers.append(number)
        number += 1
    return numbers


class DistributedPackedSampler(Sampler[list[int]]):
    """Endless micro-batches of sample indices for one dp rank, in the global order.

    Use as ``DataLoader(samples, batch_sampler=DistributedPackedSampler(len(samples), ...))``.
    Batch n of this rank is micro-step n of the run counted from `consumed_samples`; the
    gradient-accumulation grouping does not change which samples come next, so it is not needed.
    The global sample numbers in `skip` are left out of the stream (`stream_numbers`).
    """

    def __init__(self, num_samples: int, *, micro_batch_size: int, dp_rank: int, dp_size: int,
                 consumed_samples: int = 0, skip: list[int] | tuple[int, ...] = ()) -> None:
        if num_samples < 1:
            raise DataError(f"cannot sample from a dataset of {num_samples} samples")
        if micro_batch_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need micro_batch_size >= 1 and 0 <= dp_rank < dp_size, got "
                             f"{micro_batch_size}, {dp_rank}, {dp_size}")
        self.num_samples = num_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.consumed_samples = consumed_samples
        self.skip = sorted(set(skip))

    def __iter__(self) -> Iterator[list[int]]:
        micro_step = 0
        while True:
            numbers = micro_batch_indices(
                step=micro_step, micro_step=0, dp_rank=self.dp_rank,
                micro_batch_size=self.micro_batch_size, dp_size=self.dp_size, grad_accum=1,
                start_sample=self.consumed_samples)
            if self.skip:
                numbers = stream_numbers(numbers[0], len(numbers), skip=self.skip)
            yield [number % self.num_samples for number in numbers]
            micro_step += 1
