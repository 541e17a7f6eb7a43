"""CPU ranks held to what NCCL takes: a collective on a group that is NCCL on GPUs refuses a
tensor that would live in host memory there.

On a GPU node the default group and every group made without a backend are NCCL, which moves
device memory only: a host tensor handed to it fails at the first step ("No backend type
associated with device type cpu"). On CPU ranks every group is gloo and every tensor is a host
tensor, so a collective over offloaded state passes every CPU test and fails on the first GPU.

    with nccl_strict() as strict:
        strict.watch(engine.host_resident_tensors)  # (label, tensor) of what lives on the host
        engine.backward(loss); engine.step()        # HostTensorInCollective if one is sent

Which tensors would be host-resident is the engine's own knowledge, asked at every collective
(gradients come and go each step): `FSDP2Engine.host_resident_tensors` under CPUOffloadPolicy,
`deepspeed_host_tensors` for DeepSpeed's offloaded optimizer. A tensor is refused when it shares
a storage with one of them (a view of an offloaded shard is one); a copy (`torch.cat`,
`.to(device, copy=True)`) is a new storage, which on a GPU is device memory.

Allowed: the groups that are gloo on GPUs too - the I/O group (`pretrain.dist.create_io_group`)
and any group made with backend "gloo" inside the block.

The wrapper sits on `torch.distributed`'s collectives (`collective_log.OPS`, FSDP2's
`all_gather_single` and `reduce_scatter_single` among them, plus `MORE_OPS`:
`all_gather_coalesced`, `batch_isend_irecv`) and on the two
that DeepSpeed's communication backend captured when it was made (`all_gather_into_tensor`,
`reduce_scatter_tensor`); `collective_log`'s hook passes an operation and a group, not the
tensors, so it cannot serve here. Limits: code that moves a host
tensor with a plain `.to(device)` gets the same tensor back on a CPU rank, so such a tensor
reads as host memory here although a GPU would copy it. DeepSpeed moves its offloaded
parameter partitions that way (ZeRO-3's all-gathers): `deepspeed_host_tensors` leaves them out.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as torch_dist

from pretrain.training.collective_log import OPS

# beyond the collective log's (which holds FSDP2's all_gather_single and reduce_scatter_single):
# the coalesced all-gather and the batched point-to-point call; not `isend` / `irecv`: torch
# checks a P2POp's function by identity
MORE_OPS = ("all_gather_coalesced", "batch_isend_irecv")
HostTensors = Callable[[], Iterable[tuple[str, torch.Tensor]]]


class HostTensorInCollective(RuntimeError):
    """A collective on a group that is NCCL on GPUs was handed a host-resident tensor."""


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The plain tensors in a collective's argument (tensor lists, P2POps, DTensors' locals)."""
    if isinstance(value, torch.Tensor):
        yield value.to_local() if hasattr(value, "to_local") else value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, torch_dist.P2POp):
        yield from _tensors(value.tensor)


