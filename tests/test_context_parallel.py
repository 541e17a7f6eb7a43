"""Context parallelism (DeepSpeed-Ulysses, `parallel.context`) against one process.

Fast: the rank grid, the refusals, the loader's chunks, the all-to-all's backward against
autograd of the unsplit computation, and the model's loss and gradients on 2 gloo ranks. Slow:
the real `pretrain train` at context 2 (ZeRO 0-3, offload, data parallel, recomputation, a
pipeline), tp 2 x context 2 (with sequence parallelism and a pipeline, and without either)
against the single-process run: fp32 losses and gradient norms, 5 steps of 256 tokens with
grouped-query attention.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from pretrain.config import load_config
from pretrain.errors import ConfigError
from pretrain.resolve.layout import Layout, check_layout
from pretrain.resolve.run import layout_on
from pretrain.testing.numerics import assert_ranks_match_one_process
from pretrain.testing.ranks import run_on_ranks
from pretrain.resolve.topology import Topology


def tiny_model(**fields):
    overrides = ["model.preset=tiny"] + [f"model.{k}={v}" for k, v in fields.items()]
    return load_config(None, overrides).model


# ---- the rank grid ------------------------------------------------------------------------------

def test_topology_context_rank_table():
    topo = Topology(tensor=2, pipeline=2, world_size=16, context=2)
    assert (topo.data, topo.replicas) == (2, 4)
    # rank = ((pipeline * dp + data) * cp + context) * tp + tensor
    assert topo.tensor_groups()[:4] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.context_groups() == [[0, 2], [1, 3], [4, 6], [5, 7],
                                     [8, 10], [9, 11], [12, 14], [13, 15]]
    assert topo.data_groups() == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert topo.pipeline_groups()[:3] == [[0, 8], [1, 9], [2, 10]]
    assert topo.model_groups() == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
    c = topo.coords(11)
    assert (c.tensor, c.context, c.data, c.pipeline) == (1, 1, 0, 1)
    assert topo.replica_rank(11) == 1 and topo.replica_rank(12) == 2
    for rank in range(16):
        c = topo.coords(rank)
        assert topo.rank_of(tensor=c.tensor, data=c.data, pipeline=c.pipeline,
                            context=c.context) == rank
    # DeepSpeed's grid of the same ranks: its data axis is our data x context
    theirs = topo.deepspeed_topology()
    assert topo.data_groups() == theirs.get_axis_comm_lists("data")
    assert theirs.get_axis_comm_lists("model")[:2] == [[0, 1], [2, 3]]
    assert theirs.get_axis_comm_lists("pipe")[:2] == [[0, 8], [1, 9]]
    table = topo.describe()
    assert "context=2" in table and "dp 1 cp 1   [6, 7]     [14, 15]" in table


def test_topology_context_one_is_unchanged():
    with_cp = Topology(tensor=2, pipeline=2, world_size=16, context=1)
    assert with_cp == Topology(tensor=2, pipeline=2, world_size=16)
    assert with_cp.data == with_cp.replicas == 4
    assert repr(with_cp.coords(13)) == "RankCoords(tensor=1, data=2, pipeline=1)"
    assert "context" not in with_cp.describe()


def test_topology_refuses_a_world_not_divisible_by_context():
    with pytest.raises(ConfigError, match="parallel.context"):
        Topology(tensor=2, pipeline=1, world_size=6, context=2)


# ---- refusals before launch ---------------------------------------------------------------------

def _check(model, **layout):
    check_layout(model, Layout(**{"global_batch": 4, "micro_batch": 1, **layout}))


def test_refuses_heads_not_divisible_by_tensor_times_context():
    model = tiny_model()  # 4 heads, 2 kv heads
    _check(model, context=2)  # 2 kv heads over 2 context ranks: one each
    with pytest.raises(ConfigError, match=r"num_kv_heads=2 is not divisible by parallel.tensor "
                                          r"x parallel.context = 2 x 2 = 4"):
        _check(model, tensor=2, context=2)
    with pytest.raises(ConfigError, match="num_heads=4 is not divisible"):
        _check(tiny_model(num_heads=4, num_kv_heads=4), context=8)
    _check(tiny_model(num_heads=8, num_kv_heads=4), tensor=2, context=2)


def test_refuses_sequence_not_divisible():
    with pytest.raises(ConfigError,
                       match=r"seq_length=66: must be divisible by parallel.context=4"):
        _check(tiny_model(seq_length=66, num_heads=8, num_kv_heads=4), context=4)
    model = tiny_model(seq_length=70, num_heads=8, num_kv_heads=4)
    _check(model, tensor=2, context=2)  # 70 = 2 chunks of 35 without sequence parallelism
    with pytest.raises(ConfigError, match=r"seq_length=70: must be divisible by parallel.context "
                                          r"x parallel.tensor .* = 4"):
        _check(model, tensor=2, context=2, sequence_parallel=True)


def test_refuses_what_is_not_implemented():
    with pytest.raises(ConfigError, match="model.compile=true with parallel.context=2: not "
                                          "supported yet"):
        _check(tiny_model(compile=True), context=2)
    _check(tiny_model(compile=True), context=1)


def test_batch_arithmetic_counts_data_replicas_not_context_ranks():
    from pretrain.resolve.run import resolve_ds_config

    cfg = load_config(None, ["model.preset=tiny", "parallel.context=2",
                             "train.micro_batch_size=2", "train.global_batch_size=8",
                             "train.precision=fp32"])
    layout = layout_on(cfg, world_size=4)
    assert (layout.data, layout.context, layout.grad_accum) == (2, 2, 2)
    assert "cp2" in layout.describe()
    ds = resolve_ds_config(cfg, world_size=4, source={"zero_optimization": {"stage": 1}})
    # DeepSpeed's data parallelism is data x context: each context rank's chunk counts once
    assert ds["train_batch_size"] == 16 and ds["gradient_accumulation_steps"] == 2
    with pytest.raises(ConfigError, match="parallel.context"):
        layout_on(cfg, world_size=5)


def test_loader_chunks_share_samples_and_shift_labels_before_splitting():
    from pretrain.data.loader import micro_batches

    class Samples:
        def __len__(self):
            return 64

        def tokens(self, index):
            return np.arange(17, dtype=np.int64) + 1000 * index

    def first(**kw):
        it = micro_batches(Samples(), micro_batch_size=2, dp_rank=0, dp_size=1, **kw)
        return [next(it) for _ in range(3)]

    whole = first()
    chunks = [first(context_rank=c, context_size=4) for c in range(4)]
    for i, batch in enumerate(whole):
        for name in ("input_ids", "labels"):
            joined = torch.cat([chunks[c][i][name] for c in range(4)], dim=1)
            assert torch.equal(joined, batch[name]), (i, name)
        assert chunks[0][i]["input_ids"].shape == (2, 4)
        # the last label of chunk 0 is the first input of chunk 1
        assert torch.equal(chunks[0][i]["labels"][:, -1], chunks[1][i]["input_ids"][:, 0])
    in_worker = first(context_rank=3, context_size=4, workers=1)  # sliced in a worker process
    assert all(torch.equal(a[k], b[k]) for a, b in zip(in_worker, chunks[3]) for k in a)


# ---- the all-to-all and the model on gloo ranks -------------------------------------------------

def _all_to_all_backward(rank, world_size):
    from pretrain.data.loader import context_chunk
    from pretrain.model.context_parallel import heads_to_sequence, sequence_to_heads

    group = dist.new_group(list(range(world_size)))
    g = torch.Generator().manual_seed(3)
    B, T, H, hd = 2, 8, 4, 3
    full = torch.randn(B, T, H, hd, generator=g, dtype=torch.float64)
    weight = torch.randn(B, T, H, hd, generator=g, dtype=torch.float64)
    heads = H // world_size
    chunk = context_chunk(T, rank=rank, size=world_size)
    # reference: the unsplit computation y = (x * w) ** 2 with its autograd gradient
    ref_x = full.clone().requires_grad_(True)
    ((ref_x * weight) ** 2).sum().backward()

    x = full[:, chunk].clone().requires_grad_(True)  # (B, T/N, H, hd)
    swapped = sequence_to_heads(x, group)  # (B, T, H/N, hd): every position of my heads
    mine = slice(rank * heads, (rank + 1) * heads)
    assert torch.equal(swapped, full[:, :, mine])
    back = heads_to_sequence(swapped * weight[:, :, mine], group)  # (B, T/N, H, hd)
    assert torch.equal(back, (full * weight)[:, chunk])
    (back ** 2).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad[:, chunk], rtol=1e-12, atol=0)
    return True


def test_all_to_all_backward_matches_autograd_of_the_unsplit_computation(tmp_path):
    assert all(run_on_ranks(_all_to_all_backward, world_size=2, tmp_path=tmp_path))


def _model_run(rank, world_size, tensor, fields, sequence_parallel):
    from pretrain.model import build_model
    from pretrain.testing.numerics import replica_mean_loss_and_grads

    torch.manual_seed(0)
    context = world_size // tensor
    topo = Topology(tensor=tensor, pipeline=1, world_size=world_size, rank=rank, context=context)
    groups = topo.create_groups() if world_size > 1 else None
    cfg = tiny_model(**fields)
    model = build_model(cfg, seed=7, tp_group=groups.tensor if tensor > 1 else None,
                        sequence_parallel=sequence_parallel,
                        cp_group=groups.context if groups else None).double()
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1),
                           generator=torch.Generator().manual_seed(11))
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    # ignored labels: the chunks' label counts differ (context 2: 29 and 31 of 32 kept)
    labels[0, 5] = labels[0, 9] = labels[1, -3] = -100
    c, T = topo.my_coords.context, cfg.seq_length // context
    loss = model(inputs[:, c * T:(c + 1) * T], labels[:, c * T:(c + 1) * T])
    loss.backward()
    return replica_mean_loss_and_grads(model, loss, topology=topo, groups=groups)


def _assert_model_matches(tmp_path, world_size, tensor, fields, sequence_parallel=False):
    single = run_on_ranks(_model_run, world_size=1, tmp_path=tmp_path,
                          args=(1, fields, False))[0]
    results = run_on_ranks(_model_run, world_size=world_size, tmp_path=tmp_path,
                           args=(tensor, fields, sequence_parallel))
    assert_ranks_match_one_process(single, results)


@pytest.mark.parametrize("family", [dict(), dict(family="qwen3", head_dim=24)],
                         ids=["llama", "qwen3"])
def test_model_context2_loss_and_grads_equal_one_process(tmp_path, family):
    """fp64, 2 context ranks, grouped-query attention (4 heads, 2 kv heads), ignored labels;
    per family (Qwen3: its q/k norms on each rank's chunk, before the all-to-all)."""
    _assert_model_matches(tmp_path, 2, 1, dict(seq_length=32, **family))


@pytest.mark.slow  # 2 spawned ranks; the quick tier has llama's and qwen3's
def test_deepseek_v3_context2_loss_and_grads_equal_one_process(tmp_path):
    """The same for DeepSeek-V3's latent attention: its expanded keys and values, of other
    widths (q.k 12 + 8, values 16), exchanged for the whole sequence of half the heads."""
    _assert_model_matches(tmp_path, 2, 1, dict(
        seq_length=32, family="deepseek_v3", num_kv_heads=4, q_lora_rank=40, kv_lora_rank=24,
        qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=16))


@pytest.mark.slow  # 4 spawned ranks
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_model_tp2_context2_loss_and_grads_equal_one_process(tmp_path, sequence_parallel):
    _assert_model_matches(tmp_path, 4, 2, dict(seq_length=32, num_heads=8, num_kv_heads=4),
                          sequence_parallel)


# ---- the real `pretrain train` ------------------------------------------------------------------

SEQ = ["model.seq_length=256", "train.steps=5", "train.eval_interval=5", "train.eval_batches=2"]


@pytest.fixture(scope="module")
def reference_256(tiny_data, tmp_path_factory):
    from pretrain.testing.runs import train

    return train(tmp_path_factory.mktemp("cp_ref"), tiny_data, name="single",
                 overrides=[*SEQ, "checkpoint.save_final=true"])


@pytest.fixture(scope="module")
def reference_256_8_heads(tiny_data, tmp_path_factory):
    from pretrain.testing.runs import train

    return train(tmp_path_factory.mktemp("cp_ref8"), tiny_data, name="single",
                 overrides=[*SEQ, "model.num_heads=8", "model.num_kv_heads=4",
                            "checkpoint.save_final=true"])


def _assert_trains_like(run, reference, tolerance=1e-5):
    from pretrain.testing.runs import rel_diff

    norms = [[r["grad_norm"] for r in x.records if r["kind"] == "train"] for x in (run, reference)]
    assert len(run.losses) == 5
    assert run.records[0]["context"] == 2 and reference.records[0]["context"] == 1
    assert rel_diff(run.losses, reference.losses) < tolerance, (run.losses, reference.losses)
    assert rel_diff(*norms) < tolerance, norms
    evals = [[r["loss"] for r in x.records if r["kind"] == "eval"] for x in (run, reference)]
    assert len(evals[0]) == 1 and rel_diff(*evals) < tolerance, evals


@pytest.mark.slow
def test_train_context2_matches_one_process(tiny_data, tmp_path, reference_256):
    """ZeRO-1 (ZeRO-0, 2 and 3 run in the combined layouts below)."""
    from pretrain.testing.runs import train

    run = train(tmp_path, tiny_data, nprocs=2, overrides=[
        *SEQ, "parallel.context=2", "deepspeed=ds_configs/zero1.json",
        "checkpoint.save_final=true"])
    _assert_trains_like(run, reference_256)
    _assert_same_final(run, reference_256)


def _assert_same_final(run, reference) -> None:
    """final/ (written by rank 0 from the first replica's shards) holds the reference's
    tensors: 5 Adam steps of lr 1e-3 in another reduction order move no element by 2e-5."""
    from safetensors.torch import load_file

    ours = load_file(str(run.run_dir / "final" / "model.safetensors"))
    ref = load_file(str(reference.run_dir / "final" / "model.safetensors"))
    assert sorted(ours) == sorted(ref)
    for name, tensor in ref.items():
        assert torch.allclose(ours[name], tensor, rtol=1e-4, atol=2e-5), name


@pytest.mark.slow
@pytest.mark.parametrize("sp, pp", [(False, 1), (True, 2)])
def test_train_tp2_context2_matches_one_process(tiny_data, tmp_path, reference_256_8_heads, sp,
                                                pp):
    """tp 2 x context 2 (4 ranks); with sequence parallelism and a pipeline of 2 stages, 8 ranks
    (each of the two is also tested without the other: sequence parallelism at tp 2 in
    test_model_tp2_context2_loss_and_grads_equal_one_process, the pipeline below)."""
    from pretrain.testing.runs import train

    run = train(tmp_path, tiny_data, nprocs=4 * pp, overrides=[
        *SEQ, "model.num_heads=8", "model.num_kv_heads=4", "parallel.tensor=2",
        "parallel.context=2", f"parallel.pipeline={pp}",
        f"parallel.sequence_parallel={str(sp).lower()}", "checkpoint.save_final=true"])
    _assert_trains_like(run, reference_256_8_heads)
    _assert_same_final(run, reference_256_8_heads)


# Each ZeRO stage and offload target, data parallelism, recomputation and the pipeline at context
# 2: settings that do not interact are combined in one run (each run is the same assertion
# against one process, so a broken setting fails the run it is in).
@pytest.mark.slow
@pytest.mark.parametrize("name, nprocs, overrides", [
    ("zero0_recompute", 2, ["deepspeed=ds_configs/zero0.json",
                            "model.activation_checkpointing=full"]),
    ("zero3", 2, ["deepspeed=ds_configs/zero3.json"]),
    ("zero2_offload", 2, ["deepspeed=ds_configs/zero2_offload_cpu.json"]),
    ("zero3_offload", 2, ["deepspeed=ds_configs/zero3_offload_cpu.json"]),
    ("dp2_zero2", 4, ["train.micro_batch_size=1", "deepspeed=ds_configs/zero2.json"]),
    ("pp2_recompute", 4, ["parallel.pipeline=2", "model.activation_checkpointing=full"]),
])
def test_train_context2_phase2_layouts_match_one_process(tiny_data, tmp_path, reference_256,
                                                         name, nprocs, overrides):
    from pretrain.testing.runs import train

    run = train(tmp_path, tiny_data, nprocs=nprocs, name=name,
                overrides=[*SEQ, "parallel.context=2", *overrides])
    _assert_trains_like(run, reference_256)


# ---- checkpoints --------------------------------------------------------------------------------

def _resumed(tmp_path, tiny_data, step_dir, *, name, nprocs, overrides):
    from pretrain.testing.runs import run_pretrain, train_args

    run_dir = tmp_path / name
    args = train_args(run_dir, tiny_data, overrides=overrides) + ["--resume-from", str(step_dir)]
    return run_pretrain(args, run_dir=run_dir, nprocs=nprocs,
                        launcher="single" if nprocs == 1 else "torchrun").check()


@pytest.mark.slow
def test_context2_checkpoint_resumes_bitwise_and_onto_context1(tiny_data, tmp_path):
    from pretrain.testing.runs import rel_diff, train

    common = ["model.seq_length=256", "train.steps=6"]
    source = train(tmp_path, tiny_data, nprocs=2, name="source", overrides=[
        *common, "parallel.context=2", "checkpoint.save_interval=3"])
    step3 = source.run_dir / "checkpoints" / "step3"
    meta = (step3 / "meta.json").read_text()
    assert '"context": 2' in meta
    after = source.losses[3:]
    same = _resumed(tmp_path, tiny_data, step3, name="same", nprocs=2,
                    overrides=[*common, "parallel.context=2"])
    assert same.losses == after  # its own layout: DeepSpeed's files, bitwise
    onto_one = _resumed(tmp_path, tiny_data, step3, name="one", nprocs=1, overrides=common)
    assert onto_one.records[0]["context"] == 1
    assert "resharded tp1 pp1 cp2 dp1 ZeRO-1 -> tp1 pp1 dp1 ZeRO-1" in onto_one.stdout + \
        onto_one.stderr
    assert len(onto_one.losses) == 3 and rel_diff(onto_one.losses, after) < 1e-5
    # resharded onto ZeRO-2 partitions over the data x context replicas
    onto_zero2 = _resumed(tmp_path, tiny_data, step3, name="zero2", nprocs=2, overrides=[
        *common, "parallel.context=2", "deepspeed=ds_configs/zero2.json"])
    assert "resharded tp1 pp1 cp2 dp1 ZeRO-1 -> tp1 pp1 cp2 dp1 ZeRO-2" in onto_zero2.stdout + \
        onto_zero2.stderr
    assert len(onto_zero2.losses) == 3 and rel_diff(onto_zero2.losses, after) < 1e-5


def test_resume_allows_long_context_continued_pretraining(tiny_data):
    """`model.seq_length` and `model.rope_theta` may change at resume; the width may not."""
    from pretrain.checkpoint.engine import resume_mismatch
    from pretrain.data import Tokenizer

    base = ["model.preset=tiny", f"data.tokenizer={tiny_data['tokenizer']}"]
    saved = load_config(None, base)
    meta = {"step": 1, "consumed_samples": 4, "global_batch": 4, "config": saved.to_dict(),
            "tokenizer": {"path": "t.model",
                          "sha256": Tokenizer.load(tiny_data["tokenizer"]).sha256},
            "layout": {"tensor": 1, "pipeline": 1, "data": 1, "world_size": 1, "zero_stage": 1}}
    longer = load_config(None, [*base, "model.seq_length=1024", "model.rope_theta=500000",
                                 "parallel.context=2"])
    assert resume_mismatch(meta, longer) is None
    wider = load_config(None, [*base, "model.seq_length=1024", "model.hidden_size=128"])
    assert "model.hidden_size=64 there, 128 here" in resume_mismatch(meta, wider)


def test_layout_change_counts_context():
    from pretrain.resolve.run import layout_change

    one = {"tensor": 1, "pipeline": 1, "data": 2, "zero_stage": 1}  # saved before context
    assert layout_change(one, {**one, "context": 1}) is None
    two = {"tensor": 1, "pipeline": 1, "data": 1, "context": 2, "zero_stage": 1}
    assert layout_change(two, {**two, "context": 1}) == \
        "tp1 pp1 cp2 dp1 ZeRO-1 -> tp1 pp1 dp1 ZeRO-1"
    assert layout_change(two, dict(two)) is None


# ---- the planner --------------------------------------------------------------------------------

def test_planner_halves_activations_and_counts_the_all_to_all():
    from pretrain.config import Precision
    from pretrain.plan.clusters import make_cluster
    from pretrain.plan.search import estimate, search

    model = load_config(None, ["model.preset=7b", "model.seq_length=32768"]).model
    cluster = make_cluster("h100-80gb", nodes=2)
    plans = {cp: estimate(model, Layout(tensor=2, context=cp, data=8 // cp, global_batch=16,
                                        zero_stage=1, sequence_parallel=True), cluster)
             for cp in (1, 2, 4)}
    act = {cp: p.memory.activations for cp, p in plans.items()}
    assert act[2] == pytest.approx(act[1] / 2) and act[4] == pytest.approx(act[1] / 4)
    assert plans[1].time.context_comm == 0 < plans[2].time.context_comm < plans[4].time.context_comm
    # ZeRO-1 shards the optimizer over data x context ranks: the same 8 replicas each time
    assert plans[1].memory.optimizer == pytest.approx(plans[4].memory.optimizer)
    found = search(model, cluster, global_batch=16, precision=Precision.BF16,
                   micro_batches=(1,), allow_offload=False)
    assert {p.layout.context for p in found} > {1}
    assert all(p.layout.tensor * p.layout.context <= cluster.gpus_per_node for p in found)
    short = load_config(None, ["model.preset=7b"]).model  # 4096 tokens: context 1 only
    assert {p.layout.context for p in search(short, cluster, global_batch=16,
                                             micro_batches=(1,), allow_offload=False)} == {1}

