"""Hugging Face `MixtralForCausalLM` names for a mixture-of-experts model, both ways.

    ours                                      Mixtral checkpoint (save_pretrained, the Hub)
    model.layers.N.mlp.gate.weight   (E, h)   model.layers.N.block_sparse_moe.gate.weight
    model.layers.N.mlp.experts.M.gate_proj    model.layers.N.block_sparse_moe.experts.M.w1.weight
    model.layers.N.mlp.experts.M.up_proj      model.layers.N.block_sparse_moe.experts.M.w3.weight
    model.layers.N.mlp.experts.M.down_proj    model.layers.N.block_sparse_moe.experts.M.w2.weight

Everything else (attention, norms, embeddings) has Llama's names in both. Export writes that
layout (transformers 5 stacks the experts into `mlp.experts.gate_up_proj` (E, 2f, h, expert M's
[gate; up]) and `mlp.experts.down_proj` (E, h, f) as it loads them); import reads it and the
stacked one. Both views are lazy mappings: a name looked up reads one tensor, or one expert's
rows of a stacked one (`LazyTensors.slice`), so conversion still holds one tensor at a time.
"""
from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

import torch

from pretrain.config import ModelConfig

_EXPERT = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_STACKED = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_LEGACY = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.(gate\.weight|experts\.(\d+)\."
                     r"(w1|w2|w3)\.weight)$")
_LEGACY_PROJ = {"w1": "gate", "w3": "up", "w2": "down"}


def _shape(state: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    return tuple(state.shape(name)) if hasattr(state, "shape") else tuple(state[name].shape)


class MixtralExport(Mapping):
    """Our state (names of `pretrain.model.hf.expected_hf_keys`) under a Mixtral checkpoint's
    names: the layout `MixtralForCausalLM.save_pretrained` writes and the Hub's Mixtral
    checkpoints use (transformers stacks the experts when it loads them)."""

    def __init__(self, state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> None:
        self.state, self.cfg = state, cfg
        self.ours = {_checkpoint_name(name): name for name in state}

    def __iter__(self) -> Iterator[str]:
        return iter(self.ours)

    def __len__(self) -> int:
        return len(self.ours)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.state[self.ours[name]]

    def shape(self, name: str) -> tuple[int, ...]:
        return _shape(self.state, self.ours[name])


def _checkpoint_name(ours: str) -> str:
    """A Mixtral checkpoint's name of our parameter `ours` (attention, norms: unchanged)."""
    match = _EXPERT.match(ours)
    if match:
        layer, expert, proj = match.groups()
        w = {"gate": "w1", "down": "w2", "up": "w3"}[proj]
        return f"{layer}.block_sparse_moe.experts.{expert}.{w}.weight"
    if ours.endswith(".mlp.gate.weight"):
        return ours.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight")
    return ours


class MixtralImport(Mapping):
    """A Mixtral checkpoint's tensors (stacked or original layout) under our names."""

    def __init__(self, state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> None:
        self.state, self.cfg = state, cfg
        self.source: dict[str, tuple] = {}  # our name -> (their name, expert or None, part)
        f = cfg.expert_ffn_hidden_size
        for name in state:
            stacked, legacy = _STACKED.match(name), _LEGACY.match(name)
            if stacked:
                layer, kind = stacked.groups()
                parts = ("down",) if kind == "down_proj" else ("gate", "up")
                for e in range(_shape(state, name)[0]):
                    for i, part in enumerate(parts):
                        rows = slice(i * f, (i + 1) * f) if kind == "gate_up_proj" else None
                        self.source[f"{layer}.mlp.experts.{e}.{part}_proj.weight"] = (name, e, rows)
            elif legacy:
                layer, rest, expert, proj = legacy.groups()
                ours = (f"{layer}.mlp.gate.weight" if expert is None else
                        f"{layer}.mlp.experts.{expert}.{_LEGACY_PROJ[proj]}_proj.weight")
                self.source[ours] = (name, None, None)
            else:
                self.source[name] = (name, None, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self.source)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, name: str) -> torch.Tensor:
        theirs, expert, rows = self.source[name]
        if expert is None:
            return self.state[theirs]
        if hasattr(self.state, "slice"):  # read this expert only
            tensor = self.state.slice(theirs, dim=0, start=expert, stop=expert + 1)[0]
        else:
            tensor = self.state[theirs][expert]
        return (tensor if rows is None else tensor[rows]).contiguous()

    def shape(self, name: str) -> tuple[int, ...]:
        theirs, expert, rows = self.source[name]
        shape = _shape(self.state, theirs)
        if expert is None:
            return shape
        if rows is None:
            return shape[1:]
        return (shape[1] // 2, shape[2])
