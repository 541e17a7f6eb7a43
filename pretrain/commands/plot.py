"""`pretrain plot RUN [RUN ...] [--output FILE]`: compare runs' loss curves in one PNG.

Each RUN is a run directory of `pretrain train` (or its metrics.jsonl). The picture has train
loss with validation points, learning rate and tokens/s against the step, one line per run named
after its directory (`pretrain.training.curves`). A RUN without metrics.jsonl is one `error:` line, exit 2.
"""
from __future__ import annotations

import argparse

DEFAULT_OUTPUT = "curves.png"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN",
                        help="run directory (or its metrics.jsonl); several to compare them")
    parser.add_argument("--output", default=DEFAULT_OUTPUT, metavar="FILE",
                        help="the PNG to write, relative to the current directory")


def run(args: argparse.Namespace) -> None:
    from pretrain.training.curves import read_runs, write_png

    runs = read_runs(args.runs)
    path = write_png(runs, args.output)
    print(f"[plot] {len(runs)} run(s) ({', '.join(run.name for run in runs)}) -> {path}")
