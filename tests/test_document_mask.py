"""Document masking (`data.document_mask`): attention and positions stay inside each document.

Fast: the loader's document ids (an eod token ends its own document; every context rank gets the
whole sample's ids), documents that leave each other's logits bitwise alone, each document's
logits and loss against transformers' LlamaForCausalLM run on that document alone, the pipeline
stages, the CUDA kernel's inputs (checked here on the CPU). Slow: the real `pretrain train` with
the mask at tensor 2 + ZeRO-3, pipeline 2 and context 2 against one process.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

from pretrain.config import load_config
from pretrain.data.loader import micro_batches
from pretrain.data.samples import document_ids
from pretrain.model import build_model
from pretrain.model.build import build_flat_pipeline
from pretrain.model.documents import (block_causal_mask, document_positions, masked_backends,
                                      uses_varlen, varlen_boundaries)
from pretrain.model.hf import to_hf_config, to_hf_state_dict

transformers.logging.set_verbosity_error()
EOD = 2
SEQ = 48
DOCUMENT_LENGTHS = (14, 20, 14)  # one packed sample: three documents, each ending with EOD


def tiny_cfg(**fields):
    overrides = ["model.preset=tiny"] + [f"model.{k}={v}" for k, v in fields.items()]
    return load_config(None, overrides).model


def packed_sample(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens (1, SEQ + 1) of three documents and the next one's first token; the document ids
    (1, SEQ) of its inputs, as the loader computes them."""
    g = torch.Generator().manual_seed(seed)
    pieces = []
    for length in DOCUMENT_LENGTHS:
        pieces += [torch.randint(3, 512, (length - 1,), generator=g), torch.tensor([EOD])]
    tokens = torch.cat(pieces + [torch.randint(3, 512, (1,), generator=g)])[None]
    return tokens, torch.from_numpy(document_ids(tokens.numpy(), eod=EOD))


def spans() -> list[slice]:
    starts = np.cumsum((0,) + DOCUMENT_LENGTHS)
    return [slice(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]


# ---- the data path -------------------------------------------------------------------------------

def test_document_ids_count_the_eod_tokens_before_each_input():
    tokens = np.array([[5, 6, EOD, 7, EOD, EOD, 8, 9, 4], [EOD, 5, 5, 5, 5, 5, 5, 5, EOD]])
    # the eod is its document's last token; the label after the last input is not an input
    assert document_ids(tokens, eod=EOD).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3],
                                                      [0, 1, 1, 1, 1, 1, 1, 1]]
    positions = document_positions(torch.from_numpy(document_ids(tokens, eod=EOD)))
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 1, 2, 3, 4, 5, 6]]


def test_loader_sends_every_context_rank_the_whole_samples_document_ids():
    class Samples:
        def __len__(self):
            return 16

        def tokens(self, index):
            tokens = np.arange(17, dtype=np.int64) + 100 * index + 3
            tokens[[3, 9 + index % 4]] = EOD
            return tokens

    def first(**kw):
        it = micro_batches(Samples(), micro_batch_size=2, dp_rank=0, dp_size=1, **kw)
        return [next(it) for _ in range(3)]

    plain, whole = first(), first(document_eod=EOD)
    chunks = [first(context_rank=c, context_size=4, document_eod=EOD) for c in range(4)]
    assert set(plain[0]) == {"input_ids", "labels"}  # off: the batches of before
    for i, batch in enumerate(whole):
        for name in ("input_ids", "labels"):
            assert torch.equal(batch[name], plain[i][name])
            assert torch.equal(torch.cat([c[i][name] for c in chunks], dim=1), batch[name])
        full = torch.cat((batch["input_ids"], batch["labels"][:, -1:]), dim=1)
        assert torch.equal(batch["document_ids"],
                           torch.from_numpy(document_ids(full.numpy(), eod=EOD)))
        assert batch["document_ids"].shape == (2, 16) and batch["document_ids"].is_contiguous()
        for c in range(4):
            assert torch.equal(chunks[c][i]["document_ids"], batch["document_ids"])


# ---- the model -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return build_model(tiny_cfg(seq_length=64), seed=3).eval()


