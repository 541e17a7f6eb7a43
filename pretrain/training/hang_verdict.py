"""The hang verdict: from every rank's status, which rank(s) the others wait for.

A status (`pretrain.training.hang.Watchdog.status`) says, for one rank: its host, last finished step,
how many collectives it entered per process group (`counts`), the last one (`last`: op, group,
its ranks, sequence number, state) and whether it answered the alarm (`answered`; a rank that did
not is known only by its last heartbeat, or not at all).

The waiters are the ranks whose last collective is still running (blocking: "waiting"; async:
"issued" - the wait for it comes later). For each collective waited in, a member of its group
whose count for that group is below its sequence number never reached it. Of those, the ranks
that are not themselves waiting elsewhere are the cause (a chain: rank 0 waits for rank 1, which
waits for rank 2, names rank 2); if all of them wait elsewhere (collectives called in a different
order on different ranks) they are all named. If every member reached the collective its ranks wait in
(a stalled transport), no rank is named and the line says so. A rank that did not answer is named as such
whether or not it reached the collective.
"""
from __future__ import annotations

from typing import Any

from pretrain.training.collective_log import rank_list

WAITING = ("waiting", "issued")


def verdict(statuses: dict[int, dict[str, Any] | None], *,
            now: float) -> tuple[str, dict[str, Any]]:
    """The one verdict line and the metrics record ({"kind": "hang", ...})."""
    silent = sorted(r for r, s in statuses.items() if not (s and s["answered"]))
    waits: dict[tuple[str, int], dict[str, Any]] = {}  # (group, seq) -> collective
    waiters: dict[tuple[str, int], list[int]] = {}
    for rank, s in statuses.items():
        last = s and s["answered"] and s["last"]
        if last and last["state"] in WAITING:
            key = (last["group"], last["seq"])
            waits.setdefault(key, last)
            waiters.setdefault(key, []).append(rank)
    waiting = {r for ranks in waiters.values() for r in ranks}
    missing: dict[int, dict[str, Any]] = {}  # a rank that did not reach -> the collective
    for key, last in waits.items():
        for member in last["ranks"]:
            s = statuses.get(member)
            if s is None or s["counts"].get(last["group"], 0) < last["seq"]:
                missing.setdefault(member, last)
    causes = sorted(r for r in missing if r not in waiting) or sorted(missing)
    named = sorted(set(causes) | set(silent))
    parts = []
    for rank in named:
        parts.append(_describe_rank(rank, statuses.get(rank), missing.get(rank),
                                    waiters=waiters, now=now))
    if not named and waits:  # every member reached what its ranks wait in: nobody to blame
        for key, last in sorted(waits.items()):
            them = waiters[key]
            parts.append(f"{rank_list(them)} wait{'s' if len(them) == 1 else ''} in {name(last)}, "
                         f"which every member reached (for {now - last['started']:.1f} s): the "
                         f"collective itself is stalled (network, transport), no rank is missing "
                         f"(see their stacks in hang/rank<N>.txt)")
    elif not named:
        stuck = sorted(statuses)
        parts.append(f"no rank waits in a collective: {rank_list(stuck)} made no progress "
                     f"(see their stacks in hang/rank<N>.txt)")
    line = "[hang] " + "; ".join(parts)
    hosts = sorted({statuses[r]["host"] for r in named if statuses.get(r)})
    record = {"kind": "hang", "step": max((s["step"] for s in statuses.values() if s), default=0),
              "hangs": 1, "ranks_named": len(named), "ranks": named, "hosts": hosts,
              "silent": silent, "verdict": line}
    return line, record


def _describe_rank(rank: int, status: dict[str, Any] | None, collective: dict[str, Any] | None,
                   *, waiters: dict[tuple[str, int], list[int]], now: float) -> str:
    host = f" ({status['host']})" if status else ""
    text = f"rank {rank}{host}"
    if status is None:
        text += " cannot answer (never heard from: dead or stopped before its first heartbeat)"
    elif not status["answered"]:
        text += (f" cannot answer (stopped or frozen: last heard {now - status['at']:.0f} s ago, "
                 f"at step {status['step']})")
    if collective is not None:
        them = waiters[(collective["group"], collective["seq"])]
        text += (f"{' and' if status is None or not status['answered'] else ''} did not reach "
                 f"{name(collective)} that {rank_list(them)} wait{'s' if len(them) == 1 else ''}"
                 f" in (for {now - collective['started']:.1f} s)")
    if status is not None and status["answered"]:
        last = status["last"]
        where = ("waits in no collective" if last is None or last["state"] not in WAITING
                 else f"waits in {name(last)}")
        text += (f"; it finished step {status['step']} and {where}"
                 + (f" (last: {name(last)}, {last['state']})" if last and "no" in where else "")
                 + f"; its stack: hang/rank{rank}.txt")
    return text


def name(collective: dict[str, Any]) -> str:
    """`all_reduce #7 on group 4 (ranks 0, 1)`."""
    return (f"{collective['op']} #{collective['seq']} on group {collective['group']} "
            f"({rank_list(collective['ranks'])})")
