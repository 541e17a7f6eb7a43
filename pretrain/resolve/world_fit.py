"""Run on the largest part of an allocation the layout and the batch can use.

A job may start with more ranks than its layout can use: a Slurm job requeued onto 12 nodes of a
recipe whose replica is 4 nodes and whose global batch (1024) 3 replicas do not divide, or an
elastic job that lost a node. `pretrain train` then trains on the largest usable world - whole
model-parallel groups (tensor x context x pipeline ranks) whose data-parallel size divides the
global batch into micro-batches - keeps the global batch exactly, and leaves the other ranks idle.

How the idle ranks leave, under every launcher: the active ranks are ranks 0..used-1 (launchers
number ranks node by node, so the idle ranks are the last nodes' ranks) and create the default
process group with WORLD_SIZE = used (env://, rank 0 and MASTER_ADDR unchanged). The idle ranks
never join it: they connect as clients to the same rendezvous store (MASTER_ADDR:MASTER_PORT:
rank 0's TCPStore under the `deepspeed` launcher and srun, the agent's store under torchrun) and
block until rank 0 publishes the job's exit status there, acknowledge it, and exit with it.
Exiting at once is not an option: srun's `--wait` (slurm/common.sh: 300 s) ends every task that
many seconds after the first one exits. If the active ranks crash instead, the launcher ends the
idle ranks with the others (or their store connection breaks and they exit EXIT_FAULT). A stop
signal (SIGTERM / SIGUSR1, which srun and the launchers pass to every rank) only sets the flag of
`faults.RunControl` in an idle rank, so it keeps waiting and exits 75 with the training ranks
instead of dying first (a non-zero exit that launchers answer by killing the training ranks
mid-save); the store's blocking read survives the signal.
"""
from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

from pretrain.errors import EXIT_FAULT, EXIT_REQUEUE, PretrainError

# An idle rank waits as long as the job runs; the launcher, not this timeout, bounds the job.
IDLE_WAIT = datetime.timedelta(days=365)
_KEY = "pretrain/world_fit"


class WorldTooSmall(PretrainError):
    """Fewer ranks than one model replica: more nodes cure it, so the job is requeued."""

    exit_code = EXIT_REQUEUE


@dataclass(frozen=True)
class WorldFit:
    """How many of the `launched` ranks train (`used`), and why the rest sit idle."""

    launched: int
    used: int
    reason: str = ""  # why `launched` is not usable as a whole ('' when every rank trains)

    @property
    def idle(self) -> range:
        return range(self.used, self.launched)

    def describe(self) -> str:
        """One line: which ranks sit idle and why."""
        idle = self.idle
        ranks = (f"rank {idle[0]} sits" if len(idle) == 1
                 else f"ranks {idle[0]}-{idle[-1]} sit")
        return (f"[world] training on ranks 0-{self.used - 1} of {self.launched}; {ranks} idle "
                f"until the job ends: {self.reason}")


def usable_world(launched: int, *, model_parallel: int, micro_batch: int,
                 global_batch: int | None, ramp: tuple[int, ...] = ()) -> WorldFit:
    """The largest world of at most `launched` ranks made of whole model-parallel groups whose
    data-parallel size divides `global_batch` into micro-batches (any size when the global
    batch follows the world: `global_batch` None), and `ramp` too (train.batch_ramp's start and
    increment: then every size the ramp passes through)."""
    replicas = launched // model_parallel
    if replicas < 1:
        raise WorldTooSmall(
            f"{launched} rank(s) cannot hold one model replica of {model_parallel} ranks "
            f"(parallel.tensor x context x pipeline): run on at least {model_parallel} ranks")
    data = next((d for d in range(replicas, 0, -1)
                 if global_batch is None or all(b % (micro_batch * d) == 0
                                                for b in (global_batch, *ramp))), None)
    if data is None:  # no replica count fits: bad input, which the layout check reports (exit 2)
        return WorldFit(launched, launched)
    used = data * model_parallel
    if used == launched:
        return WorldFit(launched, used)
    whole = replicas * model_parallel
    if data == replicas:
        reason = (f"{launched} ranks are not a whole number of model replicas of "
                  f"{model_parallel} ranks")
    else:
        what = (f"train.global_batch_size={global_batch}" if not ramp else
                f"train.global_batch_size={global_batch} and train.batch_ramp's start and "
                f"increment {ramp[0]}, {ramp[1]}")
        reason = (f"data parallel {replicas} does not divide {what} into micro-batches of "
                  f"{micro_batch}; data parallel {data} does")
        if whole != launched:
            reason = f"{launched - whole} ranks are not a whole replica, and " + reason
    return WorldFit(launched, used, reason)


def fit_of_config(cfg: Any, launched: int) -> WorldFit:
    """`usable_world` of a `RunConfig` (its parallel sizes, micro and global batch). A model
    the parallel sizes cannot split is bad input (ConfigError, exit 2) whatever the world."""
    from pretrain.resolve.layout import check_pipeline_split, check_tensor_split

    p, t = cfg.parallel, cfg.train
    check_tensor_split(cfg.model, p.tensor)
    check_pipeline_split(cfg.model, p.pipeline, partition_method=p.pipeline_partition)
    ramp = getattr(t, "batch_ramp", None)
    return usable_world(launched, model_parallel=p.tensor * p.pipeline * getattr(p, "context", 1),
                        micro_batch=t.micro_batch_size, global_batch=t.global_batch_size,
                        ramp=(ramp.start, ramp.increment) if ramp is not None else ())


