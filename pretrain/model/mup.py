"""muP, the maximal update parametrization (Yang et al., Tensor Programs V / muTransfer): the one
rule of how each parameter's init, Adam learning rate and multiplier depend on the width.

With `model.parametrization: mup`, init_std and train.lr mean their values at the proxy width
`model.mup_base_width`; a wider model of the same depth keeps the same per-coordinate update
sizes, so the hyper-parameters tuned on the proxy transfer. The width multiplier is
m = hidden_size / mup_base_width. For Adam (muTransfer, Table 3 in its output-multiplier form):

    parameter (Hugging Face name)          init std              Adam lr   weight decay  multiplier
    model.layers.N.self_attn.{q,k,v}_proj  init_std / sqrt(m)    lr / m    wd
    model.layers.N.self_attn.o_proj        init_std / sqrt(m)    lr / m    wd
                                           / sqrt(2 num_layers)
    model.layers.N.mlp.{gate,up}_proj      init_std / sqrt(m)    lr / m    wd
    model.layers.N.mlp.down_proj           init_std / sqrt(m)    lr / m    wd
                                           / sqrt(2 num_layers)
    mixture of experts: mlp.gate (router), mlp.experts.M.{gate,up,down}_proj as the MLP's rows
    model.embed_tokens.weight              init_std              lr        wd
    lm_head.weight (tied: the embedding)   init_std              lr        wd            logits x 1/m
    *norm.weight (RMSNorm gains)           1                     lr        0
    attention softmax                                                                    sqrt(base_hd) / hd

`weight_decay` is the same number in every group, as in standard training; AdamW's decoupled
decay is lr x wd per step, so a hidden matrix's decay shrinks with its lr (1/m): the decay
relative to the update stays what it was on the proxy.

The softmax scale is 1/d_head (not 1/sqrt(d_head)), normalised so the proxy's head dimension
gives the standard 1/sqrt(d_head). At m = 1 (hidden_size == mup_base_width, head_dim == the base
head dim) every factor is 1: a muP model is the standard one, bitwise.

Rules are looked up by name: the Hugging Face names above, or a pipeline stage's names
("3.mlp.up_proj.weight", "tied_modules.embed.embed_tokens.weight"), which end the same way
(`pipeline_to_canonical_name` only changes their prefix). The module imports nothing of the
model, so the model modules and `optimizer_groups`' callers (the engine, a benchmark's plain
`torch.optim.AdamW`) all read the same table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from pretrain.config import ModelConfig, Parametrization

# each parameter's class is its family table's (`pretrain.families`); a mixture-of-experts
# layer's experts use the MLP's names, its router is mlp.gate.weight (hidden)
from pretrain.families import EMBED, EMBEDDING, HIDDEN, NORM, OUTPUT, family_of  # noqa: F401


@dataclass(frozen=True)
class Rule:
    """One parameter's factors relative to the standard parametrization at the proxy width."""

    kind: str  # HIDDEN, EMBEDDING, OUTPUT or NORM
    init_std: float  # multiplies the standard init std (norm gains are 1 whatever it is)
    lr: float  # multiplies train.lr
    weight_decay: bool  # whether train.weight_decay applies


def is_mup(cfg: ModelConfig) -> bool:
    return cfg.parametrization == Parametrization.MUP


