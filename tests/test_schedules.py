"""Learning-rate schedules (train.lr_schedule) and annealing a checkpoint of a WSD run.

Quick: `schedule_factor` against each schedule's formula, written out here, at every step of a
run (the first and the last, a decay whose length does not divide evenly), and the config's
checks. Slow: a WSD run's metrics.jsonl `lr` under both engines; a checkpoint of a WSD run's
stable phase annealed into its own run directory equals, bit for bit (fp32), the run that
decayed from that step on its own, and an anneal killed mid-decay resumes the decay.
"""
from __future__ import annotations

import math

import pytest

from pretrain.config import ConfigError, load_config
from pretrain.training.engine import lr_factor, warmup_cosine

PEAK, FLOOR = 2.0, 0.5  # train.lr, train.min_lr of the unit tests


def _train(*overrides: str):
    return load_config(None, [f"train.lr={PEAK}", f"train.min_lr={FLOOR}", *overrides]).train


def _expected(schedule: str, update: int, *, warmup: int, total: int, start: int = 0,
              shape: str = "linear") -> float:
    """The lr of `update` (1-based), each schedule's formula written out."""
    if schedule == "cosine":
        return warmup_cosine(update, lr=PEAK, min_lr=FLOOR, warmup=warmup, total=total)
    if update <= warmup:
        return PEAK * update / warmup
    if schedule == "constant":
        return PEAK
    if schedule == "linear":
        return FLOOR + (PEAK - FLOOR) * (1 - (update - warmup) / (total - warmup))
    if update <= start:  # wsd's stable phase
        return PEAK
    p = (update - start) / (total - start)
    down = {"linear": 1 - p, "sqrt": 1 - math.sqrt(p), "cosine": 0.5 * (1 + math.cos(math.pi * p))}
    return FLOOR + (PEAK - FLOOR) * down[shape]


@pytest.mark.parametrize("schedule, shape, overrides, start", [
    ("cosine", "linear", [], 0),
    ("linear", "linear", [], 0),
    ("constant", "linear", [], 0),
    ("wsd", "linear", [], 21),  # decay_fraction 0.1 of 23 steps: round(2.3) = 2, from step 21
    ("wsd", "sqrt", ["train.decay_fraction=0.3"], 16),  # 6.9 -> 7 decay steps
    ("wsd", "cosine", ["train.decay_fraction=0.3"], 16),
    ("wsd", "sqrt", ["train.decay_start_step=10"], 10),  # 13 decay steps
])
def test_each_schedules_lr_at_every_step_is_its_formula(schedule, shape, overrides, start):
    t = _train("train.steps=23", "train.warmup_steps=4", f"train.lr_schedule={schedule}",
               f"train.decay_shape={shape}", *overrides)
    if schedule == "wsd":
        assert t.decay_start == start
    factor = lr_factor(t)
    got = [PEAK * factor(i) for i in range(t.steps)]  # the scheduler's step i: update i + 1
    want = [_expected(schedule, u, warmup=4, total=23, start=start, shape=shape)
            for u in range(1, 24)]
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    assert got[0] == pytest.approx(PEAK / 4)  # the first update already learns
    if schedule == "constant":
        assert got[-1] == PEAK
    else:
        assert got[-1] == pytest.approx(FLOOR)  # the last update is at min_lr
        assert PEAK * factor(40) == pytest.approx(FLOOR)  # and it stays there
    if schedule == "wsd":
        assert got[start - 1] == PEAK and got[start] < PEAK  # decays in the updates after it


def test_cosine_default_is_bitwise_warmup_cosine():
    t = _train("train.steps=17", "train.warmup_steps=3")
    assert t.lr_schedule.value == "cosine"
    factor = lr_factor(t)
    assert [factor(i) for i in range(20)] == [
        warmup_cosine(i + 1, lr=1.0, min_lr=FLOOR / PEAK, warmup=3, total=17) for i in range(20)]


