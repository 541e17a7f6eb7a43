"""Paths that are objects in an S3 store: which settings may name one, reaching the store, and the
few operations the run needs (put, ranged get, list, delete, a node-local copy).

A path setting is a local path or, where the stack serves it (`SERVED`), `s3://bucket/prefix`.
Anything else that looks like a URL (`gs://`, `hf://`, a typo such as `s3:/bucket`) is refused
when the config is loaded (`path_problem`), instead of becoming a local directory named `s3:`.

The endpoint and credentials come from the environment only, as every S3 client reads them:
`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` (`AWS_SESSION_TOKEN`), `AWS_DEFAULT_REGION`, and
`AWS_ENDPOINT_URL` for a store that is not AWS (MinIO, SeaweedFS, Ceph). Nothing here writes
them anywhere: a config holds the `s3://` URL alone.

fsspec and s3fs are imported when a store is first used, so loading a config stays cheap.
"""
from __future__ import annotations

import contextlib
import os
import re
import threading
import uuid
from pathlib import Path
from typing import Any

from pretrain.errors import PretrainError

SCHEME = "s3"
ENDPOINT_ENV = "AWS_ENDPOINT_URL"
# The path settings that may name an object in the store (the others are read by code that
# opens local files: the DeepSpeed JSON, a tokenizer, init_from's weights).
SERVED = ("run_dir", "data.dataset", "data.blend")
_URL_LIKE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):/")  # "s3://", "gs://", and "s3:/" typos
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")  # S3's bucket naming rule
# Seconds before an unreachable store counts as down: a save then warns instead of stalling.
CONNECT_TIMEOUT_S, READ_TIMEOUT_S, ATTEMPTS = 5, 60, 3


class StoreError(PretrainError):
    """The object store cannot be used: unreachable, no such bucket, credentials refused."""


def is_remote(path: str | Path) -> bool:
    """Whether `path` names an object in the store (`s3://...`)."""
    return isinstance(path, str) and path.startswith(f"{SCHEME}://")


def path_problem(name: str, text: str) -> str | None:
    """What is wrong with the path setting `name` = `text` (None: a local path, or an `s3://`
    URL where `name` may have one): a URL scheme the stack does not serve, a malformed `s3`
    URL, or a store URL in a setting read only from local files."""
    match = _URL_LIKE.match(text or "")
    if match is None:
        return None
    scheme = match.group(1).lower()
    if scheme != SCHEME:
        return (f"{text!r} has the scheme {scheme}://, which is not served: use a local path "
                f"or s3://bucket/prefix ({', '.join(SERVED)})")
    if not is_remote(text):
        return f"{text!r} is not an object store URL: write s3://bucket/prefix"
    if name not in SERVED:
        return (f"{text!r}: {name} is read from local files only; an s3:// URL is served for "
                f"{', '.join(SERVED)}")
    bucket = text[len(SCHEME) + 3:].split("/", 1)[0]
    if not _BUCKET.match(bucket):
        return (f"{text!r}: {bucket!r} is not a bucket name (3-63 lower-case letters, digits, "
                "dots, hyphens): write s3://bucket/prefix")
    return None


def join(url: str, *parts: str) -> str:
    """`url` with `parts` appended as '/'-separated keys."""
    return "/".join([url.rstrip("/"), *(p.strip("/") for p in parts if p)])


def _key(url: str) -> str:
    """`bucket/key` of an `s3://bucket/key` URL (what s3fs takes)."""
    return url[len(SCHEME) + 3:].rstrip("/")


# ---- the client ---------------------------------------------------------------------------------

_FS: dict[tuple, Any] = {}
_FS_LOCK = threading.Lock()


def filesystem():
    """The s3fs file system of this process's environment (one per endpoint and credentials,
    held in memory only). Listings are never cached: another rank or a rerun changes the
    store under us."""
    import s3fs

    endpoint = os.environ.get(ENDPOINT_ENV) or None
    key = (endpoint, os.getpid(), *(os.environ.get(name) for name in (
        "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")))
    with _FS_LOCK:
        if key not in _FS:
            _FS[key] = s3fs.S3FileSystem(
                use_listings_cache=False, skip_instance_cache=True,
                client_kwargs={"endpoint_url": endpoint} if endpoint else {},
                config_kwargs={"connect_timeout": CONNECT_TIMEOUT_S,
                               "read_timeout": READ_TIMEOUT_S,
                               "retries": {"max_attempts": ATTEMPTS}})
        return _FS[key]


class Traffic:
    """Bytes this process moved to and from the store (what resuming and the data read)."""

    def __init__(self) -> None:
        self.read = self.written = 0
        self._lock = threading.Lock()

    def add(self, *, read: int = 0, written: int = 0) -> None:
        with self._lock:
            self.read += read
            self.written += written


TRAFFIC = Traffic()


def put_file(local: str | Path, url: str) -> None:
    """Upload one local file (s3fs streams it, multipart above its block size)."""
    filesystem().put_file(str(local), _key(url))
    TRAFFIC.add(written=os.path.getsize(local))


def put_text(url: str, text: str) -> None:
    """Write a small object whole (S3 makes a PUT visible at once and atomically)."""
    data = text.encode()
    filesystem().pipe_file(_key(url), data)
    TRAFFIC.add(written=len(data))


def read_bytes(url: str, start: int | None = None, end: int | None = None) -> bytes:
    """Bytes [start, end) of an object (a ranged GET), the whole object by default."""
    data = filesystem().cat_file(_key(url), start=start, end=end)
    TRAFFIC.add(read=len(data))
    return data


