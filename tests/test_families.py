"""Model families (`pretrain.families`): each family's tiny model of an unusual shape is
`transformers`' own class through `import-hf`, `export-hf` and greedy decoding; its parameter
table agrees with the model it builds; Llama 3's rotary scaling is transformers' `llama3`;
DeepSeek-V3's latent attention decodes from its compressed cache as without one, and trains
with its heads over two tensor ranks as one process does."""
from __future__ import annotations

import json
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
from pretrain.model import LlamaModel, build_model
from pretrain.model.hf import expected_hf_keys, from_hf_state_dict, to_hf_config
from pretrain.model.layers import inverse_frequencies
from pretrain.model.llama import full_parameter_shape, shard_init

VOCAB = 515  # odd: padded rows under every tensor-parallel size

# per family, a tiny model of a shape that differs from the plain Llama where the family can:
# GQA and untied everywhere; Llama 3's scaling with a factor, and an original context and
# band factors (none the default) that put the tiny head's frequencies in every band: kept,
# blended, divided; Qwen3's head_dim 24, not hidden / heads = 16; DeepSeek-V3's latent
# attention with a query latent and without (q_proj), every width its own (rotary != nope)
DEEPSEEK_V3 = ["model.family=deepseek_v3", "model.num_kv_heads=4", "model.kv_lora_rank=24",
               "model.v_head_dim=20"]
SHAPES = {
    "llama3": ["model.family=llama", "model.rope_scaling=llama3", "model.rope_theta=500000",
               "model.rope_scaling_factor=8", "model.rope_original_max_positions=256",
               "model.rope_low_freq_factor=2", "model.rope_high_freq_factor=8"],
    "qwen3": ["model.family=qwen3", "model.head_dim=24", "model.rope_theta=1000000",
              "model.norm_eps=1e-6"],
    "deepseek_v3": [*DEEPSEEK_V3, "model.q_lora_rank=40", "model.qk_nope_head_dim=12",
                    "model.qk_rope_head_dim=8"],
    "deepseek_v3_q_proj": [*DEEPSEEK_V3, "model.q_lora_rank=0", "model.qk_nope_head_dim=6",
                           "model.qk_rope_head_dim=10"],
}
HF_CLASSES = {"llama3": transformers.LlamaForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
              "deepseek_v3": transformers.DeepseekV3ForCausalLM,
              "deepseek_v3_q_proj": transformers.DeepseekV3ForCausalLM}
HEAD_DIMS = {"llama3": 16, "qwen3": 24,  # qwen3: not 64 / 4
             "deepseek_v3": 8, "deepseek_v3_q_proj": 10}  # deepseek_v3: the rotary width


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


@pytest.mark.parametrize("shape", SHAPES)
def test_imported_family_model_is_transformers_and_exports_back(shape, tmp_path):
    """transformers' model -> import-hf -> our model: the same fp32 logits and greedy tokens;
    -> export-hf: the same tensors and a config.json transformers reads as the same model."""
    hf = random_hf(shape, tmp_path / "src")
    cli("import-hf", tmp_path / "src", "--output", tmp_path / "init")
    weights = load_weights(tmp_path / "init")
    assert weights.model.head_dim == HEAD_DIMS[shape]
    for name in family_of(model_cfg(shape)).architecture_fields:  # config.json both ways
        assert getattr(weights.model, name) == getattr(model_cfg(shape), name), name
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


@pytest.mark.parametrize("family", FAMILIES)
def test_parameter_table_is_the_built_model(family):
    """Every parameter a family's model holds is in its table with the shape the table gives
    (a q_norm is head_dim long, not a hidden_size norm), the seeded init fills it (norms 1),
    and the counts from the table are the model's."""
    shape = SHAPES["deepseek_v3"] if family == "deepseek_v3" else ["model.head_dim=24"]
    cfg = load_config(None, ["model.preset=tiny", f"model.family={family}", *shape,
                             f"model.vocab_size={VOCAB}"]).model
    model = build_model(cfg, seed=3)
    attention = model.model.layers[0].self_attn
    if family == "deepseek_v3":  # 4 heads of 12 + 8 query/key features
        assert attention.q_b_proj.weight.shape == (4 * 20, 40)
    else:
        assert attention.q_proj.weight.shape == (4 * 24, 64)  # 4 heads of 24
    params = dict(model.named_parameters())
    assert set(params) == expected_hf_keys(cfg)
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
    assert counter.get_total_flops() == T * layer_forward_flops_per_token(cfg)


