"""Pipeline bubble of DeepSpeed's 1F1B schedule at pp = 2, measured against the theory; with
`--schedules`, of each of fsdp2's schedules (torch.distributed.pipelining) against the planner.

Two gloo ranks (one core each) run a 2-stage pipeline of the Llama model for m = 1, 2, 4, 8
micro-batches per step (the same micro-batch size, `engine.set_train_batch_size`). A step
should take (m + p - 1) micro-batch slots; the busy part is m slots, so the bubble is
(p - 1) / (m + p - 1). The slot time is the slope of step time against m (a least-squares
line through all m), and the measured bubble fraction of m is 1 - m * slope / step_time(m).

    .venv/bin/python bench/pipeline_bubble.py          # ~2 minutes on 2 cores

`--schedules`: two gloo ranks (one core each) run torch's schedules (`1f1b`, `interleaved_1f1b`
with 2 and 4 stages a rank, `zero_bubble` with 1 and 2, `zbv`, `dualpipe_v`) over a stack of 8
residual MLP blocks (hidden 256, 1024 inner, 256 tokens a micro-batch, fp32) cut into pp x v
stages, for m = 4 and 8 micro-batches a step. Each rank times its stages' work inside the
pipelined step ("busy": the stages' forward and backward calls, wrapped); the measured bubble
fraction is 1 - busy / step time (the mean of the two ranks', the median over the steps),
beside the ideal b / (m + b), b = `pipeline_bubble_slots`, and the planner's: 1 - busy /
(busiest (m + b) / m + `pipeline_overhead`), the step set by the busier rank as the planner's
by the busiest stage, and the schedule's fixed costs from the CPU cluster's constants measured
in the same run (`--calibrate`'s: the split backward against a full one, and the runtime's
costs on a schedule no row runs, interleaved 1F1B with 3 stages a rank at m = 6 over the same
blocks: its work per entry of torch's action list, where each send and receive is an entry of
its own, and a message's entry and post to gloo), none fitted to the schedules they predict.
The peak activation memory of each rank is the most bytes autograd holds saved at once
(`saved_tensors_hooks`: each saved tensor counted from its save to its release, kept detached),
over one micro-batch's saved bytes through the rank's stages: the micro-batches in flight,
beside the planner's (`micro_batches_in_flight`) and torch's action lists replayed
(`pretrain.testing.schedule_replay`).

    .venv/bin/python bench/pipeline_bubble.py --schedules   # ~2 minutes on 2 cores
    .venv/bin/python bench/pipeline_bubble.py --calibrate   # the CPU constants alone, ~15 s
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from common import machine
from pretrain.testing.ranks import run_on_ranks

MICRO = 4


def _rank(rank: int, world_size: int, micro_counts: list[int], steps: int, layers: int) -> dict:
    import logging

    import deepspeed
    import torch

    from pretrain.config import load_config
    from pretrain.model import build_pipeline_model

    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    cfg = load_config(None, ["model.preset=small", f"model.num_layers={layers}",
                             "model.seq_length=128", "model.tie_embeddings=false"]).model
    module = build_pipeline_model(cfg, seed=0, num_stages=2, partition_method="uniform")
    config = {"train_batch_size": MICRO, "train_micro_batch_size_per_gpu": MICRO,
              "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": {"stage": 0}}
    engine, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                      config=config)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (MICRO, cfg.seq_length + 1), generator=gen)
    batch = (tokens[:, :-1], tokens[:, 1:])

    def forever():
        while True:
            yield batch

    step_times = {}
    for m in micro_counts:
        engine.set_train_batch_size(MICRO * m)
        data = forever()
        for _ in range(2):  # warm-up
            engine.train_batch(data)
        times = []
        for _ in range(steps):
            torch.distributed.barrier()
            start = time.perf_counter()
            engine.train_batch(data)
            times.append(time.perf_counter() - start)
        step_times[m] = statistics.median(times)
    return step_times


SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4), ("zero_bubble", 1),
             ("zero_bubble", 2), ("zbv", 2), ("dualpipe_v", 2))
# the runtime's costs are measured on a schedule no row runs: torch's action-list runtime (the
# one every row but 1F1B runs), 3 stages a rank (every boundary crosses ranks: 10 messages and 6
# actions a micro-batch on each), at m = 6
CALIBRATION = ("interleaved_1f1b", 3)
HIDDEN, INNER, TOKENS = 256, 1024, 256


def _schedule_rank(rank: int, world_size: int, micro_counts: list[int], steps: int,
                   layers: int, hidden: int = HIDDEN, inner: int = INNER,
                   schedules=SCHEDULES) -> dict:
    import weakref

    import torch
    import torch.nn as nn
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    from pretrain.arithmetic import stage_indices, stage_spans
    from pretrain.training.pipeline_schedules import SCHEDULE_CLASSES

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(hidden, inner), nn.Linear(inner, hidden)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    held = {"now": 0, "peak": 0}

    class Saved:
        def __init__(self, tensor) -> None:
            # kept detached: a tensor an autograd node saves of its own output (relu's result)
            # holds that node as its grad_fn, so keeping the tensor itself here would make a
            # cycle (node -> its saved Saved -> tensor -> node) that autograd breaks only by
            # running the node with the graph released. The split backward's input pass keeps
            # the graph, and its weight pass never runs the nodes off the weights' paths: with
            # the tensor itself the cycle outlived the step and was counted as held
            self.tensor = tensor.detach()
            self.size = tensor.numel() * tensor.element_size()
            held["now"] += self.size
            held["peak"] = max(held["peak"], held["now"])
            weakref.finalize(self, _release, self.size)

    def _release(size: int) -> None:
        held["now"] -= size

    hooks = (lambda t: Saved(t), lambda saved: saved.tensor)
    parts = _time_the_step()
    torch.manual_seed(0)
    blocks = [Block() for _ in range(layers)]
    results = {}
    for schedule_name, v in schedules:
        stages = world_size * v
        # every stage its share of the blocks (stage_spans' cut, the layer specs less the
        # embedding, norm and head a model's stages would add)
        spans = [(start - (start > 0), stop - 1 if stop <= layers else layers)
                 for start, stop in stage_spans(layers, stages)]
        mine = stage_indices(rank, pipeline=world_size, virtual_stages=v, schedule=schedule_name)
        modules = {i: nn.Sequential(*blocks[spans[i][0]:spans[i][1]]) for i in mine}
        x = torch.randn(TOKENS, hidden)
        # one micro-batch's saved bytes through this rank's stages
        with torch.autograd.graph.saved_tensors_hooks(*hooks):
            held.update(now=0, peak=0)
            outs = [modules[i](x.clone().requires_grad_()) for i in mine]
            per_micro = held["now"]
            del outs
        results[(schedule_name, v, "per_micro")] = per_micro
        for m in micro_counts:
            pipeline_stages = [PipelineStage(modules[i], i, stages, torch.device("cpu"))
                               for i in mine]
            cls = get_schedule_class(SCHEDULE_CLASSES[schedule_name])
            single = issubclass(cls, PipelineScheduleSingle)
            schedule = cls(pipeline_stages[0] if single else pipeline_stages, n_microbatches=m,
                           loss_fn=lambda out, target: out.pow(2).mean())
            first = any(s.is_first for s in pipeline_stages)
            last = any(s.is_last for s in pipeline_stages)
            batch = torch.randn(m * TOKENS, hidden)

            def step():
                kwargs = {"target": torch.zeros(m * TOKENS, hidden)} if last else {}
                # return_outputs=False, as the run's driver: the last stage keeps no outputs
                # (whose graphs would hold every micro-batch's activations to the step's end)
                schedule.step(*((batch,) if first else ()), return_outputs=False, **kwargs)
                for module in modules.values():
                    module.zero_grad(set_to_none=True)

            step()  # warm-up (and torch's shape inference)
            records, peaks = [], []
            for _ in range(steps):
                torch.distributed.barrier()
                with torch.autograd.graph.saved_tensors_hooks(*hooks):
                    held.update(now=0, peak=0)
                    parts.clear()
                    start = time.perf_counter()
                    step()
                    records.append(dict(parts, step=time.perf_counter() - start))
                    peaks.append(held["peak"])
            results[(schedule_name, v, m)] = {"records": records, "peak": max(peaks)}
    parts.restore()
    return results


class _StepParts(dict):
    """Seconds a rank's pipelined step spends in each part, accumulated while the schedule runs
    (torch's own stages and schedule runtime, timed at their methods): the stages' compute
    (`forward`: the stage module's forward; `backward`, `input`, `weight`: the autograd calls
    of a full backward, a split backward's input pass and its weight pass; `loss`), `post`
    (posting sends and receives to gloo) and `wait` (blocked on a message). The rest of the
    step is the runtime's own work (`runtime`, derived). `restore()` puts torch's methods back."""

    def __init__(self) -> None:
        super().__init__()
        self._undo = []

    def wrap(self, owner, name: str, part) -> None:
        original = getattr(owner, name)
        parts = self

        def timed(*args, **kwargs):
            key = part(args, kwargs) if callable(part) else part
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                parts[key] = parts.get(key, 0.0) + time.perf_counter() - start
                parts[key + "_n"] = parts.get(key + "_n", 0) + 1

        setattr(owner, name, timed)
        self._undo.append((owner, name, original))

    def restore(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()


def _time_the_step() -> _StepParts:
    from torch.distributed.pipelining import schedules, stage

    parts = _StepParts()
    base = stage._PipelineStageBase
    parts.wrap(base, "forward_maybe_with_nosync", "forward")
    parts.wrap(base, "backward_maybe_with_nosync",
               lambda args, kwargs: {"full": "backward"}.get(args[1], args[1]))
    parts.wrap(schedules._PipelineSchedule, "_compute_loss", "loss")
    # module globals: the schedules call them by name
    parts.wrap(schedules, "_batch_p2p", "post")
    parts.wrap(schedules, "_wait_batch_p2p", "wait")
    return parts


COMPUTE = ("forward", "backward", "input", "weight", "loss")


def _calibrate_rank(rank: int, world_size: int, steps: int, layers: int) -> dict:
    """The CPU cluster's pipeline overheads, measured apart from the schedules they predict:
    gloo's one-way message time (a ping-pong of a 4-byte tensor, printed beside them), the
    split backward's extra per block (input and weight passes against a full backward, one
    process, nearly no work) and the parts of `CALIBRATION`'s steps over the bench's blocks at
    m = 6, a schedule and count no row uses (the step less the stages' compute and the waits,
    and the posts of its messages: the runtime's costs under the stages' real load, which
    stages of nearly no work understate by up to 5x on two shared cores and measure
    unsteadily). Torch's 1F1B (`Schedule1F1B`) is not its own action list's runtime, which
    every other schedule runs: its fixed cost barely grows with m."""
    import torch
    import torch.nn as nn
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    tiny = 16

    def ping_pong(tensor: torch.Tensor, rounds: int) -> float:
        """One way's seconds: the fastest of 3 tries of `rounds` round trips."""
        tries = []
        for _ in range(3):
            torch.distributed.barrier()
            start = time.perf_counter()
            for _ in range(rounds):
                if rank == 0:
                    torch.distributed.send(tensor, 1)
                    torch.distributed.recv(tensor, 1)
                else:
                    torch.distributed.recv(tensor, 0)
                    torch.distributed.send(tensor, 0)
            tries.append((time.perf_counter() - start) / (2 * rounds))
        return min(tries)

    one_way = ping_pong(torch.zeros(1), 200)
    # a stage boundary's message (TOKENS x HIDDEN fp32): its bytes' time beside the latency
    boundary = torch.zeros(TOKENS, HIDDEN)
    boundary_way = ping_pong(boundary, 50)

    blocks = layers // world_size

    def passes(hidden: int, inner: int, runs: int) -> dict:
        """Median seconds of a forward, a forward and full backward, and a forward and split
        backward (torch's input pass, then its weight pass) of one rank's blocks."""
        stage = nn.Sequential(*[nn.Sequential(nn.Linear(hidden, inner), nn.ReLU(),
                                              nn.Linear(inner, hidden)) for _ in range(blocks)])
        x0 = torch.randn(TOKENS, hidden)

        def forward():
            x = x0.clone().requires_grad_()
            return x, stage(x)

        def full():
            _, out = forward()
            out.backward(torch.ones_like(out))

        def split():
            x, out = forward()
            _, groups = stage_backward_input([out], [torch.ones_like(out)], [x],
                                             stage.parameters())
            stage_backward_weight(stage.parameters(), groups)

        timed = {}
        for name, fn in (("forward", forward), ("full", full), ("split", split)):
            for _ in range(3):
                fn()
            took = []
            for _ in range(runs):
                start = time.perf_counter()
                fn()
                took.append(time.perf_counter() - start)
            timed[name] = statistics.median(took)
        return timed

    small = passes(tiny, tiny, 50)  # nearly no work: the fixed part, per block
    split_per_block = (small["split"] - small["full"]) / blocks
    big = passes(HIDDEN, INNER, 15)  # the bench's blocks: the share of the backward's time
    backward = big["full"] - big["forward"]
    split_fraction = (big["split"] - big["full"] - blocks * split_per_block) / backward
    m = 6
    records = _schedule_rank(rank, world_size, [m], steps, layers,
                             schedules=(CALIBRATION,))[(*CALIBRATION, m)]["records"]
    return {"one_way": one_way, "boundary_way": boundary_way,
            "boundary_bytes": boundary.numel() * boundary.element_size(),
            "split_per_block": split_per_block, "split_fraction": split_fraction,
            "records": records, "m": m}


def _bench_rank(rank: int, world_size: int, micro_counts: list[int], steps: int,
                layers: int) -> dict:
    """The calibration and the schedules in one run, the same machine state for both: the
    calibration's steps (`CALIBRATION` at m = 6) run again after each schedule, all of them
    pooled (the runtime's costs follow the machine through the run, as the rows do)."""
    calibration = _calibrate_rank(rank, world_size, steps, layers)
    m = calibration["m"]
    results = {}
    for schedule in SCHEDULES:
        results.update(_schedule_rank(rank, world_size, micro_counts, steps, layers,
                                      schedules=(schedule,)))
        again = _schedule_rank(rank, world_size, [m], steps, layers, schedules=(CALIBRATION,))
        calibration["records"] += again[(*CALIBRATION, m)]["records"]
    results["calibration"] = calibration
    return results


def _per_step(ranks: list[list[dict]]) -> dict[str, list[float]]:
    """Each step's parts (seconds), the mean of the ranks' (the ranks' steps are the same steps:
    a barrier starts each): `step`, `compute` (the stages' work), `wait` (blocked on messages)
    and `overhead` (the rest: posting messages and the schedule runtime's own work)."""
    out: dict[str, list[float]] = {"step": [], "compute": [], "busiest": [], "wait": [],
                                   "overhead": [], "post": []}
    for records in zip(*ranks):
        step = statistics.fmean(r["step"] for r in records)
        computes = [sum(r.get(k, 0.0) for k in COMPUTE) for r in records]
        compute = statistics.fmean(computes)
        wait = statistics.fmean(r.get("wait", 0.0) for r in records)
        out["step"].append(step)
        out["compute"].append(compute)
        out["busiest"].append(max(computes))
        out["wait"].append(wait)
        out["overhead"].append(step - compute - wait)
        out["post"].append(statistics.fmean(r.get("post", 0.0) for r in records))
    return out


def _constants(calibrations: list[dict], layers: int) -> dict:
    """The CPU cluster's overhead constants (microseconds) from each rank's calibration, in the
    calibration schedule's steps (medians over the steps): the runtime's own work per entry of
    its action list (the step less its compute, its waits and its posts, over the m x
    (`pipeline_actions_per_micro_batch` + `pipeline_messages_per_micro_batch`) entries of a
    rank: torch lists each send and receive as an action of its own), which is the planner's
    cost per action, and a message's (its entry and its post to gloo: the posts' time over the
    m x `pipeline_messages_per_micro_batch` messages a rank posted); and the split backward's
    extra per block."""
    from pretrain.config import Recompute
    from pretrain.plan.clusters import COLLECTIVE_EFFICIENCY
    from pretrain.plan.step_time import (pipeline_actions_per_micro_batch,
                                         pipeline_messages_per_micro_batch)
    from pretrain.resolve.layout import Layout

    one_way = statistics.fmean(r["one_way"] for r in calibrations)
    split = statistics.fmean(r["split_per_block"] for r in calibrations)
    m = calibrations[0]["m"]
    name, v = CALIBRATION
    layout = Layout(pipeline=len(calibrations), global_batch=m, engine="fsdp2",
                    schedule=name, virtual_stages=v, recompute=Recompute.NONE)
    steps = _per_step([r["records"] for r in calibrations])
    overhead, post = statistics.median(steps["overhead"]), statistics.median(steps["post"])
    messages = m * pipeline_messages_per_micro_batch(layout)
    action = (overhead - post) / (m * pipeline_actions_per_micro_batch(layout) + messages)
    message = action + post / messages
    fraction = statistics.fmean(r["split_fraction"] for r in calibrations)
    boundary_way = statistics.fmean(r["boundary_way"] for r in calibrations)
    # a boundary's bytes over the link: the planner's intra-node bandwidth at its efficiency
    gbps = calibrations[0]["boundary_bytes"] / max(boundary_way - one_way, 1e-9) / 1e9 \
        / COLLECTIVE_EFFICIENCY
    return {"p2p_latency_us": message * 1e6, "ping_pong_us": one_way * 1e6,
            "pipeline_action_us": max(action, 0.0) * 1e6,
            "split_backward_layer_us": max(split, 0.0) * 1e6,
            "split_backward_fraction": max(fraction, 0.0), "intra_node_gbps": gbps,
            "calibration_step_ms": statistics.median(steps["step"]) * 1e3,
            "calibration_overhead_ms": overhead * 1e3, "calibration_post_ms": post * 1e3,
            "calibration_m": m}


def _calibrate(args) -> None:
    """Print the CPU cluster's overhead constants (`pretrain.plan.clusters.CPU_*_US`)."""
    with tempfile.TemporaryDirectory() as tmp:
        results = run_on_ranks(_calibrate_rank, world_size=2, tmp_path=Path(tmp),
                               timeout_s=1200, args=(args.steps, args.layers))
    c = _constants(results, args.layers)
    print(f"machine: {machine()}; 2 ranks x 1 thread, gloo; shared load")
    name, v = CALIBRATION
    print(f"gloo one-way message (4 bytes, ping-pong):    {c['ping_pong_us']:8.0f} us")
    print(f"{name} with {v} stages a rank, m={c['calibration_m']}, the bench's blocks: step "
          f"{c['calibration_step_ms']:.1f} ms, the runtime's part {c['calibration_overhead_ms']:.1f}"
          f" ms, of which posting messages {c['calibration_post_ms']:.1f} ms")
    print(f"runtime per action (the rest over its actions and messages): "
          f"{c['pipeline_action_us']:5.0f} us (CPU_PIPELINE_ACTION_US)")
    print(f"a message (its action and its post: the posts over its messages): "
          f"{c['p2p_latency_us']:5.0f} us (CPU_P2P_LATENCY_US)")
    print(f"split backward's extra per block:             {c['split_backward_layer_us']:8.0f} us "
          "(CPU_SPLIT_BACKWARD_LAYER_US)")
    print(f"split backward's extra share of the backward: {c['split_backward_fraction']:8.3f} "
          "   (CPU_SPLIT_BACKWARD_FRACTION)")
    print(f"a boundary's bytes ({TOKENS} x {HIDDEN} fp32) at: {c['intra_node_gbps']:8.2f} GB/s "
          "(CPU_INTRA_NODE_GBPS, at the planner's collective efficiency)")


def _schedules(args) -> None:
    import dataclasses

    from pretrain.config import Recompute
    from pretrain.plan.clusters import COLLECTIVE_EFFICIENCY, cpu_cluster
    from pretrain.plan.memory import micro_batches_in_flight
    from pretrain.plan.step_time import (pipeline_bubble_slots, pipeline_overhead,
                                         pipeline_p2p_bytes)
    from pretrain.resolve.layout import Layout
    from pretrain.testing.schedule_replay import replay

    pp = 2
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        results = run_on_ranks(_bench_rank, world_size=pp, tmp_path=Path(tmp),
                               timeout_s=1200, args=(args.micro_batches, args.steps, args.layers))
    constants = _constants([r.pop("calibration") for r in results], args.layers)
    # the planner's CPU cluster with this run's calibration (nothing of the schedules below)
    cluster = dataclasses.replace(
        cpu_cluster(nodes=1, ranks_per_node=pp, peak_tflops=1.0, memory_gb=16.0),
        **{k: constants[k] for k in ("p2p_latency_us", "pipeline_action_us",
                                     "split_backward_layer_us", "split_backward_fraction",
                                     "intra_node_gbps")})
    no_split = dataclasses.replace(cluster, split_backward_layer_us=0.0,
                                   split_backward_fraction=0.0)
    boundary = TOKENS * HIDDEN * 4
    print(f"machine: {machine()}; 2 ranks x 1 thread, gloo; load average (1 min) "
          f"{load:.1f} before the run, {os.getloadavg()[0]:.1f} after")
    print(f"model: {args.layers} residual MLP blocks (hidden {HIDDEN}, inner {INNER}), "
          f"{TOKENS} tokens a micro-batch, fp32, pp={pp}; m = {args.micro_batches}")
    print(f"calibration (same run; {CALIBRATION[0]} with {CALIBRATION[1]} stages a rank at m = "
          f"{constants['calibration_m']}, the runtime's part "
          f"{constants['calibration_overhead_ms']:.1f} ms of "
          f"{constants['calibration_step_ms']:.0f}, posts {constants['calibration_post_ms']:.1f}):"
          f" message {constants['p2p_latency_us']:.0f} us (ping-pong "
          f"{constants['ping_pong_us']:.0f}) + bytes at "
          f"{constants['intra_node_gbps']:.2f} GB/s, action "
          f"{constants['pipeline_action_us']:.0f} us, split backward "
          f"{constants['split_backward_layer_us']:.0f} us a block + "
          f"{constants['split_backward_fraction']:.3f} of the backward")
    print("per step (each the mean of the two ranks'): busy = the stages' compute, timed inside "
          "the step; bubble = 1 - busy / step (min-median over the steps); ideal = b / (m + b); "
          "planner = 1 - busy / (busiest (m + b) / m + pipeline_overhead + p2p bytes), at the "
          "median busy; ratio = median bubble / planner")
    print("the step's parts (medians, ms): wait = blocked on messages, overhead = the rest "
          "(posting messages, the runtime's work); planner's: overhead = m x its fixed costs a "
          "micro-batch + the bytes, wait = the b slots' busy and fixed costs")
    header = (f"{'schedule':<18}{'v':>2}{'m':>3}{'step':>7}{'busy':>7}{'bubble':>13}{'ideal':>7}"
              f"{'planner':>8}{'ratio':>7}{'overhead':>14}{'wait':>14}")
    print(header)
    rows = {}
    for name, v in SCHEDULES:
        for m in args.micro_batches:
            layout = Layout(pipeline=pp, global_batch=m, engine="fsdp2", schedule=name,
                            virtual_stages=v, recompute=Recompute.NONE)
            b = pipeline_bubble_slots(layout)
            parts = _per_step([r[(name, v, m)]["records"] for r in results])
            bubbles = sorted(1 - c / t for c, t in zip(parts["compute"], parts["step"]))
            busy = statistics.median(parts["compute"])
            busiest = statistics.median(parts["busiest"])
            # the split backward's extra work is in the measured busy (its passes' compute,
            # timed): the planner's fixed costs without it
            fixed = pipeline_overhead(layout, no_split, rank_layers=args.layers // pp,
                                      micro_batch_seconds=busy / m)
            sent = pipeline_p2p_bytes(layout, boundary) / (
                cluster.intra_node_gbps * 1e9 * COLLECTIVE_EFFICIENCY)
            predicted = busiest * (m + b) / m + fixed + sent
            planned = 1 - busy / predicted
            measured = statistics.median(bubbles)
            rows[(name, v, m)] = (measured, planned)
            per_slot = fixed / (m + b)
            overhead = (f"{statistics.median(parts['overhead']) * 1e3:.1f}/"
                        f"{(m * per_slot + sent) * 1e3:.1f}")
            wait = f"{statistics.median(parts['wait']) * 1e3:.1f}/{b * (busy / m + per_slot) * 1e3:.1f}"
            print(f"{name:<18}{v:>2}{m:>3}{statistics.median(parts['step']) * 1e3:>7.0f}"
                  f"{busy * 1e3:>7.0f}{f'{bubbles[0]:.3f}-{measured:.3f}':>13}"
                  f"{b / (m + b):>7.3f}{planned:>8.3f}{measured / planned:>7.2f}"
                  f"{overhead:>14}{wait:>14}")
    within = sum(0.8 <= measured / planned <= 1.2 for measured, planned in rows.values())
    print(f"within 20%: {within} of {len(rows)}")
    m_top = max(args.micro_batches)
    print(f"micro-batches in flight at m = {m_top} (measured peak saved bytes over one "
          "micro-batch's; planner; torch's action lists replayed), ranks 0/1:")
    for name, v in SCHEDULES:
        layout = Layout(pipeline=pp, global_batch=m_top, engine="fsdp2", schedule=name,
                        virtual_stages=v, recompute=Recompute.NONE)
        flight = [r[(name, v, m_top)]["peak"] / r[(name, v, "per_micro")] for r in results]
        planned_flight = [micro_batches_in_flight(layout, rank) for rank in range(pp)]
        replayed = (replay(name, pipeline=pp, virtual_stages=v, micro_batches=m_top)
                    .peak_in_flight if name != "1f1b" else planned_flight)
        print(f"{name:<18}{v:>2}{'/'.join(f'{f:.2f}' for f in flight):>12}"
              f"{'/'.join(f'{f:.1f}' for f in planned_flight):>10}"
              f"{'/'.join(f'{f:.1f}' for f in replayed):>10}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--schedules", action="store_true",
                        help="fsdp2's schedules (torch.distributed.pipelining) against the planner")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure the CPU cluster's pipeline overheads (the planner's "
                        "CPU_P2P_LATENCY_US, CPU_PIPELINE_ACTION_US, CPU_SPLIT_BACKWARD_LAYER_US)")
    args = parser.parse_args()
    if args.calibrate:
        args.steps = args.steps or 10
        _calibrate(args)
        return
    if args.schedules:
        args.micro_batches = args.micro_batches or [4, 8]
        args.steps = args.steps or 15  # 7 steps' medians moved rows by 20% between runs
        _schedules(args)
        return
    args.micro_batches = args.micro_batches or [1, 2, 4, 8]
    args.steps = args.steps or 5
    with tempfile.TemporaryDirectory() as tmp:
        results = run_on_ranks(_rank, world_size=2, tmp_path=Path(tmp), timeout_s=1200,
                               args=(args.micro_batches, args.steps, args.layers))
    times = {m: max(r[m] for r in results) for m in args.micro_batches}  # the slower stage
    ms = list(times)
    mean_m, mean_t = statistics.fmean(ms), statistics.fmean(times.values())
    slope = sum((m - mean_m) * (times[m] - mean_t) for m in ms) / sum((m - mean_m) ** 2 for m in ms)
    p = 2
    print(f"machine: {machine()}; 2 ranks x 1 thread, gloo")
    print(f"model: preset small with {args.layers} layers, seq 128, micro-batch {MICRO}, fp32, "
          f"pp=2 (uniform split), ZeRO-0; slot time (slope) {slope * 1e3:.0f} ms")
    print(f"{'m':>3} {'step time':>10} {'measured bubble':>16} {'1F1B theory':>12}")
    for m in ms:
        measured = 1.0 - m * slope / times[m]
        print(f"{m:>3} {times[m] * 1e3:>8.0f}ms {measured:>16.3f} {(p - 1) / (m + p - 1):>12.3f}")


if __name__ == "__main__":
    main()