def read_ranges(url: str, ranges: list[tuple[int, int]]) -> list[bytes]:
    """Bytes [start, end) of an object for each (start, end) of `ranges`: ranged GETs, sent
    together."""
    if not ranges:
        return []
    key = _key(url)
    found = filesystem().cat_ranges([key] * len(ranges), [a for a, _ in ranges],
                                    [b for _, b in ranges], on_error="raise")
    TRAFFIC.add(read=sum(len(data) for data in found))
    return found


def get_file(url: str, local: str | Path) -> None:
    """Download one object to a local file, atomically (a temporary name, then renamed)."""
    local = Path(local)
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = local.with_name(f".{local.name}.{uuid.uuid4().hex[:8]}.part")
    try:
        filesystem().get_file(_key(url), str(tmp))
        TRAFFIC.add(read=tmp.stat().st_size)
        os.replace(tmp, local)
    finally:
        tmp.unlink(missing_ok=True)


def sizes(url: str) -> dict[str, int]:
    """{key below `url`: size} of every object under the prefix `url` (recursively)."""
    prefix = _key(url) + "/"
    try:
        found = filesystem().find(prefix, detail=True)
    except FileNotFoundError:
        return {}
    return {k[len(prefix):]: int(info.get("size") or 0) for k, info in found.items()
            if k.startswith(prefix) and info.get("type", "file") == "file"}


def size(url: str) -> int | None:
    """The size of one object, None when there is none."""
    try:
        return int(filesystem().info(_key(url))["size"])
    except FileNotFoundError:
        return None


def remove(url: str) -> None:
    """Delete every object under the prefix `url` (and the object `url` itself)."""
    fs = filesystem()
    keys = list(sizes(url))
    if keys:
        fs.rm([f"{_key(url)}/{k}" for k in keys])
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(_key(url))


# ---- checks before a job ------------------------------------------------------------------------

def check_writable(url: str, *, setting: str = "run_dir") -> None:
    """Write and delete a probe object under `url`: the store answers, the bucket exists, the
    credentials may write. Raises `StoreError` naming `setting` and what failed, without the
    credentials."""
    bucket = _key(url).split("/", 1)[0]
    where = os.environ.get(ENDPOINT_ENV) or "AWS"
    probe = join(url, f".pretrain-probe-{uuid.uuid4().hex[:12]}")
    try:
        filesystem().info(bucket)  # first: some stores make a missing bucket on a PUT
        put_text(probe, "probe")
        remove(probe)
    except FileNotFoundError:
        raise StoreError(f"{setting} {url!r}: the bucket {bucket!r} does not exist at {where}: "
                         "create it first") from None
    except PermissionError as exc:
        raise StoreError(f"{setting} {url!r}: the store at {where} refused the credentials of "
                         f"AWS_ACCESS_KEY_ID ({_first_line(exc)})") from None
    except Exception as exc:  # noqa: BLE001 - botocore's connection errors have no common base
        raise StoreError(f"{setting} {url!r}: the store at {where} cannot be reached "
                         f"({type(exc).__name__}: {_first_line(exc)}); set {ENDPOINT_ENV} to "
                         "its address") from None


def check_readable(url: str, *, setting: str, suffixes: tuple[str, ...] = ("",)) -> None:
    """The objects `url` + each suffix exist and can be read (e.g. a dataset's .bin and .idx):
    `StoreError` naming `setting` otherwise."""
    where = os.environ.get(ENDPOINT_ENV) or "AWS"
    for suffix in suffixes:
        try:
            found = size(url + suffix)
        except PermissionError as exc:
            raise StoreError(f"{setting} {url!r}: the store at {where} refused the credentials "
                             f"of AWS_ACCESS_KEY_ID ({_first_line(exc)})") from None
        except Exception as exc:  # noqa: BLE001 - as in check_writable
            raise StoreError(f"{setting} {url!r}: the store at {where} cannot be reached "
                             f"({type(exc).__name__}: {_first_line(exc)})") from None
        if found is None:
            raise StoreError(f"{setting}: {url + suffix!r} does not exist in the store")


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0][:200]


# ---- node-local copies --------------------------------------------------------------------------

def local_copies(urls: list[str], *, cache_dir: str | Path, max_bytes: int) -> list[Path]:
    """Node-local copies of the objects `urls` under `cache_dir`, downloaded once per node: the
    ranks of a node share them under a lock, and a copy whose size differs from its object's is
    fetched again. Other copies, least recently used first, are deleted while the cache would
    exceed `max_bytes`; `urls` together may exceed it alone."""
    from pretrain.file_lock import exclusive_lock

    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    local = [cache_dir / _key(url) for url in urls]
    with exclusive_lock(cache_dir / ".lock"):
        wanted = []
        for url in urls:
            want = size(url)
            if want is None:
                raise StoreError(f"{url!r} does not exist in the store")
            wanted.append(want)
        missing = [(url, path, want) for url, path, want in zip(urls, local, wanted)
                   if not (path.is_file() and path.stat().st_size == want)]
        if missing:
            _evict(cache_dir, keep=set(local), need=sum(w for _, _, w in missing),
                   max_bytes=max_bytes)
        for url, path, _ in missing:
            get_file(url, path)
        for path in local:
            os.utime(path)  # most recently used
    return local


def _evict(cache_dir: Path, *, keep: set[Path], need: int, max_bytes: int) -> None:
    """Delete the least recently used files until `need` more bytes fit in `max_bytes`."""
    files = sorted((p for p in cache_dir.rglob("*") if p.is_file() and p not in keep
                    and not p.name.startswith(".")), key=lambda p: p.stat().st_mtime)
    used = sum(p.stat().st_size for p in files) + sum(p.stat().st_size for p in keep
                                                      if p.is_file())
    for old in files:
        if used + need <= max_bytes:
            break
        used -= old.stat().st_size
        old.unlink(missing_ok=True)
