"""End to end as the README runs it: CLI data preparation on the bundled corpus, training through
the real `deepspeed` launcher (2 ranks, ZeRO-2), a checkpoint, and `pretrain generate`."""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
from png_check import coloured_pixels_per_band

from pretrain.config import load_config
from pretrain.training.curves import PANELS
from pretrain.testing.runs import run_pretrain

pytestmark = pytest.mark.slow  # training runs through the launchers (quick tier: not slow)

STEPS = 40  # enough for the loss to fall by > 1 nat (here: 6.7 over the first 5, ~5.4 the last)
HALF = STEPS // 2  # an evaluation and a checkpoint here and at the end


@pytest.fixture(scope="module")
def stdlib_data(tmp_path_factory):
    """The quickstart's corpus (this interpreter's standard library), with a 1k tokenizer."""
    out = tmp_path_factory.mktemp("stdlib")
    run_pretrain(["tokenizer", "--corpus", "python-stdlib", "--vocab-size", "1024",
                  "--output", str(out / "sp1k.model")], run_dir=out).check()
    run = run_pretrain(["preprocess", "--corpus", "python-stdlib", "--tokenizer",
                        str(out / "sp1k.model"), "--output-prefix", str(out / "stdlib"),
                        "--workers", "2"], run_dir=out).check()
    assert "documents" in run.stdout
    return {"tokenizer": str(out / "sp1k.model"), "dataset": str(out / "stdlib")}


def assert_final_is_the_last_step(run_dir: Path, step_dir: Path) -> None:
    """final/ holds the model of the last step: every tensor is the checkpoint's fp32 master
    rounded to bf16 (the module weights a bf16 run computes with), bit for bit."""
    from pretrain.checkpoint.weights import load_weights

    final, masters = load_weights(run_dir / "final"), load_weights(step_dir)
    assert sorted(final.state) == sorted(masters.state)
    for name in masters.state:
        master = masters.state[name]
        assert master.dtype == torch.float32, name
        assert torch.equal(final.state[name], master.to(torch.bfloat16).float()), name


