"""Decoding past the rotary table (the window recomputed each step): the hidden state it
predicts from, not only the greedy tokens (a random model's argmax can hide a shifted window)."""
from __future__ import annotations

import torch

from tests.test_generate import PROMPT, _model


@torch.no_grad()
def test_the_recomputed_window_is_the_last_seq_length_tokens():
    model = _model(seq_length=8)
    ids = torch.cat((PROMPT, torch.randint(3, 500, (1, 7), generator=torch.Generator().manual_seed(3))),
                    dim=1)
    assert ids.shape[1] > 8
    got = model._last_hidden_recomputed(ids)
    expected = model.hidden_states(ids[:, -8:])[:, -1]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    shorter = model.hidden_states(ids[:, -7:])[:, -1]  # a window one token shorter differs
    assert not torch.allclose(shorter, expected, rtol=1e-4, atol=1e-5)
