"""What one rank reads to reshard a checkpoint: its own pieces against whole tensors.

Two ranks (gloo, ZeRO-1 at dp 2, fp32, the small preset at 8 layers, ~30M parameters) take one
step and save a real checkpoint (`pretrain.checkpoint.Saver`). Then one process plays rank 0 of a
new layout, tensor parallel 2 x data parallel 2, and reads the fp32 master and both Adam moments
of every parameter two ways, in alternating rounds:

- pieces (what `reshard.load_resharded` does): its ZeRO partition (a quarter of each tensor,
  cut as ZeRO-3 cuts a parameter; a ZeRO-1/2 rank's partition is as large) of its
  tensor-parallel shard, through `reshard.read_shard_piece`;
- whole (the previous reshard): every tensor whole (`weights.engine_tensors`), then its shard.

Printed: bytes copied out of the files and seconds per way, and their ratios (measured in the
same run). Page-cache state is whatever the save left (the files were just written).

With `--store` the checkpoint is uploaded to a local S3 store (SeaweedFS,
`pretrain.testing.seaweedfs`) as a run directory, and the same rank reads its pieces from a
fresh node two ways: staged by ranges (`store.stage_run(ranged=True)`: the tensor files left in
the store, each piece read by ranged GETs) against staged whole (the checkpoint downloaded, then
the pieces read from the copy). Printed: bytes from the store (client-counted,
`storage.TRAFFIC`: staging, zip directories and pickles included) and seconds, and the ratios.

    .venv/bin/python bench/reshard_read.py          # a few minutes on 2 loaded cores
    .venv/bin/python bench/reshard_read.py --store  # the same, read from a local S3 store
"""
from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

from common import machine, median, tiny_zero1_engine, train_step, zero1_layout
from pretrain.testing.ranks import run_on_ranks

OVERRIDES = ["model.preset=small", "model.num_layers=8", "model.vocab_size=8192",
             "model.seq_length=64", "train.micro_batch_size=1", "train.global_batch_size=2",
             "deepspeed=ds_configs/zero1.json", "train.precision=fp32"]
NEW_TP, NEW_DP, ROUNDS = 2, 2, 3


def _save(rank: int, world_size: int, out_dir: str) -> None:
    from pretrain import checkpoint

    engine, cfg = tiny_zero1_engine(OVERRIDES, out_dir=out_dir, world_size=world_size)
    train_step(engine, cfg)
    layout = zero1_layout(world_size)
    saver = checkpoint.Saver(engine, ckpt_dir=Path(out_dir) / "checkpoints", keep_last=1,
                             keep_every=0, rank=rank, background=False)
    saver.save(client_state={"step": 1, "config": cfg.to_dict()},
               meta={"step": 1, "consumed_samples": 0, "config": cfg.to_dict(),
                     "global_batch": 2, "layout": layout})
    saver.finish()


def _read(step_dir: Path, cfg, *, pieces: bool) -> tuple[int, float]:
    """(bytes copied out, seconds) for rank 0 of tp NEW_TP x dp NEW_DP."""
    from pretrain.checkpoint.reshard import ADAM_MOMENTS, read_shard_piece
    from pretrain.checkpoint.weights import engine_tensors
    from pretrain.model.llama import shard_of, shard_range

    start = time.perf_counter()
    sources = [engine_tensors(step_dir)] + [engine_tensors(step_dir, k) for k in ADAM_MOMENTS]
    copied = 0
    for name in sources[0]:
        where = shard_range(name, cfg, tp_rank=0, tp_size=NEW_TP)
        numel = math.prod(where.shape)
        per_rank = math.ceil(numel / NEW_DP)
        for source in sources:
            if pieces:
                piece = read_shard_piece(source, name, where, (0, min(per_rank, numel)), cfg=cfg)
            else:
                whole = source[name]
                copied += whole.numel() * whole.element_size()
                piece = shard_of(whole, name, cfg=cfg, tp_rank=0, tp_size=NEW_TP).clone()
            del piece
    if pieces:
        copied = sum(source.bytes_read for source in sources)
    return copied, time.perf_counter() - start


