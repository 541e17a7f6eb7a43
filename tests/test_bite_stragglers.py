"""The straggler check's schedule: each check judges the steps since the previous check, and a
step that is not a multiple of the interval only adds to the next check."""
from __future__ import annotations

from pretrain.training.stragglers import StragglerWatch


def test_each_check_measures_the_steps_since_the_last_one():
    seen = []

    class Recording(StragglerWatch):
        def measured(self, times, *, step, rank):
            seen.append((step, times))
            return times

    watch = Recording(interval=2, margin=0.2, patience=1, rank=0, log=lambda line: None)
    for step in range(1, 6):
        watch.begin_step(step)
        record = watch.end_step(step=step, elapsed=float(step), data_wait=0.25)
        assert ("straggler_max_slowdown" in record) == (step % 2 == 0), (step, record)
    # (compute, data wait, collective wait) over steps 1-2, then 3-4; step 5 waits for step 6
    assert [(s, (round(c, 6), d)) for s, (c, d, _) in seen] == [(2, (2.5, 0.5)), (4, (6.5, 0.5))]
