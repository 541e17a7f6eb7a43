"""Replay `torch.distributed.pipelining`'s own schedules without running them: the action lists
its interleaved schedule classes compute (`pipeline_order`: per rank, forwards, input and weight
backwards, full backwards, DualPipeV's overlapped pairs), executed in order on each rank with
each action's cost and the dependencies between stages, to give the step's length (so its
bubble) and each rank's peak micro-batches in flight. The planner's formulas
(`pretrain.plan.step_time.pipeline_bubble_slots`, `pretrain.plan.memory.micro_batches_in_flight`)
are checked against it (`tests/test_plan_pipelines.py`), and `bench/pipeline_bubble.py` sets it
beside measured steps.

The schedules are built on stand-in stages (`_Stage`: the attributes the constructors read);
nothing is sent, no process group is made. `Schedule1F1B` (one stage a rank) has no action list:
1F1B's fill and drain are pp - 1 slots, its peak pp - rank micro-batches (Narayanan et al.).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn
from torch.distributed.pipelining import schedules as torch_schedules

from pretrain.arithmetic import stage_indices

# parallel.pipeline_schedule -> the class whose pipeline_order is replayed
REPLAYED = {"interleaved_1f1b": torch_schedules.ScheduleInterleaved1F1B,
            "zero_bubble": torch_schedules.ScheduleInterleavedZeroBubble,
            "zbv": torch_schedules.ScheduleZBVZeroBubble,
            "dualpipe_v": torch_schedules.ScheduleDualPipeV}

_KEY = {"FORWARD": "F", "BACKWARD_INPUT": "B", "FULL_BACKWARD": "B", "BACKWARD_WEIGHT": "W"}


class _Stage:
    """What the schedules' constructors read of a `PipelineStage`."""

    def __init__(self, index: int, rank: int, pipeline: int, stages: int) -> None:
        self.stage_index, self.group_rank, self.group_size = index, rank, pipeline
        self.num_stages, self.is_first, self.is_last = stages, index == 0, index == stages - 1
        self.submod = nn.Linear(1, 1)
        self.has_backward = True
        self.stage_index_to_group_rank: dict[int, int] = {}


@dataclass
class Replay:
    """One step of a schedule, replayed: its length, each rank's busy time and peak micro-batches
    in flight (in units of one micro-batch through all of a rank's stages)."""

    span: float
    busy: list[float]
    peak_in_flight: list[float]

    @property
    def bubble_slots(self) -> float:
        """The step's length less a rank's work, in micro-batch slots (forward and backward of
        one micro-batch through the rank's stages: 3 of the unit costs)."""
        return (self.span - max(self.busy)) / 3.0


def pipeline_order(schedule: str, *, pipeline: int, virtual_stages: int, micro_batches: int):
    """torch's `pipeline_order` of `schedule` (rank -> actions, None for an idle slot)."""
    stages = pipeline * virtual_stages
    mine = stage_indices(0, pipeline=pipeline, virtual_stages=virtual_stages, schedule=schedule)
    built = REPLAYED[schedule]([_Stage(i, 0, pipeline, stages) for i in mine],
                               n_microbatches=micro_batches, loss_fn=lambda out, target: out)
    return built.pipeline_order


def replay(schedule: str, *, pipeline: int, virtual_stages: int, micro_batches: int,
           weight_share: float = 0.5) -> Replay:
    """Run `schedule`'s actions: a stage's forward costs 1 / v (a micro-batch through all v of a
    rank's stages costs 1 forward), its input backward and weight backward (1 - weight_share)
    and weight_share of 2 / v (a full backward 2 / v: each of its matmuls' two gradient
    products costs a forward's). An action waits for its rank's previous
    one and for the actions it needs (a forward: the previous stage's; a backward: the next
    stage's backward and its own forward; a weight backward: its input backward). A stage's
    micro-batch counts in flight from its forward to its weight gradients."""
    v = virtual_stages
    order = pipeline_order(schedule, pipeline=pipeline, virtual_stages=v,
                           micro_batches=micro_batches)
    stages = pipeline * v
    cost = {"F": 1.0 / v, "B": 2.0 * (1 - weight_share) / v, "W": 2.0 * weight_share / v}
    queue = {r: [a for a in order[r] if a is not None and (
        a.computation_type.name in _KEY or a.computation_type.name == "OVERLAP_F_B")]
        for r in range(pipeline)}
    done: dict[tuple[str, int, int], float] = {}
    clock, busy = [0.0] * pipeline, [0.0] * pipeline
    held, peak = [0] * pipeline, [0] * pipeline
    position = [0] * pipeline

    def needs(kind: str, stage: int, micro: int) -> list[tuple[str, int, int]]:
        if kind == "F":
            return [("F", stage - 1, micro)] if stage else []
        if kind == "B":
            return [("F", stage, micro)] + ([("B", stage + 1, micro)] if stage < stages - 1
                                            else [])
        return [("B", stage, micro)]

    moved = True
    while moved:
        moved = False
        for r in range(pipeline):
            while position[r] < len(queue[r]):
                action = queue[r][position[r]]
                parts = (action.sub_actions if action.computation_type.name == "OVERLAP_F_B"
                         else [action])
                steps = [(a.computation_type.name, a.stage_index, a.microbatch_index)
                         for a in parts]
                waits = [w for name, s, i in steps for w in needs(_KEY[name], s, i)]
                if any(w not in done for w in waits):
                    break
                start = max([clock[r]] + [done[w] for w in waits])
                took = sum(cost[_KEY[name]] + (cost["W"] if name == "FULL_BACKWARD" else 0.0)
                           for name, _, _ in steps)
                end = start + took
                for name, s, i in steps:
                    done[(_KEY[name], s, i)] = end
                    if name == "FULL_BACKWARD":
                        done[("W", s, i)] = end
                    held[r] += 1 if name == "FORWARD" else (
                        -1 if name in ("FULL_BACKWARD", "BACKWARD_WEIGHT") else 0)
                    peak[r] = max(peak[r], held[r])
                busy[r] += took
                clock[r] = end
                position[r] += 1
                moved = True
    if any(position[r] < len(queue[r]) for r in range(pipeline)):
        raise RuntimeError(f"{schedule}: the replay stalled (an action waits for one never run)")
    return Replay(span=max(clock), busy=busy, peak_in_flight=[p / v for p in peak])
