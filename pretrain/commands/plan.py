"""`pretrain plan`: dry-run a run config for N ranks, and plan its memory and speed per GPU.

Without launching anything or creating a process group, it loads the config exactly as
`pretrain train` does (same `--set` and `--deepspeed-config`), resolves the DeepSpeed JSON for the
world size, derives the layout and checks it with the rules the model build applies, and prints
the layout with the planner's per-GPU memory breakdown and predicted step time, tokens/s and MFU,
under the config's `train.engine` (DeepSpeed's or FSDP2's sharding; `--search` ranks that
engine's layouts, fsdp2's pipelines under each of their schedules), `train.fp8` and
`train.optimizer`.
Any problem is one `error:` line and exit status 2, so a Slurm script can call it before
`srun`::

    python -m pretrain plan --config configs/llama_70b.yaml --world-size 128
    python -m pretrain plan --config configs/llama_70b.yaml --world-size 128 --json
    python -m pretrain plan --config configs/llama_70b.yaml --nodes 16 --search --top 5
    python -m pretrain plan --config configs/llama_70b.yaml --world-size 128 --build

`--build` also constructs every distinct rank's module on the meta device and checks its
parameters against the plan (`pretrain.plan.build_check`).

The planner itself is `pretrain.plan` (imported in `run`: `pretrain --help` stays light).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from pretrain.config import (Fp8Recipe, Optimizer, RunConfig, add_config_arguments,
                             config_overrides, load_config)
from pretrain.errors import ConfigError
from pretrain.resolve.layout import planned_precision
from pretrain.plan.clusters import CLUSTER_PRESETS, Cluster, make_cluster


def add_arguments(parser: argparse.ArgumentParser, *, search: bool = True) -> None:
    """`search=False`: the arguments planning one run takes (the Slurm pre-flight's)."""
    add_config_arguments(parser)
    parser.add_argument("--world-size", type=int, help="ranks (GPUs) of the run; default: "
                        "--nodes x GPUs per node")
    parser.add_argument("--accelerator", choices=["cuda", "cpu"],
                        help="DeepSpeed accelerator the run will use (decides the Adam kernel); "
                        "default: cpu with --cluster cpu, else cuda")
    cluster = parser.add_argument_group("cluster (a preset, any field overridden)")
    cluster.add_argument("--cluster", default="h100-80gb",
                         choices=sorted(CLUSTER_PRESETS) + ["cpu"],
                         help="cpu: this machine, --gpus-per-node ranks per node (default: "
                         "--world-size), each rank's peak measured here in the precision "
                         "train.precision resolves to")
    cluster.add_argument("--nodes", type=int, help="default: enough nodes for --world-size, else 1")
    cluster.add_argument("--gpus-per-node", type=int)
    cluster.add_argument("--gpu-memory-gb", type=float)
    cluster.add_argument("--peak-tflops", type=float, help="dense bf16 peak per GPU")
    cluster.add_argument("--intra-node-gbps", type=float, help="NVLink GB/s per GPU, one way")
    cluster.add_argument("--inter-node-gbps", type=float, help="network GB/s per GPU, one way")
    parser.set_defaults(search=False, json=False, global_batch=None, top=10)
    parser.add_argument("--memory-margin", type=float, default=None, metavar="FRACTION",
                        help="memory to keep free beyond the planner's count, as a fraction of "
                        "the predicted memory: the layout search ranks only layouts whose "
                        "predicted memory x (1 + FRACTION) fits the usable memory, and a plan "
                        "warns when such a layout is predicted more than 10%% faster than its own "
                        "(default 0.2: bf16 runs measured up to 1.19x the predicted peak)")
    if search:
        parser.add_argument("--search", action="store_true",
                            help="rank every valid layout of the model on the cluster that fits "
                                 "(under train.engine=fsdp2 each pipeline schedule and its "
                                 "virtual stages too; train.fp8 and train.optimizer kept)")
        parser.add_argument("--global-batch", type=int,
                            help="samples per step for --search (default: the config's)")
        parser.add_argument("--top", type=int, default=10, help="layouts --search prints")
        parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--build", action="store_true",
                        help="also construct every distinct rank's module (pipeline stage x "
                        "tensor rank) on the meta device, in a fake process group of the "
                        "world size, and check its parameters against the plan (seconds, "
                        "even for 70B on 128 ranks)")


