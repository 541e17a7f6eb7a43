"""The typed config tree of a run: one source of truth for model, parallelism, data and training.

A run config is a YAML file whose top-level sections map onto the dataclasses below::

    model:      {preset: tiny, ...}        # architecture (ModelConfig); presets in MODEL_PRESETS
    parallel:   {tensor: 1, pipeline: 1}   # tensor / pipeline sizes; data parallel is derived
    data:       {...}                      # tokenizer, dataset prefix or blend (DataConfig)
    train:      {...}                      # steps, batch, optimizer, schedule (TrainConfig)
    checkpoint: {...}                      # where and how often to save (CheckpointConfig)
    logging:    {...}                      # step lines, sinks, log level (LoggingConfig)
    deepspeed:  ds_configs/zero2.json      # the DeepSpeed JSON whose "auto" fields we fill

Loading is strict: unknown keys, duplicate keys and wrong types are errors that name the field.
Each section validates itself in ``__post_init__``. What needs the world size (data-parallel
size, gradient accumulation, which tensor / pipeline / ZeRO combinations are supported) is
derived and checked by the run's resolver (`pretrain.resolve.run`, with the rules of `pretrain.resolve.layout`),
which settles every `auto` once and then freezes the config (`freeze`); the DeepSpeed JSON is
filled in `pretrain.resolve.ds_config`, and parameter and FLOP counts are in `pretrain.arithmetic`.

Paths. The fields a run reads (`INPUT_PATHS`: deepspeed, model.init_from, data.dataset, each
data.blend prefix, data.tokenizer) are made absolute when the config is loaded: written in a
config file, relative to that file's directory, so a config works from any working directory;
a `ds_configs/...` or `configs/...` path missing there is the project's shipped file
(`PROJECT_ROOT`), so a copied config still finds them. Given with `--set` or
`--deepspeed-config`, they are relative to the working directory, as a user typing them expects.
`run_dir`, which the run writes, is always relative to the working directory. The loaded config
holds only absolute paths, so the copy saved in a run directory resumes from anywhere.
`run_dir`, `data.dataset` and `data.blend` prefixes may also be `s3://bucket/prefix` (kept as
written: `pretrain.storage`); any other URL scheme, a typo like `s3:/bucket`, or a store URL in a
setting read from local files only is refused when the config is loaded, naming the setting.
"""
from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import math
import os
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pretrain import storage
from pretrain.errors import ConfigError, DataError


class Recompute(str, enum.Enum):
    """Activation checkpointing: which transformer layers recompute their forward in backward."""

    NONE = "none"  # keep all activations
    FULL = "full"  # recompute every layer
    EVERY_K = "every_k"  # recompute every k-th layer (model.activation_checkpointing_interval)
    SELECTIVE = "selective"  # every layer keeps its matmul and attention outputs, recomputes
    # the rest (norms, rotary, SwiGLU, adds): no matmul twice (pretrain/model/recompute.py)


class Parametrization(str, enum.Enum):
    """How init, learning rates and multipliers depend on width (`pretrain.model.mup`)."""

    STANDARD = "standard"  # the same init std and lr for every width
    MUP = "mup"  # maximal update parametrization: hyper-parameters tuned at mup_base_width transfer


class Precision(str, enum.Enum):
    AUTO = "auto"  # bf16 where the device computes it natively, else fp32 (pretrain/hardware.py)
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"  # dynamic loss scaling


class Fp8Recipe(str, enum.Enum):
    """`train.fp8`: torchao's float8 training recipe of the decoder blocks' projections
    (`pretrain.model.fp8`)."""

    NONE = "none"  # every matmul in train.precision
    TENSORWISE = "tensorwise"  # one dynamic scale per tensor; fsdp2 all-gathers weights in FP8
    ROWWISE = "rowwise"  # one scale per row, powers of two: closer to bf16, a slower kernel


class Engine(str, enum.Enum):
    """What shards, reduces and steps the model (`pretrain.training.engine.build_engine`)."""

    DEEPSPEED = "deepspeed"  # DeepSpeed's engine: ZeRO 0-3 from the DeepSpeed JSON, pipelines
    FSDP2 = "fsdp2"  # PyTorch's fully_shard (`pretrain.training.fsdp2`): ZeRO-3-like, its
    # pipelines through torch.distributed.pipelining (parallel.pipeline_schedule)


class SpikeAction(str, enum.Enum):
    """What a loss spike (train.loss_spike_factor x the running mean) does (`pretrain.training.spikes`)."""

    LOG = "log"  # a warning line; the update is applied
    SKIP = "skip"  # the update is dropped, as a non-finite step's is (flat models)
    ROLLBACK = "rollback"  # replay from the last checkpoint; a data problem quarantines the batch


class LRSchedule(str, enum.Enum):
    """The learning rate after warmup (`pretrain.training.engine.schedule_factor`)."""

    COSINE = "cosine"  # cosine from train.lr down to train.min_lr at train.steps
    WSD = "wsd"  # warmup-stable-decay: train.lr until train.decay_start_step, then down to min_lr
    LINEAR = "linear"  # a straight line from train.lr down to train.min_lr at train.steps
    CONSTANT = "constant"  # train.lr to the end (min_lr unused)


class Optimizer(str, enum.Enum):
    """What steps the parameters (`pretrain.training.muon` for muon)."""

    ADAMW = "adamw"  # AdamW for every parameter
    MUON = "muon"  # Muon for the decoder layers' projection matrices, AdamW for the rest


class DecayShape(str, enum.Enum):
    """WSD's decay, as a function of its progress p (0 -> 1) from train.lr to train.min_lr."""

    LINEAR = "linear"  # 1 - p
    SQRT = "sqrt"  # 1 - sqrt(p) ("1-sqrt"): a fast drop, then a long tail near min_lr
    COSINE = "cosine"  # (1 + cos(pi p)) / 2


# model.vocab_size: the vocabulary of data.tokenizer, read by the data checks before the run starts
# (`pretrain.data.build.check_run_data`); the config keeps the word until then.
VOCAB_AUTO = "auto"


class _Freezable:
    """A config section that refuses assignment once `freeze` has run: the resolved run's config
    (`pretrain.resolve.run`) is settled once and then only read."""

    _frozen = False

    def __setattr__(self, name: str, value: Any) -> None:
        if self._frozen:
            raise dataclasses.FrozenInstanceError(
                f"cannot assign {type(self).__name__}.{name}: the run config is resolved and "
                "frozen (pretrain.resolve.run.resolve_run settles every field once; change the config "
                "file or --set, or the rule in pretrain/resolve/run.py)")
        self.__dict__.pop("_key", None)  # `key()`'s text no longer says what the fields hold
        object.__setattr__(self, name, value)

    def key(self) -> str:
        """The section's fields as text (its repr), kept until a field is assigned: a hashable
        name of its values for caches the planner consults per layer of every layout."""
        key = self.__dict__.get("_key")
        if key is None:
            key = repr(self)
            object.__setattr__(self, "_key", key)
        return key


def freeze(cfg: "RunConfig") -> "RunConfig":
    """Make `cfg` and its sections refuse assignment from now on (`pretrain.resolve.run` calls it once
    every `auto` is settled); returns `cfg`."""
    for section in [cfg] + [getattr(cfg, f.name) for f in dataclasses.fields(cfg)]:
        if isinstance(section, _Freezable):
            object.__setattr__(section, "_frozen", True)
    return cfg


def _fail(section: str, name: str, value: Any, fix: str) -> None:
    raise ConfigError(f"{section}.{name}={value!r}: {fix}")


def nearest_name(word: str, names: Iterable[str], *, cutoff: float = 0.5) -> str | None:
    """The name closest to a misspelt `word` (difflib's ratio at least `cutoff`), or None."""
    close = difflib.get_close_matches(word, sorted(names), n=1, cutoff=cutoff)
    return close[0] if close else None


def did_you_mean(word: str, names: Iterable[str], *, cutoff: float = 0.5,
                 quote: bool = False) -> str:
    """' (did you mean X?)' for the name closest to a misspelt `word`, or ''."""
    close = nearest_name(word, names, cutoff=cutoff)
    if close is None:
        return ""
    return f" (did you mean {close!r}?)" if quote else f" (did you mean {close}?)"


REPORT_SINKS = ("tensorboard", "wandb", "mlflow")  # logging.report_to; metrics.jsonl is always on
LOG_LEVELS = ("debug", "info", "warning")  # logging.level, most verbose first


