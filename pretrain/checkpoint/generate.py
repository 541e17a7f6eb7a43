"""Continue a prompt from any checkpoint `load_weights` reads, on one process, in fp32.

A run directory, an engine step directory of any layout (consolidated offline), final/, an
`import-hf` or `convert-checkpoint` directory, or a Hugging Face Llama directory (e.g. written by
`export-hf`). Decoding is greedy (temperature 0) or sampled with temperature and top-k.
"""
from __future__ import annotations

import torch

from pretrain.checkpoint.weights import load_weights
from pretrain.data import Tokenizer
from pretrain.errors import CheckpointError
from pretrain.model import LlamaModel
from pretrain.model.hf import from_hf_state_dict


def generate(checkpoint: str, prompt: str, *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, seed: int = 0,
             tokenizer: str | None = None) -> tuple[str, list[int]]:
    """(completion text, completion token ids) for `prompt` from any checkpoint."""
    weights = load_weights(checkpoint)
    tokenizer_path = tokenizer or weights.tokenizer
    if tokenizer_path is None:
        raise CheckpointError(f"no tokenizer found with {weights.source}: pass --tokenizer")
    tok = Tokenizer.load(tokenizer_path)
    model = LlamaModel(weights.model)
    state = {k: v.float() for k, v in weights.state.items()}
    model.load_state_dict(from_hf_state_dict(state, weights.model))
    model.eval()
    ids = tok.encode(prompt)
    prompt_ids = torch.tensor([ids or [tok.bos_id]], dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        out = model.generate(prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                             top_k=top_k, generator=generator,
                             eos_id=tok.eos_id if tok.eos_id >= 0 else None)
    new_ids = out[0, prompt_ids.shape[1]:].tolist()
    return tok.decode(new_ids), new_ids