def _cpu_cluster(args: argparse.Namespace, cfg: RunConfig) -> Cluster:
    """This machine, measured in the precision `train.precision` settled to (as `pretrain
    train` settles it: `pretrain.resolve.run.settle_precision`)."""
    from pretrain.hardware import cpu_peak_tflops, host_memory_gb
    from pretrain.model import DTYPES
    from pretrain.plan.clusters import cpu_cluster

    ranks = args.gpus_per_node or args.world_size or 1
    nodes = args.nodes or math.ceil((args.world_size or ranks) / ranks)
    threads = max(1, (os.cpu_count() or 1) // ranks)
    peak = args.peak_tflops or cpu_peak_tflops(DTYPES[cfg.train.precision], threads=threads)
    return cpu_cluster(nodes=nodes, ranks_per_node=ranks, peak_tflops=peak,
                       memory_gb=args.gpu_memory_gb * ranks if args.gpu_memory_gb
                       else host_memory_gb())


def _cluster(args: argparse.Namespace, cfg: RunConfig) -> Cluster:
    if args.cluster == "cpu":
        return _cpu_cluster(args, cfg)
    gpn = args.gpus_per_node or CLUSTER_PRESETS[args.cluster]["gpus_per_node"]
    if args.nodes is None and args.world_size is not None:
        nodes = math.ceil(args.world_size / gpn)
        gpn = min(gpn, args.world_size)  # a single partly used node
    else:
        nodes = args.nodes or 1
    cluster = make_cluster(args.cluster, nodes=nodes, gpus_per_node=gpn,
                           gpu_memory_gb=args.gpu_memory_gb, peak_tflops=args.peak_tflops,
                           intra_node_gbps=args.intra_node_gbps,
                           inter_node_gbps=args.inter_node_gbps)
    if args.world_size is not None and args.world_size > cluster.world_size:
        raise ConfigError(f"--world-size {args.world_size} exceeds the cluster's {cluster.nodes} "
                          f"nodes x {cluster.gpus_per_node} GPUs: raise --nodes")
    return cluster


def _search(args: argparse.Namespace, settled, cluster: Cluster) -> None:
    from pretrain.arithmetic import num_parameters
    from pretrain.resolve.ds_config import shipped_ds_configs
    from pretrain.plan.report import current_rank, format_search, selecting_arguments
    from pretrain.plan.search import engine_key, minimum_memory_gb, search

    cfg = settled.cfg
    if args.world_size is not None and args.nodes is not None and \
            args.world_size != cluster.world_size:
        raise ConfigError(f"--search plans the whole cluster ({cluster.world_size} GPUs); "
                          f"drop --world-size {args.world_size} or match --nodes")
    gbs = args.global_batch or cfg.train.global_batch_size
    if not gbs:
        raise ConfigError("--search needs a global batch: set train.global_batch_size or pass "
                          "--global-batch N")
    engines = shipped_ds_configs()
    margin = _margin(args)
    plans = search(cfg.model, cluster, global_batch=gbs,
                   precision=planned_precision(cfg.train.precision), engines=set(engines),
                   memory_margin=margin, engine=cfg.train.engine,
                   fp8=Fp8Recipe(cfg.train.fp8).value,
                   optimizer=Optimizer(cfg.train.optimizer).value)
    if not plans:
        need = minimum_memory_gb(cfg.model, cluster,
                                 precision=planned_precision(cfg.train.precision))
        raise ConfigError(f"no layout of {cluster.world_size} GPUs fits the model "
                          f"({num_parameters(cfg.model) / 1e9:.1f}B parameters, global batch "
                          f"{gbs}) in {cluster.gpu_memory_gb:g} GB per GPU with a {margin:.0%} "
                          f"memory margin; even ZeRO-3 with offload needs {need:.1f} GB: add "
                          "nodes, use a smaller model or lower --memory-margin")
    current = _current_plan(args, settled, cluster)
    if args.json:
        print(json.dumps({"count": len(plans), "memory_margin": margin, "plans": [
            {**p.to_dict(), "arguments": selecting_arguments(
                p.layout, engines[engine_key(p.layout)], engine=p.engine)}
            for p in plans[:args.top]], "current": current_rank(plans, *current, margin=margin)}))
    else:
        print(format_search(plans, cluster, top=args.top, ds_configs=engines, margin=margin,
                            current=current))


def _margin(args: argparse.Namespace) -> float:
    from pretrain.plan.search import DEFAULT_MEMORY_MARGIN, check_margin

    return check_margin(DEFAULT_MEMORY_MARGIN if args.memory_margin is None
                        else args.memory_margin)


def _current_plan(args: argparse.Namespace, settled, cluster: Cluster):
    """(the config's own plan on the whole cluster, or None, and why not)."""
    from pretrain.plan.dry_run import dry_run
    from pretrain.plan.search import estimate

    try:
        run = dry_run(settled, world_size=cluster.world_size, accelerator=args.accelerator)
        return estimate(run.cfg.model, run.layout, cluster, engine=run.cfg.train.engine,
                        ds=run.ds_config), ""
    except ConfigError as error:
        return None, f"does not resolve on {cluster.world_size} GPUs: {error}"


def run(args: argparse.Namespace):
    """The dry run and plan of the config (a `pretrain.plan.search.Plan`), or with --search the
    ranking of every layout (None)."""
    return plan_run(args)[0]


def plan_run(args: argparse.Namespace):
    """(the plan, the resolved run it plans) of `run`, printed; (None, None) with --search."""
    from pretrain.arithmetic import model_flops_per_token, num_active_parameters, num_parameters
    from pretrain.plan.dry_run import data_warnings, settle_for_plan
    from pretrain.plan.report import format_run
    from pretrain.plan.search import estimate

    settled = settle_for_plan(load_config(args.config, config_overrides(args)),
                              on_this_machine=args.cluster == "cpu")
    cfg, warnings = settled.cfg, data_warnings(settled)
    cluster = _cluster(args, cfg)
    args.accelerator = args.accelerator or ("cpu" if args.cluster == "cpu" else "cuda")
    if args.search:
        _search(args, settled, cluster)
        return None, None
    if args.accelerator == "cuda":
        from pretrain.resolve.world_fit import check_tensor_within_node

        check_tensor_within_node(cfg, gpus_per_node=cluster.gpus_per_node)
    world, resolved, idle = _fit_world(settled, args.world_size or cluster.world_size,
                                       accelerator=args.accelerator,
                                       gpus_per_node=cluster.gpus_per_node)
    warnings += idle
    plan = estimate(cfg.model, resolved.layout, cluster, engine=cfg.train.engine,
                    ds=resolved.ds_config)
    if args.accelerator == "cuda" and world == cluster.world_size and plan.fits:
        from pretrain.plan.report import slower_layout_warnings

        warnings += slower_layout_warnings(cfg.model, plan, margin=_margin(args))
    builds = None
    if args.build:
        from pretrain.plan.build_check import build_distinct_ranks

        builds = build_distinct_ranks(resolved)
    if args.json:
        print(json.dumps({"ok": plan.fits, "config": args.config, "world_size": world,
                          "accelerator": args.accelerator, "warnings": warnings,
                          "parameters": num_parameters(cfg.model),
                          "active_parameters": num_active_parameters(cfg.model),
                          "flops_per_token": model_flops_per_token(cfg.model),
                          "deepspeed": resolved.ds_config, **plan.to_dict(),
                          **({"builds": [b.to_dict() for b in builds]} if builds else {})}))
    else:
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr)
        print(format_run(plan, cfg, config_path=args.config, accelerator=args.accelerator))
        if builds:
            from pretrain.plan.build_check import format_builds

            print(format_builds(builds))
    if not plan.fits:
        sys.stdout.flush()  # the plan first, then the error line
        raise ConfigError(_does_not_fit(plan, args))
    return plan, resolved


