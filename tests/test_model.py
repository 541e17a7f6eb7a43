"""The Llama model against Hugging Face's LlamaForCausalLM, and its own invariants.

Hugging Face models are built offline from `to_hf_config` (nothing is downloaded) and use the
eager attention path, so our SDPA attention is checked against an independent implementation.
"""
from __future__ import annotations

import pytest
import torch
import transformers

from pretrain.arithmetic import num_parameters
from pretrain.config import load_config
from pretrain.errors import ConfigError
from pretrain.model import LlamaModel, build_model, causal_lm_loss
from pretrain.model.hf import from_hf_state_dict, to_hf_config, to_hf_state_dict
from pretrain.model.layers import column_linear, row_linear, vocab_embedding
from pretrain.testing.numerics import bf16_logits_tolerance, cross_entropy64
from pretrain.model.llama import (INIT_BLOCK, full_parameter_init, parameter_seed, shard_init,
                                  shard_of)

transformers.logging.set_verbosity_error()


def tiny_cfg(**fields):
    """The `tiny` preset (hidden 64, 2 layers, 4 heads, 2 kv heads, vocab 512) with overrides."""
    overrides = ["model.preset=tiny"] + [f"model.{k}={v}" for k, v in fields.items()]
    return load_config(None, overrides).model


def hf_twin(model: LlamaModel) -> transformers.LlamaForCausalLM:
    """A Hugging Face model holding `model`'s weights (eager attention, fp32)."""
    cfg = model.cfg
    hf = transformers.LlamaForCausalLM(to_hf_config(cfg, attn_implementation="eager",
                                                    bos_token_id=None, eos_token_id=None))
    result = hf.load_state_dict(to_hf_state_dict(model.state_dict(), cfg), strict=False)
    assert result.unexpected_keys == []
    assert result.missing_keys == (["lm_head.weight"] if cfg.tie_embeddings else [])
    return hf.eval()


def batch(cfg, *, size=2, length=None, seed=0):
    """Tokens (B, T + 1) and their split into inputs and shifted labels, as the data pipeline does."""
    length = length or cfg.seq_length
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (size, length + 1), generator=g)
    return tokens, tokens[:, :-1], tokens[:, 1:]


VARIANTS = {
    "gqa": dict(num_heads=4, num_kv_heads=2),
    "mha": dict(num_heads=4, num_kv_heads=4),
    "tied": dict(tie_embeddings="true"),
    "vocab500_padded": dict(vocab_size=500),
    "tied_vocab500_mqa": dict(vocab_size=500, tie_embeddings="true", num_kv_heads=1),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_and_loss_match_hugging_face(variant):
    cfg = tiny_cfg(num_layers=3, **VARIANTS[variant])
    model = build_model(cfg, seed=7)
    hf = hf_twin(model)
    tokens, inputs, labels = batch(cfg, length=32)

    with torch.no_grad():
        ours = model(inputs)
        theirs = hf(inputs).logits
    assert ours.shape == (2, 32, cfg.vocab_size)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)

    # Hugging Face shifts labels itself: it gets the unshifted tokens, we get them pre-shifted.
    # Some positions are ignored (-100) in both, at the same target tokens.
    labels = labels.clone()
    hf_labels = tokens.clone()
    labels[0, :5] = -100
    hf_labels[0, 1:6] = -100
    with torch.no_grad():
        loss = model(inputs, labels)
        hf_loss = hf(tokens, labels=hf_labels).loss
    assert loss.dtype == torch.float32 and loss.ndim == 0
    torch.testing.assert_close(loss, hf_loss, rtol=1e-5, atol=1e-6)


def test_rope_theta_and_norm_eps_reach_the_layers():
    """Not the defaults, and init_std large enough that attention is not uniform (at 0.02 the
    scores are ~0 and any rotary table gives the same logits): ignoring either breaks the match."""
    cfg = tiny_cfg(rope_theta=31.0, norm_eps=0.5, init_std=0.3)
    model = build_model(cfg, seed=7)
    _, inputs, _ = batch(cfg, length=32)
    with torch.no_grad():
        torch.testing.assert_close(model(inputs), hf_twin(model)(inputs).logits,
                                   rtol=1e-4, atol=1e-3)


