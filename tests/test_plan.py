"""The planner's arithmetic: memory by ZeRO stage / offload / recompute / SP, two published
runs, and the predictions docs/planning-and-telemetry.md and BENCHMARKS.md print."""
from __future__ import annotations

import json
import subprocess
from dataclasses import replace

import pytest

from pretrain.testing.cli import run_cli
from pretrain.testing.runs import REPO
from pretrain.arithmetic import num_parameters, stage_items, stage_parameters
from pretrain.config import MODEL_PRESETS, ModelConfig, Precision, Recompute, load_config
from pretrain.errors import ConfigError
from pretrain.resolve.ds_config import gradient_dtypes
from pretrain.resolve.layout import Layout
from pretrain.resolve.run import resolve_ds_config
from pretrain.plan.clusters import MATMUL_EFFICIENCY, MEMORY_BANDWIDTH_EFFICIENCY, make_cluster
from pretrain.plan.memory import layer_activation_elements
from pretrain.plan.published import BLOOM_176B, MEGATRON_70B
from pretrain.plan.search import estimate, search

LLAMA_7B = ModelConfig(**MODEL_PRESETS["7b"])
UNFUSED_7B = replace(LLAMA_7B, fused_projections=False)
H100 = make_cluster("h100-80gb", nodes=1)


def _mem(layout: Layout, model: ModelConfig = LLAMA_7B):
    return estimate(model, layout, H100).memory


def test_model_states_follow_zero_stage_by_stage():
    """Mixed precision: 2 + 2 + 12 bytes per parameter; ZeRO shards 12, then 2, then 2 by dp.
    bf16 at ZeRO 1 steps in DeepSpeed's BF16_Optimizer, which sums the bf16 gradients into an
    unsharded fp32 buffer of the whole model: 4 bytes of gradients per parameter, each bf16
    gradient freed once added (the resolver's bf16.immediate_grad_update)."""
    base = Layout(data=8, global_batch=8, precision=Precision.BF16)
    n = stage_parameters(LLAMA_7B, base, stage_items(LLAMA_7B, base)[0])
    assert n == num_parameters(LLAMA_7B) + (LLAMA_7B.padded_vocab_size() - 32000) * 4096 * 2
    z1, z2, z3 = (_mem(replace(base, zero_stage=s)) for s in (1, 2, 3))
    assert (z1.params, z1.grads, z1.optimizer) == (2 * n, 4 * n, 12 * n / 8)
    assert (z2.params, z2.grads, z2.optimizer) == (2 * n, 2 * n / 8, 12 * n / 8)
    assert (z3.params, z3.grads, z3.optimizer) == (2 * n / 8, 2 * n / 8, 12 * n / 8)
    assert z3.model_states == pytest.approx(16 * n / 8)  # the 16 bytes / parameter / dp theory
    z0 = _mem(replace(base, zero_stage=0))  # DeepSpeed's bf16 ZeRO-0: fp32 masters, and the
    assert (z0.params, z0.grads, z0.optimizer) == (2 * n, 6 * n, 12 * n)  # gradients widened
    fp32 = _mem(replace(base, zero_stage=0, precision=Precision.FP32))
    assert (fp32.params, fp32.grads, fp32.optimizer) == (4 * n, 4 * n, 8 * n)
    offload = _mem(replace(base, zero_stage=1, offload_optimizer="cpu"))  # ZeRO's optimizer
    assert (offload.params, offload.grads, offload.optimizer) == (2 * n, 2 * n, 0)


def test_bf16_pipelines_at_zero0_step_in_the_bf16_optimizer():
    """DeepSpeed gives a bf16 pipeline at ZeRO 0 its BF16_Optimizer too: fp32 masters and
    moments partitioned over data parallelism, an unsharded fp32 gradient buffer."""
    pp = Layout(pipeline=2, data=4, global_batch=8, precision=Precision.BF16, zero_stage=0)
    memory = _mem(pp)
    n = memory.parameters_count
    assert (memory.params, memory.grads, memory.optimizer) == (2 * n, 4 * n, 12 * n / 4)


