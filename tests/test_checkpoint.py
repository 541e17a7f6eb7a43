"""Checkpoints: exact resume for every layout, damaged checkpoints, pruning, resharding.

An uninterrupted run saves at step 3; a second run dir that holds only that checkpoint resumes
from it automatically. Its fp32 losses and gradient norms for steps 4..6 must be bitwise those of
the uninterrupted run (same layout, same reduction order: nothing may differ).
"""
from __future__ import annotations

import json
import shutil

import pytest

from pretrain.testing.runs import rel_diff, run_pretrain, train

pytestmark = pytest.mark.slow  # training runs through the launchers (quick tier: not slow)

STEPS, SAVE_AT = 6, 3


def _train_records(run) -> list[dict]:
    return [r for r in run.records if r["kind"] == "train"]


def _layout(tp: int, pp: int, zero: int) -> list[str]:
    return [f"train.steps={STEPS}", f"parallel.tensor={tp}", f"parallel.pipeline={pp}",
            f"deepspeed=ds_configs/zero{zero}.json", f"checkpoint.save_interval={SAVE_AT}",
            "checkpoint.keep_last=5"]


@pytest.mark.parametrize("tp, pp, dp, zero", [
    pytest.param(1, 1, 2, 1, id="dp2-zero1"),
    pytest.param(1, 1, 2, 2, id="dp2-zero2"),
    pytest.param(1, 1, 2, 3, id="dp2-zero3"),
    pytest.param(2, 2, 1, 1, id="tp2-pp2"),
    pytest.param(1, 2, 2, 1, id="pp2-dp2"),
])
def test_resume_gives_bitwise_the_same_losses(tp, pp, dp, zero, tiny_data, tmp_path):
    nprocs = tp * pp * dp
    full = train(tmp_path, tiny_data, nprocs=nprocs, name="full", overrides=_layout(tp, pp, zero))
    saved = full.run_dir / "checkpoints" / f"step{SAVE_AT}"
    assert {p.name for p in saved.glob("rng_rank*.pt")} == {f"rng_rank{r:05d}.pt"
                                                             for r in range(nprocs)}
    meta = json.loads((saved / "meta.json").read_text())
    assert meta["step"] == SAVE_AT and meta["consumed_samples"] == SAVE_AT * 4
    assert meta["layout"] == {"tensor": tp, "pipeline": pp, "data": dp, "world_size": nprocs,
                              "context": 1, "expert": 1, "zero_stage": zero, "offload": "none",
                              "precision": "fp32"}

    shutil.copytree(saved, tmp_path / "resumed" / "checkpoints" / saved.name)
    resumed = train(tmp_path, tiny_data, nprocs=nprocs, name="resumed",
                    overrides=_layout(tp, pp, zero))
    assert f"[resume] from {tmp_path / 'resumed' / 'checkpoints' / saved.name}" in resumed.stdout
    after, before = _train_records(resumed), _train_records(full)[SAVE_AT:]
    assert [r["step"] for r in after] == list(range(SAVE_AT + 1, STEPS + 1))
    assert [r["loss"] for r in after] == [r["loss"] for r in before]
    assert [r["grad_norm"] for r in after] == [r["grad_norm"] for r in before]
    assert [r["lr"] for r in after] == [r["lr"] for r in before]


