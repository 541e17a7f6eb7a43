"""Every gradient reduction torch.distributed runs, recorded: which group, what it reduced.

The expert tests name the group of each reduction (an expert's gradient over the ranks holding
the same experts, the router's over the tensor group, the rest over the data group) by wrapping
torch.distributed's reducing collectives for one step of a real engine.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

# reduce_scatter_single: torch 2.13's name of reduce_scatter_tensor, which FSDP2 calls
REDUCTIONS = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter",
              "reduce", "all_reduce_coalesced")


@contextlib.contextmanager
def recorded_reductions(describe: Callable[[str, tuple[int, ...], Any], Any]) -> Iterator[list]:
    """Inside: each reduction of `REDUCTIONS` runs as before and `describe(op, ranks of its
    group, the tensor it reduces)` is appended to the yielded list, in order."""
    import torch.distributed as dist

    seen: list = []
    originals = {op: getattr(dist, op) for op in REDUCTIONS}

    def recording(op):
        def reduce(*args, **kwargs):
            tensor = kwargs.get("tensor", args[0] if args else None)
            if op in ("reduce_scatter_tensor", "reduce_scatter_single"):
                tensor = kwargs.get("input", args[1] if len(args) > 1 else None)
            group = tuple(dist.get_process_group_ranks(kwargs.get("group") or
                                                       dist.group.WORLD))
            seen.append(describe(op, group, tensor))
            return originals[op](*args, **kwargs)
        return reduce

    for op in REDUCTIONS:
        setattr(dist, op, recording(op))
    try:
        yield seen
    finally:
        for op, function in originals.items():
            setattr(dist, op, function)
