"""`pretrain plan`: dry-run a run config for N ranks, and plan its memory and speed per GPU.

Without launching anything or creating a process group, it loads the config exactly as
`pretrain train` does (same `--set` and `--deepspeed-config`), resolves the DeepSpeed JSON for the
world size, builds the `Topology` arithmetic, checks what the model build would refuse, and
prints the layout with the planner's per-GPU memory breakdown and predicted step time, tokens/s
and MFU. Any problem is one `error:` line and exit status 2, so a Slurm script can call it before
`srun`::

    python -m pretrain plan --config configs/llama_70b.yaml --world-size 128
    python -m pretrain plan --config configs/llama_70b.yaml --world-size 128 --json
    python -m pretrain plan --config configs/llama_70b.yaml --nodes 16 --search --top 5
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from pretrain.clusters import CLUSTER_PRESETS, Cluster, make_cluster
from pretrain.config import RunConfig, add_config_arguments, config_overrides, load_config
from pretrain.errors import ConfigError
from pretrain.plan import DEEPSPEED_DEFAULT_BUCKET, GB, Layout, Plan, estimate, search


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--world-size", type=int, help="ranks (GPUs) of the run; default: "
                        "--nodes x GPUs per node")
    parser.add_argument("--accelerator", default="cuda", choices=["cuda", "cpu"],
                        help="DeepSpeed accelerator the run will use (decides the Adam kernel)")
    cluster = parser.add_argument_group("cluster (a preset, any field overridden)")
    cluster.add_argument("--cluster", default="h100-80gb", choices=sorted(CLUSTER_PRESETS))
    cluster.add_argument("--nodes", type=int, help="default: enough nodes for --world-size, else 1")
    cluster.add_argument("--gpus-per-node", type=int)
    cluster.add_argument("--gpu-memory-gb", type=float)
    cluster.add_argument("--peak-tflops", type=float, help="dense bf16 peak per GPU")
    cluster.add_argument("--intra-node-gbps", type=float, help="NVLink GB/s per GPU, one way")
    cluster.add_argument("--inter-node-gbps", type=float, help="network GB/s per GPU, one way")
    parser.add_argument("--search", action="store_true",
                        help="rank every valid layout of the model on the cluster that fits")
    parser.add_argument("--global-batch", type=int,
                        help="samples per step for --search (default: the config's)")
    parser.add_argument("--top", type=int, default=10, help="layouts --search prints")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _cluster(args: argparse.Namespace) -> Cluster:
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


def layout_from_config(cfg: RunConfig, ds: dict[str, Any], *, world_size: int) -> Layout:
    """The planner's layout of a resolved run config and DeepSpeed config."""
    from pretrain.ds_config import offload_devices, zero_stage

    zero = ds.get("zero_optimization", {})
    stage = zero_stage(ds)
    opt_dev, param_dev = offload_devices(ds)
    gather_key = "stage3_prefetch_bucket_size" if stage == 3 else "allgather_bucket_size"
    return Layout(tensor=cfg.parallel.tensor, pipeline=cfg.parallel.pipeline,
                  data=cfg.data_parallel_size(world_size), micro_batch=cfg.train.micro_batch_size,
                  global_batch=cfg.global_batch_size(world_size), zero_stage=stage,
                  offload_optimizer=opt_dev, offload_param=param_dev,
                  recompute=cfg.model.activation_checkpointing,
                  recompute_interval=cfg.model.activation_checkpointing_interval,
                  sequence_parallel=cfg.parallel.sequence_parallel,
                  precision=cfg.train.precision, partition=cfg.parallel.pipeline_partition,
                  reduce_bucket=int(zero.get("reduce_bucket_size", DEEPSPEED_DEFAULT_BUCKET)),
                  allgather_bucket=int(zero.get(gather_key, DEEPSPEED_DEFAULT_BUCKET)),
                  max_live_parameters=int(zero.get("stage3_max_live_parameters", 1_000_000_000)))


def data_warnings(cfg: RunConfig) -> list[str]:
    """What is missing on this machine; the run's nodes may see other files, so not errors.
    A tokenizer that is present must match model.vocab_size (the trainer refuses it)."""
    warnings = []
    d = cfg.data
    if d.tokenizer and Path(d.tokenizer).is_file():
        from pretrain.data import Tokenizer

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


def dry_run(cfg: RunConfig, *, world_size: int, accelerator: str) -> tuple[dict[str, Any], Layout]:
    """Every check `pretrain train` makes before building the model, plus the model build's own
    (tensor sizes, stages): (resolved DeepSpeed config, layout). Raises ConfigError."""
    from pretrain.ds_config import resolve_ds_config
    from pretrain.plan import check_layout
    from pretrain.topology import Topology

    ds = resolve_ds_config(cfg, world_size=world_size, accelerator=accelerator)
    Topology.from_parallel_config(cfg.parallel, world_size=world_size)
    layout = layout_from_config(cfg, ds, world_size=world_size)
    check_layout(cfg.model, layout)
    return ds, layout


