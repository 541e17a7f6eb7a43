"""FSDP2's checkpoint rows where the rows do not divide evenly over the ranks (the tiny model's
do): each rank's piece starts where torch.chunk's split puts it."""
from __future__ import annotations

from pretrain.testing.ranks import run_on_ranks


def _first_rows(rank: int, world_size: int) -> list[tuple[int, int]]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from pretrain.training.fsdp2 import _first_row, _local

    mesh = init_device_mesh("cpu", (world_size,))
    found = []
    for rows in (3, 5, 8):
        full = torch.arange(rows * 2, dtype=torch.float32).view(rows, 2)
        piece = distribute_tensor(full, mesh, [Shard(0)])
        start = _first_row(piece)
        local = _local(piece)
        assert torch.equal(full[start:start + local.shape[0]], local), (rows, start)
        found.append((rows, start))
    return found


def test_each_ranks_piece_starts_at_its_row_when_the_rows_do_not_divide(tmp_path):
    starts = run_on_ranks(_first_rows, world_size=2, tmp_path=tmp_path)
    assert starts == [[(3, 0), (5, 0), (8, 0)], [(3, 2), (5, 3), (8, 4)]]
