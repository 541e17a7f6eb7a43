"""`pretrain tune`: a hyper-parameter search with Optuna over short `pretrain train` runs.

    pretrain tune --config configs/tiny.yaml --space configs/tune/space.yaml --trials 20 \
        --workers 2 --study-dir runs/tune-tiny --set data.dataset=... --set train.steps=200

Each trial is a `pretrain train` run of the config with the sampled values as `--set` overrides,
through a launcher (`--launcher`, `--nprocs` ranks, any `--deepspeed-config`), in
`<study dir>/trials/<study>-trial-<n>/`; its train losses feed the pruner (`--pruner`), the last
validation (or train) loss is the objective. The study lives in its storage (by default
`<study dir>/study.journal`), shared by `--workers` processes here and by any other
`pretrain tune` on the same study directory (Slurm array tasks: slurm/tune.sh); rerun the same
command after a crash or a kill and it finishes the study. The study directory gets
`trials.csv` and `best.yaml` as trials finish, and history.png, importances.png and contour.png
at the end; the last line printed is the best trial as a `pretrain train` command.

The space's keys are checked against the config before any trial starts: every choice and both
ends of every range are loaded with `--set` and dry-run for the trial's ranks, as `pretrain
train` would (a typo or a layout that does not fit is one `error:` line and exit 2). The study
logic is in `pretrain.tune` (its space, study, worker and results).
"""
from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_STUDY_DIR = "runs/tune"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pretrain.config import add_config_arguments
    from pretrain.launchers.local import LAUNCHERS

    add_config_arguments(parser)  # --config, --set, --deepspeed-config: of every trial
    parser.add_argument("--space", required=True, metavar="YAML",
                        help="search space: config field -> {low, high[, log | step]} or "
                             "{choices: [...]} (see configs/tune/space.yaml)")
    parser.add_argument("--trials", type=int, default=20,
                        help="trials of the study in total (COMPLETE + PRUNED + FAIL), over all "
                             "its workers and restarts")
    parser.add_argument("--workers", type=int, default=1,
                        help="worker processes here, each running one trial at a time")
    parser.add_argument("--study-dir", default=DEFAULT_STUDY_DIR,
                        help="trial run directories, storage, trials.csv, best.yaml, plots")
    parser.add_argument("--study-name", help="name of the study in its storage, prefix of the "
                                             "trials' run names (default: the study dir's name)")
    parser.add_argument("--storage", metavar="URL",
                        help="an RDB URL (sqlite:///study.db, postgresql://...) or a journal "
                             "file path (default: <study dir>/study.journal)")
    parser.add_argument("--objective", choices=["valid", "train"],
                        help="minimise the last validation loss, or the last train loss "
                             "(default: valid when the config evaluates, else train)")
    parser.add_argument("--pruner", choices=["median", "halving", "none"], default="median",
                        help="stop trials whose train loss falls behind: the median of the "
                             "completed trials at the same step, or successive halving")
    parser.add_argument("--prune-after", type=int, metavar="STEPS",
                        help="no trial is pruned before this step (default: a quarter of "
                             "train.steps; the first steps' losses reflect init and warmup)")
    parser.add_argument("--seed", type=int, default=0, help="TPE sampler seed")
    parser.add_argument("--enqueue", metavar="YAML",
                        help="a list of {field: value} mappings, tried first by a new study "
                             "(known good settings; the sampler goes on from there)")
    parser.add_argument("--nprocs", type=int, default=1, help="ranks per trial (one node)")
    parser.add_argument("--launcher", default="torchrun", choices=LAUNCHERS)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per trial")
    parser.add_argument("--grace-period", type=float, default=120,
                        help="seconds without a heartbeat after which another worker takes a "
                             "RUNNING trial's worker for dead and retries the trial")
    parser.add_argument("--keep-checkpoints", action="store_true",
                        help="keep every trial's checkpoints/ and final/ (default: deleted when "
                             "the trial ends; config, log and metrics.jsonl stay)")


def _check(args: argparse.Namespace, params, base: list[str],
           world_size: int) -> tuple[str, int]:
    """Every value a trial can start from loads and dry-runs; the objective and the steps before
    pruning, resolved."""
    from pretrain.config import load_config
    from pretrain.errors import ConfigError
    from pretrain.resolve.run import lay_out_as_loaded
    from pretrain.tune.space import override, unread_settings

    cfg = load_config(args.config, base)
    lay_out_as_loaded(cfg, world_size=world_size)
    unread = unread_settings(params, optimizer=cfg.train.optimizer.value)
    if unread:
        raise ConfigError(unread)
    for param in params:
        if param.key == "run_dir":
            raise ConfigError("search space: run_dir is each trial's own directory; it cannot "
                              "be tuned")
        for value in param.edge_values():
            text = override(param.key, value)
            try:
                lay_out_as_loaded(load_config(args.config, base + [text]), world_size=world_size)
            except ConfigError as exc:
                raise ConfigError(f"search space {text} ({world_size} ranks): {exc}") from None
    objective = args.objective or ("valid" if cfg.train.eval_interval > 0 else "train")
    if objective == "valid" and cfg.train.eval_interval == 0:
        raise ConfigError("--objective valid needs validation: set train.eval_interval > 0 (and "
                          "data.valid_fraction > 0), or use --objective train")
    prune_after = cfg.train.steps // 4 if args.prune_after is None else args.prune_after
    if prune_after < 0:
        raise ConfigError(f"--prune-after must be >= 0, got {prune_after}")
    return objective, prune_after


