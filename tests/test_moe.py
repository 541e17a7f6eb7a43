"""Mixture of experts (`pretrain/model/moe.py`): the layer against a per-token reference, the
auxiliary losses in training, and every layout against one process.

The layer tests are in-process and tiny (hidden 64, 4 experts, top-2, 64 tokens). The layout
tests share one single-process run of `configs/tiny_moe.yaml` (6 fp32 steps, auxiliary loss
coefficients raised so their gradients move the losses visibly) as the reference
(`moe_reference`, in conftest.py: tests/test_expert_parallel.py compares with it too).
"""
from __future__ import annotations

import dataclasses
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from pretrain.config import MODEL_PRESETS, ModelConfig
from pretrain.errors import ConfigError
from pretrain.model.build import build_model
from pretrain.model.llama import fused_projections
from pretrain.model.moe import MoE

CFG = ModelConfig(**{**MODEL_PRESETS["tiny"], "seq_length": 32, "ffn_hidden_size": 96,
                     "num_experts": 4, "experts_per_token": 2, "moe_aux_loss_coeff": 0.1,
                     "moe_z_loss_coeff": 0.01})


def _layer(cfg: ModelConfig = CFG, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    layer = MoE(cfg, project=fused_projections)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.2)
    return layer


def _assert_close(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """Equal up to fp32 rounding of sums of a few hundred terms: 1e-5 of the largest element."""
    scale = b.abs().max().item()
    assert (a - b).abs().max().item() <= 1e-5 * scale, (what, (a - b).abs().max().item(), scale)


def _expert_reference(layer: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    expert = layer.experts[e]
    return expert.down_proj.weight @ (F.silu(expert.gate_proj.weight @ x)
                                      * (expert.up_proj.weight @ x))


def _reference(layer: MoE, x: torch.Tensor, *, k: int, capacity: int | None = None):
    """Token by token, top-`k`: (output (N, C), balance loss, z-loss, dropped assignments)."""
    flat = x.reshape(-1, x.shape[-1])
    N, E = flat.shape[0], len(layer.experts)
    taken = [0] * E
    rows, dropped, probs_all, counts, z = [], 0, [], torch.zeros(E), []
    for n in range(N):
        logits = (layer.gate.weight @ flat[n]).float()
        probs = torch.softmax(logits, dim=0)
        probs_all.append(probs)
        z.append(torch.logsumexp(logits, dim=0) ** 2)
        top = torch.topk(probs, k)
        weights = top.values / top.values.sum()
        out = torch.zeros(x.shape[-1])
        for w, e in zip(weights, top.indices.tolist()):
            counts[e] += 1
            if capacity is not None and taken[e] >= capacity:
                dropped += 1
                continue
            taken[e] += 1
            out = out + w * _expert_reference(layer, e, flat[n])
        rows.append(out)
    mean_probs = torch.stack(probs_all).mean(dim=0)
    balance = E * torch.sum(counts / (N * k) * mean_probs)
    return torch.stack(rows).view_as(x), balance, torch.stack(z).mean(), dropped


@pytest.mark.parametrize("top_k", [2, 3])
def test_moe_layer_matches_a_per_token_reference_in_output_losses_and_gradients(top_k):
    cfg = dataclasses.replace(CFG, experts_per_token=top_k)
    layer = _layer(cfg)
    x = torch.randn(2, 32, 64, requires_grad=True)
    out = layer(x)
    routing, _, aux = layer.route(x.detach().reshape(-1, 64))
    ref_layer = _layer(cfg)
    x_ref = x.detach().clone().requires_grad_(True)
    ref_out, balance, z_loss, dropped = _reference(ref_layer, x_ref, k=top_k)
    assert dropped == 0 and routing.dropped == 0
    _assert_close(out, ref_out, "output")
    torch.testing.assert_close(aux, 0.1 * balance + 0.01 * z_loss, rtol=1e-5, atol=1e-6)
    # the gradient of out . g + the auxiliary losses (which the layer adds in backward)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    ((ref_out * g).sum() + 0.1 * balance + 0.01 * z_loss).backward()
    _assert_close(x.grad, x_ref.grad, "input")
    for (name, p), q in zip(layer.named_parameters(), ref_layer.parameters()):
        _assert_close(p.grad, q.grad, name)
    # the router's gradient has an auxiliary part: without it the reference differs
    assert layer.gate.weight.grad.abs().max() > 0


def test_capacity_factor_drops_and_counts_the_assignments_over_capacity():
    cfg = dataclasses.replace(CFG, moe_capacity_factor=0.5)
    layer, x = _layer(cfg, seed=3), torch.randn(1, 32, 64)
    capacity = math.ceil(0.5 * 32 * 2 / 4)  # 8 of the 64 assignments per expert
    with torch.no_grad():
        out = layer(x)
        ref_out, _, _, dropped = _reference(layer, x, k=2, capacity=capacity)
    assert dropped > 0  # the 0.5 factor cannot hold 64 assignments in 4 x 8 places
    _assert_close(out, ref_out, "output")
    forwards, _, _, counted, assignments = layer.stats.tolist()
    assert (forwards, counted, assignments) == (1, dropped, 64)


def test_dropless_routing_keeps_every_assignment_however_unbalanced():
    layer = _layer(dataclasses.replace(CFG, moe_capacity_factor=0.0))
    with torch.no_grad():
        layer.gate.weight.zero_()
        layer.gate.weight[0] = 1.0  # every token prefers expert 0
        layer(torch.ones(1, 32, 64))
    assert layer.stats[3] == 0 and layer.stats[4] == 64


def test_moe_fields_are_checked():
    with pytest.raises(ConfigError, match="experts_per_token=5: must be between 1 and"):
        dataclasses.replace(CFG, experts_per_token=5)
    with pytest.raises(ConfigError, match="moe_capacity_factor"):
        dataclasses.replace(CFG, moe_capacity_factor=-1.0)
    with pytest.raises(ConfigError, match="num_experts"):
        dataclasses.replace(CFG, num_experts=-2)


def test_moe_model_parameters_and_init_follow_the_dense_rules():
    from pretrain.arithmetic import num_parameters

    model = build_model(CFG, seed=5)
    names = [n for n, _ in model.named_parameters()]
    assert "model.layers.1.mlp.gate.weight" in names
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names
    assert model.num_parameters() == num_parameters(CFG)
    params = dict(model.named_parameters())
    # experts are drawn from their own seeds; output projections at the scaled std
    a = params["model.layers.0.mlp.experts.0.gate_proj.weight"]
    b = params["model.layers.0.mlp.experts.1.gate_proj.weight"]
    assert not torch.equal(a, b)
    down = params["model.layers.0.mlp.experts.2.down_proj.weight"]
    assert abs(down.std().item() - 0.02 / math.sqrt(4)) < 2e-3
    # a dense config builds the dense model, names and values unchanged by the MoE code
    dense = build_model(dataclasses.replace(CFG, num_experts=0), seed=5)
    assert "model.layers.0.mlp.gate_proj.weight" in dict(dense.named_parameters())


# ---- training through `pretrain train`: every layout against one process ----------------------

STEPS, SAVE_AT = 10, 3
TRAIN = [f"train.steps={STEPS}", "model.moe_aux_loss_coeff=1.0", "model.moe_z_loss_coeff=0.1"]


def _moe_train(tmp_path, tiny_data, *, name, overrides=(), nprocs=1):
    from pretrain.testing.runs import train

    return train(tmp_path, tiny_data, nprocs=nprocs, name=name, config="configs/tiny_moe.yaml",
                 overrides=[*TRAIN, *overrides])


def _train_records(run) -> list[dict]:
    return [r for r in run.records if r["kind"] == "train"]


def _assert_final_is_last_checkpoint(run) -> None:
    """`final/` holds every tensor of the run's last step checkpoint, bitwise (each expert once,
    from the rank that held it)."""
    from pretrain.checkpoint.weights import consolidate_engine_checkpoint, load_weights

    final = load_weights(run.run_dir / "final").state
    last = consolidate_engine_checkpoint(run.run_dir / "checkpoints" / f"step{STEPS}").state
    assert sorted(final) == sorted(last)
    for name in last:
        assert torch.equal(final[name], last[name]), name


def _assert_same_steps(run, reference, *, first_step: int = 1) -> None:
    """Losses, gradient norms and the routers' statistics of each step within 1e-5."""
    from pretrain.testing.runs import rel_diff

    ours, ref = _train_records(run), _train_records(reference)[first_step - 1:]
    assert [r["step"] for r in ours] == [r["step"] for r in ref]
    for key in ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss"):
        assert rel_diff([r[key] for r in ours], [r[key] for r in ref]) < 1e-5, \
            (key, [r[key] for r in ours], [r[key] for r in ref])
    # tokens per expert and dropped assignments per layer: over the whole batch, every layout
    for key in ("moe_expert_tokens", "moe_dropped"):
        assert [r[key] for r in ours] == [r[key] for r in ref], key


@pytest.mark.slow
def test_single_process_moe_run_reports_router_statistics(moe_reference):
    records = _train_records(moe_reference)
    assert len(records) == STEPS
    for r in records:
        assert r["moe_dropped_fraction"] == 0.0  # dropless
        assert 1.0 <= r["moe_aux_loss"] < 4.0  # 1 when balanced, at most num_experts
        assert r["moe_z_loss"] > 0
    assert "aux " in moe_reference.stdout  # the step line
    assert "experts max/mean " in moe_reference.stdout
    for r in records:  # 2 layers of 4 experts; every step's global batch routed top-2
        tokens = r["moe_expert_tokens"]
        assert len(tokens) == 2 and all(len(layer) == 4 for layer in tokens)
        assert len({sum(layer) for layer in tokens}) == 1  # the same assignments per layer
        assert r["moe_load_max_mean_worst"] == max(r["moe_load_max_mean"]) >= 1.0


@pytest.mark.slow
def test_tensor_and_sequence_parallel_moe_under_zero3_equals_one_process_and_resumes(
        moe_reference, tiny_data, tmp_path):
    run = _moe_train(tmp_path, tiny_data, name="tp2sp", nprocs=2, overrides=[
        "parallel.tensor=2", "parallel.sequence_parallel=true", "deepspeed=ds_configs/zero3.json",
        f"checkpoint.save_interval={SAVE_AT}", "checkpoint.keep_last=1",
        f"checkpoint.keep_every={SAVE_AT}"])
    _assert_same_steps(run, moe_reference)
    # its step-3 checkpoint continues on two data ranks (ZeRO-1) like the uninterrupted run;
    # one micro-batch per rank where one process accumulates two: the auxiliary losses'
    # gradients must follow the engine's 1/accumulation scaling of the loss
    saved = run.run_dir / "checkpoints" / f"step{SAVE_AT}"
    shutil.copytree(saved, tmp_path / "resumed" / "checkpoints" / saved.name)
    resumed = _moe_train(tmp_path, tiny_data, name="resumed", nprocs=2)
    assert "resharded" in resumed.stdout
    _assert_same_steps(resumed, moe_reference, first_step=SAVE_AT + 1)


@pytest.mark.slow
def test_pipelined_moe_equals_one_process(moe_reference, tiny_data, tmp_path):
    run = _moe_train(tmp_path, tiny_data, name="pp2", nprocs=2,
                     overrides=["parallel.pipeline=2"])
    _assert_same_steps(run, moe_reference)


# ---- Hugging Face Mixtral ------------------------------------------------------------------------

def test_mixtral_import_gives_transformers_logits_and_export_gives_back_its_tensors(
        tiny_data, tmp_path):
    import transformers
    from safetensors.torch import load_file

    from pretrain.checkpoint.weights import load_weights
    from pretrain.cli import main
    from pretrain.model import LlamaModel
    from pretrain.model.hf import from_hf_state_dict, to_hf_config
    from pretrain.model.mixtral import MixtralImport

    torch.manual_seed(11)
    hf = transformers.MixtralForCausalLM(to_hf_config(CFG, bos_token_id=1, eos_token_id=2,
                                                      attn_implementation="eager")).eval()
    with torch.no_grad():  # non-trivial norms and decisive routers: a swap would show
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    hf.save_pretrained(tmp_path / "src")
    main(["import-hf", str(tmp_path / "src"), "--output", str(tmp_path / "init")])
    weights = load_weights(tmp_path / "init")
    assert (weights.model.num_experts, weights.model.experts_per_token) == (4, 2)
    ours = LlamaModel(weights.model)
    ours.load_state_dict(from_hf_state_dict(dict(weights.state.items()), weights.model))
    # transformers' own (stacked) state dict reads as the same tensors
    stacked = MixtralImport(hf.state_dict(), weights.model)
    assert "model.layers.0.mlp.experts.gate_up_proj" in hf.state_dict()
    assert sorted(stacked) == sorted(weights.state)
    for name in weights.state:
        assert torch.equal(stacked[name], weights.state[name]), name
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids).logits
        # one fp32 model against another: rounding only (the dense model's bound)
        assert ((ours.eval()(ids) - expected).abs().max() / expected.abs().max()) < 1e-5
        # greedy generation with the KV cache: transformers' tokens
        prompt = ids[:, :8]
        theirs = hf.generate(prompt, max_new_tokens=8, do_sample=False, min_new_tokens=8,
                             attention_mask=torch.ones_like(prompt), pad_token_id=0)
        assert torch.equal(ours.generate(prompt, max_new_tokens=8), theirs)

    main(["export-hf", str(tmp_path / "init"), "--output", str(tmp_path / "back"),
          "--dtype", "fp32", "--tokenizer", tiny_data["tokenizer"]])
    original, back = (load_file(str(p / "model.safetensors"))
                      for p in (tmp_path / "src", tmp_path / "back"))
    assert back.keys() == original.keys()
    for name, tensor in back.items():
        assert torch.equal(tensor, original[name]), name
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "back", attn_implementation="eager").eval()
    assert type(exported).__name__ == "MixtralForCausalLM"
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, expected)


