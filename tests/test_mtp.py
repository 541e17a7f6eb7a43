"""Multi-token prediction (`model.mtp_depth`, `pretrain.model.mtp`): the loss the modules add
is a plain-torch computation of DeepSeek-V3's formula on a tiny model (embedding first, each
depth's last positions without a target, the shared head, lambda / D); the returned loss stays
the main head's, bitwise a model without the modules; the export is DeepSeek-V3's layout, which
transformers loads as the same model and which imports back bitwise; the layouts it cannot run
are refused before anything starts; on tensor, data and expert ranks it trains as one process."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file

from pretrain.config import load_config
from pretrain.errors import ConfigError
from pretrain.families import family_of
from pretrain.model import build_model
from pretrain.model.hf import to_hf_config, to_hf_state_dict
from pretrain.model.llama import DecoderLayer, gather_full_state_dict
from pretrain.model.mtp import MultiTokenPrediction, collect_losses, reset_losses

VOCAB = 515  # odd: padded rows
# DeepSeek-V3's latent attention, 2 decoder layers; with experts layer 0 dense, then the
# mixture (the prediction modules' blocks too)
DENSE = ["model.family=deepseek_v3", "model.num_kv_heads=4", "model.kv_lora_rank=24",
         "model.v_head_dim=20", "model.q_lora_rank=40", "model.qk_nope_head_dim=12",
         "model.qk_rope_head_dim=8"]
MOE = [*DENSE, "model.num_experts=8", "model.experts_per_token=3", "model.moe_ffn_hidden_size=40",
       "model.moe_router=sigmoid", "model.moe_groups=4", "model.moe_topk_groups=2",
       "model.num_shared_experts=2", "model.moe_first_dense_layers=1",
       "model.moe_routed_scaling_factor=2.5", "model.moe_aux_loss_coeff=0"]
SHAPES = {"dense": DENSE, "moe": MOE}


def model_cfg(shape: str, *more: str):
    return load_config(None, ["model.preset=tiny", f"model.vocab_size={VOCAB}",
                              "model.tie_embeddings=false", *SHAPES[shape], *more]).model


def _model(cfg, seed: int = 3):
    """The seeded model with every norm's gain away from 1 (a swapped or dropped norm shows)."""
    model = build_model(cfg, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=generator) + 0.5)
    return model


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _by_hand(model, inputs: torch.Tensor, labels: torch.Tensor):
    """(main loss, [CE_k], main + lambda / D sum CE_k) in plain torch from the model's weights:
    depth k sees the first T - k positions only (causal attention: the same states as the whole
    sequence's there), their targets the labels k further on."""
    cfg = model.cfg
    layers, N, T = model.model.layers, cfg.num_layers, inputs.shape[1]
    embedding, head = model.model.embed_tokens.weight, model.lm_head.weight[:cfg.vocab_size]
    cos, sin = model.model.rotary_emb(T, torch.float32)

    def cross_entropy(hidden, targets):
        return F.cross_entropy((hidden @ head.T).reshape(-1, cfg.vocab_size), targets.reshape(-1))

    h = F.embedding(inputs, embedding)
    for layer in layers[:N]:
        h = layer(h, cos, sin)
    main = cross_entropy(_rms(h, model.model.norm.weight, cfg.norm_eps), labels)
    depths = []
    for k in range(1, cfg.mtp_depth + 1):
        module, n = layers[N + k - 1], T - k
        token = _rms(F.embedding(inputs[:, k:], embedding), module.enorm.weight, cfg.norm_eps)
        joined = torch.cat((token, _rms(h[:, :n], module.hnorm.weight, cfg.norm_eps)), dim=-1)
        h = DecoderLayer.forward(module, joined @ module.eh_proj.weight.T, cos[:n], sin[:n])
        depths.append(cross_entropy(_rms(h, module.shared_head.norm.weight, cfg.norm_eps),
                                    labels[:, k:]))
    return main, depths, main + cfg.mtp_loss_weight / cfg.mtp_depth * sum(depths)


