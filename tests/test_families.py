"""Model families (`pretrain.families`): each family's tiny model of an unusual shape is
`transformers`' own class through `import-hf`, `export-hf` and greedy decoding; its parameter
table agrees with the model it builds; Llama 3's rotary scaling is transformers' `llama3`;
DeepSeek-V3's latent attention decodes from its compressed cache as without one, and trains
with its heads over two tensor ranks as one process does."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from pretrain.arithmetic import kv_cache_elements_per_token, num_parameters
from pretrain.cli import main as pretrain_main
from pretrain.checkpoint.weights import load_weights
from pretrain.config import load_config
from pretrain.families import FAMILIES, family_of
from pretrain.model import LlamaModel, build_model, canonical_buffers
from pretrain.errors import CheckpointError
from pretrain.model.hf import (check_same_architecture, expected_hf_keys, from_hf_state_dict,
                               to_hf_config)
from pretrain.model.layers import inverse_frequencies
from pretrain.model.llama import full_parameter_shape, shard_init

VOCAB = 515  # odd: padded rows under every tensor-parallel size

# per family, a tiny model of a shape that differs from the plain Llama where the family can:
# GQA and untied everywhere; Llama 3's scaling with a factor, an original context (60, under
# the tiny model's 64 positions, as Llama 3.1's 8k under its 128k) and band factors (none the
# default, so that one dropped on the way shows) that put the tiny head's frequencies in every
# band: wavelength 6.3 kept (< 60 / 6), 32.5 blended (< 60 / 1.5), the rest divided by 8;
# Qwen3's head_dim 24, not hidden / heads = 16
# DeepSeek-V3's latent attention with a query latent and without (q_proj), every width its
# own (rotary != nope)
DEEPSEEK_V3 = ["model.family=deepseek_v3", "model.num_kv_heads=4", "model.kv_lora_rank=24",
               "model.v_head_dim=20"]
SHAPES = {
    "llama3": ["model.family=llama", "model.rope_scaling=llama3", "model.rope_theta=500000",
               "model.rope_scaling_factor=8", "model.rope_original_max_positions=60",
               "model.rope_low_freq_factor=1.5", "model.rope_high_freq_factor=6"],
    "qwen3": ["model.family=qwen3", "model.head_dim=24", "model.rope_theta=1000000",
              "model.norm_eps=1e-6"],
    # Qwen3-MoE: fine-grained experts (inner 40, not the dense layers' 176), the mixture every
    # second layer of 3 (layers 0 and 2 dense), top-3 of 6 renormalised, GQA, head_dim 24
    "qwen3_moe": ["model.family=qwen3", "model.head_dim=24", "model.rope_theta=1000000",
                  "model.norm_eps=1e-6", "model.num_layers=3", "model.num_kv_heads=2",
                  "model.num_experts=6", "model.experts_per_token=3",
                  "model.moe_ffn_hidden_size=40", "model.moe_layer_interval=2",
                  "model.moe_norm_topk_prob=true"],
    # and the router's plain softmax weights (norm_topk_prob false), the mixture every layer
    "qwen3_moe_softmax": ["model.family=qwen3", "model.head_dim=24", "model.num_experts=6",
                          "model.experts_per_token=2", "model.moe_ffn_hidden_size=40",
                          "model.moe_norm_topk_prob=false"],
    "deepseek_v3": [*DEEPSEEK_V3, "model.q_lora_rank=40", "model.qk_nope_head_dim=12",
                    "model.qk_rope_head_dim=8"],
    "deepseek_v3_q_proj": [*DEEPSEEK_V3, "model.q_lora_rank=0", "model.qk_nope_head_dim=6",
                           "model.qk_rope_head_dim=10"],
}
# DeepSeek-V3's experts: layer 0 dense, then 4 groups of 2 experts (inner 40), each token's
# top-3 among its best 2 groups (so the groups restrict the choice), the weights renormalised
# and scaled, 2 shared experts (one SwiGLU of 2 x 40); an odd vocabulary (the padded rows cut
# on export)
SHAPES["deepseek_v3_moe"] = [*SHAPES["deepseek_v3"], "model.num_layers=3", "model.num_experts=8",
                             "model.experts_per_token=3", "model.moe_ffn_hidden_size=40",
                             "model.moe_router=sigmoid", "model.moe_groups=4",
                             "model.moe_topk_groups=2", "model.num_shared_experts=2",
                             "model.moe_first_dense_layers=1",
                             "model.moe_routed_scaling_factor=2.5", "model.moe_aux_loss_coeff=0"]
# trained: the bias balancing on (it changes the choices of later steps, so every rank must
# hold the bias one process does) and the balance loss and z-loss
SHAPES["deepseek_v3_moe_bias"] = [*SHAPES["deepseek_v3_moe"], "model.moe_bias_update_rate=0.01",
                                  "model.moe_aux_loss_coeff=0.01", "model.moe_z_loss_coeff=0.001"]
SHAPES["qwen3_tied"] = [*SHAPES["qwen3"], "model.tie_embeddings=true"]  # as Qwen3-0.6B
# trained: the balance loss and z-loss on, so that their gradients are compared too
SHAPES["qwen3_moe_losses"] = [*SHAPES["qwen3_moe"], "model.moe_aux_loss_coeff=0.01",
                              "model.moe_z_loss_coeff=0.001"]
# and with 8 experts (top-3 renormalised), so that 4 expert ranks hold 2 each
SHAPES["qwen3_moe8_losses"] = [*SHAPES["qwen3_moe_losses"], "model.num_experts=8"]
# shapes whose import and export the quick test leaves to their base: the same classes and
# weight names, with another expert count or the bias moved in training
TRAINED_ONLY = ("deepseek_v3_moe_bias", "qwen3_moe8_losses")
HF_CLASSES = {"llama3": transformers.LlamaForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
              "qwen3_tied": transformers.Qwen3ForCausalLM,
              "qwen3_moe": transformers.Qwen3MoeForCausalLM,
              "qwen3_moe_softmax": transformers.Qwen3MoeForCausalLM,
              "qwen3_moe_losses": transformers.Qwen3MoeForCausalLM,
              "qwen3_moe8_losses": transformers.Qwen3MoeForCausalLM,
              "deepseek_v3": transformers.DeepseekV3ForCausalLM,
              "deepseek_v3_q_proj": transformers.DeepseekV3ForCausalLM,
              "deepseek_v3_moe": transformers.DeepseekV3ForCausalLM,
              "deepseek_v3_moe_bias": transformers.DeepseekV3ForCausalLM}
# qwen3: not 64 / 4; deepseek_v3: the rotary width
HEAD_DIMS = {"llama3": 16, "deepseek_v3": 8, "deepseek_v3_q_proj": 10, "deepseek_v3_moe": 8,
             "deepseek_v3_moe_bias": 8}


def model_cfg(shape: str, *more: str):
    return load_config(None, ["model.preset=tiny", f"model.vocab_size={VOCAB}",
                              "model.tie_embeddings=false", *SHAPES[shape], *more]).model


def random_hf(shape: str, path: Path):
    """A randomly initialised transformers model of the shape, saved to `path`; its norms
    (Qwen3's q/k norms, DeepSeek-V3's latent norms too) away from 1, so a dropped or swapped
    norm shows."""
    torch.manual_seed(5)
    hf = HF_CLASSES[shape](to_hf_config(model_cfg(shape), bos_token_id=1, eos_token_id=2,
                                        attn_implementation="eager"))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        for name, b in hf.named_buffers():  # DeepSeek-V3's expert bias: it steers the choice
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.3, 0.3)
    hf.save_pretrained(path)
    return hf.eval()


def cli(*args) -> None:
    pretrain_main([str(a) for a in args])


def _assert_equals_transformers(weights, hf, ids: torch.Tensor, *, prompt: int,
                                new_tokens: int) -> torch.Tensor:
    """Our model built from `weights` (a `load_weights` result) against `hf`, transformers'
    model of the same weights: fp32 logits of `ids` within a few ulps of the largest logit (the
    same operations in another order), and greedy continuations of the first `prompt` tokens of
    each row identical. Returns transformers' logits of `ids`."""
    ours = LlamaModel(weights.model)
    ours.load_state_dict(from_hf_state_dict(dict(weights.state.items()), weights.model))
    ours.eval()
    with torch.no_grad():
        expected, got = hf(ids).logits, ours(ids)
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-5
    theirs = hf.generate(ids[:, :prompt], max_new_tokens=new_tokens, do_sample=False,
                         min_new_tokens=new_tokens, pad_token_id=0)
    assert torch.equal(ours.generate(ids[:, :prompt], max_new_tokens=new_tokens), theirs)
    return expected


