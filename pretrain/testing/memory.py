"""This process's resident memory from Linux's /proc/self/status, and its peak over a phase:
how the memory tests and benchmarks measure what a step, a build or a save adds."""
from __future__ import annotations

import gc
from typing import Callable


def status_bytes(field: str) -> int:
    """A memory line of /proc/self/status ("VmRSS", "VmHWM", ...), in bytes."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(f"{field} not in /proc/self/status")


def reset_peak() -> None:
    """Restart the resident high-water mark (VmHWM) from the current resident size."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_added(phase: Callable[[], object]) -> int:
    """Bytes the peak resident memory rose, while `phase()` ran, above the resident memory
    before it (garbage collected first)."""
    gc.collect()
    reset_peak()
    before = status_bytes("VmRSS")
    phase()
    return status_bytes("VmHWM") - before
