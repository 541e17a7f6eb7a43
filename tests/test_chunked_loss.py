"""The chunked lm_head loss (`pretrain.model.loss`, `model.loss_chunk_tokens` > 0) against the
whole-logits loss it replaces (`loss_chunk_tokens=0`), all in fp32.

Single process: the fused function and the whole model (untied and tied, through `LlamaModel`
and the pipeline's layers) give the loss and every gradient of the unchunked path within 1e-6
relative, with ignored labels, a chunk size that does not divide the micro-batch's tokens and a
padded vocabulary whose padded rows hold 1e4 (they must never reach the softmax, and get no
gradient). On 2 gloo ranks: tensor parallelism (one rank's vocabulary shard all padding, and
sequence parallelism) against the single-process unchunked model, within 1e-5. Memory: the
fused loss's peak during forward + backward is a fraction of the unchunked one's. Training
runs (slow): 10 steps of `pretrain train` chunked against unchunked, pipeline pp=2 with tied
embeddings and ZeRO-3, losses and gradient norms within 1e-5 relative at every step.

"Relative" for a tensor is ||a - b|| / ||b||: rounding differences (the chunks sum the weight
gradient in another order, the softmax gradient is rounded differently) are a few fp32 ulps
per element, measured up to 3.9e-7 of the norm after backpropagating through 2 layers (4.5e-7
on 2 tensor-parallel ranks, whose reductions add their own); an element near zero has no
meaningful relative error of its own.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pretrain.config import load_config
from pretrain.model import build_flat_pipeline, build_model
from pretrain.model.loss import fused_linear_cross_entropy, lm_head_loss, lm_loss
from pretrain.model.pipeline import pipeline_to_canonical_name
from pretrain.testing.memory import peak_added
from pretrain.testing.numerics import VOCAB_MATRICES, full_grads
from pretrain.testing.ranks import run_on_ranks
from pretrain.testing.runs import rel_diff, train

SEED = 7
CHUNK = 16  # tokens per chunk: does not divide the 3 x 37 = 111 tokens of a micro-batch
B, T = 3, 37
PAD_VALUE = 1e4  # what the padded vocabulary rows hold in these tests


def tiny_cfg(chunk: int, **fields):
    overrides = ["model.preset=tiny", f"model.loss_chunk_tokens={chunk}"]
    return load_config(None, overrides + [f"model.{k}={v}" for k, v in fields.items()]).model


def batch(vocab_size: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) of B x T tokens; some labels ignored (-100) in two rows."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (B, T + 1), generator=generator)
    labels = tokens[:, 1:].clone()
    labels[0, :5] = -100
    labels[2, -3:] = -100
    return tokens[:, :-1].contiguous(), labels


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


@torch.no_grad()
def fill_padded_rows(model, value: float = PAD_VALUE) -> None:
    """Padded vocabulary rows of every vocabulary matrix set to `value` (0 after init); under
    tensor parallelism those of this rank's shard."""
    for module in (model.lm_head, model.model.embed_tokens):
        start = model.tensor_parallel_rank * module.weight.shape[0]  # first row's global index
        module.weight[max(0, model.cfg.vocab_size - start):] = value


# ---- the function alone ----------------------------------------------------------------------

@pytest.mark.parametrize("chunk", [1, 7, CHUNK, B * T, 4096])
def test_fused_function_matches_whole_logits(chunk):
    """Loss, d hidden and d weight (scaled by a loss gradient that is not 1) equal the
    whole-logits path; padded rows get no gradient; without grad mode the same loss."""
    vocab, padded, width = 300, 384, 32
    generator = torch.Generator().manual_seed(0)
    hidden0 = torch.randn(B, T, width, generator=generator)
    weight0 = torch.randn(padded, width, generator=generator) * 0.5
    weight0[vocab:] = PAD_VALUE
    _, labels = batch(vocab)
    results = []
    for chunk_tokens in (0, chunk):
        hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
        loss = lm_head_loss(hidden, weight, labels, vocab_size=vocab, chunk_tokens=chunk_tokens)
        (loss * 0.25).backward()  # as under gradient accumulation over 4 micro-batches
        results.append((loss.detach(), hidden.grad, weight.grad))
    (ref_loss, ref_dh, ref_dw), (loss, dh, dw) = results
    assert rel(loss, ref_loss) < 1e-6, (float(loss), float(ref_loss))
    assert rel(dh, ref_dh) < 1e-6
    assert rel(dw, ref_dw) < 1e-6
    assert bool((dw[vocab:] == 0).all()) and bool((ref_dw[vocab:] == 0).all())
    with torch.no_grad():
        eval_loss = fused_linear_cross_entropy(hidden0, weight0, labels, vocab_size=vocab,
                                               chunk_tokens=chunk)
    assert not eval_loss.requires_grad and rel(eval_loss, ref_loss) < 1e-6


