"""Checkpoint saves: synchronous against a plain write, what a background save costs training,
and resume time.

Two ranks (gloo, ZeRO-1, fp32, a ~16M-parameter model) take one step, then save real
checkpoints with `pretrain.checkpoint.Saver` (DeepSpeed shards + RNG states, every file fsync'd,
manifest with checksums, atomic `latest`), in rounds that alternate so drift in the machine's
load hits every mode alike:

- synchronous: the time `save` takes; the baseline, in the same directory, is rank 0 writing
  the same number of bytes to one file in 16 MiB chunks, fsync'd;
- background write: a background save finished at once (`save` + `finish`, no training in
  between), against the same plain write: the writer thread's own rate;
- background (`checkpoint.async_save`): the time training is blocked (the call to `save`,
  until it returns), against the synchronous save of the same state; then training steps go on
  while the files are written, until no rank is writing (agreed by an all-reduce after each
  step, as the trainer does), and their rate is compared with as many steps without a save;
- resume: `find_resume` (the manifest's sizes) + `confirm_content` (checksums, each rank its
  share of the files) + `checkpoint.load` on both ranks.

    .venv/bin/python bench/checkpoint_save.py          # ~30 s on 2 cores
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from common import machine, median, tiny_zero1_engine, train_step, zero1_layout
from pretrain.testing.ranks import run_on_ranks

OVERRIDES = ["model.preset=small", "model.num_layers=8", "model.vocab_size=8192",
             "model.seq_length=64", "train.micro_batch_size=1", "train.global_batch_size=2",
             "deepspeed=ds_configs/zero1.json", "train.precision=fp32"]
ROUNDS = 5


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _sequential_write(path: Path, nbytes: int) -> float:
    chunk = os.urandom(16 << 20)
    start = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(chunk[:min(left, len(chunk))])
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed


def _rank(rank: int, world_size: int, out_dir: str) -> dict:
    import torch
    import torch.distributed as dist

    from pretrain import checkpoint

    engine, cfg = tiny_zero1_engine(OVERRIDES, out_dir=out_dir, world_size=world_size)

    def one_step() -> None:
        train_step(engine, cfg)

    def anyone_writing(saver) -> bool:  # the trainer's per-step agreement
        flag = torch.tensor([float(saver.writing())])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    one_step()  # optimizer states exist: the checkpoint has its full size
    ckpt_dir = Path(out_dir) / "checkpoints"
    layout = zero1_layout(world_size)
    savers = {mode: checkpoint.Saver(engine, ckpt_dir=ckpt_dir, keep_last=1, keep_every=0,
                                     rank=rank, background=mode == "background")
              for mode in ("sync", "background")}
    step = 0

    def save(mode: str) -> Path:
        nonlocal step
        step += 1
        return savers[mode].save(client_state={"step": step}, meta={
            "step": step, "consumed_samples": 0, "config": cfg.to_dict(), "global_batch": 2,
            "layout": layout})

    times: dict[str, list[float]] = {k: [] for k in ("sync", "write", "background_write",
                                                     "blocked", "during", "without")}
    steps_during: list[int] = []
    nbytes = 0
    save("sync")  # warm-up: first-save costs (directories, imports)
    save("background")
    savers["background"].finish()
    for _ in range(ROUNDS):
        dist.barrier()
        start = time.perf_counter()
        tag = save("sync")
        dist.barrier()
        times["sync"].append(time.perf_counter() - start)
        if rank == 0:
            nbytes = _dir_bytes(tag)
            times["write"].append(_sequential_write(Path(out_dir) / "plain.bin", nbytes))

        dist.barrier()
        start = time.perf_counter()
        save("background")
        savers["background"].finish()
        dist.barrier()
        times["background_write"].append(time.perf_counter() - start)

        dist.barrier()
        start = time.perf_counter()
        save("background")
        times["blocked"].append(time.perf_counter() - start)
        start, n = time.perf_counter(), 0
        while True:
            one_step()
            n += 1
            if not anyone_writing(savers["background"]):
                break
        times["during"].append(time.perf_counter() - start)
        steps_during.append(n)
        savers["background"].finish()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            one_step()
            anyone_writing(savers["background"])
        times["without"].append(time.perf_counter() - start)

    resume = []
    for _ in range(ROUNDS):
        dist.barrier()
        start = time.perf_counter()
        point = checkpoint.find_resume(cfg, resume_from=None, log=lambda text: None)
        point = checkpoint.confirm_content(point, cfg, resume_from=None, log=lambda text: None)
        checkpoint.load(engine, point, cfg=cfg, groups=None, layout=layout, rank=rank)
        dist.barrier()
        resume.append(time.perf_counter() - start)
    return {"bytes": nbytes, "times": times, "steps_during": steps_during, "resume": resume,
            "params": sum(p.numel() for p in engine.module.parameters())}


def main() -> None:
    with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parents[1] / ".build") as tmp:
        result = run_on_ranks(_rank, world_size=2, tmp_path=Path(tmp), args=(tmp,),
                              timeout_s=600)[0]
    t, nbytes = result["times"], result["bytes"]
    print(f"machine: {machine()}; 2 ranks, ZeRO-1 fp32, {result['params'] / 1e6:.1f}M parameters, "
          f"checkpoint {nbytes / 2**20:.1f} MiB; medians of {ROUNDS} rounds")
    s, w = median(t["sync"]), median(t["write"])
    print(f"synchronous save {nbytes / s / 2**20:8.1f} MiB/s ({s:.2f}s) | plain write + fsync "
          f"{nbytes / w / 2**20:8.1f} MiB/s ({w:.2f}s) | ratio {w / s:.2f} (target >= 0.8)")
    bw = median(t["background_write"])
    print(f"background write  {nbytes / bw / 2**20:8.1f} MiB/s ({bw:.2f}s) | plain write + fsync "
          f"{nbytes / w / 2**20:8.1f} MiB/s | ratio {w / bw:.2f} (target >= 0.8)")
    b = median(t["blocked"])
    print(f"background save: training blocked {b:.3f}s vs {s:.2f}s synchronous | ratio "
          f"{b / s:.3f} (target <= 0.2)")
    n = result["steps_during"]
    during = [k / x for k, x in zip(n, t["during"])]
    without = [k / x for k, x in zip(n, t["without"])]
    ratio = median([x / y for x, y in zip(t["without"], t["during"])])
    print(f"steps/s while the background save writes {median(during):.1f} vs {median(without):.1f}"
          f" without a save | ratio {ratio:.2f} (target >= 0.8; {n} steps per round)")
    print(f"resume (manifest sizes and checksums + load on both ranks): median "
          f"{median(result['resume']):.2f}s")


if __name__ == "__main__":
    main()
