"""Generation with a KV cache: the same logits and tokens as running the whole prefix again,
one new position per step after the prompt; bf16 and device placement."""
from __future__ import annotations

import pytest
import torch

from pretrain.checkpoint.generate import inference_placement
from pretrain.config import load_config
from pretrain.errors import ConfigError
from pretrain.model import build_model
from pretrain.model.llama import LayerCache

PROMPT = torch.tensor([[5, 17, 3, 99, 250, 7]])


def _model(**fields):
    overrides = ["model.preset=tiny", "model.seq_length=32"]  # tiny: 4 heads, 2 kv heads (GQA)
    overrides += [f"model.{k}={v}" for k, v in fields.items()]
    return build_model(load_config(None, overrides).model, seed=7).eval()


@torch.no_grad()
def test_cached_decoding_gives_the_logits_of_the_whole_prefix():
    model = _model()
    cache = [LayerCache() for _ in model.model.layers]
    ids = PROMPT
    hidden = model.hidden_states(ids, cache)
    for _ in range(10):
        logits = model.lm_head(hidden[:, -1])[:, :model.cfg.vocab_size]
        reference = model(ids)[:, -1]  # every position run again, no cache
        torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
        ids = torch.cat((ids, logits.argmax(-1, keepdim=True)), dim=1)
        hidden = model.hidden_states(ids[:, -1:], cache)
    assert cache[0].keys.shape == (1, 2, ids.shape[1], model.cfg.head_dim)  # kv heads cached


@torch.no_grad()
def test_generate_runs_the_prompt_once_then_one_position_per_step():
    model = _model()
    lengths = []
    model.model.layers[0].self_attn.register_forward_hook(
        lambda module, args, out: lengths.append(args[0].shape[1]))
    out = model.generate(PROMPT, max_new_tokens=8)
    assert lengths == [PROMPT.shape[1]] + [1] * 7
    # greedy without the cache: the whole prefix every step
    ids = PROMPT
    for _ in range(8):
        ids = torch.cat((ids, model(ids)[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(out, ids)


@torch.no_grad()
def test_generation_past_the_rotary_table_recomputes_the_window():
    model = _model(seq_length=8)
    out = model.generate(PROMPT, max_new_tokens=6)  # 6 + 6 > 8 positions
    ids = PROMPT
    for _ in range(6):
        ids = torch.cat((ids, model(ids[:, -8:])[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(out, ids)


@torch.no_grad()
def test_bf16_logits_are_the_fp32_ones_to_bf16_rounding():
    model = _model()
    fp32 = model(PROMPT)[:, -1]
    bf16 = model.to(torch.bfloat16)(PROMPT)[:, -1].float()
    # ~2 hidden layers of bf16 rounding (2^-8 relative) on logits of this scale
    assert (bf16 - fp32).abs().max() <= 0.05 * fp32.abs().max(), (bf16 - fp32).abs().max()
    assert not torch.equal(bf16, fp32)


def test_placement_is_the_gpu_in_bf16_else_the_cpu_in_fp32():
    if not torch.cuda.is_available():
        assert inference_placement("auto", "auto") == ("cpu", torch.float32)
        with pytest.raises(ConfigError, match="no CUDA device here"):
            inference_placement("cuda", "auto")
    assert inference_placement("cpu", "bf16") == ("cpu", torch.bfloat16)
    with pytest.raises(ConfigError, match="expected cpu, cuda or cuda:N"):
        inference_placement("tpu", "auto")
