"""The names the trainer and `pretrain train` still import from here, re-exported from their
owners: `log.py` (our lines and their level), `sinks.py` (metrics.jsonl and the report_to
sinks), `profiler.py` (the step profiler), `metrics.py` (the step line). New code imports the
owner."""
from __future__ import annotations

from pretrain.log import log, set_log_level
from pretrain.metrics import format_step_line
from pretrain.profiler import StepProfiler
from pretrain.sinks import MetricsSink, check_sinks

__all__ = ["MetricsSink", "StepProfiler", "check_sinks", "format_step_line", "log",
           "set_log_level"]
