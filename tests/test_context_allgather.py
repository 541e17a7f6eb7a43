"""All-gather context parallelism (`parallel.context_kind: allgather`) against one process.

Quick: the head-tail chunking (every rank the same causal work, the chunks reassembling the
sequence exactly, the loader's chunks and labels), the refusals, the planner's all-gather
terms. Slow: the model's loss and gradients on gloo ranks in fp64 (context 4 on a model with 2
kv heads, with and without a document mask; tensor 2 x context 2 with sequence parallelism),
and the real `pretrain train`: fp32 losses and gradient norms over 10 steps equal to one
process within 1e-5 at context 4 (2 kv heads: Ulysses refuses it), with document masks,
tensor 2 x context 2 and pipeline 2 x context 2.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pretrain.config import load_config
from pretrain.data.loader import context_chunks, context_positions, micro_batches
from pretrain.errors import ConfigError
from pretrain.resolve.layout import Layout, check_layout
from tests.test_document_mask import short_documents  # noqa: F401  (the fixture)


def tiny_model(**fields):
    overrides = ["model.preset=tiny"] + [f"model.{k}={v}" for k, v in fields.items()]
    return load_config(None, overrides).model


# ---- the head-tail chunks -----------------------------------------------------------------------

@pytest.mark.parametrize("length, size", [(16, 2), (64, 4), (48, 3), (256, 8)])
def test_head_tail_chunks_give_equal_causal_work_and_reassemble_the_sequence(length, size):
    held = [context_positions(length, rank=r, size=size, head_tail=True) for r in range(size)]
    # every position once: the ranks' chunks, in chunk order, are the sequence
    assert np.array_equal(np.sort(np.concatenate(held)), np.arange(length))
    chunks = sorted((s for r in range(size)
                     for s in context_chunks(length, rank=r, size=size, head_tail=True)),
                    key=lambda s: s.start)
    assert [s.start for s in chunks] == list(range(0, length, length // (2 * size)))
    # a query at position p attends p + 1 keys: the same number of pairs on every rank
    work = [int((positions + 1).sum()) for positions in held]
    assert len(set(work)) == 1, work
    contiguous = [int((context_positions(length, rank=r, size=size) + 1).sum())
                  for r in range(size)]
    assert contiguous[-1] > contiguous[0]  # what the balancing is for
    # rank r: chunks r and 2 x size - 1 - r, in that order
    piece = length // (2 * size)
    assert held[0][:piece].tolist() == list(range(piece))
    assert held[0][piece:].tolist() == list(range(length - piece, length))


class _Samples:
    def __len__(self):
        return 64

    def tokens(self, index):
        return np.arange(17, dtype=np.int64) + 1000 * index


def _first(**kw):
    it = micro_batches(_Samples(), micro_batch_size=2, dp_rank=0, dp_size=1, **kw)
    return [next(it) for _ in range(3)]


def test_loader_gives_each_rank_its_head_and_tail_with_labels_shifted_before_the_split():
    whole = _first(document_eod=1005)
    for rank in range(4):
        mine = _first(context_rank=rank, context_size=4, head_tail=True, document_eod=1005)
        positions = torch.from_numpy(context_positions(16, rank=rank, size=4, head_tail=True))
        for batch, ours in zip(whole, mine):
            assert ours["input_ids"].shape == (2, 4)
            assert torch.equal(ours["input_ids"], batch["input_ids"][:, positions])
            assert torch.equal(ours["labels"], batch["labels"][:, positions])
            # every rank gets the whole sample's document ids
            assert torch.equal(ours["document_ids"], batch["document_ids"])
    in_worker = _first(context_rank=1, context_size=4, head_tail=True, workers=1)
    in_process = _first(context_rank=1, context_size=4, head_tail=True)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(in_worker, in_process) for k in a)


def test_gathered_chunks_go_back_in_sequence_order():
    from pretrain.model.context_parallel import _in_sequence_order

    length, size = 24, 3
    held = [torch.from_numpy(context_positions(length, rank=r, size=size, head_tail=True))
            for r in range(size)]
    gathered = torch.stack([torch.cat(held)] * 2)[:, None]  # (2, 1, T): rank-major, as gathered
    assert torch.equal(_in_sequence_order(gathered, size, 2)[0, 0], torch.arange(length))


# ---- refusals before launch ---------------------------------------------------------------------

def _check(model, **layout):
    check_layout(model, Layout(**{"global_batch": 4, "micro_batch": 1, **layout}))


def test_allgather_needs_no_head_divisibility_but_two_chunks_per_rank():
    model = tiny_model()  # 4 heads, 2 kv heads
    with pytest.raises(ConfigError, match="num_kv_heads=2 is not divisible"):
        _check(model, context=4)  # Ulysses
    _check(model, context=4, context_kind="allgather")
    _check(model, tensor=2, context=2, context_kind="allgather", sequence_parallel=True)
    with pytest.raises(ConfigError, match=r"seq_length=36: must be divisible by 2 x "
                                          r"parallel.context = 8 with parallel.context_kind"):
        _check(tiny_model(seq_length=36), context=4, context_kind="allgather")
    with pytest.raises(ConfigError, match="model.compile=true with parallel.context=2"):
        _check(tiny_model(compile=True), context=2, context_kind="allgather")
    with pytest.raises(ConfigError, match="parallel.context_kind"):
        load_config(None, ["parallel.context_kind=ring"])


# ---- the planner --------------------------------------------------------------------------------

def test_planner_counts_the_gathered_keys_and_values():
    from pretrain.plan.clusters import make_cluster
    from pretrain.plan.context import allgather_context

    model = load_config(None, ["model.preset=70b", "model.seq_length=131072"]).model
    cluster = make_cluster("h100-80gb", nodes=2)
    costs = {cp: allgather_context(model, Layout(tensor=8, context=cp, data=16 // cp,
                                                 global_batch=16, context_kind="allgather"),
                                   cluster) for cp in (2, 4)}
    bf16 = 2
    # K and V of the whole sequence (B=1, kv heads / tp per rank), (cp - 1)/cp of it received
    kv = 2 * model.seq_length * (model.num_kv_heads // 8) * model.head_dim * bf16
    assert costs[2].bytes_per_layer == pytest.approx(kv / 2)
    assert costs[4].bytes_per_layer == pytest.approx(kv * 3 / 4)
    assert costs[2].gathered_bytes_per_layer == pytest.approx(kv)
    assert 0 < costs[2].seconds < costs[4].seconds
    none = allgather_context(model, Layout(tensor=8, context=1, data=16, global_batch=16,
                                           context_kind="allgather"), cluster)
    assert none.bytes_per_layer == none.seconds == none.gathered_bytes_per_layer == 0


def test_planner_adds_the_gathered_keys_and_values_to_step_time_and_activations():
    from pretrain.plan.clusters import make_cluster
    from pretrain.plan.context import allgather_context
    from pretrain.plan.search import estimate

    model = load_config(None, ["model.preset=70b", "model.seq_length=32768"]).model
    cluster = make_cluster("h100-80gb", nodes=2)
    plans = {kind: estimate(model, Layout(tensor=2, context=4, data=2, global_batch=16,
                                          zero_stage=1, sequence_parallel=True,
                                          context_kind=kind), cluster)
             for kind in ("ulysses", "allgather")}
    layout = plans["allgather"].layout
    cost = allgather_context(model, layout, cluster)
    # one micro-batch in flight, no recomputation: every layer keeps the gathered K and V
    extra = plans["allgather"].memory.activations - plans["ulysses"].memory.activations
    assert extra == pytest.approx(model.num_layers * cost.gathered_bytes_per_layer)
    micro_batches = layout.grad_accum
    assert plans["allgather"].time.context_comm == pytest.approx(micro_batches * cost.seconds)
    assert plans["ulysses"].time.context_comm != plans["allgather"].time.context_comm


# ---- the model on gloo ranks --------------------------------------------------------------------

def _model_run(rank, world_size, tensor, fields, masked):
    from pretrain.data.samples import document_ids
    from pretrain.model import build_model
    from pretrain.resolve.topology import Topology
    from pretrain.testing.numerics import replica_mean_loss_and_grads

    torch.manual_seed(0)
    context = world_size // tensor
    topo = Topology(tensor=tensor, pipeline=1, world_size=world_size, rank=rank, context=context)
    groups = topo.create_groups() if world_size > 1 else None
    cfg = tiny_model(**fields)
    model = build_model(cfg, seed=7, tp_group=groups.tensor if tensor > 1 else None,
                        sequence_parallel=tensor > 1,
                        cp_group=groups.context if groups else None,
                        context_kind="allgather").double()
    tokens = torch.randint(3, cfg.vocab_size, (2, cfg.seq_length + 1),
                           generator=torch.Generator().manual_seed(11))
    ids = None
    if masked:  # documents ending at 9, 20 and 41 (row 0) and at 30 (row 1)
        tokens[0, [9, 20, 41]] = tokens[1, 30] = 2
        ids = torch.from_numpy(document_ids(tokens.numpy(), eod=2))
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[0, 5] = labels[0, 9] = labels[1, -3] = -100  # the chunks' label counts differ
    mine = torch.from_numpy(context_positions(cfg.seq_length, rank=topo.my_coords.context,
                                              size=context, head_tail=True))
    loss = model(inputs[:, mine], labels[:, mine], document_ids=ids)
    loss.backward()
    return replica_mean_loss_and_grads(model, loss, topology=topo, groups=groups)


def _assert_model_matches(tmp_path, world_size, tensor, fields, masked=False):
    from pretrain.testing.numerics import assert_ranks_match_one_process
    from pretrain.testing.ranks import run_on_ranks

    single = run_on_ranks(_model_run, world_size=1, tmp_path=tmp_path,
                          args=(1, fields, masked))[0]
    results = run_on_ranks(_model_run, world_size=world_size, tmp_path=tmp_path,
                           args=(tensor, fields, masked))
    assert_ranks_match_one_process(single, results)


@pytest.mark.slow  # 4 spawned ranks
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "documents"])
def test_model_allgather_context4_two_kv_heads_equals_one_process(tmp_path, masked):
    """fp64, 4 context ranks of a model with 2 kv heads (Ulysses cannot split it), grouped-query
    attention, ignored labels; with a document mask built from the whole sequence's ids."""
    _assert_model_matches(tmp_path, 4, 1, dict(seq_length=48), masked)


