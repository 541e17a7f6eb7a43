"""The hang verdict on faults tests/test_hang.py does not combine: every rank inside the same
collective (each reached it: a stalled transport, no rank to blame), and an async collective
issued but not yet waited for."""
from __future__ import annotations

from tests.test_hang import _entry, _status


def test_every_rank_inside_the_same_collective_names_no_missing_rank():
    from pretrain.training.hang_verdict import verdict

    statuses = {r: _status(r, counts={"1": 5}, last=_entry(5)) for r in range(4)}
    line, record = verdict(statuses, now=100.0)
    assert record["ranks"] == [] and record["silent"] == []
    assert "did not reach" not in line and "no rank waits" not in line, line
    assert line.startswith("[hang] ranks 0-3 wait in all_reduce #5 on group 1 (ranks 0-3), "
                           "which every member reached (for 10.0 s)"), line


def test_an_issued_async_collective_counts_as_waiting():
    from pretrain.training.hang_verdict import verdict

    # rank 0 issued all_reduce #5 asynchronously and is blocked on its handle; rank 1 is at #4
    statuses = {0: _status(0, counts={"1": 5}, last=_entry(5, ranks=(0, 1), state="issued")),
                1: _status(1, counts={"1": 4}, last=_entry(4, ranks=(0, 1), state="done"))}
    line, record = verdict(statuses, now=100.0)
    assert record["ranks"] == [1], line
    assert "rank 1 (node0) did not reach all_reduce #5 on group 1 (ranks 0, 1) that rank 0 "\
           "waits in" in line, line


def test_a_silent_rank_that_reached_the_collective_is_named_beside_the_missing_one():
    from pretrain.training.hang_verdict import verdict

    # rank 0 waits in #5; rank 1 never reached it; rank 2 reached it, then stopped answering
    statuses = {0: _status(0, counts={"1": 5}, last=_entry(5, ranks=(0, 1, 2))),
                1: _status(1, counts={"1": 4}, last=_entry(4, ranks=(0, 1, 2), state="done")),
                2: _status(2, counts={"1": 5}, answered=False, at=40.0)}
    line, record = verdict(statuses, now=100.0)
    assert record["ranks"] == [1, 2] and record["silent"] == [2], line
    assert "rank 2 (node1) cannot answer (stopped or frozen: last heard 60 s ago" in line, line
