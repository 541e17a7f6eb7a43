"""A run directory in the object store (`run_dir: s3://bucket/prefix`): staged on the node,
checkpoints uploaded with the manifest last.

The ranks work in a node-local copy of the run directory (`staging_dir`, under the node's
scratch: `mounts.node_local_scratch`), so every writer and reader of the run keeps its file
code. `stage_run`, before the run resolves, makes that copy agree with the store: the newest
checkpoint the store holds complete (its `manifest.json` object present) is downloaded, local
step directories the store does not hold complete are deleted, the run's small files
(`config.yaml`, `metrics.jsonl`, ...) are the store's. A checkpoint reaches the store when its
save completes (`pretrain.checkpoint.saver.Saver.finish`): each rank uploads its own files,
rank 0, once all of them are in the store, the rest, `manifest.json` last, and `latest`; only then does
the store hold it complete, so a save cut short (a rank killed mid-upload, the store down) is
never resumed. A failed upload warns and training goes on; the next save uploads its own
checkpoint. The uploads run in a background thread per rank (`start_upload`) while training
goes on; rank 0's waits in the store, not in a collective, for the other ranks' objects before
it puts the manifest. `checkpoint.keep_last` and `keep_every` prune the store as they prune the
disk.

Metrics and logs are written locally and uploaded at each completed save and at the end of
the run (`upload_run_files`), only the files that changed; a hang watchdog's exit uploads the
save it completes and the records too (`Saver.*_without_collectives`). The config a staged run
records names the store URL as its run_dir (`recorded_config`).

`train` stages by ranges (`stage_run(ranged=True)`): the checkpoint's tensor files stay in the
store, as placeholders of their size listed in `RANGED_MARK`. A reader of such a file
(`zero_shards.load_checkpoint_file`) gets `load_ranged`'s view of it: torch's zip directory and
pickle read by ranged GETs and loaded with `map_location="meta"`, which records where each
storage's bytes lie in the file (torch's `_checkpoint_offset`), so every tensor is a meta
tensor at a known offset; `materialize`, at the points where the readers copy elements out,
reads just those bytes. A resume that reshards thus reads each rank's pieces; one on the
checkpoint's own layout, which DeepSpeed loads from whole files, downloads them first
(`fetch_whole`).
"""
from __future__ import annotations

import io
import json
import shutil
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pretrain import storage
from pretrain.checkpoint.paths import (CHECKPOINTS, FINAL, LATEST, MANIFEST, RANGED_MARK,
                                       tag_step)
from pretrain.errors import CheckpointError
from pretrain.file_lock import exclusive_lock
from pretrain.mounts import node_local_scratch

STAGE_MARK = ".store.json"  # in a staged run directory: {"url": the run directory in the store}
STAGING = "pretrain-store"  # <node scratch>/pretrain-store/<bucket>/<prefix>/


def staging_dir(url: str) -> Path:
    """The node-local copy of the run directory `url`."""
    return node_local_scratch() / STAGING / url[len(storage.SCHEME) + 3:].strip("/")


def mirror_of(run_dir: str | Path) -> str | None:
    """The store URL a staged run directory mirrors, None for a run directory of its own."""
    mark = Path(run_dir) / STAGE_MARK
    return json.loads(mark.read_text())["url"] if mark.is_file() else None


def recorded_config(cfg):
    """The config a run records (config.yaml, meta.json and the checkpoints' client state,
    final/config.yaml, the metrics' run record): a run staged from the store names its URL as
    run_dir, not the node's copy (a path no other node or later job has)."""
    import dataclasses

    url = mirror_of(cfg.run_dir)
    return cfg if url is None else dataclasses.replace(cfg, run_dir=url)


