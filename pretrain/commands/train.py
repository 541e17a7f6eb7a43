"""`pretrain train`: parse -> validate -> find the checkpoint -> build -> train -> close.

Runs the same under `deepspeed`, `torchrun`, `srun` and as a plain process (a world of one)::

    deepspeed --num_gpus 2 --no_local_rank --module pretrain train --config configs/quickstart.yaml
    torchrun --nproc_per_node 2 -m pretrain train --config configs/quickstart.yaml
    srun python -m pretrain train --config configs/llama_70b.yaml
    pretrain train --config configs/tiny.yaml --set train.steps=10

Exit statuses (pretrain/errors.py): 0 done; 2 bad config / data / checkpoint; 3 the run stopped
itself (a rank died or a collective timed out, too many non-finite steps); 75 a checkpoint was
saved because of SIGTERM / SIGUSR1 / --exit-after-minutes, or fewer ranks than one model replica,
or a hung rank named (pretrain/training/hang.py): requeue the job and it resumes. Ranks the layout or the batch cannot use sit idle and exit with
the others' status (pretrain/resolve/world_fit.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import warnings
from pathlib import Path
from typing import NoReturn

from pretrain.config import LOG_LEVELS, add_config_arguments, config_overrides
from pretrain.errors import EXIT_REQUEUE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--profile-steps", metavar="A:B",
                        help="export a torch profiler Chrome trace of steps A..B to "
                        "<run_dir>/profile/ (logging.profile_steps)")
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--resume-from", metavar="PATH",
                       help="start from this checkpoint (a run dir, its checkpoints/ dir, a "
                            "step<N> dir, or a universal checkpoint) instead of the newest one "
                            "of run_dir; a checkpoint of another layout (tp, pp, dp, ZeRO "
                            "stage, offload, precision) is resharded onto this one")
    start.add_argument("--start-from", metavar="PATH",
                       help="as --resume-from, until run_dir has a complete checkpoint of its "
                            "own: from then on the run resumes its own (a requeued job that "
                            "repeats the command, e.g. annealing another run's checkpoint, "
                            "goes on where it stopped)")
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
    from pretrain import storage
    from pretrain.checkpoint import confirm_content, find_resume
    from pretrain.config import load_config
    from pretrain.dist import discover_world, exit_distributed, init_distributed, set_cpu_threads
    from pretrain.log import log as log_line, set_log_level
    from pretrain.resolve import world_fit
    from pretrain.training.faults import RunControl

    # Signals are caught from here on (a SIGTERM while loading still stops after the first step);
    # the trainer gives it the run's save cadence and time limit.
    control = RunControl()
    cfg = load_config(args.config, _overrides(args))
    world = discover_world()
    from deepspeed.accelerator import get_accelerator  # after the world: picks the device type

    # DeepSpeed 0.19.8's ZeRO-2 calls a torch.distributed function that torch 2.13 deprecates,
    # once per rank per step: the warning is DeepSpeed's to fix and would bury the step lines.
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated")

    from pretrain.resolve.run import lay_out, settle_config

    set_log_level(cfg.logging.level)  # DeepSpeed, now imported, logs from here on
    log = lambda text: log_line(text, main=world.is_main)  # noqa: E731
    store_url = None
    if storage.is_remote(cfg.run_dir):  # ranks work in a node-local copy (checkpoint/store.py)
        from pretrain.checkpoint.store import stage_run

        store_url = cfg.run_dir
        storage.check_writable(store_url)
        cfg = dataclasses.replace(cfg, run_dir=str(stage_run(store_url, log=log, ranged=True)))
    # Every check that can fail does so before a process group or an engine exists: in
    # `settle_config` (sinks, eval tasks, data, precision) and `lay_out` (the layout).
    set_cpu_threads(world)  # before precision's measurement, which uses this rank's threads
    device_type = get_accelerator().device_name()
    resume_from, own_first = args.resume_from or args.start_from, args.start_from is not None
    if resume_from and storage.is_remote(resume_from):  # the node's copy of it
        from pretrain.checkpoint.store import local_checkpoint

        resume_from = str(local_checkpoint(resume_from, log=log))
    settled = settle_config(cfg, device_type=device_type, find_resume=lambda c: find_resume(
        c, resume_from=resume_from, log=log, own_first=own_first))
    # ranks the layout or the batch cannot use sit idle until the job ends (never return here)
    fit = world_fit.fit_of_config(settled.cfg, world.world_size)
    world_fit.enter(fit, rank=world.rank, log=log)
    world = dataclasses.replace(world, world_size=fit.used)
    run = lay_out(settled, world_size=world.world_size, rank=world.rank, device_type=device_type,
                  same_layout_only=args.require_same_layout)
    if store_url is not None and run.resume is not None and not _resharded(run):
        from pretrain.checkpoint.store import fetch_whole

        fetch_whole(run.resume.path)  # DeepSpeed loads its own layout from whole files
    from pretrain.training import collective_log, hang

    collective_log.install()  # before DeepSpeed's backend keeps references to the collectives
    hang.flight_recorder_environment(device_type)
    init_distributed(world, timeout_minutes=run.cfg.train.collective_timeout_minutes,
                     io_timeout_minutes=run.cfg.train.io_timeout_minutes)
    from pretrain.training.trainer import Trainer  # DeepSpeed's modules, once the process group exists

    groups = run.topology.create_groups()
    try:
        # every rank reads its share of the checkpoint's files: damage found anywhere is skipped
        resume = confirm_content(run.resume, run.cfg, resume_from=resume_from, log=log,
                                 own_first=own_first)
        result = Trainer(run, world, groups, resume=resume, control=control).train()
        if store_url is not None:  # the last save's upload; the last metrics, final/, stopped.json
            from pretrain.checkpoint.store import upload_run_files_or_warn, wait_for_uploads

            wait_for_uploads()
            if world.is_main:
                upload_run_files_or_warn(Path(run.cfg.run_dir), store_url,
                                         log=functools.partial(log_line, level="warning"))
    except Exception as exc:  # noqa: BLE001 - a fault ends the process without a hang
        _exit_on_fault(exc, rank=world.rank)
        raise
    exit_distributed(EXIT_REQUEUE if result.stop_reason else 0)


def _resharded(run) -> bool:
    """Whether resuming `run.resume` reshards it (`checkpoint.load`: fsdp2 always, DeepSpeed
    on another layout), reading each rank's byte ranges; else DeepSpeed reads whole files."""
    from pretrain.config import Engine
    from pretrain.resolve.run import layout_change

    point = run.resume
    return run.cfg.train.engine is Engine.FSDP2 or (
        not point.universal and layout_change(point.meta["layout"], run.checkpoint_layout)
        is not None)


