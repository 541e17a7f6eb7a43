"""One evaluation of lm-eval tasks on every rank (which tasks a name means:
`pretrain.resolve.eval_tasks`). Datasets are read offline: a standard task needs its dataset
in the Hugging Face cache of the machine that runs it.
"""
from __future__ import annotations

import contextlib
import random
from typing import Any

import numpy as np
import torch

from pretrain.resolve.eval_tasks import offline, task_manager

# lm-eval's result keys are "metric,filter"; these are not scores
_NOT_SCORES = ("alias", "samples", "name", "sample_len")


@contextlib.contextmanager
def _random_states_kept():
    """lm-eval seeds the global generators: training after it must draw as without it."""
    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])


def scores_of(results: dict[str, Any]) -> dict[str, float]:
    """{"task/metric": value} of lm-eval's results ("acc,none" -> "acc"; stderr left out)."""
    scores = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if metric in _NOT_SCORES or "stderr" in metric or not isinstance(value, (int, float)):
                continue
            name = metric if filt in ("", "none") else f"{metric}_{filt}"
            scores[f"{task}/{name}"] = float(value)
    return scores


def evaluate(runner, tokenizer, *, tasks: list[str], limit: int | None = None,
             manager=None) -> dict[str, float] | None:
    """Evaluate `tasks` with `runner` (collective: every rank calls it). Rank 0 returns the
    scores {"task/metric": value}; the other ranks serve its forwards and return None."""
    if runner.decode is None:  # every rank decodes, to stop generations at their strings
        runner.decode = tokenizer.decode
    if not runner.is_driver:
        runner.serve()
        return None
    offline()
    from lm_eval import simple_evaluate

    from pretrain.evaluation.adapter import PretrainLM

    try:
        with _random_states_kept():
            results = simple_evaluate(
                model=PretrainLM(runner, tokenizer), tasks=list(tasks), limit=limit,
                task_manager=manager or task_manager(tasks), log_samples=False,
                bootstrap_iters=0, random_seed=None, numpy_random_seed=None,
                torch_random_seed=None, fewshot_random_seed=1234, verbosity="WARNING")
    except BaseException as exc:
        runner.stop(error=f"{type(exc).__name__}: {exc}")
        raise
    runner.stop()
    return scores_of(results)