def complete_steps(objects: dict[str, int]) -> list[str]:
    """The step directories (`step<N>`) that `objects` (key under the run: size) holds complete,
    newest first."""
    tags = {key.split("/")[1] for key in objects
            if key.startswith(f"{CHECKPOINTS}/") and key.endswith(f"/{MANIFEST}")
            and key.count("/") == 2}
    return sorted((t for t in tags if tag_step(Path(t)) is not None),
                  key=lambda t: tag_step(Path(t)), reverse=True)


def stage_run(url: str, *, log=print, ranged: bool = False) -> Path:
    """Make the node-local copy of the run directory `url` agree with the store (the newest
    complete checkpoint and the run's top-level files downloaded; local checkpoints the store
    does not hold complete deleted): its path. The ranks of a node take turns (a lock); the
    first downloads, the others find the files there.

    `ranged`: the checkpoint's tensor files (`ranged_file`) are not downloaded but left as
    placeholders of their size, listed in the step directory's `RANGED_MARK`: a resume that
    reshards reads from them only the byte ranges this rank keeps (`load_ranged`), one that
    loads them whole fetches them first (`fetch_whole`)."""
    local = staging_dir(url)
    local.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(local.parent / f".{local.name}.lock"):
        (local / STAGE_MARK).write_text(json.dumps({"url": url}))
        objects = storage.sizes(url)
        for key, size in objects.items():
            if "/" not in key and not key.startswith("."):  # config.yaml, metrics.jsonl, ...
                _download_if_changed(url, key, local, size)
        steps = complete_steps(objects)
        newest = steps[0] if steps else None
        ckpt_dir = local / CHECKPOINTS
        if ckpt_dir.is_dir():
            for old in ckpt_dir.iterdir():
                if old.is_dir() and old.name != newest:
                    shutil.rmtree(old)
        (ckpt_dir / LATEST).unlink(missing_ok=True)
        if newest is not None:
            files = {key: size for key, size in objects.items()
                     if key.startswith(f"{CHECKPOINTS}/{newest}/")}
            manifest = f"{CHECKPOINTS}/{newest}/{MANIFEST}"
            step_dir = ckpt_dir / newest
            placeholders = _placeholders(step_dir)
            later = {}
            for key in sorted(files, key=lambda k: k == manifest):  # the manifest last
                name = key[len(f"{CHECKPOINTS}/{newest}/"):]
                copied = name not in placeholders and (local / key).is_file() and \
                    (local / key).stat().st_size == files[key]
                if ranged and ranged_file(name) and not copied:
                    later[name] = files[key]
                    continue
                if name in placeholders:  # left by a ranged staging: not a copy
                    (local / key).unlink(missing_ok=True)
                _download_if_changed(url, key, local, files[key])
            _write_placeholders(step_dir, storage.join(url, CHECKPOINTS, newest), later,
                                keep={n for n in placeholders if n in later})
            (ckpt_dir / LATEST).write_text(newest)
            log(f"[checkpoint] {storage.join(url, CHECKPOINTS, newest)} staged in {local}")
    return local


# ---- checkpoints read by byte ranges -------------------------------------------------------------

def ranged_file(name: str) -> bool:
    """Whether a checkpoint file holds tensors a reshard reads by ranges (DeepSpeed's model and
    optimizer states, fsdp2's rank files); the small ones (meta, manifest, RNG states) are
    always downloaded."""
    return name.endswith(("model_states.pt", "optim_states.pt")) or (
        name.startswith("fsdp2_rank") and name.endswith(".pt"))


def _placeholders(step_dir: Path) -> dict[str, int]:
    """{name: size} of the placeholders of a step directory staged by ranges."""
    mark = step_dir / RANGED_MARK
    return json.loads(mark.read_text())["files"] if mark.is_file() else {}


def _write_placeholders(step_dir: Path, step_url: str, files: dict[str, int], *,
                        keep: set[str]) -> None:
    """Placeholders (sparse files of the objects' sizes: nothing read) for `files`, and the
    mark naming them and their objects; `keep` already are."""
    mark = step_dir / RANGED_MARK
    if not files:
        mark.unlink(missing_ok=True)
        return
    mark.write_text(json.dumps({"url": step_url, "files": files}))
    for name, size in files.items():
        path = step_dir / name
        if name in keep and path.is_file() and path.stat().st_size == size:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.truncate(size)