@dataclass
class ModelConfig(_Freezable):
    """Decoder architecture of one model family (`pretrain.families`: llama, qwen3,
    deepseek_v3). `preset`
    fills every field the YAML does not set."""

    preset: str | None = None  # one of MODEL_PRESETS; explicit fields override it
    family: str = "llama"  # llama (Llama 2/3, Mixtral with num_experts) | qwen3 (per-head q/k
    # RMSNorm before RoPE) | deepseek_v3 (multi-head latent attention, DeepSeek-V3's experts);
    # each family's parameter table and HF adapter in pretrain/families/
    vocab_size: int | str = 32000  # tokenizer's vocabulary (or more); padded for the embedding
    # (padded_vocab_size); auto: data.tokenizer's, read before the process group starts
    hidden_size: int = 4096  # d_model
    num_layers: int = 32  # decoder layers
    num_heads: int = 32  # query heads
    num_kv_heads: int = 32  # key-value heads; < num_heads is grouped-query attention
    head_dim: int = 0  # each head's width; 0: hidden_size // num_heads (settled when loaded);
    # may differ from it (Qwen3: num_heads x head_dim need not be hidden_size)
    ffn_hidden_size: int = 11008  # SwiGLU inner size
    seq_length: int = 4096  # training context length, also the rotary table length
    rope_theta: float = 10000.0  # rotary embedding base
    rope_scaling: str = "none"  # none | llama3: Llama 3.1's frequency-dependent rotary scaling
    # (wavelengths past original_max_positions / low_freq_factor divided by the factor, those
    # under original_max_positions / high_freq_factor kept, a smooth blend between)
    rope_scaling_factor: float = 8.0  # llama3: how much longer the context is than the original
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths > original / this are scaled whole
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths < original / this are unscaled
    rope_original_max_positions: int = 8192  # llama3: the context the base model was trained at
    norm_eps: float = 1e-5  # RMSNorm epsilon
    tie_embeddings: bool = False  # share input embedding and output projection
    init_std: float = 0.02  # normal init; output projections are scaled by 1/sqrt(2*num_layers)
    activation_checkpointing: Recompute = Recompute.NONE  # none | full | every_k | selective
    activation_checkpointing_interval: int = 1  # k for Recompute.EVERY_K
    vocab_pad_multiple: int = 128  # vocabulary rounded up to a multiple of this x tensor size
    init_from: str = ""  # initial weights instead of the seeded init: a Hugging Face Llama
    # directory, `pretrain import-hf` output, a run dir, step dir or final/ (same shapes)
    compile: bool = False  # torch.compile each decoder layer (regional; inductor, cached in
    # <run_dir>/torch_compile); parameters and checkpoints are unchanged
    fused_projections: bool = True  # q/k/v and gate/up each as one matmul; the parameters stay
    # separate (Hugging Face names and values in every format)
    loss_chunk_tokens: int = 4096  # lm_head + cross entropy over chunks of this many tokens of a
    # micro-batch, gradients computed chunk by chunk: the full fp32 logits never exist (0: whole)
    parametrization: Parametrization = Parametrization.STANDARD  # standard | mup: muP scales
    # hidden-matrix init and Adam lr, the logits and the attention scale with width (docs/model.md)
    mup_base_width: int = 256  # mup: the hidden_size init_std and train.lr were tuned at
    mup_base_head_dim: int = 0  # mup: the head_dim of that proxy (attention scale
    # sqrt(mup_base_head_dim) / head_dim); 0: mup_base_width // num_heads
    num_experts: int = 0  # > 0: each layer's MLP is a routed mixture of this many SwiGLU experts
    # of ffn_hidden_size each (Mixtral; pretrain/model/moe.py); 0: the dense MLP
    experts_per_token: int = 2  # top-k: the experts each token goes to (1..num_experts)
    moe_aux_loss_coeff: float = 0.01  # load-balancing loss weight (1.0 unweighted when balanced)
    moe_z_loss_coeff: float = 0.0  # router z-loss weight (mean logsumexp(router logits)^2)
    moe_capacity_factor: float = 0.0  # > 0: an expert takes at most ceil(factor * tokens * k /
    # num_experts) tokens of a forward, the rest are dropped and counted; 0: dropless
    moe_ffn_hidden_size: int = 0  # qwen3: each expert's SwiGLU inner size (fine-grained
    # experts, beside the dense layers' ffn_hidden_size); 0: ffn_hidden_size (llama: always)
    moe_layer_interval: int = 1  # qwen3: layer i's MLP is the mixture when (i + 1) % this == 0,
    # the dense MLP otherwise (Hugging Face's decoder_sparse_step); llama: 1
    moe_norm_topk_prob: bool = True  # renormalise the k chosen probabilities to sum to 1
    # (Mixtral, Qwen3-MoE's norm_topk_prob); false: the softmax's own (qwen3 only)
    moe_router: str = "softmax"  # softmax (Mixtral, Qwen3-MoE) | sigmoid (deepseek_v3: sigmoid
    # scores, an expert bias steering the choice only, group-limited top-k)
    moe_bias_update_rate: float = 0.0  # sigmoid: after each optimizer step every expert's bias
    # moves by this toward balance (auxiliary-loss-free balancing; 0: the bias stays)
    moe_groups: int = 1  # sigmoid: the experts form this many groups (DeepSeek-V3's n_group)
    moe_topk_groups: int = 1  # sigmoid: each token chooses among its best this many groups
    moe_routed_scaling_factor: float = 1.0  # sigmoid: the combine weights' factor
    num_shared_experts: int = 0  # deepseek_v3: a SwiGLU of this many x moe_ffn_hidden_size
    # inner features beside the routed experts, every token through it
    moe_first_dense_layers: int = 0  # deepseek_v3: the first this many layers' MLP stays dense
    # deepseek_v3's multi-head latent attention (pretrain/model/mla.py); DeepSeek-V3's sizes
    q_lora_rank: int = 1536  # queries through a rank-q_lora_rank latent (q_a_proj, its norm,
    # q_b_proj); 0: one q_proj
    kv_lora_rank: int = 512  # the latent keys and values are expanded from (the decoding cache)
    qk_nope_head_dim: int = 128  # each head's query/key features without rotary embedding
    qk_rope_head_dim: int = 64  # each head's rotary features (the key's shared by the heads);
    # model.head_dim is this width in deepseek_v3
    v_head_dim: int = 128  # each head's value width
    mtp_depth: int = 0  # deepseek_v3: multi-token prediction modules after the decoder
    # (DeepSeek-V3's num_nextn_predict_layers; pretrain/model/mtp.py): module k predicts the
    # token k + 1 after the next from module k - 1's hidden states and token k's embedding;
    # training only, generation uses the main head; 0: none
    mtp_loss_weight: float = 0.3  # lambda: the back-propagated loss is the LM loss + lambda x
    # the mean over the mtp_depth modules of their cross entropies (metrics: loss, mtp_loss)

    @property
    def expert_ffn_hidden_size(self) -> int:
        """Each expert's SwiGLU inner size."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    def __post_init__(self) -> None:
        if self.vocab_size != VOCAB_AUTO and (isinstance(self.vocab_size, str)
                                             or self.vocab_size < 1):
            _fail("model", "vocab_size", self.vocab_size,
                  f"must be a positive integer, or {VOCAB_AUTO} (the vocabulary of data.tokenizer)")
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "ffn_hidden_size", "seq_length", "activation_checkpointing_interval",
                     "vocab_pad_multiple"):
            if getattr(self, name) < 1:
                _fail("model", name, getattr(self, name), "must be a positive integer")
        if self.head_dim < 0:
            _fail("model", "head_dim", self.head_dim,
                  "must be a positive head width, or 0 (hidden_size // num_heads)")
        if self.family == "deepseek_v3":
            self._check_latent_attention()  # settles head_dim: the rotary width
        if not self.head_dim and self.hidden_size % self.num_heads:
            _fail("model", "hidden_size", self.hidden_size,
                  f"must be divisible by model.num_heads={self.num_heads} "
                  f"(e.g. hidden_size={self.num_heads * max(1, self.hidden_size // self.num_heads)})"
                  ", or set model.head_dim")
        if not self.head_dim:  # settled once: a saved config names the width it was built with
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            _fail("model", "num_kv_heads", self.num_kv_heads,
                  f"must divide model.num_heads={self.num_heads} (grouped-query attention)")
        if self.head_dim % 2:
            _fail("model", "hidden_size", self.hidden_size,
                  f"gives an odd head_dim={self.head_dim}; rotary embeddings need an even one")
        if self.loss_chunk_tokens < 0:
            _fail("model", "loss_chunk_tokens", self.loss_chunk_tokens,
                  "must be 0 (the whole micro-batch at once) or a positive number of tokens")
        if self.rope_theta <= 0 or self.norm_eps <= 0 or self.init_std <= 0:
            _fail("model", "rope_theta/norm_eps/init_std",
                  (self.rope_theta, self.norm_eps, self.init_std), "must be positive")
        self._check_experts()
        self._check_family()
        if self.mup_base_width < 1:
            _fail("model", "mup_base_width", self.mup_base_width,
                  "must be a positive integer: the hidden_size the hyper-parameters were tuned at")
        if self.mup_base_head_dim < 0:
            _fail("model", "mup_base_head_dim", self.mup_base_head_dim,
                  "must be a positive head dimension, or 0 (mup_base_width // num_heads)")
        if (self.parametrization == Parametrization.MUP and not self.mup_base_head_dim
                and self.mup_base_width < self.num_heads):
            _fail("model", "mup_base_width", self.mup_base_width,
                  f"is smaller than model.num_heads={self.num_heads}: set "
                  "model.mup_base_head_dim to the proxy's head dimension")

    def _check_experts(self) -> None:
        if self.num_experts < 0:
            _fail("model", "num_experts", self.num_experts,
                  "must be 0 (a dense MLP) or the number of experts per layer")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            _fail("model", "experts_per_token", self.experts_per_token,
                  f"must be between 1 and model.num_experts={self.num_experts}")
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_capacity_factor"):
            if getattr(self, name) < 0:
                _fail("model", name, getattr(self, name), "must be 0 (off) or positive")
        if self.moe_ffn_hidden_size < 0:
            _fail("model", "moe_ffn_hidden_size", self.moe_ffn_hidden_size,
                  "must be 0 (ffn_hidden_size) or each expert's inner size")
        if self.moe_layer_interval < 1:
            _fail("model", "moe_layer_interval", self.moe_layer_interval,
                  "must be a positive integer (1: every layer's MLP is the mixture)")
        if self.moe_router not in MOE_ROUTERS:
            _fail("model", "moe_router", self.moe_router,
                  f"choose one of {', '.join(MOE_ROUTERS)}")
        for name in ("moe_bias_update_rate", "num_shared_experts", "moe_first_dense_layers"):
            if getattr(self, name) < 0:
                _fail("model", name, getattr(self, name), "must be 0 (off) or positive")
        if self.mtp_depth < 0 or self.mtp_loss_weight < 0:
            _fail("model", "mtp_depth/mtp_loss_weight", (self.mtp_depth, self.mtp_loss_weight),
                  "must be 0 (off) or positive")
        if self.moe_routed_scaling_factor <= 0:
            _fail("model", "moe_routed_scaling_factor", self.moe_routed_scaling_factor,
                  "must be positive (1: the weights as chosen)")
        if self.moe_groups < 1:
            _fail("model", "moe_groups", self.moe_groups, "must be a positive integer")
        if not 1 <= self.moe_topk_groups <= self.moe_groups:
            _fail("model", "moe_topk_groups", self.moe_topk_groups,
                  f"must be between 1 and model.moe_groups={self.moe_groups}")
        if self.moe_router == "softmax":
            for name, default in (("moe_bias_update_rate", 0.0), ("moe_groups", 1),
                                  ("moe_topk_groups", 1), ("moe_routed_scaling_factor", 1.0)):
                if getattr(self, name) != default:
                    _fail("model", name, getattr(self, name),
                          "belongs to the sigmoid router (model.moe_router=sigmoid); the "
                          f"softmax router has {name}={default}")
        if self.num_experts and self.moe_groups > 1:
            if self.num_experts % self.moe_groups or self.num_experts // self.moe_groups < 2:
                _fail("model", "moe_groups", self.moe_groups,
                      f"must divide model.num_experts={self.num_experts} into groups of at "
                      "least 2 experts (a group scores by its 2 best)")
            allowed = self.moe_topk_groups * self.num_experts // self.moe_groups
            if self.experts_per_token > allowed:
                _fail("model", "experts_per_token", self.experts_per_token,
                      f"exceeds the {allowed} experts of model.moe_topk_groups="
                      f"{self.moe_topk_groups} groups")

    def _check_latent_attention(self) -> None:
        """deepseek_v3's multi-head latent attention: positive widths, an even rotary one
        (model.head_dim, the rotary table's width, is it), every head its own keys and values,
        and what the model does not implement refused."""
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                _fail("model", name, getattr(self, name), "must be a positive integer")
        if self.q_lora_rank < 0:
            _fail("model", "q_lora_rank", self.q_lora_rank,
                  "must be 0 (queries projected directly) or the rank of the query latent")
        if self.qk_rope_head_dim % 2:
            _fail("model", "qk_rope_head_dim", self.qk_rope_head_dim,
                  "must be even: rotary embeddings rotate pairs of features")
        if self.head_dim and self.head_dim != self.qk_rope_head_dim:
            _fail("model", "head_dim", self.head_dim,
                  f"must be 0 or model.qk_rope_head_dim={self.qk_rope_head_dim} in deepseek_v3 "
                  "(the rotary width; the attention widths are qk_nope_head_dim + "
                  "qk_rope_head_dim and v_head_dim)")
        self.head_dim = self.qk_rope_head_dim
        if self.num_kv_heads != self.num_heads:
            _fail("model", "num_kv_heads", self.num_kv_heads,
                  f"must equal model.num_heads={self.num_heads} in deepseek_v3: latent attention "
                  "expands keys and values for every head")
        if self.rope_scaling != "none":
            _fail("model", "rope_scaling", self.rope_scaling,
                  "deepseek_v3 supports only none here (DeepSeek's YaRN scaling is not "
                  "implemented)")
        if self.parametrization != Parametrization.STANDARD:
            _fail("model", "parametrization",
                  getattr(self.parametrization, "value", self.parametrization),
                  "deepseek_v3 supports only standard (muP's attention scale and its export "
                  "are not derived for latent attention)")

    def _check_family(self) -> None:
        if self.family not in MODEL_FAMILIES:
            _fail("model", "family", self.family,
                  f"choose one of {', '.join(MODEL_FAMILIES)}{did_you_mean(self.family, MODEL_FAMILIES)}")
        if self.rope_scaling not in ROPE_SCALINGS:
            _fail("model", "rope_scaling", self.rope_scaling,
                  f"choose one of {', '.join(ROPE_SCALINGS)}")
        if self.rope_scaling == "llama3":
            if self.rope_scaling_factor < 1 or self.rope_original_max_positions < 1:
                _fail("model", "rope_scaling_factor/rope_original_max_positions",
                      (self.rope_scaling_factor, self.rope_original_max_positions),
                      "must be at least 1")
            if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
                _fail("model", "rope_low_freq_factor/rope_high_freq_factor",
                      (self.rope_low_freq_factor, self.rope_high_freq_factor),
                      "need 0 < low < high (the blend between them divides by high - low)")
        if self.num_experts and self.family not in MOE_FAMILIES:
            _fail("model", "num_experts", self.num_experts,
                  f"a mixture of experts is the {', '.join(MOE_FAMILIES)} families' "
                  f"(Mixtral, Qwen3-MoE, DeepSeek-V3); model.family={self.family} has a dense MLP")
        if self.family == "deepseek_v3" and self.num_experts and self.moe_router != "sigmoid":
            _fail("model", "moe_router", self.moe_router,
                  "deepseek_v3's experts are routed by sigmoid scores: set model.moe_router=sigmoid")
        if self.family != "deepseek_v3":
            for name in ("num_shared_experts", "moe_first_dense_layers", "mtp_depth"):
                if getattr(self, name):
                    _fail("model", name, getattr(self, name),
                          f"is DeepSeek-V3's (model.family=deepseek_v3); model.family="
                          f"{self.family} has {name}=0")
            if self.moe_router != "softmax":
                _fail("model", "moe_router", self.moe_router,
                      f"model.family={self.family} routes by softmax (sigmoid: deepseek_v3)")
        if self.family == "llama":  # Mixtral: every layer's MLP, experts of ffn_hidden_size
            for name, value, default in (("moe_ffn_hidden_size", self.moe_ffn_hidden_size, 0),
                                         ("moe_layer_interval", self.moe_layer_interval, 1),
                                         ("moe_norm_topk_prob", self.moe_norm_topk_prob, True)):
                if value != default:
                    _fail("model", name, value,
                          f"is Qwen3-MoE's (model.family=qwen3); Mixtral (model.family=llama) "
                          f"has {name}={default}")

    def padded_vocab_size(self, tensor_parallel: int = 1) -> int:
        """Vocabulary rounded up so each tensor-parallel shard is a multiple of vocab_pad_multiple."""
        if self.vocab_size == VOCAB_AUTO:
            raise ConfigError("model.vocab_size=auto has not been read from data.tokenizer yet: "
                              "pretrain.data.build.check_run_data settles it before the model "
                              "is sized")
        multiple = self.vocab_pad_multiple * tensor_parallel
        return int(math.ceil(self.vocab_size / multiple) * multiple)


# model.family: the families of `pretrain.model.families` (the config names them without torch)
MODEL_FAMILIES = ("llama", "qwen3", "deepseek_v3")
MOE_FAMILIES = ("llama", "qwen3", "deepseek_v3")  # model.num_experts > 0: Mixtral, Qwen3-MoE,
# DeepSeek-V3
MOE_ROUTERS = ("softmax", "sigmoid")  # model.moe_router
ROPE_SCALINGS = ("none", "llama3")  # model.rope_scaling

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # tests: a few hundred thousand parameters, runs in milliseconds per step on CPU
    "tiny": dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 ffn_hidden_size=176, seq_length=64),
    # quickstart: ~16M parameters with an 8k vocabulary, trains visibly in minutes on 2 cores
    "small": dict(vocab_size=8192, hidden_size=384, num_layers=6, num_heads=6, num_kv_heads=2,
                  ffn_hidden_size=1024, seq_length=256, tie_embeddings=True),
    # GPT-2 small's width/depth with a Llama block
    "125m": dict(vocab_size=32000, hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=12,
                 ffn_hidden_size=2048, seq_length=2048),
    # TinyLlama-1.1B shape
    "1b": dict(vocab_size=32000, hidden_size=2048, num_layers=22, num_heads=32, num_kv_heads=4,
               ffn_hidden_size=5632, seq_length=2048),
    # Llama-2 shapes
    "7b": dict(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32,
               ffn_hidden_size=11008, seq_length=4096),
    "13b": dict(vocab_size=32000, hidden_size=5120, num_layers=40, num_heads=40, num_kv_heads=40,
                ffn_hidden_size=13824, seq_length=4096),
    "70b": dict(vocab_size=32000, hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                ffn_hidden_size=28672, seq_length=4096),
    # Llama 3.1 shapes: 128,256-token vocabulary, RoPE theta 500,000, llama3 rotary scaling
    # (factor 8 over an original 8192 positions; transformers' defaults for these checkpoints)
    "llama3_8b": dict(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                      num_kv_heads=8, ffn_hidden_size=14336, seq_length=8192,
                      rope_theta=500000.0, norm_eps=1e-5, rope_scaling="llama3"),
    "llama3_70b": dict(vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64,
                       num_kv_heads=8, ffn_hidden_size=28672, seq_length=8192,
                       rope_theta=500000.0, norm_eps=1e-5, rope_scaling="llama3"),
    # Qwen3 dense shapes (Qwen3-0.6B, -8B, -32B: head_dim 128 whatever the width; q/k RMSNorm)
    "qwen3_0_6b": dict(family="qwen3", vocab_size=151936, hidden_size=1024, num_layers=28,
                       num_heads=16, num_kv_heads=8, head_dim=128, ffn_hidden_size=3072,
                       seq_length=4096, rope_theta=1000000.0, norm_eps=1e-6,
                       tie_embeddings=True),
    "qwen3_8b": dict(family="qwen3", vocab_size=151936, hidden_size=4096, num_layers=36,
                     num_heads=32, num_kv_heads=8, head_dim=128, ffn_hidden_size=12288,
                     seq_length=4096, rope_theta=1000000.0, norm_eps=1e-6),
    "qwen3_32b": dict(family="qwen3", vocab_size=151936, hidden_size=5120, num_layers=64,
                      num_heads=64, num_kv_heads=8, head_dim=128, ffn_hidden_size=25600,
                      seq_length=4096, rope_theta=1000000.0, norm_eps=1e-6),
    # Qwen3-MoE shapes (Qwen3-30B-A3B, -235B-A22B): 128 fine-grained experts, top 8 renormalised,
    # every layer a mixture (ffn_hidden_size: transformers' intermediate_size, no dense layer)
    "qwen3_30b_a3b": dict(family="qwen3", vocab_size=151936, hidden_size=2048, num_layers=48,
                          num_heads=32, num_kv_heads=4, head_dim=128, ffn_hidden_size=6144,
                          seq_length=4096, rope_theta=1000000.0, norm_eps=1e-6,
                          num_experts=128, experts_per_token=8, moe_ffn_hidden_size=768,
                          moe_norm_topk_prob=True, moe_aux_loss_coeff=0.001),
    "qwen3_235b_a22b": dict(family="qwen3", vocab_size=151936, hidden_size=4096, num_layers=94,
                            num_heads=64, num_kv_heads=4, head_dim=128, ffn_hidden_size=12288,
                            seq_length=4096, rope_theta=1000000.0, norm_eps=1e-6,
                            num_experts=128, experts_per_token=8, moe_ffn_hidden_size=1536,
                            moe_norm_topk_prob=True, moe_aux_loss_coeff=0.001),
}


# How DeepSpeed's PipelineModule may cut layers into stages: "parameters" (balance parameter
# counts), "uniform" (equal numbers of layers), "type:DecoderLayerPipe" (balance decoder layers).
PARTITION_METHODS = ("parameters", "uniform", "type:DecoderLayerPipe")

# The pipeline schedules of `train.engine: fsdp2` (`torch.distributed.pipelining`), and the
# virtual stages (stages per rank) each takes: None, any number. DeepSpeed's engine runs 1f1b.
PIPELINE_SCHEDULES = {"1f1b": 1, "interleaved_1f1b": None, "zero_bubble": None, "zbv": 2,
                      "dualpipe_v": 2}

# How context parallelism runs attention (`pretrain.model.context_parallel`): "ulysses" swaps
# each rank's chunk for whole heads by all-to-all (tensor x context must divide the kv heads);
# "allgather" keeps each rank's queries and all-gathers the keys and values over the context
# group, the sequence cut into 2 x context chunks, rank r holding chunks r and 2 x context-1-r.
CONTEXT_KINDS = ("ulysses", "allgather")


@dataclass
class ParallelConfig(_Freezable):
    """Model-parallel sizes. Data parallel = world size / (tensor * context * pipeline)."""

    tensor: int = 1  # Megatron-style tensor parallel size (inside a node)
    pipeline: int = 1  # pipeline stages (across nodes): DeepSpeed's 1F1B, or fsdp2's schedule
    pipeline_schedule: str = "1f1b"  # one of PIPELINE_SCHEDULES (train.engine=fsdp2 for others)
    virtual_stages: int = 1  # pipeline stages per rank (interleaved schedules; zbv/dualpipe_v: 2)
    context: int = 1  # context parallelism (DeepSpeed-Ulysses): each sequence split into
    # this many contiguous chunks over as many ranks; attention swaps chunks for heads by an
    # all-to-all per layer (inside a node, next to tensor)
    context_kind: str = "ulysses"  # one of CONTEXT_KINDS: ulysses (all-to-all of heads; tensor
    # x context must divide the kv heads) or allgather (keys and values all-gathered, any head
    # count; each rank holds a head and a tail chunk of every sequence, equal causal work)
    sequence_parallel: bool = False  # shard norms/dropout along the sequence (needs tensor > 1)
    pipeline_partition: str = "parameters"  # one of PARTITION_METHODS
    expert: int = 1  # expert parallelism: each MoE layer's experts split over this many ranks
    # (each holds 1/expert of them), laid out over a stage's tensor x context x data ranks:
    # = tensor with whole experts, the tensor ranks (every engine layout); beyond them (from the
    # data ranks), DeepSpeed ZeRO-1/2 only, experts reduced over the ranks holding the same ones
    expert_tensor: int = 0  # ranks splitting each expert's matrices: 1 (whole experts) or
    # tensor; 0: tensor when expert is 1, else 1 (expert = tensor: the tensor ranks hold the experts)

    def __post_init__(self) -> None:
        for name in ("tensor", "pipeline", "context", "expert"):
            if getattr(self, name) < 1:
                _fail("parallel", name, getattr(self, name), "must be a positive integer")
        if self.expert_tensor not in (0, 1, self.tensor):
            _fail("parallel", "expert_tensor", self.expert_tensor,
                  f"must be 0 (auto), 1 or parallel.tensor={self.tensor}")
        if self.pipeline_partition not in PARTITION_METHODS:
            _fail("parallel", "pipeline_partition", self.pipeline_partition,
                  f"choose one of {', '.join(PARTITION_METHODS)}")
        if self.context_kind not in CONTEXT_KINDS:
            _fail("parallel", "context_kind", self.context_kind,
                  f"choose one of {', '.join(CONTEXT_KINDS)}")
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            _fail("parallel", "pipeline_schedule", self.pipeline_schedule,
                  f"choose one of {', '.join(PIPELINE_SCHEDULES)}")
        if self.virtual_stages < 1:
            _fail("parallel", "virtual_stages", self.virtual_stages, "must be a positive integer")
        fixed = PIPELINE_SCHEDULES[self.pipeline_schedule]
        if fixed is not None and self.virtual_stages != fixed:
            _fail("parallel", "virtual_stages", self.virtual_stages,
                  f"parallel.pipeline_schedule={self.pipeline_schedule} runs {fixed} stage"
                  f"{'s' if fixed > 1 else ''} per rank: set parallel.virtual_stages={fixed}")


# ---- data.blend entries: "WEIGHT PREFIX" ---------------------------------------------------

_BLEND_FORMAT = "write each entry as \"WEIGHT PREFIX\" (e.g. \"0.7 runs/data/code\") or " \
          "{weight: 0.7, prefix: runs/data/code}"


@dataclass(frozen=True)
class BlendEntry:
    weight: float  # normalised: the weights of a blend sum to 1
    prefix: str  # a .bin/.idx dataset prefix


def parse_blend(entries: Sequence[str | dict]) -> list[BlendEntry]:
    """The entries of `data.blend` with normalised weights; `DataError` naming the entry
    otherwise. Written here because the config checks a blend when it is loaded."""
    if isinstance(entries, (str, dict)):
        entries = [entries]
    pairs = [_parse_entry(entry) for entry in entries]
    total = sum(weight for weight, _ in pairs)
    return [BlendEntry(weight / total, prefix) for weight, prefix in pairs]


def _parse_entry(entry: str | dict) -> tuple[float, str]:
    if isinstance(entry, dict):
        if set(entry) != {"weight", "prefix"}:
            raise DataError(f"blend entry {entry!r} must have exactly the keys weight and "
                            f"prefix: {_BLEND_FORMAT}")
        raw_weight, prefix = entry["weight"], entry["prefix"]
    elif isinstance(entry, str) and len(entry.split(maxsplit=1)) == 2:
        raw_weight, prefix = entry.split(maxsplit=1)
    else:
        raise DataError(f"blend entry {entry!r} is not a weight and a prefix: {_BLEND_FORMAT}")
    try:
        weight = float(raw_weight)
    except (TypeError, ValueError):
        raise DataError(f"blend entry {entry!r}: weight {raw_weight!r} is not a number; "
                        f"{_BLEND_FORMAT}") from None
    if not (math.isfinite(weight) and weight > 0):
        raise DataError(f"blend entry {entry!r}: weight {weight} must be a positive finite "
                        "number")
    if not isinstance(prefix, str) or not prefix.strip():
        raise DataError(f"blend entry {entry!r} has no dataset prefix: {_BLEND_FORMAT}")
    return weight, prefix.strip()


@dataclass
class DataConfig(_Freezable):
    """Where the training tokens come from.

    `dataset` is the prefix of a preprocessed .bin/.idx pair (`pretrain preprocess`); or
    `blend` lists several prefixes with weights (see `pretrain.data.blend`). How they were built
    (`pretrain tokenizer` / `pretrain preprocess --corpus ...`) is not part of a run.
    """

    dataset: str = ""  # prefix of the .bin/.idx pair, e.g. runs/data/stdlib
    blend: list = field(default_factory=list)  # ["0.7 runs/data/code", "0.3 runs/data/prose"]
    tokenizer: str = ""  # sentencepiece .model path or Hugging Face tokenizer directory
    valid_fraction: float = 0.01  # documents held out for validation
    test_fraction: float = 0.0  # documents held out for testing (never trained or validated on)
    seed: int = 1234  # document and sample shuffle seed
    num_workers: int = 1  # DataLoader workers per rank
    # attention and rotary positions restart at each end-of-document token of a packed sample
    # (`pretrain.model.documents`); false: a sample is one sequence, across its documents
    document_mask: bool = False
    # Global sample numbers (positions in the run's sample stream, counted from 0 as
    # consumed_samples counts) never trained on; a rollback adds to the checkpoint's own list.
    exclude_samples: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0
               for n in self.exclude_samples):
            _fail("data", "exclude_samples", self.exclude_samples,
                  "must list sample numbers, integers >= 0 (as [12, 13])")
        for name in ("valid_fraction", "test_fraction"):
            if not 0.0 <= getattr(self, name) < 1.0:
                _fail("data", name, getattr(self, name), "must be in [0, 1)")
        if self.valid_fraction + self.test_fraction >= 1.0:
            _fail("data", "valid_fraction + test_fraction",
                  self.valid_fraction + self.test_fraction, "must be < 1 to leave training data")
        if self.blend:
            if self.dataset:
                _fail("data", "dataset", self.dataset, "give data.dataset or data.blend, not both")
            try:
                parse_blend(self.blend)
            except DataError as error:
                _fail("data", "blend", self.blend, str(error))
        if self.num_workers < 0:
            _fail("data", "num_workers", self.num_workers, "must be >= 0")


@dataclass(frozen=True)
class BatchRamp:
    """train.batch_ramp: the global batch grows from `start` samples by `increment` samples at a
    time, in equal stretches of the first `samples` samples trained on, up to
    train.global_batch_size (Megatron's rampup_batch_size [start, increment, samples]). The
    batch of a step is a function of the samples consumed before it
    (`pretrain/resolve/batch_ramp.py`), so a resume continues the ramp where it stopped."""

    start: int  # the first steps' global batch, samples
    increment: int  # samples added at each growth
    samples: int  # samples trained on until the batch reaches train.global_batch_size


@dataclass
class TrainConfig(_Freezable):
    """Optimisation. The global batch is micro_batch_size * grad_accum * data_parallel."""

    steps: int = 1000  # optimizer steps
    micro_batch_size: int = 1  # samples per rank per forward
    global_batch_size: int | None = None  # samples per optimizer step; None: micro * dp (accum 1)
    # {start, increment, samples}: the global batch ramps up from `start` by `increment` over the
    # first `samples` samples to global_batch_size (each size a multiple of micro_batch_size x
    # data parallel: gradient accumulation follows it); the lr schedule stays by step; null: none
    batch_ramp: BatchRamp | None = None
    lr: float = 3e-4  # peak learning rate, reached after warmup
    min_lr: float = 3e-5  # the schedule decays to this (cosine, wsd, linear)
    warmup_steps: int = 100  # linear warmup from 0
    # after warmup: cosine | wsd (warmup-stable-decay: lr until decay_start_step, then decayed to
    # min_lr at steps) | linear | constant (pretrain/training/engine.py `schedule_factor`)
    lr_schedule: LRSchedule = LRSchedule.COSINE
    decay_fraction: float = 0.1  # wsd: the fraction of steps spent decaying, at the end
    decay_shape: DecayShape = DecayShape.LINEAR  # wsd's decay: linear | sqrt (1-sqrt) | cosine
    # wsd: the step its decay starts at; null: steps * (1 - decay_fraction). Annealing a
    # checkpoint of step S over N steps: steps=S+N, decay_start_step=S, --start-from it
    decay_start_step: int | None = None
    weight_decay: float = 0.1  # AdamW's decoupled weight decay
    beta1: float = 0.9  # AdamW
    beta2: float = 0.95  # AdamW
    eps: float = 1e-8  # AdamW
    # adamw | muon: Muon (torch.optim.Muon's update, the whole matrix orthogonalised under every
    # layout) for the decoder layers' projections, AdamW (lr, weight_decay, betas) for the
    # embeddings, head, norms and router (pretrain/training/muon.py)
    optimizer: Optimizer = Optimizer.ADAMW
    muon_lr: float = 0.02  # Muon's peak lr (the schedule scales it as it scales train.lr)
    muon_weight_decay: float | None = None  # Muon's decoupled weight decay; null: weight_decay
    # bf16 | fp32: the dtype of Muon's Newton-Schulz iteration. bf16 is torch.optim.Muon's; fp32
    # keeps two layouts' updates as close as their gradients (bf16 rounds their last-bit
    # differences into ~1e-5 of the loss after 10 steps)
    muon_ns_dtype: str = "bf16"
    grad_clip: float = 1.0  # global gradient-norm clipping; 0 disables
    precision: Precision = Precision.AUTO  # auto | bf16 | fp32 | fp16; auto: pretrain/hardware.py
    # none | tensorwise | rowwise: the decoder blocks' projections multiply in FP8 (torchao; the
    # head, embedding and router stay in train.precision; pretrain/model/fp8.py). GPUs from
    # compute capability 8.9; a CPU emulates it (same rounding, fp32 speed)
    fp8: Fp8Recipe = Fp8Recipe.NONE
    # deepspeed | fsdp2: DeepSpeed's engine, or PyTorch's fully_shard over the same model, data,
    # schedule and checkpoints directory (pretrain/training/fsdp2.py; the DeepSpeed JSON still says the
    # ZeRO stage and offload, and settings fsdp2 cannot honour are refused before launch)
    engine: Engine = Engine.DEEPSPEED
    # fsdp2 only, HSDP: the data-parallel ranks (data x context) split into this many replica
    # groups; each unit is sharded over the ranks of one group and its gradient shard
    # all-reduced over the groups (pretrain/training/fsdp2.py). Must divide data x context; 1: one group
    fsdp2_replicas: int = 1
    seed: int = 1234  # model init and dropout
    eval_interval: int = 100  # steps between validation passes; 0 disables
    eval_batches: int = 10  # global batches per validation pass (capped by the validation set)
    # Faults (pretrain/training/faults.py): a NaN/Inf step is skipped; this many in a row stop the run.
    max_nonfinite_steps: int = 5
    loss_spike_factor: float = 2.0  # log a spike when a loss exceeds this x its running mean
    on_loss_spike: SpikeAction = SpikeAction.LOG  # log | skip | rollback (pretrain/training/spikes.py)
    straggler_interval: int = 0  # steps between the ranks' straggler checks (pretrain/training/stragglers.py); 0: off
    straggler_margin: float = 0.2  # slower than the median rank by this fraction (0.2: 20%)...
    straggler_patience: int = 3  # ...at this many checks in a row: the rank is named, with its host
    collective_timeout_minutes: float = 10.0  # a collective waiting longer: a rank is dead/stuck
    # No micro-batch or step for this long: every rank dumps its stacks and last collectives to
    # <run_dir>/hang/, one names the rank(s) the others wait for, all exit 75 (pretrain/training/hang.py).
    # null: half of collective_timeout_minutes; must stay below it.
    hang_timeout_minutes: float | None = None
    # How long the other ranks wait for one rank's file work (sample indices, a checkpoint's
    # manifest and pruning, final weights): minutes at 70B scale, beyond a collective's timeout.
    io_timeout_minutes: float = 120.0
    exit_after_minutes: float = 0.0  # wall-time limit: save and exit 75 after this; 0: none

    def __post_init__(self) -> None:
        if self.max_nonfinite_steps < 1 or self.loss_spike_factor <= 1.0 \
                or self.collective_timeout_minutes <= 0 or self.exit_after_minutes < 0 \
                or self.io_timeout_minutes <= 0:
            _fail("train", "max_nonfinite_steps/loss_spike_factor/collective_timeout_minutes/"
                  "exit_after_minutes/io_timeout_minutes",
                  (self.max_nonfinite_steps, self.loss_spike_factor,
                   self.collective_timeout_minutes, self.exit_after_minutes,
                   self.io_timeout_minutes),
                  "need max_nonfinite_steps >= 1, loss_spike_factor > 1, "
                  "collective_timeout_minutes > 0, exit_after_minutes >= 0 and "
                  "io_timeout_minutes > 0")
        if self.hang_timeout_minutes is not None and not \
                0 < self.hang_timeout_minutes < self.collective_timeout_minutes:
            _fail("train", "hang_timeout_minutes", self.hang_timeout_minutes,
                  f"must be > 0 and below train.collective_timeout_minutes="
                  f"{self.collective_timeout_minutes:g} (the watchdog must name the hung rank "
                  "before the collective times out), or null for half of it")
        if self.straggler_interval < 0 or self.straggler_margin <= 0 \
                or self.straggler_patience < 1:
            _fail("train", "straggler_interval/straggler_margin/straggler_patience",
                  (self.straggler_interval, self.straggler_margin, self.straggler_patience),
                  "need straggler_interval >= 0 (0: off), straggler_margin > 0 (a fraction of "
                  "the median: 0.2 is 20% slower) and straggler_patience >= 1")
        if self.fsdp2_replicas < 1 or (self.fsdp2_replicas > 1
                                       and Engine(self.engine) is not Engine.FSDP2):
            _fail("train", "fsdp2_replicas", self.fsdp2_replicas,
                  "must be >= 1, and above 1 only with train.engine=fsdp2 (HSDP is FSDP2's; "
                  "DeepSpeed's ZeRO shards over every data-parallel rank)")
        for name in ("steps", "micro_batch_size", "eval_batches"):
            if getattr(self, name) < 1:
                _fail("train", name, getattr(self, name), "must be a positive integer")
        if self.global_batch_size is not None and self.global_batch_size < 1:
            _fail("train", "global_batch_size", self.global_batch_size, "must be positive or null")
        if self.batch_ramp is not None:
            self._check_batch_ramp(self.batch_ramp)
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            _fail("train", "min_lr", self.min_lr, f"needs 0 <= min_lr <= lr={self.lr} and lr > 0")
        if self.muon_ns_dtype not in ("bf16", "fp32"):
            _fail("train", "muon_ns_dtype", self.muon_ns_dtype, "must be bf16 or fp32")
        if self.muon_lr <= 0 or (self.muon_weight_decay or 0.0) < 0:
            _fail("train", "muon_lr/muon_weight_decay", (self.muon_lr, self.muon_weight_decay),
                  "need muon_lr > 0 and muon_weight_decay >= 0 (or null: train.weight_decay)")
        if self.warmup_steps < 0 or self.eval_interval < 0 or self.grad_clip < 0:
            _fail("train", "warmup_steps/eval_interval/grad_clip",
                  (self.warmup_steps, self.eval_interval, self.grad_clip), "must be >= 0")
        if not 0.0 <= self.decay_fraction <= 1.0:
            _fail("train", "decay_fraction", self.decay_fraction,
                  "must be within [0, 1] (the fraction of train.steps spent decaying)")
        if self.decay_start_step is not None:
            if LRSchedule(self.lr_schedule) is not LRSchedule.WSD:
                _fail("train", "decay_start_step", self.decay_start_step,
                      f"only train.lr_schedule=wsd has a decay start (this run's is "
                      f"{LRSchedule(self.lr_schedule).value}): set train.lr_schedule=wsd or "
                      "drop it")
            if not self.warmup_steps <= self.decay_start_step <= self.steps:
                _fail("train", "decay_start_step", self.decay_start_step,
                      f"must be within [train.warmup_steps={self.warmup_steps}, "
                      f"train.steps={self.steps}]: the decay starts after warmup and ends at "
                      "train.steps (to anneal a checkpoint of step S over N steps: "
                      "train.steps=S+N, train.decay_start_step=S)")
        elif LRSchedule(self.lr_schedule) is LRSchedule.WSD \
                and self.decay_start < self.warmup_steps:
            _fail("train", "decay_fraction", self.decay_fraction,
                  f"decays from step {self.decay_start}, inside the {self.warmup_steps} warmup "
                  "steps: lower train.decay_fraction or train.warmup_steps")

    def _check_batch_ramp(self, ramp: BatchRamp) -> None:
        """What train.batch_ramp needs of the train section alone (the sizes' divisibility by
        micro-batches x data parallel is the layout's: `pretrain/resolve/batch_ramp.py`)."""
        if self.global_batch_size is None:
            _fail("train", "batch_ramp", ramp, "needs train.global_batch_size, the size the "
                  "ramp ends at")
        if min(ramp.start, ramp.increment, ramp.samples) < 1:
            _fail("train", "batch_ramp", ramp, "start, increment and samples must be positive")
        if ramp.start >= self.global_batch_size:
            _fail("train", "batch_ramp.start", ramp.start, f"must be below "
                  f"train.global_batch_size={self.global_batch_size} (or drop train.batch_ramp)")
        if (self.global_batch_size - ramp.start) % ramp.increment:
            _fail("train", "batch_ramp.increment", ramp.increment,
                  f"must divide train.global_batch_size - batch_ramp.start = "
                  f"{self.global_batch_size} - {ramp.start}: the ramp ends at the global batch")

    @property
    def decay_start(self) -> int:
        """wsd's last step at train.lr (decay_start_step, null resolved): its decay's updates
        are the steps after it."""
        if self.decay_start_step is not None:
            return self.decay_start_step
        return self.steps - round(self.steps * self.decay_fraction)

    @property
    def hang_timeout(self) -> float:
        """hang_timeout_minutes, null resolved (half of collective_timeout_minutes)."""
        return self.hang_timeout_minutes or self.collective_timeout_minutes / 2


@dataclass
class CheckpointConfig(_Freezable):
    save_interval: int = 0  # steps between DeepSpeed checkpoints; 0: only the final one
    save_interval_minutes: float = 0.0  # also save every this many minutes of wall time; 0: off
    keep_last: int = 2  # DeepSpeed checkpoints kept (older ones deleted)
    keep_every: int = 0  # also keep forever every checkpoint whose step is a multiple; 0: none
    save_final: bool = True  # write a plain `final/` checkpoint that `pretrain generate` loads
    async_save: bool = True  # a thread writes each save while training goes on: GPU state from
    # one reused host buffer per rank, state already in host memory (CPU ranks, CPU offload) in
    # place, the next optimizer step waiting for the write; the save completes (manifest,
    # `latest`) at the first step all ranks' files are on disk, else at the next save, a stop or
    # the end of the run; false: training waits for every save's files

    def __post_init__(self) -> None:
        if self.save_interval < 0 or self.keep_last < 1 or self.keep_every < 0 \
                or self.save_interval_minutes < 0:
            _fail("checkpoint", "save_interval/keep_last/keep_every/save_interval_minutes",
                  (self.save_interval, self.keep_last, self.keep_every, self.save_interval_minutes),
                  "need save_interval >= 0, keep_last >= 1, keep_every >= 0 and "
                  "save_interval_minutes >= 0")


@dataclass
class LoggingConfig(_Freezable):
    log_interval: int = 1  # steps between step lines (metrics.jsonl gets every step)
    report_to: list[str] = field(default_factory=lambda: ["tensorboard", "wandb"])  # sinks
    # besides metrics.jsonl (always written): tensorboard (<run_dir>/tensorboard), wandb, mlflow
    level: str = "info"  # info | warning (our notes hidden) | debug (DeepSpeed's INFO and DEBUG
    # lines too); step and eval lines are printed at every level
    mlflow_tracking_uri: str = ""  # "": a SQLite store, <run_dir>/mlruns/mlflow.db; else as given
    mlflow_experiment: str = "pretrain"  # MLflow experiment of the run (run name: run_dir's name)
    wandb_project: str = ""  # wandb project; with a key (WANDB_API_KEY or `wandb login`),
    # "auto" mode goes online
    wandb_mode: str = "auto"  # auto (online with a project and a key, else offline) | offline |
    # online | disabled; offline runs are kept under <run_dir>/wandb for `wandb sync`
    peak_tflops: float = 0.0  # per-device peak for MFU; 0: taken from the accelerator's table
    progress_bar: bool = True
    curves: bool = True  # draw <run_dir>/curves.png (matplotlib) after each eval and at the end
    profile_steps: str = ""  # "a:b": torch profiler Chrome trace of steps a..b (1-based,
    # inclusive), one file per rank under <run_dir>/profile; "" disables
    memory_snapshot: int = 0  # N > 0: record the CUDA allocator's history and write its
    # snapshot (pytorch.org/memory_viz) after step N and on out-of-memory, per rank under
    # <run_dir>/memory (pretrain/training/memory_snapshot.py); a no-op on CPU ranks; 0: off

    def __post_init__(self) -> None:
        if self.log_interval < 1:
            _fail("logging", "log_interval", self.log_interval, "must be >= 1")
        if self.memory_snapshot < 0:
            _fail("logging", "memory_snapshot", self.memory_snapshot,
                  "must be 0 (off) or the step after which to write the snapshot")
        if self.wandb_mode not in ("auto", "offline", "online", "disabled"):
            _fail("logging", "wandb_mode", self.wandb_mode,
                  "use auto, offline, online or disabled")
        for sink in self.report_to:
            if sink not in REPORT_SINKS:
                _fail("logging", "report_to", self.report_to,
                      f"unknown sink {sink!r}{did_you_mean(sink, REPORT_SINKS)}: choose from "
                      f"{', '.join(REPORT_SINKS)} (metrics.jsonl is always written)")
        if self.level not in LOG_LEVELS:
            _fail("logging", "level", self.level,
                  f"unknown level{did_you_mean(str(self.level), LOG_LEVELS)}: use "
                  f"{', '.join(LOG_LEVELS)}")
        self.profile_range()

    def profile_range(self) -> tuple[int, int] | None:
        """(first, last) step of logging.profile_steps, or None when profiling is off."""
        if not self.profile_steps:
            return None
        first, sep, last = str(self.profile_steps).partition(":")
        if not (sep and first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last)):
            _fail("logging", "profile_steps", self.profile_steps,
                  "use FIRST:LAST with 1 <= FIRST <= LAST, e.g. 3:5")
        return int(first), int(last)


@dataclass
class EvalConfig(_Freezable):
    """Downstream tasks during training, with lm-eval-harness (pretrain/evaluation).

    Run on the model as it is sharded, every rank taking part; the scores go to metrics.jsonl,
    the sinks, the run line and curves.png."""

    tasks: list[str] = field(default_factory=list)  # lm-eval task names, e.g. [python_next_line]
    # (a local task; standard ones such as hellaswag need their dataset in the HF cache)
    interval: int = 0  # steps between evaluations of eval.tasks; 0: after the last step only
    limit: int | None = None  # the first N examples of each task; null: all

    def __post_init__(self) -> None:
        if self.interval < 0:
            _fail("eval", "interval", self.interval, "must be >= 0 (0: after the last step only)")
        if self.limit is not None and self.limit < 1:
            _fail("eval", "limit", self.limit, "must be a positive number of examples, or null")
        if len(set(self.tasks)) != len(self.tasks):
            _fail("eval", "tasks", self.tasks, "name each task once")


@dataclass
class RunConfig(_Freezable):
    run_dir: str = "runs/default"  # resolved config, checkpoints, logs, metrics.jsonl
    deepspeed: str = "ds_configs/zero2.json"  # DeepSpeed JSON with "auto" fields
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(dataclasses.asdict(self))

    def save(self, path: str | Path) -> None:
        """Write the resolved config as YAML that `load_config` reads back."""
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


# ---- loading ----------------------------------------------------------------------------------

class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML loader that rejects duplicate keys (PyYAML silently keeps the last one)."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False):
    mapping = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in mapping:
            raise ConfigError(f"duplicate key {key!r} at line {key_node.start_mark.line + 1}: "
                              "each key may appear once per section")
        mapping[key] = loader.construct_object(value_node, deep=deep)
    return mapping


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's problem with its line and column (1-based), on one line."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
    return f"{problem}{where}" + (f" ({context})" if context else "")


def _json_problem(exc: json.JSONDecodeError) -> str:
    return f"{exc.msg} at line {exc.lineno} column {exc.colno}"


# a file's language: (its parser, the error the parser raises, that error on one line)
_LANGUAGES = {"JSON": (json.loads, json.JSONDecodeError, _json_problem),
              "YAML": (yaml.safe_load, yaml.YAMLError, _yaml_problem)}


def read_user_file(path: str | Path, what: str, *, language: str, hint: str = "",
                   expect: str = "", parse: Callable[[str], Any] | None = None) -> Any:
    """The parsed contents of a JSON or YAML file (`language`) the user named, or one
    ConfigError naming it as `what` (`run config 'x.yaml'`): it does not exist (then `hint`,
    what to pass instead), cannot be read as text (a directory, not UTF-8, no permission), is
    not valid JSON/YAML (with the line and column), or is not a mapping where `expect` describes
    one. `parse` replaces the language's parser (the run config's refuses duplicate keys)."""
    path = Path(path)
    name = f"{what} {str(path)!r}"
    if not path.exists():
        raise ConfigError(f"{name} does not exist" + (f": {hint}" if hint else ""))
    try:
        text = path.read_text()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{name} cannot be read: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{name} cannot be read: {exc.strerror}") from None
    default_parse, error, problem = _LANGUAGES[language]
    try:
        data = (parse or default_parse)(text)
    except error as exc:
        raise ConfigError(f"{name} is not valid {language}: {problem(exc)}") from None
    if expect and not isinstance(data, dict):
        raise ConfigError(f"{name}: expected {expect}")
    return data


def _to_plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    return value


def _coerce(path: str, value: Any, annotation: Any) -> Any:
    """Check `value` against a field annotation; convert only lossless cases (int->float, enums)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        errors = []
        for alternative in (a for a in args if a is not type(None)):  # int | str: 8192 or auto
            try:
                return _coerce(path, value, alternative)
            except ConfigError as error:
                errors.append(error)
        raise errors[0]
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping (section), got {value!r}")
        return _build(annotation, value, path)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        try:
            return annotation(value)
        except ValueError:
            choices = ", ".join(e.value for e in annotation)
            raise ConfigError(f"{path}={value!r}: choose one of {choices}") from None
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}={value!r}: expected a list")
        return [_coerce(f"{path}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str):
        try:  # YAML 1.1 reads 3e-4 as a string
            return float(value)
        except ValueError:
            pass
    if annotation in (int, float, str, bool):
        if type(value) is not annotation:
            raise ConfigError(f"{path}={value!r}: expected {annotation.__name__}, "
                              f"got {type(value).__name__}")
        return value
    return value


# What other stacks (Megatron, Hugging Face, GPT-NeoX) call our fields: the "did you mean" of an
# unknown key that no spelling distance would find.
_OTHER_STACKS_NAMES = {
    "learning_rate": "lr", "min_learning_rate": "min_lr", "max_steps": "steps",
    "train_iters": "steps", "lr_warmup_steps": "warmup_steps", "lr_warmup_iters": "warmup_steps",
    "clip_grad": "grad_clip", "max_grad_norm": "grad_clip", "gradient_clipping": "grad_clip",
    "micro_batch": "micro_batch_size", "global_batch": "global_batch_size",
    "train_micro_batch_size_per_gpu": "micro_batch_size", "train_batch_size": "global_batch_size",
    "num_attention_heads": "num_heads", "num_hidden_layers": "num_layers",
    "num_key_value_heads": "num_kv_heads", "intermediate_size": "ffn_hidden_size",
    "max_position_embeddings": "seq_length", "data_path": "dataset",
    "num_local_experts": "num_experts", "num_experts_per_tok": "experts_per_token",
    "moe_intermediate_size": "moe_ffn_hidden_size", "decoder_sparse_step": "moe_layer_interval",
    "norm_topk_prob": "moe_norm_topk_prob", "n_routed_experts": "num_experts",
    "n_shared_experts": "num_shared_experts", "n_group": "moe_groups",
    "topk_group": "moe_topk_groups", "routed_scaling_factor": "moe_routed_scaling_factor",
    "first_k_dense_replace": "moe_first_dense_layers",
    "num_nextn_predict_layers": "mtp_depth", "mtp_num_layers": "mtp_depth",
    "mtp_loss_scaling_factor": "mtp_loss_weight",
}


def _retired_tensorboard(raw: dict[str, Any]) -> dict[str, Any]:
    """A logging section with the retired boolean `tensorboard` as the `report_to` it meant:
    the configs saved in earlier runs' checkpoints and final/ directories still load."""
    if not isinstance(raw.get("tensorboard"), bool):
        return raw
    raw = dict(raw)
    enabled = raw.pop("tensorboard")
    raw.setdefault("report_to", ["tensorboard", "wandb"] if enabled else ["wandb"])
    return raw


def _build(cls: type, raw: dict[str, Any], path: str) -> Any:
    if cls is LoggingConfig:
        raw = _retired_tensorboard(raw)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        where = f"{path}." if path else ""
        alias = _OTHER_STACKS_NAMES.get(unknown[0])
        close = alias if alias in names else nearest_name(unknown[0], names)
        hint = f" (did you mean {where}{close}?)" if close else ""
        raise ConfigError(f"unknown config key {where}{unknown[0]}{hint}: valid keys are "
                          f"{', '.join(sorted(names))}")
    raw = dict(raw)
    if cls is ModelConfig and raw.get("preset") is not None:
        preset = raw["preset"]
        if preset not in MODEL_PRESETS:
            raise ConfigError(f"model.preset={preset!r}: choose one of "
                              f"{', '.join(MODEL_PRESETS)}")
        raw = {**MODEL_PRESETS[preset], **raw}
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in raw
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:  # a section of required fields (train.batch_ramp) given in part
        raise ConfigError(f"{path}: needs {', '.join(missing)} as well, e.g. {path}="
                          f"{{{', '.join(f'{f.name}: ...' for f in dataclasses.fields(cls))}}}")
    kwargs = {k: _coerce(f"{path}.{k}" if path else k, v, hints[k]) for k, v in raw.items()}
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`train.lr=3e-4` -> (['train', 'lr'], 0.0003). The value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. train.lr=3e-4")
    key, value = text.split("=", 1)
    return key.strip().split("."), yaml.load(value, Loader=_UniqueKeyLoader)


def config_from_dict(raw: dict[str, Any]) -> RunConfig:
    """A validated RunConfig from `RunConfig.to_dict()` output (e.g. a checkpoint's saved config)."""
    return _build(RunConfig, raw, "")


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load a run config YAML (or the defaults), apply `--set` overrides, validate; every path
    absolute, the file's against its directory and the overrides' against the cwd (see Paths in
    the module docstring)."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        raw = read_user_file(path, "run config", language="YAML",
                             hint="pass a YAML file from configs/ or your own",
                             expect="a mapping of sections",
                             parse=lambda text: yaml.load(text, Loader=_UniqueKeyLoader) or {})
        raw = _absolute_inputs("", raw, base=path.absolute().parent)
    for text in overrides:
        keys, value = parse_override(text)
        node = raw
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {text!r}: {k!r} is not a section")
        node[keys[-1]] = _absolute_inputs(".".join(keys), value, base=Path.cwd())
    cfg = _build(RunConfig, raw, "")
    _check_path_schemes(cfg)
    if not storage.is_remote(cfg.run_dir):
        cfg.run_dir = os.path.abspath(os.path.expanduser(cfg.run_dir))  # an output: the cwd's
    cfg.deepspeed = resolve_input_path(cfg.deepspeed, base=Path.cwd())  # the default, if unset
    return cfg


# ---- paths ------------------------------------------------------------------------------------

# The fields naming a file or directory the run reads (see the module docstring for the rule).
INPUT_PATHS = ("deepspeed", "model.init_from", "data.dataset", "data.blend", "data.tokenizer")
# The checkout or installation holding the shipped ds_configs/ and configs/.
PROJECT_ROOT = Path(__file__).resolve().parents[1]
_SHIPPED_DIRS = ("ds_configs", "configs")


def resolve_input_path(text: str, *, base: Path) -> str:
    """`text` made absolute against `base`; a `ds_configs/...` or `configs/...` path that is not
    there but is shipped is the shipped one, so a config copied out of the project still finds
    its DeepSpeed JSON. "" (an unset field) and a URL (`s3://...`, or one `_check_path_schemes`
    refuses) stay as they are."""
    if not text or storage.is_remote(text) or storage.path_problem("", text) is not None:
        return text
    path = Path(text).expanduser()
    found = os.path.abspath(base / path)  # `base / path` is `path` when it is absolute
    shipped = PROJECT_ROOT / path
    if not path.is_absolute() and not os.path.exists(found) and path.parts[0] in _SHIPPED_DIRS \
            and shipped.exists():
        return str(shipped)
    return found


def _check_path_schemes(cfg: RunConfig) -> None:
    """Refuse a path setting that names a URL the stack does not serve (`gs://`, `hf://`, the
    typo `s3:/bucket`), or an `s3://` URL where only local files are read (`storage.SERVED`):
    otherwise `run_dir: s3:/b/r` would quietly become a local directory `./s3:/b/r`."""
    paths = [("run_dir", cfg.run_dir), ("deepspeed", cfg.deepspeed),
             ("model.init_from", cfg.model.init_from), ("data.dataset", cfg.data.dataset),
             ("data.tokenizer", cfg.data.tokenizer)]
    paths += [("data.blend", _blend_prefix(entry)) for entry in cfg.data.blend]
    for name, text in paths:
        problem = storage.path_problem(name, text) if isinstance(text, str) else None
        if problem is not None:
            raise ConfigError(f"{name}: {problem}")


def _blend_prefix(entry: Any) -> Any:
    """The prefix of a data.blend entry as written (the blend's loader checks the rest)."""
    if isinstance(entry, dict):
        return entry.get("prefix")
    return entry.split(maxsplit=1)[-1].strip() if isinstance(entry, str) else None


def _absolute_inputs(name: str, value: Any, *, base: Path) -> Any:
    """`value` of the config key `name` ("" for the whole config, a section, or one field) with
    its input paths absolute against `base`. Values of the wrong type are left for the loader to
    name."""
    if name == "data.blend":
        return [_absolute_blend_entry(e, base=base) for e in value] \
            if isinstance(value, list) else _absolute_blend_entry(value, base=base)
    if name in INPUT_PATHS:
        return resolve_input_path(value, base=base) if isinstance(value, str) else value
    if isinstance(value, dict):
        return {k: _absolute_inputs(f"{name}.{k}" if name else str(k), v, base=base)
                for k, v in value.items()}
    return value


def _absolute_blend_entry(entry: Any, *, base: Path) -> Any:
    """A data.blend entry ("WEIGHT PREFIX" or {weight, prefix}) with its prefix absolute."""
    if isinstance(entry, dict) and isinstance(entry.get("prefix"), str):
        return {**entry, "prefix": resolve_input_path(entry["prefix"].strip(), base=base)}
    if isinstance(entry, str) and len(entry.split(maxsplit=1)) == 2:
        weight, prefix = entry.split(maxsplit=1)
        return f"{weight} {resolve_input_path(prefix.strip(), base=base)}"
    return entry


def add_config_arguments(parser) -> None:
    """`--config`, `--set` and `--deepspeed-config`: how every command that reads a run config
    (train, plan) takes it, with the same meaning (see `config_overrides`)."""
    parser.add_argument("--config", help="run config YAML (configs/*.yaml); defaults apply when "
                                         "omitted")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config field, e.g. --set train.lr=3e-4 (repeatable)")
    parser.add_argument("--deepspeed-config", metavar="JSON",
                        help="DeepSpeed JSON to use instead of the run config's `deepspeed` field")


def config_overrides(args) -> list[str]:
    """The `--set` overrides of `add_config_arguments`, `--deepspeed-config` included."""
    return list(args.set) + ([f"deepspeed={args.deepspeed_config}"]
                             if args.deepspeed_config else [])
