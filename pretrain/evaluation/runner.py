"""The forwards of an evaluation, on the model as it is sharded in the run, every rank taking
part.

Rank 0 drives lm-eval (`pretrain.evaluation.adapter`) and hands the runner all the batches of a
request type at once; that is one collective: rank 0 broadcasts them as a command, and every
rank (the other ranks in `serve`) takes part. The data-parallel replicas share the batches
(`Replicas`: replica r runs batches r, r + R, r + 2R, ... of R replicas); every rank of a
replica (its tensor and pipeline ranks) runs the same forwards with the same inputs, so tensor
parallelism sees the same ids on every rank of a group, as it requires, and a pipeline runs its
inference schedule on every stage. The results then reach rank 0 in the batches' order (one
all-gather of Python objects). Where the weights are partitioned over the data-parallel ranks
(ZeRO-3, FSDP2) every forward gathers them from every replica: there every replica runs every
batch.

Greedy decoding stops a row at the end-of-document token or once its decoded text contains one
of its `until` strings (every rank decodes: `decode`), and a batch once all its rows have
stopped; each row's tokens end where it stopped.

Shapes: a flat model (one process, tensor parallel, ZeRO) takes each batch right-padded to its
longest row (a multiple of the tensor-parallel size under sequence parallelism): causal attention
keeps every real position exact. A DeepSpeed pipeline scores batches of exactly its training
shape (train.micro_batch_size x model.seq_length) through its `eval_batch`, because its stages
keep the activation buffers of their first send; fsdp2's pipelines score padded batches as a
flat model does, stage by stage outside torch's schedule. The last stage computes the results,
which reach every rank of the replica through one all-reduce (MAX over identical values and
-inf/-1 elsewhere: exact). A pipeline decodes with a key/value cache, the prompt once and then
(B, 1) per token, its stages sending hidden states to each other outside the engine's schedule
(`pretrain.evaluation.pipeline_decoding`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F

from pretrain.evaluation.pipeline_decoding import (PipelineDecoder, deepspeed_hops,
                                                   from_last_stage)
from pretrain.model.form import ModelForm

_STOP, _ERROR = "stop", "error"


@dataclasses.dataclass(frozen=True)
class ScoreRow:
    """One window to score: `tokens` are the model's inputs followed by the last target token
    (so inputs = tokens[:-1], targets = tokens[1:]); the last `continuation` targets count."""
    tokens: tuple[int, ...]
    continuation: int


@dataclasses.dataclass(frozen=True)
class GreedyBatch:
    """Prompts of one length to continue greedily by at most `max_new_tokens`; row i stops at
    `eos_id` or once its decoded continuation contains one of `until[i]`."""
    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: int
    until: tuple[tuple[str, ...], ...]
    eos_id: int | None = None


@dataclasses.dataclass(frozen=True)
class Replicas:
    """This rank's data-parallel replica: `index` of `count`, and `group`, the process group of
    the replica's ranks (tensor x pipeline; None: every rank, when there is one replica)."""
    index: int = 0
    count: int = 1
    group: Any = None

    @classmethod
    def of_mpu(cls, mpu) -> "Replicas":
        """From a model-parallel unit (`pretrain.resolve.topology.DeepSpeedMPU`, DeepSpeed's
        pipeline grid): its data-parallel rank and size, its model-parallel (tensor x pipeline)
        group."""
        count = mpu.get_data_parallel_world_size()
        if count == 1:
            return cls()
        return cls(index=mpu.get_data_parallel_rank(), count=count,
                   group=mpu.get_model_parallel_group())

    @classmethod
    def of_model(cls, model) -> "Replicas":
        """The replicas of a DeepSpeed engine (its `mpu`); one for a bare model, an engine
        without one, or weights partitioned over the data-parallel ranks (ZeRO-3, FSDP2 has no
        mpu), whose every forward needs every rank."""
        mpu = getattr(model, "mpu", None)
        partitioned = getattr(model, "zero_optimization_partition_weights", lambda: False)()
        return cls() if mpu is None or partitioned else cls.of_mpu(mpu)


