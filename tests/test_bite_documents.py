"""Document masking with the settings that take another code path: recomputed layers
(model.activation_checkpointing) and muP's attention scale."""
from __future__ import annotations

import torch

from pretrain.model import build_model
from tests.test_document_mask import packed_sample, tiny_cfg


def test_recomputed_layers_keep_the_document_mask():
    """The loss and every gradient with every layer recomputed equal those without recompute
    (the same computation run twice: equal to fp32 rounding), and differ from the unmasked
    model's (the mask matters on this sample)."""
    tokens, ids = packed_sample(seed=3)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    results = {}
    for name, recompute, document_ids in (("plain", "none", ids), ("recomputed", "full", ids),
                                          ("unmasked", "full", None)):
        model = build_model(tiny_cfg(seq_length=64, activation_checkpointing=recompute), seed=3)
        loss = model(inputs, labels, document_ids=document_ids)
        loss.backward()
        results[name] = (loss.item(), {n: p.grad for n, p in model.named_parameters()})
    (loss, grads), (loss_re, grads_re) = results["plain"], results["recomputed"]
    assert abs(loss_re - loss) <= 1e-6 * loss
    for name, grad in grads.items():
        assert (grads_re[name] - grad).abs().max() <= 1e-5 * grad.abs().max(), name
    assert abs(results["unmasked"][0] - loss) > 1e-4 * loss


@torch.no_grad()
def test_mup_attention_scale_holds_under_the_document_mask():
    """One document spanning the sample: the document mask is the causal mask, so a muP model
    (softmax scale sqrt(base head dim)/head_dim, not SDPA's default) gives the same logits with
    and without document ids."""
    cfg = tiny_cfg(seq_length=64, hidden_size=256, ffn_hidden_size=768, parametrization="mup",
                   mup_base_width=64)
    model = build_model(cfg, seed=1).eval()
    tokens = torch.randint(3, 512, (2, 48), generator=torch.Generator().manual_seed(9))
    plain = model(tokens)
    masked = model(tokens, document_ids=torch.zeros_like(tokens))
    assert (masked - plain).abs().max() <= 1e-5 * plain.abs().max()


def test_the_loader_sends_each_samples_document_ids_computed_from_its_tokens(tmp_path):
    """The ids a training micro-batch carries are `document_ids` of the sample's own tokens
    (tests/test_document_mask.py's training test recomputes its reference through the same
    loader, so a loader that sends no ids, or the wrong ones, agrees with itself there)."""
    from pretrain.data import PackedSamples
    from pretrain.data.loader import micro_batches
    from pretrain.data.samples import document_ids
    from tests.test_data_blend import EOS, write_dataset

    samples = PackedSamples(write_dataset(tmp_path / "docs", documents=40, seed=3),
                            seq_length=64, split="train", valid_fraction=0.0, seed=1)
    batches = micro_batches(samples, micro_batch_size=2, dp_rank=0, dp_size=1, document_eod=EOS)
    for step in range(2):
        batch = next(batches)
        rows = [samples.tokens(index) for index in range(2 * step, 2 * step + 2)]
        expected = torch.from_numpy(document_ids(torch.stack(
            [torch.from_numpy(r.astype("int64")) for r in rows]).numpy(), eod=EOS))
        assert torch.equal(batch["input_ids"], torch.stack(
            [torch.from_numpy(r[:-1].astype("int64")) for r in rows]))
        assert torch.equal(batch["document_ids"], expected)
        assert int(expected.max()) >= 1  # the samples pack several documents