@pytest.mark.parametrize("setting, message", [
    ("model.num_kv_heads=2", "model.num_kv_heads=2: must equal model.num_heads=4"),
    ("model.head_dim=16", "model.head_dim=16: must be 0 or model.qk_rope_head_dim=8"),
    ("model.qk_rope_head_dim=7", "model.qk_rope_head_dim=7: must be even"),
    ("model.kv_lora_rank=0", "model.kv_lora_rank=0: must be a positive integer"),
    ("model.q_lora_rank=-1", "model.q_lora_rank=-1: must be 0 (queries projected directly)"),
    ("model.rope_scaling=llama3", "model.rope_scaling='llama3': deepseek_v3 supports only none"),
    ("model.parametrization=mup", "model.parametrization='mup': deepseek_v3 supports only"),
    ("model.num_experts=4", "model.num_experts=4: a mixture of experts is the llama family's"),
])
def test_deepseek_v3_refuses_what_its_attention_cannot_be(setting, message):
    """Each setting latent attention cannot honour is one `ConfigError` naming it."""
    from pretrain.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        load_config(None, ["model.preset=tiny", *SHAPES["deepseek_v3"], setting])
    assert message in str(error.value)
    assert "\n" not in str(error.value)


# ---- trained on layouts: an imported Qwen3 ------------------------------------------------------

LAYOUT_STEPS = 4
QWEN3_LAYOUTS = {
    # name: (ranks, overrides); each changes how the q/k norms' gradients are formed
    "fsdp2_tp2_sp_dp2": (4, ["train.engine=fsdp2", "deepspeed=ds_configs/zero3.json",
                             "parallel.tensor=2", "parallel.sequence_parallel=true"]),
    "zero3_tp2_dp2": (4, ["deepspeed=ds_configs/zero3.json", "parallel.tensor=2"]),
}


@pytest.fixture(scope="module")
def imported_qwen3(tiny_data, tmp_path_factory) -> Path:
    """A random transformers Qwen3 of the tokenizer's 512 tokens, imported (final/ format)."""
    root = tmp_path_factory.mktemp("qwen3_import")
    torch.manual_seed(5)
    cfg = load_config(None, ["model.preset=tiny", *SHAPES["qwen3"]]).model
    hf = transformers.Qwen3ForCausalLM(to_hf_config(cfg, attn_implementation="eager"))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(root / "hf")
    cli("import-hf", root / "hf", "--output", root / "init")
    return root / "init"


def _qwen3_run(tmp_path, tiny_data, imported, *, nprocs: int, overrides: list[str], name: str):
    from pretrain.testing.runs import train

    return train(tmp_path, tiny_data, nprocs=nprocs, name=name, overrides=[
        *SHAPES["qwen3"], f"model.init_from={imported}", f"train.steps={LAYOUT_STEPS}",
        "checkpoint.save_final=true", *overrides])


@pytest.fixture(scope="module")
def qwen3_single(tiny_data, tmp_path_factory, imported_qwen3):
    return _qwen3_run(tmp_path_factory.mktemp("qwen3_single"), tiny_data, imported_qwen3,
                      nprocs=1, overrides=[], name="single")


@pytest.mark.slow  # `pretrain train` on 4 forked ranks
@pytest.mark.parametrize("layout", QWEN3_LAYOUTS)
def test_imported_qwen3_trains_on_a_layout_like_one_process_and_exports_as_transformers(
        layout, tiny_data, tmp_path, imported_qwen3, qwen3_single):
    """The imported model's losses and gradient norms on the layout are one process's (only
    the reduction order differs: 1e-5); its final weights, exported, are transformers' Qwen3
    computing our logits and greedy tokens."""
    from pretrain.testing.runs import rel_diff

    nprocs, overrides = QWEN3_LAYOUTS[layout]
    run = _qwen3_run(tmp_path, tiny_data, imported_qwen3, nprocs=nprocs, overrides=overrides,
                     name=layout)
    head = run.records[0]
    assert (head["tensor"], head["data_parallel"]) == (2, 2)
    assert rel_diff(run.losses, qwen3_single.losses) < 1e-5, (run.losses, qwen3_single.losses)
    norms = [[r["grad_norm"] for r in x.records if r["kind"] == "train"]
             for x in (run, qwen3_single)]
    assert rel_diff(*norms) < 1e-5, norms

    final = run.run_dir / "final"
    cli("export-hf", final, "--output", tmp_path / "hf", "--dtype", "fp32")
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "hf",
                                                       attn_implementation="eager").eval()
    weights = load_weights(final)
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    _assert_equals_transformers(weights, hf, ids, prompt=5, new_tokens=8)


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


