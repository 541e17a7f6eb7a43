"""`Family` and `Parameter`: the form every family's description takes (`pretrain.families`)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from pretrain.config import PARTITION_METHODS, ModelConfig
from pretrain.errors import ConfigError

# the settings of each model.rope_scaling type: weights and the run reading them agree on these
# too when either uses it (Llama 3.2's factor 32 is not Llama 3.1's 8)
ROPE_SCALING_FIELDS: dict[str, tuple[str, ...]] = {
    "llama3": ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
               "rope_original_max_positions"),
}

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"

# initialisation of a parameter (`pretrain.model.llama._draw_init`)
ONES = "ones"  # norm gains
NORMAL = "normal"  # normal(0, init_std)
RESIDUAL = "residual"  # normal(0, init_std / sqrt(2 num_layers)): writes into the residual stream
ZEROS = "zeros"  # a buffer that starts at 0 (DeepSeek-V3's expert bias)

# muP classes (`pretrain.model.mup`)
HIDDEN = "hidden"  # both dimensions grow with width
EMBEDDING = "embedding"  # the token embedding (a tied lm_head is this one)
OUTPUT = "output"  # lm_head
NORM = "norm"  # gains (vectors)


@dataclass(frozen=True)
class Parameter:
    """One row of a family's parameter table: the parameters whose Hugging Face name ends in
    `<module>.weight`."""

    shape: Callable[[ModelConfig], tuple[int, ...]]  # unsharded, unpadded
    tp_dim: int | None  # split over tensor-parallel ranks (None: replicated)
    init: str  # ONES, NORMAL or RESIDUAL
    mup: str  # HIDDEN, EMBEDDING, OUTPUT or NORM
    # a hidden matrix train.optimizer=muon orthogonalises (a decoder layer's projections; not
    # embeddings, head, gains, nor the router, whose few rows pick experts)
    muon: bool = False


@dataclass(frozen=True)
class AttentionWidths:
    """The widths one decoder layer's attention works at, per token, unsharded (the planner's
    FLOPs, activations and exchanges, and the decoding cache): its queries and keys (heads x the
    q.k width; kv heads x it), values (kv heads x the value width), outputs (heads x the value
    width), the elements a token leaves in the layer's decoding cache, and the weight elements
    fused projections concatenate (`pretrain.model.llama.fused_projections`; 0: none)."""

    queries: int
    keys: int
    values: int
    outputs: int
    cached: int
    concatenated: int


def grouped_query_widths(cfg: ModelConfig) -> AttentionWidths:
    """Grouped-query attention's: heads x head_dim for queries and outputs, num_kv_heads x
    head_dim for keys and values, both cached; q, k and v fused into one matmul."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return AttentionWidths(queries=q, keys=kv, values=kv, outputs=q, cached=2 * kv,
                           concatenated=cfg.hidden_size * (q + 2 * kv))