@pytest.mark.parametrize("shape", [s for s in SHAPES if s not in TRAINED_ONLY])
def test_imported_family_model_is_transformers_and_exports_back(shape, tmp_path, capsys):
    """transformers' model -> import-hf -> our model: the same fp32 logits and greedy tokens
    (and the `--set` options import-hf prints make a run the weights fit, Llama 3's scaling
    factors included); -> export-hf: the same tensors and a config.json transformers reads as
    the same model."""
    hf = random_hf(shape, tmp_path / "src")
    cli("import-hf", tmp_path / "src", "--output", tmp_path / "init")
    weights = load_weights(tmp_path / "init")
    hint = [o.strip() for o in capsys.readouterr().out.split(" --set ")[1:]
            if not o.startswith("model.init_from=")]
    check_same_architecture(weights.model, load_config(None, hint).model, source="import-hf")
    assert weights.model.family == model_cfg(shape).family
    assert weights.model.head_dim == HEAD_DIMS.get(shape, 24)
    assert weights.model.tie_embeddings == (shape == "qwen3_tied")
    for name in family_of(model_cfg(shape)).architecture_fields:  # config.json both ways
        assert getattr(weights.model, name) == getattr(model_cfg(shape), name), name
    assert weights.model.rope_scaling == model_cfg(shape).rope_scaling
    ids = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))
    expected = _assert_equals_transformers(weights, hf, ids, prompt=9, new_tokens=12)

    tokenizer = _tokenizer(tmp_path)
    cli("export-hf", tmp_path / "init", "--output", tmp_path / "back", "--dtype", "fp32",
        "--tokenizer", tokenizer)
    original, back = (load_file(str(p / "model.safetensors"))
                      for p in (tmp_path / "src", tmp_path / "back"))
    assert back.keys() == original.keys()
    for name, tensor in back.items():
        assert torch.equal(tensor, original[name]), name
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == [HF_CLASSES[shape].__name__]
    again = HF_CLASSES[shape].from_pretrained(tmp_path / "back",
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, expected)


