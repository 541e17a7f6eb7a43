"""Checkpoint save throughput against a plain sequential write of the same bytes, and resume time.

Two ranks (gloo, ZeRO-1, fp32, a ~30M-parameter model) take one step, then save real checkpoints
with `pretrain.checkpoint.engine.save` (DeepSpeed shards + RNG states + manifest + atomic `latest`).
The baseline, in the same run and directory: rank 0 writes the same number of bytes to one
file in 16 MiB chunks. Both are timed with and without a closing `os.sync()` (page cache vs
on disk); rounds alternate so drift in the machine's load hits both alike. Resume time is
`find_resume` (manifest check) + `checkpoint.load` on both ranks.

    .venv/bin/python bench/checkpoint_save.py          # ~2 minutes on 2 cores
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from common import machine, median
from pretrain.testing.ranks import run_on_ranks

OVERRIDES = ["model.preset=small", "model.num_layers=8", "model.vocab_size=8192",
             "model.seq_length=64", "train.micro_batch_size=1", "train.global_batch_size=2",
             "deepspeed=ds_configs/zero1.json", "train.precision=fp32"]
ROUNDS = 5


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _sequential_write(path: Path, nbytes: int, *, sync: bool) -> float:
    chunk = os.urandom(16 << 20)
    start = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(chunk[:min(left, len(chunk))])
    if sync:
        os.sync()
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed


def _rank(rank: int, world_size: int, out_dir: str) -> dict:
    import deepspeed
    import torch
    import torch.distributed as dist

    from pretrain import checkpoint
    from pretrain.config import load_config
    from pretrain.ds_config import resolve_ds_config
    from pretrain.model import build_model
    from pretrain.engine import param_groups

    cfg = load_config("configs/tiny.yaml", OVERRIDES + [f"run_dir={out_dir}"])
    ds_config = resolve_ds_config(cfg, world_size=world_size, accelerator="cpu")
    model = build_model(cfg.model, seed=1, tp_group=None, sequence_parallel=False)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config,
                                      model_parameters=param_groups(model, 0.1))
    ids = torch.randint(0, cfg.model.vocab_size, (1, cfg.model.seq_length))
    engine.backward(engine(ids, labels=ids))
    engine.step()  # optimizer states exist: the checkpoint has its full size

    ckpt_dir = Path(out_dir) / "checkpoints"
    meta = {"step": 0, "consumed_samples": 0, "config": cfg.to_dict(), "global_batch": 2,
            "layout": {"tensor": 1, "pipeline": 1, "data": world_size, "world_size": world_size,
                       "zero_stage": 1}}
    times: dict[str, list[float]] = {"save": [], "write": [], "save_sync": [], "write_sync": []}
    nbytes = 0
    checkpoint.save(engine, ckpt_dir=ckpt_dir, meta=meta, client_state={}, keep_last=1,
                    keep_every=0, rank=rank)  # warm-up: first-save costs (directories, imports)
    for i in range(2 * ROUNDS):
        sync = i % 2 == 1
        dist.barrier()
        start = time.perf_counter()
        tag = checkpoint.save(engine, ckpt_dir=ckpt_dir, meta={**meta, "step": i + 1},
                              client_state={"step": i + 1}, keep_last=1, keep_every=0, rank=rank)
        if sync:
            os.sync()
        dist.barrier()
        times["save_sync" if sync else "save"].append(time.perf_counter() - start)
        if rank == 0:
            nbytes = _dir_bytes(tag)
            times["write_sync" if sync else "write"].append(
                _sequential_write(Path(out_dir) / "plain.bin", nbytes, sync=sync))
        dist.barrier()

    resume = []
    for _ in range(ROUNDS):
        dist.barrier()
        start = time.perf_counter()
        point = checkpoint.find_resume(cfg, world_size=world_size, resume_from=None,
                                       log=lambda text: None)
        checkpoint.load(engine, point, rank=rank, world_size=world_size)
        dist.barrier()
        resume.append(time.perf_counter() - start)
    return {"bytes": nbytes, "times": times, "resume": resume,
            "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parents[1] / ".build") as tmp:
        result = run_on_ranks(_rank, world_size=2, tmp_path=Path(tmp), args=(tmp,),
                              timeout_s=600)[0]
    t, nbytes = result["times"], result["bytes"]
    print(f"machine: {machine()}; 2 ranks, ZeRO-1 fp32, {result['params'] / 1e6:.1f}M parameters, "
          f"checkpoint {nbytes / 2**20:.1f} MiB; medians of {ROUNDS} rounds")
    for label, save, write in (("page cache", "save", "write"), ("with os.sync()", "save_sync",
                                                                 "write_sync")):
        s, w = median(t[save]), median(t[write])
        print(f"{label:15s} checkpoint save {nbytes / s / 2**20:8.1f} MiB/s ({s:.2f}s) | plain "
              f"write {nbytes / w / 2**20:8.1f} MiB/s ({w:.2f}s) | ratio {w / s:.2f} (target >= 0.5)")
    print(f"resume (verify manifest + load on both ranks): median {median(result['resume']):.2f}s")


if __name__ == "__main__":
    main()
