"""The dry run of a full run config for N ranks: every check `pretrain train` makes before it
builds the model, without launching anything or creating a process group."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pretrain.config import RunConfig
from pretrain.data import Tokenizer
from pretrain.ds_config import engine_fields, resolve_ds_config
from pretrain.errors import ConfigError
from pretrain.layout import Layout, resolve_layout


def dry_run(cfg: RunConfig, *, world_size: int, accelerator: str) -> tuple[dict[str, Any], Layout]:
    """(resolved DeepSpeed config, layout) of `cfg` on `world_size` ranks; raises ConfigError for
    anything the run would refuse, the model build's rules (tensor sizes, stages) included."""
    ds = resolve_ds_config(cfg, world_size=world_size, accelerator=accelerator)
    return ds, resolve_layout(cfg, world_size=world_size, **engine_fields(ds))


def data_warnings(cfg: RunConfig) -> list[str]:
    """What is missing on this machine; the run's nodes may see other files, so not errors.
    A tokenizer that is present must match model.vocab_size (the trainer refuses it)."""
    warnings = []
    d = cfg.data
    if d.tokenizer and Path(d.tokenizer).is_file():
        vocab = Tokenizer.load(d.tokenizer).vocab_size
        if vocab != cfg.model.vocab_size:
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} but the tokenizer "
                              f"{d.tokenizer!r} has {vocab} tokens: set model.vocab_size={vocab}")
    elif d.tokenizer:
        warnings.append(f"data.tokenizer {d.tokenizer!r} does not exist on this machine")
    if d.dataset and not Path(d.dataset + ".idx").is_file() and not d.corpus:
        warnings.append(f"data.dataset {d.dataset!r}(.bin/.idx) does not exist on this machine "
                        "and data.corpus is empty")
    return warnings