@torch.no_grad()
def test_changing_one_document_leaves_the_others_logits_bitwise_unchanged(model):
    tokens, ids = packed_sample()
    first, middle, last = spans()
    changed = tokens.clone()
    changed[0, middle.start:middle.stop - 1] = torch.randint(3, 512, (middle.stop - 1 -
                                                                      middle.start,))
    a = model(tokens[:, :-1], document_ids=ids)
    b = model(changed[:, :-1], document_ids=ids)
    assert torch.equal(a[0, first], b[0, first]) and torch.equal(a[0, last], b[0, last])
    assert not torch.allclose(a[0, middle], b[0, middle])  # the changed document did change
    # without the mask the last document reads the middle one (the test can fail)
    assert not torch.equal(model(tokens[:, :-1])[0, last], model(changed[:, :-1])[0, last])


@torch.no_grad()
def test_a_mixture_of_experts_keeps_documents_apart_when_dropless():
    """Routing is per token, so a dropless mixture of experts keeps documents apart as the dense
    MLP does; with a capacity, the tokens an expert drops depend on the whole batch's routing, so
    one document's tokens can change another's (documented)."""
    tokens, ids = packed_sample()
    first, middle, last = spans()
    changed = tokens.clone()
    changed[0, middle.start:middle.stop - 1] = torch.randint(
        3, 512, (middle.stop - 1 - middle.start,), generator=torch.Generator().manual_seed(1))

    def logits(capacity: float) -> tuple[torch.Tensor, torch.Tensor]:
        moe = build_model(tiny_cfg(seq_length=64, num_experts=4, experts_per_token=2,
                                   moe_capacity_factor=capacity), seed=3).eval()
        return moe(tokens[:, :-1], document_ids=ids), moe(changed[:, :-1], document_ids=ids)

    a, b = logits(0.0)
    assert torch.equal(a[0, first], b[0, first]) and torch.equal(a[0, last], b[0, last])
    assert not torch.allclose(a[0, middle], b[0, middle])
    a, b = logits(0.5)  # half the tokens' slots: some are dropped, which ones depends on all
    assert not (torch.equal(a[0, first], b[0, first]) and torch.equal(a[0, last], b[0, last]))


def hf_twin(model) -> transformers.LlamaForCausalLM:
    cfg = model.cfg
    hf = transformers.LlamaForCausalLM(to_hf_config(cfg, attn_implementation="eager",
                                                    bos_token_id=None, eos_token_id=None))
    hf.load_state_dict(to_hf_state_dict(model.state_dict(), cfg), strict=False)
    return hf.eval()


@torch.no_grad()
def test_each_documents_logits_and_loss_equal_transformers_on_that_document_alone(model):
    """Tolerance: both sides compute in fp32 and differ only in the order of their sums (SDPA's
    kernel with a mask against HF's eager softmax; rotary tables gathered per token). A sum of
    K <= 256 terms reordered changes by at most ~K u |terms| (u = 2^-24, 1.5e-5 relative); a
    handful of such sums per layer over 2 layers: 1e-4 of the largest logit bounds it, while a
    leak of another document or a position off by one moves logits by ~1e-1 of it (checked on
    the unmasked forward). Rotary scores depend on relative positions only, so a document's
    logits cannot show a constant offset of all its positions (the positions themselves are
    checked in `test_document_ids_count_the_eod_tokens_before_each_input`)."""
    tokens, ids = packed_sample(seed=1)
    hf = hf_twin(model)
    logits = model(tokens[:, :-1], document_ids=ids)
    unmasked = model(tokens[:, :-1])
    labels = tokens[:, 1:]
    for span in spans():
        alone = hf(tokens[:, span]).logits  # the document alone, its eod last
        scale = alone.abs().max().item()
        diff = (logits[:, span] - alone).abs().max().item()
        assert diff <= 1e-4 * scale, (span, diff, scale)
        # the loss of the document's own predictions (its next token up to its eod)
        inner = slice(span.start, span.stop - 1)
        ours = F.cross_entropy(logits[0, inner], labels[0, inner])
        theirs = F.cross_entropy(alone[0, :-1], tokens[0, span][1:])
        assert abs(ours.item() - theirs.item()) <= 1e-5 * theirs.item()
        if span.start > 0:  # a later document: the unmasked model reads the earlier ones
            assert (unmasked[:, span] - alone).abs().max().item() > 1e-2 * scale


