"""Every distinct rank of a run built on the meta device, against the planner (`plan --build`).

A run's ranks differ only by (pipeline stage, tensor-parallel rank): data-parallel replicas
build the same module. For each distinct one this joins a fake process group of the run's world
size as that rank (torch's "fake" backend: every collective returns at once, nothing is
connected), creates the run's process groups, and constructs the rank's module through
`model.construct_for_layout` under `torch.device("meta")`: the real model code and DeepSpeed's
`PipelineModule` (its partitioning included), with no memory allocated. The parameters it holds
must be the planner's `arithmetic.stage_parameters`; the 128 ranks of the 70B recipe take
seconds, so a cluster job checks them before it queues.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import time
from dataclasses import dataclass
from typing import Iterator
from unittest import mock

import torch
import torch.distributed as dist

from pretrain.arithmetic import stage_items, stage_parameters
from pretrain.config import RunConfig
from pretrain.dist import init_deepspeed_comm
from pretrain.errors import ConfigError
from pretrain.model.build import construct_for_layout
from pretrain.resolve.run import ResolvedRun


@dataclass(frozen=True)
class RankBuild:
    """One distinct rank built on the meta device."""

    rank: int
    stage: int
    tensor_rank: int
    built: int  # parameters its module holds (before ZeRO sharding)
    planned: int  # arithmetic.stage_parameters for its stage
    seconds: float

    @property
    def matches(self) -> bool:
        return self.built == self.planned

    def to_dict(self) -> dict:
        return {"rank": self.rank, "stage": self.stage, "tensor_rank": self.tensor_rank,
                "built": self.built, "planned": self.planned, "seconds": round(self.seconds, 3)}


def build_distinct_ranks(run: ResolvedRun) -> list[RankBuild]:
    """Build every (stage, tensor rank) of the resolved `run` (data replica 0) on the meta
    device; raises ConfigError naming the first rank whose module differs from the plan."""
    cfg, layout, topology = run.cfg, run.layout, run.topology
    world_size = topology.world_size
    items = stage_items(cfg.model, layout)
    builds = []  # DeepSpeed's messages (op builds, its partition table) would spoil --json
    for stage in range(layout.pipeline):
        for tensor_rank in range(layout.tensor):
            rank = topology.rank_of(tensor=tensor_rank, data=0, pipeline=stage)
            start = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()), _fake_world(rank, world_size):
                groups = dataclasses.replace(topology, rank=rank).create_groups()
                built = _meta_parameters(cfg, groups)
            builds.append(RankBuild(rank=rank, stage=stage, tensor_rank=tensor_rank, built=built,
                                    planned=stage_parameters(cfg.model, layout, items[stage]),
                                    seconds=time.perf_counter() - start))
    wrong = next((b for b in builds if not b.matches), None)
    if wrong is not None:
        raise ConfigError(f"rank {wrong.rank} (pipeline stage {wrong.stage}, tensor rank "
                          f"{wrong.tensor_rank}) builds {wrong.built:,} parameters, the planner "
                          f"expects {wrong.planned:,}: the model code and the planner disagree")
    return builds


def _meta_parameters(cfg: RunConfig, groups) -> int:
    """Parameters of this rank's module, constructed on the meta device."""
    from deepspeed.pipe import PipelineModule

    # PipelineModule moves itself to the accelerator at the end of its constructor: on the meta
    # device there is nothing to move.
    with torch.device("meta"), mock.patch.object(PipelineModule, "to", lambda self, *a, **k: self):
        module = construct_for_layout(cfg, groups)
    return sum(p.numel() for p in module.parameters())


@contextlib.contextmanager
def _fake_world(rank: int, world_size: int) -> Iterator[None]:
    """This process as `rank` of a fake `world_size`-rank process group (and DeepSpeed's comm
    over it) until the block ends."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the meta build needs a process without a process group")
    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0",
           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    with mock.patch.dict(os.environ, env):
        dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
        try:
            init_deepspeed_comm(dist_backend="gloo", verbose=False)
            yield
        finally:
            dist.destroy_process_group()


def format_builds(builds: list[RankBuild]) -> str:
    """One line per stage: its tensor ranks' parameters, planned, time."""
    lines = ["meta-device build of every distinct rank (stage x tensor rank; data replicas "
             "are the same):"]
    for stage in sorted({b.stage for b in builds}):
        row = [b for b in builds if b.stage == stage]
        built = sorted({b.built for b in row})
        lines.append(f"  stage {stage}: {len(row)} tensor rank(s) x "
                     f"{', '.join(f'{n:,}' for n in built)} parameters (planned "
                     f"{row[0].planned:,}) | {'ok' if all(b.matches for b in row) else 'MISMATCH'}"
                     f" | {sum(b.seconds for b in row):.1f}s")
    return "\n".join(lines)