def ranged_object(path: Path) -> str | None:
    """The store URL of `path` when it is a placeholder of a checkpoint staged by ranges."""
    path = Path(path)
    mark = path.parent / RANGED_MARK
    if not mark.is_file():
        return None
    staged = json.loads(mark.read_text())
    return storage.join(staged["url"], path.name) if path.name in staged["files"] else None


def fetch_whole(step_dir: Path) -> None:
    """Download the placeholders of a step directory staged by ranges (a resume on the
    checkpoint's own layout, which DeepSpeed loads from whole files)."""
    step_dir = Path(step_dir)
    with exclusive_lock(step_dir.parent / f".{step_dir.name}.lock"):
        mark = step_dir / RANGED_MARK
        if not mark.is_file():
            return
        staged = json.loads(mark.read_text())
        for name in sorted(staged["files"]):
            (step_dir / name).unlink(missing_ok=True)
            storage.get_file(storage.join(staged["url"], name), step_dir / name)
        mark.unlink()


_SMALL = 4096  # tensors of at most this many bytes are read with the object's pickle
_BLOCK = 1024  # the granularity of the metadata reads (zip headers, the pickle)
_LOADED: dict[tuple[str, int], Any] = {}


class _RangedFile(io.RawIOBase):
    """An object of the store as a seekable read-only file: each read a ranged GET of the
    blocks it touches (blocks read once)."""

    def __init__(self, url: str, size: int) -> None:
        self.url, self.size, self.position = url, size, 0
        self.blocks: dict[int, bytes] = {}

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = 0) -> int:
        self.position = {0: 0, 1: self.position, 2: self.size}[whence] + offset
        return self.position

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self.size - self.position))
        if n == 0:
            return 0
        first, last = self.position // _BLOCK, (self.position + n - 1) // _BLOCK
        missing = [b for b in range(first, last + 1) if b not in self.blocks]
        spans: list[list[int]] = []
        for block in missing:
            if spans and spans[-1][1] == block:
                spans[-1][1] = block + 1
            else:
                spans.append([block, block + 1])
        ranges = [(a * _BLOCK, min(b * _BLOCK, self.size)) for a, b in spans]
        for (a, b), data in zip(spans, storage.read_ranges(self.url, ranges)):
            for block in range(a, b):
                self.blocks[block] = data[(block - a) * _BLOCK:(block - a + 1) * _BLOCK]
        data = b"".join(self.blocks[b] for b in range(first, last + 1))
        start = self.position - first * _BLOCK
        buffer[:n] = data[start:start + n]
        self.position += n
        return n


def load_ranged(url: str, size: int) -> Any:
    """The checkpoint file `url` as `torch.load` gives it, its tensors left in the store: only
    the zip's directory, its pickle and the tensors of at most `_SMALL` bytes are read; every
    other tensor is a meta tensor whose bytes `materialize` reads, by ranges, when a reader
    copies out of it. Read once per process."""
    import pretrain.checkpoint.safe_load as safe_load

    if (url, size) not in _LOADED:
        loaded = safe_load.load(_RangedFile(url, size), map_location="meta")
        small: dict[int, tuple[Any, int]] = {}  # checkpoint offset: (storage, bytes)

        def mark(tensor):
            st = tensor.untyped_storage()
            st._checkpoint_url = url
            if 0 < st.nbytes() <= _SMALL:
                small[st._checkpoint_offset] = st.nbytes()
        _walk(loaded, mark)
        offsets = sorted(small)
        read = dict(zip(offsets, storage.read_ranges(url, [(o, o + small[o])
                                                           for o in offsets])))
        _LOADED[(url, size)] = _walk(loaded, lambda t: _from_bytes(t, read))
    return _LOADED[(url, size)]


