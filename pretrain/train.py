"""`pretrain train`: parse -> validate -> build -> train -> close.

Runs the same under `deepspeed`, `torchrun`, `srun` and as a plain process (a world of one)::

    deepspeed --num_gpus 2 --no_local_rank --module pretrain train --config configs/quickstart.yaml
    torchrun --nproc_per_node 2 -m pretrain train --config configs/quickstart.yaml
    srun python -m pretrain train --config configs/llama_70b.yaml
    pretrain train --config configs/tiny.yaml --set train.steps=10
"""
from __future__ import annotations

import argparse

from pretrain.trainer import TrainResult


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="run config YAML (configs/*.yaml); defaults apply when omitted")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config field, e.g. --set train.lr=3e-4 (repeatable)")
    parser.add_argument("--deepspeed-config", metavar="JSON",
                        help="DeepSpeed JSON to use instead of the run config's `deepspeed` field")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help=argparse.SUPPRESS)  # passed by launchers; LOCAL_RANK is what we read


def run(args: argparse.Namespace) -> TrainResult:
    from pretrain.config import load_config
    from pretrain.dist import close_distributed, discover_world, init_distributed, set_cpu_threads
    from pretrain.ds_config import resolve_ds_config

    overrides = list(args.set) + ([f"deepspeed={args.deepspeed_config}"] if args.deepspeed_config else [])
    cfg = load_config(args.config, overrides)
    world = discover_world()
    from deepspeed.accelerator import get_accelerator  # after the world: picks the device type

    # Every check that can fail does so here, before a process group or an engine exists.
    ds_config = resolve_ds_config(cfg, world_size=world.world_size,
                                  accelerator=get_accelerator().device_name())
    set_cpu_threads(world)
    init_distributed(world)
    from pretrain.topology import Topology
    from pretrain.trainer import Trainer

    groups = Topology.from_parallel_config(cfg.parallel, world_size=world.world_size,
                                           rank=world.rank).create_groups()
    result = Trainer(cfg, world, ds_config, groups).train()
    # Tear the process groups down before the interpreter exits: gloo's worker threads alive
    # at exit made a rank abort ("terminate called without an active exception", exit -6).
    close_distributed()
    return result