@torch.no_grad()
def test_loss_keeps_its_definition(model):
    """The mean over every label, the prediction at an eod of the next document's first token
    included: the mask changes what is attended, not what is counted."""
    tokens, ids = packed_sample(seed=2)
    logits = model(tokens[:, :-1], document_ids=ids)
    loss = model(tokens[:, :-1], tokens[:, 1:], document_ids=ids)
    expected = F.cross_entropy(logits.flatten(0, 1).double(), tokens[:, 1:].flatten())
    assert abs(loss.item() - expected.item()) <= 1e-5 * expected.item()


@torch.no_grad()
def test_pipeline_stages_carry_the_document_ids():
    cfg = tiny_cfg(seq_length=64)
    flat, pipe = build_model(cfg, seed=3).eval(), build_flat_pipeline(cfg, seed=3).eval()
    tokens, ids = packed_sample(seed=4)
    assert torch.equal(pipe(tokens[:, :-1], document_ids=ids),
                       flat(tokens[:, :-1], document_ids=ids))
    assert torch.equal(pipe(tokens[:, :-1], tokens[:, 1:], document_ids=ids),
                       flat(tokens[:, :-1], tokens[:, 1:], document_ids=ids))


def test_generation_refuses_document_ids_with_a_cache(model):
    from pretrain.model.llama import LayerCache

    tokens, ids = packed_sample()
    cache = [LayerCache() for _ in model.model.layers]
    with pytest.raises(ValueError, match="a prompt is one document"):
        model.hidden_states(tokens[:, :-1], cache, document_ids=ids)


def _masked_model_run(rank, world_size, tensor):
    """Loss and gradients (fp64) of the packed sample with its document ids, on `world_size`
    gloo ranks: tensor x context = world_size, sequence parallel under tensor 2."""
    from pretrain.testing.numerics import replica_mean_loss_and_grads
    from pretrain.resolve.topology import Topology

    context = world_size // tensor
    topo = Topology(tensor=tensor, pipeline=1, world_size=world_size, rank=rank, context=context)
    groups = topo.create_groups() if world_size > 1 else None
    model = build_model(tiny_cfg(seq_length=64), seed=5,
                        tp_group=groups.tensor if tensor > 1 else None,
                        sequence_parallel=tensor > 1,
                        cp_group=groups.context if groups else None).double()
    tokens, ids = packed_sample(seed=6)
    c, T = topo.my_coords.context, SEQ // context
    chunk = slice(c * T, (c + 1) * T)  # the loader's chunk; every rank gets the whole ids
    loss = model(tokens[:, :-1][:, chunk], tokens[:, 1:][:, chunk], document_ids=ids)
    loss.backward()
    return replica_mean_loss_and_grads(model, loss, topology=topo, groups=groups)


@pytest.mark.parametrize("tensor", [1, 2], ids=["context2", "tensor2_sequence_parallel"])
def test_masked_model_on_two_ranks_equals_one_process(tmp_path, tensor):
    """fp64 but for the fp32 cross entropy: fp32 rounding, ~1e-7 of the largest element, where a
    context chunk's positions counted from its own start instead of the sequence's, or a mask
    built from a chunk's ids, changes gradients by far more."""
    from pretrain.testing.ranks import run_on_ranks

    single = run_on_ranks(_masked_model_run, world_size=1, tmp_path=tmp_path, args=(1,))[0]
    for rank, result in enumerate(run_on_ranks(_masked_model_run, world_size=2,
                                               tmp_path=tmp_path, args=(tensor,))):
        assert abs(result["loss"] - single["loss"]) <= 1e-6 * abs(single["loss"]), rank
        for name, g in single["grads"].items():
            err = float((result["grads"][name] - g).abs().max())
            assert err <= 1e-6 * float(g.abs().max()), (rank, name, err)


# ---- what the CUDA kernels would get ------------------------------------------------------------

