"""The evaluations during a run, on the engine as it is sharded: the validation loss every
train.eval_interval steps (`ValidationLoss`) and eval.tasks every eval.interval steps
(`TaskEvaluator`), each also after the last step.

The validation loss reads `train.eval_batches` global batches of the validation split in the
training order (the same samples whatever the layout) and goes to metrics.jsonl as
``{"kind": "eval", "step", "loss", "ppl"}`` and an `[eval]` line. For eval.tasks every rank takes
part (`pretrain.evaluation.runner`), rank 0 drives lm-eval. Their scores go to metrics.jsonl as ``{"kind": "tasks", "step", "<task>/<metric>": value, ...,
"seconds"}``, hence to the configured sinks (as tasks/<task>/<metric>), to a `[tasks]` run line
and to curves.png. The evaluation runs without gradients, restores the engine's training mode,
and keeps the random generators' states: the training that follows is bitwise the same.
"""
from __future__ import annotations

import math
import time

import torch

from pretrain.log import log
from pretrain.training.loop_state import LoopState


# A pipeline evaluates this many micro-batches per stage in one call (a stop waits for one call)
PIPELINE_EVAL_CHUNK = 4


class ValidationLoss:
    """The run's validation loss; `after_step` is the trainer's one call."""

    def __init__(self, state: LoopState) -> None:
        """`state`: the run's loop (its engine, validation data and loader, stop control,
        watchdog, metrics and curves)."""
        self.state = state
        self.cfg = state.cfg

    def due(self, step: int) -> bool:
        t = self.cfg.train
        return self.state.valid_data is not None and bool(t.eval_interval) and (
            step % t.eval_interval == 0 or step == t.steps)

    def after_step(self, step: int, eval_losses: list[tuple[int, float]]) -> None:
        """When due: the loss into `eval_losses`, metrics.jsonl and an `[eval]` line."""
        if not self.due(step):
            return
        state = self.state
        loss = self.loss()
        if loss is None:  # stopped inside: the poll after the step stops the run
            log(f"[eval] step {step}: interrupted by a stop request",
                          main=state.main, level="warning")
            return
        eval_losses.append((step, loss))
        ppl = math.exp(min(loss, 50.0))
        state.metrics.write({"kind": "eval", "step": step, "loss": loss, "ppl": ppl})
        log(f"[eval] step {step} | valid loss {loss:.4f} | ppl {ppl:.2f}",
                      main=state.main, level="result")
        state.draw_curves()

    @torch.no_grad()
    def loss(self) -> float | None:
        """The validation loss; None when a stop request came between two micro-batches (a
        pipeline's: between two chunks of PIPELINE_EVAL_CHUNK x stages micro-batches)."""
        # the engine module imports DeepSpeed's: not before `pretrain train` has its process group
        from pretrain.training.engine import TimedBatches, engine_loss

        state = self.state
        engine, device, control = state.engine, state.device, state.control
        engine.eval()
        batches = state.loader(state.valid_data, consumed=0, workers=0)
        # `eval_batches` global batches, read in the training order: the same samples whatever
        # the layout, since the global batch is (each rank: accum micro-batches per batch).
        n = min(self.cfg.train.eval_batches,
                max(1, len(state.valid_data) // state.global_batch)) * state.grad_accum
        pairs = TimedBatches(batches)
        # a pipeline evaluates a chunk per call (its inference schedule; the loss comes back on
        # every stage): a stop waits for one chunk, whose fill and drain cost ~1/4 more time
        chunk = PIPELINE_EVAL_CHUNK * state.groups.topology.pipeline if state.pipelined else 1
        total, done = torch.zeros((), device=device), 0
        while done < n:
            if done and control.stop_agreed():  # one small all-reduce per micro-batch
                engine.train()
                return None
            control.micro_batch_started("eval", step=state.position.step, micro=done,
                                        rank=state.rank)
            size = min(chunk, n - done)
            if state.pipelined:
                loss = engine.eval_batch(pairs, num_micro_batches=size)  # shape [1]
                total += loss.float().reshape(()) * size
            else:
                inputs, labels = next(pairs)
                total += engine_loss(engine, inputs, labels, device).float()
            done += size
            control.micro_batch_done()
            state.watchdog.beat()
        engine.train()
        return state.mean_over_dp(total / n)


class TaskEvaluator:
    """The run's downstream evaluation; `after_step` is the trainer's one call."""

    def __init__(self, state: LoopState) -> None:
        """`state`: the run's loop (its engine, groups, tokenizer, metrics, watchdog and
        curves)."""
        self.state = state
        self.cfg = state.cfg
        self._runner = None
        self._manager = None

    def due(self, step: int) -> bool:
        tasks, interval = self.cfg.eval.tasks, self.cfg.eval.interval
        return bool(tasks) and ((interval and step % interval == 0)
                                or step == self.cfg.train.steps)

    def after_step(self, step: int) -> None:
        if not self.due(step):
            return
        state = self.state
        start = time.perf_counter()
        engine = state.engine
        engine.eval()
        try:
            with state.watchdog.paused():  # lm-eval's tokenizing and loading are not steps
                from pretrain.resolve.eval_tasks import task_manager
                from pretrain.evaluation.tasks import evaluate

                if self._manager is None and state.main:
                    self._manager = task_manager(list(self.cfg.eval.tasks))
                scores = evaluate(self._get_runner(), state.tokenizer,
                                  tasks=list(self.cfg.eval.tasks), limit=self.cfg.eval.limit,
                                  manager=self._manager)
        finally:
            engine.train()
        if not state.main:
            return
        seconds = time.perf_counter() - start
        state.metrics.write({"kind": "tasks", "step": step, **scores, "seconds": seconds})
        shown = " | ".join(f"{name} {value:.4f}" for name, value in scores.items())
        log(f"[tasks] step {step} | {shown} | {seconds:.1f}s", main=True,
                      level="result")
        state.draw_curves()

    def _get_runner(self):
        if self._runner is None:
            from pretrain.evaluation.runner import ModelRunner
            from pretrain.model import tensor_parallel_group

            state, cfg = self.state, self.cfg
            tp = state.groups.topology.tensor
            self._runner = ModelRunner(
                state.engine, vocab_size=cfg.model.vocab_size, seq_length=cfg.model.seq_length,
                batch_size=cfg.train.micro_batch_size, device=state.device,
                tp_multiple=tp if cfg.parallel.sequence_parallel else 1,
                distributed=state.world_size > 1,
                pipeline_shape=(cfg.train.micro_batch_size, cfg.model.seq_length),
                tp_group=tensor_parallel_group(state.groups),
                document_mask=cfg.data.document_mask)
        return self._runner
