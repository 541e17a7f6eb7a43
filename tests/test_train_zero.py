"""Multi-rank equivalence: every ZeRO stage and offload target trains the same model.

Each run is the real `pretrain train` under `torchrun` (2 ranks, gloo) against a single-process
run of the same global batch: 2 ranks x micro 2 x accum 1 versus 1 rank x micro 2 x accum 2.
Losses and gradient norms are both compared: Adam's update hardly moves when every gradient is
scaled by one factor, so a loss curve alone would not show a gradient reduced with the wrong
scale. What each run really built (ZeRO stage, dtypes, offload) is read from its run record,
which takes it from the engine, not from the config.
"""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from pretrain.config import load_config
from pretrain.testing.ranks import run_on_ranks
from pretrain.testing.runs import REPO, rel_diff, train

pytestmark = pytest.mark.slow  # training runs through the launchers (quick tier: not slow)

STEPS = 10
IN_MEMORY = {"offload_optimizer": "none", "offload_param": "none"}


def grad_norms(run) -> list[float]:
    return [r["grad_norm"] for r in run.records if r["kind"] == "train"]


def assert_trains_like(run, reference, losses: float, norms: float | None = None) -> None:
    """Same losses and same global gradient norms (before clipping), step by step, within
    these relative tolerances (`norms`: `losses` unless given)."""
    norms = losses if norms is None else norms
    assert rel_diff(run.losses, reference.losses) < losses, (run.losses, reference.losses)
    assert rel_diff(grad_norms(run), grad_norms(reference)) < norms, \
        (grad_norms(run), grad_norms(reference))


def engine_record(run) -> dict:
    """The run record's account of what DeepSpeed built."""
    head = run.records[0]
    assert head["kind"] == "run", head
    return {k: head[k] for k in ("zero_stage", "zero_optimizer", "optimizer", "param_dtypes",
                                 "master_dtypes", "offload_optimizer", "offload_param")}


@pytest.fixture(scope="module")
def single_fp32(tiny_data, tmp_path_factory):
    return train(tmp_path_factory.mktemp("ref"), tiny_data, name="single_fp32",
                 overrides=[f"train.steps={STEPS}"])


@pytest.fixture(scope="module")
def zero3_fp32(tiny_data, tmp_path_factory):
    # timeouts of no consequence here, other than the defaults: the groups are read back
    run = train(tmp_path_factory.mktemp("z3"), tiny_data, nprocs=2, name="zero3",
                overrides=[f"train.steps={STEPS}", "deepspeed=ds_configs/zero3.json",
                           "train.collective_timeout_minutes=20", "train.io_timeout_minutes=45"])
    assert engine_record(run) == {
        "zero_stage": 3, "zero_optimizer": "DeepSpeedZeroOptimizer_Stage3", "optimizer": "AdamW",
        "param_dtypes": ["float32"], "master_dtypes": ["float32"], **IN_MEMORY}
    return run


def test_the_process_groups_have_the_configured_timeouts(zero3_fp32):
    """The default group waits train.collective_timeout_minutes, the I/O group (saves, exports,
    the first rank's downloads) train.io_timeout_minutes: read back from the groups built."""
    assert zero3_fp32.records[0]["timeouts_minutes"] == {"collectives": 20.0, "io": 45.0}


@pytest.fixture(scope="module")
def bf16_run(tiny_data, tmp_path_factory):
    """The 2-rank bf16 run of a ZeRO stage, trained once for all the tests that compare it."""
    runs = {}

    def run(stage: int):
        if stage not in runs:
            runs[stage] = train(tmp_path_factory.mktemp(f"bf16_zero{stage}"), tiny_data,
                                nprocs=2, name=f"bf16_zero{stage}",
                                overrides=[f"train.steps={STEPS}",
                                           f"deepspeed=ds_configs/zero{stage}.json",
                                           "train.precision=bf16"])
        return runs[stage]

    return run


