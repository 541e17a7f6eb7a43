"""Saving DeepSpeed (and fsdp2) engine checkpoints: `Saver`, at most one save in flight, and
pruning. A save is complete only when every rank's files are on disk: all ranks write (now, or
from a host copy in a background thread: `pretrain.checkpoint.writer`), meet, then rank 0
writes `meta.json`, `manifest.json` (size and CRC32 of every file) and `latest`. DeepSpeed's own
`latest` is written by rank 0 before the other ranks are done, so it is switched off
(`save_latest=False`). A crash during a save leaves a directory without a manifest, which
resuming (`pretrain.checkpoint.engine`) skips. A run directory in the object store
(`pretrain.checkpoint.store`) gets each completed save uploaded in the background, its manifest
last; the next save waits for that upload.
"""
from __future__ import annotations

import functools
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from deepspeed.accelerator import get_accelerator

from pretrain.checkpoint.store import (complete_upload, mirror_of, start_upload, upload_files,
                                       upload_run_files, upload_run_files_or_warn,
                                       wait_for_uploads)
from pretrain.checkpoint.store import prune as store_prune
from pretrain.storage import join, put_file
from pretrain.checkpoint.paths import MANIFEST, tag_step, write_latest, write_manifest
from pretrain.checkpoint.reshard import OPTIMIZER_NAMES, optimizer_parameter_names
from pretrain.checkpoint.writer import ShardWriter
from pretrain.dist import barriers_for_io, gather_for_io, wait_for_io
from pretrain.errors import TrainingFault
from pretrain.log import log

# DeepSpeed's ds_to_universal refuses a checkpoint whose client state lacks this entry.
UNIVERSAL_INFO = {"universal_checkpoint_info": {"universal_checkpoint_version": 0.4}}


def _rng_state() -> dict[str, Any]:
    accel = get_accelerator()
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if accel.device_name() != "cpu":
        state["accelerator"] = accel.get_rng_state()
    return state


