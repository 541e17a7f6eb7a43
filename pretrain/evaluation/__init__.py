"""Downstream evaluation with lm-eval-harness on the model as it is sharded in the run.

- `runner.ModelRunner`: batched log-likelihoods and greedy decoding on any layout, every rank
  taking part (rank 0 broadcasts the batches, the data-parallel replicas share them:
  `Replicas`; `GreedyBatch` stops at its `until` strings);
- `adapter.PretrainLM`: lm-eval's `LM` over a runner (rank 0);
- `tasks`: `evaluate` on every rank (task names, the local ones in tasks/ and lm-eval's own:
  `pretrain.resolve.eval_tasks`);
- eval.tasks every eval.interval steps of a run: `pretrain.training.evaluators.TaskEvaluator`;
- `next_line`: builds the local task python_next_line from the bundled corpus.

lm-eval is imported only when an evaluation runs.
"""
from pretrain.evaluation.runner import GreedyBatch, ModelRunner, Replicas, ScoreRow
from pretrain.resolve.eval_tasks import LOCAL_TASKS, TASKS_DIR, check_tasks
from pretrain.evaluation.tasks import evaluate

__all__ = ["LOCAL_TASKS", "TASKS_DIR", "GreedyBatch", "ModelRunner", "Replicas", "ScoreRow",
           "check_tasks", "evaluate"]