def _fit_world(settled, world: int, *, accelerator: str, gpus_per_node: int):
    """(the world `pretrain train` trains on of `world` launched ranks, its resolved run, the
    warnings): every rank when the layout and the batch resolve on all of them; else, as
    `train` and the Slurm pre-flight do, the largest usable part (`resolve.world_fit`), with a
    warning naming the idle GPUs and what would use them. A config no part of the world
    resolves raises the whole world's error."""
    from pretrain.errors import PretrainError
    from pretrain.plan.dry_run import dry_run
    from pretrain.resolve import world_fit

    try:
        return world, dry_run(settled, world_size=world, accelerator=accelerator), []
    except ConfigError as error:
        try:
            fit = world_fit.fit_of_config(settled.cfg, world)
            if not fit.idle:
                raise error
            resolved = dry_run(settled, world_size=fit.used, accelerator=accelerator)
        except PretrainError:
            raise error from None
    return fit.used, resolved, [world_fit.idle_warning(fit, settled.cfg,
                                                       ranks_per_node=gpus_per_node)]


def _does_not_fit(plan, args: argparse.Namespace) -> str:
    """The error line of a plan over the GPU's memory, with the cluster it was planned for."""
    from pretrain.plan.memory import GB

    given = getattr(args, "gpu_memory_source", "given") if args.gpu_memory_gb else \
        f"--cluster {args.cluster}'s; pass --gpu-memory-gb if the job's GPUs differ"
    return (f"the plan needs {plan.memory.total / GB:.1f} GB per GPU but "
            f"{plan.memory_limit_gb:.1f} GB are usable of {plan.cluster.gpu_memory_gb:g} GB "
            f"({given}): raise ZeRO's stage, tensor or pipeline parallelism, turn on "
            "activation recomputation, or lower train.micro_batch_size (`pretrain plan "
            "--search` ranks the layouts that fit)")