class NcclStrict:
    """The state of one `nccl_strict` block: what is watched, the groups allowed, counts."""

    def __init__(self) -> None:
        self._sources: list[HostTensors] = []
        self.gloo_groups: list[Any] = []  # gloo on GPUs too: never checked
        self.checked = 0  # collectives on NCCL groups whose tensors were checked

    def watch(self, source: HostTensors) -> None:
        """Refuse, from now on, the tensors `source()` yields (asked at each collective)."""
        self._sources.append(source)

    def _allowed(self, group: Any) -> bool:
        from pretrain import dist

        return group is not None and (group is dist._IO_GROUP
                                      or any(group is g for g in self.gloo_groups))

    def check(self, op: str, group: Any, args: tuple, kwargs: dict) -> None:
        if self._allowed(group):
            return
        self.checked += 1
        sent = [t for value in (*args, *kwargs.values()) for t in _tensors(value)
                if t.numel() > 0]
        if not sent:
            return
        host: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for source in self._sources:
            for label, t in source():
                if t is not None and t.numel() > 0:
                    host.setdefault(_storage(t), []).append((label, t))
        for tensor in sent:
            if _storage(tensor) in host:  # named by the watched tensor it overlaps, if any
                same = host[_storage(tensor)]
                label = next((lbl for lbl, t in same if _overlap(t, tensor)), same[0][0])
                raise HostTensorInCollective(
                    f"{op} on group {_group_name(group)} was handed {label} "
                    f"{tuple(tensor.shape)} {tensor.dtype}, which lives in host memory: the group "
                    "is NCCL on GPUs, which takes device tensors only (copy it to the device "
                    "for the collective)")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the spans of memory two tensors of one storage cover intersect."""
    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _group_name(group: Any) -> str:
    try:
        pg = group if group is not None else torch_dist.distributed_c10d._get_default_group()
        ranks = torch_dist.get_process_group_ranks(pg)
        return f"{pg.group_name} (ranks {', '.join(map(str, ranks))})"
    except Exception:  # noqa: BLE001 - a group this rank is not in
        return repr(group)


def _checked(fn: Callable, op: str, strict: NcclStrict) -> Callable:
    params = list(inspect.signature(fn).parameters)
    at = params.index("group") if "group" in params else None

    @functools.wraps(fn)
    def collective(*args, **kwargs):
        if op == "batch_isend_irecv":
            for p2p in args[0] if args else kwargs["p2p_op_list"]:
                strict.check(op, p2p.group, (p2p,), {})
        else:
            group = kwargs.get("group", args[at] if at is not None and len(args) > at else None)
            strict.check(op, group, args, kwargs)
        return fn(*args, **kwargs)

    return collective


@contextlib.contextmanager
def nccl_strict() -> Iterator[NcclStrict]:
    """Within the block, collectives refuse the host-resident tensors `watch`ed (see the module
    docstring); everything is put back on leaving."""
    strict = NcclStrict()
    patches: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, value: Any) -> None:
        patches.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    new_group = torch_dist.new_group

    @functools.wraps(new_group)
    def recording_new_group(*args, **kwargs):
        group = new_group(*args, **kwargs)
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        if backend is not None and str(backend).lower() == "gloo":
            strict.gloo_groups.append(group)
        return group

    try:
        for op in (*OPS, *MORE_OPS):
            fn = getattr(torch_dist, op, None)
            if fn is not None:
                patch(torch_dist, op, _checked(fn, op, strict))
        patch(torch_dist, "new_group", recording_new_group)
        backend = _deepspeed_backend()
        if backend is not None:  # the functions it captured from torch.distributed
            for name, op in (("all_gather_function", "all_gather_into_tensor"),
                             ("reduce_scatter_function", "reduce_scatter_tensor")):
                if getattr(backend, name, None) is not None:
                    patch(backend, name, _checked(getattr(backend, name), op, strict))
        yield strict
    finally:
        for owner, name, original in reversed(patches):
            setattr(owner, name, original)


def _deepspeed_backend() -> Any:
    """DeepSpeed's communication backend when one exists in this process (else None)."""
    import sys

    comm = sys.modules.get("deepspeed.comm.comm")
    return getattr(comm, "cdb", None) if comm is not None else None


def deepspeed_host_tensors(engine) -> HostTensors:
    """What DeepSpeed's ZeRO-1/2/3 with `offload_optimizer` keeps in host memory and could hand
    a collective: the fp32 partitions the CPU optimizer steps, their gradients and the
    optimizer's state. Its offloaded parameter partitions (ZeRO-3 `offload_param`) are left
    out: DeepSpeed moves them with `.to(device)`, which on a CPU rank is the same tensor."""
    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        if not engine.zero_use_cpu_optimizer():
            return
        zero = engine.optimizer
        flats = (getattr(zero, "fp32_partitioned_groups_flat", None)
                 or getattr(zero, "single_partition_of_fp32_groups", None) or [])
        for i, flat in enumerate(flats):
            yield f"DeepSpeed's offloaded fp32 partition of group {i}", flat
            yield f"the gradient of DeepSpeed's offloaded fp32 partition of group {i}", flat.grad
        inner = getattr(zero, "optimizer", None)
        for i, state in enumerate(getattr(inner, "state", {}).values()):
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    yield f"DeepSpeed's offloaded optimizer state {key} of partition {i}", value
    return tensors
