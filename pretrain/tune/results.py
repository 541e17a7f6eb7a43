"""What a `pretrain tune` study leaves: the best trial and the command that reruns it, every
trial as CSV, the plots (history, importances, contour of the two most important parameters)
and the summary lines.
"""
from __future__ import annotations

import contextlib
import csv
import io
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

from pretrain.tune.space import override
from pretrain.tune.study import Settings, counted, params_text, retried


def best_trial(study: Any) -> Any | None:
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return min(complete, key=lambda t: t.value) if complete else None


def best_command(settings: Settings, trial: Any) -> str:
    """`pretrain train` with the best trial's overrides: the line to train with."""
    args = ["pretrain", "train"] + (["--config", settings.config] if settings.config else [])
    for text in settings.base_overrides + [override(p.key, trial.params[p.key])
                                           for p in settings.params]:
        args += ["--set", text]
    return shlex.join(args)


def _trials_csv(study: Any) -> str:
    """The text of trials.csv: Optuna's trials dataframe, or without pandas its few columns."""
    try:
        frame = study.trials_dataframe()
    except ImportError:  # pandas: the few columns that matter, by hand
        rows = [{"number": t.number, "state": t.state.name, "value": t.value,
                 **{f"params_{k}": v for k, v in t.params.items()}}
                for t in study.get_trials(deepcopy=False)]
        names = sorted({k for r in rows for k in r}, key=lambda k: (k != "number", k))
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=names)
        writer.writeheader()
        writer.writerows(rows)
        return text.getvalue()
    return frame.to_csv(index=False)


def write_results(study: Any, settings: Settings, *, plots: bool) -> dict[str, Path]:
    """trials.csv and best.yaml (and with `plots`, the PNGs) in the study directory."""
    from pretrain.files import write_text_atomic

    out = settings.study_dir
    paths = {"csv": out / "trials.csv"}
    write_text_atomic(paths["csv"], _trials_csv(study))
    best = best_trial(study)
    if best is not None:
        paths["best"] = out / "best.yaml"
        record = {"study": settings.study_name, "trial": best.number, "value": best.value,
                  "objective": f"{settings.objective} loss",
                  "overrides": {p.key: best.params[p.key] for p in settings.params},
                  "command": best_command(settings, best)}
        write_text_atomic(paths["best"], yaml.safe_dump(record, sort_keys=False))
    if plots:
        paths.update(write_plots(study, settings))
    return paths


def write_plots(study: Any, settings: Settings) -> dict[str, Path]:
    """history.png, importances.png, contour.png where they can be drawn; a one-line warning
    for each that cannot (matplotlib missing, too few trials): a plot never fails the study."""
    from optuna.trial import TrialState

    out = settings.study_dir
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from optuna.visualization import matplotlib as ovm
    except ImportError as exc:
        print(f"warning: tune plots skipped: matplotlib cannot be imported ({exc}); "
              "pip install matplotlib", file=sys.stderr)
        return {}
    import warnings

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    keys = [p.key for p in settings.params]
    lr = next((k for k in keys if k.endswith(".lr")), None)
    other = next((k for k in keys if k != lr), None)
    wanted: dict[str, tuple[Any, str | None]] = {
        "history": (lambda: ovm.plot_optimization_history(study),
                    None if complete else "no complete trial"),
        "importances": (lambda: ovm.plot_param_importances(study),
                        "fewer than 2 parameters" if len(keys) < 2 else
                        "fewer than 2 complete trials" if len(complete) < 2 else None),
        "contour": (lambda: contour(complete, lr, other, settings),
                    "the space has no *.lr and second parameter" if not (lr and other) else
                    "fewer than 2 complete trials" if len(complete) < 2 else None),
    }
    written = {}
    for name, (draw, missing) in wanted.items():
        path = out / f"{name}.png"
        if missing:
            print(f"{settings.label} {path.name} skipped: {missing}", flush=True)
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Optuna's "experimental" notes
                axes = draw()
            figure = (axes.flat[0] if hasattr(axes, "flat") else axes).get_figure()
            figure.savefig(path, dpi=100, bbox_inches="tight")
            plt.close(figure)
            written[name] = path
        except Exception as exc:  # noqa: BLE001 - a plot never costs the study its results
            print(f"warning: {path.name} skipped: {type(exc).__name__}: {exc}", file=sys.stderr,
                  flush=True)
            plt.close("all")
    return written