def test_single_process_run_learns(single_fp32):
    assert len(single_fp32.losses) == STEPS
    assert single_fp32.losses[-1] < single_fp32.losses[0] - 0.1, single_fp32.losses
    assert engine_record(single_fp32)["param_dtypes"] == ["float32"]
    # the test model sets logging.curves: false and a configured MFU peak: no picture drawn, MFU
    # against 1 TFLOP/s (tokens/s x FLOPs per token / 1e12)
    assert not (single_fp32.run_dir / "curves.png").exists()
    head = single_fp32.records[0]
    assert (head["peak_tflops"], head["peak_source"]) == (1.0, "logging.peak_tflops"), head


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_zero_stage_matches_single_process_fp32(stage, tiny_data, tmp_path, single_fp32):
    run = train(tmp_path, tiny_data, nprocs=2, name=f"zero{stage}",
                overrides=[f"train.steps={STEPS}", f"deepspeed=ds_configs/zero{stage}.json"])
    assert_trains_like(run, single_fp32, 1e-5)
    head = run.records[0]
    assert head["data_parallel"] == 2 and head["zero_stage"] == stage
    # ZeRO-0 leaves the torch optimizer alone; ZeRO-1/2 partition it (fp32: no bf16 wrapper)
    assert head["zero_optimizer"] == ("AdamW" if stage == 0 else "DeepSpeedZeroOptimizer")
    assert head["param_dtypes"] == head["master_dtypes"] == ["float32"]


def test_zero3_matches_single_process_fp32(zero3_fp32, single_fp32):
    assert_trains_like(zero3_fp32, single_fp32, 1e-5)


# bf16 against fp32, (losses, gradient norms), relative, measured over the 10 steps: ZeRO >= 1
# (fp32 gradient sums and masters; only forward and backward in bf16) 9e-5 and 3.3e-3. ZeRO-0
# 4.4e-3 and 4.5e-2, the same with 1 rank as with 2: DeepSpeed's FP16_UnfusedOptimizer steps
# torch's AdamW once with zero gradients when it is built, so Adam's bias correction runs a
# step ahead (the first update is 0.735 lr, measured) after one weight decay before step 1;
# it also sums gradients in bf16. Bounds ~3-5x the measurement: a run that silently stayed in
# fp32 is caught by the dtypes instead.
BF16_VS_FP32 = {0: (8e-3, 1e-1), 1: (5e-4, 1e-2), 2: (5e-4, 1e-2), 3: (5e-4, 1e-2)}
# bf16 ZeRO-2/3 against bf16 ZeRO-1, measured: losses 1.3e-5, gradient norms 2.3e-4.
BF16_ACROSS_STAGES = (1e-4, 1e-3)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_bf16_close_to_single_process(stage, bf16_run, single_fp32):
    """bf16 runs compute in bf16 and keep fp32 masters at every stage (ZeRO-0 too: DeepSpeed
    wraps the optimizer in its FP16_UnfusedOptimizer, which steps fp32 copies)."""
    run = bf16_run(stage)
    facts = engine_record(run)
    assert (facts["zero_stage"], run.records[0]["precision"]) == (stage, "bf16"), facts
    assert facts["param_dtypes"] == ["bfloat16"] and facts["master_dtypes"] == ["float32"], facts
    assert facts["zero_optimizer"] == {0: "FP16_UnfusedOptimizer", 1: "BF16_Optimizer",
                                       2: "DeepSpeedZeroOptimizer",
                                       3: "DeepSpeedZeroOptimizer_Stage3"}[stage], facts
    assert_trains_like(run, single_fp32, *BF16_VS_FP32[stage])


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_zero_stages_train_alike(stage, bf16_run):
    """ZeRO 1, 2 and 3 run the same bf16 forward and backward on the same samples per rank,
    sum gradients and reduce them in fp32 (the shipped `grad_accum_dtype` and
    `communication_data_type`) and step fp32 masters: they differ only in where each rank's
    share lives and in the order of fp32 sums (gradient norms, reductions), which a bf16
    forward amplifies a little where a master sits on a bf16 rounding boundary. A stage that
    summed gradients in bf16 moves the norm by ~1e-3 at the first step alone (see
    `test_bf16_sums_128_micro_batch_gradients_in_fp32`)."""
    assert_trains_like(bf16_run(stage), bf16_run(1), *BF16_ACROSS_STAGES)


@pytest.mark.parametrize("ds_config", ["zero2_offload_cpu", "zero3_offload_cpu"])
def test_cpu_offload_matches_zero3(ds_config, tiny_data, tmp_path, zero3_fp32):
    """Offloaded optimizer (DeepSpeed's CPU Adam) and parameters train like in-memory ZeRO-3."""
    run = train(tmp_path, tiny_data, nprocs=2, name=ds_config,
                overrides=[f"train.steps={STEPS}", f"deepspeed=ds_configs/{ds_config}.json"])
    assert_trains_like(run, zero3_fp32, 1e-5)
    stage = int(ds_config[4])
    facts = engine_record(run)
    assert (facts["zero_stage"], facts["optimizer"]) == (stage, "DeepSpeedCPUAdam"), facts
    assert (facts["offload_optimizer"], facts["offload_param"]) == \
        ("cpu", "cpu" if stage == 3 else "none"), facts


