"""Micro-batches for one data-parallel rank: sampler + DataLoader + tensors, as the trainer reads.

Why not the DataLoader's default path (a dict of two tensors per sample, collated in the
worker): every tensor a worker returns travels through its own shared-memory segment, which
costs about a millisecond per tensor on a CPU machine and capped a worker at ~1,000 samples/s
for the tiny model. Here a worker gathers several consecutive micro-batches (at least
`_SAMPLES_PER_FETCH` samples) as one NumPy array of ``seq_length + 1`` tokens per sample, which
is pickled through the worker's pipe; the main process splits it into micro-batches of inputs
and labels and pins them when asked. The order of the samples is the
sampler's, whatever the grouping.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

import numpy as np
import torch

from pretrain.data.samples import DistributedPackedSampler, document_ids, inputs_and_labels


class TokenSamples(Protocol):
    """What the loader needs: `PackedSamples` and `BlendedSamples` both provide it."""

    def __len__(self) -> int: ...

    def tokens(self, index: int) -> np.ndarray: ...


_SAMPLES_PER_FETCH = 64  # per worker round trip: amortises its fixed cost (~0.3 ms)


def context_chunk(length: int, *, rank: int, size: int) -> slice:
    """The positions of context rank `rank`'s contiguous chunk of a sequence of `length`
    positions (`length` divisible by `size`, as the layout checks): chunk c is
    c * length / size up to (c + 1) * length / size, where the model's rotary positions start it
    (`model.context_parallel.chunk_offset`)."""
    chunk = length // size
    return slice(rank * chunk, (rank + 1) * chunk)


def context_chunks(length: int, *, rank: int, size: int,
                   head_tail: bool = False) -> tuple[slice, ...]:
    """The positions of context rank `rank`'s tokens of a sequence of `length` positions, as
    slices in the order the rank holds them. Contiguous (`head_tail` False, Ulysses): the one
    `context_chunk`. Head-tail (all-gather context parallelism): the sequence cut into
    2 x `size` equal chunks, rank r holding chunk r then chunk 2 x size - 1 - r, so that under
    the causal mask every rank attends over the same number of (query, key) pairs: rank r's
    queries see (r + 1/2) + (2 x size - r - 1/2) = 2 x size chunks of keys."""
    if not head_tail:
        return (context_chunk(length, rank=rank, size=size),)
    piece = length // (2 * size)
    tail = 2 * size - 1 - rank
    return (slice(rank * piece, (rank + 1) * piece), slice(tail * piece, (tail + 1) * piece))


def context_positions(length: int, *, rank: int, size: int, head_tail: bool = False) -> np.ndarray:
    """The global positions (int64) of context rank `rank`'s tokens, in the order it holds
    them (`context_chunks`): the rotary angles and the causal mask of its queries."""
    return np.concatenate([np.arange(s.start, s.stop, dtype=np.int64)
                           for s in context_chunks(length, rank=rank, size=size,
                                                   head_tail=head_tail)])


class _MicroBatches:
    """Maps a group of micro-batches of sample indices to an int64 array
    [micro-batches, micro_batch_size, seq_length + 1]; with context parallelism
    [..., seq_length / context + 1]: context rank c's chunk of each sample's inputs and the one
    token after it (the label of its last input); head-tail (`context_chunks`), each of the
    rank's two chunks so, one after the other. With `document_eod` (document masking) each
    row goes on with the document ids of the whole sample's inputs (seq_length more)."""

    def __init__(self, samples: TokenSamples, *, context_rank: int = 0,
                 context_size: int = 1, document_eod: int | None = None,
                 head_tail: bool = False) -> None:
        self.samples = samples
        self.context_rank, self.context_size = context_rank, context_size
        self.document_eod = document_eod
        self.head_tail = head_tail

    def _tokens(self, index: int) -> np.ndarray:
        tokens = self.samples.tokens(index)
        # each chunk of inputs and the label of its last input
        chunk = np.concatenate([tokens[s.start:s.stop + 1] for s in context_chunks(
            len(tokens) - 1, rank=self.context_rank, size=self.context_size,
            head_tail=self.head_tail)])
        if self.document_eod is None:
            return chunk
        return np.concatenate((chunk, document_ids(tokens, eod=self.document_eod)))

    def __getitem__(self, group: Sequence[Sequence[int]]) -> np.ndarray:
        return np.stack([[self._tokens(index) for index in indices]
                         for indices in group]).astype(np.int64)