def test_offload_moves_states_to_the_host():
    base = Layout(data=8, global_batch=8, zero_stage=3)
    on_gpu = _mem(base)
    opt = _mem(replace(base, offload_optimizer="cpu"))
    both = _mem(replace(base, offload_optimizer="cpu", offload_param="cpu"))
    assert opt.optimizer == 0 and opt.params == on_gpu.params
    assert opt.host == pytest.approx(on_gpu.optimizer + 4 * on_gpu.parameters_count / 8)
    assert both.params == 0 and both.host == pytest.approx(opt.host + on_gpu.params)
    assert both.total < opt.total < on_gpu.total


def test_activations_by_recompute_and_sequence_parallel():
    """Korthikanti et al.: full recompute keeps each layer's input only (s*b*h, /t with SP);
    SP divides the replicated part by t; 1F1B's first stage holds pp micro-batches."""
    m = LLAMA_7B
    tokens = 2 * m.seq_length
    base = Layout(tensor=4, data=2, micro_batch=2, global_batch=64, zero_stage=1)
    rep, shard = layer_activation_elements(m, base)
    assert shard == pytest.approx((3 * 4096 + 2 * 4096 + 4 * 11008) / 4)
    rep_sp, shard_sp = layer_activation_elements(m, replace(base, sequence_parallel=True))
    assert (rep_sp, shard_sp) == (pytest.approx(rep / 4), shard)

    none, full = _mem(base), _mem(replace(base, recompute=Recompute.FULL))
    head = tokens * (m.padded_vocab_size(4) // 4) * (2 + 4) + tokens * 4096 * 2
    layer = (rep + shard) * tokens * 2
    assert none.activations == pytest.approx(32 * layer + tokens * 4096 * 2 + head)
    inputs = tokens * 4096 * 2
    assert full.activations == pytest.approx(32 * inputs + layer + inputs + head)
    full_sp = _mem(replace(base, recompute=Recompute.FULL, sequence_parallel=True))
    assert full_sp.activations < full.activations

    pp = replace(base, pipeline=4, data=1, global_batch=64)
    stages = stage_items(m, pp)
    assert sum(s.count("layer") for s in stages) == 32
    plan = estimate(m, pp, H100)
    first = plan.stages[0]
    assert plan.memory.stage == 0 and first["embedding"]
    # stage 0 keeps 4 micro-batches in flight; with 2 micro-batches per step only 2
    few = estimate(m, replace(pp, global_batch=4), H100).memory
    assert few.activations == pytest.approx(plan.memory.activations / 2, rel=0.01)


def test_hardware_flops_exceed_model_flops_with_recompute():
    base = Layout(data=8, global_batch=64, zero_stage=1)
    plain, full = estimate(LLAMA_7B, base, H100), \
        estimate(LLAMA_7B, replace(base, recompute=Recompute.FULL), H100)
    assert plain.hfu == pytest.approx(plain.mfu)
    assert full.hfu > full.mfu and full.hardware_tflops_per_gpu > full.model_tflops_per_gpu
    assert full.time.step > plain.time.step


def test_invalid_layouts_are_refused():
    with pytest.raises(ConfigError, match="pipelines support ZeRO 0 or 1"):
        estimate(LLAMA_7B, Layout(pipeline=2, data=4, global_batch=8, zero_stage=2), H100)
    with pytest.raises(ConfigError, match="tensor=3 must divide"):
        estimate(LLAMA_7B, Layout(tensor=3, global_batch=1), H100)
    with pytest.raises(ConfigError, match="NVMe offload needs ZeRO stage 3"):
        estimate(LLAMA_7B, Layout(data=2, global_batch=2, zero_stage=2,
                                  offload_optimizer="nvme"), H100)


# ---- what DeepSpeed does beyond the layout: the dtype it reduces in, its memory-bound copies --

H100_COPY = 3350e9 * MEMORY_BANDWIDTH_EFFICIENCY  # bytes/s a memory-bound copy sustains


def _dp_work(layout: Layout, cluster, ds: dict | None, model: ModelConfig = UNFUSED_7B) -> float:
    """Seconds of data-parallel communication of one step, the part the backward hides back
    in (ZeRO 0/1: one reduction behind the last micro-batch's backward, 2/3 of its compute)."""
    t = estimate(model, layout, cluster, ds=ds).time
    return t.data_comm + t.compute / layout.grad_accum * 2 / 3


def test_data_parallel_time_follows_the_communication_dtype():
    """DeepSpeed reduces gradients in `communication_data_type`: the resolver's fp32 for bf16
    under ZeRO moves 4 bytes a gradient, twice bf16's; the planner's default is the resolver's."""
    slow = make_cluster("h100-80gb", nodes=2, inter_node_gbps=1.0)  # the reduction exposed
    layout = Layout(data=16, global_batch=16, zero_stage=1, precision=Precision.BF16)
    fp32 = _dp_work(layout, slow, {"communication_data_type": "fp32"})
    bf16 = _dp_work(layout, slow, {"communication_data_type": "bf16"})
    assert fp32 == pytest.approx(2 * bf16, rel=1e-9)
    assert _dp_work(layout, slow, None) == fp32
    # ZeRO-2: a reduce-scatter of every micro-batch in that dtype (twice the bytes in fp32)
    # and, after the step, an all-gather of the bf16 parameters (as many bytes as bf16's
    # reduce-scatter): 3 : 2
    zero2 = replace(layout, zero_stage=2)
    fp32, bf16 = (_dp_work(zero2, slow, {"communication_data_type": dtype})
                  for dtype in ("fp32", "bf16"))
    assert fp32 == pytest.approx(1.5 * bf16, rel=1e-9)
    # what fill_ds_config writes into the shipped JSON is what the planner assumed
    cfg = load_config(None, ["model.preset=tiny", "train.precision=bf16",
                             "deepspeed=ds_configs/zero1.json"])
    resolved = resolve_ds_config(cfg, world_size=16)
    assert gradient_dtypes(layout, resolved) == gradient_dtypes(layout) == ("fp32", "fp32")


def test_plan_counts_the_json_s_communication_dtype(tmp_path):
    """`pretrain plan` plans the run's own JSON: communication_data_type bf16 halves the bytes
    of the data-parallel time the fp32 the resolver fills in costs."""
    source = json.loads((REPO / "ds_configs" / "zero1.json").read_text())
    path = tmp_path / "zero1_bf16_reduce.json"
    path.write_text(json.dumps({**source, "communication_data_type": "bf16"}))
    common = ["--config", "configs/tiny.yaml", "--set", "train.precision=bf16",
              "--world-size", "2", "--json"]
    plans = []
    for extra in ([], ["--deepspeed-config", str(path)]):
        out = _plan_cli(*common, *extra)
        assert out.returncode == 0, out.stderr
        plans.append(json.loads(out.stdout))
    assert [p["deepspeed"]["communication_data_type"] for p in plans] == ["fp32", "bf16"]
    work = [p["time_s"]["data_comm"] + p["time_s"]["compute"] / p["layout"]["grad_accum"] * 2 / 3
            for p in plans]
    assert work[0] == pytest.approx(2 * work[1], rel=1e-9)


def test_bf16_optimizer_adds_every_bf16_gradient_into_fp32_each_micro_batch():
    """DeepSpeed's BF16_Optimizer (bf16, ZeRO-1, fp32 accumulation) reads each bf16 gradient
    (2 bytes) and its fp32 sum (4) and writes the sum (4) every micro-batch, at the memory
    bandwidth; not when another optimizer steps (ZeRO-2, fp32, offload, bf16 accumulation)."""
    layout = Layout(data=8, global_batch=64, zero_stage=1, precision=Precision.BF16)
    plan = estimate(UNFUSED_7B, layout, H100)
    n = plan.memory.parameters_count
    assert plan.time.memory_bound == pytest.approx(8 * n * 10 / H100_COPY, rel=1e-12)
    for other, ds in ((replace(layout, zero_stage=2), None),
                      (replace(layout, precision=Precision.FP32), None),
                      (replace(layout, offload_optimizer="cpu"), None),
                      (layout, {"data_types": {"grad_accum_dtype": "bf16"}})):
        assert estimate(UNFUSED_7B, other, H100, ds=ds).time.memory_bound == 0, other
    # each bf16 gradient is freed as it is added (the resolver's immediate_grad_update); a JSON
    # that turns it off keeps them all to the step: 2 bytes more per parameter
    assert plan.memory.grads == 4 * n
    kept = estimate(UNFUSED_7B, layout, H100, ds={"bf16": {"immediate_grad_update": False}})
    assert kept.memory.grads == 6 * n


def test_the_resolver_adds_bf16_gradients_in_their_backward_hooks():
    """bf16.immediate_grad_update: true for bf16 runs, unless the JSON says otherwise."""
    def resolved(*overrides: str, source: dict | None = None) -> dict:
        cfg = load_config(None, ["model.preset=tiny", "deepspeed=ds_configs/zero1.json",
                                 *overrides])
        return resolve_ds_config(cfg, world_size=2, source=source)

    assert resolved("train.precision=bf16")["bf16"]["immediate_grad_update"] is True
    assert "immediate_grad_update" not in resolved("train.precision=fp32")["bf16"]
    source = json.loads((REPO / "ds_configs" / "zero1.json").read_text())
    off = resolved("train.precision=bf16",
                   source={**source, "bf16": {"immediate_grad_update": False}})
    assert off["bf16"]["immediate_grad_update"] is False


def test_fused_projections_concatenate_each_layers_weights_every_pass():
    """Fused projections copy this rank's q/k/v rows and gate/up (read and write, bf16) in
    every layer's forward and backward, once more per recomputed layer."""
    layout = Layout(tensor=2, data=4, global_batch=32, zero_stage=2, sequence_parallel=True,
                    precision=Precision.BF16)  # 8 micro-batches
    fused = estimate(LLAMA_7B, layout, H100).time
    assert estimate(UNFUSED_7B, layout, H100).time.memory_bound == 0
    weights = (4096 * (32 + 2 * 32) * 128 + 2 * 4096 * 11008) / 2  # this rank's half
    per_pass = 2 * weights * 2
    assert fused.memory_bound == pytest.approx(8 * 32 * 2 * per_pass / H100_COPY, rel=1e-12)
    recomputed = estimate(LLAMA_7B, replace(layout, recompute=Recompute.FULL), H100).time
    assert recomputed.memory_bound == pytest.approx(1.5 * fused.memory_bound, rel=1e-12)
    # a mixture of experts concatenates every expert's gate and up it holds
    moe = replace(UNFUSED_7B, fused_projections=True, num_experts=4, experts_per_token=2)
    moe_weights = (4096 * (32 + 2 * 32) * 128 + 4 * 2 * 4096 * 11008) / 2
    assert estimate(moe, layout, H100).time.memory_bound == pytest.approx(
        8 * 32 * 2 * 2 * moe_weights * 2 / H100_COPY, rel=1e-12)


# ---- the published runs (pretrain.plan.published): one set of efficiency constants for both --

def test_megatron_core_70b_on_768_h100():
    run = MEGATRON_70B
    plan = estimate(run["model"], run["layout"], run["cluster"], ds=run["ds"])
    assert plan.fits
    assert plan.mfu == pytest.approx(run["published_mfu"], rel=0.20)
    assert plan.model_tflops_per_gpu == pytest.approx(run["published_tflops"], rel=0.20)
    assert plan.mfu < MATMUL_EFFICIENCY  # communication and the bubble cost something


def test_bloom_176b_on_384_a100():
    run = BLOOM_176B
    assert num_parameters(run["model"]) == pytest.approx(176e9, rel=0.02)
    plan = estimate(run["model"], run["layout"], run["cluster"], ds=run["ds"])
    assert plan.fits
    assert plan.hardware_tflops_per_gpu == pytest.approx(run["published_hw_tflops"], rel=0.20)
    assert plan.hfu == pytest.approx(150 / 312, rel=0.20)
    # recompute: layers run 4 passes of which 3 count; the output layer is not recomputed
    assert 0.75 * plan.hfu < plan.mfu < 0.8 * plan.hfu


# ---- the predictions the planning docs and BENCHMARKS.md print: a change in the planner fails here
# until these numbers and the documents are updated together

PLANNING_DOC = "docs/planning-and-telemetry.md"


def _doc(name: str) -> str:
    """A document of the repository with its line breaks as spaces."""
    return " ".join((REPO / name).read_text().split())


def test_published_runs_predict_what_the_docs_and_benchmarks_print():
    megatron = estimate(MEGATRON_70B["model"], MEGATRON_70B["layout"], MEGATRON_70B["cluster"],
                        ds=MEGATRON_70B["ds"])
    bloom = estimate(BLOOM_176B["model"], BLOOM_176B["layout"], BLOOM_176B["cluster"],
                     ds=BLOOM_176B["ds"])
    # each within half a unit of the last digit printed
    assert megatron.mfu == pytest.approx(0.345, abs=0.0005)
    assert megatron.model_tflops_per_gpu == pytest.approx(342, abs=0.5)
    assert bloom.hardware_tflops_per_gpu == pytest.approx(147, abs=0.5)
    t = megatron.time
    assert (round(t.step, 2), round(t.compute, 2), round(t.tensor_comm, 2), round(t.bubble, 2),
            round(t.data_comm, 2), round(t.memory_bound, 2)) == (2.69, 1.57, 0.42, 0.27, 0.30,
                                                                 0.13)
    t = bloom.time
    assert (round(t.step, 1), round(t.compute, 1), round(t.tensor_comm, 1), round(t.bubble, 1),
            round(t.pipeline_comm, 1), round(t.data_comm, 2), round(t.memory_bound, 1),
            round(t.pipeline_overhead, 2)) == (101.0, 85.8, 3.4, 7.9, 0.4, 0.25, 3.1, 0.03)
    planning, benchmarks = _doc(PLANNING_DOC), _doc("BENCHMARKS.md")
    assert ("x DP 48 on 768 H100 (published ~42% MFU, 420 TFLOP/s per GPU; predicted 34.5%, 342) "
            "and BLOOM-176B") in planning
    assert "(published ~150 TFLOP/s per GPU counting recomputation; predicted 147)" in planning
    assert ("| 34.5% MFU, 342 TFLOP/s/GPU | 0.82 / 0.81 | 2.69 s = compute 1.57 + TP 0.42 + "
            "bubble 0.27 + DP 0.30 + copies 0.13 |") in benchmarks
    assert ("| 147 TFLOP/s/GPU | 0.98 | 101.0 s = compute 85.8 + TP 3.4 + bubble 7.9 + PP 0.4 + "
            "DP 0.25 + copies 3.1 + schedule 0.03 |") in benchmarks


def test_the_step_time_is_the_sum_of_its_parts_and_each_part_follows_its_dimension():
    """Every part of the breakdown is in the step, and a parallel dimension of 1 (or no
    offloading) costs no time of its own: each dimension turned on alone adds its parts only."""
    from dataclasses import fields

    from pretrain.plan.step_time import TimeBreakdown

    parts = [field.name for field in fields(TimeBreakdown)]
    cluster = make_cluster("h100-80gb", nodes=4)

    def spent(layout: Layout, model: ModelConfig = UNFUSED_7B) -> set[str]:
        t = estimate(model, layout, cluster).time
        assert sum(getattr(t, name) for name in parts) == pytest.approx(t.step, rel=1e-12)
        return {name for name in parts if getattr(t, name) > 0}

    alone = Layout(global_batch=64, micro_batch=1)
    assert spent(alone) == {"compute"}
    assert spent(alone, LLAMA_7B) == {"compute", "memory_bound"}  # the weights concatenated
    assert spent(replace(alone, tensor=2, sequence_parallel=True)) == {"compute", "tensor_comm"}
    # a bf16 pipeline steps in DeepSpeed's BF16_Optimizer: its fp32 sums are copies
    # (a pipeline's schedule also pays each action's runtime and each message's latency)
    assert spent(replace(alone, pipeline=2)) == {"compute", "bubble", "pipeline_comm",
                                                 "memory_bound", "pipeline_overhead"}
    assert spent(replace(alone, pipeline=2, precision=Precision.FP32)) == {
        "compute", "bubble", "pipeline_comm", "pipeline_overhead"}
    # context ranks also reduce gradients, as DeepSpeed's data parallelism (inside a node, in
    # bf16 at ZeRO-0: hidden behind the backward; across nodes in fp32 at ZeRO-1: exposed)
    assert spent(replace(alone, context=2)) == {"compute", "context_comm"}
    assert spent(replace(alone, context=2, data=8, zero_stage=1, global_batch=512,
                         precision=Precision.FP32)) == {"compute", "context_comm", "data_comm"}
    assert spent(replace(alone, data=16)) == {"compute", "data_comm"}
    assert spent(replace(alone, zero_stage=1, offload_optimizer="cpu")) == {"compute", "offload"}
    assert spent(replace(alone, optimizer="muon")) == {"compute", "optimizer"}  # Newton-Schulz
    every = replace(alone, tensor=2, pipeline=2, context=2, data=4, zero_stage=1,
                    offload_optimizer="cpu", sequence_parallel=True, recompute=Recompute.FULL,
                    optimizer="muon")
    assert spent(every, LLAMA_7B) == set(parts)


def test_the_70b_recipes_plan_is_the_one_the_docs_print():
    """The `pretrain plan --config configs/llama_70b.yaml --world-size 128` output the planning docs
    print: each of its lines (one "..." stands for the lines left out) is a line the command
    prints."""
    lines = (REPO / PLANNING_DOC).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("layout  tp 4 x pp 8 x dp 4"))
    block = lines[start:lines.index("```", start)]
    assert len(block) > 10 and block[-1].startswith("throughput 128,733 tokens/s")
    out = _plan_cli("--config", "configs/llama_70b.yaml", "--world-size", "128")
    assert out.returncode == 0, out.stderr
    printed = out.stdout.splitlines()
    assert [line for line in block if line.strip() != "..." and line not in printed] == []