@dataclass(frozen=True)
class Family:
    """What one decoder architecture is, for the code that builds, initialises, shards,
    converts and plans it."""

    name: str  # model.family
    hf_architectures: tuple[str, ...]  # transformers classes of its checkpoints (first: ours)
    hf_model_types: tuple[str, ...]  # config.json model_type values it reads
    differs: str  # what differs from a Llama 2 decoder, in a line (the README's table)
    # by module name: embed_tokens, q_proj, ..., norm, lm_head; an expert's projection may have
    # its own row, "experts.<module>" (its shape differs from the dense MLP's)
    parameters: dict[str, Parameter]
    # decoder layer `index`'s parameter names after model.layers.N. (its MLP dense or mixture)
    layer: Callable[[ModelConfig, int], list[str]]
    # the model's building blocks, "package.module:Class": "attention", "mlp" (dense), "moe"
    modules: dict[str, str]
    hf_config: Callable[[ModelConfig], tuple[str, dict[str, Any]]]  # (transformers class, fields)
    from_hf_config: Callable[[dict, str], dict[str, Any]]  # ModelConfig fields of a config.json
    # the last parameter that scales the queries linearly (muP's attention scale folds into
    # it on export: `pretrain.model.mup.fold_for_export`)
    query_scale: str = "self_attn.q_proj.weight"
    architecture_fields: tuple[str, ...] = field(default=())  # fields weights must agree on
    # features per token of attention's projection outputs the family normalises before RoPE
    # (sharded over tensor parallelism with the heads); each such norm saves its input for
    # backward, as the layer's norms do (the planner's activation memory)
    normed_projection_width: Callable[[ModelConfig], int] = lambda cfg: 0

    # the table rows (by last name part) that are module buffers saved with the weights, not
    # parameters: no gradient, no optimizer state (DeepSeek-V3's expert bias)
    buffers: tuple[str, ...] = ()

    # whether decoder layer `index`'s MLP is the mixture of experts (`modules["moe"]`) or the
    # dense one (`modules["mlp"]`); by default every layer's when model.num_experts > 0
    moe_layer: Callable[[ModelConfig, int], bool] = lambda cfg, index: cfg.num_experts > 0

    # the widths attention computes at and caches (`pretrain.arithmetic`, the planner)
    attention_widths: Callable[[ModelConfig], AttentionWidths] = grouped_query_widths

    # multi-token prediction module `depth`'s parameter names after model.layers.N. (N =
    # num_layers + depth: a decoder layer's and the module's own); None: the family has none
    # (model.mtp_depth is refused)
    mtp_layer: Callable[[ModelConfig, int], list[str]] | None = None

    def fields_to_agree(self, *cfgs: ModelConfig) -> tuple[str, ...]:
        """The `ModelConfig` fields weights and a run must agree on: `architecture_fields` and
        the settings of the rotary scaling either config uses."""
        scaling = [f for cfg in cfgs for f in ROPE_SCALING_FIELDS.get(cfg.rope_scaling, ())]
        return self.architecture_fields + tuple(dict.fromkeys(scaling))

    def mlp_module(self, cfg: ModelConfig, index: int) -> type:
        """The class of decoder layer `index`'s MLP: the mixture of experts or the dense one."""
        return self.module("moe" if self.moe_layer(cfg, index) else "mlp")

    def moe_layers(self, cfg: ModelConfig) -> list[int]:
        """The indices of the decoder layers whose MLP is the mixture of experts."""
        return [i for i in range(cfg.num_layers) if self.moe_layer(cfg, i)]

    def module(self, role: str) -> type:
        """The class of the building block `role` ("attention", ...), imported when asked: the
        family's description stays torch-free (the planner reads it), its modules are torch."""
        path, _, name = self.modules[role].partition(":")
        return getattr(importlib.import_module(path), name)

    # the rows `parameter` found, by name (the planner asks for each layer's names many times)
    _rows: dict[str, tuple[Parameter, bool]] = field(default_factory=dict, init=False,
                                                     repr=False, compare=False)
    # decoder layers' parameter counts, by the config's fields and the layer (`_layer_counts`)
    _counts: dict[tuple, tuple[int, int, int, int]] = field(default_factory=dict, init=False,
                                                            repr=False, compare=False)

    def parameter(self, name: str) -> Parameter:
        """The table row of parameter `name` (a Hugging Face or pipeline-stage name)."""
        return self._row(name)[0]

    def _row(self, name: str) -> tuple[Parameter, bool]:
        """(the table row of `name`, whether it is a buffer), found once per name."""
        found = self._rows.get(name)
        if found is None:
            found = self._rows[name] = (self._find_parameter(name),
                                        name.rsplit(".", 1)[-1] in self.buffers)
        return found

    def _find_parameter(self, name: str) -> Parameter:
        if name.endswith(EMBED.removeprefix("model.")):
            return self.parameters["embed_tokens"]
        parts = name.rsplit(".", 2)
        module = parts[-2] if len(parts) == 3 else parts[0]
        if ".experts." in name and f"experts.{module}" in self.parameters:
            return self.parameters[f"experts.{module}"]
        if ".shared_experts." in name and f"shared_experts.{module}" in self.parameters:
            return self.parameters[f"shared_experts.{module}"]
        if parts[-1] in self.parameters and parts[-1] in self.buffers:  # a tensor, not a weight
            return self.parameters[parts[-1]]
        if parts[-1] != "weight" or module not in self.parameters:
            raise KeyError(f"unknown parameter name {name!r}: not a {self.name} parameter")
        return self.parameters[module]

    def parameter_names(self, cfg: ModelConfig) -> list[str]:
        """Every parameter's Hugging Face name in module order (tied: no lm_head.weight)."""
        names = [EMBED]
        for i in range(cfg.num_layers):
            names += [f"model.layers.{i}.{n}" for n in self.layer(cfg, i)]
        names += self.mtp_parameter_names(cfg)
        names.append("model.norm.weight")
        if not cfg.tie_embeddings:
            names.append(LM_HEAD)
        return names

    def mtp_parameter_names(self, cfg: ModelConfig) -> list[str]:
        """The multi-token prediction modules' parameters (model.mtp_depth), numbered after
        the decoder layers as DeepSeek-V3's checkpoints number them."""
        if not cfg.mtp_depth:
            return []
        return [f"model.layers.{cfg.num_layers + k}.{n}" for k in range(cfg.mtp_depth)
                for n in self.mtp_layer(cfg, k)]

    def mtp_parameters(self, cfg: ModelConfig) -> tuple[int, int]:
        """(tensor-parallel-sharded, replicated) parameters of the multi-token prediction
        modules, buffers left out, from the table."""
        sharded = replicated = 0
        for name in self.mtp_parameter_names(cfg):
            row, buffer = self._row(name)
            if not buffer:
                if row.tp_dim is None:
                    replicated += _product(row.shape(cfg))
                else:
                    sharded += _product(row.shape(cfg))
        return sharded, replicated

    def layer_parameters(self, cfg: ModelConfig, index: int) -> tuple[int, int]:
        """(tensor-parallel-sharded, replicated) parameters of decoder layer `index`, from
        the table: every parameter counted once, whatever the family."""
        return self._layer_counts(cfg, index)[:2]

    def layer_matmul_parameters(self, cfg: ModelConfig, index: int, *,
                                active: bool = False) -> int:
        """The matrix parameters of decoder layer `index` (a token's, `active`: a mixture of
        experts counts experts_per_token of its experts)."""
        return self._layer_counts(cfg, index)[3 if active else 2]

    def _layer_counts(self, cfg: ModelConfig, index: int) -> tuple[int, int, int, int]:
        """(sharded, replicated, matrix, active matrix) parameters of decoder layer `index`,
        counted once per config and layer: the planner asks for every layer's counts of the
        same model for each of the hundreds of layouts it ranks."""
        try:  # the config's every field, as it is now
            key = (tuple(vars(cfg).items()), index)
            found = self._counts.get(key)
        except TypeError:  # a field that cannot be a key (not a ModelConfig's): counted, not kept
            key = found = None
        if found is None:
            found = self._count_layer(cfg, index)
            if key is not None:
                if len(self._counts) >= 4096:
                    self._counts.clear()
                self._counts[key] = found
        return found

    def _count_layer(self, cfg: ModelConfig, index: int) -> tuple[int, int, int, int]:
        sharded = replicated = matmul = 0
        active = 0
        for name in self.layer(cfg, index):
            row, buffer = self._row(name)
            count = _product(row.shape(cfg))
            if row.mup == HIDDEN:
                matmul += count
                active += count * cfg.experts_per_token / cfg.num_experts \
                    if ".experts." in name else count
            if buffer:  # carried with the weights, not trained
                continue
            if row.tp_dim is None:
                replicated += count
            else:
                sharded += count
        return sharded, replicated, int(matmul), int(active)

    def projection_shapes(self, cfg: ModelConfig, index: int = 0) -> list[tuple[int, int]]:
        """The unsharded shapes of decoder layer `index`'s projection matrices (its table's `muon`
        rows: attention's and the MLP's, each expert's own; not the router): what
        `train.optimizer: muon` steps and `train.fp8` multiplies in FP8."""
        return [tuple(self.parameter(name).shape(cfg)) for name in self.layer(cfg, index)
                if self.parameter(name).muon]