def _split_row(micro_batch: torch.Tensor, *, masked: bool, context_size: int,
               pieces: int = 1) -> dict[str, torch.Tensor]:
    """A fetched micro-batch's inputs and labels, from `pieces` chunks of inputs each followed
    by the label of its last input (2 head-tail, else 1); `masked`: and its document ids, the
    last seq_length columns, after the chunks' seq_length / context_size + pieces tokens."""
    width = micro_batch.shape[-1]  # chunks + pieces (+ seq_length = context x chunks)
    seq_length = (width - pieces) // (context_size + 1) * context_size if masked else 0
    rows = micro_batch[..., :width - seq_length]
    if pieces == 1:
        batch = inputs_and_labels(rows)
    else:  # each piece's inputs and labels, the pieces' joined in the order the rank holds them
        split = inputs_and_labels(rows.unflatten(-1, (pieces, -1)))
        batch = {name: tensor.flatten(-2) for name, tensor in split.items()}
    if masked:
        batch["document_ids"] = micro_batch[..., width - seq_length:]
    return batch


def _grouped(batches: Iterable[list[int]], size: int) -> Iterator[list[list[int]]]:
    """Consecutive micro-batches of an endless sampler, `size` at a time."""
    iterator = iter(batches)
    while True:
        yield [next(iterator) for _ in range(size)]


def _keep(batch: np.ndarray) -> np.ndarray:
    return batch  # module level: spawned workers pickle the collate function


def micro_batches(samples: TokenSamples, *, micro_batch_size: int, dp_rank: int, dp_size: int,
                  consumed_samples: int = 0, workers: int = 0, pin_memory: bool = False,
                  prefetch_factor: int = 4, context_rank: int = 0,
                  context_size: int = 1, skip: list[int] | tuple[int, ...] = (),
                  document_eod: int | None = None,
                  head_tail: bool = False) -> Iterator[dict[str, torch.Tensor]]:
    """Endless ``{"input_ids", "labels"}`` micro-batches of `dp_rank`, from `consumed_samples`
    on, in the global order of `DistributedPackedSampler` (the same for every dp size). With
    `context_size` > 1 the context ranks of a data-parallel rank read the same samples and each
    keeps its contiguous chunk of their tokens: inputs T/context, labels shifted before the
    split (a chunk's last label is the next chunk's first input). The global sample numbers in
    `skip` are left out of the stream. With `document_eod` (the tokenizer's end-of-document
    id, ``data.document_mask``) each micro-batch also has "document_ids": each input position's
    document (`samples.document_ids`) over the whole sample, also under context parallelism,
    where attention sees the whole sequence. `head_tail` (all-gather context parallelism): each
    context rank keeps its head and tail chunks instead (`context_chunks`), each chunk's labels
    shifted before the split likewise."""
    sampler = DistributedPackedSampler(len(samples), micro_batch_size=micro_batch_size,
                                       dp_rank=dp_rank, dp_size=dp_size,
                                       consumed_samples=consumed_samples, skip=skip)
    # In-process there is no round trip to amortise: one micro-batch per fetch.
    group = math.ceil(_SAMPLES_PER_FETCH / micro_batch_size) if workers > 0 else 1
    # batch_size=None: each item of the sampler (a group of micro-batches) is one fetch.
    loader = torch.utils.data.DataLoader(
        _MicroBatches(samples, context_rank=context_rank, context_size=context_size,
                      document_eod=document_eod, head_tail=head_tail and context_size > 1),
        sampler=_grouped(sampler, group), batch_size=None,
        collate_fn=_keep, num_workers=workers, persistent_workers=workers > 0,
        prefetch_factor=prefetch_factor if workers > 0 else None)
    pieces = 2 if head_tail and context_size > 1 else 1
    for chunk in loader:
        for micro_batch in torch.from_numpy(chunk):
            # Contiguous copies, as the default collate gave: engines may view or send them.
            batch = {name: tensor.contiguous()
                     for name, tensor in _split_row(micro_batch, masked=document_eod is not None,
                                                  context_size=context_size,
                                                  pieces=pieces).items()}
            yield {name: tensor.pin_memory() for name, tensor in batch.items()} if pin_memory \
                else batch
