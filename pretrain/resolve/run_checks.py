"""What a run needs beyond its layout, checked where its config is settled (`resolve.run`'s
`settle_config`), so that `train`, `plan` and the Slurm pre-flight refuse the same configs with
the same `error:` line, before any process group: every sink of `logging.report_to` importable
here, every task of `eval.tasks` known to lm-eval and on a layout the evaluation runs on.
"""
from __future__ import annotations

from pretrain.config import RunConfig
from pretrain.errors import ConfigError
from pretrain.resolve.eval_tasks import check_tasks

# The packages each sink of logging.report_to imports (MLflow's SQLite store needs SQLAlchemy
# and Alembic, which mlflow-skinny leaves out).
SINK_PACKAGES = {"tensorboard": ("tensorboard",), "wandb": ("wandb",),
                 "mlflow": ("mlflow", "sqlalchemy", "alembic")}


def check_run(cfg: RunConfig) -> None:
    """Every check of this module on `cfg`."""
    check_sinks(cfg.logging.report_to)
    check_eval_config(cfg)


def check_sinks(report_to: list[str]) -> None:
    """Every sink of `logging.report_to` can be imported: checked before the process group,
    not hours into a run."""
    from importlib.util import find_spec

    for sink in report_to:
        missing = [package for package in SINK_PACKAGES[sink] if find_spec(package) is None]
        if missing:
            raise ConfigError(f"logging.report_to={report_to!r}: {sink} needs {', '.join(missing)}"
                              f", not installed here: bash launch/setup_env.sh (or pip install "
                              f"-c launch/constraints.txt -e .), or take {sink} off the list")


def check_eval_config(cfg: RunConfig) -> None:
    """Refuse tasks lm-eval does not know and layouts the evaluation cannot run on."""
    if not cfg.eval.tasks:
        return
    if cfg.parallel.context > 1:
        raise ConfigError("eval.tasks with parallel.context > 1: the evaluation does not split "
                          "sequences over context ranks; evaluate the checkpoint with "
                          "`pretrain eval`, or set eval.tasks=[]")
    check_tasks(list(cfg.eval.tasks))