def test_varlen_boundaries_describe_the_same_documents_as_the_mask():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1]])
    boundaries, longest = varlen_boundaries(ids)
    assert boundaries.dtype == torch.int32 and boundaries.device == ids.device
    assert boundaries.tolist() == [0, 3, 5, 8, 9, 16] and longest == 7
    # a query attends the keys of its own [start, stop) up to itself: the block-causal mask
    T = ids.shape[1]
    rebuilt = torch.zeros(ids.shape[0] * T, ids.shape[0] * T, dtype=torch.bool)
    for start, stop in zip(boundaries[:-1].tolist(), boundaries[1:].tolist()):
        rebuilt[start:stop, start:stop] = torch.ones(stop - start, stop - start).tril().bool()
    mask = block_causal_mask(ids)
    for b in range(ids.shape[0]):
        rows = slice(b * T, (b + 1) * T)
        assert torch.equal(rebuilt[rows, rows], mask[b, 0])


def test_kernel_choice():
    from torch.nn.attention import SDPBackend

    assert not uses_varlen("cpu", torch.bfloat16) and not uses_varlen("cuda", torch.float32)
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
        assert uses_varlen("cuda", torch.bfloat16)
    except ImportError:
        assert not uses_varlen("cuda", torch.bfloat16)
    # FlashAttention's SDPA kernel takes no mask: the masked fallback must never pin it
    assert SDPBackend.FLASH_ATTENTION not in masked_backends("cuda", torch.bfloat16)
    assert masked_backends("cpu", torch.float32) is None


# ---- the real `pretrain train` -------------------------------------------------------------------

STEPS = 5
RUN = [f"train.steps={STEPS}", "model.seq_length=64", "data.document_mask=true",
       "data.valid_fraction=0.05", "train.eval_interval=5", "train.eval_batches=2"]


@pytest.fixture(scope="module")
def short_documents(tiny_data, tmp_path_factory) -> dict[str, str]:
    """The tiny corpus cut into documents of 2-6 lines (~15-80 tokens), so that nearly every
    64-token sample packs two or more of them: the stdlib files themselves (median ~5,000
    tokens) leave a document boundary in one sample of ~100."""
    import json

    from conftest import TINY_CORPUS_FILES
    from pretrain.data import preprocess

    out = tmp_path_factory.mktemp("short_documents")
    lines = [line for path in TINY_CORPUS_FILES[:6]
             for line in path.read_text().splitlines() if line.strip()]
    sizes, documents, at = [2, 5, 3, 6], [], 0
    while at < len(lines):
        size = sizes[len(documents) % len(sizes)]
        documents.append("\n".join(lines[at:at + size]))
        at += size
    corpus = out / "short.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in documents))
    preprocess([corpus], tokenizer_path=tiny_data["tokenizer"], output_prefix=out / "short",
               workers=1, show_progress=False)
    return {"tokenizer": tiny_data["tokenizer"], "dataset": str(out / "short")}


@pytest.fixture(scope="module")
def masked_reference(short_documents, tmp_path_factory):
    from pretrain.testing.runs import train

    return train(tmp_path_factory.mktemp("docmask_ref"), short_documents, name="single",
                 overrides=RUN)


def first_step_loss(data: dict[str, str], *, masked: bool) -> float:
    """Step 1's loss of the tiny run recomputed here: its initial weights on its first global
    batch (2 micro-batches of 2 samples), with or without the documents' ids."""
    from pretrain.data.build import build_datasets

    cfg = load_config("configs/tiny.yaml", [*RUN, f"data.tokenizer={data['tokenizer']}",
                                            f"data.dataset={data['dataset']}"])
    train_data, _ = build_datasets(cfg.data, seq_length=64, train_samples=STEPS * 4,
                                   with_valid=False, log=lambda message: None)
    model = build_model(cfg.model, seed=cfg.train.seed)
    batches = micro_batches(train_data, micro_batch_size=2, dp_rank=0, dp_size=1,
                            document_eod=EOD)
    losses = []
    with torch.no_grad():
        for batch in (next(batches), next(batches)):
            assert int(batch["document_ids"].max()) >= 1  # the batch packs several documents
            ids = batch["document_ids"] if masked else None
            losses.append(model(batch["input_ids"], batch["labels"], document_ids=ids).item())
    return sum(losses) / 2


@pytest.mark.slow
def test_training_uses_the_document_mask(masked_reference, short_documents):
    """`data.document_mask=true` reaches the model: the run's first loss is the masked forward's,
    not the unmasked one's (they differ by far more than the 1e-6 the runs agree to)."""
    masked = first_step_loss(short_documents, masked=True)
    unmasked = first_step_loss(short_documents, masked=False)
    assert abs(masked_reference.losses[0] - masked) <= 1e-6 * masked
    assert abs(unmasked - masked) > 1e-4 * masked