# ---- the planner ---------------------------------------------------------------------------------

MIXTRAL_8X7B = ModelConfig(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
                           num_kv_heads=8, ffn_hidden_size=14336, seq_length=4096,
                           num_experts=8, experts_per_token=2)


def test_parameter_and_flop_counts_of_mixtral_8x7b_by_hand():
    from pretrain.arithmetic import (model_flops_per_token, num_active_parameters,
                                     num_parameters, stage_parameters)
    from pretrain.resolve.layout import Layout

    attention = 2 * 4096 * 4096 + 2 * 4096 * 1024  # q, o; k, v (8 kv heads of 128)
    expert = 3 * 4096 * 14336  # gate, up, down
    router, norms, embeddings = 8 * 4096, 2 * 4096, 2 * 32000 * 4096
    total = 32 * (attention + 8 * expert + router + norms) + 4096 + embeddings
    active = 32 * (attention + 2 * expert + router + norms) + 4096 + embeddings
    assert (total, active) == (46_702_792_704, 12_879_925_248)  # Mixtral's 46.7B / 12.9B
    assert num_parameters(MIXTRAL_8X7B) == total
    assert num_active_parameters(MIXTRAL_8X7B) == active
    # 6 per active weight (the lm_head once, not the input embedding) + attention's 12 s h
    assert model_flops_per_token(MIXTRAL_8X7B) == \
        6.0 * (active - 32000 * 4096) + 12.0 * 32 * 4096 * 4096
    # memory holds every expert: one rank of tp 2 holds half of each expert and all routers
    layout = Layout(tensor=2, pipeline=1, data=1)
    layer_on_rank = (attention + 8 * expert) // 2 + router + norms
    expected = 32 * layer_on_rank + 4096 + 2 * (32000 * 4096 // 2)  # final norm, vocab shards
    assert stage_parameters(MIXTRAL_8X7B, layout, ["embed", *["layer"] * 32, "norm", "head"]) == expected
    # a dense config counts as before: active = total
    dense = dataclasses.replace(MIXTRAL_8X7B, num_experts=0)
    assert num_active_parameters(dense) == num_parameters(dense)


def test_plan_of_the_tiny_moe_recipe_reports_total_and_active_parameters(capsys):
    import json

    from pretrain.arithmetic import model_flops_per_token, num_active_parameters, num_parameters
    from pretrain.cli import main
    from pretrain.config import load_config

    cfg = load_config("configs/tiny_moe.yaml").model
    main(["plan", "--config", "configs/tiny_moe.yaml", "--cluster", "cpu", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["parameters"] == num_parameters(cfg) > plan["active_parameters"] \
        == num_active_parameters(cfg)
    assert plan["flops_per_token"] == model_flops_per_token(cfg)


def test_recomputed_moe_layers_give_the_same_gradients_and_count_each_forward_once():
    from pretrain.config import Recompute
    from pretrain.model.moe import moe_layers

    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    grads, stats = [], []
    for mode in (Recompute.NONE, Recompute.FULL):
        model = build_model(dataclasses.replace(CFG, activation_checkpointing=mode), seed=2)
        model(ids, labels=ids).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        stats.append(torch.stack([layer.stats for layer in moe_layers(model)]))
    for name, grad in grads[0].items():
        _assert_close(grads[1][name], grad, name)
    assert stats[1][:, 0].tolist() == [1.0, 1.0]  # a recomputed forward is not counted again
    torch.testing.assert_close(stats[1], stats[0])


@pytest.mark.parametrize("capacity_factor", [0.0, 0.75])
def test_router_statistics_count_each_layers_top_k_choices(capacity_factor):
    """`collect_stats`' per-layer tokens per expert, dropped assignments and auxiliary losses
    against a count of the routers' own top-k on the same batch (two forwards of a step)."""
    from pretrain.model.moe import collect_stats, moe_layers

    cfg = dataclasses.replace(CFG, moe_capacity_factor=capacity_factor)
    model = build_model(cfg, seed=4)
    logits = {layer.layer_index: [] for layer in moe_layers(model)}
    for layer in moe_layers(model):
        layer.gate.register_forward_hook(
            lambda m, i, out, index=layer.layer_index: logits[index].append(out.detach()))
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):  # micro-batches of one step
        ids = torch.randint(0, 512, (2, 32), generator=gen)
        model(ids, labels=ids).backward()
    record = collect_stats(model, device="cpu", num_layers=cfg.num_layers, num_experts=4)
    tokens, dropped, balance, z = [], [], [], []
    for index in sorted(logits):
        counts, drops, losses = torch.zeros(4, dtype=torch.long), 0, []
        for out in logits[index]:
            probs = torch.softmax(out.float(), dim=-1)
            chosen = torch.bincount(torch.topk(probs, 2).indices.reshape(-1), minlength=4)
            counts += chosen
            if capacity_factor:
                capacity = math.ceil(capacity_factor * len(out) * 2 / 4)
                drops += int((chosen - capacity).clamp(min=0).sum())
            losses.append((4 * torch.sum(chosen / chosen.sum() * probs.mean(dim=0)),
                           torch.logsumexp(out.float(), dim=-1).pow(2).mean()))
        tokens.append(counts.tolist())
        dropped.append(drops)
        balance.append(sum(b for b, _ in losses).item() / 2)
        z.append(sum(zl for _, zl in losses).item() / 2)
    assert record["moe_expert_tokens"] == tokens
    assert record["moe_dropped"] == dropped
    assert (sum(dropped) > 0) == bool(capacity_factor)
    loads = [max(c) / (sum(c) / 4) for c in tokens]
    assert record["moe_load_max_mean"] == pytest.approx(loads)
    assert record["moe_load_max_mean_worst"] == pytest.approx(max(loads))
    assert record["moe_layer_aux_loss"] == pytest.approx(balance, rel=1e-6)
    assert record["moe_layer_z_loss"] == pytest.approx(z, rel=1e-6)
    # the sums were reset: a step with no forward reports no layer
    assert "moe_expert_tokens" not in collect_stats(model, device="cpu",
                                                    num_layers=cfg.num_layers, num_experts=4)


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts, by name, the calls of a forward that make the host wait for the device on a GPU:
    reading a value back (`item`, `tolist`, `cpu`, a tensor's truth or number), an output whose
    size depends on the values (`nonzero`, a boolean index, `bincount`, `unique`,
    `repeat_interleave` of tensor repeats without `output_size`) and a host value copied to the
    device (`torch.tensor`). On CPU none of them waits; counted here, they fail a test that a
    GPU's `torch.cuda.set_sync_debug_mode` would."""

    READS = {torch.Tensor.item: "item", torch.Tensor.tolist: "tolist", torch.Tensor.cpu: "cpu",
             torch.Tensor.numpy: "numpy", torch.Tensor.__bool__: "bool",
             torch.Tensor.__int__: "int", torch.Tensor.__float__: "float",
             torch.Tensor.__index__: "index", torch.nonzero: "nonzero",
             torch.Tensor.nonzero: "nonzero", torch.bincount: "bincount",
             torch.Tensor.bincount: "bincount", torch.unique: "unique",
             torch.Tensor.unique: "unique", torch.masked_select: "masked_select",
             torch.Tensor.masked_select: "masked_select", torch.tensor: "tensor"}

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = self.READS.get(func)
        if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave) \
                and isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor) \
                and kwargs.get("output_size") is None:
            name = "repeat_interleave"
        if func is torch.Tensor.__getitem__ and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool
                for i in (args[1] if isinstance(args[1], tuple) else (args[1],))):
            name = "boolean index"
        if name is not None:
            self.calls.append(name)
        return func(*args, **kwargs)


