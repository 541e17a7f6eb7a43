"""Overhead of the hang watchdog and the collective ring buffer (pretrain/training/hang.py,
pretrain/training/collective_log.py) on a training step of the quickstart's shape.

2 gloo ranks, one engine each (configs/quickstart.yaml: small preset, 6 layers, hidden 384, seq
256, micro-batch 8, global batch 16, ZeRO-2), fp32, random tokens. In the same processes rounds
alternate "off" (torch.distributed's own collectives, no watchdog) and "on" (every collective
recorded in the ring buffer, the watchdog thread running with the run's default timeout and
publishing its heartbeat through the rendezvous store, a beat per micro-batch and step);
`--steps` steps per round after `--warmup`, the median step time of each round kept. Printed:
each pair's ratio and their median. Because a shared 2-core machine drifts by more than the
effect, it also prints the bound that does not drift: collectives per step x the measured cost
of one recorded call (wrapper and ring buffer, against an empty function), over the step time.

    .venv/bin/python bench/hang_overhead.py               # defaults: 4 rounds x 8 steps per side
    .venv/bin/python bench/hang_overhead.py --rounds 2 --steps 3 --warmup 1   # BENCHMARKS.md's run
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from common import REPO, machine


def _engine(rank: int, world_size: int, run_dir: str):
    from pretrain.config import load_config
    from pretrain.dist import init_deepspeed_comm
    from pretrain.training.engine import build_engine
    from pretrain.resolve.run import resolve_ds_config
    from pretrain.resolve.topology import Topology

    init_deepspeed_comm(dist_backend="gloo", verbose=False)
    cfg = load_config(REPO / "configs/quickstart.yaml", [
        "train.precision=fp32", "model.vocab_size=8192", f"run_dir={run_dir}"])
    ds_config = resolve_ds_config(cfg, world_size=world_size, accelerator="cpu")
    groups = Topology.from_parallel_config(cfg.parallel, world_size=world_size,
                                           rank=rank).create_groups()
    return cfg, build_engine(cfg, ds_config, groups, main=False)


def _recorded_call_cost() -> float:
    """Seconds one recorded call adds (wrapper + ring buffer) over calling the function."""
    from pretrain.training import collective_log

    log = collective_log.CollectiveLog()

    def nothing(tensor=None, op=None, group=None, async_op=False):
        return None

    wrapped, n = collective_log._wrap(nothing, "all_reduce", log), 200_000
    times = {}
    for name, fn in (("plain", nothing), ("recorded", wrapped)):
        start = time.perf_counter()
        for _ in range(n):
            fn(None, group=None)
        times[name] = (time.perf_counter() - start) / n
    return times["recorded"] - times["plain"]


def _measure(rank: int, world_size: int, run_dir: str, rounds: int, steps: int,
             warmup: int) -> dict:
    import deepspeed.comm.comm as ds_comm
    import torch
    import torch.distributed as dist

    from pretrain.training import collective_log, hang

    plain = {op: getattr(dist, op) for op in collective_log.OPS if hasattr(dist, op)}
    collective_log.install()  # before DeepSpeed's backend keeps references, as `train` does
    recorded = {op: getattr(dist, op) for op in plain}
    cfg, engine = _engine(rank, world_size, run_dir)
    backend = ds_comm.cdb

    def use(functions: dict) -> None:
        for op, fn in functions.items():
            setattr(dist, op, fn)
        backend.all_gather_function = dist.all_gather_into_tensor
        backend.reduce_scatter_function = dist.reduce_scatter_tensor

    torch.manual_seed(rank)
    ids = torch.randint(0, cfg.model.vocab_size,
                        (cfg.train.micro_batch_size, cfg.model.seq_length + 1))

    def step(dog) -> float:
        start = time.perf_counter()
        loss = engine(ids[:, :-1], labels=ids[:, 1:])
        engine.backward(loss)
        engine.step()
        if dog is not None:
            dog.beat()
            dog.beat(1)
        dist.barrier()
        return time.perf_counter() - start

    for _ in range(warmup):
        step(None)
    before = collective_log.LOG.total
    use(recorded)
    step(None)
    per_step = collective_log.LOG.total - before
    medians = {"off": [], "on": []}
    for _ in range(rounds):
        for side in ("off", "on"):
            dog = None
            use(plain)
            if side == "on":
                use(recorded)
                dog = hang.Watchdog(timeout_minutes=cfg.train.hang_timeout, rank=rank,
                                    world_size=world_size, run_dir=Path(run_dir),
                                    store=hang.default_store())
                dog.start()
            medians[side].append(statistics.median(step(dog) for _ in range(steps)))
            if dog is not None:
                dog.stop()
    use(plain)
    return {"medians": medians, "collectives_per_step": per_step,
            "call_cost": _recorded_call_cost(), "interval": hang.intervals(
                cfg.train.hang_timeout * 60)[0]}


def main() -> None:
    from pretrain.testing.ranks import run_on_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = run_on_ranks(_measure, world_size=2, tmp_path=Path(tmp), timeout_s=1800,
                              args=(tmp, args.rounds, args.steps, args.warmup))[0]
    off, on = result["medians"]["off"], result["medians"]["on"]
    ratios = [b / a for a, b in zip(off, on)]
    print(f"machine: {machine()}")
    print(f"quickstart shape, 2 gloo ranks, ZeRO-2, fp32; {args.rounds} rounds x {args.steps} "
          f"steps per side; heartbeat every {result['interval']:.0f} s")
    for i, (a, b, r) in enumerate(zip(off, on, ratios)):
        print(f"round {i + 1}: off {a * 1000:.1f} ms/step, on {b * 1000:.1f} ms/step, "
              f"on/off {r:.4f}")
    print(f"median on/off: {statistics.median(ratios):.4f}")
    bound = result["collectives_per_step"] * result["call_cost"] / statistics.median(off)
    print(f"{result['collectives_per_step']} collectives per step x "
          f"{result['call_cost'] * 1e6:.2f} us per recorded call = {bound * 100:.4f}% of a step")


if __name__ == "__main__":
    main()
