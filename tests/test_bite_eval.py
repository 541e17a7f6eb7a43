"""When the in-run evaluations are due: every `interval` steps and after the last step, also
when the step count is not a multiple of the interval (the training tests' counts are)."""
from __future__ import annotations

from types import SimpleNamespace

from pretrain.config import load_config
from pretrain.training.evaluators import TaskEvaluator, ValidationLoss


def _trainer(*overrides: str):
    return SimpleNamespace(cfg=load_config(None, list(overrides)), valid_data=object())


def test_tasks_are_evaluated_every_interval_and_after_a_last_step_off_the_interval():
    evaluator = TaskEvaluator(_trainer("eval.tasks=[python_next_line]", "eval.interval=2",
                                       "train.steps=5"))
    assert [s for s in range(1, 6) if evaluator.due(s)] == [2, 4, 5]
    only_last = TaskEvaluator(_trainer("eval.tasks=[python_next_line]", "eval.interval=0",
                                       "train.steps=5"))
    assert [s for s in range(1, 6) if only_last.due(s)] == [5]
    none = TaskEvaluator(_trainer("eval.interval=2", "train.steps=5"))
    assert not any(none.due(s) for s in range(1, 6))


def test_the_validation_loss_is_due_every_interval_and_after_a_last_step_off_the_interval():
    loss = ValidationLoss(_trainer("train.eval_interval=3", "train.steps=7"))
    assert [s for s in range(1, 8) if loss.due(s)] == [3, 6, 7]
    off = ValidationLoss(_trainer("train.eval_interval=0", "train.steps=7"))
    assert not any(off.due(s) for s in range(1, 8))
