"""logging.wandb_project as wandb receives it (tests/test_telemetry.py checks that the project
decides the mode, with the sink replaced): the run opened in that project, and in the mode."""
from __future__ import annotations

import sys
import types

from pretrain.config import LoggingConfig


def test_the_wandb_run_opens_in_the_configured_project_and_mode(tmp_path, monkeypatch):
    from pretrain.training import sinks

    opened = []
    fake = types.SimpleNamespace(init=lambda **kw: opened.append(kw),
                                 Settings=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    settings = LoggingConfig(report_to=["wandb"], wandb_mode="offline", wandb_project="ablations")
    sinks.SINKS["wandb"][0](tmp_path, settings=settings, run_config={"a": 1}, mode="offline")
    assert [(kw["project"], kw["mode"], kw["config"]) for kw in opened] == \
        [("ablations", "offline", {"a": 1})]
