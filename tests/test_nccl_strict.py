"""`pretrain.testing.nccl_strict`: CPU ranks refuse, as NCCL does on GPUs, a collective handed a
tensor that lives in host memory there - and the offloading engines, run under it, send none.

The harness itself on 2 gloo ranks: a watched tensor (or a view of it) is refused on the world
and on a group made without a backend, naming the group and the tensor; a copy of it passes, and
so does the watched tensor on the I/O group and on a group made with backend "gloo" (both gloo
on GPUs too). Then the engines: fsdp2 under CPUOffloadPolicy at tensor 2 x data 2 with sequence
parallelism (the norms' gradient shards summed over the tensor group at the step's end) and
DeepSpeed's ZeRO-3 with its optimizer offloaded, a step each under the harness, with the fsdp2
step's gradient norm and updated norm weights against the same step without offload.
"""
from __future__ import annotations

import pytest
import torch

from pretrain.testing.ranks import run_on_ranks
from pretrain.testing.runs import REPO


def _harness(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from pretrain import dist as pretrain_dist
    from pretrain.testing.nccl_strict import HostTensorInCollective, nccl_strict

    shard = torch.ones(8)
    outcome = {}
    with nccl_strict() as strict:
        strict.watch(lambda: [("the offloaded shard", shard)])
        nccl_like = dist.new_group([0, 1])
        gloo = dist.new_group([0, 1], backend="gloo")
        for name, call in (
                ("world", lambda: dist.all_reduce(shard)),
                ("view", lambda: dist.all_reduce(shard[2:6])),
                ("group", lambda: dist.all_reduce(shard, group=nccl_like)),
                ("list", lambda: dist.all_gather([torch.empty(8), torch.empty(8)], shard)),
                ("copy", lambda: dist.all_reduce(shard.clone())),
                ("io", lambda: dist.all_reduce(shard, group=pretrain_dist._IO_GROUP)),
                ("gloo", lambda: dist.broadcast(shard, src=0, group=gloo))):
            try:
                call()
                outcome[name] = "sent"
            except HostTensorInCollective as refused:
                outcome[name] = str(refused)
    outcome["after"] = dist.all_reduce(shard) is None  # the wrappers are gone
    return outcome


def test_a_host_tensor_is_refused_on_the_groups_that_are_nccl_on_gpus(tmp_path):
    for outcome in run_on_ranks(_harness, world_size=2, tmp_path=tmp_path):
        for name, shape in (("world", 8), ("view", 4), ("group", 8), ("list", 8)):
            assert f"handed the offloaded shard ({shape},) torch.float32" in outcome[name], outcome
            assert "lives in host memory" in outcome[name] and "ranks 0, 1" in outcome[name]
        assert [outcome[n] for n in ("copy", "io", "gloo")] == ["sent"] * 3, outcome
        assert outcome["after"]


def _engine_step(rank: int, world_size: int, ds_name: str, overrides: list[str],
                 run_dir: str) -> dict:
    """One step of the tiny model's engine (`build_engine`, as a run builds it) from
    ds_configs/<ds_name>.json, each data rank its own batch, under `nccl_strict` watching the
    engine's host-resident tensors; the norm, the final norm's weight after the update, and
    the number of collectives checked."""
    from pretrain.config import Engine, load_config
    from pretrain.dist import init_deepspeed_comm
    from pretrain.model import canonical_parameters
    from pretrain.resolve.run import resolve_ds_config
    from pretrain.resolve.topology import Topology
    from pretrain.testing.nccl_strict import deepspeed_host_tensors, nccl_strict
    from pretrain.training import collective_log
    from pretrain.training.engine import build_engine
    from pretrain.training.fsdp2 import _local

    cfg = load_config(REPO / "configs/tiny.yaml", [
        f"deepspeed={REPO}/ds_configs/{ds_name}.json", "model.vocab_size=512",
        "train.micro_batch_size=1", f"run_dir={run_dir}", *overrides])
    log = collective_log.CollectiveLog(size=4096)
    collective_log.install(log)  # as `train` does: the hang dumps name FSDP2's collectives too
    init_deepspeed_comm(dist_backend="gloo", verbose=False)
    ds_config = resolve_ds_config(cfg, world_size=world_size)
    groups = Topology.from_parallel_config(cfg.parallel, world_size=world_size,
                                           rank=rank).create_groups()
    engine = build_engine(cfg, ds_config, groups, main=False)
    fsdp2 = cfg.train.engine is Engine.FSDP2
    data_rank = groups.topology.my_coords.data
    with nccl_strict() as strict:
        strict.watch(engine.host_resident_tensors if fsdp2 else deepspeed_host_tensors(engine))
        for micro in range(engine.gradient_accumulation_steps()):
            ids = torch.randint(0, 512, (1, 33),
                                generator=torch.Generator().manual_seed(10 * data_rank + micro))
            engine.backward(engine(ids[:, :-1], labels=ids[:, 1:]))
            engine.step()
    norm = dict(canonical_parameters(engine.module, cfg.model))["model.norm.weight"]
    return {"grad_norm": engine.get_global_grad_norm(), "checked": strict.checked,
            "ops": sorted({entry[1] for entry in log.entries if entry is not None}),
            "norm": _local(norm.detach()).clone() if fsdp2 else None}


TP2_SP = ["train.engine=fsdp2", "parallel.tensor=2", "parallel.sequence_parallel=true",
          "train.global_batch_size=4"]


def test_fsdp2_offload_with_sequence_parallelism_sends_no_host_tensor(tmp_path):
    """fsdp2, tensor 2 x data 2, sequence parallel, 2 micro-batches, CPU offload: no host
    shard or gradient reaches a collective on the tensor or data group, and the step equals
    the one without offload (norm and updated weights: the norms' gradient sums are the same)."""
    results = {}
    for ds_name in ("zero3_offload_cpu", "zero3"):
        results[ds_name] = run_on_ranks(_engine_step, world_size=4, tmp_path=tmp_path,
                                        args=(ds_name, TP2_SP, str(tmp_path / ds_name)))
    for offloaded, on_device in zip(results["zero3_offload_cpu"], results["zero3"]):
        assert offloaded["checked"] > 10, offloaded  # FSDP2's all-gathers, reduce-scatters...
        # ... which the collective log (the hang dumps, the straggler's wait) records as well
        assert {"all_gather_single", "reduce_scatter_single"} <= set(offloaded["ops"]), offloaded
        assert offloaded["grad_norm"] == pytest.approx(on_device["grad_norm"], rel=1e-6)
        assert torch.allclose(offloaded["norm"], on_device["norm"], rtol=0, atol=1e-7)


@pytest.mark.slow
def test_deepspeed_zero3_with_its_optimizer_offloaded_sends_no_host_tensor(tmp_path):
    """ZeRO-3 at data 2, its optimizer on the CPU: DeepSpeed's gradient reduce-scatters,
    all-gathers and norm go through device buffers, never its host partitions."""
    for result in run_on_ranks(_engine_step, world_size=2, tmp_path=tmp_path, timeout_s=300,
                               args=("zero3_offload_cpu", ["train.global_batch_size=2"],
                                     str(tmp_path / "ds"))):
        assert result["checked"] > 10 and result["grad_norm"] > 0, result