def base_head_dim(cfg: ModelConfig) -> int:
    """The proxy's head dimension: model.mup_base_head_dim, or mup_base_width // num_heads."""
    return cfg.mup_base_head_dim or max(1, cfg.mup_base_width // cfg.num_heads)


def width_multiplier(cfg: ModelConfig) -> float:
    """m = hidden_size / mup_base_width under muP; 1 in the standard parametrization."""
    return cfg.hidden_size / cfg.mup_base_width if is_mup(cfg) else 1.0


def parameter_kind(name: str, cfg: ModelConfig) -> str:
    """HIDDEN, EMBEDDING, OUTPUT or NORM of a Hugging Face or pipeline parameter name, from the
    family's parameter table."""
    return family_of(cfg).parameter(name).mup


def rule(name: str, cfg: ModelConfig) -> Rule:
    """The `Rule` of parameter `name` (Hugging Face or pipeline name) under `cfg`."""
    kind = parameter_kind(name, cfg)
    decay = kind != NORM
    if kind == HIDDEN and is_mup(cfg):
        m = width_multiplier(cfg)
        return Rule(kind, init_std=1.0 / math.sqrt(m), lr=1.0 / m, weight_decay=decay)
    return Rule(kind, init_std=1.0, lr=1.0, weight_decay=decay)


def init_std_multiplier(name: str, cfg: ModelConfig) -> float:
    """Factor on the standard init std of `name` (`llama._draw_init` applies it)."""
    return rule(name, cfg).init_std


def output_multiplier(cfg: ModelConfig) -> float:
    """Factor on the logits: 1/m under muP (tied or untied lm_head), 1 otherwise."""
    return 1.0 / width_multiplier(cfg)


def softmax_scale(cfg: ModelConfig) -> float | None:
    """Attention's score scale: sqrt(base head dim) / head_dim under muP; None (SDPA's default
    1/sqrt(head_dim)) otherwise, and when the two are the same number."""
    if not is_mup(cfg) or base_head_dim(cfg) == cfg.head_dim:
        return None
    return math.sqrt(base_head_dim(cfg)) / cfg.head_dim


def optimizer_groups(model: torch.nn.Module | Iterable[tuple[str, torch.nn.Parameter]], *,
                     lr: float, weight_decay: float, cfg: ModelConfig) -> list[dict[str, Any]]:
    """torch-style parameter groups, each with its "lr" and "weight_decay", from the rule table.

    `model`: a `LlamaModel`, pipeline stages (`PipelineModule`, `SequentialPipeline`), or
    (name, parameter) pairs; parameters that do not require grad are left out. Standard: two
    groups, matrices (weight_decay) and norm gains (0), both at `lr`, in module order - the
    groups the engine always had. muP: one group per (lr, weight decay) - hidden matrices at lr/m,
    embeddings and lm_head at lr (group 0: the lr a run logs), norm gains at lr without decay -
    empty ones left out (a stage may hold no norm or no embedding), and a pipeline stage with
    fewer kinds than the whole model gets as many groups all the same, its largest cut in two
    (DeepSpeed's collectives are per group). A learning rate schedule that
    multiplies each group's base lr (LambdaLR) keeps the ratios. Each muP group also names its
    kinds ("mup": "hidden", "embedding+output", "norm")."""
    named = model.named_parameters() if isinstance(model, torch.nn.Module) else model
    if not is_mup(cfg):
        decay, no_decay = [], []
        for name, p in named:
            if p.requires_grad:
                (decay if rule(name, cfg).weight_decay else no_decay).append(p)
        return [{"params": decay, "lr": lr, "weight_decay": weight_decay},
                {"params": no_decay, "lr": lr, "weight_decay": 0.0}]
    groups: dict[tuple[float, bool], list[torch.nn.Parameter]] = {}
    kinds: dict[tuple[float, bool], set[str]] = {}
    for name, p in named:
        if not p.requires_grad:
            continue
        r = rule(name, cfg)
        key = (r.lr, r.weight_decay)
        groups.setdefault(key, []).append(p)
        kinds.setdefault(key, set()).add(r.kind)
    # the group at lr first (the lr a run logs is group 0's), then the hidden matrices, then
    # the norms
    order = sorted(groups, key=lambda key: (not key[1], key[0] != 1.0))
    found = [{"params": groups[key], "lr": lr * key[0],
              "weight_decay": weight_decay if key[1] else 0.0,
              "mup": "+".join(sorted(kinds[key]))} for key in order]
    return _as_many_groups_as_the_whole_model(found, cfg)


def _kind_examples(cfg: ModelConfig) -> list[str]:
    """The parameters of the model's embedding, final norm and of one layer of each kind it
    has (dense, mixture): every kind the whole model has."""
    family = family_of(cfg)
    kinds = {family.moe_layer(cfg, i): i for i in range(cfg.num_layers)}  # one of each
    return [EMBED, "model.norm.weight"] + [f"model.layers.{i}.{name}" for i in kinds.values()
                                            for name in family.layer(cfg, i)]


def _as_many_groups_as_the_whole_model(groups: list[dict[str, Any]],
                                       cfg: ModelConfig) -> list[dict[str, Any]]:
    """`groups` of one pipeline stage, split until there are as many as the whole model has.

    DeepSpeed's ZeRO-1/2 optimizers all-reduce one gradient norm per group across the pipeline
    stages: a stage with fewer groups (a middle stage holds neither embedding nor head, so no
    group at lr with weight decay) leaves the others waiting in a collective it never joins,
    and the run hangs before its first step. The missing group cannot be empty (DeepSpeed
    flattens each group and reads its first tensor), so the largest group is cut in two with
    the same hyper-parameters: the updates, and the sum of squares that is the norm, are
    unchanged."""
    wanted = len({(r.lr, r.weight_decay) for r in (rule(n, cfg) for n in _kind_examples(cfg))})
    groups = list(groups)
    while 0 < len(groups) < wanted:
        largest = max(range(len(groups)), key=lambda i: len(groups[i]["params"]))
        params = groups[largest]["params"]
        if len(params) < 2:
            break  # nothing left to cut (not a stage of a decoder model)
        half = len(params) // 2
        groups[largest:largest + 1] = [{**groups[largest], "params": params[:half]},
                                       {**groups[largest], "params": params[half:]}]
    return groups


def comparable_model_fields(model: dict[str, Any]) -> dict[str, Any]:
    """A model config dict (a checkpoint's or a run's `to_dict()`) with the fields as resuming
    compares them: absent parametrization (older checkpoints) is standard, and the muP base
    fields only count under muP; absent family, head_dim and rope_scaling are Llama's, and the
    rotary scaling's parameters only count with a scaling."""
    out = dict(model)
    out.setdefault("parametrization", Parametrization.STANDARD.value)
    # older checkpoints: a Llama without rotary scaling, heads of hidden_size / num_heads
    out.setdefault("family", "llama")
    out.setdefault("rope_scaling", "none")
    if out.get("head_dim") is None and out.get("num_heads"):
        out["head_dim"] = out["hidden_size"] // out["num_heads"]
    if out["rope_scaling"] == "none":  # the scaling's parameters mean nothing without it
        for name in ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                     "rope_original_max_positions"):
            out.pop(name, None)
    if out["parametrization"] != Parametrization.MUP.value:
        out.pop("mup_base_width", None)
        out.pop("mup_base_head_dim", None)
    return out