def _product(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


# ---- the model's shape rules: what a split over ranks needs (the model and the layout check) --

def check_tensor_split(model: ModelConfig, tensor: int) -> None:
    """Each tensor-parallel rank must hold whole query heads, whole kv heads and an equal slice
    of the MLP."""
    names = ("num_heads", "num_kv_heads", "ffn_hidden_size")
    if model.moe_ffn_hidden_size:  # fine-grained experts: each rank holds 1/tp of each
        names += ("moe_ffn_hidden_size",)
    for name in names:
        if getattr(model, name) % tensor:
            raise ConfigError(
                f"parallel.tensor={tensor}: must divide model.{name}={getattr(model, name)} "
                f"(each rank holds a whole share: tensor={tensor} must divide "
                f"{', '.join(names)})")


def check_pipeline_split(model: ModelConfig, pipeline: int, *, partition_method: str) -> None:
    """Every pipeline stage needs a decoder layer, cut by a partition method DeepSpeed knows."""
    if not isinstance(pipeline, int) or pipeline < 1:
        raise ConfigError(f"pipeline stages={pipeline!r}: must be a positive integer")
    if pipeline > model.num_layers:
        raise ConfigError(f"parallel.pipeline={pipeline}: exceeds model.num_layers="
                          f"{model.num_layers}: {pipeline} pipeline stages for model.num_layers="
                          f"{model.num_layers} leave stages idle; set parallel.pipeline <= "
                          f"{model.num_layers}")
    if partition_method not in PARTITION_METHODS:
        raise ConfigError(f"partition_method={partition_method!r}: choose one of "
                          f"{', '.join(PARTITION_METHODS)}")