def _tokenizer(tmp_path: Path) -> Path:
    from pretrain.data import train_tokenizer
    from conftest import TINY_CORPUS_FILES

    return train_tokenizer(TINY_CORPUS_FILES, model_prefix=tmp_path / "sp",
                           vocab_size=VOCAB).path


def test_weights_and_run_agree_on_the_rotary_scaling_settings():
    """Llama 3 weights of one scaling factor (or band) do not fit a run of another: one error
    naming the field; the factors of a scaling neither uses are not compared."""
    weights = model_cfg("llama3")
    check_same_architecture(weights, model_cfg("llama3"), source="w")
    for field, value in [("rope_scaling_factor", 32), ("rope_high_freq_factor", 4),
                         ("rope_original_max_positions", 8192)]:
        with pytest.raises(CheckpointError, match=rf"model\.{field}: run {value}"):
            check_same_architecture(weights, model_cfg("llama3", f"model.{field}={value}"),
                                    source="w")
    plain = load_config(None, ["model.preset=tiny"]).model
    check_same_architecture(plain, load_config(None, ["model.preset=tiny",
                                                      "model.rope_scaling_factor=32"]).model,
                            source="w")


def test_llama3_frequencies_are_transformers():
    """`inverse_frequencies` under rope_scaling llama3 is transformers' llama3 rope type, bit
    for bit, and differs from the unscaled frequencies in both the divided and blended bands."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = model_cfg("llama3")
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](to_hf_config(cfg), torch.device("cpu"))
    ours = inverse_frequencies(cfg)
    assert torch.equal(ours, theirs)
    plain = inverse_frequencies(load_config(None, ["model.preset=tiny",
                                                   "model.rope_theta=500000"]).model)
    ratio = plain / ours
    assert (ratio == 1).any() and (ratio == 8).any() and ((ratio > 1) & (ratio < 8)).any()


@pytest.mark.parametrize("family, more", [*((f, ()) for f in FAMILIES),
                                          ("qwen3", SHAPES["qwen3_moe"]),
                                          ("deepseek_v3", SHAPES["deepseek_v3_moe"])],
                         ids=[*FAMILIES, "qwen3_moe", "deepseek_v3_moe"])
def test_parameter_table_is_the_built_model(family, more):
    """Every parameter a family's model holds is in its table with the shape the table gives
    (a q_norm is head_dim long, not a hidden_size norm; a fine-grained expert's projections
    its own inner size, the dense layers' theirs), the seeded init fills it (norms 1), and the
    counts from the table are the model's."""
    shape = SHAPES["deepseek_v3"] if family == "deepseek_v3" else ["model.head_dim=24"]
    cfg = load_config(None, ["model.preset=tiny", f"model.family={family}", *shape,
                             f"model.vocab_size={VOCAB}", *more]).model
    model = build_model(cfg, seed=3)
    attention = model.model.layers[0].self_attn
    if family == "deepseek_v3":  # 4 heads of 12 + 8 query/key features
        assert attention.q_b_proj.weight.shape == (4 * 20, 40)
    else:
        assert attention.q_proj.weight.shape == (4 * 24, 64)  # 4 heads of 24
    params = dict(model.named_parameters())
    buffers = dict(canonical_buffers(model, cfg))  # DeepSeek-V3's expert bias: not trained
    assert set(params) | set(buffers) == expected_hf_keys(cfg)
    assert len(buffers) == (2 if cfg.num_experts and family == "deepseek_v3" else 0)
    assert all(torch.equal(b, torch.zeros(cfg.num_experts)) for b in buffers.values())
    for name, p in params.items():
        shape = full_parameter_shape(name, cfg)
        assert tuple(p.shape) == (cfg.padded_vocab_size(1), cfg.hidden_size) if "embed" in name \
            else shape, name
        init = shard_init(name, cfg, seed=3, tp_rank=0, tp_size=1)
        assert torch.equal(init, p.detach()), name
        if family_of(cfg).parameter(name).init == "ones":
            assert bool((init == 1).all()), name
    assert model.num_parameters() == num_parameters(cfg)


@pytest.mark.parametrize("shape", SHAPES)
def test_a_layers_flops_are_the_planners(shape):
    """The FLOPs torch counts in one decoder layer's forward over seq_length tokens (attention
    by the math kernel, so its two matmuls are counted) are seq_length x the planner's per-token
    count: the table's matrices and the family's attention widths (DeepSeek-V3's q.k over
    nope + rope features, its values v_head_dim wide)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from pretrain.arithmetic import layer_forward_flops_per_token

    cfg = model_cfg(shape)
    model = build_model(cfg, seed=1)
    T = cfg.seq_length
    cos, sin = model.model.rotary_emb(T, torch.float32)
    x = torch.randn(1, T, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter, torch.no_grad(), \
            sdpa_kernel([SDPBackend.MATH]):
        model.model.layers[0](x, cos, sin)
    counted, planned = counter.get_total_flops(), T * layer_forward_flops_per_token(cfg)
    if family_of(cfg).moe_layer(cfg, 0):  # + the combine's k weights x outputs (2 k a token)
        assert 0 <= counted - planned <= 2 * cfg.experts_per_token * T, (counted, planned)
    else:
        assert counted == planned


@pytest.mark.parametrize("setting, message", [
    ("model.num_kv_heads=2", "model.num_kv_heads=2: must equal model.num_heads=4"),
    ("model.head_dim=16", "model.head_dim=16: must be 0 or model.qk_rope_head_dim=8"),
    ("model.qk_rope_head_dim=7", "model.qk_rope_head_dim=7: must be even"),
    ("model.kv_lora_rank=0", "model.kv_lora_rank=0: must be a positive integer"),
    ("model.q_lora_rank=-1", "model.q_lora_rank=-1: must be 0 (queries projected directly)"),
    ("model.rope_scaling=llama3", "model.rope_scaling='llama3': deepseek_v3 supports only none"),
    ("model.parametrization=mup", "model.parametrization='mup': deepseek_v3 supports only"),
    ("model.num_experts=4", "model.moe_router='softmax': deepseek_v3's experts are routed by "
                            "sigmoid scores"),
    ("model.num_experts=6 model.moe_router=sigmoid model.moe_groups=4",
     "model.moe_groups=4: must divide model.num_experts=6 into groups of at least 2"),
    ("model.num_experts=8 model.moe_router=sigmoid model.moe_groups=2 model.moe_topk_groups=3",
     "model.moe_topk_groups=3: must be between 1 and model.moe_groups=2"),
    ("model.num_experts=8 model.moe_router=sigmoid model.moe_groups=4 model.experts_per_token=5",
     "model.experts_per_token=5: exceeds the 2 experts of model.moe_topk_groups=1 groups"),
    ("model.moe_router=topk", "model.moe_router='topk': choose one of softmax, sigmoid"),
    ("model.moe_bias_update_rate=-1", "model.moe_bias_update_rate=-1"),
    ("model.moe_bias_update_rate=0.1", "model.moe_bias_update_rate=0.1: belongs to the sigmoid"),
    ("model.family=llama model.num_shared_experts=1",
     "model.num_shared_experts=1: is DeepSeek-V3's (model.family=deepseek_v3)"),
    ("model.family=qwen3 model.moe_router=sigmoid",
     "model.moe_router='sigmoid': model.family=qwen3"),
])
def test_deepseek_v3_refuses_what_its_attention_cannot_be(setting, message):
    """Each setting latent attention cannot honour is one `ConfigError` naming it."""
    from pretrain.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        load_config(None, ["model.preset=tiny", *SHAPES["deepseek_v3"], *setting.split()])
    assert message in str(error.value)
    assert "\n" not in str(error.value)


# ---- trained on layouts: each family imported, trained, exported ---------------------------------

LAYOUT_STEPS = 4
ZERO1 = "deepspeed=ds_configs/zero1.json"
ZERO2 = "deepspeed=ds_configs/zero2.json"
# 4 data ranks of the tiny config's micro-batch of 2; a layout with it is compared against one
# process of the same global batch (4 micro-batches of 2 a step)
BATCH8 = "train.global_batch_size=8"
# the expert grid's rows: 10 steps, against one process of as many
GRID_STEPS = "train.steps=10"
# (shape, layout): (ranks, overrides). Each family trains at tp 2 and on every layout whose code
# path it changes (docs/verified.md says why these): llama3 changes the rotary frequencies only,
# which every layer takes from one table of global positions, so tp 2 with sequence parallelism,
# context parallelism (a chunk's positions from its offset) and fsdp2's pipeline stages (a
# model built on the meta device, its tables made again per stage); qwen3's per-head q/k norms
# are replicated gains inside the tensor-parallel attention, their gradients partial per rank:
# reduced over the tensor group (tp 2), under sequence parallelism, gathered by ZeRO-3 and
# fsdp2, offloaded, named in a pipeline's stages, and applied before context parallelism's
# all-to-all; and tied, as Qwen3-0.6B is, at ZeRO-2 x tp 2 (the embedding is the
# vocab-parallel head).
FAMILY_LAYOUTS = {
    ("llama3", "zero3_tp2_sp_dp2"): (4, ["deepspeed=ds_configs/zero3.json", "parallel.tensor=2",
                                         "parallel.sequence_parallel=true"]),
    ("llama3", "cp2"): (2, [ZERO1, "parallel.context=2"]),
    ("llama3", "fsdp2_pp2_tp2"): (4, ["train.engine=fsdp2", "deepspeed=ds_configs/zero3.json",
                                      "parallel.pipeline=2", "parallel.tensor=2"]),
    ("qwen3", "fsdp2_tp2_sp_dp2"): (4, ["train.engine=fsdp2", "deepspeed=ds_configs/zero3.json",
                                        "parallel.tensor=2", "parallel.sequence_parallel=true"]),
    ("qwen3", "zero3_tp2_dp2"): (4, ["deepspeed=ds_configs/zero3.json", "parallel.tensor=2"]),
    ("qwen3", "pp2_tp2"): (4, [ZERO1, "parallel.pipeline=2", "parallel.tensor=2"]),
    ("qwen3", "cp2_zero3_offload"): (2, ["deepspeed=ds_configs/zero3_offload_cpu.json",
                                         "parallel.context=2"]),
    ("qwen3_tied", "zero2_tp2_dp2"): (4, ["deepspeed=ds_configs/zero2.json", "parallel.tensor=2"]),
    # Qwen3-MoE (a mixture between two dense layers): the fine-grained experts sliced over the
    # tensor ranks (each holds 20 of every expert's 40 inner features), or whole on them (3
    # each); two pipeline stages cut by parameters, each building its layers' own MLPs
    ("qwen3_moe_losses", "tp2_sp"): (2, ["parallel.tensor=2", "parallel.sequence_parallel=true"]),
    ("qwen3_moe_losses", "tp2_expert2"): (2, ["parallel.tensor=2", "parallel.expert=2"]),
    ("qwen3_moe_losses", "pp2"): (2, ["parallel.pipeline=2"]),
    # the expert grid: expert ranks from the data ranks (3 whole experts each; or each expert
    # split over the tensor pair too), the experts' gradients over the ranks holding them
    ("qwen3_moe_losses", "expert2_dp2"): (2, [ZERO1, "parallel.expert=2", GRID_STEPS]),
    ("qwen3_moe_losses", "expert2_tp2_etp2_dp2"): (4, [ZERO1, "parallel.tensor=2",
                                                     "parallel.expert=2",
                                                     "parallel.expert_tensor=2", GRID_STEPS]),
    # expert 4 from 4 data ranks (2 of the 8 experts each), ZeRO-2: one micro-batch of 2 a
    # rank, so against one process of the same micro-batches (global batch 8: the auxiliary
    # losses are each micro-batch's)
    ("qwen3_moe8_losses", "expert4_dp4"): (4, [ZERO2, "parallel.expert=4", BATCH8,
                                               GRID_STEPS]),
    # DeepSeek-V3: the heads over two tensor ranks, the latents' projections and norms
    # replicated with their gradients summed over the pair (with sequence parallelism; under
    # ZeRO-3, which gathers them; fsdp2); a pipeline's stages
    ("deepseek_v3", "tp2_sp"): (2, ["parallel.tensor=2", "parallel.sequence_parallel=true"]),
    ("deepseek_v3", "zero3_tp2_dp2"): (4, ["deepspeed=ds_configs/zero3.json", "parallel.tensor=2"]),
    ("deepseek_v3", "fsdp2_tp2_sp_dp2"): (4, ["train.engine=fsdp2", "deepspeed=ds_configs/zero3.json",
                                              "parallel.tensor=2", "parallel.sequence_parallel=true"]),
    ("deepseek_v3", "pp2"): (2, ["parallel.pipeline=2"]),
    # DeepSeek-V3's experts (layer 0 dense): the routed experts sliced over the tensor ranks
    # with the shared one (sequence parallelism; under ZeRO-3, whose gathers skip the bias
    # buffer), or whole on them (4 each); two data ranks; two pipeline stages (each stage's
    # layers' bias, named by stage); the bias moved from the loads of the whole batch, the
    # same on every rank (fsdp2's experts, at expert 1 or = tensor, with this family at dp 2:
    # tests/test_fsdp2_experts.py)
    ("deepseek_v3_moe_bias", "tp2_sp"): (2, ["parallel.tensor=2",
                                             "parallel.sequence_parallel=true"]),
    ("deepseek_v3_moe_bias", "tp2_expert2"): (2, ["parallel.tensor=2", "parallel.expert=2"]),
    ("deepseek_v3_moe_bias", "dp2"): (2, [ZERO1]),
    ("deepseek_v3_moe_bias", "pp2"): (2, ["parallel.pipeline=2"]),
    ("deepseek_v3_moe_bias", "zero3_tp2_dp2"): (4, ["deepspeed=ds_configs/zero3.json",
                                                    "parallel.tensor=2"]),
    # the expert grid: experts from the data ranks (4 each), or split over the tensor pair
    # too; the bias moved from every rank's loads, the same everywhere
    ("deepseek_v3_moe_bias", "expert2_dp2"): (2, [ZERO1, "parallel.expert=2", GRID_STEPS]),
    ("deepseek_v3_moe_bias", "expert2_tp2_etp2_dp2"): (4, [ZERO1, "parallel.tensor=2",
                                                         "parallel.expert=2",
                                                         "parallel.expert_tensor=2",
                                                         GRID_STEPS]),
    # expert 4 from 4 data ranks (2 experts each, the 4 groups one a rank), ZeRO-1, against
    # one process of global batch 8; the bias moved from the loads of all 4 ranks
    ("deepseek_v3_moe_bias", "expert4_dp4"): (4, [ZERO1, "parallel.expert=4", BATCH8,
                                                  GRID_STEPS]),
}


@pytest.fixture(scope="module")
def family_runs(tiny_data, tmp_path_factory):
    """Per shape, made once: a random transformers model of its odd vocabulary (GQA),
    imported (final/ format); and per shape and `train.*` overrides (batch, steps), one
    process training it: (imported, single run)."""
    imports: dict[str, Path] = {}
    made: dict[tuple[str, tuple[str, ...]], tuple[Path, object]] = {}

    def get(shape: str, *train: str):
        if shape not in imports:
            root = tmp_path_factory.mktemp(f"{shape}_import")
            random_hf(shape, root / "hf")
            cli("import-hf", root / "hf", "--output", root / "init")
            imports[shape] = root / "init"
        if (shape, train) not in made:
            root = tmp_path_factory.mktemp(f"{shape}_single")
            made[shape, train] = imports[shape], _family_run(
                root, tiny_data, shape, imports[shape], nprocs=1, overrides=list(train),
                name="single")
        return made[shape, train]
    return get


def _family_run(tmp_path, tiny_data, shape: str, imported: Path, *, nprocs: int,
                overrides: list[str], name: str):
    from pretrain.testing.runs import train

    return train(tmp_path, tiny_data, nprocs=nprocs, name=name, overrides=[
        f"model.vocab_size={VOCAB}", "model.tie_embeddings=false", *SHAPES[shape],
        f"model.init_from={imported}", f"train.steps={LAYOUT_STEPS}",
        "checkpoint.save_final=true", *overrides])


@pytest.mark.slow  # `pretrain train` on 2 or 4 forked ranks
@pytest.mark.parametrize("shape, layout", FAMILY_LAYOUTS)
def test_imported_family_trains_on_a_layout_like_one_process_and_exports_as_transformers(
        shape, layout, tiny_data, tmp_path, family_runs):
    """A random transformers model of the family, imported: its losses and gradient norms on
    the layout are one process's (only the reduction order differs: 1e-5); its final weights,
    exported, are transformers' class computing our fp32 logits and greedy tokens."""
    from pretrain.testing.runs import rel_diff

    nprocs, overrides = FAMILY_LAYOUTS[shape, layout]
    # the reference of the same micro-batches and steps: the layout's train.* on one process
    imported, single = family_runs(shape, *(o for o in overrides if o.startswith("train.")))
    run = _family_run(tmp_path, tiny_data, shape, imported, nprocs=nprocs, overrides=overrides,
                      name=layout)
    head = run.records[0]
    asked = {k: int(v) for o in overrides if o.startswith("parallel.") and "=" in o
             for k, v in [o.removeprefix("parallel.").split("=")]
             if k in ("tensor", "pipeline", "context")}
    assert {k: head[k] for k in asked} == asked, head
    assert head["tensor"] * head["pipeline"] * head["context"] * head["data_parallel"] == nprocs
    steps = next((int(o.split("=")[1]) for o in overrides if o.startswith("train.steps=")),
                 LAYOUT_STEPS)
    assert len(run.losses) == steps
    assert rel_diff(run.losses, single.losses) < 1e-5, (run.losses, single.losses)
    norms = [[r["grad_norm"] for r in x.records if r["kind"] == "train"] for x in (run, single)]
    assert rel_diff(*norms) < 1e-5, norms
    if "moe" in shape:  # the router's statistics: each mixture layer's experts
        cfg = model_cfg(shape)
        moe = [r for r in run.records if r["kind"] == "train"][-1]
        assert [len(row) for row in moe["moe_expert_tokens"]] == \
            [cfg.num_experts] * len(family_of(cfg).moe_layers(cfg))
        for a, b in zip(*[[r["moe_expert_tokens"] for r in x.records if r["kind"] == "train"]
                          for x in (run, single)]):
            assert a == b
        expert = next((int(o.split("=")[1]) for o in overrides
                       if o.startswith("parallel.expert=")), 1)
        if expert > 1:  # the layout's experts a rank: the first rank's last step holds its own
            states = torch.load(run.run_dir / "checkpoints" / f"step{steps}" /
                                "mp_rank_00_model_states.pt", map_location="cpu",
                                weights_only=False)["module"]
            layer = family_of(cfg).moe_layers(cfg)[0]
            held = {n.split(".")[5] for n in states
                    if n.startswith(f"model.layers.{layer}.mlp.experts.")}
            assert len(held) == cfg.num_experts // expert, (expert, sorted(held))
    if "bias" in shape:  # the expert bias, moved, is the one process's in the final weights
        bias = "model.layers.1.mlp.gate.e_score_correction_bias"
        start, ours, theirs = (load_weights(p).state[bias] for p in
                               (imported, run.run_dir / "final", single.run_dir / "final"))
        assert torch.equal(ours, theirs)
        reported = [r for r in run.records if r["kind"] == "train"][-1]["moe_expert_bias"]
        assert torch.equal(torch.tensor(reported[0], dtype=torch.float32), ours)  # metrics.jsonl
        moved = ((ours - start) / 0.01).round()
        assert moved.abs().max() > 0 and torch.allclose(ours - start, moved * 0.01, atol=1e-6)

    final = run.run_dir / "final"
    cli("export-hf", final, "--output", tmp_path / "hf", "--dtype", "fp32")
    hf = HF_CLASSES[shape].from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    wanted = to_hf_config(model_cfg(shape))  # the scaling, its factors, vocabulary, tying
    assert (hf.config.rope_scaling, hf.config.vocab_size, hf.config.tie_word_embeddings) == \
        (wanted.rope_scaling, VOCAB, shape == "qwen3_tied")
    weights = load_weights(final)
    ids = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(1))
    _assert_equals_transformers(weights, hf, ids, prompt=5, new_tokens=8)


