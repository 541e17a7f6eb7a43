"""Which lm-eval tasks a run may name, and one evaluation of them on every rank.

Task names are lm-eval's: the local tasks shipped in tasks/ beside this file (found without
indexing lm-eval's ~15,000 task files), else any task of the installed lm-eval (indexed only
when a name is not local: ~15 s). Datasets are read offline (HF_DATASETS_OFFLINE /
HF_HUB_OFFLINE set unless the user set them): a standard task needs its dataset in the Hugging
Face cache of the machine that runs it.
"""
from __future__ import annotations

import contextlib
import logging
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pretrain.config import RunConfig, did_you_mean
from pretrain.errors import ConfigError

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
LOCAL_TASKS = tuple(sorted(p.stem for p in TASKS_DIR.glob("*.yaml")))
# lm-eval's result keys are "metric,filter"; these are not scores
_NOT_SCORES = ("alias", "samples", "name", "sample_len")


def offline() -> None:
    """No download at evaluation time (the user's own setting wins), no progress bars of the
    datasets library between the run's lines."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()


def task_manager(names: list[str]):
    """An lm-eval TaskManager that knows the local tasks, and lm-eval's own when a name needs
    them."""
    offline()
    from lm_eval.tasks import TaskManager

    # lm-eval warns of every local task's data hook (custom_dataset) at every load
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    return TaskManager(include_path=str(TASKS_DIR),
                       include_defaults=any(name not in LOCAL_TASKS for name in names))


def check_eval_config(cfg: RunConfig) -> None:
    """Refuse, before any process group exists, tasks lm-eval does not know and layouts the
    evaluation cannot run on."""
    if not cfg.eval.tasks:
        return
    if cfg.parallel.context > 1:
        raise ConfigError("eval.tasks with parallel.context > 1: the evaluation does not split "
                          "sequences over context ranks; evaluate the checkpoint with "
                          "`pretrain eval`, or set eval.tasks=[]")
    check_tasks(list(cfg.eval.tasks))


def check_tasks(names: list[str], *, where: str = "eval.tasks") -> None:
    """ConfigError naming the first unknown task, the near names, and where tasks come from."""
    unknown = [name for name in names if name not in LOCAL_TASKS]
    if not unknown:
        return
    try:
        known = set(task_manager(unknown).all_tasks)
    except ImportError as exc:
        raise ConfigError(f"{where}: lm-eval is not installed ({exc}): pip install "
                          "lm-eval (setup.py carries it)") from None
    for name in unknown:
        if name not in known:
            raise ConfigError(
                f"{where}: unknown task {name!r}{did_you_mean(name, list(known))}: name a task "
                f"of lm-eval (`lm_eval ls tasks`) or a local one ({', '.join(LOCAL_TASKS)})")


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