@pytest.mark.parametrize("shape, chunk", [("dense", 0), ("moe", 24)])
def test_mtp_loss_is_deepseek_v3s_formula_by_hand(shape, chunk):
    """Depth 2, lambda 0.3: the model returns the main loss, back-propagates main + lambda / D x
    sum CE_k (every gradient the by-hand total's), and counts each CE_k for the metrics; whole
    logits and chunked alike."""
    cfg = model_cfg(shape, "model.mtp_depth=2", "model.mtp_loss_weight=0.3",
                    f"model.loss_chunk_tokens={chunk}")
    model = _model(cfg)
    ids = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(0))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    loss = model(inputs, labels=labels)
    loss.backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    record = collect_losses(model, depth=2, device="cpu")
    model.zero_grad()
    main, depths, total = _by_hand(model, inputs, labels)
    total.backward()
    assert abs(loss.item() - main.item()) < 1e-6 * main.item()
    assert record["mtp_losses"] == pytest.approx([d.item() for d in depths], rel=1e-6)
    assert record["mtp_loss"] == pytest.approx(sum(d.item() for d in depths) / 2, rel=1e-6)
    assert all(d.item() > 0 for d in depths)
    for name, p in model.named_parameters():
        scale = p.grad.abs().max().item()
        assert scale > 0, name  # every module's parameter learns (the embedding, the head too)
        assert (ours[name] - p.grad).abs().max().item() <= 1e-5 * scale, name


def test_without_depth_everything_is_as_before_and_inference_uses_the_main_head():
    """mtp_depth 0: no module, the parameter names of before, no MTP layer in config.json; the
    same seed with depth 2 holds the same decoder (the modules' names are their own) and
    returns bitwise the loss and logits of the model without them; under no_grad (evaluation)
    the modules do not run."""
    plain, deep = model_cfg("moe"), model_cfg("moe", "model.mtp_depth=2")
    assert plain.mtp_depth == 0 and plain.mtp_loss_weight == 0.3
    without, with_mtp = build_model(plain, seed=3), build_model(deep, seed=3)
    assert not [m for m in without.modules() if isinstance(m, MultiTokenPrediction)]
    names = [n for n, _ in without.named_parameters()]

    def trained(cfg):  # the table's names, the expert bias (a buffer) left out
        return [n for n in family_of(cfg).parameter_names(cfg)
                if not n.endswith("e_score_correction_bias")]

    assert names == trained(plain)
    assert not any(n.startswith(f"model.layers.{plain.num_layers}.") for n in names)
    assert to_hf_config(plain).num_nextn_predict_layers == 0
    assert [n for n, _ in with_mtp.named_parameters()] == trained(deep)
    shared = dict(with_mtp.named_parameters())
    for name, p in without.named_parameters():
        assert torch.equal(p, shared[name]), name
    ids = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(1))
    assert torch.equal(without(ids[:, :-1], labels=ids[:, 1:]),
                       with_mtp(ids[:, :-1], labels=ids[:, 1:]))
    assert torch.equal(without(ids), with_mtp(ids))
    assert all(m.loss_sum is not None for m in with_mtp.modules()  # the training forward's
               if isinstance(m, MultiTokenPrediction))
    reset_losses(with_mtp)
    with_mtp.eval()
    with torch.no_grad():
        assert torch.equal(without(ids[:, :-1], labels=ids[:, 1:]),
                           with_mtp(ids[:, :-1], labels=ids[:, 1:]))
    assert all(m.loss_sum is None for m in with_mtp.modules()
               if isinstance(m, MultiTokenPrediction))