# ---- search and the command line -------------------------------------------------------------

def test_search_finds_fitting_layouts_fastest_first():
    model = ModelConfig(**MODEL_PRESETS["13b"])
    plans = search(model, make_cluster("a100-80gb", nodes=2), global_batch=64)
    assert plans and all(p.fits for p in plans)
    assert [p.tokens_per_s for p in plans] == sorted((p.tokens_per_s for p in plans), reverse=True)
    assert all(p.layout.world_size == 16 for p in plans)
    assert all(p.layout.pipeline == 1 or p.layout.zero_stage <= 1 for p in plans)
    # a 13B model's 16-byte states do not fit one 80 GB GPU without sharding
    assert all(p.layout.zero_stage > 0 or p.layout.tensor * p.layout.pipeline > 1 for p in plans)


def test_search_refuses_impossible_models():
    huge = ModelConfig(**MODEL_PRESETS["70b"])
    tiny_cluster = make_cluster("a100-80gb", nodes=1, gpus_per_node=1, gpu_memory_gb=16)
    assert search(huge, tiny_cluster, global_batch=8) == []


def _plan_cli(*args: str) -> subprocess.CompletedProcess:
    return run_cli(["plan", *args], cwd=REPO)


def test_search_cli_json_and_refusal():
    out = _plan_cli("--set", "model.preset=7b", "--set", "train.global_batch_size=64",
                    "--cluster", "a100-80gb", "--nodes", "1", "--search", "--json", "--top", "3")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["count"] >= 3 and len(result["plans"]) == 3
    best = result["plans"][0]
    assert best["fits"] and best["memory_gb"]["total"] <= best["memory_limit_gb"]
    text = _plan_cli("--set", "model.preset=7b", "--set", "train.global_batch_size=64",
                     "--cluster", "a100-80gb", "--nodes", "1", "--search", "--top", "2")
    assert text.returncode == 0 and "layouts of 8 GPUs" in text.stdout
    bad = _plan_cli("--set", "model.preset=70b", "--set", "train.global_batch_size=8",
                    "--gpus-per-node", "1", "--gpu-memory-gb", "16", "--search")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "error: no layout of 1 GPUs fits" in bad.stderr