def assert_trains_like(run, reference, tolerance=1e-5):
    from pretrain.testing.runs import rel_diff

    norms = [[r["grad_norm"] for r in x.records if r["kind"] == "train"] for x in (run, reference)]
    assert len(run.losses) == STEPS
    assert rel_diff(run.losses, reference.losses) < tolerance, (run.losses, reference.losses)
    assert rel_diff(*norms) < tolerance, norms
    evals = [[r["loss"] for r in x.records if r["kind"] == "eval"] for x in (run, reference)]
    assert len(evals[0]) == 1 and rel_diff(*evals) < tolerance, evals


# name: (ranks, overrides); tensor 2 with sequence parallelism under ZeRO-3, a 2-stage pipeline
# with compiled layers (the ids cross the stage boundary and enter the compiled graphs), 2
# context ranks (each holds half of every sequence and needs the whole one's ids)
LAYOUTS = {
    "tp2_sp_zero3": (2, ["parallel.tensor=2", "parallel.sequence_parallel=true",
                         "deepspeed=ds_configs/zero3.json"]),
    "pp2_compiled": (2, ["parallel.pipeline=2", "deepspeed=ds_configs/zero1.json",
                         "model.compile=true"]),
    "cp2": (2, ["parallel.context=2"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_masked_training_on_every_layout_equals_one_process(layout, masked_reference,
                                                            short_documents, tmp_path):
    from pretrain.testing.runs import train

    ranks, overrides = LAYOUTS[layout]
    run = train(tmp_path, short_documents, nprocs=ranks, name=layout,
                overrides=[*RUN, *overrides])
    assert_trains_like(run, masked_reference)
    if layout == "pp2_compiled":
        assert "decoder layers compiled by torch.compile" in run.stdout + run.stderr


def test_stage_activations_carry_integer_document_ids():
    from pretrain.model.pipeline import StageActivations

    hidden, ids = torch.randn(2, 3, 4), torch.zeros(2, 3, dtype=torch.long)
    wire = StageActivations(hidden=hidden, document_ids=ids).to_tuple()
    assert len(wire) == 2 and wire[1] is ids
    assert StageActivations.from_tuple(wire).document_ids is ids
    assert StageActivations(hidden=hidden).to_tuple() == (hidden,)  # off: the wire of before
    with pytest.raises(ValueError, match="expected 1 .hidden., or 2"):
        StageActivations.from_tuple((hidden, hidden, ids))


# ---- the installed `varlen_attn`, whatever its release -------------------------------------------

def _varlen_reference(query, key, value, cu_seq_q, max_q, *, causal, scale, gqa):
    """What FlashAttention's variable-length kernel computes, on the CPU: each [start, stop) of
    the cumulative lengths attends itself (causally), packed (tokens, heads, head_dim)."""
    assert cu_seq_q.dtype == torch.int32 and max_q >= int((cu_seq_q[1:] - cu_seq_q[:-1]).max())
    if key.shape[1] != query.shape[1]:
        assert gqa, "kv heads differ from q heads without enable_gqa: the kernel would refuse"
    out = torch.empty_like(query)
    for start, stop in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist()):
        q, k, v = (t[start:stop].transpose(0, 1)[None] for t in (query, key, value))
        out[start:stop] = F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1])[0].transpose(0, 1)
    return out


def varlen_attn_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                     return_aux=None):
    """torch 2.10's signature: causal by `is_causal`, no scale, no GQA."""
    return _varlen_reference(query, key, value, cu_seq_q, max_q, causal=is_causal, scale=None,
                             gqa=False)


def varlen_attn_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                     scale=None, window_size=(-1, -1)):
    """torch 2.11's signature: causal by `window_size=(-1, 0)`, a scale, no GQA."""
    assert tuple(window_size) in ((-1, -1), (-1, 0))
    return _varlen_reference(query, key, value, cu_seq_q, max_q,
                             causal=tuple(window_size) == (-1, 0), scale=scale, gqa=False)