def test_the_planner_counts_the_modules_parameters_and_flops_as_built_and_run():
    """Depth 2 on the tiny mixture: the planner's stage (`stage_items`: the modules' decoder
    layers and an "mtp" item each) holds the built model's parameters exactly, the export's
    count too; a training forward's matmul FLOPs (torch's count) grow over depth 0 by each
    module's decoder layer and projection as the planner counts them, and the head once more
    per module (the planner's head term, once more per "mtp" item)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from pretrain.arithmetic import (layer_forward_flops_per_token, num_parameters, stage_items,
                                     stage_flops_per_token, stage_parameters)
    from pretrain.config import Precision
    from pretrain.resolve.layout import Layout

    layout = Layout(global_batch=1, micro_batch=1, precision=Precision.FP32)
    ids = torch.randint(0, VOCAB, (1, 65), generator=torch.Generator().manual_seed(0))
    counted, planned = {}, {}
    for depth in (0, 2):
        cfg = model_cfg("moe", f"model.mtp_depth={depth}")
        model = _model(cfg).train()
        (items,) = stage_items(cfg, layout)
        assert items.count("mtp") == depth and items.count("layer") == cfg.num_layers + depth
        assert stage_parameters(cfg, layout, items) == sum(p.numel() for p in model.parameters())
        assert num_parameters(cfg) == model.num_parameters()
        with FlopCounterMode(display=False) as counter, sdpa_kernel([SDPBackend.MATH]):
            model(ids[:, :-1], labels=ids[:, 1:])
        counted[depth], planned[depth] = counter.get_total_flops(), \
            stage_flops_per_token(cfg, layout, items)[0]
    T, h, N, V = cfg.seq_length, cfg.hidden_size, cfg.num_layers, cfg.vocab_size
    head = counted[0] - T * sum(layer_forward_flops_per_token(cfg, i) for i in range(N))
    modules = T * sum(layer_forward_flops_per_token(cfg, N + k) + 4 * h * h for k in range(2))
    assert counted[2] - counted[0] == modules + 2 * head
    assert planned[2] - planned[0] == pytest.approx(3 * modules / T + 2 * 6 * V * h, rel=1e-12)


def _lookahead_rank(rank: int, world_size: int, ids, labels, depth: int):
    import torch.distributed as dist

    from pretrain.model.context_parallel import lookahead

    chunk = ids.shape[1] // world_size
    mine = slice(rank * chunk, (rank + 1) * chunk)
    group = dist.new_group(list(range(world_size)))
    return lookahead(ids[:, mine], labels[:, mine], depth, group, ignore_index=IGNORE)


IGNORE = -100


@pytest.mark.parametrize("context", [1, 2, 4])
def test_a_context_rank_reads_the_tokens_after_its_chunk_as_one_process_shifts_them(context,
                                                                                    tmp_path):
    """`lookahead` of each contiguous chunk, then x[:, k:k + L]: the whole sequence's tokens k
    ahead (0 past its end) and labels k ahead (ignored past its end), as one process shifts
    them, for every k up to the depth, on every context rank."""
    from pretrain.testing.ranks import run_on_ranks

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 500, (2, 16), generator=gen)
    labels = torch.randint(0, 500, (2, 16), generator=gen)
    labels[0, 5] = IGNORE  # a masked label stays masked
    depth, chunk = 3, 16 // context
    ranks = run_on_ranks(_lookahead_rank, world_size=context, tmp_path=tmp_path,
                         args=(ids, labels, depth))
    for k in range(1, depth + 1):
        whole_ids = torch.cat((ids[:, k:], ids.new_zeros(2, k)), dim=1)
        whole_labels = torch.cat((labels[:, k:], labels.new_full((2, k), IGNORE)), dim=1)
        assert torch.equal(torch.cat([a[:, k:k + chunk] for a, _ in ranks], dim=1), whole_ids)
        assert torch.equal(torch.cat([b[:, k:k + chunk] for _, b in ranks], dim=1),
                           whole_labels)


@pytest.mark.parametrize("setting, message", [
    ("model.family=llama model.num_kv_heads=4", "model.mtp_depth=1: is DeepSeek-V3's"),
    ("parallel.pipeline=2", "model.mtp_depth=1 with parallel.pipeline=2: not supported"),
    ("model.mtp_depth=3 parallel.context=2 model.seq_length=4",
     "model.mtp_depth=3 with parallel.context=2: each rank's chunk of model.seq_length=4 is 2"),
    ("model.mtp_loss_weight=-1", "must be 0 (off) or positive"),
])
def test_what_multi_token_prediction_cannot_run_is_refused_before_the_run(setting, message):
    from pretrain.resolve.run import lay_out_as_loaded

    with pytest.raises(ConfigError, match=re.escape(message)):
        cfg = load_config(None, ["model.preset=tiny", *DENSE, "model.mtp_depth=1",
                                 *setting.split()])  # the last of a setting wins
        lay_out_as_loaded(cfg, world_size=2)


def test_export_is_deepseek_v3s_layout_transformers_loads_and_imports_back_bitwise(tiny_data,
                                                                                  tmp_path):
    """Export of a model with 2 modules: DeepSeek-V3's names (model.layers.{N + k - 1}.*, with
    each module's copy of the embedding and head) and num_nextn_predict_layers; transformers'
    DeepseekV3ForCausalLM loads it (the modules unused) and computes our logits; import-hf
    restores every tensor, the modules' too, bitwise, and the depth."""
    from pretrain.checkpoint.hf import export_hf, import_hf
    from pretrain.checkpoint.weights import Weights

    cfg = model_cfg("moe", "model.mtp_depth=2")
    model = _model(cfg).eval()
    state = to_hf_state_dict(gather_full_state_dict(model), cfg)
    export_hf(Weights(model=cfg, state=state, tokenizer=Path(tiny_data["tokenizer"]),
                      source="test"),
              tmp_path / "hf", dtype="fp32")
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    N = cfg.num_layers
    for k in range(2):
        for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "self_attn.kv_b_proj",
                     "mlp.gate"):
            assert torch.equal(written[f"model.layers.{N + k}.{name}.weight"],
                               state[f"model.layers.{N + k}.{name}.weight"])
        assert torch.equal(written[f"model.layers.{N + k}.embed_tokens.weight"],
                           state["model.embed_tokens.weight"])
        assert torch.equal(written[f"model.layers.{N + k}.shared_head.head.weight"],
                           state["lm_head.weight"])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 2 and config["num_hidden_layers"] == N
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(
        tmp_path / "hf", attn_implementation="eager").eval()
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, got = hf(ids).logits, model(ids)
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-5

    back = import_hf(tmp_path / "hf", tmp_path / "init")
    assert back.model.mtp_depth == 2
    assert set(back.state) == set(state)
    for name, tensor in state.items():
        assert torch.equal(back.state[name], tensor), name