def test_host_reads_count_what_waits_on_a_gpu():
    """The counter sees each kind of read it names (and nothing of a plain computation)."""
    x = torch.arange(6.0)
    with HostReads() as reads:
        (x * 2).sum(dim=0)
        x.tolist(), x[0].item(), x.cpu(), bool(x[1] > 0), x[x > 2], torch.bincount(x.long())
        torch.repeat_interleave(x, torch.ones(6, dtype=torch.long))
        torch.repeat_interleave(x, torch.ones(6, dtype=torch.long), output_size=6)
    assert reads.calls == ["tolist", "item", "cpu", "bool", "boolean index", "bincount",
                           "repeat_interleave"]


@pytest.mark.parametrize("capacity_factor", [0.0, 0.5])
def test_a_moe_layer_forward_reads_the_device_at_most_once(capacity_factor):
    """Each host read stalls the GPU until its queue drains: a training forward of a MoE layer
    reads one thing, the rows per expert the split needs (one `tolist`); the statistics stay on
    the device until `collect_stats` reads them once per step."""
    from pretrain.model.moe import collect_stats

    layer = _layer(dataclasses.replace(CFG, moe_capacity_factor=capacity_factor))
    x = torch.randn(2, 32, 64, requires_grad=True)
    with HostReads() as reads:
        out = layer(x)
    assert reads.calls == ["tolist"]
    out.sum().backward()
    record = collect_stats(layer, device="cpu", num_layers=1, num_experts=4)
    assert sum(record["moe_expert_tokens"][0]) == 2 * 32 * 2  # top-2 of 64 tokens, counted
