"""When the in-run evaluations are due: every `interval` steps and after the last step, also
when the step count is not a multiple of the interval (the training tests' counts are)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from pretrain.config import load_config
from pretrain.training.evaluators import TaskEvaluator, ValidationLoss
from pretrain.training.loop_state import LoopState, Position


def _state(*overrides: str, valid_data=(), **pieces) -> LoopState:
    """The `LoopState` of a run of one process with the config `overrides`; the rest of the run
    (engine, data, watchers) as `pieces` give it, else absent."""
    fields = dict(position=Position(step=1), engine=None, device="cpu", main=True, rank=0,
                  world_size=1, groups=None, run_dir=None, checkpoint_layout={},
                  global_batch=1, grad_accum=1, pipelined=False, train_data=None,
                  tokenizer=None, watchdog=None, guard=None, control=None, metrics=None,
                  spikes=None, loader=None, train_step=None, finish_save=None,
                  mean_over_dp=None, draw_curves=None)
    fields.update(pieces)
    return LoopState(cfg=load_config(None, list(overrides)), valid_data=valid_data, **fields)


def test_tasks_are_evaluated_every_interval_and_after_a_last_step_off_the_interval():
    evaluator = TaskEvaluator(_state("eval.tasks=[python_next_line]", "eval.interval=2",
                                       "train.steps=5"))
    assert [s for s in range(1, 6) if evaluator.due(s)] == [2, 4, 5]
    only_last = TaskEvaluator(_state("eval.tasks=[python_next_line]", "eval.interval=0",
                                       "train.steps=5"))
    assert [s for s in range(1, 6) if only_last.due(s)] == [5]
    none = TaskEvaluator(_state("eval.interval=2", "train.steps=5"))
    assert not any(none.due(s) for s in range(1, 6))


def test_the_validation_loss_is_due_every_interval_and_after_a_last_step_off_the_interval():
    loss = ValidationLoss(_state("train.eval_interval=3", "train.steps=7"))
    assert [s for s in range(1, 8) if loss.due(s)] == [3, 6, 7]
    off = ValidationLoss(_state("train.eval_interval=0", "train.steps=7"))
    assert not any(off.due(s) for s in range(1, 8))


class _Engine(torch.nn.Module):
    """A flat engine whose loss of a micro-batch is the mean of its input ids: the validation
    loss over the micro-batches read is then known exactly."""

    def forward(self, input_ids, labels):
        return input_ids.float().mean()


def _validation(*, grad_accum: int, eval_batches: int, samples: int):
    """The validation loss `ValidationLoss` computes over a split of `samples` samples whose
    micro-batch i has ids all equal to i (read by the loader only from the validation split),
    and the losses of the micro-batches it should read."""
    batches = ({"input_ids": torch.full((1, 4), float(i)), "labels": torch.zeros(1, 4)}
               for i in range(samples))  # micro-batches of one sample
    control = SimpleNamespace(stop_agreed=lambda: False, micro_batch_started=lambda *a, **k: None,
                              micro_batch_done=lambda: None)
    valid = list(range(samples))
    state = _state(
        f"train.eval_batches={eval_batches}", "train.eval_interval=1",
        valid_data=valid, train_data=["train"], engine=_Engine(), control=control,
        loader=lambda data, consumed, workers: batches if data is valid else iter(()),
        global_batch=grad_accum,
        grad_accum=grad_accum, watchdog=SimpleNamespace(beat=lambda: None),
        mean_over_dp=lambda t: t.item())
    read = min(eval_batches, max(1, samples // state.global_batch)) * grad_accum
    return ValidationLoss(state).loss(), sum(range(read)) / read


def test_the_validation_loss_reads_eval_batches_global_batches():
    """train.eval_batches global batches of grad_accum micro-batches each, capped by the split's
    size: 3 of 2 micro-batches (the mean of ids 0..5), not 1 (0..1) nor the whole split."""
    loss, expected = _validation(grad_accum=2, eval_batches=3, samples=20)
    assert loss == expected == 2.5
    # a split smaller than eval_batches global batches is read whole (2 batches of 2)
    loss, expected = _validation(grad_accum=2, eval_batches=5, samples=4)
    assert loss == expected == 1.5
