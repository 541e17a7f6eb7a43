"""Loss spikes (`pretrain.training.spikes`): the data stream without excluded samples, `skip` and
`rollback` against clean runs whose data stream leaves the same samples out.

The tiny config's global batch is 4 samples, so step s (from 1) reads the global sample
numbers 4(s-1) .. 4s-1. Spikes are injected through `pretrain.testing.faults.spike_environment`.
"""
from __future__ import annotations

import json
import random
import re

import pytest

from pretrain.config import load_config
from pretrain.errors import ConfigError
from pretrain.data import DistributedPackedSampler
from pretrain.data.samples import stream_numbers
from pretrain.resolve.run import resolve_layout
from pretrain.testing.faults import SPIKE_FACTOR, slow_spike_environment, spike_environment
from pretrain.testing.runs import REPO, rel_diff, run_pretrain, train, train_args
from pretrain.resolve.topology import Topology


def _brute_force(first: int, count: int, skip: set[int]) -> list[int]:
    kept = [n for n in range(first + count + len(skip) + 1) if n not in skip]
    return kept[first:first + count]


def test_stream_numbers_leave_the_excluded_numbers_out():
    rng = random.Random(0)
    for _ in range(200):
        skip = set(rng.sample(range(60), rng.randint(0, 30)))
        first, count = rng.randint(0, 40), rng.randint(1, 12)
        assert stream_numbers(first, count, skip=sorted(skip)) == \
            _brute_force(first, count, skip), (first, count, sorted(skip))
    assert stream_numbers(5, 3) == [5, 6, 7]


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_sampler_with_excluded_samples_reads_one_stream_on_every_dp_size(dp_size):
    """dp ranks interleave, per micro-step, the numbers left after the exclusion, and a sampler
    started at consumed_samples=c continues the same stream (samples trained on, not
    positions)."""
    skip = [1, 2, 9, 30]
    expected = _brute_force(0, 48, set(skip))
    micro = 2
    ranks = [iter(DistributedPackedSampler(1000, micro_batch_size=micro, dp_rank=r,
                                           dp_size=dp_size, skip=skip)) for r in range(dp_size)]
    read = [n for _ in range(48 // (micro * dp_size)) for it in ranks for n in next(it)]
    assert read == expected
    resumed = DistributedPackedSampler(1000, micro_batch_size=micro, dp_rank=0, dp_size=dp_size,
                                       consumed_samples=8 * dp_size, skip=skip)
    assert next(iter(resumed)) == expected[8 * dp_size:8 * dp_size + micro]


def test_spike_settings_are_checked():
    tiny = str(REPO / "configs" / "tiny.yaml")
    with pytest.raises(ConfigError, match="choose one of log, skip, rollback"):
        load_config(tiny, overrides=["train.on_loss_spike=drop"])
    with pytest.raises(ConfigError, match=r"data.exclude_samples=\[3, -1\]: must list"):
        load_config(tiny, overrides=["data.exclude_samples=[3, -1]"])
    cfg = load_config(tiny, overrides=["train.on_loss_spike=skip", "parallel.pipeline=2"])
    with pytest.raises(ConfigError, match="use train.on_loss_spike=rollback"):
        resolve_layout(cfg, Topology.from_parallel_config(cfg.parallel, world_size=2))


def _tensors(step_dir):
    from test_faults import _saved_tensors

    return _saved_tensors(step_dir)


def _changed(a, b):
    from test_faults import _changed as changed

    return changed(a, b)


def _train_records(run) -> list[dict]:
    return [r for r in run.records if r["kind"] == "train"]


def _last_loss_per_step(run) -> dict[int, float]:
    """The loss of each step as the run finally took it (a rollback redoes steps)."""
    return {r["step"]: r["loss"] for r in _train_records(run)}


STEP3, STEP4 = list(range(8, 12)), list(range(12, 16))  # the sample numbers of steps 3 and 4


@pytest.mark.slow
def test_skip_drops_the_spiking_updates(tiny_data, tmp_path):
    """Step 3's samples spike, and step 4's right after (judged against the running mean that
    step 3's spike stayed out of): both updates are dropped, so after 5 steps the weights and
    optimizer state equal bitwise those of a clean run (the same 5-step schedule) that never read
    the samples of steps 3 and 4, after 3."""
    run_dir = tmp_path / "skip"
    spiky = run_pretrain(
        train_args(run_dir, tiny_data, overrides=["train.steps=5", "train.on_loss_spike=skip"]),
        run_dir=run_dir, env=spike_environment(data=[9, 13], directory=tmp_path)).check()
    clean = train(tmp_path, tiny_data, name="clean",
                  overrides=["train.steps=5", "checkpoint.save_interval=3",
                             f"data.exclude_samples={STEP3 + STEP4}"])
    records = _train_records(spiky)
    assert [r["update_skipped"] for r in records] == [False, False, True, True, False]
    assert [r["loss_spike"] for r in records] == [False, False, True, True, False]
    assert [r["spikes_skipped"] for r in records] == [0, 0, 1, 2, 2]
    assert records[-1]["nonfinite_steps"] == 0
    assert spiky.stdout.count("update skipped (train.on_loss_spike=skip)") == 2
    assert "[spike] run summary: 2 update(s) skipped" in spiky.stdout
    kept = [r for r in records if r["step"] not in (3, 4)]
    assert [r["loss"] for r in kept] == clean.losses[:3]  # bitwise: json keeps every float bit
    assert [r["lr"] for r in kept] == [r["lr"] for r in _train_records(clean)][:3]
    after = _tensors(run_dir / "checkpoints" / "step5")
    assert _changed(after, _tensors(clean.run_dir / "checkpoints" / "step3")) == []


@pytest.mark.slow
def test_a_loss_under_the_configured_factor_is_no_spike(tiny_data, tmp_path):
    """train.loss_spike_factor above the injected factor: the loss that the default factor calls
    a spike (step 3's samples, as in the test above) stays under it: no spike, nothing skipped."""
    run_dir = tmp_path / "high"
    run = run_pretrain(
        train_args(run_dir, tiny_data, overrides=[
            "train.steps=3", "train.on_loss_spike=skip",
            f"train.loss_spike_factor={1.5 * SPIKE_FACTOR}", "logging.log_interval=2"]),
        run_dir=run_dir, env=spike_environment(data=[9], directory=tmp_path)).check()
    records = _train_records(run)
    assert records[2]["loss"] > SPIKE_FACTOR / 2 * records[1]["loss"]  # the loss was raised
    assert [r["loss_spike"] for r in records] == [False, False, False]
    assert [r["update_skipped"] for r in records] == [False, False, False]
    # (and logging.log_interval=2: step lines every second step and at the end; metrics.jsonl
    # has every step)
    assert re.findall(r"step (\d+)/3 \|", run.stdout) == ["2", "3"], run.stdout


# Under `pretrain.testing.nondeterminism` (reruns differ in the last bits, as on GPUs) a run
# that quarantined a batch equals the clean run within tolerances instead of bitwise. The harness
# scales each micro-batch loss by at most 1 + 4 eps (fp32: 5e-7) ahead of its backward; over 5
# steps the losses move by 1.5e-6 relative, and the weights and Adam moments by 4e-5 of each
# tensor's largest magnitude (Adam's first updates are ~lr x the gradient's sign, which the last
# bits of a near-zero gradient flip) - measured on AMD EPYC Zen 4. Another sample in a batch moves
# a loss by ~1e-3 and those tensors by ~1e-2.
LOSS_RTOL, TENSOR_RTOL = 1e-4, 1e-3


def _close(a: dict, b: dict) -> list[str]:
    """The keys whose tensors differ by more than TENSOR_RTOL of the tensor's largest magnitude
    (dtype and shape exactly)."""
    assert sorted(a) == sorted(b)
    return [key for key, x in a.items() if x.dtype != b[key].dtype or x.shape != b[key].shape
            or (x.double() - b[key].double()).abs().max() >
            TENSOR_RTOL * b[key].double().abs().max()]


def _agree(spiky, clean, *, bitwise: bool) -> None:
    """The losses of each step as the runs finally took them, and their last checkpoints'
    tensors: bitwise, or (reruns differing in the last bits) within LOSS_RTOL / TENSOR_RTOL and
    not all bitwise (the harness acted)."""
    ours, theirs = _last_loss_per_step(spiky), _last_loss_per_step(clean)
    step = max(theirs)
    after = _tensors(spiky.run_dir / "checkpoints" / f"step{step}")
    reference = _tensors(clean.run_dir / "checkpoints" / f"step{step}")
    if bitwise:
        assert ours == theirs
        assert _changed(after, reference) == []
        return
    assert sorted(ours) == sorted(theirs)
    assert rel_diff(list(ours.values()), list(theirs.values())) < LOSS_RTOL
    assert ours != theirs and _changed(after, reference) != []
    assert _close(after, reference) == []


@pytest.fixture(scope="module")
def clean_runs(tiny_data, tmp_path_factory):
    """Clean runs (no spike, no harness) by (ranks, overrides), each trained once per module."""
    runs = {}

    def run(nprocs: int, overrides: list[str]):
        key = (nprocs, tuple(overrides))
        if key not in runs:
            runs[key] = train(tmp_path_factory.mktemp("clean"), tiny_data, name="clean",
                              nprocs=nprocs, overrides=overrides)
        return runs[key]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("nprocs, layout, nondeterministic", [
    (1, [], False), (2, ["parallel.pipeline=2"], False), (1, [], True)],
    ids=["single", "pp2", "single-nondeterministic"])
def test_rollback_replays_then_quarantines_a_bad_batch(nprocs, layout, nondeterministic,
                                                       tiny_data, tmp_path, clean_runs):
    """Checkpoints every 2 steps. Step 3 spikes once (a transient fault: its replay from step 2
    does not), step 4's samples spike every time (a data problem: the replay spikes again), so
    the run goes back to step 2, quarantines step 4's batch and goes on. It ends equal to a clean
    run whose data stream leaves those 4 samples out - bitwise, or to the last bits when reruns
    differ in them (`nondeterministic`: every replay compares a loss that differs from the
    first run's) - and later checkpoints list them."""
    run_dir = tmp_path / "rollback"
    common = ["train.steps=5", "checkpoint.save_interval=2", "checkpoint.keep_last=5", *layout]
    spiky = run_pretrain(
        train_args(run_dir, tiny_data, overrides=common + ["train.on_loss_spike=rollback"]),
        run_dir=run_dir, launcher="single" if nprocs == 1 else "torchrun", nprocs=nprocs,
        env=spike_environment(data=[13], transient=[10], directory=tmp_path,
                              nondeterministic=nondeterministic)).check()
    clean = clean_runs(nprocs, common + [f"data.exclude_samples={STEP4}"])
    spikes = [r for r in spiky.records if r["kind"] == "spike"]
    assert [(r["step"], r["verdict"], r["to_step"]) for r in spikes] == \
        [(3, "transient", 2), (4, "data", 2)]
    assert spikes[1]["samples"] == STEP4 and spikes[1]["samples_quarantined"] == 4
    assert "a transient fault on rank 0 (host " in spiky.stdout
    assert "a data problem. Rolled back to step 2; quarantined its 4 samples (numbers 12-15)" \
        in spiky.stdout
    last = _train_records(spiky)[-1]
    assert (last["spikes_rolled_back"], last["spikes_transient"]) == (1, 1)
    for step in (4, 5):
        meta = json.loads((run_dir / "checkpoints" / f"step{step}" / "meta.json").read_text())
        assert meta["quarantined_samples"] == STEP4
    _agree(spiky, clean, bitwise=not nondeterministic)
    if nprocs == 1:  # a resume honours the checkpoint's quarantine (else step 5 reads 12-15)
        resumed_dir = tmp_path / "resumed"
        resumed = run_pretrain(
            train_args(resumed_dir, tiny_data, overrides=common)
            + ["--resume-from", str(run_dir / "checkpoints" / "step4")],
            run_dir=resumed_dir).check()
        if nondeterministic:  # from a step 4 in other last bits
            assert rel_diff(resumed.losses, [_last_loss_per_step(clean)[5]]) < LOSS_RTOL
        else:
            assert resumed.losses == [_last_loss_per_step(clean)[5]]


@pytest.mark.slow
def test_two_bad_batches_in_a_row_are_both_quarantined(tiny_data, tmp_path, clean_runs):
    """Steps 3 and 4's samples spike every time, reruns differing in the last bits: step 3
    spikes, its replay from step 2 spikes again, its batch is quarantined; the new step 3 reads
    step 4's old batch, which spikes the same way: both batches are quarantined, two rollbacks,
    and the run ends as the clean run without those 8 samples."""
    run_dir = tmp_path / "rollback"
    common = ["train.steps=5", "checkpoint.save_interval=2", "checkpoint.keep_last=5"]
    spiky = run_pretrain(
        train_args(run_dir, tiny_data, overrides=common + ["train.on_loss_spike=rollback"]),
        run_dir=run_dir, env=spike_environment(data=[9, 13], directory=tmp_path,
                                               nondeterministic=True)).check()
    spikes = [r for r in spiky.records if r["kind"] == "spike"]
    assert [(r["step"], r["verdict"], r["to_step"], r["samples"]) for r in spikes] == \
        [(3, "data", 2, STEP3), (3, "data", 2, STEP4)]
    assert [r["samples_quarantined"] for r in spikes] == [4, 8]
    last = _train_records(spiky)[-1]
    assert (last["spikes_rolled_back"], last["spikes_transient"], last["samples_quarantined"]) \
        == (2, 0, 8)
    meta = json.loads((run_dir / "checkpoints" / "step5" / "meta.json").read_text())
    assert meta["quarantined_samples"] == STEP3 + STEP4
    _agree(spiky, clean_runs(1, common + [f"data.exclude_samples={STEP3 + STEP4}"]),
           bitwise=False)

# A pipeline whose steps outlast the hang timeout while its micro-batches do not: 2 stages, 4
# micro-batches a step, rank 0 spending SLOW_MICRO_S as each of step 2's starts. Step 2, its
# replay and its rerun each last at least 4 x SLOW_MICRO_S = 8 s, longer than the timeout by
# construction; the beats of micro-batches come every SLOW_MICRO_S plus a tiny model's compute,
# which has the other 4 s of the timeout.
SLOW_MICRO_S = 2.0
SLOW_PIPELINE = ["parallel.pipeline=2", "train.micro_batch_size=1", "train.global_batch_size=4",
                 f"train.hang_timeout_minutes={3 * SLOW_MICRO_S / 60}", "train.steps=2",
                 "checkpoint.save_interval=1", "checkpoint.keep_last=3"]


@pytest.mark.slow
def test_pipeline_rollback_whose_replay_outlasts_the_hang_timeout(tiny_data, tmp_path):
    """Step 2's samples spike every time, and reruns differ in the last bits (as on GPUs): the
    pipeline replays step 2 from step 1's checkpoint, for longer than the hang timeout, finds it
    spikes again, quarantines step 2's samples and trains step 2 on the next ones, with no hang
    called: the stages beat per micro-batch, the replay per step."""
    run_dir = tmp_path / "run"
    run = run_pretrain(
        train_args(run_dir, tiny_data, overrides=SLOW_PIPELINE + ["train.on_loss_spike=rollback"]),
        run_dir=run_dir, nprocs=2, timeout=300,
        env=slow_spike_environment(0, SLOW_MICRO_S, from_step=2, data=[5], directory=tmp_path,
                                   nondeterministic=True)).check()
    assert not (run_dir / "hang").exists() and "[hang]" not in run.stdout
    records = _train_records(run)
    assert [r["step"] for r in records] == [1, 2, 2]
    assert min(r["step_time_s"] for r in records[1:]) > 3 * SLOW_MICRO_S  # outlasted the timeout
    [spike] = [r for r in run.records if r["kind"] == "spike"]
    assert (spike["step"], spike["verdict"], spike["to_step"]) == (2, "data", 1)
    assert spike["samples"] == [4, 5, 6, 7] and spike["replay_loss"] != records[1]["loss"]
    assert records[-1]["spikes_rolled_back"] == 1 and not records[-1]["loss_spike"]
    meta = json.loads((run_dir / "checkpoints" / "step2" / "meta.json").read_text())
    assert meta["quarantined_samples"] == [4, 5, 6, 7]
