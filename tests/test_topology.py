"""The rank grid: arithmetic against DeepSpeed's own topology, the worked example in the module
docstring, validation, and the process groups / `mpu` adapter on 4 real ranks."""
from __future__ import annotations

import doctest
import itertools

import pytest
import torch.distributed as dist

import pretrain.resolve.topology
from pretrain.testing.ranks import run_on_ranks
from pretrain.config import ParallelConfig
from pretrain.errors import ConfigError
from pretrain.resolve.topology import RankCoords, Topology

SHAPES = [  # (tensor, pipeline, data)
    (1, 1, 4), (2, 1, 2), (1, 2, 3), (2, 2, 2), (4, 2, 3), (8, 4, 2), (2, 2, 4), (3, 1, 1)]


@pytest.mark.parametrize("tp,pp,dp", SHAPES)
def test_rank_order_equals_deepspeed_pipe_model_data_topology(tp, pp, dp):
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    ours = Topology(tensor=tp, pipeline=pp, world_size=tp * pp * dp)
    theirs = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    assert ours.data == dp
    for rank in range(ours.world_size):
        c = theirs.get_coord(rank)
        assert ours.coords(rank) == RankCoords(tensor=c.model, data=c.data, pipeline=c.pipe)
        assert ours.rank_of(tensor=c.model, data=c.data, pipeline=c.pipe) == rank
    assert ours.tensor_groups() == theirs.get_axis_comm_lists("model")
    assert ours.data_groups() == theirs.get_axis_comm_lists("data")
    assert ours.pipeline_groups() == theirs.get_axis_comm_lists("pipe")
    # DeepSpeed's PipelineParallelGrid: one model-parallel group per data index
    assert ours.model_groups() == [sorted(theirs.get_axis_list("data", d)) for d in range(dp)]
    assert ours.deepspeed_topology().mapping == theirs.mapping


@pytest.mark.parametrize("tp,pp,dp", SHAPES)
def test_groups_partition_the_world(tp, pp, dp):
    topo = Topology(tensor=tp, pipeline=pp, world_size=tp * pp * dp)
    world = list(range(topo.world_size))
    for groups, size in ((topo.tensor_groups(), tp), (topo.data_groups(), dp),
                         (topo.pipeline_groups(), pp), (topo.model_groups(), tp * pp)):
        assert sorted(itertools.chain.from_iterable(groups)) == world
        assert all(len(g) == size for g in groups)
    for rank in world:
        me = topo.coords(rank)
        tp_group = next(g for g in topo.tensor_groups() if rank in g)
        assert tp_group[me.tensor] == rank  # position in the group = coordinate
        assert all(topo.coords(r).data == me.data and topo.coords(r).pipeline == me.pipeline
                   for r in tp_group)
    # TP innermost: each tensor group is a run of consecutive ranks (one node's GPUs)
    assert all(g == list(range(g[0], g[0] + tp)) for g in topo.tensor_groups())


