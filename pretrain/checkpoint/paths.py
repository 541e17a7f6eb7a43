"""Names and small files of a run directory, and which checkpoint directory a path means.

Nothing here loads tensors: resuming and the readers of weights decide from these files alone
which checkpoint to open. Every small file goes through `pretrain.files.write_text_atomic`, so a reader sees the
old file or the new one, never half of one.
"""
from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

from pretrain.data.tokenizer import COPIED_DIR, COPIED_MODEL
from pretrain.errors import CheckpointError
from pretrain.files import write_text_atomic

CHECKPOINTS = "checkpoints"  # <run_dir>/checkpoints/step<N>/
FINAL = "final"  # <run_dir>/final/
FINAL_WEIGHTS = "model.safetensors"
FINAL_CONFIG = "config.yaml"
# the tokenizer's copy (`copy_tokenizer`): a sentencepiece model, or a Hugging Face tokenizer's
# files (import-hf of a non-sentencepiece one)
FINAL_TOKENIZER, FINAL_TOKENIZER_DIR = COPIED_MODEL, COPIED_DIR
LATEST = "latest"
META = "meta.json"
MANIFEST = "manifest.json"
STOPPED = "stopped.json"
# in a step directory staged from the object store by ranges (`store.stage_run(ranged=True)`):
# the files left in the store, read by byte ranges; their CRC32 is not checked here
RANGED_MARK = ".ranged.json"
_MODEL_STATES = "*mp_rank_*_model_states.pt"  # DeepSpeed's per-model-parallel-rank files


def tag_step(path: Path) -> int | None:
    """N of a `step<N>` directory, None for anything else."""
    name = path.name
    return int(name[4:]) if name.startswith("step") and name[4:].isdigit() else None


def _is_step_dir(path: Path) -> bool:
    return (tag_step(path) is not None or (path / META).is_file()
            or any(path.glob(_MODEL_STATES)))


def step_dirs(path: str | Path, *, follow_latest: bool = False) -> list[Path]:
    """The engine checkpoint directories that `path` (a run dir, its checkpoints/ dir or a step
    dir) names; a step dir names itself.

    Two modes, for two kinds of callers:
    - `follow_latest=False` (resuming): every `step<N>` directory, newest first, complete or not;
      the caller verifies them and falls back past damaged ones.
    - `follow_latest=True` (readers of weights): only the directory `latest` names, the last
      save that finished; [] when there is no `latest`.
    """
    path = Path(path)
    if (path / CHECKPOINTS).is_dir():
        path = path / CHECKPOINTS
    if _is_step_dir(path):
        return [path]
    if not path.is_dir():
        return []
    if follow_latest:
        latest = path / LATEST
        if not latest.is_file():
            return []
        step = path / latest.read_text().strip()
        if not step.is_dir():
            raise CheckpointError(f"{latest} names {step.name!r}, which does not exist: "
                                  "pass a checkpoints/step<N> directory instead")
        return [step]
    return sorted((p for p in path.iterdir() if p.is_dir() and tag_step(p) is not None),
                  key=tag_step, reverse=True)


def verify(tag_dir: Path, *, content: bool = False,
           share: tuple[int, int] = (0, 1)) -> str | None:
    """What is wrong with a checkpoint directory (None: complete and undamaged).

    Checks that the save finished (manifest present) and that every file it lists is there
    with the size it had when written: a truncated or missing shard is found without reading it.
    With `content` the files are also read and their CRC32 compared with the ones their writers
    computed, so damage that keeps the size (a flipped byte) is found too; `share` = (i, n)
    reads only every n-th file from the i-th (n ranks share the reading: `confirm_content`).
    Manifests written before checksums were recorded are checked by size only.
    """
    if not (tag_dir / MANIFEST).is_file():
        return "incomplete (no manifest.json: the save did not finish)"
    try:
        manifest = json.loads((tag_dir / MANIFEST).read_text())
        files, checksums = manifest["files"], manifest.get("crc32", {}) if content else {}
    except (OSError, ValueError, KeyError) as exc:
        return f"unreadable manifest.json ({exc})"
    for name, size in files.items():
        path = tag_dir / name
        if not path.is_file():
            return f"missing file {name}"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} were written (truncated?)"
    index, count = share
    mark = tag_dir / RANGED_MARK  # files left in the store: the size only (the store's own
    ranged = set(json.loads(mark.read_text())["files"]) if mark.is_file() else set()  # checksums)
    for name, crc in [item for item in sorted(checksums.items())
                      if item[0] not in ranged][index::count]:
        found = file_crc32(tag_dir / name)
        if found != crc:
            return (f"{name} is damaged: its content has CRC32 {found:08x}, {crc:08x} was "
                    "written")
    try:
        read_meta(tag_dir)
    except (OSError, ValueError) as exc:
        return f"unreadable meta.json ({exc})"
    return None


def file_crc32(path: Path) -> int:
    """The CRC32 of a file's bytes (zlib's, as the checkpoint writer computes it)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def read_meta(tag_dir: Path) -> dict[str, Any]:
    """The `meta.json` of a checkpoint directory (step, layout, config, tokenizer, commit)."""
    return json.loads((tag_dir / META).read_text())


def write_manifest(tag_dir: Path, meta: dict[str, Any],
                   written: dict[str, tuple[int, int]] | None = None) -> None:
    """Write meta.json, then manifest.json (size and CRC32 of every file): the completion marker.

    `written` holds the (size, CRC32) of files by their names in `tag_dir`, as their writers
    computed them (`pretrain.checkpoint.writer`); any other file is measured and read here.
    """
    write_text_atomic(tag_dir / META, json.dumps(meta, indent=2))
    written = dict(written or {})
    for p in sorted(tag_dir.rglob("*")):
        name = str(p.relative_to(tag_dir))
        if p.is_file() and p.name != MANIFEST and name not in written:
            written[name] = (p.stat().st_size, file_crc32(p))
    names = sorted(written)
    write_text_atomic(tag_dir / MANIFEST, json.dumps(
        {"files": {n: written[n][0] for n in names}, "crc32": {n: written[n][1] for n in names}},
        indent=1))


def write_latest(ckpt_dir: Path, tag: str) -> None:
    """Point `latest` at `tag` (DeepSpeed's format: the tag name alone)."""
    write_text_atomic(ckpt_dir / LATEST, tag)


def mark_stopped(run_dir: Path, *, step: int, reason: str, exit_code: int) -> None:
    """`<run_dir>/stopped.json`: why and where the run stopped early, for job scripts whose
    launcher does not pass the ranks' exit status on (torchrun exits 1 whatever they return)."""
    write_text_atomic(run_dir / STOPPED, json.dumps({"exit_code": exit_code, "reason": reason,
                                                      "step": step}))


def clear_stopped(run_dir: Path) -> None:
    """Remove `stopped.json` when a run starts again."""
    (run_dir / STOPPED).unlink(missing_ok=True)