def test_bf16_forward_close_to_hugging_face():
    cfg = tiny_cfg()
    model = build_model(cfg, seed=3)
    with torch.no_grad():  # non-trivial norms, so a dropped or misplaced norm weight shows
        generator = torch.Generator().manual_seed(3)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=generator))
    hf = hf_twin(model)
    model, hf = model.to(torch.bfloat16), hf.to(torch.bfloat16)
    tokens, inputs, labels = batch(cfg, length=16)
    labels, hf_labels = labels.clone(), tokens.clone()  # as in the fp32 test: HF shifts itself
    labels[0, :5] = -100
    hf_labels[0, 1:6] = -100
    with torch.no_grad():
        ours, theirs = model(inputs), hf(inputs).logits
        loss, hf_out = model(inputs, labels), hf(tokens, labels=hf_labels)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert loss.dtype == hf_out.loss.dtype == torch.float32
    # The two differ in attention only (norms, rotary and MLP round the same values in the same
    # order): Hugging Face's eager path rounds the scores, the scaled scores, the probabilities
    # and their product with the values to bf16; SDPA rounds its output once. 5 a layer.
    tol = bf16_logits_tolerance(theirs, roundings=5 * cfg.num_layers)
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=0.0, atol=tol)
    # Both losses are fp32 cross entropies of bf16 logits (Hugging Face's of its 17-position
    # forward): their difference is the one the logits' difference makes, to the fp32
    # roundings of the two losses (a few ulps of fp32 at the loss's magnitude each).
    expected = cross_entropy64(ours, labels) - cross_entropy64(hf_out.logits[:, :-1], labels)
    torch.testing.assert_close((loss - hf_out.loss).double(), expected, rtol=0.0,
                               atol=8 * torch.finfo(torch.float32).eps * float(hf_out.loss))


@pytest.mark.parametrize("tied", [False, True])
def test_hf_state_dict_round_trip(tied):
    cfg = tiny_cfg(vocab_size=500, tie_embeddings=tied)
    model = build_model(cfg, seed=1)
    ours = model.state_dict()

    hf_sd = to_hf_state_dict(ours, cfg)
    assert hf_sd["model.embed_tokens.weight"].shape == (500, cfg.hidden_size)
    assert ("lm_head.weight" in hf_sd) is not tied
    back = from_hf_state_dict(hf_sd, cfg)
    assert back.keys() == ours.keys()
    for key, value in ours.items():
        assert torch.equal(back[key], value), key
    if tied:
        assert back["lm_head.weight"] is back["model.embed_tokens.weight"]


@pytest.mark.parametrize("tied", [False, True])
def test_import_from_hugging_face_model(tied):
    """A randomly initialised Hugging Face model loads into ours (strictly) and agrees with it."""
    cfg = tiny_cfg(vocab_size=500, tie_embeddings=tied)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(to_hf_config(cfg, attn_implementation="eager")).eval()
    model = LlamaModel(cfg)
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg), strict=True)
    _, inputs, _ = batch(cfg, length=16)
    with torch.no_grad():
        torch.testing.assert_close(model(inputs), hf(inputs).logits, rtol=1e-5, atol=1e-6)


def _loss_and_grads(cfg, *, calls):
    model = build_model(cfg, seed=5)
    default_fn = model.checkpoint_fn

    def counting_checkpoint(function, *args):
        calls.append(function)
        return default_fn(function, *args)

    model.checkpoint_fn = counting_checkpoint
    _, inputs, labels = batch(cfg, size=2, length=24)
    loss = model(inputs, labels)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, model


@pytest.mark.parametrize("mode,interval,checkpointed", [("full", 1, [0, 1, 2, 3]),
                                                        ("every_k", 2, [0, 2])])
def test_activation_checkpointing_gives_same_loss_and_grads(mode, interval, checkpointed):
    base = dict(num_layers=4, vocab_size=500)
    calls_none = []
    loss0, grads0, _ = _loss_and_grads(tiny_cfg(**base), calls=calls_none)
    calls = []
    cfg = tiny_cfg(**base, activation_checkpointing=mode,
                   activation_checkpointing_interval=interval)
    loss, grads, model = _loss_and_grads(cfg, calls=calls)

    assert calls_none == []
    assert calls == [model.model.layers[i] for i in checkpointed]
    torch.testing.assert_close(loss, loss0, rtol=1e-6, atol=0.0)
    assert grads.keys() == grads0.keys()
    for name, grad in grads.items():
        assert grad is not None and grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, grads0[name], rtol=1e-5, atol=1e-7, msg=name)
    # no recomputation (and no checkpoint calls) without autograd, e.g. in evaluation
    calls.clear()
    with torch.no_grad():
        model(batch(cfg, length=8)[1])
    assert calls == []


def test_same_seed_same_weights_different_seed_different():
    cfg = tiny_cfg(vocab_size=500)
    a, b, c = (build_model(cfg, seed=s).state_dict() for s in (11, 11, 12))
    for name in a:
        assert torch.equal(a[name], b[name]), name
        if name.endswith("norm.weight"):
            assert torch.equal(a[name], c[name]) and bool((a[name] == 1).all()), name
        else:
            assert not torch.equal(a[name], c[name]), name


