"""Continue a prompt from any checkpoint `load_weights` reads, on one process: the GPU in bf16
when there is one, else the CPU in fp32; keys and values cached (`LlamaModel.generate`).

A run directory, an engine step directory of any layout (consolidated offline), final/, an
`import-hf` or `convert-checkpoint` directory, or a Hugging Face Llama directory (e.g. written by
`export-hf`). Decoding is greedy (temperature 0) or sampled with temperature and top-k.
"""
from __future__ import annotations

import torch

from pretrain.checkpoint.weights import Weights, load_weights
from pretrain.data import Tokenizer
from pretrain.config import Precision
from pretrain.errors import CheckpointError, ConfigError
from pretrain.model import DTYPES, LlamaModel
from pretrain.model.hf import from_hf_state_dict


def generate(checkpoint: str, prompt: str, *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, seed: int = 0, tokenizer: str | None = None,
             device: str = "auto", dtype: str = "auto") -> tuple[str, list[int]]:
    """(completion text, completion token ids) for `prompt` from any checkpoint."""
    model, tok, _, device = load_for_inference(checkpoint, tokenizer=tokenizer, device=device,
                                               dtype=dtype)
    ids = tok.encode(prompt)
    prompt_ids = torch.tensor([ids or [tok.bos_id]], dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        out = model.generate(prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                             top_k=top_k, generator=generator,
                             eos_id=tok.eos_id if tok.eos_id >= 0 else None)
    new_ids = out[0, prompt_ids.shape[1]:].tolist()
    return tok.decode(new_ids), new_ids


def load_for_inference(checkpoint: str, *, tokenizer: str | None = None, device: str = "auto",
                       dtype: str = "auto") -> tuple[LlamaModel, Tokenizer, Weights, str]:
    """(model in eval mode on its device, tokenizer, weights read, device) of any checkpoint."""
    weights = load_weights(checkpoint)
    tokenizer_path = tokenizer or weights.tokenizer
    if tokenizer_path is None:
        raise CheckpointError(f"no tokenizer found with {weights.source}: pass --tokenizer")
    tok = Tokenizer.load(tokenizer_path)
    device, torch_dtype = inference_placement(device, dtype)
    model = LlamaModel(weights.model)
    state = {k: v.float() for k, v in weights.state.items()}
    model.load_state_dict(from_hf_state_dict(state, weights.model))
    del state
    model.to(device=device, dtype=torch_dtype).eval()
    return model, tok, weights, device


def inference_placement(device: str, dtype: str) -> tuple[str, torch.dtype]:
    """(device, dtype) of `--device` / `--dtype`: auto is the GPU in bf16 when there is one,
    else the CPU in fp32 (bf16 matmuls run 50-80x slower than fp32 on CPUs without bf16
    instructions)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ConfigError(f"--device {device!r}: expected cpu, cuda or cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: no CUDA device here")
    if dtype == "auto":
        dtype = "fp32" if device == "cpu" else "bf16"
    return device, DTYPES[Precision(dtype)]