DEEPSEEK_LAYOUTS = {
    # name: (ranks, overrides): the heads over two tensor ranks, the latents' projections and
    # norms replicated with their gradients summed over the pair (with sequence parallelism;
    # under ZeRO-3, which gathers them; fsdp2); the compressed-cache-free stages of a pipeline
    "tp2_sp": (2, ["parallel.tensor=2", "parallel.sequence_parallel=true"]),
    "zero3_tp2_dp2": (4, ["deepspeed=ds_configs/zero3.json", "parallel.tensor=2"]),
    "fsdp2_tp2_sp_dp2": (4, ["train.engine=fsdp2", "deepspeed=ds_configs/zero3.json",
                             "parallel.tensor=2", "parallel.sequence_parallel=true"]),
    "pp2": (2, ["parallel.pipeline=2"]),
}


@pytest.fixture(scope="module")
def imported_deepseek_v3(tiny_data, tmp_path_factory) -> Path:
    """A random transformers DeepSeek-V3 (dense) of the tokenizer's 512 tokens, imported."""
    root = tmp_path_factory.mktemp("deepseek_v3_import")
    torch.manual_seed(5)
    cfg = load_config(None, ["model.preset=tiny", *SHAPES["deepseek_v3"]]).model
    hf = transformers.DeepseekV3ForCausalLM(to_hf_config(cfg, attn_implementation="eager"))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(root / "hf")
    cli("import-hf", root / "hf", "--output", root / "init")
    return root / "init"


def _deepseek_run(tmp_path, tiny_data, imported, *, nprocs: int, overrides: list[str], name: str):
    from pretrain.testing.runs import train

    return train(tmp_path, tiny_data, nprocs=nprocs, name=name, overrides=[
        *SHAPES["deepseek_v3"], f"model.init_from={imported}", f"train.steps={LAYOUT_STEPS}",
        "checkpoint.save_final=true", *overrides])


@pytest.fixture(scope="module")
def deepseek_v3_single(tiny_data, tmp_path_factory, imported_deepseek_v3):
    return _deepseek_run(tmp_path_factory.mktemp("deepseek_v3_single"), tiny_data,
                         imported_deepseek_v3, nprocs=1, overrides=[], name="single")


@pytest.mark.slow  # `pretrain train` on 2 and 4 forked ranks
@pytest.mark.parametrize("layout", DEEPSEEK_LAYOUTS)
def test_imported_deepseek_v3_trains_on_a_layout_like_one_process_and_exports_as_transformers(
        layout, tiny_data, tmp_path, imported_deepseek_v3, deepseek_v3_single):
    """The imported model's losses and gradient norms on the layout are one process's within
    1e-5; its final weights, exported, are transformers' DeepSeek-V3 computing our logits and
    greedy tokens."""
    from pretrain.testing.runs import rel_diff

    single = deepseek_v3_single
    nprocs, overrides = DEEPSEEK_LAYOUTS[layout]
    run = _deepseek_run(tmp_path, tiny_data, imported_deepseek_v3, nprocs=nprocs,
                        overrides=overrides, name=layout)
    head = run.records[0]
    assert (head["tensor"], head["pipeline"]) == \
        ((1, 2) if layout == "pp2" else (2, 1)), head
    assert rel_diff(run.losses, single.losses) < 1e-5, (run.losses, single.losses)
    norms = [[r["grad_norm"] for r in x.records if r["kind"] == "train"] for x in (run, single)]
    assert rel_diff(*norms) < 1e-5, norms

    final = run.run_dir / "final"
    cli("export-hf", final, "--output", tmp_path / "hf", "--dtype", "fp32")
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf",
                                                            attn_implementation="eager").eval()
    weights = load_weights(final)
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    _assert_equals_transformers(weights, hf, ids, prompt=5, new_tokens=8)