# ---- training on layouts (slow) ---------------------------------------------------------------

STEPS = 4
# the mixture every layer but the first, the modules' blocks too; the bias balancing and the
# balance loss on, so that the router statistics of the modules' layers are compared too
RUN = [f"model.vocab_size={VOCAB}", "model.tie_embeddings=false", *MOE, "model.mtp_depth=2",
       "model.mtp_loss_weight=0.3", "model.moe_bias_update_rate=0.01",
       "model.moe_aux_loss_coeff=0.01", f"train.steps={STEPS}", "checkpoint.save_final=true"]
LAYOUTS = {
    # the heads over two tensor ranks, the positions too (the projection's and the norms'
    # gradients summed over the pair)
    "tp2_sp": (2, ["parallel.tensor=2", "parallel.sequence_parallel=true"]),
    "dp2_zero2": (2, ["deepspeed=ds_configs/zero2.json"]),
    # whole experts on the tensor ranks, the modules' mixture's too
    "tp2_expert2": (2, ["parallel.tensor=2", "parallel.expert=2"]),
    # the expert grid: whole experts on data ranks, the modules' in DeepSpeed's MoE groups too
    "expert2_dp2_grid": (2, ["parallel.expert=2"]),
    # ZeRO-3 gathers the embedding and head for each of their calls; fsdp2's units
    "zero3_tp2_dp2": (4, ["deepspeed=ds_configs/zero3.json", "parallel.tensor=2"]),
    "fsdp2_dp2": (2, ["train.engine=fsdp2", "deepspeed=ds_configs/zero3.json"]),
    # fsdp2's expert grid: the modules' experts sharded over their expert-data ranks too
    "fsdp2_expert2_grid": (2, ["train.engine=fsdp2", "deepspeed=ds_configs/zero3.json",
                               "parallel.expert=2"]),
    # Ulysses' chunks: each rank reads the tokens after its chunk from the next rank's, each
    # module's loss its chunk's share; and with the heads and positions over tensor ranks too
    "cp2": (2, ["parallel.context=2"]),
    "cp2_tp2_sp": (4, ["parallel.context=2", "parallel.tensor=2",
                       "parallel.sequence_parallel=true"]),
    # saved at step 2 for the resume below
    "dp2_zero1": (2, ["checkpoint.save_interval=2", "checkpoint.keep_last=1",
                      "checkpoint.keep_every=2"]),
}


