"""The fp32 master weights and Adam moments in a DeepSpeed ZeRO checkpoint, read one parameter
at a time.

A ZeRO-1/2/3 checkpoint keeps the fp32 masters only as flat partitions: each data-parallel
rank's `*_optim_states.pt` holds its slice of every parameter group, flattened. DeepSpeed's
`zero_to_fp32` concatenates all of them into one vector per group before it cuts out a single
parameter (twice the model in memory, and its entry points for one model-parallel rank are
private). `ZeroMasters` instead computes where each parameter lies and, when it is asked for,
maps the files that hold its pieces (`torch.load(mmap=True)`) and copies out only those: the
caller holds one full tensor at a time, and the pages of the rest are never read. The optimizer's
per-element state (Adam's `exp_avg`, `exp_avg_sq`) is flattened and partitioned exactly as the
masters are, so the same spans read it (`key=`).

The layout is DeepSpeed's (0.19.8; `deepspeed.utils.zero_to_fp32` reads the same):

- ZeRO-1/2 (and DeepSpeed's BF16_Optimizer, which partitions like ZeRO-1): the concatenation of
  the ranks' partitions of group g, in rank order, is the group's parameters flattened one after
  the other in `param_shapes[g]` order, each followed by its alignment padding
  (`param_alignment_paddings[g]`, when saved);
- ZeRO-3: every parameter is split on its own into `ceil(numel / dp)` elements per rank; a rank's
  groups, concatenated, hold its piece of each parameter in `param_shapes` order.

On the expert grid (experts beyond the tensor group) the experts are DeepSpeed's MoE groups,
partitioned over the expert-data ranks only (`partition_count` of the group), and each file's
group holds its own expert rank's experts: the files of one expert rank, in expert-data order,
are that group's concatenation, under names the first data rank's `param_shapes` gives with the
expert indices moved to that expert rank's (`ExpertFiles`).
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

import pretrain.checkpoint.safe_load as safe_load
from pretrain.checkpoint.store import materialize, materialize_all
from pretrain.errors import CheckpointError


def load_checkpoint_file(path: Path) -> dict:
    """A DeepSpeed checkpoint file, memory-mapped: tensors are read when touched. A file of a
    checkpoint staged from the object store by ranges is read from the store: its tensors are
    meta tensors until `materialize` reads the elements a reader copies out."""
    from pretrain.checkpoint.store import load_ranged, ranged_object

    try:
        url = ranged_object(path)
        if url is not None:
            return load_ranged(url, Path(path).stat().st_size)
        return safe_load.load(path, mmap=True)
    except CheckpointError:  # a pickle naming a type no checkpoint holds: refused as such
        raise
    except Exception as exc:  # truncated or foreign files raise many different types
        raise CheckpointError(f"{str(path)!r} cannot be read ({type(exc).__name__}: "
                              f"{str(exc)[:200]}): the checkpoint is damaged or incomplete") from None


@dataclass(frozen=True)
class _Span:
    """Where a parameter lies: `numel` elements from `offset` of a virtual concatenation."""

    group: int  # ZeRO-1/2: the parameter group; ZeRO-3: unused
    offset: int  # ZeRO-1/2: in the group's concatenated partitions; ZeRO-3: in each rank's groups
    numel: int
    shape: tuple[int, ...]
    # the files whose partitions of `group` are concatenated, in order (None: every file); an
    # expert group of the expert grid: the files of one expert rank
    files: tuple[int, ...] | None = None


_EXPERT_INDEX = re.compile(r"(\.mlp\.experts\.)(\d+)(\.)")


@dataclass(frozen=True)
class ExpertFiles:
    """Where one model-parallel rank's optimizer files of an expert-grid checkpoint keep the
    experts, file by file (in data-parallel order): which expert rank's experts its MoE groups
    hold (`expert`: (expert-tensor, expert) index, the same for the files of the same experts),
    its index among those files (`position`: its expert-data rank), and how far its experts'
    indices lie from those of the first file's (`shift`), whose names `param_shapes` holds."""

    expert: tuple[tuple[int, int], ...]
    position: tuple[int, ...]
    shift: tuple[int, ...]

    def families(self) -> list[tuple[int, ...]]:
        """The files holding the same experts, each family in expert-data order."""
        found: dict[tuple[int, int], list[int]] = {}
        for file, key in enumerate(self.expert):
            found.setdefault(key, []).append(file)
        return [tuple(sorted(files, key=lambda f: self.position[f])) for files in found.values()]