@pytest.mark.slow  # `pretrain train` on 2 forked ranks, twice
def test_deepseek_v3_expert_bias_is_saved_and_resumed(tiny_data, tmp_path, family_runs):
    """The balancing bias is in the step checkpoints: a run of the bias-balanced DeepSeek-V3 on
    two data ranks saved at step 2, resumed on its layout, takes steps 3 and 4 as the
    uninterrupted single process does (the bias changes the experts chosen, so a bias lost or
    reset on resume changes the losses) and ends on its bias; resumed on tensor 2 = expert 2
    (resharded, the bias read from the module states) it does the same."""
    from pretrain.testing.runs import rel_diff

    shape = "deepseek_v3_moe_bias"
    imported, single = family_runs(shape)
    saved = _family_run(tmp_path, tiny_data, shape, imported, nprocs=2, name="saved",
                        overrides=[ZERO1, "checkpoint.save_interval=2", "checkpoint.keep_last=1",
                                   "checkpoint.keep_every=2"])
    step = saved.run_dir / "checkpoints" / "step2"
    shutil.copytree(step, tmp_path / "resumed" / "checkpoints" / step.name)
    resumed = _family_run(tmp_path, tiny_data, shape, imported, nprocs=2, name="resumed",
                          overrides=[ZERO1])
    assert rel_diff(resumed.losses, single.losses[2:]) < 1e-5, (resumed.losses, single.losses)
    bias = "model.layers.2.mlp.gate.e_score_correction_bias"
    final, start = (load_weights(p).state[bias] for p in (resumed.run_dir / "final", imported))
    assert torch.equal(final, load_weights(single.run_dir / "final").state[bias])
    assert not torch.equal(final, start)  # moved by the balancing
    # on another layout (tensor 2 = expert 2): the resharding reader takes the bias from the
    # module states, bitwise, and the run goes on as the uninterrupted one
    shutil.copytree(step, tmp_path / "tp2" / "checkpoints" / step.name)
    onto_tp2 = _family_run(tmp_path, tiny_data, shape, imported, nprocs=2, name="tp2",
                           overrides=[ZERO1, "parallel.tensor=2", "parallel.expert=2"])
    assert "tp1 pp1 dp2 ZeRO-1 -> tp2 pp1 ep2 dp1 ZeRO-1" in onto_tp2.stdout
    assert rel_diff(onto_tp2.losses, single.losses[2:]) < 1e-5, (onto_tp2.losses, single.losses)
    assert torch.equal(load_weights(onto_tp2.run_dir / "final").state[bias], final)


