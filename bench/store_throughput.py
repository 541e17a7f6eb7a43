"""Checkpoint save and load throughput: a local S3 store (SeaweedFS) against the file system.

A checkpoint-shaped step directory (FILES files of FILE_MB MiB of random bytes, plus meta.json)
is saved and loaded through the code a run uses, in alternating rounds:

- store save: `checkpoint.store.upload_files` (a rank's files) then `complete_upload` (the rest,
  manifest.json last, `latest`), from the local copy the writer left;
- store load: `checkpoint.store.stage_run` into an empty node directory (what a rerun on a fresh
  node downloads);
- file-system save: each file copied into another directory of this disk and fsync'd (what the
  writer does on a shared file system); file-system load: each file read back after dropping
  it from the page cache (`posix_fadvise(DONTNEED)`).

The server runs on this machine (`pretrain.testing.seaweedfs`): the store's numbers are its
HTTP, signing and copy cost, not a network's; the file system is this machine's disk.

    .venv/bin/python bench/store_throughput.py     # about a minute on 2 loaded cores
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from common import machine, median
from pretrain import storage
from pretrain.checkpoint import store
from pretrain.checkpoint.paths import write_manifest
from pretrain.testing.seaweedfs import SeaweedServer

FILES, FILE_MB, ROUNDS = 4, 48, 3
BUCKET = "bench"


def _checkpoint(run: Path) -> Path:
    step = run / "checkpoints" / "step1"
    step.mkdir(parents=True)
    for i in range(FILES):
        (step / f"shard{i}.pt").write_bytes(os.urandom(FILE_MB << 20))
    write_manifest(step, {"step": 1})
    return step


def _fs_save(step: Path, target: Path) -> None:
    target.mkdir(parents=True)
    for path in sorted(step.iterdir()):
        shutil.copyfile(path, target / path.name)
        fd = os.open(target / path.name, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def _fs_load(target: Path) -> int:
    read = 0
    for path in sorted(target.iterdir()):
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        while chunk := os.read(fd, 16 << 20):
            read += len(chunk)
        os.close(fd)
    return read


def main() -> None:
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        tmp = Path(tmp)
        server = SeaweedServer(tmp / "seaweedfs", volumes=16)
        server.start()
        os.environ.update(server.env())
        try:
            storage.filesystem().mkdir(BUCKET)
            step = _checkpoint(tmp / "run")
            total = sum(p.stat().st_size for p in step.iterdir())
            times: dict[str, list[float]] = {k: [] for k in
                                             ("store save", "store load", "fs save", "fs load")}
            for r in range(ROUNDS):
                url = f"s3://{BUCKET}/run{r}"
                start = time.perf_counter()
                mine = [p.name for p in step.iterdir() if p.name.startswith("shard")]
                assert store.upload_files(step, mine, url) is None
                store.complete_upload(step, url, uploaded=set(mine))
                times["store save"].append(time.perf_counter() - start)
                os.environ["TMPDIR"] = str(tmp / f"node{r}")
                start = time.perf_counter()
                staged = store.stage_run(url, log=lambda text: None)
                times["store load"].append(time.perf_counter() - start)
                assert (staged / "checkpoints" / "step1" / "shard0.pt").stat().st_size == \
                    FILE_MB << 20
                start = time.perf_counter()
                _fs_save(step, tmp / f"fs{r}")
                times["fs save"].append(time.perf_counter() - start)
                start = time.perf_counter()
                assert _fs_load(tmp / f"fs{r}") == total
                times["fs load"].append(time.perf_counter() - start)
                shutil.rmtree(staged)
                shutil.rmtree(tmp / f"fs{r}")
        finally:
            server.stop()
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.1f}")
    print(f"checkpoint: {FILES} x {FILE_MB} MiB + meta/manifest ({total / 2**20:.0f} MiB), "
          f"{ROUNDS} rounds, median")
    rows = {name: total / 2**20 / median(seconds) for name, seconds in times.items()}
    for name, seconds in times.items():
        print(f"  {name:<11} {median(seconds):6.2f} s  {rows[name]:7.0f} MiB/s")
    print(json.dumps({k: round(v, 1) for k, v in rows.items()}), file=sys.stderr)


if __name__ == "__main__":
    main()
