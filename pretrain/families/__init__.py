"""Model families: what distinguishes one decoder architecture from another, as data.

A family (`model.family`) is one module of this package holding a `Family`: its parameter table
(each parameter's shape, tensor-parallel dimension, initialisation and muP class, by the module
name that ends its Hugging Face name), the parameters of one decoder layer, its Hugging Face
adapter (architecture, `config.json` written and read), the modules the model builds for it (by
dotted path, bound when a model is built, so this package imports no torch) and, from the
table, the counts the planner and the telemetry use (`pretrain.arithmetic`). Generic code -
initialisation, sharding and gathering, muP's groups, checkpoint readers, the planner, the
layout rules - asks `family_of(cfg)` and names no projection; `tests/test_architecture_families.py`
keeps it so. Presets stay in `pretrain.config.MODEL_PRESETS` (read without this package), each
naming its family.

Adding a family: a module here with its `Family` (usually llama's table plus what differs), one
line in `FAMILIES`, its name in `pretrain.config.MODEL_FAMILIES`, the modules it names under
`pretrain/model/`, presets (and a recipe), and its tests against transformers (the checklist in
ARCHITECTURE.md).
"""
from __future__ import annotations

from pretrain.config import ModelConfig
from pretrain.families.base import (EMBED, EMBEDDING, HIDDEN, LM_HEAD, NORM, ONES, OUTPUT,
                                    RESIDUAL, NORMAL, ROPE_SCALING_FIELDS, ZEROS, AttentionWidths,
                                    Family,
                                    Parameter, check_pipeline_split, check_tensor_split)
from pretrain.families.llama import LLAMA
from pretrain.families.qwen3 import QWEN3
from pretrain.families.deepseek_v3 import DEEPSEEK_V3

# model.family -> its Family (one line per family; pretrain.config.MODEL_FAMILIES names the same)
FAMILIES: dict[str, Family] = {family.name: family
                               for family in (LLAMA, QWEN3, DEEPSEEK_V3)}


def family_of(cfg: ModelConfig) -> Family:
    """The `Family` of a model config (`model.family`)."""
    return FAMILIES[cfg.family]


def family_of_hf_config(hf: dict) -> Family | None:
    """The family whose Hugging Face architecture or model type a `config.json` names; None
    when none does (`pretrain.model.hf` says what is supported)."""
    architectures = hf.get("architectures") or []
    for family in FAMILIES.values():
        if hf.get("model_type") in family.hf_model_types or \
                any(a in family.hf_architectures for a in architectures):
            return family
    return None


def tensor_partition_dim_of(module: str) -> int | None:
    """The tensor-parallel dimension of the parameters of `module` (the name before `.weight`),
    the same in every family that has it; KeyError when none has it."""
    for family in FAMILIES.values():
        if module in family.parameters:
            return family.parameters[module].tp_dim
    raise KeyError(module)


def is_muon_matrix(name: str) -> bool:
    """Whether parameter `name` (a Hugging Face or pipeline-stage name) is a decoder layer's
    hidden matrix that Muon steps, in the family that has its module (`Parameter.muon`)."""
    parts = name.rsplit(".", 2)
    if len(parts) != 3 or parts[2] != "weight":
        return False
    return any(family.parameters[parts[1]].muon for family in FAMILIES.values()
               if parts[1] in family.parameters)


__all__ = ["AttentionWidths", "EMBED", "EMBEDDING", "FAMILIES", "Family", "HIDDEN", "LM_HEAD",
           "NORM", "NORMAL", "ONES", "OUTPUT", "Parameter", "RESIDUAL", "ROPE_SCALING_FIELDS",
           "ZEROS", "check_pipeline_split", "check_tensor_split",
           "family_of", "family_of_hf_config", "is_muon_matrix", "tensor_partition_dim_of"]