def varlen_attn_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                     scale=None, window_size=(-1, -1), enable_gqa=False, seqused_k=None,
                     block_table=None, num_splits=None):
    """torch 2.12/2.13's signature: window size, scale and GQA."""
    assert tuple(window_size) in ((-1, -1), (-1, 0))
    return _varlen_reference(query, key, value, cu_seq_q, max_q,
                             causal=tuple(window_size) == (-1, 0), scale=scale, gqa=enable_gqa)


@pytest.mark.parametrize("release", [varlen_attn_2_10, varlen_attn_2_11, varlen_attn_2_13],
                         ids=["2.10", "2.11", "2.13"])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_the_bound_varlen_attn_equals_the_masked_reference(release, scale):
    """Each release's signature is called with what it takes (its causal keyword, GQA by
    repeated kv heads and the scale folded into q where it has none) and computes the masked
    path's attention."""
    from pretrain.model import documents

    binding = documents.bind_varlen(release)
    assert binding.problem is None
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1]])
    q = torch.randn(2, 4, 8, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 8, 16, generator=g, dtype=torch.float64) for _ in range(2))
    boundaries = varlen_boundaries(ids)
    got = documents.varlen_attention(q, k, v, boundaries, scale=scale, binding=binding)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(ids),
                                              enable_gqa=True, scale=scale)
    assert torch.allclose(got, expected, rtol=1e-12, atol=1e-12)


def test_an_unusable_varlen_attn_falls_back_to_the_mask_with_one_warning(monkeypatch):
    from pretrain.model import documents

    def no_causal(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None):
        raise AssertionError("never called")

    assert "torch" in documents.bind_varlen(None).problem  # missing from this torch
    binding = documents.bind_varlen(no_causal)
    assert "causal" in binding.problem
    monkeypatch.setattr(documents, "VARLEN", binding)
    monkeypatch.setattr(documents, "_warned", False)
    with pytest.warns(RuntimeWarning, match="causal") as caught:
        assert documents.document_kernel("cuda", torch.bfloat16) == "masked"
        assert documents.document_kernel("cuda", torch.bfloat16) == "masked"
    assert len(caught) == 1
    assert documents.document_kernel("cpu", torch.float32) == "masked"


def _count_boundaries(monkeypatch) -> list[int]:
    """Makes the CPU take the variable-length path (through a reference `varlen_attn` of the
    installed signature) and counts `varlen_boundaries` calls."""
    from pretrain.model import documents

    calls = []
    real = documents.varlen_boundaries

    def counted(ids):
        calls.append(1)
        return real(ids)

    monkeypatch.setattr(documents, "VARLEN", documents.bind_varlen(varlen_attn_2_13))
    monkeypatch.setattr(documents, "uses_varlen", lambda device_type, dtype: True)
    monkeypatch.setattr(documents, "varlen_boundaries", counted)
    return calls


@torch.no_grad()
@pytest.mark.parametrize("form", ["flat", "pipeline"])
def test_boundaries_are_computed_once_per_forward_not_per_layer(monkeypatch, form):
    cfg = tiny_cfg(seq_length=64, num_layers=3)
    build = build_model if form == "flat" else build_flat_pipeline
    model = build(cfg, seed=3).eval()
    tokens, ids = packed_sample(seed=4)
    masked = model(tokens[:, :-1], tokens[:, 1:], document_ids=ids)
    calls = _count_boundaries(monkeypatch)
    varlen = model(tokens[:, :-1], tokens[:, 1:], document_ids=ids)
    assert len(calls) == 1  # one micro-batch, three layers
    assert abs(varlen.item() - masked.item()) <= 1e-5 * masked.item()


def test_boundaries_stay_inside_a_stage():
    """A stage's layers hand each other the boundaries; what DeepSpeed sends to the next stage
    (`wire`) has the two tensors of before, whose shapes do not change between micro-batches."""
    from pretrain.model.pipeline import StageActivations

    hidden, ids = torch.randn(2, 3, 4), torch.zeros(2, 3, dtype=torch.long)
    boundaries = (torch.tensor([0, 3, 6], dtype=torch.int32), 3)
    inside = StageActivations(hidden=hidden, document_ids=ids, boundaries=boundaries).to_tuple()
    assert len(inside) == 4 and inside[2] is boundaries[0] and inside[3] == 3
    state = StageActivations.from_tuple(inside)
    assert state.boundaries == boundaries and state.document_ids is ids
    assert state.wire() == (hidden, ids)