def test_nvme_offload_matches_zero3(libaio, tiny_data, tmp_path, zero3_fp32, monkeypatch):
    """ZeRO-Infinity: optimizer state and parameters swapped through files in the node's
    scratch directory ($SLURM_TMPDIR here)."""
    monkeypatch.setenv("SLURM_TMPDIR", str(tmp_path / "node_local"))
    # On a fresh machine DeepSpeed's async-io op compiles inside this run: 15.5 minutes on a
    # 2-core AMD EPYC (Zen 3) beside the other pytest worker, past the default 15-minute limit.
    run = train(tmp_path, tiny_data, nprocs=2, name="nvme", timeout=2400,
                overrides=[f"train.steps={STEPS}", "deepspeed=ds_configs/zero3_offload_nvme.json"])
    assert_trains_like(run, zero3_fp32, 1e-5)
    facts = engine_record(run)
    assert (facts["zero_stage"], facts["offload_optimizer"], facts["offload_param"]) == \
        (3, "nvme", "nvme"), facts
    # DeepSpeed's swappers make one folder per rank for parameters and optimizer state (and
    # delete the swap files themselves at exit); ZeRO-2 + nvme, which does no I/O, makes none.
    (swap,) = (tmp_path / "node_local" / "pretrain_nvme_swap").glob("nvme-*/zero_stage_3")
    for rank in (0, 1):
        assert (swap / "optimizer" / f"rank{rank}").is_dir(), list(swap.rglob("*"))
        assert list(swap.glob(f"*params/rank{rank}")), list(swap.rglob("*"))