def _walk(obj: Any, visit) -> Any:
    """`obj` with every tensor `t` in its dicts, lists and tuples replaced by `visit(t)` (when
    that returns one)."""
    import torch

    if isinstance(obj, torch.Tensor):
        found = visit(obj)
        return obj if found is None else found
    if isinstance(obj, dict):
        return type(obj)((key, _walk(value, visit)) for key, value in obj.items())
    if isinstance(obj, list):
        return [_walk(value, visit) for value in obj]
    if isinstance(obj, tuple) and type(obj) is tuple:
        return tuple(_walk(value, visit) for value in obj)
    return obj


def _from_bytes(tensor, read: dict[int, bytes]):
    """`tensor` (meta) built on its storage's bytes when they were read (None otherwise)."""
    import torch

    if not tensor.is_meta:
        return None
    data = read.get(getattr(tensor.untyped_storage(), "_checkpoint_offset", None))
    if data is None:
        return None
    flat = torch.frombuffer(bytearray(data), dtype=tensor.dtype)
    return flat.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset()).clone()


def materialize(tensor):
    """A real tensor equal to `tensor`; a meta tensor of `load_ranged` is read from the store,
    only the bytes of its elements (one ranged GET per contiguous run; the span that covers
    them when that is at most a quarter more)."""
    return materialize_all([tensor])[0]


def materialize_all(tensors: list) -> list:
    """`materialize` of each of `tensors`, the ranged GETs of all of them sent together (a
    reader copying many runs out of one file: the rows of a column block)."""
    plans = [_plan(t) for t in tensors]
    wanted: dict[str, list[tuple[int, int]]] = {}
    for plan in plans:
        if plan is not None:
            wanted.setdefault(plan[0], []).extend(plan[1])
    got = {url: iter(storage.read_ranges(url, ranges)) for url, ranges in wanted.items()}
    return [t if plan is None else plan[2]([next(got[plan[0]]) for _ in plan[1]])
            for t, plan in zip(tensors, plans)]


def _plan(tensor):
    """None for a real tensor; for a meta tensor of `load_ranged`: (its object's URL, the byte
    ranges to read, a function of their bytes giving the tensor)."""
    import numpy as np
    import torch

    if not isinstance(tensor, torch.Tensor) or not tensor.is_meta:
        return None
    st = tensor.untyped_storage()
    url = getattr(st, "_checkpoint_url", None)
    if url is None:
        raise CheckpointError("a tensor of a checkpoint read by ranges lost its place in the store")
    size, stride, first = tuple(tensor.shape), tensor.stride(), tensor.storage_offset()
    width, base, dtype = tensor.element_size(), st._checkpoint_offset, tensor.dtype
    if tensor.numel() == 0:
        return url, [], lambda parts: torch.empty(size, dtype=dtype)
    runs = None
    if tensor.is_contiguous():
        runs = [[first, first + tensor.numel()]]
    elif stride[-1] == 1 or size[-1] == 1:
        starts = np.array(first)
        for n, step in zip(size[:-1], stride[:-1]):
            starts = starts[..., None] + np.arange(n) * step
        runs = []
        for start in starts.ravel().tolist():
            if runs and runs[-1][1] == start:
                runs[-1][1] += size[-1]
            else:
                runs.append([start, start + size[-1]])
    lo = first + sum((n - 1) * s for n, s in zip(size, stride) if s < 0)
    hi = first + sum((n - 1) * s for n, s in zip(size, stride) if s > 0) + 1
    if runs is not None and (len(runs) == 1 or hi - lo > 1.25 * tensor.numel()):
        return url, [(base + a * width, base + b * width) for a, b in runs], \
            lambda parts: torch.frombuffer(bytearray(b"".join(parts)),
                                           dtype=dtype).view(size).clone()
    return url, [(base + lo * width, base + hi * width)], \
        lambda parts: torch.frombuffer(bytearray(parts[0]), dtype=dtype).as_strided(
            size, stride, first - lo).clone()


