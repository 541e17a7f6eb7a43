"""Tensor parallelism on real gloo ranks: every sharded layer against its unsharded reference
(forward, input gradients, weight-gradient slices), the collectives' pairs, the whole model at
tp = 2 and 4 (with and without sequence parallelism) against tp = 1, and DeepSpeed ZeRO-1 with
our `mpu` at tp 2 x dp 2 against a single rank.

Every rank builds the same full reference from the same seed, so each rank can check its own
shard without gathering anything except where gathering is the point.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pretrain.testing.numerics import (VOCAB_MATRICES, bf16_logits_tolerance, cross_entropy64,
                                       full_grads)
from pretrain.testing.ranks import run_on_ranks
from pretrain.arithmetic import num_parameters
from pretrain.config import load_config
from pretrain.dist import init_deepspeed_comm
from pretrain.errors import ConfigError
from pretrain.model import (LlamaModel, build_model, gather_full_state_dict, shard_of,
                            tensor_partition_dim)
from pretrain.model import llama as llama_module
from pretrain.model.layers import (RMSNorm, column_linear, defer_sequence_parallel_grads,
                                   row_linear, vocab_embedding)
from pretrain.model.loss import vocab_parallel_cross_entropy
from pretrain.model.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                            VocabParallelEmbedding,
                                            copy_to_tp, gather_from_sequence, gather_from_tp,
                                            reduce_from_tp, reduce_scatter_to_sequence,
                                            scatter_to_sequence, scatter_to_tp)

TOL = dict(rtol=1e-5, atol=1e-5)


def tiny_cfg(**fields):
    overrides = ["model.preset=tiny"] + [f"model.{k}={v}" for k, v in fields.items()]
    return load_config(None, overrides).model


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def chunk(t, dim, group):
    return t.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)]


# ---- collectives and layers, checked on one rank's shard ----------------------------------------

def _check_collectives(group, tp, r):
    B, T, C = 2, 4 * tp, 4 * tp
    assert copy_to_tp(x := randn(2, 3, seed=0), None) is x  # no-op without a group
    # per-rank different tensors, so sums are visible
    mine = [randn(B, T, C, seed=10 + i) for i in range(tp)]
    grads = [randn(B, T, C, seed=20 + i) for i in range(tp)]
    total, grad_total = sum(mine), sum(grads)

    x = leaf(mine[r])
    y = reduce_from_tp(x, group)  # forward all-reduce, backward identity
    torch.testing.assert_close(y, total, **TOL)
    y.backward(grads[r])
    torch.testing.assert_close(x.grad, grads[r])

    x = leaf(mine[0])
    y = copy_to_tp(x, group)  # forward identity, backward all-reduce
    assert torch.equal(y, mine[0])
    y.backward(grads[r])
    torch.testing.assert_close(x.grad, grad_total, **TOL)

    # scatter -> gather along the sequence: the identity forward; gather's consumers are TP
    # (partial grads), so x receives the sum of the ranks' gradients
    x = leaf(mine[0])
    shard = scatter_to_sequence(x, group)
    assert shard.shape == (B, T // tp, C) and torch.equal(shard, chunk(mine[0], 1, group))
    y = gather_from_sequence(shard, group)
    assert torch.equal(y, mine[0])
    y.backward(grads[r])
    torch.testing.assert_close(x.grad, grad_total, **TOL)

    # reduce-scatter -> gather: partial sums in, the total out
    x = leaf(mine[r])
    shard = reduce_scatter_to_sequence(x, group)
    torch.testing.assert_close(shard, chunk(total, 1, group), **TOL)
    y = gather_from_sequence(shard, group)
    torch.testing.assert_close(y, total, **TOL)
    y.backward(grads[r])
    torch.testing.assert_close(x.grad, grad_total, **TOL)

    # last-dimension pair (full logits): replicated gradient in, replicated gradient out
    x = leaf(mine[0][..., :4 * tp])
    y = gather_from_tp(scatter_to_tp(x, group), group)
    assert torch.equal(y, x)
    y.backward(grads[0][..., :4 * tp])
    torch.testing.assert_close(x.grad, grads[0][..., :4 * tp])

    with pytest.raises(ValueError, match="divisible"):
        scatter_to_sequence(randn(1, 4 * tp + 1, 2, seed=0), group)


def _check_column_and_row(group, tp, r):
    B, T, h, f = 2, 4 * tp, 8, 6 * tp
    x_full, w_col, w_row = randn(B, T, h, seed=1), randn(f, h, seed=2), randn(h, f, seed=3)
    r_mid, r_out = randn(B, T, f, seed=4), randn(B, T, h, seed=5)

    # reference: y = row(column(x)), loss = <column out, r_mid> + <row out, r_out>
    x, wc, wr = leaf(x_full), leaf(w_col), leaf(w_row)
    mid = x @ wc.T
    out = mid @ wr.T
    ((mid * r_mid).sum() + (out * r_out).sum()).backward()

    for sequence_parallel in (False, True):
        column = column_linear(h, f, tp_group=group)
        row = row_linear(f, h, tp_group=group, sequence_parallel=sequence_parallel)
        assert isinstance(column, ColumnParallelLinear) and isinstance(row, RowParallelLinear)
        assert column.weight.shape == (f // tp, h) and row.weight.shape == (h, f // tp)
        with torch.no_grad():
            column.weight.copy_(chunk(w_col, 0, group))
            row.weight.copy_(chunk(w_row, 1, group))
        xt = leaf(chunk(x_full, 1, group) if sequence_parallel else x_full)
        entry = gather_from_sequence(xt, group) if sequence_parallel else copy_to_tp(xt, group)
        mid_shard = column(entry)  # (B, T, f/tp)
        out_t = row(mid_shard)  # (B, T, h), or (B, T/tp, h)
        torch.testing.assert_close(mid_shard, chunk(mid, -1, group), **TOL)
        expected_out = chunk(out, 1, group) if sequence_parallel else out
        torch.testing.assert_close(out_t, expected_out, **TOL)
        # Megatron's convention: each rank's loss has its shards of sharded outputs (the column
        # slice; the row output's tokens under SP) and all of a replicated output
        loss = (mid_shard * chunk(r_mid, -1, group)).sum()
        loss = loss + (out_t * (chunk(r_out, 1, group) if sequence_parallel else r_out)).sum()
        loss.backward()
        expected_grad = chunk(x.grad, 1, group) if sequence_parallel else x.grad
        torch.testing.assert_close(xt.grad, expected_grad, **TOL)
        torch.testing.assert_close(column.weight.grad, chunk(wc.grad, 0, group), **TOL)
        torch.testing.assert_close(row.weight.grad, chunk(wr.grad, 1, group), **TOL)
        for p in (column.weight, row.weight):
            assert p.tensor_model_parallel is True


def _check_vocab_embedding_and_norm(group, tp, r):
    V, C, B, T = 128 * tp, 6, 2, 4 * tp
    table = randn(V, C, seed=6)
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(7))
    ids[0, :tp] = torch.arange(tp) * (V // tp)  # the first row of every shard
    ids[1, :tp] = (torch.arange(tp) + 1) * (V // tp) - 1  # the last row of every shard
    grad_out = randn(B, T, C, seed=8)
    ref_table = leaf(table)
    ref = F.embedding(ids, ref_table)
    (ref * grad_out).sum().backward()

    for sequence_parallel in (False, True):
        emb = vocab_embedding(V, C, tp_group=group, sequence_parallel=sequence_parallel)
        assert isinstance(emb, VocabParallelEmbedding) and emb.weight.shape == (V // tp, C)
        with torch.no_grad():
            emb.weight.copy_(chunk(table, 0, group))
        out = emb(ids)
        if sequence_parallel:
            torch.testing.assert_close(out, chunk(ref, 1, group), **TOL)
            (out * chunk(grad_out, 1, group)).sum().backward()
        else:
            torch.testing.assert_close(out, ref, **TOL)
            (out * grad_out).sum().backward()  # replicated output: every rank's own grad
        torch.testing.assert_close(emb.weight.grad, chunk(ref_table.grad, 0, group), **TOL)

    # RMSNorm on a sequence shard: output = its slice, weight grad = the full-sequence grad
    x_full, w = randn(B, T, C, seed=9), 1 + randn(C, seed=10)
    ref_norm = RMSNorm(C)
    with torch.no_grad():
        ref_norm.weight.copy_(w)
    (ref_norm(x_full) * grad_out).sum().backward()
    norm = RMSNorm(C, sequence_parallel_group=group)
    with torch.no_grad():
        norm.weight.copy_(w)
    y = norm(chunk(x_full, 1, group))
    (y * chunk(grad_out, 1, group)).sum().backward()
    torch.testing.assert_close(norm.weight.grad, ref_norm.weight.grad, **TOL)
    assert not hasattr(norm.weight, "tensor_model_parallel")
    _check_norm_grads_reduced_once_per_step(group, x_full=x_full, w=w, grad_out=grad_out)


def _check_norm_grads_reduced_once_per_step(group, *, x_full, w, grad_out, micro_batches=4):
    """Under sequence parallelism with gradient accumulation the norm's weight gradient is
    all-reduced once per step (the last micro-batch's backward), and the accumulated gradient
    is still the full-sequence gradient summed over the micro-batches; two steps in a row."""
    ref_norm, norm = RMSNorm(x_full.shape[-1]), RMSNorm(x_full.shape[-1],
                                                        sequence_parallel_group=group)
    with torch.no_grad():
        ref_norm.weight.copy_(w)
        norm.weight.copy_(w)
    wrapper = torch.nn.Sequential(norm)
    assert defer_sequence_parallel_grads(wrapper, micro_batches=micro_batches) == 1
    assert defer_sequence_parallel_grads(torch.nn.Sequential(ref_norm), micro_batches=4) == 0
    for step in range(2):
        ref_norm.weight.grad = norm.weight.grad = None
        for micro in range(micro_batches):
            x, g = x_full * (1 + micro), grad_out.roll(micro + step, dims=1)
            (ref_norm(x) * g).sum().backward()
            (norm(chunk(x, 1, group)) * chunk(g, 1, group)).sum().backward()
            if micro < micro_batches - 1:  # nothing reduced yet: DeepSpeed accumulates zeros
                assert norm.weight_grad.reductions == step
                assert bool((norm.weight.grad == 0).all())
        assert norm.weight_grad.reductions == step + 1
        torch.testing.assert_close(norm.weight.grad, ref_norm.weight.grad, **TOL)


def _check_cross_entropy(group, tp, r):
    # vocab 200 / 100 in 128*tp padded columns: the last shards are partly or wholly padding
    for vocab, dtype in ((200, torch.float32), (100, torch.float32), (200, torch.bfloat16)):
        V, B, T = 128 * tp, 3, 5
        logits = randn(B, T, V, seed=11) * 3
        logits[..., vocab:] = 100.0  # padded columns would dominate if they leaked in
        labels = torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(12))
        labels[0, :3] = -100
        labels[1, 0], labels[1, 1] = 0, vocab - 1
        labels[2, 0] = min(vocab - 1, V // tp)  # first column of rank 1's shard
        logits = logits.to(dtype)
        ref_logits = leaf(logits)
        ref = F.cross_entropy(ref_logits[..., :vocab].float().reshape(-1, vocab),
                              labels.reshape(-1), ignore_index=-100)
        ref.backward()
        shard = leaf(chunk(logits, -1, group))
        loss = vocab_parallel_cross_entropy(shard, labels, vocab_size=vocab, tp_group=group)
        assert loss.dtype == torch.float32 and loss.ndim == 0
        torch.testing.assert_close(loss, ref, **TOL)
        (loss * 2.0).backward()
        assert shard.grad.dtype == dtype
        tol = TOL if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-4)
        torch.testing.assert_close(shard.grad, chunk(ref_logits.grad, -1, group) * 2.0, **tol)
        first_padded = max(0, vocab - r * (V // tp))  # within this rank's shard
        assert bool((shard.grad[..., first_padded:] == 0).all())


def _layers_on_ranks(rank, world_size, tp):
    group = dist.group.WORLD
    assert dist.get_world_size(group) == tp
    _check_collectives(group, tp, rank)
    _check_column_and_row(group, tp, rank)
    _check_vocab_embedding_and_norm(group, tp, rank)
    _check_cross_entropy(group, tp, rank)


@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_layers_match_unsharded_reference(tmp_path, tp):
    run_on_ranks(_layers_on_ranks, world_size=tp, tmp_path=tmp_path, args=(tp,))


def test_vocab_parallel_cross_entropy_single_rank_is_cross_entropy():
    logits = leaf(randn(4, 7, 256, seed=1))
    labels = torch.randint(0, 250, (4, 7), generator=torch.Generator().manual_seed(2))
    labels[0, 0] = -100
    before = logits.detach().clone()
    loss = vocab_parallel_cross_entropy(logits, labels, vocab_size=250, tp_group=None)
    assert torch.equal(logits, before)  # fp32 logits: the loss works on a copy, never on them
    ref_logits = leaf(logits)
    ref = F.cross_entropy(ref_logits[..., :250].reshape(-1, 250), labels.reshape(-1))
    torch.testing.assert_close(loss, ref)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad)


def test_shard_of_splits_by_name_and_pads_the_vocabulary():
    cfg = tiny_cfg(vocab_size=500)  # padded to 512 at tp 2, 256 rows a shard
    embed = randn(500, 64, seed=0)
    second = shard_of(embed, "model.embed_tokens.weight", cfg=cfg, tp_rank=1, tp_size=2)
    assert torch.equal(second[:244], embed[256:]) and bool((second[244:] == 0).all())
    q = randn(64, 64, seed=1)
    assert torch.equal(shard_of(q, "model.layers.0.self_attn.q_proj.weight", cfg=cfg,
                                tp_rank=1, tp_size=4), q[16:32])
    o = randn(64, 64, seed=2)
    assert torch.equal(shard_of(o, "model.layers.1.self_attn.o_proj.weight", cfg=cfg,
                                tp_rank=3, tp_size=4), o[:, 48:])
    norm = torch.ones(64)
    assert shard_of(norm, "model.norm.weight", cfg=cfg, tp_rank=1, tp_size=2) is norm
    with pytest.raises(ValueError, match="rows"):
        shard_of(randn(300, 64, seed=3), "lm_head.weight", cfg=cfg, tp_rank=0, tp_size=2)


# ---- the whole model ----------------------------------------------------------------------------

def _compare_with_tp1(cfg, group, *, sequence_parallel, seed=3):
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1),
                           generator=torch.Generator().manual_seed(1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[0, :5] = -100
    ref = build_model(cfg, seed=seed)
    model = build_model(cfg, seed=seed, tp_group=group, sequence_parallel=sequence_parallel)
    what = f"tp={model.tensor_parallel} sp={sequence_parallel} tied={cfg.tie_embeddings}"

    # the same seed gives shards of bitwise the same model
    full = gather_full_state_dict(model)
    ref_sd = ref.state_dict()
    assert full.keys() == ref_sd.keys()
    for name, tensor in full.items():
        assert torch.equal(tensor, ref_sd[name][:tensor.shape[0]]), (what, name)
    if cfg.tie_embeddings:
        assert full["lm_head.weight"] is full["model.embed_tokens.weight"]
    assert model.num_parameters() == ref.num_parameters() == num_parameters(cfg)

    with torch.no_grad():
        torch.testing.assert_close(model(inputs), ref(inputs), **TOL, msg=what)
    loss, ref_loss = model(inputs, labels), ref(inputs, labels)
    torch.testing.assert_close(loss, ref_loss, **TOL, msg=what)
    loss.backward()
    ref_loss.backward()
    grads = full_grads(model)
    for name, p in ref.named_parameters():
        expected = p.grad[:cfg.vocab_size] if name in VOCAB_MATRICES else p.grad
        torch.testing.assert_close(grads[name], expected, **TOL, msg=f"{what}: {name}")

    # greedy generation: an odd prompt length exercises the sequence-parallel padding
    prompt = inputs[:, :7]
    assert torch.equal(model.generate(prompt, max_new_tokens=4),
                       ref.generate(prompt, max_new_tokens=4)), what

    # bf16 activations through the same collectives (gloo reduces bf16 too): the logits element
    # by element, within what bf16 rounding explains (bf16_logits_tolerance), and the loss
    model, ref = model.to(torch.bfloat16), ref.to(torch.bfloat16)
    with torch.no_grad():
        logits, ref_logits = model(inputs), ref(inputs)
        bf16_loss, ref_bf16_loss = model(inputs, labels), ref(inputs, labels)
    assert logits.dtype == ref_logits.dtype == torch.bfloat16
    assert bf16_loss.dtype == ref_bf16_loss.dtype == torch.float32
    # each row-parallel layer (o_proj, down_proj: 2 a decoder layer) rounds its tp partial
    # products and the all-reduce's (or reduce-scatter's) tp - 1 bf16 additions, where tp 1
    # rounds its one product: 2 tp roundings that differ between the two
    roundings = 2 * cfg.num_layers * 2 * model.tensor_parallel
    tol = bf16_logits_tolerance(ref_logits, roundings=roundings)
    torch.testing.assert_close(logits.float(), ref_logits.float(), rtol=0.0, atol=tol,
                               msg=lambda m: f"{what} bf16 logits: {m}")
    # Both losses are fp32 cross entropies of these bf16 logits (vocab-parallel over the shards,
    # plain on tp 1): their difference is the one the logits' difference makes, to the fp32
    # roundings of the two losses (a few ulps of fp32 at the loss's magnitude each).
    expected = cross_entropy64(logits, labels) - cross_entropy64(ref_logits, labels)
    torch.testing.assert_close((bf16_loss - ref_bf16_loss).double(), expected, rtol=0.0,
                               atol=8 * torch.finfo(torch.float32).eps * float(ref_bf16_loss),
                               msg=lambda m: f"{what} bf16 loss: {m}")


def _model_on_ranks(rank, world_size, variants):
    for fields, sequence_parallel in variants:
        _compare_with_tp1(tiny_cfg(**fields), dist.group.WORLD,
                          sequence_parallel=sequence_parallel)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_model_tp2_matches_tp1(tmp_path, sequence_parallel):
    base = dict(vocab_size=500, seq_length=16, num_layers=2)
    variants = [(base, sequence_parallel),
                ({**base, "tie_embeddings": "true", "activation_checkpointing": "full"},
                 sequence_parallel),
                # Qwen3: heads of their own width; its q/k norms' gains summed over the ranks
                ({**base, "family": "qwen3", "head_dim": 24}, sequence_parallel)]
    run_on_ranks(_model_on_ranks, world_size=2, tmp_path=tmp_path, args=(variants,))


def _decoder_layer_inputs(rank, world_size):
    """The shape of the first decoder layer's input in the model a run builds for its layout
    (`construct_for_layout`), with parallel.sequence_parallel off and on."""
    from pretrain.model.build import construct_for_layout
    from pretrain.resolve.topology import Topology

    shapes = {}
    for sequence_parallel in (False, True):
        cfg = load_config(None, ["model.preset=tiny", "model.seq_length=16", "parallel.tensor=2",
                                 f"parallel.sequence_parallel={sequence_parallel}"])
        groups = Topology.from_parallel_config(cfg.parallel, world_size=world_size,
                                               rank=rank).create_groups()
        model = construct_for_layout(cfg, groups)
        seen = []
        model.model.layers[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].shape))
        with torch.no_grad():
            model(torch.zeros(2, 16, dtype=torch.long))
        shapes[sequence_parallel] = tuple(seen[0])
    return shapes


def test_sequence_parallel_setting_shards_the_activations_between_layers(tmp_path):
    """parallel.sequence_parallel reaches the model a run builds: with it, each tensor rank
    holds half the sequence of the activations between decoder layers (the memory it saves);
    without it, all of it."""
    for shapes in run_on_ranks(_decoder_layer_inputs, world_size=2, tmp_path=tmp_path):
        hidden = load_config(None, ["model.preset=tiny"]).model.hidden_size
        assert shapes == {False: (2, 16, hidden), True: (2, 8, hidden)}, shapes


def test_model_tp4_splits_kv_heads(tmp_path):
    # 8 query heads, 4 kv heads: one kv head and its two query heads per rank; vocab 300 in
    # 512 padded rows leaves rank 3's vocabulary shard all padding
    fields = dict(vocab_size=300, num_heads=8, num_kv_heads=4, seq_length=16, num_layers=2)
    run_on_ranks(_model_on_ranks, world_size=4, tmp_path=tmp_path,
                 args=([(fields, False), (fields, True)],))


def test_tensor_parallel_size_must_divide_kv_heads(monkeypatch):
    cfg = tiny_cfg()  # 4 heads, 2 kv heads
    with pytest.raises(ConfigError, match="sequence_parallel"):
        LlamaModel(cfg, sequence_parallel=True)  # without a tensor-parallel group
    # a 4-rank group, refused before any collective is needed
    monkeypatch.setattr(llama_module, "tp_world_size", lambda group: 4)
    with pytest.raises(ConfigError, match="num_kv_heads=2"):
        LlamaModel(cfg, tp_group=object())


# ---- DeepSpeed ZeRO-1 with our mpu: tp 2 x dp 2 against one rank --------------------------------

def _deepspeed_run(rank, world_size, tensor_parallel):
    import logging

    import deepspeed
    from deepspeed.runtime.utils import is_model_parallel_parameter

    from pretrain.resolve.topology import Topology

    deepspeed.utils.logger.setLevel(logging.WARNING)
    init_deepspeed_comm(dist_backend="gloo", verbose=False)  # no shm inference op
    topo = Topology(tensor=tensor_parallel, pipeline=1, world_size=world_size, rank=rank)
    groups = topo.create_groups() if world_size > 1 else None
    cfg = tiny_cfg(vocab_size=500, seq_length=16, num_layers=2)
    model = build_model(cfg, seed=5, tp_group=groups.tensor if groups else None)
    for name, p in model.named_parameters():
        assert is_model_parallel_parameter(p) == (
            tensor_parallel > 1 and tensor_partition_dim(name) is not None), name
    global_batch = 4
    micro = global_batch // topo.data
    config = {
        "train_batch_size": global_batch, "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "steps_per_print": 1000, "wall_clock_breakdown": False,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      mpu=groups.mpu if groups else None, config=config)
    dp_rank = topo.my_coords.data
    losses, norms = [], []
    for step in range(3):
        tokens = torch.randint(0, cfg.vocab_size, (global_batch, cfg.seq_length + 1),
                               generator=torch.Generator().manual_seed(100 + step))
        rows = tokens[dp_rank * micro:(dp_rank + 1) * micro]
        loss = engine(rows[:, :-1], rows[:, 1:])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        if groups is not None:
            dist.all_reduce(mean, group=groups.data)
        losses.append(float(mean) / topo.data)
        norms.append(float(engine.get_global_grad_norm()))
    return {"losses": losses, "norms": norms}


@pytest.mark.slow  # a DeepSpeed engine: compiles its shared-memory op on first use
def test_deepspeed_zero1_tp2_dp2_matches_single_rank(tmp_path):
    single = run_on_ranks(_deepspeed_run, world_size=1, tmp_path=tmp_path, args=(1,))[0]
    results = run_on_ranks(_deepspeed_run, world_size=4, tmp_path=tmp_path, args=(2,))
    for rank, result in enumerate(results):
        for key in ("losses", "norms"):
            torch.testing.assert_close(torch.tensor(result[key]), torch.tensor(single[key]),
                                       rtol=1e-5, atol=0.0, msg=f"rank {rank} {key}")
    # the norm is compared directly: Adam's updates barely depend on a global gradient scale,
    # so a wrong norm (unmarked TP parameters: their shards counted on TP rank 0 only, or a
    # wrong model-parallel group) would hardly show in the losses
    assert min(single["norms"]) > 0.0
