"""Pipeline parallelism: the layer specs against `LlamaModel`, then DeepSpeed's 1F1B engine on
gloo ranks against a single-process `LlamaModel` + torch AdamW of the same seed and samples.

Single process: the flattened specs give the flat model's logits, loss and gradients bitwise,
and map 1:1 to its Hugging Face names. On ranks: pp=2 (untied / tied across the two stages,
"parameters" / "uniform" partitioning, activation checkpointing) and pp=2 x dp=2 with ZeRO-1
match the reference losses within 1e-5 relative for 5 steps, the final weights and the
evaluation loss too, and every stage starts from bitwise the flat model's weights; tp=2 x pp=2
with sequence parallelism and tied embeddings matches the losses.
"""
from __future__ import annotations

import pytest
import torch

from pretrain.testing.ranks import run_on_ranks
from pretrain.config import load_config
from pretrain.dist import init_deepspeed_comm
from pretrain.resolve.ds_config import check_deepspeed_pipeline_config
from pretrain.errors import ConfigError
from pretrain.model import (build_flat_pipeline, build_model, build_pipeline_model,
                            defer_sequence_parallel_grads)
from pretrain.model.layers import RMSNorm
from pretrain.model.llama import torch_checkpoint
from pretrain.model.pipeline import (DecoderLayerPipe, StageActivations, pipeline_module,
                                     pipeline_to_canonical_name, stage_state_dict)
from pretrain.resolve.topology import Topology

pytestmark = pytest.mark.slow  # training runs through the launchers (quick tier: not slow)

SEED = 11
STEPS = 5
GLOBAL_BATCH, MICRO_BATCH = 8, 2  # 4 micro-batches per step over all data-parallel ranks
OPTIMIZER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CLIP = 1.0
RTOL = 1e-5


def tiny_cfg(*, tie: bool = False, family: str = "llama"):
    """The tiny model; qwen3's with heads of 24 (not 64 / 4)."""
    qwen3 = ["model.family=qwen3", "model.head_dim=24"] if family == "qwen3" else []
    return load_config(None, ["model.preset=tiny", "model.num_layers=4", "model.seq_length=32",
                              f"model.tie_embeddings={str(tie).lower()}", *qwen3]).model