class ModelRunner:
    """Batched log-likelihoods and greedy decoding of `model`: a `LlamaModel`, a DeepSpeed engine
    over one (flat), a DeepSpeed `PipelineEngine`, or fsdp2's engine (flat or pipelined). `distributed`: whether several processes
    take part (then every rank must construct one and the others call `serve`); `replicas`: how
    they share the batches (default: read from the engine, `Replicas.of_model`). `batch_size` is
    the rows per forward of a flat model or fsdp2's pipeline; DeepSpeed's pipeline uses
    `pipeline_shape` (rows, length);
    `tp_multiple`: a flat model's padded length is a multiple of it (sequence parallelism).
    `decode` (token ids to text) is needed on every rank to stop generations at their `until`
    strings (`pretrain.evaluation.tasks.evaluate` sets it from the run's tokenizer)."""

    def __init__(self, model, *, vocab_size: int, seq_length: int, batch_size: int,
                 device: str = "cpu", tp_multiple: int = 1, distributed: bool = False,
                 pipeline_shape: tuple[int, int] | None = None, tp_group=None,
                 document_mask: bool = False, replicas: Replicas | None = None,
                 decode: Callable[[list[int]], str] | None = None) -> None:
        self.model, self.vocab_size, self.seq_length = model, vocab_size, seq_length
        self.device, self.tp_multiple, self.distributed = device, tp_multiple, distributed
        self.pipelined = ModelForm.of(model) is ModelForm.PIPELINE
        # fsdp2's pipelines (a `PipelineDriver`) run any shape stage by stage
        self.staged = self.pipelined and hasattr(getattr(model, "pipeline", None),
                                                 "inference_hops")
        self.pipeline_shape, self.document_mask = pipeline_shape, document_mask
        self.tp_group = tp_group  # a pipeline's head gives this rank's vocabulary shard
        fixed = self.pipelined and not self.staged  # DeepSpeed's: its training shape
        self.batch_size = pipeline_shape[0] if fixed else batch_size
        if fixed and pipeline_shape is None:
            raise ValueError("a pipeline engine needs pipeline_shape=(micro_batch_size, seq_length)")
        if replicas is None:
            replicas = Replicas.of_model(model) if distributed else Replicas()
        self.replicas, self.decode = replicas, decode
        self._decoder: PipelineDecoder | None = None  # a pipeline's greedy decoding

    @property
    def is_driver(self) -> bool:
        return not self.distributed or torch_dist.get_rank() == 0

    # ---- the commands (rank 0) -------------------------------------------------------------
    def score(self, batches: list[list[ScoreRow]]) -> list[list[tuple[float, bool]]]:
        """Per batch (at most `batch_size` rows each), per row: (sum of the continuation's
        log-probabilities, whether greedy decoding gives it)."""
        return self._command("score", batches)

    def greedy(self, batches: list[GreedyBatch]) -> list[list[list[int]]]:
        """Per batch (at most `batch_size` rows each), each row's greedy continuation up to where
        it stopped (the end-of-document token left out)."""
        return self._command("greedy", batches)

    def stop(self, error: str | None = None) -> None:
        """End the other ranks' `serve` (with `error`: they raise it too)."""
        if self.distributed:
            self._broadcast((_ERROR, error) if error else (_STOP, None))

    def _command(self, name: str, batches: list):
        if self.distributed:
            self._broadcast((name, batches))
        return self._run(name, batches)

    # ---- the other ranks ------------------------------------------------------------------
    def serve(self) -> None:
        """Run rank 0's commands until it stops; raise when rank 0 failed."""
        while True:
            name, payload = self._broadcast(None)
            if name == _STOP:
                return
            if name == _ERROR:
                raise RuntimeError(f"the evaluation failed on rank 0: {payload}")
            self._run(name, payload)

    def _broadcast(self, command):
        box = [command]
        torch_dist.broadcast_object_list(box, src=0)
        return box[0]

    def _run(self, name: str, batches: list) -> list:
        """This replica's share of `batches` run, everyone's results in the batches' order."""
        run = self._score if name == "score" else self._greedy
        share = range(self.replicas.index, len(batches), self.replicas.count)
        with torch.no_grad():
            mine = {i: run(batches[i]) for i in share}
        if self.replicas.count > 1:  # every rank of a replica holds its results: any will do
            everyone: list[dict] = [{} for _ in range(torch_dist.get_world_size())]
            torch_dist.all_gather_object(everyone, mine)
            for results in everyone:
                mine.update(results)
        return [mine[i] for i in range(len(batches))]

    # ---- forwards ----------------------------------------------------------------------------
    def _padded(self, sequences: list[list[int]]) -> torch.Tensor:
        """(rows, length) ids, right-padded with 0 to the flat model's or the pipeline's shape."""
        if self.pipelined and not self.staged:
            rows, length = self.pipeline_shape
        else:
            rows, length = len(sequences), max(map(len, sequences))
            length += -length % self.tp_multiple
        ids = torch.zeros(rows, length, dtype=torch.long)
        for i, seq in enumerate(sequences):
            ids[i, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        return ids.to(self.device)

    def _logits(self, ids: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits (B, T, vocab) of every rank of a flat model, of a pipeline's last stage
        (None on its other stages)."""
        if not self.pipelined:
            return self.model(ids).float()[..., :self.vocab_size]
        if self.staged:
            return self._pipeline_decoder().logits(ids)
        from pretrain.model.pipeline import head_logits
        from pretrain.model.tensor_parallel import gather_from_tp

        inputs = (ids, torch.zeros_like(ids)) if self.document_mask else ids  # one document
        engine = self.model
        batch = iter([(inputs, torch.zeros_like(ids))])
        # Without a loss DeepSpeed adds the outputs to the training step's total_loss, which
        # eval_batch does not reset (train_batch does): an evaluation must leave it as it was.
        kept = engine.total_loss, engine.total_additional_losses
        engine.total_loss = engine.total_additional_losses = None
        try:
            _, outputs = engine.eval_batch(batch, return_logits=True, compute_loss=False,
                                           reduce_output=None, bcast_loss=False,
                                           num_micro_batches=1)
        finally:
            engine.total_loss, engine.total_additional_losses = kept
        if not engine.is_last_stage():
            return None
        logits = gather_from_tp(head_logits(outputs), self.tp_group)
        return logits.float()[..., :self.vocab_size]

    def _from_last_stage(self, values: torch.Tensor | None, *, shape, dtype,
                         fill) -> torch.Tensor:
        """`values` of a pipeline's last stage on every rank of the replica."""
        if not self.pipelined:
            return values
        return from_last_stage(values, shape=shape, dtype=dtype, fill=fill, device=self.device,
                               group=self.replicas.group)

    def _score(self, rows: list[ScoreRow]) -> list[tuple[float, bool]]:
        ids = self._padded([list(row.tokens[:-1]) for row in rows])
        logits = self._logits(ids)
        result = None
        if logits is not None:
            result = torch.empty(len(rows), 2, dtype=torch.float64, device=self.device)
            logprobs = F.log_softmax(logits, dim=-1)
            for i, row in enumerate(rows):
                n, c = len(row.tokens) - 1, row.continuation
                targets = torch.tensor(row.tokens[-c:], dtype=torch.long, device=logits.device)
                window = logprobs[i, n - c:n]  # (c, vocab)
                result[i, 0] = window.gather(-1, targets[:, None]).sum().double()
                result[i, 1] = float(bool((window.argmax(-1) == targets).all()))
        result = self._from_last_stage(result, shape=(len(rows), 2), dtype=torch.float64,
                                       fill=float("-inf"))
        return [(float(v), bool(g)) for v, g in result.tolist()]

    def _greedy(self, batch: GreedyBatch) -> list[list[int]]:
        prompts = [list(p) for p in batch.prompts]
        stops = _Stops(batch, decode=self.decode)
        if self.pipelined:
            self._pipeline_decoder().greedy(prompts, max_new_tokens=batch.max_new_tokens,
                                            stop=stops)
        else:
            module = getattr(self.model, "module", self.model)  # a DeepSpeed engine's model
            ids = torch.tensor(prompts, dtype=torch.long, device=self.device)
            module.generate(ids, max_new_tokens=batch.max_new_tokens, stop=stops)
        return stops.kept

    def _pipeline_decoder(self) -> PipelineDecoder:
        if self._decoder is None:
            hops = (self.model.pipeline.inference_hops() if self.staged
                    else deepspeed_hops(self.model))
            self._decoder = PipelineDecoder(
                hops, vocab_size=self.vocab_size, seq_length=self.seq_length,
                tp_group=self.tp_group, replica_group=self.replicas.group,
                sequence_shards=self.tp_multiple, device=self.device)
        return self._decoder


class _Stops:
    """Where each row of a `GreedyBatch` stops, as its ids grow: `__call__(ids)` (B, prompt +
    new) after each new token says whether every row has stopped; `kept` is each row's new
    tokens up to its stop (all of them for a row that has not stopped). Every rank of a replica
    sees the same ids, hence makes the same decision."""

    def __init__(self, batch: GreedyBatch, *, decode: Callable[[list[int]], str] | None) -> None:
        if decode is None and any(any(row) for row in batch.until):
            raise ValueError("stopping at `until` strings needs the runner's `decode` (the "
                             "tokenizer's) on every rank")
        self.prompt_length = len(batch.prompts[0])
        self.until = [[s for s in row if s] for row in batch.until]
        self.eos_id, self.decode = batch.eos_id, decode
        self.stopped = [False] * len(batch.prompts)
        self.kept: list[list[int]] = [[] for _ in batch.prompts]

    def __call__(self, ids: torch.Tensor) -> bool:
        for i, row in enumerate(ids[:, self.prompt_length:].tolist()):
            if self.stopped[i]:
                continue
            if self.eos_id is not None and row[-1] == self.eos_id:
                self.kept[i], self.stopped[i] = row[:-1], True
            else:
                self.kept[i] = row
                self.stopped[i] = bool(self.until[i]) and any(
                    s in self.decode(row) for s in self.until[i])
        return all(self.stopped)
