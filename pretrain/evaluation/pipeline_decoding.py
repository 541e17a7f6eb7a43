"""Greedy decoding through a DeepSpeed pipeline with a key/value cache, every rank of a replica
taking part.

DeepSpeed's `eval_batch` cannot decode with a cache: its stages size their send/receive buffers
on the first send, while a cached decode sends the prompt (B, P) once and then (B, 1) per new
token. So decoding skips the engine's schedule: each stage runs its own layers
(`PipelineModule.forward_funcs`) and hands the hidden states to the same (data, tensor)
coordinate of the next stage with torch.distributed send/recv: a small header (shape, dtype),
then the tensor. No buffer of the engine is touched, so training resumes exactly as it was.

Each decoder layer of the stage holds a `LayerCache` while a batch decodes (its `kv_cache`,
which also gives the layer its past length: the rotary positions continue from there); the
caches are dropped when the batch ends. As `LlamaModel.generate` does, past `seq_length`
tokens (the rotary table's length) and under sequence parallelism each step recomputes the last
`seq_length` tokens without a cache. The last stage picks the tokens; they reach every rank of
the replica through one all-reduce (`from_last_stage`), and every rank appends them, so every
rank's `stop(ids)` takes the same decision.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F

from pretrain.model.llama import LayerCache
from pretrain.model.pipeline import DecoderLayerPipe, StageActivations
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


class PipelineDecoder:
    """Greedy decoding of this rank's stage of `engine` (a DeepSpeed `PipelineEngine`) with
    the other stages of its replica. `replica_group`: the ranks of the replica (None: the
    world); `sequence_shards` > 1: sequence parallelism (recompute, padded to a multiple)."""

    def __init__(self, engine, *, vocab_size: int, seq_length: int, tp_group, replica_group,
                 sequence_shards: int = 1, device: str = "cpu") -> None:
        self.functions = list(engine.module.forward_funcs)  # this stage's layers, in order
        self.layers = [f for f in self.functions if isinstance(f, DecoderLayerPipe)]
        self.first, self.last = engine.is_first_stage(), engine.is_last_stage()
        grid, stage = engine.grid, engine.stage_id
        self.previous = None if self.first else grid.stage_to_global(stage - 1)
        self.next = None if self.last else grid.stage_to_global(stage + 1)
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

    def _next_tokens(self, ids: torch.Tensor, *, position: int = -1) -> torch.Tensor:
        """(B,) greedy tokens at `position` of `ids` (B, T), the new positions after the cached
        ones: one pass through the replica's stages, the choice shared from the last stage."""
        outputs = self._stage_pass(ids)
        picked = None
        if outputs is not None:  # the head's (hidden (B, T, C), weight) pair
            hidden, weight = outputs
            logits = gather_from_tp(F.linear(hidden[:, position], weight), self.tp_group)
            picked = logits[:, :self.vocab_size].float().argmax(-1)
        return from_last_stage(picked, shape=(ids.shape[0],), dtype=torch.long, fill=-1,
                               device=self.device, group=self.replica_group)

    def _stage_pass(self, ids: torch.Tensor):
        """This stage's layers on `ids` (first stage) or on the previous stage's hidden states;
        sends the result on, or returns it on the last stage."""
        x = ids if self.first else self._receive()
        for function in self.functions:
            x = function(x)
        if self.last:
            return x
        self._send(StageActivations.from_tuple(x).hidden)
        return None

    def _send(self, hidden: torch.Tensor) -> None:
        header = torch.tensor([*hidden.shape, _DTYPES.index(hidden.dtype)], dtype=torch.long)
        torch_dist.send(header.to(hidden.device), dst=self.next)
        torch_dist.send(hidden.contiguous(), dst=self.next)

    def _receive(self) -> tuple[torch.Tensor, ...]:
        header = torch.empty(4, dtype=torch.long, device=self.device)
        torch_dist.recv(header, src=self.previous)
        *shape, dtype = header.tolist()
        hidden = torch.empty(shape, dtype=_DTYPES[dtype], device=self.device)
        torch_dist.recv(hidden, src=self.previous)
        return StageActivations(hidden=hidden).to_tuple()