def test_search_rows_carry_the_arguments_that_select_them_and_rank_the_config():
    """Each row's arguments, given back to `plan`, plan exactly that row; the config's own layout
    is ranked among the rows (the shipped 70B recipe on 16 H100 nodes)."""
    base = ["--config", "configs/llama_70b.yaml", "--nodes", "16"]
    out = _plan_cli(*base, "--search", "--json", "--top", "2")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    current = result["current"]
    assert current["ok"] and current["fits"] and current["layout"].startswith("tp4 pp8 dp4")
    assert 1 <= current["rank"] <= result["count"]
    assert sum(1 for p in result["plans"] if p["tokens_per_s"] > current["tokens_per_s"]) == \
        min(2, current["rank"] - 1)
    for row in result["plans"]:
        assert "--deepspeed-config ds_configs/" in row["arguments"]
        again = _plan_cli(*base, "--world-size", "128", "--json", *row["arguments"].split())
        assert again.returncode == 0, again.stderr
        planned = json.loads(again.stdout)
        assert planned["layout"] == row["layout"]
        assert planned["tokens_per_s"] == pytest.approx(row["tokens_per_s"], rel=1e-12)
    text = _plan_cli(*base, "--search", "--top", "1")
    assert f"this config: {current['layout']}" in text.stdout
    assert f"#{current['rank']} of {result['count']}" in text.stdout
    # the rank the planning docs quote for this recipe on 16 H100 nodes (with the default memory
    # margin)
    assert (current["rank"], result["count"]) == (1, 190)
    assert "(`this config: ... #1 of 190` for the 70B recipe on 16 H100 nodes)" in \
        _doc(PLANNING_DOC)