def micro_batches(cfg, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The GLOBAL_BATCH samples of `step` as (input_ids, labels) micro-batches, in a fixed order;
    step -1 is the evaluation batch."""
    tokens = torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, cfg.seq_length + 1),
                           generator=torch.Generator().manual_seed(1000 + step))
    rows = tokens.split(MICRO_BATCH)
    return [(r[:, :-1].contiguous(), r[:, 1:].contiguous()) for r in rows]


def reference_run(cfg) -> dict:
    """One process, `LlamaModel` + torch AdamW: the losses every layout must reproduce."""
    model = build_model(cfg, seed=SEED)
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIMIZER)
    losses = []
    for step in range(STEPS):
        batches = micro_batches(cfg, step)
        total = 0.0
        for input_ids, labels in batches:
            loss = model(input_ids, labels)
            (loss / len(batches)).backward()  # gradient accumulation = mean over micro-batches
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total / len(batches))
    with torch.no_grad():
        eval_loss = sum(model(i, l).item() for i, l in micro_batches(cfg, -1)) / 4
    return {"losses": losses, "eval": eval_loss,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


# ---- single process ------------------------------------------------------------------------------

@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_flat_pipeline_equals_llama_model(tie):
    cfg = tiny_cfg(tie=tie)
    flat, pipe = build_model(cfg, seed=SEED), build_flat_pipeline(cfg, seed=SEED)
    input_ids, labels = micro_batches(cfg, 0)[0]
    assert torch.equal(pipe(input_ids), flat(input_ids))  # logits (B, T, vocab_size)
    loss_flat, loss_pipe = flat(input_ids, labels), pipe(input_ids, labels)
    assert torch.equal(loss_pipe, loss_flat)
    loss_flat.backward()
    loss_pipe.backward()
    # parameters map 1:1 onto the flat model's names, with equal values and gradients
    flat_params = dict(flat.named_parameters())
    pipe_params = {pipeline_to_canonical_name(n, num_layers=cfg.num_layers): p
                   for n, p in pipe.named_parameters()}
    assert sorted(pipe_params) == sorted(flat_params)
    for name, param in pipe_params.items():
        assert torch.equal(param, flat_params[name]), name
        assert torch.equal(param.grad, flat_params[name].grad), name
    # the export view has exactly the flat state dict's keys (a tied head as lm_head.weight)
    state = stage_state_dict(pipe, num_layers=cfg.num_layers)
    flat_state = flat.state_dict()
    assert sorted(state) == sorted(flat_state)
    assert all(torch.equal(state[k], flat_state[k]) for k in state)


def test_pipeline_names_map_to_hugging_face_names():
    assert pipeline_to_canonical_name("0.embed_tokens.weight", num_layers=4) == \
        "model.embed_tokens.weight"
    assert pipeline_to_canonical_name("3.self_attn.q_proj.weight", num_layers=4) == \
        "model.layers.2.self_attn.q_proj.weight"
    assert pipeline_to_canonical_name("5.norm.weight", num_layers=4) == "model.norm.weight"
    assert pipeline_to_canonical_name("6.lm_head.weight", num_layers=4) == "lm_head.weight"
    assert pipeline_to_canonical_name("tied_modules.embed.embed_tokens.weight",
                                      num_layers=4) == "model.embed_tokens.weight"
    with pytest.raises(KeyError):
        pipeline_to_canonical_name("7.lm_head.weight", num_layers=4)


def test_stage_activations_round_trip_by_name():
    hidden = torch.randn(2, 3, 4)
    wire = StageActivations(hidden=hidden).to_tuple()
    assert isinstance(wire, tuple) and wire[0] is hidden
    assert StageActivations.from_tuple(wire).hidden is hidden
    assert StageActivations.from_tuple(hidden).hidden is hidden  # DeepSpeed's unwrapped 1-tuple
    with pytest.raises(ValueError, match="expected 1"):
        StageActivations.from_tuple((hidden, hidden))


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_stages=5), "5 pipeline stages for model.num_layers=4"),
    (dict(num_stages=0), "positive integer"),
    (dict(num_stages=2, partition_method="profile"), "partition_method='profile'"),
    (dict(num_stages=2, activation_checkpoint_interval=-1), "activation_checkpoint_interval"),
])
def test_bad_pipeline_arguments_are_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        build_pipeline_model(tiny_cfg(), seed=SEED, **kwargs)


# ---- DeepSpeed's pipeline engine on gloo ranks -------------------------------------------------

def _pipeline_run(rank, world_size, variant):
    import logging
    import warnings

    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    init_deepspeed_comm(dist_backend="gloo", verbose=False)  # no shm inference op
    cfg = tiny_cfg(tie=variant["tie"], family=variant.get("family", "llama"))
    num_stages, tensor = variant["stages"], variant.get("tensor", 1)
    sequence_parallel = variant.get("sequence_parallel", False)
    topology = tp_group = None
    if tensor > 1:
        topology = Topology(tensor=tensor, pipeline=num_stages, world_size=world_size, rank=rank)
        tp_group = topology.create_groups().tensor
    checkpoint_calls = []

    def counted_checkpoint(function, *args):  # the flat model's function, counted
        checkpoint_calls.append(1)
        return torch_checkpoint(function, *args)

    module = build_pipeline_model(cfg, seed=SEED, num_stages=num_stages, topology=topology,
                                  tp_group=tp_group, sequence_parallel=sequence_parallel,
                                  partition_method=variant["partition"],
                                  activation_checkpoint_interval=variant["checkpoint"],
                                  activation_checkpoint_func=counted_checkpoint)
    initial = {k: v.clone() for k, v in stage_state_dict(module, num_layers=cfg.num_layers).items()}
    dp = world_size // (num_stages * tensor)
    config = {
        "train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": GLOBAL_BATCH // (MICRO_BATCH * dp),
        "optimizer": {"type": "AdamW", "params": {**OPTIMIZER, "betas": list(OPTIMIZER["betas"]),
                                                  "torch_adam": True}},
        "gradient_clipping": CLIP, "zero_optimization": {"stage": variant["zero"]},
        "steps_per_print": 10**9, "wall_clock_breakdown": False,
        # DeepSpeed's defaults, except under sequence parallelism (check_deepspeed_pipeline_config)
        "pipeline": {"pipe_partitioned": not sequence_parallel,
                     "grad_partitioned": not sequence_parallel},
    }
    check_deepspeed_pipeline_config(config, sequence_parallel=sequence_parallel)
    engine, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                      config=config)
    gas = engine.gradient_accumulation_steps()
    # as pretrain.training.engine does: sequence-parallel norm gradients reduced once per step
    defer_sequence_parallel_grads(module, micro_batches=gas)
    norms = [m.weight_grad for m in module.modules() if isinstance(m, RMSNorm)]
    dp_rank = engine.grid.get_data_parallel_id()

    def mine(step):  # this replica's share of the step's micro-batches, in the global order
        return iter(micro_batches(cfg, step)[dp_rank * gas:(dp_rank + 1) * gas])

    with warnings.catch_warnings(record=True) as caught:  # autograd through a collective?
        warnings.simplefilter("always")
        losses = [float(engine.train_batch(mine(step))) for step in range(STEPS)]
        eval_loss = float(engine.eval_batch(mine(-1)))
    final = {k: v.clone() for k, v in stage_state_dict(module, num_layers=cfg.num_layers).items()}
    checkpointed = [type(f).__name__ for f, c in zip(
        module.forward_funcs, module.is_checkpointable_results) if c] if variant["checkpoint"] \
        else []
    return {"losses": losses, "eval": eval_loss, "initial": initial, "final": final,
            "parts": module.parts, "stage": engine.stage_id, "checkpointed": checkpointed,
            "checkpoint_calls": len(checkpoint_calls), "micro_batches": gas,
            "norm_reductions": [n.reductions for n in norms],
            "autograd_warnings": [str(w.message) for w in caught
                                  if "autograd kernel was not registered" in str(w.message)]}


def _check_against_reference(results, cfg, *, expected_parts, whole_weights=True):
    """Losses, evaluation, partitioning; with `whole_weights` (no tensor parallelism) also the
    initial and final weights of every stage."""
    reference = reference_run(cfg)
    initial_flat = build_model(cfg, seed=SEED).state_dict()
    union = {}
    for rank, result in enumerate(results):
        torch.testing.assert_close(torch.tensor(result["losses"]),
                                   torch.tensor(reference["losses"]), rtol=RTOL, atol=0.0,
                                   msg=lambda m: f"rank {rank} train losses: {m}")
        assert result["eval"] == pytest.approx(reference["eval"], rel=RTOL), rank
        assert result["parts"] == expected_parts
        assert result["autograd_warnings"] == [], rank
        if not whole_weights:
            continue
        for name, tensor in result["initial"].items():  # every stage starts bitwise equal
            assert torch.equal(tensor, initial_flat[name]), (rank, name)
        for name, tensor in result["final"].items():
            torch.testing.assert_close(tensor, reference["state"][name], rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
        for name, tensor in result["final"].items():  # every parameter was trained: equal
            # final weights are not equal initial ones (Adam moves each by ~lr per step)
            assert (tensor - result["initial"][name]).abs().max() > 1e-4, (rank, name)
        union.update(result["initial"])
    if whole_weights:  # the stages together hold the whole model
        assert sorted(union) == sorted(initial_flat)


PP2_VARIANTS = {
    # name: (variant, expected stage boundaries over the 7 specs: embed, 4 layers, norm, head)
    "untied-parameters-zero1": (dict(tie=False, partition="parameters", checkpoint=0, zero=1),
                                [0, 3, 7]),
    "tied-uniform-zero0": (dict(tie=True, partition="uniform", checkpoint=0, zero=0),
                           [0, 4, 7]),
    "tied-checkpointed-zero1": (dict(tie=True, partition="type:DecoderLayerPipe", checkpoint=1,
                                     zero=1), [0, 3, 7]),
    # another family's decoder layer in the stages (Qwen3's q/k norms)
    "qwen3-untied-uniform-zero1": (dict(tie=False, partition="uniform", checkpoint=0, zero=1,
                                        family="qwen3"), [0, 4, 7]),
}


@pytest.mark.parametrize("name", list(PP2_VARIANTS))
def test_pp2_matches_single_process(tmp_path, name):
    variant, parts = PP2_VARIANTS[name]
    results = run_on_ranks(_pipeline_run, world_size=2, tmp_path=tmp_path,
                           args=({**variant, "stages": 2},))
    assert [r["stage"] for r in results] == [0, 1]
    _check_against_reference(results, tiny_cfg(tie=variant["tie"],
                                                family=variant.get("family", "llama")),
                             expected_parts=parts)
    if variant["checkpoint"]:  # only decoder layers go through the checkpoint function
        micro = GLOBAL_BATCH // MICRO_BATCH
        for result in results:  # 2 layers a stage, every micro-batch of 5 steps and 1 eval
            assert result["checkpointed"] == [DecoderLayerPipe.__name__] * 2
            assert result["checkpoint_calls"] == 2 * micro * (STEPS + 1)
    else:
        assert all(result["checkpoint_calls"] == 0 for result in results)
    if variant["tie"]:  # the two stages' copies of the tied weight stayed identical
        torch.testing.assert_close(results[1]["final"]["lm_head.weight"],
                                   results[0]["final"]["model.embed_tokens.weight"],
                                   rtol=0.0, atol=0.0)


def test_pp2_dp2_zero1_matches_single_process(tmp_path):
    variant = dict(tie=True, partition="parameters", checkpoint=0, zero=1, stages=2)
    results = run_on_ranks(_pipeline_run, world_size=4, tmp_path=tmp_path, args=(variant,))
    assert [r["stage"] for r in results] == [0, 0, 1, 1]  # DeepSpeed: pipe outermost
    _check_against_reference(results, tiny_cfg(tie=True), expected_parts=[0, 3, 7])


def test_tp2_pp2_sequence_parallel_matches_single_process(tmp_path):
    # tied embeddings across stages *and* vocabulary shards; each TP rank sends its own
    # sequence slice between stages
    variant = dict(tie=True, partition="parameters", checkpoint=0, zero=1, stages=2, tensor=2,
                   sequence_parallel=True)
    results = run_on_ranks(_pipeline_run, world_size=4, tmp_path=tmp_path, args=(variant,))
    assert [r["stage"] for r in results] == [0, 0, 1, 1]  # TP innermost
    _check_against_reference(results, tiny_cfg(tie=True), expected_parts=[0, 3, 7],
                             whole_weights=False)
    # every norm of every stage all-reduced its weight gradient once per step, not once per
    # micro-batch
    assert all(r["micro_batches"] > 1 for r in results)
    assert all(r["norm_reductions"] and set(r["norm_reductions"]) == {STEPS} for r in results)


def test_sequence_parallel_refuses_partitioned_pipe_activations():
    with pytest.raises(ConfigError, match="pipe_partitioned and grad_partitioned"):
        check_deepspeed_pipeline_config({}, sequence_parallel=True)
    with pytest.raises(ConfigError, match="grad_partitioned"):
        check_deepspeed_pipeline_config({"pipeline": {"pipe_partitioned": False}},
                                        sequence_parallel=True)
    check_deepspeed_pipeline_config({}, sequence_parallel=False)
    check_deepspeed_pipeline_config(
        {"pipeline": {"pipe_partitioned": False, "grad_partitioned": False}},
        sequence_parallel=True)


def _count_real_layer_builds(rank, world_size):
    from pretrain.model import pipeline

    init_deepspeed_comm(dist_backend="gloo", verbose=False)  # no shm inference op
    real = []
    init = DecoderLayerPipe.__init__

    def counted(self, *args, **kwargs):
        init(self, *args, **kwargs)
        real.append(not next(self.parameters()).is_meta)

    DecoderLayerPipe.__init__ = counted
    try:
        cfg = load_config(None, ["model.preset=tiny", "model.num_layers=6"]).model
        module = pipeline.pipeline_module(cfg, num_stages=2, partition_method="parameters")
    finally:
        DecoderLayerPipe.__init__ = init
    return sum(real), len(real), sum(isinstance(f, DecoderLayerPipe) for f in module.forward_funcs)


def test_parameters_partition_builds_only_this_stages_layers(tmp_path):
    """DeepSpeed's "parameters" partition counts every layer: on the meta device, so each
    rank allocates only its own stage's 3 of the 6 decoder layers."""
    for real, built, held in run_on_ranks(_count_real_layer_builds, world_size=2,
                                          tmp_path=tmp_path):
        assert (real, built, held) == (3, 9, 3)  # 6 counted on meta + the 3 of its stage


def _grid_groups(rank, world_size):
    import torch.distributed as dist

    init_deepspeed_comm(dist_backend="gloo", verbose=False)
    topology = Topology(tensor=2, pipeline=2, world_size=world_size, rank=rank)
    groups = topology.create_groups()
    created = []
    create = dist.new_group

    def counted(*args, **kwargs):
        created.append(kwargs.get("ranks", args[0] if args else None))
        return create(*args, **kwargs)

    dist.new_group = counted
    try:
        module = pipeline_module(tiny_cfg(tie=True), num_stages=2, topology=topology,
                                 tp_group=groups.tensor, groups_by_ranks=groups.by_ranks)
        reused = len(created)
        pipeline_module(tiny_cfg(tie=True), num_stages=2, topology=topology,
                        tp_group=groups.tensor)
    finally:
        dist.new_group = create
    grid = module._grid
    return {"reused_new_groups": reused, "ours": sorted(groups.by_ranks),
            "plain_new_groups": sorted(tuple(sorted(r)) for r in created[reused:]),
            "same": [grid.slice_proc_group is groups.tensor, grid.dp_proc_group is groups.data,
                     grid.pp_proc_group is groups.pipeline,
                     grid.ds_model_proc_group is groups.model]}


def test_pipeline_grid_reuses_the_topology_groups(tmp_path):
    """DeepSpeed's pipeline grid gets our tensor, data, pipe and model groups instead of
    creating each communicator a second time (tp 2 x pp 2)."""
    for result in run_on_ranks(_grid_groups, world_size=4, tmp_path=tmp_path):
        assert result["same"] == [True, True, True, True]
        assert result["reused_new_groups"] == 0
        # without them every one of our 9 rank lists (1 model, 4 data, 2 pipe, 2 tensor) is
        # made again, plus the tied embedding's groups
        assert len(result["ours"]) == 9
        assert set(result["ours"]) <= set(result["plain_new_groups"])