def test_parameter_seed_is_stable_across_processes():
    # sha256-based: a changed value would silently change every model this code initialises
    assert parameter_seed(1234, "lm_head.weight") == 6947349614781503708
    assert parameter_seed(1234, "lm_head.weight") != parameter_seed(1235, "lm_head.weight")


def test_init_is_per_name_and_independent_of_padding():
    """Each parameter equals its standalone full-tensor init (what a pipeline stage or a tensor-
    parallel shard will draw), and padding only appends zero rows."""
    cfg = tiny_cfg(vocab_size=500)
    model = build_model(cfg, seed=3)
    for name, param in model.named_parameters():
        full = full_parameter_init(name, cfg, seed=3)
        assert torch.equal(param[:full.shape[0]], full), name
    wide = build_model(tiny_cfg(vocab_size=500, vocab_pad_multiple=1000), seed=3)
    assert wide.padded_vocab_size == 1000 and model.padded_vocab_size == 512
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        ours, theirs = model.state_dict()[key], wide.state_dict()[key]
        assert torch.equal(ours[:500], theirs[:500])
        assert bool((ours[500:] == 0).all()) and bool((theirs[500:] == 0).all())


def test_init_statistics_scale_output_projections():
    cfg = load_config(None, ["model.preset=tiny", "model.hidden_size=256", "model.num_heads=4",
                             "model.num_kv_heads=4", "model.ffn_hidden_size=1024",
                             "model.num_layers=8", "model.init_std=0.05"]).model
    model = build_model(cfg, seed=0)
    params = dict(model.named_parameters())
    scaled = 0.05 / (2 * 8) ** 0.5
    for name, std in [("model.embed_tokens.weight", 0.05), ("lm_head.weight", 0.05),
                      ("model.layers.3.self_attn.q_proj.weight", 0.05),
                      ("model.layers.3.mlp.gate_proj.weight", 0.05),
                      ("model.layers.3.self_attn.o_proj.weight", scaled),
                      ("model.layers.3.mlp.down_proj.weight", scaled)]:
        values = params[name][:cfg.vocab_size]
        assert abs(values.mean().item()) < 0.1 * std, name
        assert values.std().item() == pytest.approx(std, rel=0.03), name


@pytest.mark.parametrize("tied", [False, True])
def test_padded_vocab_rows_never_matter(tied):
    cfg = tiny_cfg(vocab_size=500, tie_embeddings=tied)
    model = build_model(cfg, seed=2)
    _, inputs, labels = batch(cfg, length=16)
    with torch.no_grad():
        logits, loss = model(inputs), model(inputs, labels)
        greedy = model.generate(inputs[:, :8], max_new_tokens=4)
        model.lm_head.weight[500:] = 1e4  # tied: the embedding's padded rows too
        assert model.lm_head.weight.shape[0] == 512
        torch.testing.assert_close(model(inputs, labels), loss, rtol=0, atol=0)
        torch.testing.assert_close(model(inputs), logits, rtol=0, atol=0)
        assert torch.equal(model.generate(inputs[:, :8], max_new_tokens=4), greedy)
    assert bool((greedy < 500).all())


def test_causal_lm_loss_ignores_padded_columns():
    logits = torch.randn(2, 3, 8)
    labels = torch.randint(0, 6, (2, 3))
    padded = torch.cat((logits[..., :6], torch.full((2, 3, 2), 1e6)), dim=-1)
    expected = torch.nn.functional.cross_entropy(logits[..., :6].reshape(-1, 6), labels.reshape(-1))
    torch.testing.assert_close(causal_lm_loss(padded, labels, 6), expected)


def test_num_parameters_matches_config():
    for tied in (False, True):
        cfg = tiny_cfg(vocab_size=500, tie_embeddings=tied)
        model = LlamaModel(cfg)
        assert model.num_parameters() == num_parameters(cfg)
        assert ("lm_head.weight" in dict(model.named_parameters())) is not tied


def test_greedy_generate_matches_hugging_face():
    cfg = tiny_cfg(vocab_size=500)
    model = build_model(cfg, seed=4)
    hf = hf_twin(model)
    prompt = batch(cfg, size=2, length=10)[0]
    ours = model.generate(prompt, max_new_tokens=6)
    theirs = hf.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert ours.shape == (2, 17)
    assert torch.equal(ours, theirs)


