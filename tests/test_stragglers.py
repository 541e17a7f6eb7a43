"""Stragglers (`pretrain.training.stragglers`): the verdict from measured times, and 2-rank runs where
one rank is slowed - through fake measured times (a naming no timing can move) and through a
real delay far above a tiny step's time."""
from __future__ import annotations

import threading

import pytest

from pretrain.training.collective_log import CollectiveLog, _wrap
from pretrain.config import load_config
from pretrain.errors import ConfigError
from pretrain.training.stragglers import StragglerWatch, slow_ranks
from pretrain.testing.faults import straggler_environment
from pretrain.testing.runs import REPO, run_pretrain, train_args


@pytest.mark.parametrize("override", ["train.straggler_interval=-1", "train.straggler_margin=0",
                                      "train.straggler_patience=0"])
def test_straggler_settings_are_checked(override):
    with pytest.raises(ConfigError, match="need straggler_interval >= 0 .0: off."):
        load_config(str(REPO / "configs" / "tiny.yaml"), overrides=[override])


def test_slow_ranks_are_those_above_the_median_by_the_margin():
    assert slow_ranks([1.0, 1.0, 1.3, 1.0], margin=0.2) == [2]
    assert slow_ranks([1.0, 1.0, 1.1, 1.0], margin=0.2) == []
    assert slow_ranks([1.0, 1.0], margin=0.2) == []


def test_a_rank_is_named_after_patience_checks_in_a_row():
    lines = []
    watch = StragglerWatch(interval=0, margin=0.2, patience=2, rank=0, log=lines.append)
    even, slow = [(1.0, 0.1, 0.5)] * 3, [(1.0, 0.1, 0.5), (2.0, 0.1, 0.0), (1.0, 0.1, 0.5)]
    hosts = ["a", "b", "c"]
    assert "stragglers" not in watch._judge(even, hosts=hosts, step=1)
    assert "stragglers" not in watch._judge(slow, hosts=hosts, step=2)  # once: not yet
    named = watch._judge(slow, hosts=hosts, step=3)["stragglers"]
    assert [(s["rank"], s["host"]) for s in named] == [(1, "b")]
    assert named[0]["slowdown"] == pytest.approx(2.1 / 1.1)
    assert "[straggler] step 3: rank 1 (host b)" in lines[0]
    assert "stragglers" not in watch._judge(even, hosts=hosts, step=4)  # caught up
    assert "stragglers" not in watch._judge(slow, hosts=hosts, step=5)  # the count restarted
    text, slowest = watch.summary()
    assert slowest[0]["rank"] == 1 and "1 naming(s)" in text


def test_the_collective_wrapper_times_the_training_threads_calls_only():
    """The hang log's wrapper is the straggler check's clock: seconds inside a wrapped call
    are added for the timed thread, not for another thread, and not after timing stops."""
    log = CollectiveLog()
    ticks = iter([10.0, 12.5, 20.0, 21.0])
    log.clock = lambda: next(ticks)
    barrier = _wrap(lambda group=None: None, "barrier", log)
    barrier()  # no thread timed yet: no clock read
    log.time_thread(threading.current_thread())
    barrier()
    assert log.wait_seconds == 2.5
    other = threading.Thread(target=barrier)
    other.start()
    other.join()
    assert log.wait_seconds == 2.5  # another thread's call is recorded, not timed
    barrier()
    assert log.wait_seconds == 3.5
    log.time_thread(None)
    barrier()
    assert log.wait_seconds == 3.5 and log.total == 5


def _straggler_run(tmp_path, tiny_data, call: str, overrides: list[str], name: str):
    run_dir = tmp_path / name
    return run_pretrain(
        train_args(run_dir, tiny_data, overrides=["train.steps=4", "train.straggler_interval=1",
                                                  *overrides]),
        run_dir=run_dir, launcher="torchrun", nprocs=2,
        env=straggler_environment(call, directory=tmp_path / name)).check()


def _named(run) -> list[list[int]]:
    """The ranks named at each step's check."""
    return [[s["rank"] for s in r.get("stragglers", [])] for r in run.records
            if r["kind"] == "train"]


@pytest.mark.slow
def test_a_rank_with_slow_measured_times_is_named_an_even_run_names_nobody(tiny_data, tmp_path):
    """Every rank reports the same times at steps 1-2 (an even run: nobody named), then rank 1's
    compute is 1.3 s to the others' 1 s (own time 1.4 s, 12% above the median of 1.25 s): with
    margin 0.1 and patience 2 it is named at step 4, in the step line too. The settings are not
    the defaults, so a run that ignored them would name nobody (margin 0.2) or later (3)."""
    run = _straggler_run(tmp_path, tiny_data, "fake_step_times(1, from_step=3, factor=1.3)",
                         ["train.straggler_patience=2", "train.straggler_margin=0.1"], "fake")
    assert _named(run) == [[], [], [], [1]]
    step4 = [r for r in run.records if r["kind"] == "train"][-1]
    assert step4["stragglers_named"] == 1 and step4["stragglers"][0]["compute_s"] == 1.3
    assert "straggler rank 1 (" in run.stdout and "[straggler] step 4: rank 1 (host" in run.stdout
    summary = [r for r in run.records if r["kind"] == "straggler_summary"]
    assert summary[0]["slowest"][0]["rank"] == 1


@pytest.mark.slow
def test_a_rank_that_really_sleeps_is_named(tiny_data, tmp_path):
    """Rank 1 sleeps 3 s as each step starts. Its own time (compute + data wait) is then above
    1.5x the median of the two ranks whenever a step's own time is under 1.5 s (a tiny step
    after the first takes about 0.1 s, 0.3 s on a loaded 2-core machine), and rank 0, which waits
    for it in the collectives, never is: rank 1 is named at the checks of steps 3 and 4 (step
    2's depends on whether the first step's start-up cost stayed under 1.5 s)."""
    run = _straggler_run(tmp_path, tiny_data, "delay_rank(1, 3.0)",
                         ["train.straggler_patience=2", "train.straggler_margin=0.5"], "delay")
    named = _named(run)
    assert named[2:] == [[1], [1]] and named[1] in ([], [1]) and named[0] == [], named