def tensorboard_losses(run_dir: Path) -> list[float]:
    """The train/loss scalars of the run's tensorboard event files, by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [event.value for event in sorted(events.Scalars("train/loss"), key=lambda e: e.step)]


def test_deepspeed_launcher_zero2_trains_checkpoints_and_generates(stdlib_data, tmp_path):
    run_dir = tmp_path / "e2e"
    args = ["train", "--config", "configs/tiny.yaml",
            "--set", f"run_dir={run_dir}", "--set", f"data.tokenizer={stdlib_data['tokenizer']}",
            "--set", f"data.dataset={stdlib_data['dataset']}", "--set", "model.vocab_size=1024",
            "--set", "model.seq_length=64", "--set", "model.hidden_size=128",
            "--set", f"train.steps={STEPS}", "--set", "train.micro_batch_size=4",
            "--set", "train.global_batch_size=8", "--set", "train.lr=3e-3",
            "--set", "train.warmup_steps=5", "--set", f"train.eval_interval={HALF}",
            "--set", "data.valid_fraction=0.02", "--set", "train.precision=bf16",
            "--set", f"checkpoint.save_interval={HALF}", "--set", "checkpoint.save_final=true",
            "--set", "logging.report_to=[tensorboard,wandb]",
            "--set", "logging.wandb_mode=offline",
            "--set", "logging.progress_bar=true", "--set", "logging.log_interval=10",
            # a user's defaults where the test model turns them off: curves.png, measured MFU peak
            "--set", "logging.curves=true", "--set", "logging.peak_tflops=0",
            "--deepspeed-config", "ds_configs/zero2.json"]
    extensions = tmp_path / "torch_extensions"  # a fresh machine's: nothing compiled yet
    extensions.mkdir()
    run = run_pretrain(args, run_dir=run_dir, launcher="deepspeed", nprocs=2,
                       env={"TORCH_EXTENSIONS_DIR": str(extensions)}).check()
    # training with ZeRO-2 and no offload needs no compiled op (not DeepSpeed's shm inference op)
    assert not list(extensions.iterdir()), sorted(p.name for p in extensions.iterdir())

    # the user sees a step line with every promised field, and the progress bar
    step_lines = [l for l in run.stdout.splitlines() if l.lstrip().startswith("step ")]
    assert len(step_lines) == STEPS // 10, run.stdout[-3000:]
    for field in ("loss", "lr", "gnorm", "tok/s", "MFU", "mem", "data"):
        assert field in step_lines[-1]
    # progress_bar is on, but the output is a pipe: no tqdm bar in it, only the plain lines
    assert not re.search(r"train:\s+\d+%\|", run.stdout + run.stderr), run.stderr[-2000:]

    # metrics.jsonl: one record per step with the documented fields; the loss falls
    records = run.records
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert [r["step"] for r in evals] == [HALF, STEPS]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_gb", "data_wait_s",
                "consumed_samples", "tflops_per_device", "step_time_s"):
        assert all(r[key] is not None for r in train), key
    assert train[-1]["consumed_samples"] == STEPS * 8
    losses = [r["loss"] for r in train]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.0, (first, last)
    assert evals[1]["loss"] < evals[0]["loss"] and evals[1]["ppl"] > 1.0
    run_rec = records[0]
    assert run_rec["kind"] == "run" and run_rec["launcher"] == "deepspeed"
    assert run_rec["world_size"] == 2 and run_rec["data_parallel"] == 2
    assert (run_rec["zero_stage"], run_rec["zero_optimizer"]) == (2, "DeepSpeedZeroOptimizer")
    assert run_rec["param_dtypes"] == ["bfloat16"] and run_rec["master_dtypes"] == ["float32"]

    # run directory: resolved configs, DeepSpeed checkpoints (keep_last), final weights, logs
    saved = load_config(run_dir / "config.yaml")
    assert (saved.model.hidden_size, saved.train.steps, saved.train.precision.value) == \
        (128, STEPS, "bf16")
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert (ds["train_batch_size"], ds["zero_optimization"]["stage"], ds["bf16"]["enabled"]) == \
        (8, 2, True)
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == f"step{STEPS}"
    assert sorted(p.name for p in ckpts.glob("step*")) == [f"step{HALF}", f"step{STEPS}"]
    meta = json.loads((ckpts / f"step{STEPS}" / "meta.json").read_text())
    assert (meta["step"], meta["consumed_samples"]) == (STEPS, STEPS * 8)
    tokenizer = Path(stdlib_data["tokenizer"])
    assert meta["tokenizer"] == {"path": str(tokenizer),
                                 "sha256": hashlib.sha256(tokenizer.read_bytes()).hexdigest()}
    # the precision `auto` chose on this CPU, as the saved config records it
    assert meta["layout"] == {"tensor": 1, "pipeline": 1, "data": 2, "world_size": 2,
                              "context": 1, "expert": 1, "zero_stage": 2, "offload": "none",
                              "precision": meta["config"]["train"]["precision"]}
    assert meta["layout"]["precision"] in ("bf16", "fp32")
    assert_final_is_the_last_step(run_dir, ckpts / f"step{STEPS}")
    assert tensorboard_losses(run_dir) == pytest.approx(losses, rel=1e-6)
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    # the run's curves drawn: data in each stacked panel (loss, learning rate, tokens/s)
    assert all(n > 100 for n in coloured_pixels_per_band(run_dir / "curves.png", len(PANELS)))

    # generate from the final checkpoint: greedy is deterministic and prints the prompt + text
    gen_args = ["generate", "--checkpoint", str(run_dir), "--prompt", "def ",
                "--max-new-tokens", "20", "--print-ids"]
    out1 = run_pretrain(gen_args, run_dir=run_dir).check()
    out2 = run_pretrain(gen_args, run_dir=run_dir).check()
    assert out1.stdout == out2.stdout
    text, ids_line = out1.stdout.rstrip("\n").rsplit("\n", 1)
    assert text.startswith("def ") and len(text) > len("def ") + 5
    ids = [int(t) for t in ids_line.removeprefix("ids: ").split()]
    assert 1 <= len(ids) <= 20 and all(0 <= i < 1024 for i in ids)
