"""`pretrain launch ...`: the Python side of the launch scripts in `launch/` and `slurm/`.

The shell scripts stay thin: #SBATCH headers, node discovery, environment and one `srun` or
launcher call. What needs logic lives here, where it is unit tested:

- `hostfile`: a DeepSpeed hostfile (`node slots=N` per line) from `SLURM_JOB_NODELIST` or a
  node list, expanding Slurm host lists with `scontrol show hostnames` when Slurm is installed and
  with `expand_nodelist` (same grammar: `gpu[01-04,7],login1`) when it is not;
- `env-file`: DeepSpeed's `.deepspeed_env` (one `NAME=value` a line), which its multi-node
  runners (pdsh, ssh, slurm) export to every rank: the variables that must be the same everywhere;
- `preflight`: `pretrain plan --build` for the job's world size before any rank starts (layout,
  memory per GPU of the GPUs `nvidia-smi` lists on the node unless `--gpu-memory-gb` is given;
  exit 2 with one `error:` line for a config that does not fit, 75 for a job smaller than one
  model replica, which more nodes cure), planned for the ranks `pretrain train` will use of the
  job's (`pretrain.resolve.world_fit`), with the recipe's usable node counts; then the resolved run
  config, the resolved DeepSpeed JSON, the plan and the git commit in the job's log directory;
  a config whose compiled DeepSpeed ops cannot load here is refused (`compiled_ops`);
- `build-ops`: those ops built (or copied from the set-up's builds) before the ranks start:
  `launch/setup_env.sh --ops` into `.build/`, a Slurm job once per node into node-local scratch;
- `k8s`: the Kubernetes manifests of a run (`pretrain.k8s`), after the pre-flight for its world;
- `torchrun`: torchrun, exiting with the ranks' status (the command of every Kubernetes pod).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from pretrain import compiled_ops
from pretrain.commands import launch_k8s
from pretrain.commands import plan as plan_command
from pretrain.config import add_config_arguments, config_overrides, load_config
from pretrain.errors import ConfigError
from pretrain.files import git_commit

# Variables the multi-node launchers must carry to every rank (prefixes). DeepSpeed already
# exports PYTHON*, NCCL_* (CUDA accelerator), UCX*, MV2*; the rest are ours or PyTorch's.
ENV_PREFIXES = ("PYTHON", "NCCL_", "TORCH_", "CUDA_DEVICE_MAX", "WANDB_", "HF_", "PRETRAIN_")
ENV_NAMES = ("OMP_NUM_THREADS", "DS_ACCELERATOR", "PATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV")

# The environment of every rank that slurm/common.sh exports (with these defaults) and the
# Kubernetes pods get (tests/test_k8s.py checks that the two agree).
RANK_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # a failed collective ends the rank
    "NCCL_DEBUG": "WARN",
    "PYTHONFAULTHANDLER": "1",  # Python stacks of every thread on a crash or a fatal signal
    "PYTHONUNBUFFERED": "1",
}

_RANGE = re.compile(r"^(\d+)-(\d+)$")


def expand_nodelist(spec: str) -> list[str]:
    """Expand a Slurm host list without Slurm: `n[01-03,7],login` -> n01 n02 n03 n7 login.

    Zero padding follows the lower bound's width, as in Slurm. Several bracket groups in one
    name (`rack[1-2]-n[1-2]`) expand as a product.
    """
    names: list[str] = []
    for item in _split_top_level(spec.strip()):
        names += _expand_one(item)
    return names


def _split_top_level(spec: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(spec):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0:
            raise ConfigError(f"node list {spec!r}: unbalanced ']' at position {i}")
        if ch == "," and depth == 0:
            items.append(spec[start:i])
            start = i + 1
    if depth != 0:
        raise ConfigError(f"node list {spec!r}: unbalanced '[' (write e.g. node[01-04,07])")
    items.append(spec[start:])
    return [item for item in (s.strip() for s in items) if item]


def _expand_one(item: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if not match:
        return [item]
    head, tail = item[:match.start()], item[match.end():]
    out = []
    for part in match.group(1).split(","):
        r = _RANGE.match(part.strip())
        if r:
            lo, hi = r.groups()
            if int(hi) < int(lo):
                raise ConfigError(f"node list range [{part}] in {item!r} runs backwards; write [{hi}-{lo}]")
            out += [f"{head}{n:0{len(lo)}d}" for n in range(int(lo), int(hi) + 1)]
        elif part.strip().isdigit():
            out.append(head + part.strip())
        else:
            raise ConfigError(f"node list {item!r}: {part!r} is not a number or a range like 01-04")
    return [name for prefix in out for name in _expand_one(prefix + tail)]


def node_names(nodelist: str | None = None) -> list[str]:
    """The job's nodes in Slurm's order: `nodelist`, else `$SLURM_JOB_NODELIST`.

    The spec is checked with `expand_nodelist` first: `scontrol show hostnames` accepts malformed
    lists (`c[1-` prints `c]`), which would make a hostfile of nodes that do not exist.
    """
    spec = nodelist or os.environ.get("SLURM_JOB_NODELIST", "")
    if not spec:
        raise ConfigError("no nodes: pass --nodes HOST[,HOST...] or run inside a Slurm allocation "
                          "(SLURM_JOB_NODELIST is not set)")
    names = expand_nodelist(spec)
    return _scontrol_hostnames(spec) or names


def _scontrol_hostnames(spec: str) -> list[str]:
    """`scontrol show hostnames spec` (Slurm's own expansion), or [] where Slurm is not installed
    or it fails."""
    if not shutil.which("scontrol"):
        return []
    proc = subprocess.run(["scontrol", "show", "hostnames", spec], capture_output=True, text=True,
                          timeout=60)
    return proc.stdout.split() if proc.returncode == 0 else []


def hostfile_text(nodes: list[str], *, slots: int) -> str:
    """DeepSpeed's hostfile format: `hostname slots=N`, one node a line, first node = master."""
    if slots < 1:
        raise ConfigError(f"slots per node = {slots}; need >= 1 (GPUs, or CPU ranks, per node)")
    if len(set(nodes)) != len(nodes):
        raise ConfigError(f"node list names a node twice: {nodes}")
    return "".join(f"{n} slots={slots}\n" for n in nodes)


def deepspeed_env_text(env: dict[str, str] | None = None, *, names: tuple[str, ...] = ()) -> str:
    """`.deepspeed_env` lines for the variables in ENV_PREFIXES / ENV_NAMES (plus `names`) that are set.

    DeepSpeed splits each line at the first '='; a value with a newline cannot be passed.
    """
    env = os.environ if env is None else env
    lines = []
    for key in sorted(env):
        if key in names or key in ENV_NAMES or key.startswith(ENV_PREFIXES):
            if "\n" in env[key]:
                raise ConfigError(f"environment variable {key} holds a newline; .deepspeed_env "
                                  "cannot carry it: unset it or pass it another way")
            lines.append(f"{key}={env[key]}\n")
    return "".join(lines)


def preflight(args: argparse.Namespace, *, log_dir: Path | None) -> str:
    """`pretrain plan --build` for the job's world size (the layout, the memory and time plan,
    every distinct rank's module built on the meta device), then the job record in `log_dir`;
    the plan text.

    The planner's dry run raises ConfigError (exit 2 in the CLI) before any rank has started, so a
    job with a bad config fails in seconds with the reason in its log instead of after start-up.
    One process for both: each Python start with torch costs seconds per job.
    """
    if not args.world_size or args.world_size < 1:
        raise ConfigError(f"--world-size {args.world_size}: need the job's number of ranks (>= 1)")
    args.build = not args.no_build
    if args.ranks_per_node and args.gpus_per_node is None and "cpu" not in (args.accelerator,
                                                                            args.cluster):
        args.gpus_per_node = args.ranks_per_node  # the job's nodes: tensor parallelism within one
    check_store(load_config(args.config, config_overrides(args)))
    gpus_seen = _gpus_of_this_node(args) + _fit_world(args)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            args.plan, run = plan_command.plan_run(args)  # the plan: for `launch k8s`'s grace
    except ConfigError:
        sys.stdout.write(gpus_seen + out.getvalue())  # the plan that does not fit, then why
        raise
    ops = check_compiled_ops(run.ds_config, where=run.cfg.deepspeed)
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        # for slurm/common.sh: the ops to build once per node, and the node-local folder
        (log_dir / "ops.tsv").write_text(
            f"{','.join(ops)}\t{compiled_ops.node_local_ops_dir()}\n" if ops else "")
        run.cfg.save(log_dir / "config.yaml")  # model.vocab_size: auto settled, as the run will
        (log_dir / "ds_config.json").write_text(json.dumps(run.ds_config, indent=2) + "\n")
        (log_dir / "git_commit.txt").write_text(git_commit() + "\n")
        (log_dir / "plan.txt").write_text(gpus_seen + out.getvalue())
    return gpus_seen + out.getvalue()


def check_store(cfg) -> None:
    """A run directory in the object store: the bucket reachable, there, and writable with the
    environment's credentials (`storage.check_writable`), before anything is queued; a
    `StoreError` (exit 2) naming run_dir otherwise."""
    from pretrain import storage

    if storage.is_remote(cfg.run_dir):
        storage.check_writable(cfg.run_dir)


def check_compiled_ops(ds: dict, *, where: str) -> list[str]:
    """The compiled DeepSpeed ops the resolved config needs (`compiled_ops`); ConfigError when
    one cannot load on this node, before anything is queued. Stale build locks in
    $TORCH_EXTENSIONS_DIR are removed and reported."""
    ops = compiled_ops.needed_ops(ds)
    if not ops:
        return ops
    problems = [problem for problem in map(compiled_ops.load_problem, ops) if problem]
    if problems:
        raise ConfigError(f"{where} needs DeepSpeed's compiled op(s) {', '.join(ops)}; "
                          + "; ".join(problems))
    for line in compiled_ops.clear_stale_locks(ops, compiled_ops.extensions_dir()):
        print(line, file=sys.stderr)
    return ops


def _fit_world(args: argparse.Namespace) -> str:
    """The node counts on which every rank of the recipe trains, and the world `pretrain
    train` will use of this job's (`args.world_size` becomes it): lines for the plan text.
    `WorldTooSmall` (exit 75, requeue) when the job cannot hold one model replica."""
    from pretrain.resolve import world_fit

    cfg = load_config(args.config, config_overrides(args))
    per_node = args.ranks_per_node or args.world_size
    nodes = max(1, args.world_size // per_node)
    counts = world_fit.usable_node_counts(cfg, ranks_per_node=per_node, up_to=max(16, 2 * nodes))
    fit = world_fit.fit_of_config(cfg, args.world_size)
    lines = [f"[preflight] usable node counts ({per_node} ranks a node, every rank training): "
             f"{', '.join(map(str, counts)) or 'none up to ' + str(max(16, 2 * nodes))}; other "
             "counts at least one replica large train on the largest usable set of ranks and "
             "leave the rest idle"]
    if fit.idle:
        lines.append(fit.describe().replace("[world]", "[preflight]"))
        print(f"warning: {world_fit.idle_warning(fit, cfg, ranks_per_node=per_node)}",
              file=sys.stderr)
        args.world_size = fit.used
    return "".join(line + "\n" for line in lines)


def _gpus_of_this_node(args: argparse.Namespace) -> str:
    """Plan for the GPUs the job has: unless --gpu-memory-gb is given, the memory of the
    smallest GPU `nvidia-smi` lists on this node (the batch script runs on the job's first
    node). A line saying what was seen, or ''."""
    from pretrain.hardware import visible_gpus

    if args.gpu_memory_gb or args.accelerator == "cpu" or args.cluster == "cpu":
        return ""
    gpus = visible_gpus()
    if not gpus:
        return ""
    name, memory = min(gpus, key=lambda gpu: gpu[1])
    args.gpu_memory_gb, args.gpu_memory_source = memory, f"{name}, nvidia-smi on this node"
    return (f"[preflight] this node: {len(gpus)} GPU(s), the smallest {name} with "
            f"{memory:.1f} GiB (nvidia-smi): planned with --gpu-memory-gb {memory:.1f}\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="launch_command", required=True, metavar="SUBCOMMAND")
    h = sub.add_parser("hostfile", help="write a DeepSpeed hostfile for the Slurm job or a node list")
    h.add_argument("--nodes", help="host list, Slurm syntax (node[01-04],login1); default "
                                   "$SLURM_JOB_NODELIST")
    h.add_argument("--slots", type=int, required=True, help="ranks per node (GPUs, or CPU ranks)")
    h.add_argument("--output", required=True)
    e = sub.add_parser("env-file", help="write DeepSpeed's .deepspeed_env for every rank")
    e.add_argument("--output", default=".deepspeed_env")
    e.add_argument("--var", action="append", default=[], help="also pass this variable (repeatable)")
    n = sub.add_parser("nodes", help="the node counts between --min-nodes and --max-nodes on "
                                      "which the recipe trains; prints the smallest usable one")
    add_config_arguments(n)
    n.add_argument("--ranks-per-node", type=int, required=True, metavar="N")
    n.add_argument("--min-nodes", type=int, required=True)
    n.add_argument("--max-nodes", type=int, required=True)
    add_preflight_arguments(sub.add_parser(
        "preflight", help="pretrain plan for the job's ranks, then record the resolved config, "
                          "DeepSpeed JSON and git commit"))
    b = sub.add_parser("build-ops", help="build the compiled DeepSpeed ops a config needs "
                                          "(CPU Adam, async I/O) before any rank starts")
    which = b.add_mutually_exclusive_group(required=True)
    which.add_argument("--ops", help="comma-separated op names: " + ", ".join(compiled_ops.BUILDERS))
    which.add_argument("--shipped", action="store_true",
                       help="every op a DeepSpeed config in ds_configs/ needs (launch/setup_env.sh --ops)")
    b.add_argument("--dir", type=Path, help="build here (default $TORCH_EXTENSIONS_DIR)")
    b.add_argument("--seed", type=Path, help="copy builds made for this CPU model from here "
                                             "instead of compiling (the set-up's .build)")
    launch_k8s.add_k8s_arguments(sub)
    r = sub.add_parser("ray", help="run `pretrain train` as a Ray Train job (TorchTrainer), one "
                                   "rank a worker, failed groups restarted and resumed")
    r.add_argument("--num-workers", type=int, required=True, help="ranks (Ray Train workers)")
    per = r.add_mutually_exclusive_group()
    per.add_argument("--cpus-per-worker", type=float, help="CPU ranks: cores each (default 1)")
    per.add_argument("--gpus-per-worker", type=float, help="GPU ranks: GPUs each (1)")
    r.add_argument("--address", help="Ray cluster to join: HOST:PORT, ray://HOST:PORT, or auto "
                                     "(the cluster running on this host); default $RAY_ADDRESS, "
                                     "else a Ray started for the job on this machine (never a "
                                     "cluster that happens to run here)")
    r.add_argument("--max-failures", type=int, default=3,
                   help="worker-group restarts after a failure (-1: no limit); each resumes "
                        "from the newest complete checkpoint")
    r.add_argument("train_args", nargs="*", help="after --: `pretrain train` arguments")


def add_preflight_arguments(p: argparse.ArgumentParser) -> None:
    plan_command.add_arguments(p, search=False)  # --config / --set / --world-size / cluster
    p.add_argument("--log-dir", type=Path, help="write config.yaml, ds_config.json, "
                                                 "git_commit.txt and plan.txt here")
    p.add_argument("--ranks-per-node", type=int, metavar="N",
                   help="ranks per node, for the usable node counts it prints (default: "
                        "--world-size, one node)")
    p.add_argument("--no-build", action="store_true",
                   help="skip building every distinct rank on the meta device (plan --build)")


def run(args: argparse.Namespace) -> None:
    if args.launch_command == "hostfile":
        text = hostfile_text(node_names(args.nodes), slots=args.slots)
        Path(args.output).write_text(text)
        print(f"[launch] {args.output}: {text.count(chr(10))} nodes x {args.slots} slots")
    elif args.launch_command == "env-file":
        Path(args.output).write_text(deepspeed_env_text(names=tuple(args.var)))
        print(f"[launch] {args.output}: environment for every rank")
    elif args.launch_command == "build-ops":
        build_ops(args)
    elif args.launch_command == "nodes":
        print(elastic_min_nodes(args))
    elif args.launch_command == "k8s":
        k8s_manifests(args)
    elif args.launch_command == "ray":
        sys.exit(train_on_ray(args))
    elif args.launch_command == "torchrun":
        launch_k8s.run_torchrun(args)
    else:
        sys.stdout.write(preflight(args, log_dir=args.log_dir))


def k8s_manifests(args: argparse.Namespace) -> None:
    """`pretrain launch k8s`: the pre-flight for the job's world (its plan on stderr), then the
    manifests on stdout."""
    from pretrain import k8s

    spec = launch_k8s.spec_of(args)
    spec.check()
    plan = _preflight_for_manifests(spec, gpu_memory_gb=args.gpu_memory_gb)
    if args.termination_grace is None:
        spec.termination_grace_s = k8s.grace_from_plan(plan)
        print(f"[launch] pods' termination grace {spec.termination_grace_s} s (the plan's step "
              "and save; --termination-grace sets it)", file=sys.stderr)
    sys.stdout.write(k8s.to_yaml(k8s.manifests(spec, rank_env=pod_env())))


def train_on_ray(args: argparse.Namespace) -> int:
    """`pretrain launch ray`: the run config checked here (bad input: exit 2 before Ray starts),
    then the Ray Train job; its exit status."""
    from pretrain import ray_train

    train = argparse.ArgumentParser(prog="pretrain train")
    add_config_arguments(train)
    known, _ = train.parse_known_args(args.train_args)
    cfg = load_config(known.config, config_overrides(known))
    check_store(cfg)
    job = ray_train.RayJob(train_args=args.train_args, num_workers=args.num_workers,
                           cpus_per_worker=args.cpus_per_worker or (
                               None if args.gpus_per_worker else 1.0),
                           gpus_per_worker=args.gpus_per_worker, address=args.address,
                           max_failures=args.max_failures)
    return ray_train.fit(job, run_dir=cfg.run_dir)


def pod_env() -> dict[str, str]:
    """The environment of every Kubernetes pod's ranks: RANK_ENV, and a rendezvous store per
    round (torch 2.13's shared store deadlocks when an agent that was alone is joined; see
    launch/elastic.sh)."""
    return {**RANK_ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _preflight_for_manifests(spec, *, gpu_memory_gb: float | None):
    """`preflight` with the pods' arguments, for --nodes, and a check that --min-nodes hold one
    model replica; ConfigError (exit 2, no manifest) otherwise. The plan (`Plan`)."""
    from pretrain import k8s
    from pretrain.resolve import world_fit

    parser = argparse.ArgumentParser(prog="pretrain launch preflight")
    add_preflight_arguments(parser)
    argv = k8s.preflight_argv(spec)
    if gpu_memory_gb:
        argv += ["--gpu-memory-gb", str(gpu_memory_gb)]
    args = parser.parse_args(argv)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout is the manifests
            sys.stderr.write(preflight(args, log_dir=None))
        cfg = load_config(args.config, config_overrides(args))
        world_fit.fit_of_config(cfg, spec.min_nodes * spec.procs_per_node)
    except world_fit.WorldTooSmall as exc:
        raise ConfigError(f"--min-nodes {spec.min_nodes} x {spec.procs_per_node} ranks: {exc}") \
            from None
    return args.plan


def build_ops(args: argparse.Namespace) -> None:
    """`pretrain launch build-ops`: the ops that can load here, built; the others reported
    (exit 2 when any named op cannot be built here)."""
    if args.shipped:
        ops = compiled_ops.shipped_ops(Path(__file__).resolve().parents[2] / "ds_configs")
    else:
        ops = [op.strip() for op in args.ops.split(",") if op.strip()]
        unknown = sorted(set(ops) - set(compiled_ops.BUILDERS))
        if unknown:
            raise ConfigError(f"--ops {','.join(unknown)}: unknown op; known: "
                              + ", ".join(compiled_ops.BUILDERS))
    skipped = compiled_ops.build(ops, ext_dir=args.dir or compiled_ops.extensions_dir(),
                                 seed=args.seed)
    if skipped:
        raise ConfigError("; ".join(skipped))


def elastic_min_nodes(args: argparse.Namespace) -> int:
    """`launch/elastic.sh MIN:MAX`: the smallest node count in the range that holds one model
    replica (torchrun then waits for that many nodes instead of starting a world that cannot
    train), with the counts on which every rank trains on stderr. ConfigError when even
    --max-nodes cannot hold one replica."""
    from pretrain.resolve import world_fit

    cfg = load_config(args.config, config_overrides(args))
    lo, hi, per_node = args.min_nodes, args.max_nodes, args.ranks_per_node
    if not 1 <= lo <= hi or per_node < 1:
        raise ConfigError(f"nodes {lo}:{hi} x {per_node} ranks: need 1 <= MIN <= MAX and >= 1 "
                          "rank a node")
    fitting = [n for n in range(lo, hi + 1) if _holds_a_replica(cfg, n * per_node)]
    if not fitting:  # bad input: no node count of the range can ever train
        try:
            world_fit.fit_of_config(cfg, hi * per_node)
        except world_fit.WorldTooSmall as exc:
            raise ConfigError(f"--max-nodes {hi} x {per_node} ranks: {exc}") from None
    full = [n for n in world_fit.usable_node_counts(cfg, ranks_per_node=per_node, up_to=hi)
            if n >= lo]
    print(f"[launch] nodes {lo}:{hi}: the run starts with {fitting[0]} or more (one model "
          f"replica); every rank trains at {', '.join(map(str, full)) or 'none of them'}, other "
          "counts leave ranks idle", file=sys.stderr)
    return fitting[0]


def _holds_a_replica(cfg, ranks: int) -> bool:
    from pretrain.resolve import world_fit

    try:
        world_fit.fit_of_config(cfg, ranks)
        return True
    except world_fit.WorldTooSmall:
        return False