def test_docstring_example_is_what_the_code_computes():
    result = doctest.testmod(pretrain.resolve.topology, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 6 and result.failed == 0
    topo = Topology(tensor=2, pipeline=2, world_size=16)
    doc = pretrain.resolve.topology.__doc__
    for groups in (topo.tensor_groups(), topo.data_groups(), topo.pipeline_groups(),
                   topo.model_groups()):
        assert str(groups) in doc


@pytest.mark.parametrize("kwargs,match", [
    (dict(tensor=4, pipeline=2, world_size=12), "multiple of 8"),
    (dict(tensor=3, pipeline=1, world_size=4), "not divisible"),
    (dict(tensor=0, pipeline=1, world_size=4), "tensor=0"),
    (dict(tensor=1, pipeline=1, world_size=4, rank=4), "outside"),
])
def test_bad_shapes_are_config_errors_naming_the_fix(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Topology(**kwargs)


def test_from_parallel_config():
    topo = Topology.from_parallel_config(ParallelConfig(tensor=2, pipeline=2), world_size=8,
                                         rank=5)
    assert (topo.tensor, topo.pipeline, topo.data) == (2, 2, 2)
    assert topo.my_coords == RankCoords(tensor=1, data=0, pipeline=1)


def _check_groups(rank: int, world_size: int) -> None:
    for tp, pp in ((2, 2), (2, 1)):
        topo = Topology(tensor=tp, pipeline=pp, world_size=world_size, rank=rank)
        groups = topo.create_groups()
        mpu = groups.mpu
        expected = {"tensor": topo.tensor_groups(), "data": topo.data_groups(),
                    "pipeline": topo.pipeline_groups(), "model": topo.model_groups()}
        for kind, lists in expected.items():
            mine = next(g for g in lists if rank in g)
            assert dist.get_process_group_ranks(getattr(groups, kind)) == mine, (tp, pp, kind)
        me = topo.my_coords
        assert mpu.get_tensor_model_parallel_rank() == dist.get_rank(groups.tensor) == me.tensor
        assert mpu.get_data_parallel_rank() == dist.get_rank(groups.data) == me.data
        assert mpu.get_pipe_parallel_rank() == dist.get_rank(groups.pipeline) == me.pipeline
        assert mpu.get_model_parallel_rank() == dist.get_rank(groups.model)
        assert mpu.get_tensor_model_parallel_world_size() == tp
        assert mpu.get_data_parallel_world_size() == dist.get_world_size(groups.data)
        assert mpu.get_model_parallel_world_size() == tp * pp
        assert mpu.get_data_parallel_group_ranks() == next(
            g for g in topo.data_groups() if rank in g)
        assert mpu.get_tensor_model_parallel_src_rank() == next(
            g for g in topo.tensor_groups() if rank in g)[0]
        assert mpu.get_slice_parallel_group() is groups.tensor
        assert not hasattr(mpu, "get_sequence_parallel_world_size")  # Ulysses mode stays off


def test_create_groups_and_mpu_on_four_ranks(tmp_path):
    run_on_ranks(_check_groups, world_size=4, tmp_path=tmp_path)


@pytest.mark.parametrize("local_rank, visible, index", [(3, 8, 3), (3, 1, 0), (5, 4, 1), (0, 1, 0)])
def test_device_index_with_all_gpus_or_one_gpu_per_task(local_rank, visible, index):
    """Slurm's one-GPU-per-task binding leaves each rank one visible device: index 0."""
    from pretrain.dist import device_index

    assert device_index(local_rank, visible) == index


def test_no_visible_device_is_an_error():
    from pretrain.dist import device_index

    with pytest.raises(RuntimeError, match="sees no accelerator device"):
        device_index(2, 0)


def _wait_for_slow_rank0(rank: int, world_size: int) -> float:
    import datetime
    import time

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout

    from pretrain.dist import create_io_group, wait_for_io

    create_io_group(timeout_minutes=1)
    dist.barrier()  # the ranks start together; from here the default group's timeout is 3 s
    _set_pg_timeout(datetime.timedelta(seconds=3), dist.group.WORLD)
    start = time.monotonic()
    if rank == 0:
        time.sleep(6)  # rank 0's file work (a sample index, a checkpoint's pruning), 2x the timeout
    wait_for_io()
    waited = time.monotonic() - start
    _set_pg_timeout(datetime.timedelta(seconds=120), dist.group.WORLD)  # the closing barrier's
    return waited


def test_ranks_wait_for_rank0_file_work_beyond_the_collective_timeout(tmp_path):
    """The default group's timeout is 3 s while rank 0 works: rank 1 waits about 6 s for rank 0
    on the io group. The ranks start and end under a generous timeout (a rank can start seconds
    after its peer on a loaded machine); only the wait itself runs under the short one.

    Rank 1 starts its clock when it leaves the barrier, which can be a little after rank 0 does;
    what matters is that it waited well past the 3 s timeout without failing.
    """
    waited = run_on_ranks(_wait_for_slow_rank0, world_size=2, tmp_path=tmp_path, timeout_s=120)
    assert waited[1] >= 4.5, waited


def _file_work_without_the_io_group(rank: int, world_size: int) -> bool:
    from pretrain import dist as pretrain_dist

    pretrain_dist._IO_GROUP = None  # a process that never called create_io_group
    with pytest.raises(RuntimeError, match="no I/O process group"):
        pretrain_dist.wait_for_io()
    with pytest.raises(RuntimeError, match="call pretrain.dist.create_io_group"):
        pretrain_dist.gather_for_io(rank)
    return True


def test_file_work_waits_never_fall_back_to_the_default_group(tmp_path):
    """Without the I/O group a wait for one rank's file work is an error, not a barrier on the
    default group (whose timeout, NCCL's watchdog on GPUs, would abort a long wait)."""
    assert run_on_ranks(_file_work_without_the_io_group, world_size=2,
                        tmp_path=tmp_path) == [True, True]