def contour(complete: list[Any], x_key: str, y_key: str, settings: Settings) -> Any:
    """The objective over (x, y) of the complete trials: filled contours of a linear
    interpolation over their Delaunay triangulation (matplotlib's; Optuna's own contour plot
    needs scipy), each trial a point, the best a star. Log axes for log-scaled parameters; a
    categorical parameter is drawn at the index of its choice."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.tri import Triangulation

    def coordinate(key: str) -> tuple[np.ndarray, bool, list[Any] | None]:
        param = next(p for p in settings.params if p.key == key)
        values = [t.params[key] for t in complete]
        if param.kind == "categorical":
            return np.array([param.choices.index(v) for v in values], float), False, \
                list(param.choices)
        return np.array(values, float), param.log, None

    (x, x_log, x_ticks), (y, y_log, y_ticks) = coordinate(x_key), coordinate(y_key)
    z = np.array([t.value for t in complete], float)
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    # interpolate in the space the sampler searched (log10 for log-scaled parameters)
    tx, ty = (np.log10(x) if x_log else x), (np.log10(y) if y_log else y)
    filled = None
    if len(z) >= 3 and z.max() > z.min():
        with contextlib.suppress(RuntimeError, ValueError):  # collinear points: no triangle
            filled = ax.tricontourf(Triangulation(tx, ty), z, cmap="viridis_r",
                                    levels=np.linspace(z.min(), z.max(), 13))
    points = ax.scatter(tx, ty, c=z, cmap="viridis_r", edgecolors="black", zorder=3)
    best = int(np.argmin(z))
    ax.scatter([tx[best]], [ty[best]], marker="*", s=300, c="red", edgecolors="black", zorder=4,
               label=f"best: trial {complete[best].number}, {z[best]:.4f}")
    fig.colorbar(filled if filled is not None else points, ax=ax,
                 label=f"{settings.objective} loss")
    for axis, key, log, ticks in (("x", x_key, x_log, x_ticks), ("y", y_key, y_log, y_ticks)):
        getattr(ax, f"set_{axis}label")(f"log10 {key}" if log else key)
        if ticks is not None:
            getattr(ax, f"set_{axis}ticks")(range(len(ticks)), [str(c) for c in ticks])
    ax.margins(0.06)  # points on the hull stay whole
    ax.set_title(f"study {settings.study_name}: {len(z)} complete trials")
    ax.legend(loc="best")
    return ax


def summary(study: Any, settings: Settings) -> list[str]:
    """The closing lines: counts by state, the best trial and its `pretrain train` line."""
    trials = study.get_trials(deepcopy=False)
    finished = counted(trials)
    by_state: dict[str, int] = {}
    for t in finished:
        by_state[t.state.name] = by_state.get(t.state.name, 0) + 1
    states = ", ".join(f"{by_state.get(s, 0)} {s.lower()}" for s in ("COMPLETE", "PRUNED", "FAIL"))
    lines = [f"{settings.label} study {settings.study_name}: {len(finished)}/{settings.trials} "
             f"trials finished ({states}; {len(retried(trials))} interrupted and retried)"]
    best = best_trial(study)
    if best is None:
        lines.append(f"{settings.label} no complete trial: no best parameters")
        return lines
    lines.append(f"{settings.label} best trial {best.number}: {settings.objective} loss "
                 f"{best.value:.4f} with {params_text(best.params)}")
    lines.append(best_command(settings, best))
    return lines