def test_a_mup_qwen3_exports_its_attention_scale_into_the_q_norm():
    """muP's attention scale folds into the last parameter that scales the queries: Qwen3's q
    norm gain (q_proj's scale is normalised away), so transformers' Qwen3 gives our logits."""
    from pretrain.model import mup
    from pretrain.model.hf import to_hf_state_dict

    cfg = load_config(None, ["model.preset=tiny", "model.family=qwen3", "model.head_dim=24",
                             "model.parametrization=mup", "model.mup_base_width=32",
                             "model.mup_base_head_dim=8"]).model
    assert mup.softmax_scale(cfg) is not None  # a scale that differs from 1/sqrt(head_dim)
    model = build_model(cfg, seed=2).eval()
    state = to_hf_state_dict(dict(model.state_dict()), cfg)
    hf = transformers.Qwen3ForCausalLM(to_hf_config(cfg, attn_implementation="eager")).eval()
    hf.load_state_dict({name: mup.fold_for_export(name, t, cfg) for name, t in state.items()})
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert ((ours - theirs).abs().max() / ours.abs().max()).item() < 1e-5


# ---- Qwen3-MoE: counts by layer ---------------------------------------------------------------

def test_qwen3_moe_counts_sum_its_layers_dense_and_mixture():
    """The planner's counts sum each layer as the family makes it: the published Qwen3-MoE
    shapes' totals and active parameters (Qwen's model cards: 30.5B / 3.3B, 235B / 22B); the
    tiny interval-2 model's layers counted by the table as built, a pipeline stage's layers
    knowing their index (the mixture layer weighs more than a dense one)."""
    from pretrain.arithmetic import (layer_parameters, num_active_parameters, stage_items,
                                     stage_parameters)
    from pretrain.resolve.layout import Layout

    for preset, total, active in (("qwen3_30b_a3b", 30.5e9, 3.3e9),
                                  ("qwen3_235b_a22b", 235e9, 22e9)):
        m = load_config(None, [f"model.preset={preset}"]).model
        assert abs(num_parameters(m) / total - 1) < 0.01, preset
        assert abs(num_active_parameters(m) / active - 1) < 0.02, preset

    cfg = model_cfg("qwen3_moe", "model.num_layers=4")  # layers 1 and 3 the mixtures
    model = build_model(cfg, seed=1)
    built = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    assert built == [sum(layer_parameters(cfg, i)) for i in range(4)]
    assert built[0] == built[2] < built[1] == built[3]
    expert = 3 * 64 * 40  # a token uses 3 of the 6 experts of layers 1 and 3, and their router
    assert num_active_parameters(cfg, include_embeddings=False) == \
        sum(built) - 2 * (6 - 3) * expert + cfg.hidden_size
    layout = Layout(pipeline=2, partition="uniform")  # [embed, 0, 1, 2], [3, norm, head]
    stages = stage_items(cfg, layout)
    embed = cfg.padded_vocab_size(1) * cfg.hidden_size
    assert [stage_parameters(cfg, layout, items) for items in stages] == \
        [embed + sum(built[:3]), built[3] + cfg.hidden_size + embed]


