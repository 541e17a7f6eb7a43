"""The dry run of a full run config for N ranks: every check `pretrain train` makes before it
builds the model, through the same resolver (`pretrain.resolve.run`), without launching anything or
creating a process group."""
from __future__ import annotations

from pretrain.config import RunConfig
from pretrain.resolve.run import ResolvedRun, SettledConfig, lay_out, settle_config


def settle_for_plan(cfg: RunConfig, *, on_this_machine: bool) -> SettledConfig:
    """`cfg` settled as `pretrain train` settles it, except that the data may be missing here
    (the run's nodes may see other files: warnings, not errors) and, planning for GPUs this
    machine is not (`on_this_machine` False), precision `auto` is planned as bf16 and left to
    the run. A tokenizer larger than model.vocab_size raises ConfigError, as in the run."""
    return settle_config(cfg, device_type="cpu", on_this_machine=on_this_machine,
                         data_required=False)


def dry_run(settled: SettledConfig, *, world_size: int, accelerator: str) -> ResolvedRun:
    """The run of `settled` on `world_size` ranks; raises ConfigError for anything the run would
    refuse, the model build's rules (tensor sizes, stages) included."""
    return lay_out(settled, world_size=world_size, device_type=accelerator)


def data_warnings(settled: SettledConfig) -> list[str]:
    """What of the run's data is missing on this machine."""
    return [f"{problem} (on this machine)" for problem in settled.data_warnings]
