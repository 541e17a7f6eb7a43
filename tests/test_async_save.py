"""Checkpoints written in the background, and checksums that find damage of the same size.

A background save copies the state to host memory and returns; a thread writes the files while
training changes the live tensors, and the save becomes complete (manifest, `latest`) only when
`finish` finds every rank's files on disk. The tests hold the writer on an event (or kill the
process while it writes) to put training, or a crash, exactly inside the write.
"""
from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pretrain.testing.ranks import run_on_ranks
from pretrain.testing.runs import REPO, train

pytestmark = pytest.mark.slow  # DeepSpeed engines and training runs (quick tier: not slow)


def _overrides(run_dir, world_size: int) -> list[str]:
    return ["deepspeed=ds_configs/zero1.json", "train.precision=fp32", "model.vocab_size=512",
            "train.micro_batch_size=1", f"train.global_batch_size={world_size}",
            f"run_dir={run_dir}"]


def _engine(run_dir, world_size: int):
    """(config, ZeRO-1 engine) of the tiny model on this rank (the process group exists)."""
    import deepspeed

    from pretrain.config import load_config
    from pretrain.resolve.run import resolve_ds_config
    from pretrain.training.engine import param_groups
    from pretrain.model import build_model

    cfg = load_config(REPO / "configs/tiny.yaml", _overrides(run_dir, world_size))
    ds_config = resolve_ds_config(cfg, world_size=world_size, accelerator="cpu")
    model = build_model(cfg.model, seed=1, tp_group=None, sequence_parallel=False)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config,
                                      model_parameters=param_groups(model, 0.1))
    return cfg, engine


def _train_step(cfg, engine, seed: int) -> None:
    import torch

    ids = torch.randint(0, cfg.model.vocab_size, (1, cfg.model.seq_length),
                        generator=torch.Generator().manual_seed(seed))
    engine.backward(engine(ids, labels=ids))
    engine.step()


def _meta(cfg, step: int, world_size: int) -> dict:
    return {"step": step, "consumed_samples": step * world_size, "global_batch": world_size,
            "config": cfg.to_dict(), "layout": {"tensor": 1, "pipeline": 1, "data": world_size,
                                                "world_size": world_size, "zero_stage": 1}}


def _save_while_training(rank: int, world_size: int, out: str) -> bool:
    """Step 1 saved twice from the same state: at once into sync/, in the background into
    background/ with the writer held until the next training step reaches its optimizer step
    (which waits for the write on CPU ranks, whose state the writer reads in place), and that
    step has changed the live weights and optimizer states; then a background save of step 2,
    which first finishes step 1."""
    import torch

    from pretrain.checkpoint import Saver, writer

    cfg, engine = _engine(out, world_size)
    _train_step(cfg, engine, seed=0)
    savers = {mode: Saver(engine, ckpt_dir=Path(out) / mode, keep_last=2, keep_every=0,
                          rank=rank, background=mode == "background")
              for mode in ("sync", "background")}
    savers["sync"].save(meta=_meta(cfg, 1, world_size), client_state={"step": 1})
    assert savers["sync"].in_flight is None

    release, write = threading.Event(), writer._write_file

    def held(path, state):
        release.wait()
        return write(path, state)

    writer._write_file = held
    try:
        background = savers["background"]
        background.save(meta=_meta(cfg, 1, world_size), client_state={"step": 1})
        assert background.writing() and background.in_flight is not None
        before = [p.detach().clone() for p in engine.module.parameters()]
        # on CPU ranks the writer reads the live state: the optimizer step waits for the write,
        # and the writer goes on only once the step is waiting
        written = background.writer.written
        background.writer.written = lambda: (release.set(), written())
        _train_step(cfg, engine, seed=1)  # training goes on while the writer is held
        changed = any(not torch.equal(a, p) for a, p in zip(before, engine.module.parameters()))
        assert not (Path(out) / "background" / "latest").exists()
        release.set()
    finally:
        writer._write_file = write
    background.save(meta=_meta(cfg, 2, world_size), client_state={"step": 2})
    assert background.finish() == Path(out) / "background" / "step2"
    return changed


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("saved")
    assert run_on_ranks(_save_while_training, world_size=2, tmp_path=out, args=(str(out),),
                        timeout_s=300) == [True, True]
    return out