def test_generate_sampling_truncation_and_eos():
    cfg = tiny_cfg(seq_length=16)
    model = build_model(cfg, seed=4)
    prompt = batch(cfg, size=2, length=20)[0]  # longer than seq_length: context is truncated
    greedy = model.generate(prompt, max_new_tokens=3)
    assert greedy.shape == (2, 24) and torch.equal(greedy[:, :21], prompt)
    # top_k=1 sampling is greedy; a seeded generator makes sampling reproducible
    assert torch.equal(model.generate(prompt, max_new_tokens=3, temperature=1.0, top_k=1), greedy)
    sample = [model.generate(prompt, max_new_tokens=5, temperature=1.0,
                             generator=torch.Generator().manual_seed(9)) for _ in range(2)]
    assert torch.equal(sample[0], sample[1])
    # a row that emitted eos keeps emitting it; all rows finished stops early
    eos = int(greedy[0, 21])
    out = model.generate(prompt[:1], max_new_tokens=5, eos_id=eos)
    assert out.shape == (1, 22) and int(out[0, -1]) == eos


def test_hidden_not_divisible_by_heads_is_a_config_error():
    with pytest.raises(ConfigError, match="num_heads"):
        tiny_cfg(hidden_size=66, num_heads=4)


def test_tensor_parallel_factories_are_plain_layers_without_a_group():
    """Without a group (or with one rank) the swap points build plain torch layers; the
    sharded versions are tested against these in tests/test_tensor_parallel.py."""
    assert isinstance(column_linear(8, 4), torch.nn.Linear) and column_linear(8, 4).bias is None
    assert row_linear(8, 4).weight.shape == (4, 8)
    assert isinstance(vocab_embedding(8, 4), torch.nn.Embedding)


def _wide_cfg():
    """Dimensions that are not multiples of INIT_BLOCK: blocks straddle tensor-parallel shards."""
    return tiny_cfg(hidden_size=320, num_heads=8, num_kv_heads=4, ffn_hidden_size=864,
                    vocab_size=500)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_ranks_init_shard_is_its_shard_of_the_full_init(tp):
    cfg = _wide_cfg()
    for name, _ in build_model(cfg, seed=0).named_parameters():
        full = full_parameter_init(name, cfg, seed=5)
        for rank in range(tp):
            expected = shard_of(full, name, cfg=cfg, tp_rank=rank, tp_size=tp)
            assert torch.equal(shard_init(name, cfg, seed=5, tp_rank=rank, tp_size=tp),
                               expected), (name, rank)


def test_a_rank_draws_only_the_blocks_of_its_shard(monkeypatch):
    """At tp 4 each rank's normal samples are its shard plus at most the two blocks it
    straddles, where drawing the whole tensor and cutting the shard would draw 4x."""
    cfg = tiny_cfg(hidden_size=1024, num_heads=8, num_kv_heads=4, ffn_hidden_size=2816,
                   vocab_size=4000, num_layers=1)
    names = [name for name, _ in build_model(tiny_cfg(num_layers=1), seed=0).named_parameters()
             if not name.endswith("norm.weight")]
    drawn = []
    normal = torch.Tensor.normal_
    monkeypatch.setattr(torch.Tensor, "normal_",
                        lambda self, *a, **k: (drawn.append(self.numel()), normal(self, *a, **k))[1])
    for name in names:
        full = full_parameter_init(name, cfg, seed=5)
        column_split = name.endswith(("o_proj.weight", "down_proj.weight"))
        per_index = full.shape[0] if column_split else full.shape[1]  # elements per row/column
        for rank in range(4):
            drawn.clear()
            shard = shard_init(name, cfg, seed=5, tp_rank=rank, tp_size=4)
            assert sum(drawn) <= shard.numel() + 2 * INIT_BLOCK * per_index, (name, rank)
            assert sum(drawn) <= full.numel() / 2, (name, rank, sum(drawn), full.numel())


def test_attention_on_cuda_in_16_bits_may_not_fall_back_to_the_math_kernel():
    from torch.nn.attention import SDPBackend

    from pretrain.model.llama import attention_backends

    for dtype in (torch.bfloat16, torch.float16):
        allowed = attention_backends("cuda", dtype)
        assert SDPBackend.FLASH_ATTENTION in allowed and SDPBackend.MATH not in allowed
    assert attention_backends("cuda", torch.float32) is None  # fp32: the math kernel is legit
    assert attention_backends("cpu", torch.bfloat16) is None


def test_a_shard_of_only_padded_vocabulary_rows_is_zero():
    """vocab 300 padded to 512 rows for tp 4: rank 3's rows 384-511 are all padding."""
    cfg = tiny_cfg(vocab_size=300)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        shard = shard_init(name, cfg, seed=1, tp_rank=3, tp_size=4)
        assert shard.shape == (128, cfg.hidden_size) and not shard.any()
        assert torch.equal(shard_init(name, cfg, seed=1, tp_rank=2, tp_size=4)[:300 - 256],
                           full_parameter_init(name, cfg, seed=1)[256:])