def test_fused_function_edge_cases():
    hidden = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(128, 8, requires_grad=True)
    ignored = torch.full((4,), -100)
    # no label at all: nan, like F.cross_entropy's mean over nothing
    assert torch.isnan(lm_head_loss(hidden, weight, ignored, vocab_size=100, chunk_tokens=3))
    assert torch.isnan(lm_loss(F.linear(hidden, weight), ignored, vocab_size=100))
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        fused_linear_cross_entropy(hidden, weight, ignored, vocab_size=100, chunk_tokens=0)
    # only the hidden states need a gradient (a frozen head): none is computed for the weight
    labels = torch.tensor([1, 2, 3, 99])
    frozen = weight.detach()
    fused_linear_cross_entropy(hidden, frozen, labels, vocab_size=100, chunk_tokens=3).backward()
    expected = torch.autograd.grad(lm_loss(F.linear(hidden, frozen), labels, vocab_size=100),
                                   hidden)[0]
    assert rel(hidden.grad, expected) < 1e-6 and frozen.grad is None


# ---- the whole model, one process ------------------------------------------------------------

def _loss_and_grads(model, inputs, labels, *, names=None):
    loss = model(inputs, labels)
    loss.backward()
    named = model.named_parameters()
    if names is not None:
        named = ((names(n), p) for n, p in named)
    return loss.detach(), {n: p.grad for n, p in named}


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_model_chunked_matches_unchunked(tie):
    """vocab 300 in 384 padded rows holding 1e4; chunks of 16 of 111 tokens, 8 labels ignored."""
    cfg, ref_cfg = (tiny_cfg(chunk, vocab_size=300, tie_embeddings=str(tie).lower())
                    for chunk in (CHUNK, 0))
    model, ref = build_model(cfg, seed=SEED), build_model(ref_cfg, seed=SEED)
    assert model.lm_head.weight.shape[0] == 384 and model.lm_head.chunk_tokens == CHUNK
    fill_padded_rows(model)
    fill_padded_rows(ref)
    inputs, labels = batch(cfg.vocab_size)
    loss, grads = _loss_and_grads(model, inputs, labels)
    ref_loss, ref_grads = _loss_and_grads(ref, inputs, labels)
    assert rel(loss, ref_loss) < 1e-6, (float(loss), float(ref_loss))
    assert grads.keys() == ref_grads.keys()
    assert ("lm_head.weight" in grads) is not tie
    for name, grad in grads.items():
        assert rel(grad, ref_grads[name]) < 1e-6, (name, rel(grad, ref_grads[name]))
        if name in VOCAB_MATRICES:
            assert bool((grad[cfg.vocab_size:] == 0).all()), name
    with torch.no_grad():  # evaluation: the loss chunk by chunk; logits whole as before
        assert rel(model(inputs, labels), ref_loss) < 1e-6
        assert torch.equal(model(inputs), ref(inputs))

    # the pipeline's layers (LMHeadPipe or the tied EmbeddingPipe.project_to_vocab, then
    # PipelineLoss) compute exactly what the flat model does
    pipe = build_flat_pipeline(cfg, seed=SEED)
    with torch.no_grad():
        for name, param in pipe.named_parameters():
            if pipeline_to_canonical_name(name, num_layers=cfg.num_layers) in VOCAB_MATRICES:
                param[cfg.vocab_size:] = PAD_VALUE
    pipe_loss, pipe_grads = _loss_and_grads(
        pipe, inputs, labels,
        names=lambda n: pipeline_to_canonical_name(n, num_layers=cfg.num_layers))
    assert torch.equal(pipe_loss, loss)
    for name, grad in pipe_grads.items():
        assert torch.equal(grad, grads[name]), name
    with torch.no_grad():
        assert torch.equal(pipe(inputs), ref(inputs))