def local_checkpoint(url: str, *, log=print) -> Path:
    """A node-local copy of what a reader of weights (`generate`, `export-hf`,
    `convert-checkpoint`, `eval`, `--resume-from`) names in the store: a run directory (its
    newest complete checkpoint, `stage_run`, and its final/), its checkpoints/ directory, a
    `checkpoints/step<N>` directory (only when complete: its manifest object is there), or a
    final/ directory. The local path to read."""
    url = url.rstrip("/")
    head, _, last = url.rpartition("/")
    if last == CHECKPOINTS:
        return local_checkpoint(head, log=log) / CHECKPOINTS
    local = staging_dir(url)
    if tag_step(Path(last)) is not None or last == FINAL:
        objects = storage.sizes(url)
        if not objects or (last != FINAL and MANIFEST not in objects):
            raise CheckpointError(f"{url!r} holds no complete checkpoint (no {MANIFEST} object: "
                                  "the save or its upload did not finish)" if objects else
                                  f"{url!r} holds nothing in the store")
        local.mkdir(parents=True, exist_ok=True)
        with exclusive_lock(local.parent / f".{local.name}.lock"):
            for key in sorted(objects, key=lambda k: k == MANIFEST):  # the manifest last
                _download_if_changed(url, key, local, objects[key])
        return local
    local = stage_run(url, log=log)
    with exclusive_lock(local.parent / f".{local.name}.lock"):
        for key, size in storage.sizes(storage.join(url, FINAL)).items():
            _download_if_changed(storage.join(url, FINAL), key, local / FINAL, size)
    return local


def _download_if_changed(url: str, key: str, local: Path, size: int) -> None:
    target = local / key
    if not (target.is_file() and target.stat().st_size == size):
        storage.get_file(storage.join(url, key), target)


def upload_files(tag_dir: Path, names: Iterable[str], url: str) -> str | None:
    """Upload the files `names` of the step directory `tag_dir` to the checkpoints of the run
    `url`: None, or what failed as one line (the caller warns; training goes on)."""
    try:
        for name in sorted(names):
            storage.put_file(tag_dir / name, storage.join(url, CHECKPOINTS, tag_dir.name, name))
    except Exception as exc:  # noqa: BLE001 - any failure of the store leaves the step incomplete
        return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
    return None


def complete_upload(tag_dir: Path, url: str, *, uploaded: set[str]) -> None:
    """Upload the files of `tag_dir` no rank uploaded (meta.json, ...), then `manifest.json`
    (the store's completion marker), then `latest`."""
    rest = [str(p.relative_to(tag_dir)) for p in sorted(tag_dir.rglob("*")) if p.is_file()]
    error = upload_files(tag_dir, [n for n in rest if n not in uploaded and n != MANIFEST], url)
    error = error or upload_files(tag_dir, [MANIFEST], url)
    if error:
        raise OSError(error)
    storage.put_text(storage.join(url, CHECKPOINTS, LATEST), tag_dir.name)


UPLOAD_WAIT_S = 1800.0  # rank 0 waits this long for the other ranks' objects of a save
_POLL_S = 0.5
_UPLOADS: list[threading.Thread] = []  # this process's uploads in flight