@pytest.mark.slow  # 4 spawned ranks
def test_model_allgather_tensor2_context2_sequence_parallel_equals_one_process(tmp_path):
    """tp 2 x context 2: 1 kv head per tensor rank (Ulysses needs 4), sequence parallelism."""
    _assert_model_matches(tmp_path, 4, 2, dict(seq_length=48), masked=True)


# ---- the real `pretrain train` ------------------------------------------------------------------

STEPS = 10
SEQ = ["model.seq_length=256", f"train.steps={STEPS}", f"train.eval_interval={STEPS}",
       "train.eval_batches=2"]
ALLGATHER = ["parallel.context_kind=allgather"]


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    from pretrain.testing.runs import train

    return train(tmp_path_factory.mktemp("ag_ref"), tiny_data, name="single", overrides=SEQ)


def _assert_trains_like(run, reference, context, tolerance=1e-5):
    from pretrain.testing.runs import rel_diff

    norms = [[r["grad_norm"] for r in x.records if r["kind"] == "train"] for x in (run, reference)]
    assert len(run.losses) == STEPS
    assert run.records[0]["context"] == context and reference.records[0]["context"] == 1
    assert run.records[0]["context_kind"] == "allgather"
    assert rel_diff(run.losses, reference.losses) < tolerance, (run.losses, reference.losses)
    assert rel_diff(*norms) < tolerance, norms
    evals = [[r["loss"] for r in x.records if r["kind"] == "eval"] for x in (run, reference)]
    assert len(evals[0]) == 1 and rel_diff(*evals) < tolerance, evals