def _files(step_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(step_dir)): p.read_bytes()
            for p in sorted(step_dir.rglob("*")) if p.is_file()}


def test_background_save_writes_the_state_it_was_given_bitwise(saved):
    from pretrain.checkpoint.paths import verify

    sync, background = _files(saved / "sync" / "step1"), _files(saved / "background" / "step1")
    assert {"rng_rank00000.pt", "rng_rank00001.pt", "mp_rank_00_model_states.pt",
            "manifest.json", "meta.json"} <= set(sync)
    assert any(name.endswith("optim_states.pt") for name in sync)
    assert background == sync  # every file, the manifest's checksums included
    manifest = json.loads(background["manifest.json"])
    assert set(manifest["crc32"]) == set(manifest["files"]) == set(background) - {"manifest.json"}
    assert (saved / "background" / "latest").read_text() == "step2"
    assert verify(saved / "background" / "step1", content=True) is None
    assert verify(saved / "background" / "step2", content=True) is None


def test_a_flipped_byte_is_found_and_resume_falls_back(saved, tmp_path):
    from pretrain.checkpoint import confirm_content, find_resume
    from pretrain.checkpoint.paths import verify
    from pretrain.config import load_config

    shutil.copytree(saved / "background", tmp_path / "checkpoints")
    ckpts = tmp_path / "checkpoints"
    shard = next((ckpts / "step2").glob("*rank_1_*optim_states.pt"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # the same size: only the content check can tell
    shard.write_bytes(bytes(data))
    assert verify(ckpts / "step2") is None
    problem = verify(ckpts / "step2", content=True)
    assert problem.startswith(f"{shard.name} is damaged: its content has CRC32"), problem

    log: list[str] = []
    cfg = load_config(REPO / "configs/tiny.yaml", _overrides(tmp_path, 2))
    point = find_resume(cfg, resume_from=None, log=log.append)  # sizes: before the group
    assert point.path == ckpts / "step2" and not log
    point = confirm_content(point, cfg, resume_from=None, log=log.append)  # contents: after
    assert point.path == ckpts / "step1"
    assert log[0].startswith(f"[resume] skipping {ckpts / 'step2'}: {shard.name} is damaged")
    assert log[-1] == f"[resume] falling back to {ckpts / 'step1'} (newer ones are damaged or " \
                      "incomplete)"


def test_a_manifest_without_checksums_is_checked_by_size(saved, tmp_path):
    from pretrain.checkpoint.paths import verify

    step = shutil.copytree(saved / "background" / "step1", tmp_path / "step1")
    manifest = json.loads((step / "manifest.json").read_text())
    (step / "manifest.json").write_text(json.dumps({"files": manifest["files"]}))
    assert verify(step, content=True) is None
    shard = next(step.glob("*optim_states.pt"))
    shard.write_bytes(shard.read_bytes()[:-1])
    assert verify(step).startswith(f"{shard.name} has ")


def _one_rank_cannot_write(rank: int, world_size: int, out: str) -> str:
    """A complete save of step 1, then a background save of step 2 that rank 1 cannot write:
    what `finish` raises on this rank."""
    from pretrain.checkpoint import Saver, writer
    from pretrain.errors import TrainingFault

    cfg, engine = _engine(out, world_size)
    saver = Saver(engine, ckpt_dir=Path(out) / "checkpoints", keep_last=2, keep_every=0,
                  rank=rank, background=True)
    _train_step(cfg, engine, seed=0)
    saver.save(meta=_meta(cfg, 1, world_size), client_state={})
    saver.finish()
    if rank == 1:
        def disk_full(path, state):
            raise OSError(28, "No space left on device")

        writer._write_file = disk_full
    saver.save(meta=_meta(cfg, 2, world_size), client_state={})
    with pytest.raises(TrainingFault) as raised:
        saver.finish()
    return str(raised.value)


def test_a_rank_that_cannot_write_fails_the_save_on_every_rank(tmp_path):
    errors = run_on_ranks(_one_rank_cannot_write, world_size=2, tmp_path=tmp_path,
                          args=(str(tmp_path),), timeout_s=300)
    ckpts = tmp_path / "checkpoints"
    assert errors[0] == errors[1] == (
        f"checkpoint {ckpts / 'step2'} was not saved: rank 1 could not write its files (OSError: "
        "[Errno 28] No space left on device); the previous complete checkpoint is still the one "
        "resuming starts from")
    assert (ckpts / "latest").read_text() == "step1"
    assert not (ckpts / "step2" / "manifest.json").exists()


def _save_then_die_writing(out: str, started_fd: int) -> None:
    """The kill test's process: a complete save of step 1, then a background save of step 2
    whose writer writes part of a file, tells the test through `started_fd`, and blocks: the
    test SIGKILLs the process there."""
    import torch.distributed as dist

    from pretrain.checkpoint import Saver, writer

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=0, world_size=1)
    cfg, engine = _engine(out, 1)
    saver = Saver(engine, ckpt_dir=Path(out) / "checkpoints", keep_last=2, keep_every=0, rank=0,
                  background=True)
    _train_step(cfg, engine, seed=0)
    saver.save(meta=_meta(cfg, 1, 1), client_state={})
    saver.finish()

    def dies_writing(path, state):
        with open(path, "wb") as half:
            half.write(b"PK\x03\x04 the first bytes")
            half.flush()
            os.write(started_fd, b"w")
            threading.Event().wait()

    writer._write_file = dies_writing
    _train_step(cfg, engine, seed=1)
    saver.save(meta=_meta(cfg, 2, 1), client_state={})
    saver.finish()  # waits for the writer, which never ends


def test_killed_during_a_background_write_resumes_from_the_previous_save(tmp_path):
    from pretrain.checkpoint import find_resume
    from pretrain.config import load_config

    started, started_w = os.pipe()
    with open(tmp_path / "child.log", "w") as log:
        child = subprocess.Popen(
            [sys.executable, "-c", "import test_async_save as t; "
             f"t._save_then_die_writing({str(tmp_path)!r}, {started_w})"],
            cwd=REPO, pass_fds=(started_w,), stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parent), "OMP_NUM_THREADS": "1"})
    os.close(started_w)
    try:
        readable, _, _ = select.select([started], [], [], 600)
        assert readable and os.read(started, 1) == b"w", \
            "the writer never started:\n" + (tmp_path / "child.log").read_text()[-3000:]
    finally:
        child.kill()  # SIGKILL: no handler, no flush, no finally
        child.wait()
        os.close(started)

    ckpts = tmp_path / "checkpoints"
    assert (ckpts / "latest").read_text() == "step1"
    assert (ckpts / "step2").is_dir() and not (ckpts / "step2" / "manifest.json").exists()
    log: list[str] = []
    point = find_resume(load_config(REPO / "configs/tiny.yaml", _overrides(tmp_path, 1)),
                        resume_from=None, log=log.append)
    assert point.path == ckpts / "step1"
    assert log[0].startswith(f"[resume] skipping {ckpts / 'step2'}: incomplete")