# ---- DeepSeek-V3: the compressed cache; heads over tensor ranks ---------------------------------

@pytest.mark.parametrize("shape", ["deepseek_v3", "deepseek_v3_q_proj"])
def test_deepseek_v3_decodes_from_its_compressed_cache_as_without_one(shape):
    """The cache holds each token's latent (kv_lora_rank) and rotary key (qk_rope_head_dim),
    not per-head keys and values; the logits of a prompt then of one token after another from
    it are those of the whole sequence run at once (a wrong position, a stale latent or a key
    not shared shows)."""
    from pretrain.model.llama import LayerCache

    cfg = model_cfg(shape)
    model = build_model(cfg, seed=4).eval()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    cache = [LayerCache() for _ in model.model.layers]
    with torch.no_grad():
        whole = model(ids)
        steps = [model.vocab_logits(model.hidden_states(ids[:, :8], cache))]
        for t in range(8, 12):
            steps.append(model.vocab_logits(model.hidden_states(ids[:, t:t + 1], cache)))
    cached = torch.cat(steps, dim=1)[..., :VOCAB]
    assert ((cached - whole).abs().max() / whole.abs().max()).item() < 1e-5
    assert cache[0].keys.shape == (2, 1, 12, cfg.qk_rope_head_dim)
    assert cache[0].values.shape == (2, 1, 12, cfg.kv_lora_rank)
    per_token = sum(c.keys.shape[-1] + c.values.shape[-1] for c in cache)
    assert per_token == kv_cache_elements_per_token(cfg)  # the planner's count


def test_deepseek_v3_keeps_documents_apart_under_document_masking():
    """With document ids, each document's logits are those of the document run alone (its
    positions from 0, no attention to the one before): latent attention's keys and values of
    other widths go through the masked kernel."""
    cfg = model_cfg("deepseek_v3")
    model = build_model(cfg, seed=4).eval()
    tokens = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(5))
    document_ids = torch.tensor([[0] * 10 + [1] * 14])
    with torch.no_grad():
        masked = model(tokens, document_ids=document_ids)
        for span in (slice(0, 10), slice(10, 24)):
            alone = model(tokens[:, span])
            scale = alone.abs().max()
            assert ((masked[:, span] - alone).abs().max() / scale).item() < 1e-5, span
        unmasked = model(tokens)
    assert ((unmasked[:, 10:] - masked[:, 10:]).abs().max() / scale).item() > 1e-3