@pytest.fixture(scope="module")
def single_mtp(tiny_data, tmp_path_factory):
    from pretrain.testing.runs import train

    return train(tmp_path_factory.mktemp("mtp_single"), tiny_data, name="single", overrides=RUN)


def _train_records(run) -> list[dict]:
    return [r for r in run.records if r["kind"] == "train"]


def _assert_same_run(run, single) -> None:
    """Losses, gradient norms, the modules' losses and the router's counts of one process
    (1e-5: the reduction order differs); the final weights' modules too (2e-5)."""
    from pretrain.checkpoint.weights import load_weights
    from pretrain.testing.runs import rel_diff

    assert rel_diff(run.losses, single.losses[-len(run.losses):]) < 1e-5, (run.losses,
                                                                           single.losses)
    ours, theirs = _train_records(run), _train_records(single)[-len(run.losses):]
    for name in ("grad_norm", "mtp_loss"):
        assert rel_diff([r[name] for r in ours], [r[name] for r in theirs]) < 1e-5, name
    for a, b in zip(ours, theirs):
        assert len(a["mtp_losses"]) == 2
        assert rel_diff(a["mtp_losses"], b["mtp_losses"]) < 1e-5
        assert a["moe_expert_tokens"] == b["moe_expert_tokens"]
        assert len(a["moe_expert_tokens"]) == 3  # layer 1 and the two modules' blocks
        assert a["mtp_loss"] != a["loss"]
    final, reference = (load_weights(r.run_dir / "final").state for r in (run, single))
    names = [n for n in reference if n.startswith(("model.layers.2.", "model.layers.3."))]
    assert "model.layers.3.eh_proj.weight" in names and set(final) == set(reference)
    for name in names:
        # 2e-5 of the tensor's largest element: Adam's first steps divide each element's
        # update by its own gradient's size, magnifying the reduction order's last bits (the
        # context pair's attention sums its chunks' key gradients apart: 1.1e-5 seen)
        scale = reference[name].abs().max().item()
        assert (final[name] - reference[name]).abs().max().item() <= 2e-5 * max(scale, 1e-6), name


@pytest.mark.slow  # `pretrain train` on 2 forked ranks
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mtp_trains_on_a_layout_as_one_process(layout, tiny_data, tmp_path, single_mtp):
    """Depth 2 on tensor, data (ZeRO-1, ZeRO-2) and expert = tensor ranks: everything one
    process logs and saves, within 1e-5 over 4 steps."""
    from pretrain.testing.runs import train

    nprocs, overrides = LAYOUTS[layout]
    run = train(tmp_path, tiny_data, nprocs=nprocs, name=layout, overrides=[*RUN, *overrides])
    if layout.endswith("_grid"):  # the experts on the data ranks, not on tensor ones
        assert "dp 2 (ep 2 x etp 1 of a stage's ranks) |" in run.stdout, run.stdout
        record = next(r for r in run.records if r["kind"] == "run")
        assert (record["expert"], record["expert_tensor"]) == (2, 1)
    _assert_same_run(run, single_mtp)
    if layout == "dp2_zero1":  # resumed from step 2 on tensor 2 = expert 2: resharded
        import shutil

        step = run.run_dir / "checkpoints" / "step2"
        shutil.copytree(step, tmp_path / "tp2" / "checkpoints" / step.name)
        resumed = train(tmp_path, tiny_data, nprocs=2, name="tp2", overrides=[
            *RUN, "parallel.tensor=2", "parallel.expert=2"])
        assert "tp1 pp1 dp2 ZeRO-1 -> tp2 pp1 ep2 dp1 ZeRO-1" in resumed.stdout
        assert len(resumed.losses) == STEPS - 2
        _assert_same_run(resumed, single_mtp)