def usable_node_counts(cfg: Any, *, ranks_per_node: int, up_to: int) -> list[int]:
    """The node counts (1..up_to) on which every rank of the recipe trains."""
    counts = []
    for nodes in range(1, up_to + 1):
        try:
            fit = fit_of_config(cfg, nodes * ranks_per_node)
        except WorldTooSmall:
            continue
        if fit.used == fit.launched:
            counts.append(nodes)
    return counts


def idle_warning(fit: WorldFit, cfg: Any, *, ranks_per_node: int) -> str:
    """The warning of a job whose ranks would not all train (`fit.idle`), naming what uses
    them all: the global batches nearest the config's that the whole world divides into
    micro-batches, or, when the ranks are not whole model replicas, the node counts that are.
    `plan` and the Slurm pre-flight print the same one."""
    p, t = cfg.parallel, cfg.train
    model_parallel = p.tensor * p.pipeline * getattr(p, "context", 1)
    remedies = []
    if fit.launched % model_parallel == 0:  # whole replicas: a batch they divide uses them all
        data = fit.launched // model_parallel
        step = t.micro_batch_size * data
        lower, upper = t.global_batch_size // step * step, -(-t.global_batch_size // step) * step
        batches = " or ".join(str(b) for b in dict.fromkeys((lower, upper)) if b > 0)
        remedies.append(f"--set train.global_batch_size={batches} (a multiple of "
                        f"train.micro_batch_size x data parallel = {t.micro_batch_size} x {data})")
    nodes = -(-fit.launched // ranks_per_node)
    counts = usable_node_counts(cfg, ranks_per_node=ranks_per_node, up_to=max(16, 2 * nodes))
    if counts:
        remedies.append(f"a job of {', '.join(map(str, counts))} nodes of {ranks_per_node}")
    text = (f"{len(fit.idle)} of the {fit.launched} GPUs sit idle for the whole job (only "
            f"{fit.used} train): {fit.reason}")
    if remedies:
        text += f". To train on every GPU: {'; or '.join(remedies)}"
    return text


def check_tensor_within_node(cfg: Any, *, gpus_per_node: int) -> None:
    """Tensor parallelism wider than a node would send every layer's all-reduces (or
    sequence-parallel gathers) over the network instead of NVLink: refused (ConfigError, exit 2)
    where the node's GPUs are known, before any rank starts."""
    from pretrain.errors import ConfigError

    tensor = cfg.parallel.tensor
    if tensor > gpus_per_node:
        raise ConfigError(
            f"parallel.tensor={tensor} is wider than a node's {gpus_per_node} GPUs: tensor "
            "parallelism all-reduces every layer's activations and belongs inside a node "
            f"(NVLink); set parallel.tensor to at most {gpus_per_node} and split the rest with "
            "parallel.pipeline or data parallelism (`pretrain plan --search` ranks the layouts)")


_FIT: WorldFit | None = None  # this process's fit, for `publish_exit` (active rank 0)


def enter(fit: WorldFit, *, rank: int, log) -> None:
    """Apply `fit` to this process before the process group exists: an active rank trains in a
    world of `fit.used` ranks (WORLD_SIZE reduced), an idle rank never returns."""
    global _FIT
    _FIT = fit
    if not fit.idle:
        return
    log(fit.describe())
    if rank in fit.idle:
        wait_idle(fit, rank=rank)
    os.environ["WORLD_SIZE"] = str(fit.used)


def _attempt() -> str:
    # torchrun may keep one store across worker restarts: a key per restart
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def _store(timeout: datetime.timedelta):
    """A client of the launch's rendezvous store (see the module's docstring)."""
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=timeout)


def wait_idle(fit: WorldFit, *, rank: int) -> NoReturn:
    """An idle rank: wait for the job's exit status from rank 0, acknowledge it, exit with it."""
    key = f"{_KEY}/{_attempt()}"
    try:
        store = _store(IDLE_WAIT)
        code = int(store.get(f"{key}/exit"))
        store.set(f"{key}/left/{rank}", "1")
    except Exception as exc:  # noqa: BLE001 - rank 0 ended without publishing: a failed job
        print(f"error: idle rank {rank}: the training ranks ended without an exit status "
              f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
              file=sys.stderr, flush=True)
        code = EXIT_FAULT
    sys.stdout.flush()
    os._exit(code)


def publish_exit(code: int, *, rank: int, timeout_minutes: float = 10.0) -> None:
    """Rank 0 of a fitted world: hand `code` to the idle ranks and wait until each has it (so
    that its store, which lives in rank 0 under most launchers, outlives their reads)."""
    if _FIT is None or not _FIT.idle or rank != 0:
        return
    key = f"{_KEY}/{_attempt()}"
    store = _store(datetime.timedelta(minutes=timeout_minutes))
    store.set(f"{key}/exit", str(code))
    store.wait([f"{key}/left/{r}" for r in _FIT.idle])
