"""The last collectives this process entered: a small ring buffer, for naming a hung rank.

`install()` wraps the collectives of the `torch.distributed` namespace once per process, before
DeepSpeed's communication backend exists (it keeps references to some of them, e.g.
`all_gather_into_tensor`): DeepSpeed's `deepspeed.comm` and our own code both call through that
namespace, so this one seam sees the collectives of every layout. torch's internal calls
between its own functions (`all_gather_object` using `all_gather`) are not seen twice, and
collectives inside a region torch.compile traces (a compiled layer's tensor-parallel all-reduce)
are passed through unrecorded, so dynamo traces what it traced before. Not
wrapped: `isend` / `irecv` / `batch_isend_irecv` (torch checks a P2POp's function by identity;
they only issue work) - a pipeline's blocking `send` / `recv` are.

The same wrapper times the blocking calls of one thread (`time_thread`): the training loop's
seconds spent waiting in collectives, which the straggler checks (`pretrain.training.stragglers`) take
as a rank's collective wait.

Each call costs a dict lookup, a list store and a clock read (about a microsecond, measured in
bench/hang_overhead.py), against a collective's tens of microseconds at least.

Per process group a sequence number counts the collectives entered on it: ranks of one group
call the same collectives in the same order, so a rank whose count for a group is below the
number another rank waits in never reached that collective.
"""
from __future__ import annotations

import functools
import inspect
import threading
import time
from typing import Any, Callable

import torch.distributed as torch_dist
from torch.compiler import is_compiling

OPS = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
       "all_gather_object", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
       "broadcast", "broadcast_object_list", "gather", "gather_object", "reduce", "reduce_scatter",
       "reduce_scatter_tensor", "scatter", "scatter_object_list", "send", "recv",
       "all_gather_single", "reduce_scatter_single")  # the last two: FSDP2's, in recent torch
SIZE = 64  # entries kept


class CollectiveLog:
    """The last `size` collectives: [seq, op, group name, group ranks, wall start, state], state
    one of waiting (inside a blocking call), done, issued (async: handed back a Work), failed."""

    def __init__(self, size: int = SIZE):
        self.entries: list[list | None] = [None] * size
        self.total = 0
        self.counts: dict[str, int] = {}  # collectives entered per group name
        self._groups: dict[int, tuple[str, tuple[int, ...]]] = {}
        self.timed_thread: threading.Thread | None = None
        self.wait_seconds = 0.0  # inside collectives, on `timed_thread`
        self.clock: Callable[[], float] = time.perf_counter

    def time_thread(self, thread: threading.Thread | None) -> None:
        """Add the seconds `thread` spends inside the wrapped calls to `wait_seconds` (None:
        stop timing)."""
        self.timed_thread = thread

    def _group(self, group: Any) -> tuple[str, tuple[int, ...]]:
        found = self._groups.get(id(group))
        if found is None:
            try:
                pg = group if group is not None else torch_dist.distributed_c10d._get_default_group()
                found = (str(pg.group_name), tuple(torch_dist.get_process_group_ranks(pg)))
            except Exception:  # noqa: BLE001 - a group this rank is not in: torch returns early
                found = ("?", ())
            self._groups[id(group)] = found
        return found

    def start(self, op: str, group: Any) -> list:
        name, ranks = self._group(group)
        seq = self.counts.get(name, 0) + 1
        self.counts[name] = seq
        entry = [seq, op, name, ranks, time.time(), "waiting"]
        self.entries[self.total % len(self.entries)] = entry
        self.total += 1
        return entry

    def recent(self) -> list[list]:
        """The kept entries, oldest first (copies: safe to read from another thread)."""
        n = len(self.entries)
        order = range(self.total - min(self.total, n), self.total)
        return [list(e) for e in (self.entries[i % n] for i in order) if e is not None]

    def last(self) -> dict[str, Any] | None:
        recent = self.recent()
        return as_dict(recent[-1]) if recent else None


def as_dict(entry: list) -> dict[str, Any]:
    seq, op, group, ranks, started, state = entry
    return {"seq": seq, "op": op, "group": group, "ranks": list(ranks), "started": started,
            "state": state}


def describe(entry: dict[str, Any], *, now: float) -> str:
    """`all_reduce #7 on group 3 (ranks 0-1), waiting for 12.0 s`."""
    return (f"{entry['op']} #{entry['seq']} on group {entry['group']} "
            f"({rank_list(entry['ranks'])}), {entry['state']}"
            + (f" for {now - entry['started']:.1f} s" if entry["state"] == "waiting" else ""))


def rank_list(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


LOG = CollectiveLog()  # this process's


def _wrap(fn: Callable, op: str, log: CollectiveLog) -> Callable:
    params = list(inspect.signature(fn).parameters)
    at = params.index("group") if "group" in params else None

    @functools.wraps(fn)
    def collective(*args, **kwargs):
        if is_compiling():  # traced by dynamo (a compiled layer's tensor-parallel all-reduce):
            return fn(*args, **kwargs)  # exactly what it traced before; no record of it
        if "group" in kwargs:
            group = kwargs["group"]
        else:
            group = args[at] if at is not None and len(args) > at else None
        entry = log.start(op, group)
        timed = log.timed_thread is not None and threading.current_thread() is log.timed_thread
        started = log.clock() if timed else 0.0
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            entry[5] = "failed"
            raise
        finally:
            if timed:
                log.wait_seconds += log.clock() - started
        entry[5] = "issued" if hasattr(result, "wait") else "done"
        return result

    collective.recorded = True
    return collective


def install(log: CollectiveLog = LOG) -> None:
    """Record every collective of `torch.distributed` in `log` from now on (idempotent)."""
    for op in OPS:
        fn = getattr(torch_dist, op, None)
        if fn is not None and not getattr(fn, "recorded", False):
            setattr(torch_dist, op, _wrap(fn, op, log))