# ---- tensor parallelism on 2 ranks ----------------------------------------------------------

def _tensor_parallel_against_single(rank, world_size, variants):
    results = []
    for fields, sequence_parallel in variants:
        cfg, ref_cfg = tiny_cfg(CHUNK, **fields), tiny_cfg(0, **fields)
        ref = build_model(ref_cfg, seed=SEED)  # one process, whole logits
        model = build_model(cfg, seed=SEED, tp_group=dist.group.WORLD,
                            sequence_parallel=sequence_parallel)
        fill_padded_rows(model)
        fill_padded_rows(ref)
        inputs, labels = batch(cfg.vocab_size)
        if sequence_parallel:  # T divisible by tp
            inputs, labels = inputs[:, :-1], labels[:, :-1]
        loss, ref_loss = model(inputs, labels), ref(inputs, labels)
        loss.backward()
        ref_loss.backward()
        grads = full_grads(model)
        ref_grads = {n: (p.grad[:cfg.vocab_size] if n in VOCAB_MATRICES else p.grad)
                     for n, p in ref.named_parameters()}
        errors = {n: rel(g, ref_grads[n]) for n, g in grads.items()}
        with torch.no_grad():
            eval_error = rel(model(inputs, labels), ref_loss)
        results.append({"loss": rel(loss, ref_loss), "eval": eval_error, "grads": errors,
                        "names": sorted(grads) == sorted(ref_grads),
                        "padded_rows": model.lm_head.weight.shape[0]})
    return results


def test_tensor_parallel_chunked_matches_single_process(tmp_path):
    # vocab 300: 512 padded rows, rank 1 holds 44 real ones; vocab 100: rank 1's 128 rows are
    # all padding (its logits are empty: it contributes nothing but the collectives)
    variants = [(dict(vocab_size=300), False),
                (dict(vocab_size=100, tie_embeddings="true"), True)]
    results = run_on_ranks(_tensor_parallel_against_single, world_size=2, tmp_path=tmp_path,
                           args=(variants,))
    for rank, per_rank in enumerate(results):
        for variant, result in zip(variants, per_rank):
            what = (rank, variant)
            assert result["names"] and result["padded_rows"] in (256, 128), what
            assert result["loss"] < 1e-5 and result["eval"] < 1e-5, (what, result)
            worst = max(result["grads"].items(), key=lambda item: item[1])
            assert worst[1] < 1e-5, (what, worst)


# ---- memory ------------------------------------------------------------------------------------