# name: (ranks, context, overrides); the tiny model has 4 heads and 2 kv heads: Ulysses refuses
# context 4 and tensor 2 x context 2. Pipelines: DeepSpeed's 1F1B and fsdp2's schedule.
LAYOUTS = {
    "cp4": (4, 4, []),
    "tp2_cp2_sp": (4, 2, ["parallel.tensor=2", "parallel.context=2",
                          "parallel.sequence_parallel=true"]),
    "pp2_cp2": (4, 2, ["parallel.pipeline=2", "parallel.context=2"]),
    "fsdp2_pp2_cp2": (4, 2, ["train.engine=fsdp2", "deepspeed=ds_configs/zero2.json",
                             "parallel.pipeline=2", "parallel.context=2"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_train_allgather_matches_one_process(tiny_data, tmp_path, reference, layout):
    from pretrain.testing.runs import train

    ranks, context, overrides = LAYOUTS[layout]
    run = train(tmp_path, tiny_data, nprocs=ranks, name=layout,
                overrides=[*SEQ, *ALLGATHER, f"parallel.context={context}", *overrides])
    _assert_trains_like(run, reference, context)


MASKED = ["data.document_mask=true", "data.valid_fraction=0.05"]


@pytest.mark.slow
def test_train_allgather_context4_with_document_masks_matches_one_process(short_documents,
                                                                          tmp_path):
    """Document masks (documents of ~15-80 tokens, several to every 256-token sample): the
    mask from the whole sequence's ids, the positions inside each document."""
    from pretrain.testing.runs import train

    single = train(tmp_path, short_documents, name="single", overrides=[*SEQ, *MASKED])
    run = train(tmp_path, short_documents, nprocs=4, name="cp4",
                overrides=[*SEQ, *MASKED, *ALLGATHER, "parallel.context=4"])
    _assert_trains_like(run, single, 4)


@pytest.mark.slow
def test_train_allgather_expert2_context2_matches_one_process(tiny_data, tmp_path):
    """tensor 2 = expert 2 x context 2 on the tiny MoE (1 kv head a tensor rank): each expert
    rank routes half of its head-tail chunks; losses, gradient norms, the auxiliary losses and
    the tokens per expert are one process's."""
    from tests.test_moe import _assert_same_steps, _moe_train

    single = _moe_train(tmp_path, tiny_data, name="single")
    run = _moe_train(tmp_path, tiny_data, name="ep2_cp2", nprocs=4, overrides=[
        "parallel.tensor=2", "parallel.expert=2", "parallel.context=2", *ALLGATHER])
    assert "tp 2 x pp 1 x cp 2 (allgather) x dp 1" in run.stdout
    _assert_same_steps(run, single)


@pytest.mark.slow
def test_allgather_checkpoint_resumes_under_ulysses_and_onto_context1(tiny_data, tmp_path):
    """The kind is no part of a checkpoint's layout (the same shards of the same weights): an
    all-gather run's step-3 checkpoint continues its steps under Ulysses and on one process."""
    from pretrain.testing.runs import rel_diff
    from tests.test_context_parallel import _resumed

    common = ["model.seq_length=256", "train.steps=6"]
    source = _train_allgather(tmp_path, tiny_data, [*common, "checkpoint.save_interval=3"])
    step3 = source.run_dir / "checkpoints" / "step3"
    after = source.losses[3:]
    for name, nprocs, overrides in [("ulysses", 2, ["parallel.context=2"]), ("one", 1, [])]:
        resumed = _resumed(tmp_path, tiny_data, step3, name=name, nprocs=nprocs,
                           overrides=[*common, *overrides])
        assert len(resumed.losses) == 3 and rel_diff(resumed.losses, after) < 1e-5, name


def _train_allgather(tmp_path, data, overrides):
    from pretrain.testing.runs import train

    return train(tmp_path, data, nprocs=2, name="source",
                 overrides=[*overrides, *ALLGATHER, "parallel.context=2"])
