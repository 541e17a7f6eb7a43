"""`pretrain train`: parse -> validate -> find the checkpoint -> build -> train -> close.

Runs the same under `deepspeed`, `torchrun`, `srun` and as a plain process (a world of one)::

    deepspeed --num_gpus 2 --no_local_rank --module pretrain train --config configs/quickstart.yaml
    torchrun --nproc_per_node 2 -m pretrain train --config configs/quickstart.yaml
    srun python -m pretrain train --config configs/llama_70b.yaml
    pretrain train --config configs/tiny.yaml --set train.steps=10

Exit statuses (pretrain/errors.py): 0 done; 2 bad config / data / checkpoint; 3 the run stopped
itself (a rank died or a collective timed out, too many non-finite steps); 75 a checkpoint was
saved because of SIGTERM / SIGUSR1 / --exit-after-minutes: requeue the job and it resumes.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from pretrain.config import LOG_LEVELS, add_config_arguments, config_overrides
from pretrain.errors import EXIT_REQUEUE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--profile-steps", metavar="A:B",
                        help="export a torch profiler Chrome trace of steps A..B to "
                        "<run_dir>/profile/ (logging.profile_steps)")
    parser.add_argument("--resume-from", metavar="PATH",
                        help="start from this checkpoint (a run dir, its checkpoints/ dir, a "
                             "step<N> dir, or a universal checkpoint) instead of the newest one "
                             "of run_dir; a checkpoint of another layout (tp, pp, dp, ZeRO "
                             "stage, offload, precision) is resharded onto this one")
    parser.add_argument("--require-same-layout", action="store_true",
                        help="refuse to resume a checkpoint of another layout instead of "
                             "resharding it")
    parser.add_argument("--exit-after-minutes", type=float, metavar="M",
                        help="wall-time limit: save a checkpoint and exit 75 after M minutes "
                             "(same as --set train.exit_after_minutes=M)")
    parser.add_argument("--log-level", choices=LOG_LEVELS,
                        help="our notes and DeepSpeed's logger: warning hides our [checkpoint], "
                             "[run]... notes, debug adds DeepSpeed's INFO and DEBUG lines; step "
                             "and eval lines print at every level (logging.level, default info)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help=argparse.SUPPRESS)  # passed by launchers; LOCAL_RANK is what we read


def run(args: argparse.Namespace) -> NoReturn:
    from pretrain import telemetry
    from pretrain.checkpoint import confirm_content, find_resume
    from pretrain.config import load_config
    from pretrain.data.build import check_run_data
    from pretrain.dist import discover_world, exit_distributed, init_distributed, set_cpu_threads
    from pretrain.ds_config import resolve_ds_config
    from pretrain.faults import RunControl

    overrides = config_overrides(args)
    if args.exit_after_minutes is not None:
        overrides.append(f"train.exit_after_minutes={args.exit_after_minutes}")
    if args.profile_steps:  # quoted: YAML 1.1 would read 3:5 as a base-60 integer
        overrides.append(f"logging.profile_steps='{args.profile_steps}'")
    if args.log_level:
        overrides.append(f"logging.level={args.log_level}")
    cfg = load_config(args.config, overrides)
    # Signals are caught from here on (a SIGTERM while loading still stops after the first step).
    control = RunControl(save_interval_minutes=cfg.checkpoint.save_interval_minutes,
                         exit_after_minutes=cfg.train.exit_after_minutes)
    world = discover_world()
    from deepspeed.accelerator import get_accelerator  # after the world: picks the device type

    telemetry.set_log_level(cfg.logging.level)  # DeepSpeed, now imported, logs from here on
    # Every check that can fail does so here, before a process group or an engine exists.
    telemetry.check_sinks(cfg.logging.report_to)
    check_run_data(cfg, required=True)  # first: it settles model.vocab_size: auto
    resume = find_resume(cfg, resume_from=args.resume_from,
                         log=lambda text: telemetry.log(text, main=world.is_main))
    if resume is not None and cfg.train.global_batch_size is None:
        # Resharding keeps the global batch: gradient accumulation follows the new dp size.
        cfg.train.global_batch_size = resume.meta["global_batch"]
    set_cpu_threads(world)  # before precision's measurement, which uses this rank's threads
    choice = choose_run_precision(cfg.train.precision, get_accelerator().device_name(),
                                  resume=resume)
    cfg.train.precision = choice.precision
    ds_config = resolve_ds_config(cfg, world_size=world.world_size,
                                  accelerator=get_accelerator().device_name())
    if resume is not None and args.require_same_layout:
        refuse_another_layout(resume, cfg, ds_config, world_size=world.world_size)
    if resume is not None and resume.universal:
        ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}
    init_distributed(world, timeout_minutes=cfg.train.collective_timeout_minutes,
                     io_timeout_minutes=cfg.train.io_timeout_minutes)
    from pretrain.topology import Topology
    from pretrain.trainer import Trainer  # DeepSpeed's modules, once the process group exists

    groups = Topology.from_parallel_config(cfg.parallel, world_size=world.world_size,
                                           rank=world.rank).create_groups()
    try:
        # every rank reads its share of the checkpoint's files: damage found anywhere is skipped
        resume = confirm_content(resume, cfg, resume_from=args.resume_from,
                                 log=lambda text: telemetry.log(text, main=world.is_main))
        agree_on_precision(choice, rank=world.rank)
        telemetry.log(f"[precision] {choice.precision.value}: {choice.reason}",
                      main=world.is_main)
        if choice.warning:
            telemetry.log(f"warning: {choice.warning}", main=world.is_main, level="warning")
        result = Trainer(cfg, world, ds_config, groups, resume=resume, control=control).train()
    except Exception as exc:  # noqa: BLE001 - a fault ends the process without a hang
        _exit_on_fault(exc, rank=world.rank)
        raise
    exit_distributed(EXIT_REQUEUE if result.stop_reason else 0)


def refuse_another_layout(resume, cfg, ds_config, *, world_size: int) -> None:
    """`--require-same-layout`: a `CheckpointError` when the checkpoint's layout is not the
    run's (before any process group)."""
    from pretrain.checkpoint.engine import run_layout
    from pretrain.checkpoint.reshard import layout_change
    from pretrain.errors import CheckpointError
    from pretrain.topology import Topology

    layout = run_layout(cfg, ds_config, topology=Topology.from_parallel_config(
        cfg.parallel, world_size=world_size))
    change = layout_change(resume.meta["layout"], layout)
    if change and not resume.universal:
        raise CheckpointError(f"checkpoint {str(resume.path)!r} was saved on another layout "
                              f"({change}) and --require-same-layout is set: run it on its own "
                              "layout, or drop the flag to reshard it")