def test_background_saves_resume_bitwise_like_synchronous_ones(tiny_data, tmp_path):
    """Two ranks (dp 2, ZeRO-1), saves at step 3 and at the end: training with background saves
    is bitwise training with synchronous ones, and a run resumed from a background save of step
    3 continues bitwise."""
    layout = ["train.steps=6", "checkpoint.save_interval=3", "checkpoint.keep_last=5"]
    sync = train(tmp_path, tiny_data, nprocs=2, name="sync",
                 overrides=layout + ["checkpoint.async_save=false"])
    background = train(tmp_path, tiny_data, nprocs=2, name="background",
                       overrides=layout + ["checkpoint.async_save=true"])
    step3 = background.run_dir / "checkpoints" / "step3"
    assert f"[checkpoint] {step3}: state copied in" in background.stdout
    assert f"[checkpoint] {step3} complete" in background.stdout
    assert "written in the background" not in sync.stdout
    for run in (sync, background):
        assert (run.run_dir / "checkpoints" / "latest").read_text() == "step6"

    def steps(run, since=0):
        return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in run.records
                if r["kind"] == "train"][since:]

    assert steps(background) == steps(sync)
    shutil.copytree(step3, tmp_path / "resumed" / "checkpoints" / "step3")
    resumed = train(tmp_path, tiny_data, nprocs=2, name="resumed", overrides=layout)
    assert f"[resume] from {tmp_path / 'resumed' / 'checkpoints' / 'step3'}" in resumed.stdout
    assert steps(resumed) == steps(sync, since=3)