def _enqueued(args: argparse.Namespace, params, base: list[str]) -> list[dict]:
    from pretrain.config import load_config, read_user_file
    from pretrain.errors import ConfigError
    from pretrain.tune.space import override, parse_enqueued

    if not args.enqueue:
        return []
    raw = read_user_file(args.enqueue, "--enqueue", language="YAML")
    entries = parse_enqueued(raw, params, source=f"--enqueue {args.enqueue}")
    for entry in entries:
        try:
            load_config(args.config, base + [override(k, v) for k, v in entry.items()])
        except ConfigError as exc:
            raise ConfigError(f"--enqueue {args.enqueue}: {entry}: {exc}") from None
    return entries


def _worker(settings, index: int) -> None:
    """A worker process of `--workers K`: stops its trial's run on SIGTERM and when we die."""
    import signal

    from pretrain.launchers.local import die_with_parent
    from pretrain.tune.worker import work

    def stop(signum: int, frame) -> None:
        raise SystemExit(128 + signum)  # run_trial stops the run, work() retries the trial

    die_with_parent()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent sends SIGTERM
    settings.label = f"[tune w{index}]"
    work(settings)


def _run_workers(settings, count: int) -> int:
    """`count` worker processes on the study; the number that exited non-zero."""
    import multiprocessing

    from pretrain.launchers.local import sigterm_raises

    context = multiprocessing.get_context("fork")  # the settings and the loaded modules as they are
    procs = [context.Process(target=_worker, args=(settings, i), name=f"tune-worker-{i}")
             for i in range(count)]
    with sigterm_raises():
        try:
            for proc in procs:
                proc.start()
            for proc in procs:
                proc.join()
        except BaseException:
            for proc in procs:
                if proc.is_alive():
                    proc.terminate()  # SIGTERM: the worker stops its run and retries its trial
            for proc in procs:
                proc.join()
            raise
    return sum(1 for proc in procs if proc.exitcode != 0)


def run(args: argparse.Namespace) -> None:
    from pretrain.config import config_overrides
    from pretrain.errors import EXIT_FAULT, ConfigError
    from pretrain.launchers.local import STOP_GRACE_S, sigterm_raises
    from pretrain.tune.results import summary, write_results
    from pretrain.tune.space import load_space
    from pretrain.tune.study import Settings, load_study, prepare, study_lock
    from pretrain.tune.worker import work

    for name in ("trials", "workers", "nprocs"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be >= 1, got {getattr(args, name)}")
    params = load_space(args.space)
    base = config_overrides(args)
    world_size = 1 if args.launcher == "single" else args.nprocs
    if args.launcher == "single" and args.nprocs != 1:
        raise ConfigError(f"--launcher single runs one process, got --nprocs {args.nprocs}: use "
                          "torchrun or deepspeed")
    objective, prune_after = _check(args, params, base, world_size)
    enqueue = _enqueued(args, params, base)
    study_dir = Path(args.study_dir).absolute()
    settings = Settings(
        study_dir=study_dir, study_name=args.study_name or study_dir.name,
        storage=args.storage or str(study_dir / "study.journal"), params=params,
        trials=args.trials, config=args.config, base_overrides=base, objective=objective,
        pruner=args.pruner, seed=args.seed, launcher=args.launcher, nprocs=args.nprocs,
        timeout_s=args.timeout, grace_period_s=args.grace_period, stop_grace_s=STOP_GRACE_S,
        enqueue=enqueue, keep_checkpoints=args.keep_checkpoints,
        prune_after=prune_after)
    print(f"[tune] study {settings.study_name} in {settings.storage}: {args.trials} trials of "
          f"{len(params)} parameters ({', '.join(p.key for p in params)}), objective "
          f"{objective} loss, pruner {args.pruner} (after step {prune_after}), {args.workers} worker(s) x {args.nprocs} "
          f"rank(s) per trial", flush=True)
    prepare(settings)
    failed_workers = 0
    try:
        if args.workers == 1:
            with sigterm_raises():
                work(settings)
        else:
            failed_workers = _run_workers(settings, args.workers)
    finally:  # what is finished is written, however this ends
        with study_lock(settings):
            study = load_study(settings)
            paths = write_results(study, settings, plots=True)
        print(f"[tune] results: {', '.join(str(p) for p in paths.values())}", flush=True)
        for line in summary(study, settings):
            print(line, flush=True)
    if failed_workers:
        print(f"[tune] {failed_workers} worker(s) exited with an error (see above)", flush=True)
        raise SystemExit(EXIT_FAULT)