class Saver:
    """The checkpoints of one engine in `ckpt_dir`, at most one save in flight.

    `save` (collective) hands every file of the step - each rank's DeepSpeed shards and RNG
    states - to a `ShardWriter`; `finish` (collective) waits until every rank's files are on
    disk, then rank 0 writes `meta.json`, `manifest.json` (size and CRC32 of every file) and
    `latest`, and prunes: the newest `keep_last` complete checkpoints stay, and every step that
    is a multiple of `keep_every` (when > 0) stays forever. Without `background`, `save`
    finishes before it returns. With it, `save` returns once the state is copied to host memory,
    a thread writes the files while training goes on, and the caller calls `finish` at a step
    every rank agrees on (the trainer: the first step at which no rank is still writing, or the
    next save, a stop, the end of the run); until then the previous complete checkpoint stays
    `latest`, and a crash leaves the new directory without a manifest, which resuming skips.

    Where the state lives in host memory (CPU ranks, CPU offload) the background writer reads
    it as it is, without a copy (`writer.ShardWriter`): the engine's next optimizer step then
    waits until every rank has written its files, meeting on the file-work group
    (`_hold_steps_while_writing`).
    """

    def __init__(self, engine, *, ckpt_dir: Path, keep_last: int, keep_every: int, rank: int,
                 background: bool):
        self.engine, self.ckpt_dir, self.rank = engine, Path(ckpt_dir), rank
        self.store_url = mirror_of(self.ckpt_dir.parent)  # a run directory in the store
        self.keep_last, self.keep_every = keep_last, keep_every
        live = background and host_resident_state(engine)
        self.writer = ShardWriter(background=background, live_host_state=live)
        self.in_flight: tuple[Path, dict[str, Any]] | None = None  # (step dir, its meta)
        self._written: dict[str, tuple[int, int]] | str | None = None  # this rank's, once known
        self._live_files = False  # the writer reads the live host state: steps must wait
        if live:
            self._hold_steps_while_writing()

    def _hold_steps_while_writing(self) -> None:
        """Make the engine's optimizer step wait, while the writer reads the live host state,
        until every rank has written its files: the step is the first thing that changes them
        (forward and backward change only gradients and activations). Every rank saves and
        steps alike, so all of them meet here at the same step."""
        optimizer = self.engine.optimizer
        step = optimizer.step

        def step_after_write(*args, **kwargs):
            if self._live_files:
                self.writer.written()
                wait_for_io()  # the other ranks' files too: no collective of the step waits
                self._live_files = False
            return step(*args, **kwargs)

        optimizer.step = step_after_write

    def save(self, *, meta: dict[str, Any], client_state: dict[str, Any]) -> Path:
        """Save a checkpoint tagged step<meta['step']> (collective): its directory. A save
        still in flight is finished first."""
        self.finish()
        wait_for_uploads()  # the previous save's, before anything is pruned under it
        tag_dir = self.ckpt_dir / f"step{meta['step']}"
        if self.rank == 0:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            if tag_dir.exists():  # a save of this step that crashed half-way: start it over
                shutil.rmtree(tag_dir)
        wait_for_io()
        self.engine.checkpoint_engine = self.writer  # every file DeepSpeed saves goes through it
        with barriers_for_io():  # its last barrier waits for every rank's synchronous writes
            self.engine.save_checkpoint(str(self.ckpt_dir), tag=tag_dir.name, save_latest=False,
                                        client_state={**client_state, **UNIVERSAL_INFO,
                                                      OPTIMIZER_NAMES:
                                                      optimizer_parameter_names(self.engine)})
        self.writer.save(_rng_state(), str(tag_dir / f"rng_rank{self.rank:05d}.pt"))
        self.in_flight = tag_dir, meta
        self._live_files = self.writer.live_host_state
        if not self.writer.background:
            self.finish()
        return tag_dir

    def writing(self) -> bool:
        """Whether this rank is still writing files of the save in flight (no collective)."""
        return self.writer.writing()

    def _files_written(self, tag_dir: Path) -> dict[str, tuple[int, int]] | str:
        """This rank's files of the save, {name in the step directory: (size, CRC32)}, once
        written; the writer's error as text if it failed."""
        try:
            return {str(Path(path).relative_to(tag_dir)): size_crc
                    for path, size_crc in self.writer.wait().items()}
        except Exception as exc:  # noqa: BLE001 - reported to every rank by `finish`
            return f"{type(exc).__name__}: {exc}"

    # ---- completing a save without collectives (`pretrain.training.hang`, a rank stuck in training) ---
    def pending(self) -> str | None:
        """The step directory name of the save in flight, None when there is none."""
        return self.in_flight[0].name if self.in_flight else None

    def written_without_collectives(self, *, timeout_s: float) -> dict[str, Any] | None:
        """This rank's written files of the save in flight (as `finish` gathers them), waiting
        up to `timeout_s` for the writer thread; None when it is still writing or failed."""
        if self.in_flight is None:
            return None
        if self._written is None:
            deadline = time.monotonic() + timeout_s
            while self.writer.writing() and time.monotonic() < deadline:
                time.sleep(0.1)  # polling the writer thread from the watchdog's
            if self.writer.writing():
                return None
            self._written = self._files_written(self.in_flight[0])
        return self._written if isinstance(self._written, dict) else None

    def complete_from(self, reports: list[dict[str, Any]]) -> Path:
        """Complete the save in flight from every rank's `written_without_collectives` (the
        manifest, `latest`, pruning), as `finish` does on rank 0: its directory."""
        tag_dir, meta = self.in_flight
        self._write_completion(tag_dir, meta, reports)
        return tag_dir

    def upload_without_collectives(self, written: dict[str, Any], *,
                                   timeout_s: float) -> str | None:
        """A run in the object store: upload this rank's files `written` of the save in flight
        now (a hang watchdog's exit; the background uploads of earlier saves are waited for,
        up to `timeout_s`, first). None when uploaded or there is no store, else what failed."""
        if self.store_url is None or self.in_flight is None:
            return None
        if not wait_for_uploads(timeout_s=timeout_s):
            return f"an earlier save was still uploading after {timeout_s:.0f} s"
        return upload_files(self.in_flight[0], written, self.store_url)

    def complete_upload_without_collectives(self, reports: list[dict[str, Any]]) -> str | None:
        """After `complete_from`, once every rank's `upload_without_collectives` succeeded:
        the rest of the save, `manifest.json` last, `latest`, pruning, now. None when done or
        there is no store, else what failed."""
        if self.store_url is None or self.in_flight is None:
            return None
        tag_dir = self.in_flight[0]
        try:
            complete_upload(tag_dir, self.store_url, uploaded={name for report in reports
                                                               for name in report})
            store_prune(self.store_url, keep_last=self.keep_last, keep_every=self.keep_every)
        except Exception as exc:  # noqa: BLE001 - reported by the watchdog
            return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
        return None

    def upload_records_without_collectives(self, own: list[Path], *, main: bool,
                                           timeout_s: float) -> str | None:
        """A run in the object store, before a hang watchdog's exit: this process's background
        uploads waited for (up to `timeout_s`), then rank 0 (`main`) uploads the run's changed
        files (metrics.jsonl with the hang record, hang/), another rank its files `own` (its
        dumps, on its node). None when done or there is no store, else what failed."""
        if self.store_url is None:
            return None
        if not wait_for_uploads(timeout_s=timeout_s):
            return f"a save was still uploading after {timeout_s:.0f} s"
        run_dir = self.ckpt_dir.parent
        try:
            if main:
                upload_run_files(run_dir, self.store_url)
            for path in own:
                if path.is_file():
                    put_file(path, join(self.store_url, *path.relative_to(run_dir).parts))
        except Exception as exc:  # noqa: BLE001 - reported by the watchdog
            return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
        return None

    def _write_completion(self, tag_dir: Path, meta: dict[str, Any],
                          reports: list[dict[str, Any]]) -> None:
        write_manifest(tag_dir, meta, {name: tuple(size_crc) for report in reports
                                       for name, size_crc in report.items()})
        write_latest(self.ckpt_dir, tag_dir.name)
        _prune(self.ckpt_dir, keep_last=self.keep_last, keep_every=self.keep_every)

    def finish(self) -> Path | None:
        """Complete the save in flight (collective): its directory, None when there is none.
        Raises `TrainingFault` on every rank when a rank could not write its files."""
        if self.in_flight is None:
            return None
        tag_dir, meta = self.in_flight
        self._live_files = False  # every rank waits for the files here
        try:
            self._written = self._files_written(tag_dir)
            reports = gather_for_io(self._written)  # every rank's files are on disk
        finally:  # (kept until here for a hang watchdog that completes the save instead)
            self.in_flight = self._written = None
        failed = [(rank, report) for rank, report in enumerate(reports) if isinstance(report, str)]
        if failed:
            rank, error = failed[0]
            raise TrainingFault(f"checkpoint {tag_dir} was not saved: rank {rank} could not "
                                f"write its files ({error}); the previous complete checkpoint "
                                "is still the one resuming starts from")
        if self.rank == 0:
            self._write_completion(tag_dir, meta, reports)
        if self.store_url is not None:
            self._upload(tag_dir, reports)
        wait_for_io()
        return tag_dir

    def _upload(self, tag_dir: Path, reports: list[dict[str, Any]]) -> None:
        """Start uploading the completed save to the store in the background
        (`pretrain.checkpoint.store.start_upload`: each rank its own files, rank 0 the manifest
        last once every rank's files are there); rank 0 uploads the run's changed files now
        (metrics.jsonl, which the training thread appends to, is read whole only here)."""
        listed = ({name: size_crc[0] for report in reports for name, size_crc in report.items()}
                  if self.rank == 0 else None)
        start_upload(tag_dir, self.store_url, mine=reports[self.rank], listed=listed,
                     keep_last=self.keep_last, keep_every=self.keep_every, log=log)
        if self.rank == 0:
            upload_run_files_or_warn(self.ckpt_dir.parent, self.store_url,
                                     log=functools.partial(log, level="warning"))


def host_resident_state(engine) -> bool:
    """Whether the engine's optimizer state (the bulk of a checkpoint) lives in host memory:
    on CPU ranks, and under ZeRO's CPU (or NVMe) offload."""
    if get_accelerator().device_name() == "cpu":
        return True
    params = engine.zero_offload_param()
    return engine.zero_use_cpu_optimizer() or (
        params is not None and getattr(params.device, "value", params.device) != "none")


def _prune(ckpt_dir: Path, *, keep_last: int, keep_every: int) -> None:
    complete = sorted((p for p in ckpt_dir.iterdir()
                       if tag_step(p) is not None and (p / MANIFEST).is_file()), key=tag_step)
    for old in complete[:-keep_last]:
        if not (keep_every and tag_step(old) % keep_every == 0):
            shutil.rmtree(old, ignore_errors=True)
