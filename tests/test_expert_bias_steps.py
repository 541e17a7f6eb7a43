"""The expert bias of the sigmoid router (DeepSeek-V3's auxiliary-loss-free balancing,
`model.moe_bias_update_rate`) moves with the optimizer's updates, never on its own: a step whose
update the non-finite guard skipped leaves it bitwise, a loss spike's rollback restores it with
the weights and the replayed steps move it as the first run did (the trainer's
`_end_router_step`, `_replay_step`). And a rollback under `train.batch_ramp` replays each step
at its own ramped size (`pretrain.training.spikes.roll_back`, driven in this process)."""
from __future__ import annotations

import dataclasses

import pytest

from pretrain.config import BatchRamp
from pretrain.data.samples import stream_numbers
from pretrain.resolve.batch_ramp import RampSchedule
from pretrain.testing.faults import nan_loss_environment, spike_environment
from pretrain.testing.runs import run_pretrain, train, train_args

# the bias-balanced tiny DeepSeek-V3 of tests/test_families.py (layer 0 dense, two mixture
# layers of 8 experts in 4 groups, top-3 of the best 2 groups, rate 0.01); the tokenizer's
# vocabulary, randomly initialised
DEEPSEEK_BIAS = ["model.family=deepseek_v3", "model.num_kv_heads=4", "model.kv_lora_rank=24",
                 "model.v_head_dim=20", "model.q_lora_rank=40", "model.qk_nope_head_dim=12",
                 "model.qk_rope_head_dim=8", "model.num_layers=3", "model.num_experts=8",
                 "model.experts_per_token=3", "model.moe_ffn_hidden_size=40",
                 "model.moe_router=sigmoid", "model.moe_groups=4", "model.moe_topk_groups=2",
                 "model.num_shared_experts=2", "model.moe_first_dense_layers=1",
                 "model.moe_routed_scaling_factor=2.5", "model.moe_aux_loss_coeff=0",
                 "model.moe_bias_update_rate=0.01"]


def _train_records(run) -> list[dict]:
    return [r for r in run.records if r["kind"] == "train"]


def _last_per_step(run, key: str) -> dict[int, object]:
    """`key` of each step's record as the run finally took the step (a rollback redoes steps)."""
    return {r["step"]: r[key] for r in _train_records(run)}


@pytest.mark.slow  # `pretrain train`, one process, 4 steps
def test_a_skipped_step_leaves_the_expert_bias_and_a_taken_step_moves_it(tiny_data, tmp_path):
    """Step 3's loss is NaN: the guard skips its update, and the bias after it is bitwise the
    bias after step 2; steps 2 and 4, taken, move it (the loads of a skipped step's forwards are
    still reported)."""
    run_dir = tmp_path / "nan"
    run = run_pretrain(train_args(run_dir, tiny_data, overrides=[*DEEPSEEK_BIAS, "train.steps=4"]),
                       run_dir=run_dir, env=nan_loss_environment([3], directory=tmp_path)).check()
    records = _train_records(run)
    assert [r["update_skipped"] for r in records] == [False, False, True, False]
    bias = [r["moe_expert_bias"] for r in records]
    assert bias[2] == bias[1]  # bitwise: json keeps every float bit
    assert bias[1] != bias[0] and bias[3] != bias[2]
    assert sum(sum(layer) for layer in records[2]["moe_expert_tokens"]) > 0


STEP3 = list(range(8, 12))  # the sample numbers of step 3 (global batch 4)


@pytest.mark.slow  # `pretrain train`, one process, twice
def test_a_rollback_restores_the_expert_bias_and_replays_its_steps(tiny_data, tmp_path):
    """Checkpoints every 2 steps. Step 3's samples spike every time: the run goes back to step
    2 and quarantines them; the new step 4 spikes once (a transient fault): steps 3 and 4 are
    replayed from step 2 and kept. The run ends equal, bitwise in fp32 (losses, the expert bias
    of every step, every saved tensor), to a clean run that never read step 3's samples: the
    checkpoint load restored the bias the spiking step had moved, and each replayed step moved
    it as the first run of that step did."""
    from test_spikes import _changed, _tensors

    common = [*DEEPSEEK_BIAS, "train.steps=5", "checkpoint.save_interval=2",
              "checkpoint.keep_last=5"]
    run_dir = tmp_path / "rollback"
    spiky = run_pretrain(
        train_args(run_dir, tiny_data, overrides=[*common, "train.on_loss_spike=rollback"]),
        run_dir=run_dir, env=spike_environment(data=[9], transient=[17],
                                               directory=tmp_path)).check()
    clean = train(tmp_path, tiny_data, name="clean",
                  overrides=[*common, f"data.exclude_samples={STEP3}"])
    spikes = [r for r in spiky.records if r["kind"] == "spike"]
    assert [(r["step"], r["verdict"], r["to_step"]) for r in spikes] == \
        [(3, "data", 2), (4, "transient", 2)]
    losses, clean_losses = _last_per_step(spiky, "loss"), _last_per_step(clean, "loss")
    losses[4] = spikes[1]["replay_loss"]  # the record of step 4 is its first (spiking) run's
    assert losses == clean_losses
    assert _last_per_step(spiky, "moe_expert_bias") == _last_per_step(clean, "moe_expert_bias")
    bias = _last_per_step(clean, "moe_expert_bias")
    assert bias[5] != bias[4] != bias[3] != bias[2]  # every step moved it
    assert _changed(_tensors(run_dir / "checkpoints" / "step5"),
                    _tensors(clean.run_dir / "checkpoints" / "step5")) == []


