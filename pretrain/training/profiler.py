"""The torch profiler over a range of optimizer steps (`logging.profile_steps`), one Chrome trace
per rank."""
from __future__ import annotations

from pathlib import Path

import torch


class StepProfiler:
    """Torch profiler over optimizer steps `first..last` (1-based, inclusive), exported as a
    Chrome trace (chrome://tracing, Perfetto) per rank: <run_dir>/profile/rank<R>_steps<A>-<B>.json.

    The trainer calls `begin(step)` before and `end(step)` after each step; outside the range
    both do nothing.
    """

    def __init__(self, steps: tuple[int, int] | None, *, run_dir: Path, rank: int):
        self.steps, self.rank, self._prof = steps, rank, None
        self.path = None if steps is None else \
            Path(run_dir) / "profile" / f"rank{rank}_steps{steps[0]}-{steps[1]}.json"

    def begin(self, step: int) -> None:
        if self.steps is None or step != self.steps[0]:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(activities=activities, record_shapes=True)
        self._prof.start()

    def end(self, step: int) -> Path | None:
        """Stop and write the trace after the last profiled step; returns its path then."""
        if self._prof is None or step != self.steps[1]:
            return None
        self._prof.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._prof.export_chrome_trace(str(self.path))
        self._prof = None
        return self.path
