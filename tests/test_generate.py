"""Generation with a KV cache: the same logits and tokens as running the whole prefix again,
one new position per step after the prompt, in one process and through a 2-stage pipeline;
bf16 and device placement."""
from __future__ import annotations

import pytest
import torch

from pretrain.checkpoint.generate import inference_placement
from pretrain.config import load_config
from pretrain.errors import ConfigError
from pretrain.model import build_model
from pretrain.model.llama import LayerCache

PROMPT = torch.tensor([[5, 17, 3, 99, 250, 7]])


def _config(**fields):
    overrides = ["model.preset=tiny", "model.seq_length=32"]  # tiny: 4 heads, 2 kv heads (GQA)
    overrides += [f"model.{k}={v}" for k, v in fields.items()]
    return load_config(None, overrides).model


def _model(**fields):
    return build_model(_config(**fields), seed=7).eval()


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


# the pipeline's batches: 8 new tokens after a prompt of 6, cached; after one of 28, cached
# until the rotary table's 32 positions are full, then the window of 32 recomputed
PIPELINE_PROMPTS = [[[5, 17, 3, 99, 250, 7], [9, 9, 41, 2, 77, 130]],
                    [list(range(40, 68)), list(range(90, 118))]]
PIPELINE_NEW_TOKENS = 8


def _pipeline_greedy(rank: int, world_size: int) -> dict:
    """`ModelRunner.greedy` on a 2-stage pipeline engine of `_model`'s weights (rank 0 driving):
    the tokens, and the input lengths each pass gave this stage's decoder layers."""
    import logging

    import deepspeed

    from pretrain.dist import init_deepspeed_comm
    from pretrain.evaluation.runner import GreedyBatch, ModelRunner
    from pretrain.model import build_pipeline_model
    from pretrain.model.pipeline import DecoderLayerPipe, StageActivations

    deepspeed.utils.logger.setLevel(logging.WARNING)
    init_deepspeed_comm(dist_backend="gloo", verbose=False)
    cfg = _config()
    module = build_pipeline_model(cfg, seed=7, num_stages=2)
    engine, *_ = deepspeed.initialize(model=module, config={
        "train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9})
    layers = [f for f in module.forward_funcs if isinstance(f, DecoderLayerPipe)]
    lengths: list[int] = []
    layers[0].register_forward_hook(lambda layer, args, out: lengths.append(
        StageActivations.from_tuple(args[0]).hidden.shape[1]))
    runner = ModelRunner(engine, vocab_size=cfg.vocab_size, seq_length=cfg.seq_length,
                         batch_size=2, distributed=True, pipeline_shape=(2, cfg.seq_length))
    tokens = None
    if rank == 0:
        batches = [GreedyBatch(prompts=tuple(map(tuple, prompts)), until=((), ()),
                               max_new_tokens=PIPELINE_NEW_TOKENS) for prompts in PIPELINE_PROMPTS]
        tokens = runner.greedy(batches)
        runner.stop()
    else:
        runner.serve()
    return {"stage": engine.stage_id, "tokens": tokens, "lengths": lengths,
            "caches_left": [layer.kv_cache for layer in layers]}


@pytest.mark.slow
def test_a_pipeline_decodes_with_the_cache_the_flat_models_tokens(tmp_path):
    """pp 2: the tokens of `generate` on the flat model of the same weights, each stage running
    the prompt once and then one position per token (until the window is recomputed)."""
    from pretrain.testing.ranks import run_on_ranks

    results = run_on_ranks(_pipeline_greedy, world_size=2, tmp_path=tmp_path)
    model = _model()
    expected = []
    for prompts in PIPELINE_PROMPTS:
        ids = model.generate(torch.tensor(prompts), max_new_tokens=PIPELINE_NEW_TOKENS)
        expected.append(ids[:, len(prompts[0]):].tolist())
    assert results[0]["tokens"] == expected
    assert sorted(r["stage"] for r in results) == [0, 1]
    for result in results:  # 6 + 8 <= 32; 28 + 4 <= 32, then 33 > 32: the last 32 again
        assert result["lengths"] == [6] + [1] * 7 + [28] + [1] * 4 + [32] * 3, result
        assert result["caches_left"] == [None] * len(result["caches_left"])


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
