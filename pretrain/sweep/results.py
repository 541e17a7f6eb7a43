"""The results of a `pretrain sweep`: one row per run from its metrics.jsonl and ds_config.json,
written as sweep.csv, sweep.md (a Markdown table) and sweep.png (tokens/s and peak memory).

A row's `engine` is the `train.engine` the run built (its "run" record). When the finished runs
span several engines, the plot groups the runs by configuration (the run name without its
engine) and draws a bar per engine in each group, each engine in its own colour.

The median tokens/s and step time leave out the first step, which pays for warm-up, when a run
has more than one; peak memory is the maximum over steps of every rank. Where matplotlib cannot be
imported, the table is still written and the plot skipped with a one-line warning.
"""
from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path
from typing import Any

COLUMNS = ["name", "deepspeed", "zero_stage", "engine", "offload", "micro_batch", "world_size",
           "global_batch", "steps", "tokens_per_s", "step_time_s", "peak_mem_gb_max",
           "peak_mem_gb_ranks", "final_loss", "status"]


def summarize_run(run_dir: Path) -> dict[str, Any]:
    """One result row from a run directory's metrics.jsonl and ds_config.json."""
    row: dict[str, Any] = {c: "" for c in COLUMNS}
    row["name"] = run_dir.name
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] \
        if metrics.is_file() else []
    run = next((r for r in records if r.get("kind") == "run"), {})
    steps = [r for r in records if r.get("kind") == "train"]
    ds_path = run_dir / "ds_config.json"
    if ds_path.is_file():
        ds = json.loads(ds_path.read_text())
        zero = ds.get("zero_optimization", {})
        devices = [zero.get(k, {}).get("device", "none") for k in ("offload_optimizer", "offload_param")]
        row.update(zero_stage=zero.get("stage", 0),
                   offload="none" if devices == ["none", "none"] else
                   f"opt={devices[0]},param={devices[1]}",
                   micro_batch=ds.get("train_micro_batch_size_per_gpu", ""))
    row.update(world_size=run.get("world_size", ""), global_batch=run.get("global_batch", ""),
               deepspeed=run.get("deepspeed_config", ""), engine=run.get("engine", ""),
               steps=len(steps))
    if not steps:
        row["status"] = "no steps"
        return row
    timed = steps[1:] if len(steps) > 1 else steps  # step 1 pays for warm-up
    ranks = [r.get("peak_mem_gb_ranks") or [r["peak_mem_gb"]] for r in steps]
    per_rank = [max(values) for values in zip(*ranks)]
    row.update(tokens_per_s=round(statistics.median(r["tokens_per_s"] for r in timed), 1),
               step_time_s=round(statistics.median(r["step_time_s"] for r in timed), 4),
               peak_mem_gb_max=round(max(per_rank), 3),
               peak_mem_gb_ranks=";".join(f"{v:.3f}" for v in per_rank),
               final_loss=round(steps[-1]["loss"], 4), status="ok")
    return row


def write_results(rows: list[dict[str, Any]], out: Path) -> dict[str, Path]:
    """sweep.csv, sweep.md and sweep.png (where matplotlib imports) under `out`; their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / "sweep.csv", "md": out / "sweep.md", "png": out / "sweep.png"}
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
    paths["md"].write_text("\n".join(lines) + "\n")
    plt = _pyplot()
    if plt is None:
        del paths["png"]
    else:
        _plot(plt, rows, paths["png"])
    return paths


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or None with a warning: after hours of runs, a
    missing plotting library must not cost the table."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on cluster nodes
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(f"warning: sweep.png skipped: matplotlib cannot be imported ({exc}); "
              "pip install matplotlib", file=sys.stderr)
        return None
    return plt


# Bar colours of each engine when a sweep compares engines (runs of one engine: speed blue,
# memory orange); an engine not listed takes the next of SPARE_COLOURS.
ENGINE_COLOURS = {"deepspeed": "tab:blue", "fsdp2": "tab:green"}
SPARE_COLOURS = ["tab:purple", "tab:brown", "tab:olive"]


def engine_colours(rows: list[dict[str, Any]]) -> dict[str, str]:
    """The colour of each engine the rows name, in their order."""
    engines = list(dict.fromkeys(str(r["engine"]) for r in rows))
    spare = iter(SPARE_COLOURS * len(engines))
    return {e: ENGINE_COLOURS.get(e) or next(spare) for e in engines}


def _plot(plt: Any, rows: list[dict[str, Any]], path: Path) -> None:
    ok = [r for r in rows if r["status"] == "ok"]
    colours = engine_colours(ok)
    fig, (ax_speed, ax_mem) = plt.subplots(1, 2, figsize=(max(8, 1.2 * len(ok) + 4), 4.5))
    if len(colours) > 1:
        _bars_per_engine(ax_speed, ok, "tokens_per_s", colours)
        _bars_per_engine(ax_mem, ok, "peak_mem_gb_max", colours)
        legend = ", ".join(f"{colour.removeprefix('tab:')}: {engine}"
                           for engine, colour in colours.items())
        title = f"pretrain sweep: {len(ok)} of {len(rows)} runs finished ({legend})"
    else:
        names = [r["name"] for r in ok]
        ax_speed.bar(names, [r["tokens_per_s"] for r in ok], color="tab:blue")
        ax_mem.bar(names, [r["peak_mem_gb_max"] for r in ok], color="tab:orange")
        title = f"pretrain sweep: {len(ok)} of {len(rows)} runs finished"
    ax_speed.set_ylabel("tokens/s (median step)")
    ax_mem.set_ylabel("peak memory per rank, GB (max over ranks)")
    for ax in (ax_speed, ax_mem):
        ax.tick_params(axis="x", rotation=45)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _bars_per_engine(ax: Any, rows: list[dict[str, Any]], column: str,
                     colours: dict[str, str]) -> None:
    """A group of bars per configuration (the run's name without its engine), one bar per
    engine in the engine's colour, each labelled with its engine."""
    groups = list(dict.fromkeys(_configuration(r) for r in rows))
    width = 0.8 / len(colours)
    ticks, labels = [], []
    for g, group in enumerate(groups):
        for e, engine in enumerate(colours):
            row = next((r for r in rows if _configuration(r) == group
                        and str(r["engine"]) == engine), None)
            if row is None:
                continue
            x = g + (e - (len(colours) - 1) / 2) * width
            ax.bar(x, row[column], width=width * 0.9, color=colours[engine])
            ticks.append(x)
            labels.append(f"{group} {engine}")
    ax.set_xticks(ticks, labels)


def _configuration(row: dict[str, Any]) -> str:
    """The run's name without the engine `pretrain sweep --engines` puts before it."""
    return str(row["name"]).removeprefix(f"{row['engine']}_") or str(row["name"])
