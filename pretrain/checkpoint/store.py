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
the run (`upload_run_files`), only the files that changed.
"""
from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from pretrain import storage
from pretrain.checkpoint.paths import CHECKPOINTS, FINAL, LATEST, MANIFEST, tag_step
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


def complete_steps(objects: dict[str, int]) -> list[str]:
    """The step directories (`step<N>`) that `objects` (key under the run: size) holds complete,
    newest first."""
    tags = {key.split("/")[1] for key in objects
            if key.startswith(f"{CHECKPOINTS}/") and key.endswith(f"/{MANIFEST}")
            and key.count("/") == 2}
    return sorted((t for t in tags if tag_step(Path(t)) is not None),
                  key=lambda t: tag_step(Path(t)), reverse=True)


def stage_run(url: str, *, log=print) -> Path:
    """Make the node-local copy of the run directory `url` agree with the store (the newest
    complete checkpoint and the run's top-level files downloaded; local checkpoints the store
    does not hold complete deleted): its path. The ranks of a node take turns (a lock); the
    first downloads, the others find the files there."""
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
            for key in sorted(files, key=lambda k: k == manifest):  # the manifest last
                _download_if_changed(url, key, local, files[key])
            (ckpt_dir / LATEST).write_text(newest)
            log(f"[checkpoint] {storage.join(url, CHECKPOINTS, newest)} staged in {local}")
    return local


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


def wait_for_uploads() -> None:
    """Return once this process's uploads have ended (uploaded or warned): before the next save
    (its pruning may delete what an upload reads) and before the process exits."""
    while _UPLOADS:
        _UPLOADS.pop(0).join()


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

