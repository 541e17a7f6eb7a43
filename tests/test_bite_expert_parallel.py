"""Expert parallelism's maths in the quick tier: one MoE layer on 2 gloo ranks (the all-to-all
dispatch, its backward, the gathered output's gradient, the auxiliary losses' gradient) against
the single-process layer. tests/test_expert_parallel.py runs the same check, with and without
sequence parallelism, and the training runs, in the slow tier."""
from __future__ import annotations

from pretrain.testing.ranks import run_on_ranks
from tests.test_expert_parallel import _layer_on_ranks


def test_one_expert_parallel_layer_on_two_ranks_equals_one_process(tmp_path):
    names = run_on_ranks(_layer_on_ranks, world_size=2, tmp_path=tmp_path, args=(False,))
    assert names == [["0", "1"], ["2", "3"]]