def _peak_loss_memory(rank, world_size, chunks, tokens, vocab, width):
    """Peak resident memory (bytes) of one forward + backward of the loss in chunks of
    `chunks[rank]` tokens above what this process held before it: the high-water mark is reset
    (/proc/self/clear_refs) first."""
    chunk_tokens = chunks[rank]
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, width, generator=generator).requires_grad_()
    weight = (torch.randn(vocab, width, generator=generator) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    warm_h, warm_w = torch.randn(8, width, requires_grad=True), torch.randn(128, width,
                                                                             requires_grad=True)
    lm_head_loss(warm_h, warm_w, labels[:8] % 128, vocab_size=128,
                 chunk_tokens=chunk_tokens).backward()  # kernels and their buffers, once
    return peak_added(lambda: lm_head_loss(hidden, weight, labels, vocab_size=vocab,
                                           chunk_tokens=chunk_tokens).backward())


def test_fused_loss_peak_memory_is_a_fraction_of_whole_logits(tmp_path, monkeypatch):
    """vocab 32000, 512 tokens, hidden 64: the whole fp32 logits are 65.5 MB, and the unchunked
    loss holds three such (N, V) tensors at its peak (measured 198 MB); chunks of 64 tokens hold
    one 8.2 MB chunk besides the weight's gradient (8.2 MB; measured 18 MB in all).

    Each in a fresh process (the two side by side, a rank each), whose glibc maps every buffer
    above 64 KiB on its own and unmaps it when freed (a fixed M_MMAP_THRESHOLD): the resident
    peak is then the tensors' peak. With glibc's default, adaptive threshold, freed chunk buffers
    may stay in its heap (measured 26 to 58 MB of the same chunked run), which would test the
    allocator, not the loss."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))  # read by the spawned ranks
    tokens, vocab, width = 512, 32000, 64
    chunks = (0, 64)
    peaks = dict(zip(chunks, run_on_ranks(_peak_loss_memory, world_size=len(chunks),
                                          tmp_path=tmp_path, args=(chunks, tokens, vocab, width),
                                          start_method="spawn")))
    logits_bytes = tokens * vocab * 4
    assert peaks[0] > 2 * logits_bytes, peaks  # the measurement sees the whole logits
    assert peaks[64] < peaks[0] / 4, peaks



def _peak_model_memory(rank, world_size, tokens, vocab):
    """Peak resident memory added by a forward + backward of the flat model's loss and of the
    flat pipeline's, unchunked and in chunks of 64 tokens, each measured after one warm-up pass
    (gradients already held)."""
    inputs, labels = (torch.randint(0, vocab, (1, tokens), generator=torch.Generator()
                                    .manual_seed(s)) for s in (1, 2))
    peaks = {}
    for chunk in (0, 64):
        cfg = tiny_cfg(chunk, vocab_size=vocab, seq_length=tokens, num_layers=1)
        for name, build in (("model", build_model), ("pipeline", build_flat_pipeline)):
            model = build(cfg, seed=SEED)
            model(inputs, labels).backward()  # kernels, their buffers and the gradients, once
            peaks[name, chunk] = peak_added(lambda: model(inputs, labels).backward())
            del model
    return peaks


@pytest.mark.slow  # a minute and more on a loaded 2-core machine
def test_the_models_loss_peak_memory_is_a_fraction_of_whole_logits(tmp_path, monkeypatch):
    """The same claim through the flat model's and the pipeline's forward, as training calls
    them (`model.loss_chunk_tokens` reaching their heads): vocab 16000, 512 tokens, hidden 64,
    one layer. The whole fp32 logits are 32.8 MB and the unchunked loss holds about three such
    tensors; chunks of 64 tokens hold 4.1 MB at a time (allocator as in the test above)."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
    tokens, vocab = 512, 16000
    peaks = run_on_ranks(_peak_model_memory, world_size=1, tmp_path=tmp_path,
                         args=(tokens, vocab), start_method="spawn")[0]
    logits_bytes = tokens * vocab * 4
    for name in ("model", "pipeline"):
        assert peaks[name, 0] > 2 * logits_bytes, (name, peaks)  # it sees the whole logits
        assert peaks[name, 64] < peaks[name, 0] / 4, (name, peaks)

# ---- training runs through `pretrain train` ---------------------------------------------------

STEPS = 10
EVAL = ["train.eval_interval=5", "train.eval_batches=2"]  # validation at steps 5 and 10


def _records(run, kind: str, key: str) -> list[float]:
    return [r[key] for r in run.records if r["kind"] == kind]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    # tied embeddings across the two stages: the head's gradient reaches the tied weight
    # through the (hidden, weight) pair and DeepSpeed all-reduces it with the first stage's
    ["parallel.pipeline=2", "model.tie_embeddings=true"],
    ["deepspeed=ds_configs/zero3.json"],
], ids=["pp2-tied", "zero3"])
def test_training_run_chunked_matches_unchunked(layout, tiny_data, tmp_path):
    """Micro-batches of 2 x 64 tokens in chunks of 32: 4 chunks each."""
    runs = {chunk: train(tmp_path, tiny_data, nprocs=2, name=f"chunk{chunk}",
                         overrides=[f"train.steps={STEPS}", *EVAL, *layout,
                                    f"model.loss_chunk_tokens={chunk}"])
            for chunk in (32, 0)}
    chunked, whole = runs[32], runs[0]
    assert len(chunked.losses) == STEPS
    assert rel_diff(chunked.losses, whole.losses) < 1e-5, (chunked.losses, whole.losses)
    assert rel_diff(_records(chunked, "train", "grad_norm"),
                    _records(whole, "train", "grad_norm")) < 1e-5
    assert rel_diff(_records(chunked, "eval", "loss"), _records(whole, "eval", "loss")) < 1e-5
    assert len(_records(chunked, "eval", "loss")) == 2