def test_truncated_checkpoint_is_skipped_and_resume_falls_back(tiny_data, tmp_path):
    first = train(tmp_path, tiny_data, name="run", overrides=[
        "train.steps=3", "checkpoint.save_interval=1", "checkpoint.keep_last=3"])
    ckpts = first.run_dir / "checkpoints"
    assert (ckpts / "latest").read_text() == "step3"
    shard = next((ckpts / "step2").glob("*optim_states.pt"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a crash mid-copy
    (ckpts / "step3" / "manifest.json").unlink()  # a save that died before its manifest

    again = train(tmp_path, tiny_data, name="run", overrides=[
        "train.steps=3", "checkpoint.save_interval=1", "checkpoint.keep_last=3"])
    assert f"skipping {ckpts / 'step3'}: incomplete" in again.stdout
    assert f"skipping {ckpts / 'step2'}: {shard.name} has" in again.stdout
    assert "truncated" in again.stdout
    assert f"falling back to {ckpts / 'step1'}" in again.stdout
    records = _train_records(again)[3:]  # metrics.jsonl appends: the first run's 3 come first
    assert [r["step"] for r in records] == [2, 3]
    assert [r["loss"] for r in records] == first.losses[1:3]


def _error_line(run) -> str:
    """The one `error:` line of a `pretrain train` that refused its input (exit 2)."""
    assert run.returncode == 2, (run.returncode, run.stderr[-2000:])
    assert "Traceback" not in run.stderr, run.stderr[-2000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, run.stderr[-2000:]
    return errors[0]


def test_explicit_damaged_or_mismatched_checkpoint_is_a_clear_error(tiny_data, tmp_path):
    """Resuming through `pretrain train` (one process, tp 1 x pp 1 x dp 1) a checkpoint of a
    tp 2 run: of another model, of another layout with --require-same-layout, or damaged, is
    one `error:` line, exit 2."""
    run = train(tmp_path, tiny_data, name="run", nprocs=2, overrides=[
        "train.steps=2", "checkpoint.save_interval=1", "parallel.tensor=2"])
    step1 = run.run_dir / "checkpoints" / "step1"
    assert json.loads((step1 / "meta.json").read_text())["layout"]["tensor"] == 2
    base = ["train", "--config", "configs/tiny.yaml", "--set", f"data.tokenizer={tiny_data['tokenizer']}",
            "--set", f"data.dataset={tiny_data['dataset']}", "--set", "train.steps=3"]

    def resume(name: str, *overrides: str):
        args = base + ["--set", f"run_dir={tmp_path / name}", "--resume-from", str(step1)]
        for override in overrides:
            args += ["--set", override]
        return run_pretrain(args, run_dir=tmp_path / name)

    other_model = _error_line(resume("deeper", "model.num_layers=3"))
    assert other_model == (f"error: checkpoint {str(step1)!r} does not match this run: it was "
                           "written for another model: model.num_layers=2 there, 3 here; use the "
                           "run's own config or start a new run_dir")

    # the same model on another layout, with --require-same-layout: refused before any process
    # group (without it the checkpoint is resharded: tests/test_reshard.py)
    other_layout = _error_line(run_pretrain(
        base + ["--set", f"run_dir={tmp_path / 'tp1'}", "--resume-from", str(step1),
                "--require-same-layout"], run_dir=tmp_path / "tp1"))
    assert other_layout == (
        f"error: checkpoint {str(step1)!r} was saved on another layout (tp2 pp1 dp1 ZeRO-1 -> "
        "tp1 pp1 dp1 ZeRO-1) and --require-same-layout is set: run it on its own layout, or drop "
        "the flag to reshard it")
    assert not (tmp_path / "tp1" / "metrics.jsonl").exists()  # nothing trained

    next(step1.glob("*optim_states.pt")).unlink()  # a rank's shard lost
    missing = _error_line(resume("again"))
    assert missing.startswith(f"error: checkpoint {str(step1)!r} is damaged: missing file"), missing


def test_keep_last_and_keep_every(tiny_data, tmp_path):
    run = train(tmp_path, tiny_data, name="run", overrides=[
        "train.steps=7", "checkpoint.save_interval=1", "checkpoint.keep_last=3",
        "checkpoint.keep_every=3"])  # keep_last 3, not the default 2: a run that ignores it fails
    ckpts = run.run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step*")) == ["step3", "step5", "step6", "step7"]
    assert (ckpts / "latest").read_text() == "step7"
    assert not list(ckpts.glob(".*tmp"))


def test_run_ends_with_a_checkpoint_of_its_last_step_without_save_final(tiny_data, tmp_path):
    overrides = ["train.steps=5", "checkpoint.save_interval=2", "checkpoint.save_final=false",
                 "checkpoint.keep_last=5"]
    run = train(tmp_path, tiny_data, name="run", overrides=overrides)
    ckpts = run.run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step*")) == ["step2", "step4", "step5"]
    assert (ckpts / "latest").read_text() == "step5"
    assert json.loads((ckpts / "step5" / "meta.json").read_text())["step"] == 5
    assert not (run.run_dir / "final").exists()
    # Started again when it is already done, it trains nothing and rewrites nothing.
    manifest = (ckpts / "step5" / "manifest.json").stat().st_mtime_ns
    again = train(tmp_path, tiny_data, name="run", overrides=overrides)
    assert len(_train_records(again)) == 5
    assert (ckpts / "step5" / "manifest.json").stat().st_mtime_ns == manifest


def _reshard(tmp_path, tiny_data, *, dp_from: int, dp_to: int, keep_global_batch: str):
    from pretrain.checkpoint.engine import to_universal

    overrides = [f"train.steps={STEPS}", f"checkpoint.save_interval={SAVE_AT}"]
    source = train(tmp_path, tiny_data, nprocs=dp_from, name="source", overrides=overrides)
    step_dir = source.run_dir / "checkpoints" / f"step{SAVE_AT}"
    universal = to_universal(step_dir, tmp_path / "universal")
    assert universal == tmp_path / "universal" / f"step{SAVE_AT}"
    target_dir = tmp_path / "target"
    args = ["train", "--config", "configs/tiny.yaml", "--set", f"run_dir={target_dir}",
            "--set", f"data.tokenizer={tiny_data['tokenizer']}", "--set",
            f"data.dataset={tiny_data['dataset']}", "--set", f"train.steps={STEPS}",
            "--set", f"train.global_batch_size={keep_global_batch}",
            "--resume-from", str(tmp_path / "universal")]
    target = run_pretrain(args, run_dir=target_dir, nprocs=dp_to,
                          launcher="single" if dp_to == 1 else "torchrun").check()
    run_record = target.records[0]
    assert run_record["data_parallel"] == dp_to and run_record["global_batch"] == 4
    assert run_record["grad_accum"] == 4 // (2 * dp_to)
    after, before = _train_records(target), _train_records(source)[SAVE_AT:]
    assert [r["step"] for r in after] == [4, 5, 6]
    # The same samples in the same global batches: consumed counts and losses agree (to the
    # rounding of summing gradients over ranks vs over micro-batches).
    assert [r["consumed_samples"] for r in after] == [r["consumed_samples"] for r in before]
    assert rel_diff([r["loss"] for r in after], [r["loss"] for r in before]) < 1e-5


def test_universal_checkpoint_reshards_dp2_to_dp1(tiny_data, tmp_path):
    # global_batch_size unset: resuming takes the saved global batch (accumulation 1 -> 2)
    _reshard(tmp_path, tiny_data, dp_from=2, dp_to=1, keep_global_batch="null")


def test_universal_checkpoint_reshards_dp1_to_dp2(tiny_data, tmp_path):
    _reshard(tmp_path, tiny_data, dp_from=1, dp_to=2, keep_global_batch="4")


def test_zero0_checkpoint_cannot_be_converted_to_universal(tiny_data, tmp_path):
    from pretrain.checkpoint.engine import to_universal
    from pretrain.errors import CheckpointError

    run = train(tmp_path, tiny_data, name="z0", overrides=[
        "train.steps=1", "checkpoint.save_interval=1", "checkpoint.save_final=true",
        "deepspeed=ds_configs/zero0.json"])
    with pytest.raises(CheckpointError, match="saved with ZeRO-0, which DeepSpeed cannot convert"):
        to_universal(run.run_dir, tmp_path / "universal")


def _meta(cfg, *, tensor: int = 1, zero: int = 1, sha256: str = "0" * 64) -> dict:
    return {"step": 1, "consumed_samples": 4, "global_batch": 4, "config": cfg.to_dict(),
            "tokenizer": {"path": "other.model", "sha256": sha256},
            "layout": {"tensor": tensor, "pipeline": 1, "data": 1, "world_size": tensor,
                       "zero_stage": zero}}


def test_checkpoint_of_another_tokenizer_is_refused(tiny_data):
    from pretrain.checkpoint.engine import resume_mismatch
    from pretrain.config import load_config
    from pretrain.data import Tokenizer

    cfg = load_config("configs/tiny.yaml", [f"data.tokenizer={tiny_data['tokenizer']}"])
    problem = resume_mismatch(_meta(cfg), cfg)
    assert problem.startswith("it was trained with the tokenizer 'other.model' (sha256 000000000000")
    assert resume_mismatch(_meta(cfg, sha256=Tokenizer.load(tiny_data["tokenizer"]).sha256), cfg) is None


def test_resume_allows_recompute_and_init_changes_but_not_shapes(tiny_data):
    from pretrain.checkpoint.engine import resume_mismatch
    from pretrain.config import load_config
    from pretrain.data import Tokenizer

    saved = load_config("configs/tiny.yaml", [f"data.tokenizer={tiny_data['tokenizer']}"])
    meta = _meta(saved, sha256=Tokenizer.load(tiny_data["tokenizer"]).sha256)
    changed = load_config("configs/tiny.yaml", [f"data.tokenizer={tiny_data['tokenizer']}",
                                                "model.activation_checkpointing=full",
                                                "model.init_from=/elsewhere", "model.init_std=0.01"])
    assert resume_mismatch(meta, changed) is None
    reshaped = load_config("configs/tiny.yaml", [f"data.tokenizer={tiny_data['tokenizer']}",
                                                 "model.activation_checkpointing=full",
                                                 "model.hidden_size=128"])
    assert resume_mismatch(meta, reshaped) == (
        "it was written for another model: model.hidden_size=64 there, 128 here, model.head_dim=16 "
        "there, 32 here; use the run's own config or start a new run_dir")


def test_tensor_parallel_checkpoint_is_not_converted_to_universal(tiny_data, tmp_path):
    from pretrain.checkpoint.engine import to_universal
    from pretrain.checkpoint.paths import write_manifest
    from pretrain.config import load_config
    from pretrain.errors import CheckpointError

    step = tmp_path / "checkpoints" / "step1"
    step.mkdir(parents=True)
    write_manifest(step, _meta(load_config("configs/tiny.yaml"), tensor=2))
    with pytest.raises(CheckpointError, match="has tensor parallel 2: our tensor-parallel layers"):
        to_universal(tmp_path, tmp_path / "universal")
