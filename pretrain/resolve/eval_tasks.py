"""Which lm-eval tasks a name means: the local tasks shipped in pretrain/evaluation/tasks/ (found
without indexing lm-eval's ~15,000 task files), else any task of the installed lm-eval (indexed
only when a name is not local: ~15 s). Datasets are read offline (HF_DATASETS_OFFLINE /
HF_HUB_OFFLINE set unless the user set them). Neither torch nor lm-eval at import: the run's
checks (`pretrain.resolve.run_checks`) name tasks before any model exists.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from pretrain.config import did_you_mean
from pretrain.errors import ConfigError

TASKS_DIR = Path(__file__).resolve().parents[1] / "evaluation" / "tasks"
LOCAL_TASKS = tuple(sorted(p.stem for p in TASKS_DIR.glob("*.yaml")))


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