def choose_run_precision(requested, device_type: str, *, resume):
    """`hardware.choose_precision`, except that `auto` resuming a checkpoint keeps the
    checkpoint's precision (its optimizer states are in that precision's layout)."""
    from pretrain.config import Precision
    from pretrain.hardware import PrecisionChoice, choose_precision

    if requested == Precision.AUTO and resume is not None:
        saved = resume.meta.get("config", {}).get("train", {}).get("precision")
        if saved and saved != Precision.AUTO.value:
            return PrecisionChoice(Precision(saved), "auto: the precision of the checkpoint "
                                                     "being resumed")
    return choose_precision(requested, device_type)


def agree_on_precision(choice, *, rank: int) -> None:
    """Every rank must have chosen the same precision (ranks on different CPUs might not)."""
    from pretrain.config import Precision
    from pretrain.dist import same_on_every_rank
    from pretrain.errors import ConfigError

    if not same_on_every_rank(list(Precision).index(choice.precision)):
        raise ConfigError(f"train.precision=auto chose {choice.precision.value} on rank {rank} "
                          f"({choice.reason}) but not on every rank: the ranks run on different "
                          "hardware; set train.precision explicitly")


def _exit_on_fault(exc: Exception, *, rank: int) -> None:
    """A fault or an error in the input once the process groups exist: one line, then exit.

    A dead peer, a collective timeout or a diverged run exits EXIT_FAULT; a user error (a
    checkpoint that does not fit the run) exits EXIT_USER_ERROR. The process groups are not torn
    down (that would wait for a dead rank); os._exit skips the interpreter's teardown, where
    gloo's threads would abort the process instead.
    """
    from pretrain.errors import EXIT_USER_ERROR, PretrainError
    from pretrain.faults import TrainingFault, is_collective_failure

    code = TrainingFault.exit_code
    if isinstance(exc, TrainingFault):
        reason = str(exc)
    elif is_collective_failure(exc):
        reason = (f"rank {rank}: a collective failed, another rank died or stopped answering "
                  f"({type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}); "
                  "restart the job: it resumes from the last complete checkpoint")
    elif isinstance(exc, PretrainError):
        reason, code = (str(exc) if rank == 0 else None), EXIT_USER_ERROR  # the same on every rank
    else:
        return
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)