def describe(cfg: ModelConfig) -> str:
    """One line naming the parametrization, for logs and error messages."""
    if not is_mup(cfg):
        return "standard"
    return (f"mup (base width {cfg.mup_base_width}, m={width_multiplier(cfg):g}, base head dim "
            f"{base_head_dim(cfg)})")


def fold_for_export(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """`tensor` of parameter `name` with muP's multipliers folded in, for a model that has none
    (Hugging Face's class of the family): the parameter the family's queries are last scaled
    by (`Family.query_scale`: Llama's q_proj, Qwen3's q_norm gain, after which nothing
    normalises) x softmax_scale x sqrt(head_dim) (rotary is linear, so q's scores scale
    exactly), an untied lm_head x 1/m. Raises ValueError for a tied
    muP model: its one matrix is both the embedding and the head, so 1/m cannot be folded."""
    if not is_mup(cfg):
        return tensor
    check_exportable(cfg)
    scale = softmax_scale(cfg)
    if name.endswith(family_of(cfg).query_scale) and scale is not None:
        return tensor.float() * (scale * math.sqrt(cfg.head_dim))
    if name.endswith("lm_head.weight") and output_multiplier(cfg) != 1.0:
        return tensor.float() * output_multiplier(cfg)
    return tensor


def check_exportable(cfg: ModelConfig) -> None:
    """ValueError when muP's output multiplier cannot be folded into the weights (tied)."""
    if is_mup(cfg) and cfg.tie_embeddings and output_multiplier(cfg) != 1.0:
        raise ValueError(
            f"a muP model with tied embeddings (m={width_multiplier(cfg):g}) cannot be exported "
            "to Hugging Face Llama: its logits are multiplied by 1/m, and the one matrix that "
            "is both embedding and lm_head cannot carry that factor for only one of its uses")


def parametrization_mismatch(found: ModelConfig, expected: ModelConfig) -> str | None:
    """Why weights of a model configured as `found` mean another function in a run configured
    as `expected` (None: they mean the same): another parametrization or muP base."""
    fields = ("parametrization", "mup_base_width", "mup_base_head_dim")
    a = comparable_model_fields({f: _plain(getattr(found, f)) for f in fields})
    b = comparable_model_fields({f: _plain(getattr(expected, f)) for f in fields})
    if a == b:
        return None
    return (f"the weights were trained with parametrization {describe(found)}, the run is "
            f"{describe(expected)}: the same weights compute other logits under the other rule")


def _plain(value: Any) -> Any:
    return getattr(value, "value", value)
