"""Forwards through a pipeline outside its training schedule, stage by stage, every rank of a
replica taking part: greedy decoding with a key/value cache, and (fsdp2's stages) the logits
a scoring forward needs.

DeepSpeed's `eval_batch` cannot decode with a cache: its stages size their send/receive buffers
on the first send, while a cached decode sends the prompt (B, P) once and then (B, 1) per new
token; torch's schedules (`train.engine: fsdp2`) run training steps of one shape. So these
forwards skip the schedule: a rank runs its stages (`StageHop`s, in pipeline order: DeepSpeed's
one stage, or fsdp2's `virtual_stages`, looped or V-shaped) and hands the hidden states to the
rank of the next stage in the same (data, tensor) coordinate with torch.distributed send/recv:
a small header (shape, dtype), then the tensor; consecutive stages on one rank hand them on in
place. No buffer of an engine or a schedule is touched, so training resumes exactly as it was.
Under FSDP2 a stage runs as its `fully_shard` root's forward (its layers' all-gathers are
collective over its data ranks: every replica runs the same forwards, `runner.Replicas`), and
the last stage computes its logits inside it, while its head's weight is gathered.

Each decoder layer of the stages holds a `LayerCache` while a batch decodes (its `kv_cache`,
which also gives the layer its past length: the rotary positions continue from there); the
caches are dropped when the batch ends. As `LlamaModel.generate` does, past `seq_length`
tokens (the rotary table's length) and under sequence parallelism each step recomputes the last
`seq_length` tokens without a cache. The last stage picks the tokens; they reach every rank of
the replica through one all-reduce (`from_last_stage`), and every rank appends them, so every
rank's `stop(ids)` takes the same decision.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F

from pretrain.model.llama import LayerCache
from pretrain.model.pipeline import DecoderLayerPipe, StageActivations, head_logits
from pretrain.model.tensor_parallel import gather_from_tp

# the activation dtypes a header can name, by index
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def from_last_stage(values: torch.Tensor | None, *, shape, dtype, fill, device,
                    group) -> torch.Tensor:
    """`values` of a pipeline's last stage on every rank of its replica (`group`): identical
    on each last-stage rank, `fill` elsewhere, so that MAX keeps them exactly."""
    if values is None:
        values = torch.full(shape, fill, dtype=dtype, device=device)
    values = values.to(device).contiguous()
    torch_dist.all_reduce(values, op=torch_dist.ReduceOp.MAX, group=group)
    return values


@dataclasses.dataclass(frozen=True)
class StageHop:
    """One pipeline stage this rank runs in a forward, in pipeline order. `run(x, position)`:
    the stage on `x` (input ids on the first stage, else the previous stage's activations
    tuple); the last stage returns this rank's vocabulary shard of the logits at `position`
    ((B, V/tp); every position (B, T, V/tp) when it is None), the others their activations.
    `source` / `destination`: the global rank the input comes from / the output goes to, None
    where it is the input ids or the last stage's logits, or the same rank's neighbour stage.
    `layers`: its decoder layers (for the caches)."""
    run: Callable[[Any, int | None], Any]
    source: int | None
    destination: int | None
    first: bool
    last: bool
    layers: tuple[DecoderLayerPipe, ...]


def deepspeed_hops(engine) -> list[StageHop]:
    """The one stage of a DeepSpeed `PipelineEngine` on this rank."""
    functions = list(engine.module.forward_funcs)  # this stage's layers, in order
    first, last = engine.is_first_stage(), engine.is_last_stage()
    grid, stage = engine.grid, engine.stage_id

    def run(x, position):
        for function in functions:
            x = function(x)
        return head_logits(x, position) if last else x  # the head's (hidden, weight) pair

    return [StageHop(run=run, source=None if first else grid.stage_to_global(stage - 1),
                     destination=None if last else grid.stage_to_global(stage + 1),
                     first=first, last=last,
                     layers=tuple(f for f in functions if isinstance(f, DecoderLayerPipe)))]


class PipelineDecoder:
    """Greedy decoding, and scoring logits, through this rank's `hops` (`deepspeed_hops`, or
    fsdp2's `PipelineDriver.inference_hops`) with the other stages of its replica.
    `replica_group`: the ranks of the replica (None: the world); `sequence_shards` > 1:
    sequence parallelism (recompute, padded to a multiple)."""

    def __init__(self, hops: list[StageHop], *, vocab_size: int, seq_length: int, tp_group,
                 replica_group, sequence_shards: int = 1, device: str = "cpu") -> None:
        self.hops = hops
        self.layers = [layer for hop in hops for layer in hop.layers]
        self.vocab_size, self.seq_length = vocab_size, seq_length
        self.tp_group, self.replica_group = tp_group, replica_group
        self.sequence_shards, self.device = sequence_shards, device

    def greedy(self, prompts: list[list[int]], *, max_new_tokens: int,
               stop: Callable[[torch.Tensor], bool]) -> torch.Tensor:
        """Prompts of one length continued by up to `max_new_tokens` greedy tokens, until
        `stop(ids)` says so; returns the ids (B, prompt + new), the same on every rank."""
        ids = torch.tensor(prompts, dtype=torch.long, device=self.device)
        cached = 0  # positions in the caches
        with self._caches(enabled=self.sequence_shards == 1):
            for _ in range(max_new_tokens):
                if self.sequence_shards == 1 and ids.shape[1] <= self.seq_length:
                    picked = self._next_tokens(ids[:, cached:])
                    cached = ids.shape[1]
                else:
                    picked = self._recomputed_next_tokens(ids)
                ids = torch.cat((ids, picked[:, None]), dim=1)
                if stop(ids):
                    break
        return ids

    @contextlib.contextmanager
    def _caches(self, *, enabled: bool) -> Iterator[None]:
        """A fresh `LayerCache` on each of the stage's decoder layers while a batch decodes."""
        for layer in self.layers:
            layer.kv_cache = LayerCache() if enabled else None
        try:
            yield
        finally:
            for layer in self.layers:
                layer.kv_cache = None

    def _recomputed_next_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """The next tokens from the last `seq_length` tokens run again, without a cache,
        right-padded to a multiple of the sequence shards (causal attention keeps the real
        positions exact)."""
        window = ids[:, -self.seq_length:]
        length = window.shape[1]
        window = F.pad(window, (0, -length % self.sequence_shards))
        with self._without_caches():
            return self._next_tokens(window, position=length - 1)

    @contextlib.contextmanager
    def _without_caches(self) -> Iterator[None]:
        kept = [layer.kv_cache for layer in self.layers]
        for layer in self.layers:
            layer.kv_cache = None
        try:
            yield
        finally:
            for layer, cache in zip(self.layers, kept):
                layer.kv_cache = cache

    def logits(self, ids: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits (B, T, vocab) of every position of `ids` on the last stage's ranks (the
        tensor ranks' shards gathered), None on the others: one pass through the stages."""
        logits = self._stage_pass(ids, position=None)
        if logits is None:
            return None
        return gather_from_tp(logits, self.tp_group).float()[..., :self.vocab_size]

    def _next_tokens(self, ids: torch.Tensor, *, position: int = -1) -> torch.Tensor:
        """(B,) greedy tokens at `position` of `ids` (B, T), the new positions after the cached
        ones: one pass through the replica's stages, the choice shared from the last stage."""
        logits = self._stage_pass(ids, position=position)
        picked = None
        if logits is not None:
            logits = gather_from_tp(logits, self.tp_group)
            picked = logits[:, :self.vocab_size].float().argmax(-1)
        return from_last_stage(picked, shape=(ids.shape[0],), dtype=torch.long, fill=-1,
                               device=self.device, group=self.replica_group)

    def _stage_pass(self, ids: torch.Tensor, *, position: int | None):
        """This rank's stages in pipeline order: each on `ids` (the first stage), on the
        activations received from `source`, or on its neighbour's on this rank; each result
        sent on to `destination`. Returns the last stage's logits (`StageHop.run`), or None
        where this rank does not hold it."""
        x: Any = None
        for hop in self.hops:
            if hop.first:
                x = ids
            elif hop.source is not None:
                x = self._receive(hop.source)
            x = hop.run(x, position)
            if hop.last:
                return x
            if hop.destination is not None:
                self._send(StageActivations.from_tuple(x).hidden, hop.destination)
        return None

    def _send(self, hidden: torch.Tensor, destination: int) -> None:
        header = torch.tensor([*hidden.shape, _DTYPES.index(hidden.dtype)], dtype=torch.long)
        torch_dist.send(header.to(hidden.device), dst=destination)
        torch_dist.send(hidden.contiguous(), dst=destination)

    def _receive(self, source: int) -> tuple[torch.Tensor, ...]:
        header = torch.empty(4, dtype=torch.long, device=self.device)
        torch_dist.recv(header, src=source)
        *shape, dtype = header.tolist()
        hidden = torch.empty(shape, dtype=_DTYPES[dtype], device=self.device)
        torch_dist.recv(hidden, src=source)
        return StageActivations(hidden=hidden).to_tuple()