def start_upload(tag_dir: Path, url: str, *, mine: Iterable[str],
                 listed: dict[str, int] | None, keep_last: int, keep_every: int, log) -> None:
    """Upload a completed save in a background thread, while training goes on: this rank's
    files `mine`; on rank 0 (`listed`: every rank's files and their sizes) then, once the store
    holds every listed object with its size (the other ranks' threads put them there; no
    collective), the rest and `manifest.json` last, `latest`, and pruning. A failure warns and
    leaves the step without a manifest object, never resumed; the next save uploads its own."""
    mine = sorted(mine)

    def upload() -> None:
        try:
            error = upload_files(tag_dir, mine, url)
            if error is None and listed is not None:
                _wait_for_objects(storage.join(url, CHECKPOINTS, tag_dir.name), listed)
                complete_upload(tag_dir, url, uploaded=set(listed))
                prune(url, keep_last=keep_last, keep_every=keep_every)
        except Exception as exc:  # noqa: BLE001 - the store down must not stop the run
            error = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
        if error is not None:
            log(f"[checkpoint] warning: {tag_dir.name} was not uploaded to {url} ({error}); the "
                "store keeps its last complete checkpoint, the next save uploads again",
                level="warning")

    thread = threading.Thread(target=upload, name="checkpoint-upload", daemon=True)
    thread.start()
    _UPLOADS.append(thread)


def wait_for_uploads(*, timeout_s: float | None = None) -> bool:
    """Return once this process's uploads have ended (uploaded or warned): before the next save
    (its pruning may delete what an upload reads) and before the process exits. With
    `timeout_s`, False when one is still running then."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while _UPLOADS:
        _UPLOADS[0].join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if _UPLOADS[0].is_alive():
            return False
        _UPLOADS.pop(0)
    return True


def _wait_for_objects(step_url: str, listed: dict[str, int]) -> None:
    """Poll the store until every object `listed` (name under `step_url`: size) is there with
    its size; OSError after `UPLOAD_WAIT_S` (a rank whose upload failed)."""
    deadline = time.monotonic() + UPLOAD_WAIT_S
    while True:
        found = storage.sizes(step_url)
        missing = [name for name, size in listed.items() if found.get(name) != size]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise OSError(f"{len(missing)} files of the other ranks never reached the store "
                          f"(e.g. {missing[0]})")
        time.sleep(_POLL_S)  # polling the store for the other ranks' objects, to a deadline


def prune(url: str, *, keep_last: int, keep_every: int) -> None:
    """Delete the store's checkpoints as `Saver` prunes the disk: the newest `keep_last`
    complete ones stay, and every multiple of `keep_every`; a step older than the newest
    complete one that never completed (an upload cut short) goes too."""
    objects = storage.sizes(url)
    complete = complete_steps(objects)
    if not complete:
        return
    newest = tag_step(Path(complete[0]))
    tags = {key.split("/")[1] for key in objects
            if key.startswith(f"{CHECKPOINTS}/") and key.count("/") >= 2}
    for tag in tags:
        step = tag_step(Path(tag))
        if step is None or (keep_every and step % keep_every == 0):
            continue
        if (tag in complete and tag not in complete[:keep_last]) or \
                (tag not in complete and step < newest):
            storage.remove(storage.join(url, CHECKPOINTS, tag))


_UPLOADED: dict[str, tuple[int, int]] = {}  # local path: (size, mtime_ns) when last uploaded


def upload_run_files(run_dir: Path, url: str) -> None:
    """Upload the run's files outside `checkpoints/` (config, metrics, final/, tensorboard/,
    ...) that changed since this process last uploaded them."""
    for path in sorted(Path(run_dir).rglob("*")):
        relative = path.relative_to(run_dir)
        if not path.is_file() or relative.parts[0] == CHECKPOINTS or path.name.startswith("."):
            continue
        stat = path.stat()
        if _UPLOADED.get(str(path)) != (stat.st_size, stat.st_mtime_ns):
            storage.put_file(path, storage.join(url, *relative.parts))
            _UPLOADED[str(path)] = (stat.st_size, stat.st_mtime_ns)


def upload_run_files_or_warn(run_dir: Path, url: str, *, log) -> None:
    """`upload_run_files`, a failure a warning (the local copy stays; the next upload retries)."""
    try:
        upload_run_files(run_dir, url)
    except Exception as exc:  # noqa: BLE001 - the store down must not stop the run
        log(f"[checkpoint] warning: the run's files were not uploaded to {url} "
            f"({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}); "
            f"they stay in {run_dir}, the next save uploads them", level="warning")

