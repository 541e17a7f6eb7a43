"""The forwards of an evaluation, on the model as it is sharded in the run, every rank taking
part.

Rank 0 drives lm-eval (`pretrain.evaluation.adapter`); each batch it scores or decodes is a
collective: rank 0 broadcasts it as a command, and every rank (the other ranks in `serve`) runs
the same forward with the same inputs. Tensor parallelism therefore sees the same ids on every
rank of a group (as it requires), ZeRO-3 gathers each parameter with every rank present, and a
pipeline runs its inference schedule on every stage. Every data-parallel replica runs the same
batches: simple, and exact, at the price of no data-parallel speed-up.

Shapes: a flat model (one process, tensor parallel, ZeRO) takes each batch right-padded to its
longest row (a multiple of the tensor-parallel size under sequence parallelism): causal attention
keeps every real position exact. A pipeline takes batches of exactly its training shape
(train.micro_batch_size x model.seq_length), because DeepSpeed's stages keep the activation
buffers of their first send; its last stage computes the results, which reach every rank
through one all-reduce (MAX over identical values and -inf/-1 elsewhere: exact).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F

from pretrain.model.form import ModelForm

_STOP, _ERROR = "stop", "error"


@dataclasses.dataclass(frozen=True)
class ScoreRow:
    """One window to score: `tokens` are the model's inputs followed by the last target token
    (so inputs = tokens[:-1], targets = tokens[1:]); the last `continuation` targets count."""
    tokens: tuple[int, ...]
    continuation: int


class ModelRunner:
    """Batched log-likelihoods and greedy decoding of `model`: a `LlamaModel`, a DeepSpeed engine
    over one (flat), or a DeepSpeed `PipelineEngine`. `world`: whether several processes take
    part (then every rank must construct one and the others call `serve`). `batch_size` is the
    rows per forward of a flat model; a pipeline uses `pipeline_shape` (rows, length);
    `tp_multiple`: a flat model's padded length is a multiple of it (sequence parallelism)."""

    def __init__(self, model, *, vocab_size: int, seq_length: int, batch_size: int,
                 device: str = "cpu", tp_multiple: int = 1, distributed: bool = False,
                 pipeline_shape: tuple[int, int] | None = None, tp_group=None,
                 document_mask: bool = False) -> None:
        self.model, self.vocab_size, self.seq_length = model, vocab_size, seq_length
        self.device, self.tp_multiple, self.distributed = device, tp_multiple, distributed
        self.pipelined = ModelForm.of(model) is ModelForm.PIPELINE
        self.pipeline_shape, self.document_mask = pipeline_shape, document_mask
        self.tp_group = tp_group  # a pipeline's head gives this rank's vocabulary shard
        self.batch_size = pipeline_shape[0] if self.pipelined else batch_size
        if self.pipelined and pipeline_shape is None:
            raise ValueError("a pipeline engine needs pipeline_shape=(micro_batch_size, seq_length)")

    @property
    def is_driver(self) -> bool:
        return not self.distributed or torch_dist.get_rank() == 0

    # ---- the commands (rank 0) -------------------------------------------------------------
    def score(self, rows: list[ScoreRow]) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether greedy decoding gives it) per
        row; at most `batch_size` rows."""
        return self._command("score", rows)

    def greedy(self, prompts: list[list[int]], *, max_new_tokens: int,
               eos_id: int | None) -> list[list[int]]:
        """The greedy continuation of each prompt (equal lengths; at most `batch_size`)."""
        return self._command("greedy", (prompts, max_new_tokens, eos_id))

    def stop(self, error: str | None = None) -> None:
        """End the other ranks' `serve` (with `error`: they raise it too)."""
        if self.distributed:
            self._broadcast((_ERROR, error) if error else (_STOP, None))

    def _command(self, name: str, payload):
        if self.distributed:
            self._broadcast((name, payload))
        return self._run(name, payload)

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

    def _run(self, name: str, payload):
        with torch.no_grad():
            if name == "score":
                return self._score(payload)
            prompts, max_new_tokens, eos_id = payload
            return self._greedy(prompts, max_new_tokens=max_new_tokens, eos_id=eos_id)

    # ---- forwards ----------------------------------------------------------------------------
    def _padded(self, sequences: list[list[int]]) -> torch.Tensor:
        """(rows, length) ids, right-padded with 0 to the flat model's or the pipeline's shape."""
        if self.pipelined:
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
        """`values` of a pipeline's last stage on every rank (identical on each last-stage
        rank, `fill` elsewhere: MAX keeps them exactly)."""
        if not self.pipelined:
            return values
        if values is None:
            values = torch.full(shape, fill, dtype=dtype, device=self.device)
        values = values.to(self.device).contiguous()
        torch_dist.all_reduce(values, op=torch_dist.ReduceOp.MAX)
        return values

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

    def _greedy(self, prompts: list[list[int]], *, max_new_tokens: int,
                eos_id: int | None) -> list[list[int]]:
        if not self.pipelined:
            module = getattr(self.model, "module", self.model)  # a DeepSpeed engine's model
            ids = torch.tensor(prompts, dtype=torch.long, device=self.device)
            out = module.generate(ids, max_new_tokens=max_new_tokens, eos_id=eos_id)
            return [row[len(prompts[0]):] for row in out.tolist()]
        return self._pipeline_greedy(prompts, max_new_tokens=max_new_tokens, eos_id=eos_id)

    def _pipeline_greedy(self, prompts: list[list[int]], *, max_new_tokens: int,
                         eos_id: int | None) -> list[list[int]]:
        """Greedy decoding through the pipeline's fixed shape: no key/value cache, each new
        token is one whole forward (the last seq_length tokens)."""
        sequences = [list(p) for p in prompts]
        new: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        for _ in range(max_new_tokens):
            windows = [seq[-self.seq_length:] for seq in sequences]
            logits = self._logits(self._padded(windows))
            picked = None
            if logits is not None:
                last = torch.tensor([len(w) - 1 for w in windows], device=logits.device)
                picked = logits[torch.arange(len(windows), device=logits.device), last].argmax(-1)
            picked = self._from_last_stage(picked, shape=(len(windows),), dtype=torch.long,
                                           fill=-1).tolist()
            for i, token in enumerate(picked):
                if done[i]:
                    continue
                sequences[i].append(token)
                new[i].append(token)
                done[i] = eos_id is not None and token == eos_id
            if all(done):
                break
        return new