def attention_forwards(trace_path) -> int:
    """Attention forwards in a profiler trace: recomputation in backward runs them again."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    return Counter(e.get("name") for e in events)["aten::scaled_dot_product_attention"]


def test_activation_checkpointing_under_zero3_recomputes_and_gives_the_same_losses(
        tiny_data, tmp_path, zero3_fp32):
    """Recomputation is observed, not assumed: in the profiled step every layer's attention runs
    twice per micro-batch on each rank (forward, then again in backward)."""
    run = train(tmp_path, tiny_data, nprocs=2, name="zero3_recompute",
                overrides=[f"train.steps={STEPS}", "deepspeed=ds_configs/zero3.json",
                           "model.activation_checkpointing=full", "logging.profile_steps='2:2'"])
    assert_trains_like(run, zero3_fp32, 1e-6)
    assert engine_record(run)["zero_stage"] == 3
    cfg = load_config(run.run_dir / "config.yaml")
    accum = run.records[0]["grad_accum"]
    for rank in (0, 1):
        trace = run.run_dir / "profile" / f"rank{rank}_steps2-2.json"
        assert attention_forwards(trace) == 2 * cfg.model.num_layers * accum, rank


def test_srun_style_environment_trains_like_torchrun(tiny_data, tmp_path, single_fp32):
    """Under `srun`, each task only has SLURM_* variables: the world is read from those."""
    import os
    import subprocess
    import sys

    from pretrain.dist import free_port
    from pretrain.testing.runs import REPO, Run

    run_dir = tmp_path / "srun"
    port = free_port()
    args = [sys.executable, "-m", "pretrain", "train", "--config", "configs/tiny.yaml",
            "--set", f"run_dir={run_dir}", "--set", f"data.tokenizer={tiny_data['tokenizer']}",
            "--set", f"data.dataset={tiny_data['dataset']}", "--set", f"train.steps={STEPS}"]
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                   SLURM_NTASKS_PER_NODE="2", SLURM_JOB_NODELIST="localhost",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=600) for p in procs]
    run = Run(procs[0].returncode, outs[0][0], outs[0][1] + outs[1][1], run_dir).check()
    assert procs[1].returncode == 0, outs[1][1][-3000:]
    assert run.records[0]["launcher"] == "slurm" and run.records[0]["world_size"] == 2
    assert run.records[0]["data_parallel"] == 2
    assert_trains_like(run, single_fp32, 1e-5)


def _bf16_accumulation_json(tmp_path) -> str:
    """ZeRO-1 as shipped, but gradients summed and reduced in bf16 (DeepSpeed's own default)."""
    import json

    ds = json.loads(open("ds_configs/zero1.json").read())
    ds["data_types"] = {"grad_accum_dtype": "bf16"}
    ds["communication_data_type"] = "bf16"
    path = tmp_path / "zero1_bf16_accumulation.json"
    path.write_text(json.dumps(ds))
    return str(path)


def test_bf16_sums_128_micro_batch_gradients_in_fp32(tiny_data, tmp_path):
    """One step of 128 micro-batches. With the shipped configs a bf16 run's gradient norm is the
    fp32 run's up to bf16's compute error (measured 4e-5 and 3e-4 relative for two inits);
    summed in bf16 (DeepSpeed's default), the same bf16 run moves by 3-30x more than that
    (measured 1.2e-3 and 1.3e-3): the rounding of the running sum. Norms before clipping."""
    batch = ["train.steps=1", "train.micro_batch_size=1", "train.global_batch_size=128",
             "model.seq_length=32"]
    runs = {name: train(tmp_path, tiny_data, name=name, overrides=batch + extra)
            for name, extra in [("fp32", []), ("bf16", ["train.precision=bf16"]),
                                ("bf16_sum", ["train.precision=bf16",
                                              f"deepspeed={_bf16_accumulation_json(tmp_path)}"])]}
    norm = {name: next(r for r in run.records if r["kind"] == "train")["grad_norm"]
            for name, run in runs.items()}
    compute = abs(norm["bf16"] - norm["fp32"]) / norm["fp32"]  # bf16 forward/backward only
    summing = abs(norm["bf16_sum"] - norm["bf16"]) / norm["fp32"]  # the same, summed in bf16
    assert compute < 1e-3, norm
    assert summing > 2 * compute, norm
    resolved = (runs["bf16"].run_dir / "ds_config.json").read_text()
    assert '"grad_accum_dtype": "fp32"' in resolved and '"communication_data_type": "fp32"' in resolved


def _first_bf16_zero0_update(rank: int, world_size: int, ds_json: str) -> dict:
    from pretrain.config import load_config
    from pretrain.dist import init_deepspeed_comm
    from pretrain.resolve.run import resolve_ds_config
    from pretrain.training.engine import build_engine
    from pretrain.resolve.topology import Topology

    init_deepspeed_comm(dist_backend="gloo", verbose=False)
    cfg = load_config(None, ["model.preset=tiny", "train.precision=bf16", f"deepspeed={ds_json}",
                             "train.lr=1e-2", "train.warmup_steps=1", "train.weight_decay=0.1",
                             "train.micro_batch_size=2", "train.global_batch_size=2"])
    ds_config = resolve_ds_config(cfg, world_size=1)
    groups = Topology(tensor=1, pipeline=1, world_size=1).create_groups()
    engine = build_engine(cfg, ds_config, groups, main=True)
    wrapper = engine.optimizer
    masters = [m for group in wrapper.fp32_groups for m in group]
    lows = [p for group in wrapper.fp16_groups for p in group]
    before = [m.clone() for m in masters]
    weights = [p.float() for p in lows]
    state_before = len(wrapper.optimizer.state)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(ids[:, :-1], labels=ids[:, 1:]))
    engine.step()
    steps = {int(s["step"]) for s in wrapper.optimizer.state.values()}
    norm_deltas = [(m - b).abs() for m, b, p in zip(masters, before, lows) if p.ndim == 1]
    return {"wrapper": type(wrapper).__name__, "state_before": state_before, "steps": steps,
            "masters_were_the_weights": all(torch.equal(b, w) for b, w in zip(before, weights)),
            "norm_delta_max": max(float(d.max()) for d in norm_deltas),
            "norm_delta_median": float(torch.cat(norm_deltas).median()),
            "lr": cfg.train.lr}  # warmup of one step: the first update is at the peak


def test_bf16_pipeline_stages_accumulate_each_micro_batch_once(tiny_data, tmp_path):
    """bf16, ZeRO-1 (DeepSpeed's BF16_Optimizer), 4 micro-batches a step: 2 pipeline stages train
    as 2 data-parallel ranks do (losses within 2e-6 relative over 4 steps; measured 1e-7, the
    pipeline's other order of sums). Without bf16.immediate_grad_update, DeepSpeed's pipeline adds
    a stage's bf16 gradients into fp32 after every micro-batch without clearing them, so every
    stage but the last sums 1 + 2 + 3 + 4 micro-batches' gradients: its losses drift by 6e-4
    at step 2 and 2e-3 at step 4. The resolver sets the flag for bf16 runs."""
    batch = ["train.steps=4", "train.precision=bf16", "deepspeed=ds_configs/zero1.json",
             "train.global_batch_size=4", "train.micro_batch_size=1"]
    runs = {name: train(tmp_path / name, tiny_data, nprocs=2, name=name,
                        overrides=batch + [f"parallel.pipeline={pp}"])
            for name, pp in (("flat", 1), ("pp2", 2))}
    losses = {name: [r["loss"] for r in run.records if r["kind"] == "train"]
              for name, run in runs.items()}
    assert len(losses["pp2"]) == 4, losses
    for flat, piped in zip(losses["flat"], losses["pp2"]):
        assert abs(flat - piped) <= 2e-6 * abs(flat), losses


