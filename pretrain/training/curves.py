"""Loss-curve pictures: one or more runs' `metrics.jsonl` drawn against the step.

Three panels, one line per run (the run directory's name in the legend): train loss with the
validation loss of each evaluation as points of the same colour, the learning rate, and tokens/s;
a fourth when a run evaluated downstream tasks (eval.tasks): each score in [0, 1] (accuracies,
exact match) against the step, one marker per score.
The trainer redraws `<run_dir>/curves.png` after every evaluation and at the end of a run;
`pretrain plot` draws several runs in one picture to compare them.

A resumed run appends to its `metrics.jsonl` and may log a step again (it restarts from its last
checkpoint): the last record of a step is the one drawn. matplotlib is imported only when a
picture is drawn, on the Agg canvas (no display, no pyplot state in a training process).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from pretrain.errors import PretrainError
from pretrain.files import atomic_file

METRICS = "metrics.jsonl"
FIGSIZE_INCHES, DPI = (10.0, 9.0), 100  # a 1000 x 900 pixel PNG
# (series, y-axis label) of each panel, top to bottom.
PANELS = (("train_loss", "loss"), ("lr", "learning rate"), ("tokens_per_s", "tokens/s"))
TASKS_PANEL = ("tasks", "task scores")  # drawn when a run has "tasks" records
TASK_MARKERS = "os^vD*xP"
# series -> field of the "train" records it is read from.
TRAIN_FIELDS = {"train_loss": "loss", "lr": "lr", "tokens_per_s": "tokens_per_s"}

Series = list[tuple[int, float]]  # (step, value), by step


@dataclass
class RunCurves:
    """What the picture shows of one run."""

    name: str
    train_loss: Series
    valid_loss: Series
    lr: Series
    tokens_per_s: Series
    tasks: dict[str, Series] = field(default_factory=dict)  # "task/metric": scores in [0, 1]


def metrics_path(run: str | Path) -> Path:
    """The metrics.jsonl of a run directory (or the file itself); a PretrainError when missing."""
    path = Path(run)
    if path.is_dir():
        path = path / METRICS
    if not path.is_file():
        raise PretrainError(f"{str(run)!r} has no {METRICS}: pass a run directory of "
                            "`pretrain train` (its run_dir) or a metrics.jsonl file")
    return path


def read_curves(run: str | Path, *, name: str | None = None) -> RunCurves:
    """The series of one run (named after its directory unless `name` is given)."""
    path = metrics_path(run)
    series: dict[str, dict[int, float]] = {key: {} for key in (*TRAIN_FIELDS, "valid_loss")}
    scores: dict[str, dict[int, float]] = {}
    for record in _records(path):
        step = record.get("step")
        if record.get("kind") == "train":
            for key, field in TRAIN_FIELDS.items():
                _put(series[key], step, record.get(field))
        elif record.get("kind") == "eval":
            _put(series["valid_loss"], step, record.get("loss"))
        elif record.get("kind") == "tasks":
            for key, value in record.items():
                if "/" in key:
                    _put(scores.setdefault(key, {}), step, value)
    # accuracies and the like share one axis; perplexities and bits per byte would flatten it
    tasks = {key: sorted(values.items()) for key, values in scores.items()
             if all(0.0 <= v <= 1.0 for v in values.values())}
    return RunCurves(name=name or path.parent.resolve().name, tasks=tasks,
                     **{key: sorted(values.items()) for key, values in series.items()})


def read_runs(runs: Sequence[str | Path]) -> list[RunCurves]:
    """Every run's curves, named after their directories, or after the paths as given when two
    directories share a name (runs/a/x and runs/b/x)."""
    names = [metrics_path(run).parent.resolve().name for run in runs]
    unique = len(set(names)) == len(names)
    return [read_curves(run, name=name if unique else str(run)) for run, name in zip(runs, names)]


def _records(path: Path) -> list[dict]:
    """The JSON records of a metrics.jsonl; a last line cut short (a run writing it now, or
    killed while writing) is left out."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise PretrainError(f"{path}:{number} is not a JSON record: {line[:80]!r}") \
                    from None
    return records


def _put(values: dict[int, float], step: object, value: object) -> None:
    """Keep a finite number at an integer step (null is how metrics.jsonl writes NaN and inf)."""
    if isinstance(step, int) and isinstance(value, (int, float)) and not isinstance(value, bool):
        values[step] = float(value)


def write_png(runs: Sequence[RunCurves], path: str | Path) -> Path:
    """Draw `runs` into a PNG at `path`, replaced atomically (a reader never sees half of it)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=FIGSIZE_INCHES, dpi=DPI)
    FigureCanvasAgg(figure)
    panels = PANELS + ((TASKS_PANEL,) if any(run.tasks for run in runs) else ())
    axes = figure.subplots(len(panels), 1, sharex=True)
    for index, run in enumerate(runs):
        _draw_run(axes, run, color=f"C{index % 10}")
    for ax, (_, label) in zip(axes, panels):
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small", loc="best")
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as out:
        figure.savefig(out, format="png", dpi=DPI)
    return path


def _draw_run(axes, run: RunCurves, *, color: str) -> None:
    for ax, (key, _) in zip(axes, PANELS):
        points = getattr(run, key)
        if points:
            ax.plot(*zip(*points), color=color, linewidth=1.2, label=run.name)
    if run.valid_loss:
        axes[0].plot(*zip(*run.valid_loss), "o", color=color, markersize=5,
                     label=f"{run.name} (valid)")
    for index, (score, points) in enumerate(sorted(run.tasks.items())):
        axes[len(PANELS)].plot(*zip(*points), color=color, linewidth=1.0,
                               marker=TASK_MARKERS[index % len(TASK_MARKERS)], markersize=5,
                               label=f"{run.name} {score}")
