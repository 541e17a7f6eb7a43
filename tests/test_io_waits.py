"""Waits for file work sit on the file-work group, never on the collectives' (short) timeout.

NCCL's watchdog aborts a collective or send that waits longer than its timeout: at 70B, rank 0
writes `final/` for many minutes while the later pipeline stages wait to send their tensors, and
a synchronous save's ranks wait for the slowest writer. The tests give the default group a
2-second timeout (gloo enforces it on sends and barriers alike, as NCCL's watchdog does) and
hold one rank's file work for twice that, once its peer is known to be waiting.
"""
from __future__ import annotations

import datetime
import threading
import time
from pathlib import Path

import pytest

from pretrain.testing.ranks import run_on_ranks

COLLECTIVE_TIMEOUT_S = 2.0


def test_export_order_is_stage_and_layer_order():
    from pretrain.checkpoint.engine import export_order
    from pretrain.config import ModelConfig
    from pretrain.model.hf import expected_hf_keys

    names = export_order(expected_hf_keys(ModelConfig(num_layers=12, tie_embeddings=False)))
    assert names[0] == "model.embed_tokens.weight"
    assert names[-2:] == ["model.norm.weight", "lm_head.weight"]
    layers = [int(n.split(".")[2]) for n in names[1:-2]]
    assert layers == sorted(layers) and layers[0] == 0 and layers[-1] == 11
    assert names[1:10] == sorted(n for n in names if n.startswith("model.layers.0."))


def _entering_waits(marker: Path):
    """Patch this rank's blocking sends and barriers to create `marker` as they are entered."""
    import torch.distributed as dist

    def marking(op):
        def wrapped(*args, **kwargs):
            marker.touch()
            return op(*args, **kwargs)
        return wrapped

    dist.send, dist.barrier = marking(dist.send), marking(dist.barrier)


def _held_until(marker: Path) -> None:
    """Block until the peer created `marker` (it is waiting), then for twice the timeout."""
    while not marker.exists():
        time.sleep(0.01)
    time.sleep(2 * COLLECTIVE_TIMEOUT_S)


def _short_collective_timeout() -> None:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout

    dist.barrier()  # every rank is set up: only the waits under test remain
    _set_pg_timeout(datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S), None)


def _export_with_a_slow_writer(rank: int, world_size: int, out_dir: str, tokenizer: str) -> list:
    import types

    from pretrain.checkpoint import safetensors_stream
    from pretrain.checkpoint.engine import save_final
    from pretrain.config import load_config
    from pretrain.dist import create_io_group, init_deepspeed_comm
    from pretrain.model.build import build_for_layout
    from pretrain.resolve.topology import Topology

    init_deepspeed_comm(dist_backend="gloo", verbose=False)  # no shm inference op
    create_io_group(timeout_minutes=5)
    cfg = load_config(None, ["model.preset=tiny", "model.num_layers=4",
                             "model.tie_embeddings=false", "parallel.pipeline=2",
                             "train.precision=fp32", "deepspeed=ds_configs/zero0.json"])
    groups = Topology.from_parallel_config(cfg.parallel, world_size=world_size,
                                           rank=rank).create_groups()
    model = build_for_layout(cfg, groups)
    marker = Path(out_dir).parent / "last-stage-waits"
    written: list[str] = []
    if rank == 0:
        write = safetensors_stream.SafetensorsWriter.write

        def slow_write(self, name, tensor):
            if name == "model.embed_tokens.weight":  # stage 0's first: stage 1 waits meanwhile
                _held_until(marker)
            written.append(name)
            return write(self, name, tensor)

        safetensors_stream.SafetensorsWriter.write = slow_write
    _short_collective_timeout()
    if rank == 1:
        _entering_waits(marker)
    save_final(types.SimpleNamespace(module=model), cfg=cfg, groups=groups,
               tokenizer=types.SimpleNamespace(path=tokenizer), run_dir=Path(out_dir), step=1,
               main=rank == 0)
    return written


@pytest.mark.slow
def test_final_export_outlasts_a_short_collective_timeout(tiny_data, tmp_path):
    """pp 2: rank 0 writes the embedding for longer than the collective timeout while stage 1
    waits to send its layers; the export completes, in stage and layer order."""
    from safetensors import safe_open

    written = run_on_ranks(_export_with_a_slow_writer, world_size=2, tmp_path=tmp_path,
                           args=(str(tmp_path / "run"), tiny_data["tokenizer"]),
                           timeout_s=120)[0]
    assert written[0] == "model.embed_tokens.weight" and written[-1] == "lm_head.weight"
    assert [int(n.split(".")[2]) for n in written[1:-2]] == sorted(
        int(n.split(".")[2]) for n in written[1:-2])
    with safe_open(str(tmp_path / "run" / "final" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(written)


def _sync_save_with_a_slow_rank(rank: int, world_size: int, out_dir: str) -> bool:
    from pretrain.checkpoint import Saver, writer
    from pretrain.dist import create_io_group

    create_io_group(timeout_minutes=5)
    cfg, engine = _zero1_engine(out_dir, world_size)
    marker = Path(out_dir) / "rank0-waits"
    write = writer._write_file

    def slow_write(path, state):
        if rank == 1 and path.endswith("optim_states.pt"):
            _held_until(marker)
        done = write(path, state)
        if rank == 0 and path.endswith("optim_states.pt"):  # rank 0's last file of DeepSpeed's
            _entering_waits(marker)
        return done

    writer._write_file = slow_write
    saver = Saver(engine, ckpt_dir=Path(out_dir) / "checkpoints", keep_last=1, keep_every=0,
                  rank=rank, background=False)
    _short_collective_timeout()
    layout = {"tensor": 1, "pipeline": 1, "data": world_size, "world_size": world_size,
              "zero_stage": 1}
    tag = saver.save(client_state={"step": 1}, meta={
        "step": 1, "consumed_samples": 0, "global_batch": world_size, "config": cfg.to_dict(),
        "layout": layout})
    return (tag / "manifest.json").is_file()


def _zero1_engine(run_dir: str, world_size: int):
    import deepspeed

    from pretrain.config import load_config
    from pretrain.resolve.run import resolve_ds_config
    from pretrain.training.engine import param_groups
    from pretrain.model import build_model
    from pretrain.testing.runs import REPO

    cfg = load_config(REPO / "configs/tiny.yaml", [
        "deepspeed=ds_configs/zero1.json", "train.precision=fp32", "model.vocab_size=512",
        "train.micro_batch_size=1", f"train.global_batch_size={world_size}",
        f"run_dir={run_dir}"])
    ds_config = resolve_ds_config(cfg, world_size=world_size, accelerator="cpu")
    model = build_model(cfg.model, seed=1, tp_group=None, sequence_parallel=False)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config,
                                      model_parameters=param_groups(model, 0.1))
    return cfg, engine


@pytest.mark.slow
def test_synchronous_save_outlasts_a_short_collective_timeout(tmp_path):
    """Rank 1 writes its files for longer than the collective timeout while rank 0, done with
    its own, waits at the save's barrier: the save completes."""
    assert run_on_ranks(_sync_save_with_a_slow_rank, world_size=2, tmp_path=tmp_path,
                        args=(str(tmp_path),), timeout_s=120) == [True, True]