def test_stage_cuts_are_deepspeeds_for_any_weights():
    """partition_uniform / partition_balanced (the planner's, without NumPy) cut exactly as
    DeepSpeed's PipelineModule does, ties included: random spec weights and stage counts."""
    import random

    from deepspeed.runtime import utils as ds_utils

    from pretrain.arithmetic import partition_balanced, partition_uniform

    rng = random.Random(0)
    for _ in range(300):
        n, parts = rng.randint(1, 24), rng.randint(1, 9)
        weights = tuple(rng.choice([0, 1, 1, 2, 5, rng.randint(0, 10**6)]) for _ in range(n))
        assert partition_uniform(n, parts) == ds_utils.partition_uniform(n, parts), (n, parts)
        assert list(partition_balanced(weights, parts)) == \
            [int(x) for x in ds_utils.partition_balanced(list(weights), parts)], (weights, parts)


@pytest.mark.parametrize("method, layers", [
    # 7 specs (embedding, 4 decoder layers, final norm, head) on 3 stages
    ("uniform", [2, 2, 0]),  # 3, 2, 2 specs
    ("parameters", [1, 2, 1]),  # the embedding and the head weigh a layer or more each
    ("type:DecoderLayerPipe", [2, 1, 1]),
])
def test_pipeline_partition_setting_cuts_the_stages_the_run_builds(method, layers):
    """parallel.pipeline_partition: the meta-device build of every stage (DeepSpeed's own cut)
    equals the planner's, and the decoder layers per stage follow the method."""
    run = _plan_cli("--config", "configs/tiny.yaml", "--world-size", "3", "--build", "--json",
                "--set", "parallel.pipeline=3", "--set", "model.num_layers=4",
                "--set", f"parallel.pipeline_partition={method}")
    assert run.returncode == 0, run.stderr[-2000:]
    plan = json.loads(run.stdout)
    assert all(b["built"] == b["planned"] for b in plan["builds"])
    assert [s["layers"] for s in plan["stages"]] == layers
