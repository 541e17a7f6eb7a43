"""eval.tasks every eval.interval steps of a run (and after its last step), on the engine as it
is sharded: every rank takes part (`pretrain.evaluation.runner`), rank 0 drives lm-eval.

The scores go to metrics.jsonl as ``{"kind": "tasks", "step", "<task>/<metric>": value, ...,
"seconds"}``, hence to the configured sinks (as tasks/<task>/<metric>), to a `[tasks]` run line
and to curves.png. The evaluation runs without gradients, restores the engine's training mode,
and keeps the random generators' states: the training that follows is bitwise the same.
"""
from __future__ import annotations

import time

from pretrain import telemetry
from pretrain.config import RunConfig
from pretrain.errors import ConfigError


def check_eval_config(cfg: RunConfig) -> None:
    """Refuse, before any process group exists, tasks lm-eval does not know and layouts the
    evaluation cannot run on."""
    if not cfg.eval.tasks:
        return
    if cfg.parallel.context > 1:
        raise ConfigError("eval.tasks with parallel.context > 1: the evaluation does not split "
                          "sequences over context ranks; evaluate the checkpoint with "
                          "`pretrain eval`, or set eval.tasks=[]")
    from pretrain.evaluation.tasks import check_tasks

    check_tasks(list(cfg.eval.tasks))


class TaskEvaluator:
    """The run's downstream evaluation; `after_step` is the trainer's one call."""

    def __init__(self, trainer) -> None:
        """`trainer`: the run's `pretrain.trainer.Trainer` (its engine, groups, tokenizer,
        metrics, watchdog and curves)."""
        self.trainer = trainer
        self.cfg = trainer.cfg
        self._runner = None
        self._manager = None

    def due(self, step: int) -> bool:
        tasks, interval = self.cfg.eval.tasks, self.cfg.eval.interval
        return bool(tasks) and ((interval and step % interval == 0)
                                or step == self.cfg.train.steps)

    def after_step(self, step: int) -> None:
        if not self.due(step):
            return
        trainer = self.trainer
        start = time.perf_counter()
        engine = trainer.engine
        engine.eval()
        try:
            with trainer.watchdog.paused():  # lm-eval's tokenizing and loading are not steps
                from pretrain.evaluation.tasks import evaluate, task_manager

                if self._manager is None and trainer.main:
                    self._manager = task_manager(list(self.cfg.eval.tasks))
                scores = evaluate(self._get_runner(), trainer.tokenizer,
                                  tasks=list(self.cfg.eval.tasks), limit=self.cfg.eval.limit,
                                  manager=self._manager)
        finally:
            engine.train()
        if not trainer.main:
            return
        seconds = time.perf_counter() - start
        trainer.metrics.write({"kind": "tasks", "step": step, **scores, "seconds": seconds})
        shown = " | ".join(f"{name} {value:.4f}" for name, value in scores.items())
        telemetry.log(f"[tasks] step {step} | {shown} | {seconds:.1f}s", main=True,
                      level="result")
        trainer._draw_curves()

    def _get_runner(self):
        if self._runner is None:
            from pretrain.evaluation.runner import ModelRunner
            from pretrain.model import tensor_parallel_group

            trainer, cfg = self.trainer, self.cfg
            tp = trainer.groups.topology.tensor
            self._runner = ModelRunner(
                trainer.engine, vocab_size=cfg.model.vocab_size, seq_length=cfg.model.seq_length,
                batch_size=cfg.train.micro_batch_size, device=trainer.device,
                tp_multiple=tp if cfg.parallel.sequence_parallel else 1,
                distributed=trainer.world.world_size > 1,
                pipeline_shape=(cfg.train.micro_batch_size, cfg.model.seq_length),
                tp_group=tensor_parallel_group(trainer.groups),
                document_mask=cfg.data.document_mask)
        return self._runner