def shift_expert(name: str, shift: int) -> str:
    """`name` with its expert index moved by `shift` (names of no expert unchanged)."""
    return _EXPERT_INDEX.sub(lambda m: f"{m[1]}{int(m[2]) + shift}{m[3]}", name, count=1)


def overlaps(sizes: list[int], start: int, length: int) -> list[tuple[int, int, int]]:
    """(piece, lo, hi) for each piece of a concatenation of pieces of `sizes` elements that
    holds some of its elements [start, start + length): those are the piece's [lo, hi)."""
    found, position = [], 0
    for piece, size in enumerate(sizes):
        lo, hi = max(start, position), min(start + length, position + size)
        if lo < hi:
            found.append((piece, lo - position, hi - position))
        position += size
    if sum(hi - lo for _, lo, hi in found) != length:
        raise CheckpointError(f"elements {start}..{start + length} lie beyond the {position} "
                              "saved: the optimizer partitions are incomplete")
    return found


class ZeroMasters(Mapping):
    """{module parameter name: fp32 master weight} of one model-parallel rank of a ZeRO
    checkpoint, over its data-parallel ranks' optimizer files; each item is read when asked.
    With `key` ("exp_avg", "exp_avg_sq") the items are that optimizer state instead.

    A lookup maps only the files that hold a piece of the parameter and lets them go with the
    pieces copied: the process never keeps more than the one parameter (a mapping kept open
    would count every page read so far as resident memory)."""

    def __init__(self, step_dir: Path, *, mp_rank: int, key: str | None = None,
                 experts: ExpertFiles | None = None) -> None:
        tag = f"mp_rank_{mp_rank:02d}"
        model_files = sorted(step_dir.glob(f"*{tag}_model_states.pt"))
        self._files = sorted(step_dir.glob(f"*{tag}_optim_states.pt"), key=_rank_order)
        if not model_files or not self._files:
            raise CheckpointError(f"{step_dir} lacks the {tag} model or optimizer states of a "
                                  "ZeRO checkpoint: a rank's files are missing")
        self.source, self.key = f"{step_dir} ({tag})", key
        self.bytes_read = 0  # tensor bytes `read_runs` copied out
        param_shapes = load_checkpoint_file(model_files[0])["param_shapes"]
        self.stage, self._sizes, paddings, counts = _fp32_layout(self._files, source=self.source)
        self._spans = (_zero3_spans(param_shapes, world=len(self._files))
                       if self.stage == 3 else _zero12_spans(param_shapes, paddings))
        moe = [g for g, count in enumerate(counts) if count != len(self._files)]
        if moe:
            self._spans = self._expert_spans(moe, counts, experts)

    def _expert_spans(self, moe: list[int], counts: list[int],
                      experts: ExpertFiles | None) -> dict[str, _Span]:
        """The spans with each MoE group's (partitioned over the expert-data ranks) once per
        expert rank, under that rank's expert names, over its files; each file's own names
        (`param_slice_mappings`) are checked to be its expert rank's."""
        if experts is None or len(experts.expert) != len(self._files):
            raise CheckpointError(f"{self.source}: groups {moe} are partitioned over "
                                  f"{[counts[g] for g in moe]} of the {len(self._files)} "
                                  "data-parallel ranks (expert parallelism beyond the tensor "
                                  "group) but the checkpoint's config places no experts there")
        spans = {n: s for n, s in self._spans.items() if s.group not in moe}
        for files in experts.families():
            for name, span in self._spans.items():
                if span.group in moe:
                    if len(files) != counts[span.group]:
                        raise CheckpointError(
                            f"{self.source}: group {span.group} is partitioned over "
                            f"{counts[span.group]} ranks, {len(files)} files hold its experts")
                    own = shift_expert(name, experts.shift[files[0]])
                    spans[own] = _Span(group=span.group, offset=span.offset, numel=span.numel,
                                       shape=span.shape, files=files)
        from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, PARAM_SLICE_MAPPINGS

        for rank, file in enumerate(self._files):
            mappings = load_checkpoint_file(file)[OPTIMIZER_STATE_DICT].get(PARAM_SLICE_MAPPINGS)
            for name in (n for g in moe for n in mappings[g]) if mappings else ():
                if name not in spans or rank not in spans[name].files:
                    raise CheckpointError(f"{self.source}: {file.name} holds {name}, which its "
                                          "place in the expert grid does not give it: the "
                                          "checkpoint's layout is not the one its files have")
        return spans

    def _files_of(self, span: _Span) -> tuple[int, ...]:
        return span.files if span.files is not None else tuple(range(len(self._files)))

    def __getitem__(self, name: str) -> torch.Tensor:
        span = self._spans[name]
        if self.stage == 3:  # each rank's piece in rank order, the last rank's padding cut off
            per_rank = math.ceil(span.numel / len(self._files))
            out = torch.empty(per_rank * len(self._files))
            for rank, sizes in enumerate(self._sizes):
                self._copy(rank, overlaps(sizes, span.offset, per_rank),
                           into=out[rank * per_rank:(rank + 1) * per_rank])
            out = out[:span.numel]
        else:
            out, filled = torch.empty(span.numel), 0
            files = self._files_of(span)
            sizes = [self._sizes[rank][span.group] for rank in files]
            for piece, lo, hi in overlaps(sizes, span.offset, span.numel):
                self._copy(files[piece], [(span.group, lo, hi)], into=out[filled:filled + hi - lo])
                filled += hi - lo
        return out.view(span.shape)

    def read_runs(self, name: str, runs: list[tuple[int, int]]) -> torch.Tensor:
        """Elements [start, stop) of the flattened parameter `name`, for each (start, stop) of
        `runs`, one after the other: only the files and elements that hold them are read (each
        file mapped once per call). `bytes_read` counts the elements copied out."""
        span = self._spans[name]
        pieces: dict[int, list[tuple[int, int, int, int]]] = {}  # rank: (group, lo, hi, at)
        filled = 0
        for start, stop in runs:
            for rank, group, lo, hi in self._locate(span, start, stop - start):
                pieces.setdefault(rank, []).append((group, lo, hi, filled))
                filled += hi - lo
        out = torch.empty(filled)
        for rank, parts in pieces.items():
            groups = _flat_groups(load_checkpoint_file(self._files[rank]), stage=self.stage,
                                  key=self.key)
            for group, lo, hi, at in parts:
                if groups[group] is None:
                    raise KeyError(f"{name}: its group holds no {self.key!r}")
            # a file in the store: every run's ranged GET sent together
            read = materialize_all([groups[group].reshape(-1)[lo:hi]
                                    for group, lo, hi, _ in parts])
            for (group, lo, hi, at), piece in zip(parts, read):
                out[at:at + hi - lo].copy_(piece)
            del groups, read
        self.bytes_read += out.numel() * out.element_size()
        return out

    def _locate(self, span: _Span, start: int, length: int) -> list[tuple[int, int, int, int]]:
        """(rank, group, lo, hi): where elements [start, start + length) of a parameter lie, in
        order."""
        if self.stage != 3:
            files = self._files_of(span)
            sizes = [self._sizes[rank][span.group] for rank in files]
            return [(files[piece], span.group, lo, hi)
                    for piece, lo, hi in overlaps(sizes, span.offset + start, length)]
        per_rank = math.ceil(span.numel / len(self._files))  # ZeRO-3: each rank a chunk
        found = []
        for rank in range(start // per_rank, (start + length - 1) // per_rank + 1):
            lo = max(start, rank * per_rank) - rank * per_rank
            hi = min(start + length, (rank + 1) * per_rank) - rank * per_rank
            found += [(rank, g, a, b) for g, a, b in
                      overlaps(self._sizes[rank], span.offset + lo, hi - lo)]
        return found

    def _copy(self, rank: int, parts: list[tuple[int, int, int]], *, into: torch.Tensor) -> None:
        """Copy elements [lo, hi) of flat group g, for each (g, lo, hi), of data-parallel rank
        `rank` into `into`, one after the other; the file is unmapped on return."""
        groups = _flat_groups(load_checkpoint_file(self._files[rank]), stage=self.stage,
                              key=self.key)
        filled = 0
        for g, lo, hi in parts:
            if groups[g] is None:
                raise KeyError(f"group {g} holds no {self.key!r}")
            into[filled:filled + hi - lo].copy_(materialize(groups[g].reshape(-1)[lo:hi]))
            filled += hi - lo

    def shape(self, name: str) -> tuple[int, ...]:
        return self._spans[name].shape

    def __iter__(self) -> Iterator[str]:
        return iter(self._spans)

    def __len__(self) -> int:
        return len(self._spans)


def _rank_order(path: Path) -> tuple:
    """Data-parallel order of `..._pp_rank_<dp>_...` names: 10 after 9, not after 1."""
    return tuple(int(part) if part.isdigit() else part for part in path.name.split("_"))


def _zero12_spans(param_shapes: list[dict], paddings: list | None) -> dict[str, _Span]:
    spans = {}
    for group, shapes in enumerate(param_shapes):
        offset = 0
        pads = paddings[group] if paddings is not None else [0] * len(shapes)
        if len(pads) != len(shapes):
            raise CheckpointError(f"group {group}: {len(pads)} alignment paddings for "
                                  f"{len(shapes)} parameters: the checkpoint is inconsistent")
        for (name, shape), pad in zip(shapes.items(), pads):
            spans[name] = _Span(group=group, offset=offset, numel=math.prod(shape),
                                shape=tuple(shape))
            offset += math.prod(shape) + pad
    return spans


def _zero3_spans(param_shapes: list[dict], *, world: int) -> dict[str, _Span]:
    spans, offset = {}, 0
    for shapes in param_shapes:
        for name, shape in shapes.items():
            spans[name] = _Span(group=0, offset=offset, numel=math.prod(shape), shape=tuple(shape))
            offset += math.ceil(math.prod(shape) / world)
    return spans


def _flat_groups(state: dict, *, stage: int, key: str | None = None) -> list[torch.Tensor]:
    """A rank's flat fp32 groups (`key` None) or the optimizer state `key` of each of them (the
    base optimizer's state of flat group g is its entry g: ZeRO-1/2 and BF16_Optimizer under
    `base_optimizer_state`, ZeRO-3 under a nested `optimizer_state_dict`)."""
    from deepspeed.checkpoint.constants import (BASE_OPTIMIZER_STATE, FP32_FLAT_GROUPS,
                                                OPTIMIZER_STATE_DICT,
                                                SINGLE_PARTITION_OF_FP32_GROUPS)

    saved = state[OPTIMIZER_STATE_DICT]
    masters = saved[SINGLE_PARTITION_OF_FP32_GROUPS if stage <= 2 else FP32_FLAT_GROUPS]
    if key is None:
        return masters
    base = saved[BASE_OPTIMIZER_STATE if stage <= 2 else OPTIMIZER_STATE_DICT]["state"]
    found = [base.get(g, {}).get(key) for g in range(len(masters))]
    if all(t is None for t in found):
        raise CheckpointError(f"the optimizer state holds no {key!r} in any group: it was not "
                              "saved by that optimizer (Adam's moments, Muon's momentum), or "
                              "before the first step")
    return found  # None for a group without it (train.optimizer=muon: Muon's or Adam's)


def _fp32_layout(optim_files: list[Path], *, source: str):
    """(ZeRO stage, each data-parallel rank's element count per flat fp32 group, alignment
    paddings, each group's partition count: the data-parallel ranks, or an expert group's
    expert-data ranks). DeepSpeed's BF16_Optimizer (bf16 at ZeRO-1 with fp32 gradient
    accumulation) saves no zero_stage: it partitions and aligns its flat fp32 groups as ZeRO-1
    does."""
    from deepspeed.checkpoint.constants import (OPTIMIZER_STATE_DICT, PARAM_ALIGNMENT_PADDINGS,
                                                PARTITION_COUNT, SINGLE_PARTITION_OF_FP32_GROUPS,
                                                ZERO_STAGE)

    first = load_checkpoint_file(optim_files[0])[OPTIMIZER_STATE_DICT]
    if ZERO_STAGE in first:
        stage = int(first[ZERO_STAGE])
    elif SINGLE_PARTITION_OF_FP32_GROUPS in first:
        stage = 1  # BF16_Optimizer
    else:
        raise CheckpointError(f"{source}: {optim_files[0].name} holds no ZeRO optimizer "
                              "partitions")
    counts = first[PARTITION_COUNT]
    sizes = [[t.numel() for t in _flat_groups(load_checkpoint_file(file), stage=stage)]
             for file in optim_files]
    counts = counts if isinstance(counts, list) else [counts] * len(sizes[0])
    if max(counts) != len(optim_files):
        raise CheckpointError(f"{source}: {len(optim_files)} optimizer files for {max(counts)} "
                              "data-parallel ranks: a rank's file is missing")
    return stage, sizes, first.get(PARAM_ALIGNMENT_PADDINGS), counts