def _overrides(args: argparse.Namespace) -> list[str]:
    """`--set` and the flags that are shorthands for config fields."""
    overrides = config_overrides(args)
    if args.exit_after_minutes is not None:
        overrides.append(f"train.exit_after_minutes={args.exit_after_minutes}")
    if args.profile_steps:  # quoted: YAML 1.1 would read 3:5 as a base-60 integer
        overrides.append(f"logging.profile_steps='{args.profile_steps}'")
    if args.log_level:
        overrides.append(f"logging.level={args.log_level}")
    return overrides


def _exit_on_fault(exc: Exception, *, rank: int) -> None:
    """A fault or an error in the input once the process groups exist: one line, then exit.

    A dead peer, a collective timeout or a diverged run exits EXIT_FAULT; a user error (a
    checkpoint that does not fit the run) exits EXIT_USER_ERROR. The process groups are not torn
    down (that would wait for a dead rank); os._exit skips the interpreter's teardown, where
    gloo's threads would abort the process instead.
    """
    from pretrain.errors import EXIT_USER_ERROR, PretrainError
    from pretrain.errors import TrainingFault
    from pretrain.training.faults import is_collective_failure

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
    from pretrain.resolve.world_fit import publish_exit

    publish_exit(code, rank=rank)  # ranks left idle exit with the job's status
    os._exit(code)