@pytest.mark.parametrize("overrides, named", [
    (["train.lr_schedule=wsd", "train.decay_fraction=1.5"], "train.decay_fraction=1.5"),
    (["train.lr_schedule=wsd", "train.decay_shape=exp"], "decay_shape"),
    (["train.lr_schedule=step"], "lr_schedule"),
    (["train.decay_start_step=5"], "only train.lr_schedule=wsd"),  # cosine has no decay start
    (["train.lr_schedule=wsd", "train.decay_start_step=11"], "train.steps=10"),
    (["train.lr_schedule=wsd", "train.decay_start_step=1", "train.warmup_steps=2"],
     "train.warmup_steps=2"),
    (["train.lr_schedule=wsd", "train.decay_fraction=0.9", "train.warmup_steps=2"],
     "inside the 2 warmup steps"),
])
def test_bad_schedule_settings_are_refused_naming_the_fix(overrides, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(None, ["train.steps=10", *overrides])


# ---- runs (slow) --------------------------------------------------------------------------------
S, N = 4, 4  # the anneal: a checkpoint of stable step S decayed over N steps
TINY_LR, TINY_MIN_LR, TINY_WARMUP = 1e-3, 1e-4, 2  # configs/tiny.yaml's
WSD = ["train.lr_schedule=wsd", "train.decay_shape=sqrt"]


def _train_records(run) -> list[dict]:
    return [r for r in run.records if r["kind"] == "train"]


def _tiny_wsd_lrs(steps: int, start: int) -> list[float]:
    """configs/tiny.yaml's lr of updates 1..steps under WSD (1-sqrt) decaying after `start`."""
    def lr(u: int) -> float:
        if u <= TINY_WARMUP:
            return TINY_LR * u / TINY_WARMUP
        if u <= start:
            return TINY_LR
        return TINY_MIN_LR + (TINY_LR - TINY_MIN_LR) * (1 - math.sqrt((u - start) / (steps - start)))
    return [lr(u) for u in range(1, steps + 1)]


@pytest.mark.slow
def test_fsdp2_runs_metrics_lr_follow_wsd(tiny_data, tmp_path):
    """fsdp2 builds its own LambdaLR from the same factor: each step's logged lr is the formula's
    (DeepSpeed's: `test_annealed_checkpoint_equals_the_run_that_decayed_on_its_own`)."""
    from pretrain.testing.runs import train

    run = train(tmp_path, tiny_data, overrides=[
        "train.steps=6", *WSD, "train.decay_start_step=3", "train.engine=fsdp2",
        "deepspeed=ds_configs/zero3.json"])
    assert [r["lr"] for r in _train_records(run)] == pytest.approx(_tiny_wsd_lrs(6, 3),
                                                                    rel=1e-12, abs=0)


@pytest.mark.slow
def test_annealed_checkpoint_equals_the_run_that_decayed_on_its_own(tiny_data, tmp_path):
    """A WSD run's stable-phase checkpoint of step S, annealed into its own run dir
    (`--start-from` it, train.steps=S+N, train.decay_start_step=S), gives bit for bit (fp32) the
    losses, gradient norms and lr of one WSD run of S+N steps decaying from S; the source is not
    written to; the anneal, stopped after its step S+2 checkpoint and restarted with the same
    command, resumes the decay from its own checkpoint."""
    _anneal_equals_its_own_decay(tiny_data, tmp_path, engine=[])


@pytest.mark.slow
def test_fsdp2_annealed_checkpoint_equals_the_run_that_decayed_on_its_own(tiny_data, tmp_path):
    """The same under train.engine=fsdp2 (its ZeRO-3): the anneal reads fsdp2's own checkpoint
    files, takes its schedule's position and goes on along the anneal's schedule, bit for bit
    the fsdp2 run that decayed on its own; restarted mid-decay it resumes from its own."""
    _anneal_equals_its_own_decay(tiny_data, tmp_path,
                                 engine=["train.engine=fsdp2", "deepspeed=ds_configs/zero3.json"])


def _anneal_equals_its_own_decay(tiny_data, tmp_path, *, engine: list[str]) -> None:
    import shutil

    from pretrain.testing.runs import run_pretrain, train, train_args

    whole = train(tmp_path, tiny_data, name="whole", overrides=[
        f"train.steps={S + N}", *WSD, f"train.decay_start_step={S}", *engine])
    assert [r["lr"] for r in _train_records(whole)] == pytest.approx(
        _tiny_wsd_lrs(S + N, S), rel=1e-12, abs=0)  # DeepSpeed's LambdaLR follows the formula
    # the source: a WSD run whose decay never came (decay_fraction 0), ended at step S
    source = train(tmp_path, tiny_data, name="source", overrides=[
        f"train.steps={S}", *WSD, "train.decay_fraction=0", *engine])
    assert source.losses == whole.losses[:S]
    before = {p: p.stat().st_mtime_ns for p in source.run_dir.rglob("*")}

    anneal_overrides = [f"train.steps={S + N}", *WSD, f"train.decay_start_step={S}",
                        "checkpoint.save_interval=2", "checkpoint.keep_last=5", *engine]
    anneal_dir = tmp_path / "anneal"
    anneal = run_pretrain(train_args(anneal_dir, tiny_data, overrides=anneal_overrides) +
                          ["--start-from", str(source.run_dir)], run_dir=anneal_dir).check()
    assert f"[resume] from {source.run_dir / 'checkpoints' / f'step{S}'}" in anneal.stdout
    after, decayed = _train_records(anneal), _train_records(whole)[S:]
    assert [r["step"] for r in after] == list(range(S + 1, S + N + 1))
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in after] == [r[key] for r in decayed], key
    assert {p: p.stat().st_mtime_ns for p in source.run_dir.rglob("*")} == before
    assert (anneal_dir / "checkpoints" / f"step{S + N}").is_dir()

    # killed mid-decay: a run dir holding only the anneal's step S+2 checkpoint, restarted with
    # the same command (--start-from the source: a requeue), finishes the decay from its own
    mid = anneal_dir / "checkpoints" / f"step{S + 2}"
    restarted_dir = tmp_path / "restarted"
    shutil.copytree(mid, restarted_dir / "checkpoints" / mid.name)
    restarted = run_pretrain(train_args(restarted_dir, tiny_data, overrides=anneal_overrides) +
                             ["--start-from", str(source.run_dir)], run_dir=restarted_dir).check()
    assert f"[resume] from {restarted_dir / 'checkpoints' / mid.name}" in restarted.stdout
    for key in ("loss", "lr"):
        assert [r[key] for r in _train_records(restarted)] == [r[key] for r in decayed[2:]], key
