"""The dry run of a full run config for N ranks: every check `pretrain train` makes before it
builds the model, without launching anything or creating a process group."""
from __future__ import annotations

from typing import Any

from pretrain.config import RunConfig
from pretrain.data.build import check_run_data
from pretrain.ds_config import engine_fields, resolve_ds_config
from pretrain.layout import Layout, resolve_layout


def dry_run(cfg: RunConfig, *, world_size: int, accelerator: str) -> tuple[dict[str, Any], Layout]:
    """(resolved DeepSpeed config, layout) of `cfg` on `world_size` ranks; raises ConfigError for
    anything the run would refuse, the model build's rules (tensor sizes, stages) included."""
    ds = resolve_ds_config(cfg, world_size=world_size, accelerator=accelerator)
    return ds, resolve_layout(cfg, world_size=world_size, **engine_fields(ds))


def data_warnings(cfg: RunConfig) -> list[str]:
    """What of the run's data is missing on this machine; the run's nodes may see other files,
    so not errors. Settles `model.vocab_size: auto` in `cfg` (the planner needs a number); a
    tokenizer larger than model.vocab_size raises ConfigError, as in `pretrain train`
    (`check_run_data`)."""
    return [f"{problem} (on this machine)" for problem in check_run_data(cfg, required=False)]