def test_bf16_zero0_first_update_is_adams_first_step(tmp_path):
    """DeepSpeed's bf16 ZeRO-0 optimizer steps once with zero gradients while it is built;
    pretrain.training.engine forgets that step: before the first update the optimizer has no state and the
    fp32 masters are the module's weights (no weight decay applied yet); after it, Adam's step
    count is 1 and an undecayed weight (the norms) moved by lr * g / (|g| + eps), ~lr, where the
    step DeepSpeed took makes it 0.735 x lr (bias correction of step 2)."""
    [result] = run_on_ranks(_first_bf16_zero0_update, world_size=1, tmp_path=tmp_path,
                            args=(str(REPO / "ds_configs" / "zero0.json"),))
    assert result["wrapper"] == "FP16_UnfusedOptimizer"
    assert result["state_before"] == 0 and result["masters_were_the_weights"], result
    assert result["steps"] == {1}, result
    assert result["norm_delta_max"] <= result["lr"] * (1 + 1e-6), result
    assert result["norm_delta_median"] > 0.99 * result["lr"], result


def _bf16_pipeline_gradient_sums(rank: int, world_size: int, ds_json: str) -> dict:
    """Build the tiny model's bf16 pipeline (pp 2, ZeRO-0) and sum 1 + 64 x 2**-10 into each
    gradient through the optimizer's own accumulation (under bf16.immediate_grad_update, which
    the resolver sets, each gradient's backward hook; else `update_hp_grads`, what DeepSpeed
    runs after every micro-batch's backward). fp32 holds 1.0625 exactly; bf16 (8-bit mantissa,
    spacing 2**-7 at 1) rounds every 1 + 2**-10 back to 1."""
    from pretrain.config import load_config
    from pretrain.dist import init_deepspeed_comm
    from pretrain.resolve.run import resolve_ds_config
    from pretrain.training.engine import build_engine
    from pretrain.resolve.topology import Topology

    init_deepspeed_comm(dist_backend="gloo", verbose=False)
    cfg = load_config(None, ["model.preset=tiny", "train.precision=bf16", f"deepspeed={ds_json}",
                             "parallel.pipeline=2", "train.micro_batch_size=2",
                             "train.global_batch_size=4"])
    ds_config = resolve_ds_config(cfg, world_size=world_size)
    groups = Topology(tensor=1, pipeline=2, world_size=world_size, rank=rank).create_groups()
    engine = build_engine(cfg, ds_config, groups, main=rank == 0)
    optimizer = engine.optimizer
    lows = [(i, j, p) for i, group in enumerate(optimizer.bf16_groups)
            for j, p in enumerate(group)]
    for value, times in ((1.0, 1), (2.0**-10, 64)):
        for _ in range(times):
            for i, j, p in lows:
                p.grad = torch.full_like(p, value)
                if optimizer.immediate_grad_update:  # what each gradient's backward hook runs
                    optimizer.accumulate_hp_grads_and_remove_lp(p, i, j)
            optimizer.update_hp_grads()  # what runs after a micro-batch (a no-op when immediate)
    sums = torch.cat([g.flatten() for g in optimizer.fp32_groups_actual_gradients_flat])
    return {"optimizer": type(optimizer).__name__, "immediate": optimizer.immediate_grad_update,
            "buffer_dtypes": sorted({str(g.dtype) for g in optimizer.fp32_groups_gradients_flat}),
            "sums": sorted({float(v) for v in sums.unique()})}


def test_bf16_pipeline_at_zero0_sums_gradients_in_fp32(tmp_path):
    results = run_on_ranks(_bf16_pipeline_gradient_sums, world_size=2, tmp_path=tmp_path,
                           args=(str(REPO / "ds_configs" / "zero0.json"),), timeout_s=300)
    for result in results:  # both stages
        assert result["optimizer"] == "BF16_Optimizer", result
        assert result["immediate"], result  # the resolver's bf16.immediate_grad_update
        assert result["buffer_dtypes"] == ["torch.float32"], result
        assert result["sums"] == [1.0625], result
