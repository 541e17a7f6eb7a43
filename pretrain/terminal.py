"""Whether this process writes to a terminal: progress bars are drawn only there.

In a Slurm .out file, a pipe or a file, every redraw of a tqdm bar would be a line of its own;
there the plain lines (the trainer's step lines, the preprocessor's summary) are the log. The
standard library only, so a data command decides without loading torch.
"""
from __future__ import annotations

import sys
from typing import Any


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