def _from_store(step_dir: Path, cfg, scratch: Path) -> None:
    """Upload `step_dir` as a run's checkpoint to a local S3 store; print what rank 0 of the
    new layout reads from it staged by ranges against staged whole."""
    import os

    from pretrain import storage
    from pretrain.checkpoint import store
    from pretrain.testing.seaweedfs import SeaweedServer

    server = SeaweedServer(scratch / "seaweedfs", volumes=16)
    server.start()
    os.environ.update(server.env())
    try:
        storage.filesystem().mkdir("bench")
        url = "s3://bench/run"
        names = sorted(p.name for p in step_dir.iterdir() if p.is_file())
        assert store.upload_files(step_dir, [n for n in names if n != "manifest.json"],
                                  url) is None
        store.complete_upload(step_dir, url, uploaded=set(names) - {"manifest.json"})
        size = sum(p.stat().st_size for p in step_dir.iterdir() if p.is_file())
        results: dict[str, list[tuple[int, float]]] = {"ranged": [], "whole": []}
        for r in range(ROUNDS):
            for way in ("whole", "ranged"):
                os.environ["TMPDIR"] = str(scratch / f"node-{way}{r}")  # a fresh node
                store._LOADED.clear()
                before, start = storage.TRAFFIC.read, time.perf_counter()
                local = store.stage_run(url, log=lambda text: None, ranged=way == "ranged")
                _read(local / "checkpoints" / step_dir.name, cfg, pieces=True)
                results[way].append((storage.TRAFFIC.read - before,
                                     time.perf_counter() - start))
    finally:
        server.stop()
    ranged_b, whole_b = results["ranged"][0][0], results["whole"][0][0]
    ranged_s = median([s for _, s in results["ranged"]])
    whole_s = median([s for _, s in results["whole"]])
    print(f"from the store (SeaweedFS on this machine), checkpoint {size / 1e6:.1f} MB:")
    print(f"ranged: {ranged_b / 1e6:.1f} MB from the store in {ranged_s:.2f} s")
    print(f"whole:  {whole_b / 1e6:.1f} MB from the store in {whole_s:.2f} s")
    print(f"ratio ranged/whole: bytes {ranged_b / whole_b:.3f}, time {ranged_s / whole_s:.3f}")


def main() -> None:
    import sys

    from pretrain.checkpoint.paths import step_dirs
    from pretrain.config import load_config

    with tempfile.TemporaryDirectory(dir=Path.cwd()) as out:
        run_on_ranks(_save, world_size=2, tmp_path=Path(out), args=(out,), timeout_s=1200)
        step_dir = next(iter(step_dirs(Path(out) / "checkpoints", follow_latest=True)))
        size = sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())
        cfg = load_config("configs/tiny.yaml", OVERRIDES).model
        if "--store" in sys.argv[1:]:
            print(f"machine: {machine()}; reader: rank 0 of tp {NEW_TP} x dp {NEW_DP}, "
                  f"median of {ROUNDS} rounds")
            _from_store(step_dir, cfg, Path(out))
            return
        results: dict[str, list[tuple[int, float]]] = {"pieces": [], "whole": []}
        for _ in range(ROUNDS):
            for way in ("whole", "pieces"):
                results[way].append(_read(step_dir, cfg, pieces=way == "pieces"))
    piece_bytes, whole_bytes = results["pieces"][0][0], results["whole"][0][0]
    piece_s = median([s for _, s in results["pieces"]])
    whole_s = median([s for _, s in results["whole"]])
    print(f"machine: {machine()}")
    print(f"checkpoint: {size / 1e6:.1f} MB (ZeRO-1, dp 2, fp32); reader: rank 0 of tp "
          f"{NEW_TP} x dp {NEW_DP}, median of {ROUNDS} rounds")
    print(f"pieces: read {piece_bytes / 1e6:.1f} MB in {piece_s:.2f} s")
    print(f"whole:  read {whole_bytes / 1e6:.1f} MB in {whole_s:.2f} s")
    print(f"ratio pieces/whole: bytes {piece_bytes / whole_bytes:.3f}, time "
          f"{piece_s / whole_s:.3f}")


if __name__ == "__main__":
    main()