def format_plan(plan: Plan) -> str:
    lay, mem, t, c = plan.layout, plan.memory, plan.time, plan.cluster
    pct = (lambda x: f"{100 * x / t.step:4.1f}%") if t.step else (lambda x: "-")
    lines = [
        f"memory per GPU (stage {mem.stage} of {lay.pipeline}, the heaviest; "
        f"{mem.parameters_count / 1e6:,.1f}M parameters before ZeRO sharding):",
        *(f"  {k:<12}{mem.to_gb()[k]:9.2f} GB" for k in
          ("params", "grads", "optimizer", "activations", "buffers")),
        f"  {'total':<12}{mem.total / GB:9.2f} GB of {plan.memory_limit_gb:.1f} GB usable "
        f"({c.gpu_memory_gb:g} GB x 0.9) -> {'fits' if plan.fits else 'DOES NOT FIT'}"
        + (f"; {mem.host / GB:.2f} GB per GPU on the host" if mem.host else ""),
        f"time per step {t.step:.3f} s on {c.name} ({c.peak_tflops:g} TFLOP/s peak):",
        *(f"  {k:<14}{getattr(t, k):9.3f} s {pct(getattr(t, k))}" for k in
          ("compute", "tensor_comm", "bubble", "pipeline_comm", "data_comm", "offload")),
        f"throughput {plan.tokens_per_s:,.0f} tokens/s | model {plan.model_tflops_per_gpu:.0f} "
        f"TFLOP/s/GPU (MFU {100 * plan.mfu:.1f}%) | hardware {plan.hardware_tflops_per_gpu:.0f} "
        f"TFLOP/s/GPU (HFU {100 * plan.hfu:.1f}%)",
    ]
    return "\n".join(lines)


def _search(args: argparse.Namespace, cfg: RunConfig, cluster: Cluster) -> None:
    if args.world_size is not None and args.nodes is not None and \
            args.world_size != cluster.world_size:
        raise ConfigError(f"--search plans the whole cluster ({cluster.world_size} GPUs); "
                          f"drop --world-size {args.world_size} or match --nodes")
    gbs = args.global_batch or cfg.train.global_batch_size
    if not gbs:
        raise ConfigError("--search needs a global batch: set train.global_batch_size or pass "
                          "--global-batch N")
    plans = search(cfg.model, cluster, global_batch=gbs, precision=cfg.train.precision)
    if not plans:
        need = estimate_minimum_gb(cfg, cluster)
        raise ConfigError(f"no layout of {cluster.world_size} GPUs fits the model "
                          f"({cfg.model.num_parameters() / 1e9:.1f}B parameters, global batch "
                          f"{gbs}) in {cluster.gpu_memory_gb:g} GB per GPU; even ZeRO-3 with "
                          f"offload needs {need:.1f} GB: add nodes or use a smaller model")
    if args.json:
        print(json.dumps({"count": len(plans), "plans": [p.to_dict() for p in plans[:args.top]]}))
        return
    print(f"[plan] {len(plans)} layouts of {cluster.world_size} GPUs ({cluster.nodes} x "
          f"{cluster.gpus_per_node} {cluster.name}) fit; the fastest {min(args.top, len(plans))}:")
    print(f"  {'#':>3}  {'layout':<58}{'memory':>9}{'tokens/s':>12}{'MFU':>7}")
    for i, p in enumerate(plans[:args.top], 1):
        print(f"  {i:>3}  {p.layout.describe():<58}{p.memory.total / GB:8.1f}G"
              f"{p.tokens_per_s:12,.0f}{100 * p.mfu:6.1f}%")


def estimate_minimum_gb(cfg: RunConfig, cluster: Cluster) -> float:
    """Per-GPU memory of the most frugal layout (ZeRO-3, full offload, recompute, micro 1)."""
    from pretrain.config import Recompute

    layout = Layout(data=cluster.world_size, global_batch=cluster.world_size, zero_stage=3,
                    offload_optimizer="cpu", offload_param="cpu", recompute=Recompute.FULL,
                    precision=cfg.train.precision)
    return estimate(cfg.model, layout, cluster).memory.total / GB


def run(args: argparse.Namespace) -> Plan | None:
    overrides = config_overrides(args)
    cfg = load_config(args.config, overrides)
    cluster = _cluster(args)
    if args.search:
        _search(args, cfg, cluster)
        return None
    world = args.world_size or cluster.world_size
    ds, layout = dry_run(cfg, world_size=world, accelerator=args.accelerator)
    warnings = data_warnings(cfg)
    plan = estimate(cfg.model, layout, cluster)
    if args.json:
        print(json.dumps({"ok": True, "config": args.config, "world_size": world,
                          "accelerator": args.accelerator, "warnings": warnings,
                          "parameters": cfg.model.num_parameters(),
                          "flops_per_token": cfg.model.flops_per_token(),
                          "deepspeed": ds, **plan.to_dict()}))
        return plan
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    opt, param = layout.offload_optimizer, layout.offload_param
    print(f"[plan] {args.config or '(defaults)'} on {world} ranks ({args.accelerator}): the "
          f"config resolves; nothing was launched")
    print(f"layout  tp {layout.tensor} x pp {layout.pipeline} x dp {layout.data} = {world} ranks | "
          f"global batch {layout.global_batch} = micro {layout.micro_batch} x accum "
          f"{layout.grad_accum} x dp {layout.data} ({layout.global_batch * cfg.model.seq_length:,} "
          f"tokens)")
    print(f"engine  ZeRO-{layout.zero_stage} | offload optimizer={opt} param={param} | "
          f"{layout.precision.value} | recompute {layout.recompute.value} | sequence parallel "
          f"{'on' if layout.sequence_parallel else 'off'} | partition {layout.partition}")
    print(f"model   {cfg.model.num_parameters() / 1e9:.2f}B parameters, "
          f"{cfg.model.flops_per_token():.3g} FLOPs/token, seq {cfg.model.seq_length}")
    print(format_plan(plan))
    return plan
