"""Our own lines (notes, warnings, step and eval results), the level that filters them, and
whether a progress bar is drawn beside them.

Printed from rank 0 only, through tqdm so an active progress bar is not broken. A bar is drawn
only on a terminal (`show_progress_bar`): in a Slurm .out file, a pipe or a file, every redraw
would be a line of its own, and there the plain lines (the trainer's step lines, the
preprocessor's summary) are the log. The threshold is
held by one `Log` object per process, `LOG`, configured once by `pretrain train` from
`logging.level`; `log` and `set_log_level` are its two entry points. The standard library only at
import: commands that never train do not pay for torch or DeepSpeed.
"""
from __future__ import annotations

import sys
from typing import Any

# logging.level of our own lines; "result" (step and eval lines) is shown at every level.
LEVELS = {"debug": 10, "info": 20, "warning": 30, "result": 100}


def library_level(level: str) -> str:
    """The level of DeepSpeed's and MLflow's loggers for our `logging.level`: their INFO lines
    (DeepSpeed's engine configuration is ~170 of them, some on every rank) only at debug; at info
    and warning their own default, WARNING."""
    return "debug" if level == "debug" else "warning"


class Log:
    """Where our lines go and which are shown: those at or above `level` ("result" always)."""

    def __init__(self, level: str = "info") -> None:
        self.level = level

    def set_level(self, level: str) -> None:
        """Apply `logging.level`: our notes below it are not printed, and DeepSpeed's logger gets
        `library_level(level)`. Call it after DeepSpeed is imported (importing it sets its
        logger) and before the engine is built; a DeepSpeed JSON's "log_level" still wins from
        then on."""
        from deepspeed.utils.logging import set_log_level_from_string

        if level not in LEVELS:
            raise ValueError(f"logging.level {level!r}: one of {', '.join(LEVELS)}")
        self.level = level
        set_log_level_from_string(library_level(level))

    def quiet_library(self, name: str) -> None:
        """Set a library's logger (MLflow's, which importing it sets to INFO) to
        `library_level` of our level."""
        import logging

        logging.getLogger(name).setLevel(
            logging.DEBUG if library_level(self.level) == "debug" else logging.WARNING)

    def write(self, msg: str, *, main: bool = True, level: str = "info") -> None:
        """Print `msg` on rank 0 (`main`) when `level` is at or above the threshold."""
        if not main or LEVELS[level] < LEVELS[self.level]:
            return
        from tqdm import tqdm

        tqdm.write(msg, file=sys.stdout)
        sys.stdout.flush()


LOG = Log()  # this process's; `pretrain train` sets its level from logging.level at start


def log(msg: str, *, main: bool = True, level: str = "info") -> None:
    """Print from rank 0 only, below `logging.level` nothing ("result": step and eval lines,
    always)."""
    LOG.write(msg, main=main, level=level)


def set_log_level(level: str) -> None:
    """`LOG.set_level`: apply `logging.level` to our lines and DeepSpeed's logger."""
    LOG.set_level(level)


def show_progress_bar(enabled: bool = True, *, stdout: Any = None, stderr: Any = None) -> bool:
    """Whether to draw a tqdm bar (tqdm draws on stderr): when asked for and both stdout and
    stderr are terminals, so a log captured from either stream gets no bar."""
    return enabled and all(_is_terminal(stream) for stream in
                           (stdout or sys.stdout, stderr or sys.stderr))


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