# ---- a rollback under a batch ramp, in this process ------------------------------------------
# 2 samples, growing by 2 over the first 4 samples to 6: steps of 2, 4, 6, 6, ...; a checkpoint
# after step 1 (2 samples), so a replay up to step 4 runs steps of 3 sizes
RAMP = RampSchedule(6, BatchRamp(start=2, increment=2, samples=4))
RAMP_SAVED_AT = 1


def _ramped_loop(tmp_path, monkeypatch, **spiking):
    """`tests/test_spike_verdict.py`'s model-free loop, its steps' sizes the ramp's at the
    samples consumed before each (as the trainer's `train_step` takes them), its checkpoint
    after step RAMP_SAVED_AT."""
    from test_spike_verdict import _Loop, _loading

    from pretrain.training import spikes

    loop = _loading(monkeypatch, _Loop(tmp_path, **spiking))
    plain_step = loop.train_step

    def train_step(batches):
        loss, wait = plain_step(batches)  # its samples at the fixed size, then the ramp's
        position = loop.position
        position.step_samples = stream_numbers(
            position.consumed_samples, RAMP.size_at(position.consumed_samples),
            skip=loop.spikes.quarantine)
        return loss, wait

    saved: dict[int, int] = {}  # consumed samples at each checkpoint's step

    def read_meta(path):
        step = int(path.name.removeprefix("step"))
        return {"step": step, "consumed_samples": saved[step]}

    monkeypatch.setattr(spikes, "read_meta", read_meta)
    loop.state = dataclasses.replace(loop.state, train_step=train_step)

    def run_to(step: int, losses: list[float]) -> float:
        position = loop.position
        while position.step < step:
            loss, _ = train_step(loop.loader(None, consumed=0, workers=0))
            position.step += 1
            position.consumed_samples += len(position.step_samples)
            losses.append(loss)
            if position.step == RAMP_SAVED_AT:
                position.saved_step = RAMP_SAVED_AT
                saved[RAMP_SAVED_AT] = position.consumed_samples
        return loss

    loop.run_to = run_to
    return loop


def test_a_rollback_replays_the_ramp_steps_at_their_own_sizes(tmp_path, monkeypatch):
    """Sizes 2, 4, 6, 6 and a checkpoint after step 1. A transient spike at step 4: its replay
    from step 1 runs steps 2-4 at 4, 6, 6 samples and the loop goes on at 18 consumed (a replay
    advancing by the full global batch would be at 20). A data spike at step 3 quarantines that
    step's 6 samples (6-11), not a full or starting batch's, and the loop is back at 2."""
    from test_spike_verdict import _roll_back

    assert [RAMP.size_at(c) for c in (0, 2, 6, 12)] == [2, 4, 6, 6]
    # the loop fires its spikes on the 4 numbers from a step's consumed samples on: sample 13
    # in step 4's (from 12), 9 in step 3's (from 6)
    loop = _ramped_loop(tmp_path, monkeypatch, once={13})
    _, spike = _roll_back(loop, 4)
    assert (spike["verdict"], spike["to_step"]) == ("transient", RAMP_SAVED_AT)
    assert (loop.position.step, loop.position.consumed_samples) == (4, 18)
    assert loop.position.step_samples == list(range(12, 18))

    loop = _ramped_loop(tmp_path, monkeypatch, bad={9})
    _, spike = _roll_back(loop, 3)
    assert (spike["verdict"], spike["samples"]) == ("data", list(range(6, 12)))
    assert (loop.position.step, loop.position.consumed_samples) == (RAMP_SAVED_AT, 2)
