"""The Llama model as DeepSpeed pipeline stages: one model definition, two ways to run it.

`pipeline_layer_specs(cfg)` writes `LlamaModel` as a flat list of DeepSpeed `LayerSpec`s::

    index 0           EmbeddingPipe      model.embed_tokens         input_ids -> activations
    index 1 .. L      DecoderLayerPipe   model.layers.{index - 1}   activations -> activations
    index L + 1       FinalNormPipe      model.norm                 activations -> activations
    index L + 2       LMHeadPipe         lm_head                    activations -> (hidden, weight)
    loss              PipelineLoss       the flat model's loss      (hidden, weight), labels -> loss

- `pipeline_module(cfg, num_stages=)` cuts that list into stages
  (`deepspeed.pipe.PipelineModule`), for `deepspeed.initialize` and the 1F1B `PipelineEngine`;
  `sequential_pipeline(cfg)` / `flatten(specs)` runs the *same* specs one after another in one
  process, without torch.distributed (tests, tools). `pretrain.model.build_pipeline_model` and
  `build_flat_pipeline` build them initialised.
- Stages exchange `StageActivations`, a dataclass of named tensors. DeepSpeed's p2p moves only a
  tensor or a tuple of tensors, so every stage boundary converts with `to_tuple()` /
  `from_tuple()`, and the field order is the dataclass's, defined once. Rotary cos/sin are not
  sent: each stage holds one `RotaryEmbedding` table shared by its decoder layers. Labels reach
  the last stage through DeepSpeed's `(input_ids, labels)` batch tuple (first stage reads
  element 0, last stage element 1). With `data.document_mask` element 0 is the pair
  `(input_ids, document_ids)` and the ids travel with the activations to every stage (an
  int64 tensor: DeepSpeed sends it forward and no gradient back). On the variable-length
  kernel each stage's first decoder layer computes the ids' boundaries once per micro-batch
  and the stage's activations carry them to its other layers; they never leave the stage
  (`_PipelineStages.forward` sends `StageActivations.wire()`: their length changes with each
  micro-batch, and DeepSpeed sizes its receive buffers once).
- Tied embeddings (`cfg.tie_embeddings`): the embedding and the head are `TiedLayerSpec`s with
  the key "embed"; the head runs `EmbeddingPipe.project_to_vocab` on the embedding module.
  DeepSpeed broadcasts the tied weight at start-up and all-reduces its gradient across the
  stages that hold it (`_exec_reduce_tied_grads`), counting it once in the gradient norm.
- The head's output: DeepSpeed hands labels only to `loss_fn(outputs, labels)`, so the head
  does not multiply: it returns the pair (full hidden states (B, T, C), its weight) and
  `PipelineLoss` computes the flat model's loss from it (`pretrain.model.loss.lm_head_loss`:
  chunked by `cfg.loss_chunk_tokens`, so the fp32 logits of a micro-batch never exist, or whole
  logits with 0); the weight's gradient reaches the parameter through that pair (the tied
  one's too, before DeepSpeed's all-reduce). The pipeline runs ZeRO <= 1, so the weight is the
  whole tensor. `head_logits` turns the pair into this rank's logits (a `SequentialPipeline`
  without labels).
- Initialisation is ours, not DeepSpeed's (`seed_layers` stays False: with `type:` partitioning
  it fails on a NumPy integer seed). Every parameter is mapped to its Hugging Face name
  (`pipeline_to_canonical_name`) and filled by `form.init_weights` exactly as in the flat
  model: every stage holds bitwise the values of the flat `LlamaModel` built with the same
  seed. `stage_state_dict` gives a stage's parameters
  under those names (checkpoint export).
- Partitioning (`partition_method`): "parameters" balances parameter counts (DeepSpeed's
  default; the embedding and head weigh as much as their matrices), "uniform" gives every stage
  the same number of specs (embedding, norm and head count as one each), "type:DecoderLayerPipe"
  balances decoder layers only (the embedding joins stage 0, norm and head the last stage).
  E.g. 4 layers (7 specs) on 2 stages: "uniform" splits [0, 4, 7) (3 decoder layers, then 1),
  "parameters" with the tiny preset splits [0, 3, 7) (2 and 2).
- Activation checkpointing: `activation_checkpoint_interval=k` recomputes groups of k
  consecutive specs in backward, but only groups made entirely of decoder layers
  (`checkpointable_layers=["DecoderLayerPipe"]`): the embedding's integer input and the head
  never go through the checkpoint function. The function defaults to the flat model's
  (`llama.torch_checkpoint`, non-reentrant) so both recompute the same way;
  `deepspeed.checkpointing.checkpoint` also works on CPU and gives the same losses. Note the
  meaning differs from `cfg.activation_checkpointing=every_k` of the flat model (every k-th
  layer).

DeepSpeed on CPU (0.19.8, torch 2.13, gloo; checked by tests/test_pipeline.py): the p2p layer
uses plain `dist.send`/`dist.recv`, which gloo implements, and 1F1B training, evaluation, the
tied-gradient all-reduce, ZeRO-1 across data-parallel replicas and tensor x pipeline
parallelism run unchanged: no CPU-specific workaround is needed. Quirks a caller must know
(none specific to CPU):

- `deepspeed.initialize(model=pipeline_module)` must get no `mpu`: the module's own grid
  (built from `topology`) is the mpu (DeepSpeed asserts `mpu is None`).
- A `PipelineModule` needs torch.distributed initialised even for one stage on one rank
  (it creates process groups in its constructor); `build_flat_pipeline` does not.
- `PipelineModule.forward` with an interval > 0 skips every layer until the checkpointable
  groups are precomputed (the engine does it); `pipeline_module` calls
  `set_checkpoint_interval`, so the module also works before `deepspeed.initialize`.
- A one-tensor tuple reaches a layer as a bare tensor when it crosses DeepSpeed's checkpoint
  function or its tensor-parallel activation partitioning; `StageActivations.from_tuple`
  accepts both.
- Tensor x pipeline parallelism with sequence parallelism needs `"pipeline":
  {"pipe_partitioned": false, "grad_partitioned": false}` in the DeepSpeed config, or the
  losses are silently wrong (`pretrain.resolve.ds_config.check_deepspeed_pipeline_config` says so
  before start-up).
- The DeepSpeed config's `pipeline.activation_checkpoint_interval` (if > 0) overrides the
  module's, and `pipeline.use_reentrant: false` replaces the checkpoint function by DeepSpeed's.
- `PipelineModule`'s constructor broadcasts tied weights in place with grad mode on, which
  makes autograd warn in every backward (c10d::broadcast_ has no autograd kernel);
  `pipeline_module` constructs it under `torch.no_grad()`.
- The "parameters" partitioning builds every layer once on every rank to count parameters
  (`_PipelineStages` counts on the meta device instead).
- The module's grid creates a process group for every data, pipe, model-parallel and tensor
  rank list, the same lists as `Topology.create_groups`; `pipeline_module(groups_by_ranks=)`
  hands it those, so each communicator exists once.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

from pretrain.config import ModelConfig
from pretrain.errors import ConfigError
from pretrain.families import check_pipeline_split, check_tensor_split
from pretrain.model.context_parallel import (ALLGATHER, ULYSSES, chunk_loss_scale, chunk_offset,
                                             token_positions)
import pretrain.model.documents as documents
from pretrain.model.documents import Boundaries, document_positions
from pretrain.model.layers import RMSNorm, RotaryEmbedding, rotary_embedding, vocab_embedding
from pretrain.model.llama import DecoderLayer, LayerCache, torch_checkpoint
from pretrain.model.loss import LMHead, lm_head_loss, scaled_head_input
from pretrain.model.mup import output_multiplier
from pretrain.model.tensor_parallel import column_parallel_input, gather_from_tp, tp_world_size

TIED_EMBEDDING_KEY = "embed"


# ---- what travels between stages -----------------------------------------------------------------

@dataclass
class StageActivations:
    """The tensors one stage hands to the next, by name; the field order is the wire order."""

    hidden: torch.Tensor  # residual stream (B, T, C); (B, T/tp, C) under sequence parallelism
    # data.document_mask: each position's document (B, whole sequence), int64, no gradient
    document_ids: torch.Tensor | None = None
    # the variable-length kernel's boundaries of the ids (`documents.document_boundaries`):
    # computed by a stage's first decoder layer, handed to its others, never sent (`wire`)
    boundaries: Boundaries | None = None

    def to_tuple(self) -> tuple[Any, ...]:
        """The tuple a layer hands the next one: the fields in declaration order, absent ones
        left out (they can only be the last: a run sends the same fields at every boundary),
        the boundaries as their two items (tensor, longest document)."""
        return self.wire() + (() if self.boundaries is None else tuple(self.boundaries))

    def wire(self) -> tuple[torch.Tensor, ...]:
        """The tuple DeepSpeed sends to the next stage: hidden and the ids, no boundaries."""
        return (self.hidden,) + (() if self.document_ids is None else (self.document_ids,))

    @classmethod
    def from_tuple(cls, values: torch.Tensor | tuple[Any, ...]) -> "StageActivations":
        """Inverse of `to_tuple`; a bare tensor stands for a one-field tuple (DeepSpeed unwraps
        one-element tuples when it calls a checkpointed group of layers, and when it
        reassembles activations partitioned over tensor-parallel ranks)."""
        if isinstance(values, torch.Tensor):
            values = (values,)
        # the ids are integers: a second floating tensor is another stage's idea of the wire
        if (len(values) not in (1, 2, 4) or any(not isinstance(v, torch.Tensor)
                                                or v.is_floating_point() for v in values[1:3])
                or (len(values) == 4 and not isinstance(values[3], int))):
            raise ValueError(f"a stage received {len(values)} values "
                             f"({', '.join(str(getattr(v, 'dtype', type(v))) for v in values)}), "
                             "expected 1 (hidden), or 2 (hidden, document_ids; the ids an "
                             "integer tensor) under data.document_mask (inside a stage also "
                             "their boundaries): stages built from different code?")
        boundaries = (values[2], values[3]) if len(values) == 4 else None
        return cls(values[0], values[1] if len(values) > 1 else None, boundaries)


# ---- the stage layers --------------------------------------------------------------------------

def _sequence_shards(tp_group, sequence_parallel: bool) -> int:
    """How many ranks share each sequence: the factor between local and full T."""
    return tp_world_size(tp_group) if sequence_parallel else 1


class EmbeddingPipe(nn.Module):
    """input_ids (B, T) -> StageActivations; with tied embeddings also the output projection."""

    def __init__(self, cfg: ModelConfig, *, padded_vocab_size: int, tp_group=None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.embed_tokens = vocab_embedding(padded_vocab_size, cfg.hidden_size, tp_group=tp_group,
                                            sequence_parallel=sequence_parallel)
        self.output_multiplier = output_multiplier(cfg)  # muP's 1/m on the tied head's logits

    def forward(self, inputs) -> tuple[torch.Tensor, ...]:
        """`inputs`: input_ids (B, T), or (input_ids, document_ids of the whole sequence)."""
        input_ids, document_ids = (inputs, None) if isinstance(inputs, torch.Tensor) else inputs
        shards, T = _sequence_shards(self.tp_group, self.sequence_parallel), input_ids.shape[1]
        if T % shards:
            raise ValueError(f"sequence parallelism splits each sequence over the {shards} "
                             f"tensor-parallel ranks, but it has {T} tokens: use a sequence "
                             f"length divisible by {shards}")
        return StageActivations(hidden=self.embed_tokens(input_ids),
                                document_ids=document_ids).to_tuple()

    def project_to_vocab(self, activations) -> tuple[torch.Tensor, torch.Tensor]:
        """The tied lm_head: (hidden (B, T, C), embedding weight) for `PipelineLoss`, whose
        product is this rank's logits (B, T, V_padded/tp)."""
        hidden = StageActivations.from_tuple(activations).hidden
        hidden = column_parallel_input(hidden, self.tp_group,
                                       sequence_parallel=self.sequence_parallel)  # (B, T, C)
        return scaled_head_input(hidden, self.output_multiplier), self.embed_tokens.weight


class DecoderLayerPipe(DecoderLayer):
    """`DecoderLayer` (same parameter names) on StageActivations, with its stage's rotary table.

    `kv_cache` (generation only, set by `pretrain.evaluation.pipeline_decoding` while a batch
    decodes): the keys and values of the positions before the input's, extended here; the
    input's rotary positions continue after them."""

    kv_cache: LayerCache | None = None

    def __init__(self, cfg: ModelConfig, *, rotary: RotaryEmbedding, tp_group=None,
                 sequence_parallel: bool = False, cp_group=None, expert_parallel: bool = False,
                 layer_index: int = 0, context_kind: str = ULYSSES) -> None:
        super().__init__(cfg, tp_group=tp_group, sequence_parallel=sequence_parallel,
                         cp_group=cp_group, expert_parallel=expert_parallel,
                         layer_index=layer_index, context_kind=context_kind)
        # one table object shared by the stage's layers: non-persistent buffers, no parameters
        self.rotary_emb = rotary
        self.sequence_shards = _sequence_shards(tp_group, sequence_parallel)
        self.cp_group = cp_group  # context parallelism: stages pass this rank's chunk

    def forward(self, activations) -> tuple[torch.Tensor, ...]:
        state = StageActivations.from_tuple(activations)
        T = state.hidden.shape[1] * self.sequence_shards  # full sequence length (or chunk)
        first = 0 if self.cp_group is None else chunk_offset(T, self.cp_group)
        # all-gather context parallelism: this rank's head and tail chunks' global positions
        mine = (token_positions(T, self.cp_group, ALLGATHER, state.hidden.device)
                if self.cp_group is not None and self.self_attn.context_kind == ALLGATHER
                else slice(first, first + T))
        if state.document_ids is not None:  # positions inside each document (B, T, hd)
            if state.boundaries is None:  # the stage's first layer: once per micro-batch
                state.boundaries = documents.document_boundaries(state.document_ids,
                                                                 state.hidden)
            positions = document_positions(state.document_ids)[:, mine]
            cos, sin = self.rotary_emb.at(positions, state.hidden.dtype)
            hidden = super().forward(state.hidden, cos, sin, None, state.document_ids,
                                     state.boundaries)
            return dataclasses.replace(state, hidden=hidden).to_tuple()
        cache = self.kv_cache
        if cache is not None and cache.keys is not None:  # positions after the cached ones
            first = cache.keys.shape[2]
        if not isinstance(mine, slice):
            cos, sin = self.rotary_emb.at(mine, state.hidden.dtype)  # (T, hd) each
            return dataclasses.replace(state, hidden=super().forward(state.hidden, cos, sin,
                                                                     cache)).to_tuple()
        # (T, hd) each: the positions of this input (or of this context rank's chunk)
        cos, sin = (t[first:] for t in self.rotary_emb(first + T, state.hidden.dtype))
        hidden = super().forward(state.hidden, cos, sin, cache)
        return dataclasses.replace(state, hidden=hidden).to_tuple()


class FinalNormPipe(nn.Module):
    """The final RMSNorm (`model.norm`) on StageActivations."""

    def __init__(self, cfg: ModelConfig, *, tp_group=None, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps,
                            sequence_parallel_group=tp_group if sequence_parallel else None)

    def forward(self, activations) -> tuple[torch.Tensor, ...]:
        state = StageActivations.from_tuple(activations)
        return dataclasses.replace(state, hidden=self.norm(state.hidden)).to_tuple()


class LMHeadPipe(nn.Module):
    """The untied output projection (`lm_head`, the flat model's `LMHead`): StageActivations ->
    (hidden (B, T, C), lm_head weight) for `PipelineLoss`."""

    def __init__(self, cfg: ModelConfig, *, padded_vocab_size: int, tp_group=None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.lm_head = LMHead(cfg.hidden_size, padded_vocab_size, vocab_size=cfg.vocab_size,
                              tp_group=tp_group, chunk_tokens=cfg.loss_chunk_tokens,
                              output_multiplier=output_multiplier(cfg))

    def forward(self, activations) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = StageActivations.from_tuple(activations).hidden
        hidden = column_parallel_input(hidden, self.tp_group,
                                       sequence_parallel=self.sequence_parallel)  # (B, T, C)
        # muP's output multiplier on the head's input, as `LMHead.forward` applies it
        return scaled_head_input(hidden, self.lm_head.output_multiplier), self.lm_head.weight


def head_logits(outputs: tuple[torch.Tensor, torch.Tensor],
                position: int | None = None) -> torch.Tensor:
    """This rank's logits (B, T, V_padded/tp) from the head's (hidden, weight) pair; at one
    `position` only (B, V_padded/tp) where one is given."""
    hidden, weight = outputs
    return F.linear(hidden if position is None else hidden[:, position], weight)


class PipelineLoss:
    """`loss_fn((hidden, weight), labels)` of the last stage: `loss.lm_head_loss`, as the flat
    model's `LMHead` computes it."""

    def __init__(self, *, vocab_size: int, tp_group=None, chunk_tokens: int = 0,
                 cp_group=None) -> None:
        self.vocab_size, self.tp_group, self.chunk_tokens = vocab_size, tp_group, chunk_tokens
        self.cp_group = cp_group  # context parallelism: the chunk's share of the mean, x N

    def __call__(self, outputs: tuple[torch.Tensor, torch.Tensor],
                 labels: torch.Tensor) -> torch.Tensor:
        hidden, weight = outputs
        loss = lm_head_loss(hidden, weight, labels, vocab_size=self.vocab_size,
                            tp_group=self.tp_group, chunk_tokens=self.chunk_tokens)
        if self.cp_group is None:
            return loss
        return loss * chunk_loss_scale(labels, self.cp_group)


# ---- the model definition ------------------------------------------------------------------------

def pipeline_layer_specs(cfg: ModelConfig, *, tp_group=None, sequence_parallel: bool = False,
                         cp_group=None, expert_parallel: bool = False,
                         context_kind: str = ULYSSES) -> list[LayerSpec]:
    """`LlamaModel` as DeepSpeed layer specs: embedding, cfg.num_layers decoder layers, final
    norm, lm_head (see the module docstring for the index of each). `expert_parallel`: each
    decoder layer's experts are split over the tensor ranks, as in `LlamaModel`;
    `context_kind`: how the context ranks attend (`LlamaModel`)."""
    tensor_parallel = tp_world_size(tp_group)
    check_tensor_split(cfg, tensor_parallel)
    if sequence_parallel and tensor_parallel == 1:
        raise ConfigError("sequence_parallel=True needs a tensor-parallel group of more than one "
                          "rank: set parallel.tensor > 1 or parallel.sequence_parallel=false")
    parallel = dict(tp_group=tp_group, sequence_parallel=sequence_parallel)
    vocab = dict(padded_vocab_size=cfg.padded_vocab_size(tensor_parallel))
    rotary = rotary_embedding(cfg)
    if cfg.tie_embeddings:
        embedding = TiedLayerSpec(TIED_EMBEDDING_KEY, EmbeddingPipe, cfg, **vocab, **parallel,
                                  tied_weight_attr=["embed_tokens.weight"])
        head = TiedLayerSpec(TIED_EMBEDDING_KEY, EmbeddingPipe, cfg, **vocab, **parallel,
                             forward_fn=EmbeddingPipe.project_to_vocab,
                             tied_weight_attr=["embed_tokens.weight"])
    else:
        embedding = LayerSpec(EmbeddingPipe, cfg, **vocab, **parallel)
        head = LayerSpec(LMHeadPipe, cfg, **vocab, **parallel)
    return [embedding,
            *(LayerSpec(DecoderLayerPipe, cfg, rotary=rotary, **parallel, layer_index=i,
                        **({"cp_group": cp_group} if cp_group is not None else {}),
                        **({"context_kind": context_kind} if context_kind != ULYSSES else {}),
                        **({"expert_parallel": True} if expert_parallel else {}))
              for i in range(cfg.num_layers)),
            LayerSpec(FinalNormPipe, cfg, **parallel),
            head]


def _check_pipeline_args(cfg: ModelConfig, *, num_stages: int, partition_method: str,
                         activation_checkpoint_interval: int) -> None:
    check_pipeline_split(cfg, num_stages, partition_method=partition_method)
    if not isinstance(activation_checkpoint_interval, int) or activation_checkpoint_interval < 0:
        raise ConfigError(f"activation_checkpoint_interval={activation_checkpoint_interval!r}: "
                          "must be 0 (off) or a positive number of layers")


def _deepspeed_topology(topology, *, num_stages: int, tp_group):
    """DeepSpeed's ProcessTopology for `topology` (ours or DeepSpeed's), checked against the
    stage count and the tensor-parallel group; None lets DeepSpeed make pipe x data."""
    tensor_parallel = tp_world_size(tp_group)
    if topology is None:
        if tensor_parallel > 1:
            raise ConfigError(f"a tensor-parallel group of {tensor_parallel} ranks needs "
                              "topology=Topology(tensor=, pipeline=, world_size=): without it "
                              "DeepSpeed would treat the tensor-parallel ranks as data parallel")
        world = dist.get_world_size()
        if world % num_stages:
            raise ConfigError(f"{num_stages} pipeline stages do not divide the world of {world} "
                              f"ranks: launch a multiple of {num_stages} ranks")
        return None
    if hasattr(topology, "deepspeed_topology"):  # pretrain.resolve.topology.Topology
        topology = topology.deepspeed_topology()
    stages = topology.get_dim("pipe")
    model = max(topology.get_dim("model"), 1)  # get_dim is 0 for an absent axis
    if stages != num_stages:
        raise ConfigError(f"num_stages={num_stages} but the topology has {stages} pipeline "
                          "stages: build both from parallel.pipeline")
    if model != tensor_parallel:
        raise ConfigError(f"the topology has tensor size {model} but the tensor-parallel group "
                          f"has {tensor_parallel} ranks: pass the group of the same Topology")
    if topology.world_size() != dist.get_world_size():
        raise ConfigError(f"the topology has {topology.world_size()} ranks but the world has "
                          f"{dist.get_world_size()}: build it from the launcher's WORLD_SIZE")
    return topology


@contextlib.contextmanager
def _reusing_process_groups(existing: Mapping[tuple[int, ...], Any] | None):
    """While DeepSpeed's `PipelineParallelGrid` is built, hand it the groups `existing` already
    has for a rank list instead of a new one. The grid creates a group for every data, pipe,
    model-parallel and tensor axis list: the very lists `Topology.create_groups` made, so
    without this every one of them exists twice (on NCCL, two communicators with their own
    buffers for the same ranks). Lists it lacks are created as usual, on every rank in the
    same order (the lookup gives the same answer everywhere)."""
    if not existing:
        yield
        return
    import deepspeed.comm as ds_comm

    create = ds_comm.new_group

    def new_group(ranks):
        found = existing.get(tuple(sorted(ranks)))
        return create(ranks) if found is None else found

    ds_comm.new_group = new_group
    try:
        yield
    finally:
        ds_comm.new_group = create


class _PipelineStages(PipelineModule):
    """DeepSpeed's `PipelineModule`, whose "parameters" partition counts each layer's
    parameters on the meta device: it builds every layer of the model on every rank only to
    count them (for 70B, ~69B fp32 parameters allocated and initialised, one layer at a time,
    on every rank, before its own stage is built)."""

    def _count_layer_params(self) -> list[int]:
        with torch.device("meta"):
            return super()._count_layer_params()

    def forward(self, forward_input):
        """The stage's layers; what leaves for the next stage is `StageActivations.wire()`."""
        outputs = super().forward(forward_input)
        if self.stage_id < self.num_stages - 1:
            return StageActivations.from_tuple(outputs).wire()
        return outputs


def pipeline_module(cfg: ModelConfig, *, num_stages: int, topology=None, tp_group=None,
                    sequence_parallel: bool = False, partition_method: str = "parameters",
                    activation_checkpoint_interval: int = 0,
                    activation_checkpoint_func: Callable = torch_checkpoint,
                    groups_by_ranks: Mapping[tuple[int, ...], Any] | None = None,
                    cp_group=None, expert_parallel: bool = False,
                    context_kind: str = ULYSSES) -> PipelineModule:
    """This rank's stage of the pipelined `LlamaModel`, weights left at their defaults
    (`pretrain.model.build_pipeline_model` also initialises them).

    Collective: every rank of the world calls it (DeepSpeed creates process groups).
    `topology`: a `pretrain.resolve.topology.Topology` or DeepSpeed `ProcessTopology`; required with
    tensor parallelism (then `tp_group` is this rank's group of it), otherwise DeepSpeed lays
    out pipe x data. Pass the result to `deepspeed.initialize(model=..., config=...)` without
    `mpu` and train with `engine.train_batch(iter_of((input_ids, labels)))`.
    `groups_by_ranks` (`ProcessGroups.by_ranks`): groups DeepSpeed's grid reuses.
    `cp_group`: the context-parallel group (`ProcessGroups.context`): each stage's context
    ranks compute and send their chunk of the sequence (`context_kind`: Ulysses' contiguous
    chunk, or all-gather's head and tail chunks).
    `expert_parallel`: the tensor ranks of a stage hold whole experts of its MoE layers
    (`pretrain.model.expert_parallel`; parallel.expert = tp).
    """
    _check_pipeline_args(cfg, num_stages=num_stages, partition_method=partition_method,
                         activation_checkpoint_interval=activation_checkpoint_interval)
    if not dist.is_initialized():
        raise RuntimeError("a PipelineModule needs torch.distributed initialised on every "
                           "rank (deepspeed.init_distributed); for one process without it use "
                           "build_flat_pipeline")
    ds_topology = _deepspeed_topology(topology, num_stages=num_stages, tp_group=tp_group)
    specs = pipeline_layer_specs(cfg, tp_group=tp_group, sequence_parallel=sequence_parallel,
                                 cp_group=cp_group, expert_parallel=expert_parallel,
                                 context_kind=context_kind)
    # no_grad: the constructor broadcasts tied weights in place; with grad mode on, autograd
    # records that c10d::broadcast_ (which has no autograd kernel) and warns in every backward
    with torch.no_grad(), _reusing_process_groups(groups_by_ranks):
        module = _PipelineStages(
            layers=specs, num_stages=None if ds_topology else num_stages, topology=ds_topology,
            loss_fn=PipelineLoss(vocab_size=cfg.vocab_size, tp_group=tp_group,
                                 chunk_tokens=cfg.loss_chunk_tokens, cp_group=cp_group),
            seed_layers=False, partition_method=partition_method,
            activation_checkpoint_interval=activation_checkpoint_interval,
            activation_checkpoint_func=activation_checkpoint_func,
            checkpointable_layers=[DecoderLayerPipe.__name__])
    # forward() only runs layers whose checkpoint groups were precomputed (the engine does it
    # too): do it now so the module is usable on its own
    module.set_checkpoint_interval(activation_checkpoint_interval)
    return module


# ---- one process: the same specs in sequence --------------------------------------------------

class SequentialPipeline(nn.Module):
    """Every layer spec built in this process and run in order: a one-stage pipeline without
    torch.distributed. Parameter names are those of a one-stage `PipelineModule`
    ("{index}.<local name>", tied modules under "tied_modules.<key>.")."""

    def __init__(self, specs: Iterable[LayerSpec], *, loss_fn: Callable | None = None,
                 vocab_size: int | None = None, tp_group=None) -> None:
        super().__init__()
        self.specs = list(specs)
        self.loss_fn, self.vocab_size, self.tp_group = loss_fn, vocab_size, tp_group
        self.tied_modules = nn.ModuleDict()
        self.forward_funcs: list[Callable] = []
        for index, spec in enumerate(self.specs):
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied_modules:
                    self.tied_modules[spec.key] = spec.build()
                tied = self.tied_modules[spec.key]
                self.forward_funcs.append(
                    tied if spec.forward_fn is None else _bind(spec.forward_fn, tied))
            else:
                module = spec.build()
                self.add_module(str(index), module)
                self.forward_funcs.append(module)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Like `LlamaModel.forward`: the loss with labels, else the logits (B, T, vocab_size)."""
        x: Any = input_ids if document_ids is None else (input_ids, document_ids)
        for function in self.forward_funcs:
            x = function(x)
        if labels is not None:
            return self.loss_fn(x, labels)
        logits = gather_from_tp(head_logits(x), self.tp_group)
        return logits if self.vocab_size is None else logits[..., :self.vocab_size]


def _bind(function: Callable, module: nn.Module) -> Callable:
    return lambda x: function(module, x)


def flatten(specs: Iterable[LayerSpec], *, loss_fn: Callable | None = None,
            vocab_size: int | None = None, tp_group=None) -> SequentialPipeline:
    """Run pipeline layer specs sequentially in one process (weights left at their defaults)."""
    return SequentialPipeline(specs, loss_fn=loss_fn, vocab_size=vocab_size, tp_group=tp_group)


def sequential_pipeline(cfg: ModelConfig, *, tp_group=None,
                        sequence_parallel: bool = False) -> SequentialPipeline:
    """The pipeline's specs as one sequential model with its loss, weights left at their
    defaults (`pretrain.model.build_flat_pipeline` also initialises them)."""
    specs = pipeline_layer_specs(cfg, tp_group=tp_group, sequence_parallel=sequence_parallel)
    loss_fn = PipelineLoss(vocab_size=cfg.vocab_size, tp_group=tp_group,
                           chunk_tokens=cfg.loss_chunk_tokens)
    return flatten(specs, loss_fn=loss_fn, vocab_size=cfg.vocab_size, tp_group=tp_group)


# ---- canonical (Hugging Face) names, initialisation, export --------------------------------------

def canonical_name(spec_index: int, local_name: str, *, num_layers: int) -> str:
    """Hugging Face name of parameter `local_name` of the layer spec at `spec_index`."""
    if spec_index == 0:
        return f"model.{local_name}"  # embed_tokens.weight
    if 1 <= spec_index <= num_layers:
        return f"model.layers.{spec_index - 1}.{local_name}"
    if spec_index == num_layers + 1:
        return f"model.{local_name}"  # norm.weight
    if spec_index == num_layers + 2 and local_name in ("lm_head.weight", "embed_tokens.weight"):
        return "lm_head.weight"  # untied head, or the tied embedding acting as the head
    raise KeyError(f"no Llama parameter {local_name!r} at layer spec {spec_index} of a model "
                   f"with {num_layers} decoder layers")


def pipeline_to_canonical_name(name: str, *, num_layers: int) -> str:
    """Hugging Face name of a `PipelineModule` / `SequentialPipeline` parameter name.

    "3.mlp.up_proj.weight" -> "model.layers.2.mlp.up_proj.weight"; a tied module's parameter
    ("tied_modules.embed.embed_tokens.weight") is the embedding, as `LlamaModel`'s
    `named_parameters()` yields a tied weight once, as `model.embed_tokens.weight`.
    """
    prefix = f"tied_modules.{TIED_EMBEDDING_KEY}."
    if name.startswith(prefix):
        return canonical_name(0, name[len(prefix):], num_layers=num_layers)
    index, _, local_name = name.partition(".")
    if not index.isdigit():
        raise KeyError(f"{name!r} is not a pipeline parameter name")
    return canonical_name(int(index), local_name, num_layers=num_layers)


def _local_layers(module: nn.Module) -> list[tuple[int, nn.Module]]:
    """(spec index, built module) of each layer this stage runs; tied ones are the tied module."""
    if isinstance(module, PipelineModule):
        specs, indices = module._layer_specs, range(module._local_start, module._local_stop)
    else:
        specs, indices = module.specs, range(len(module.specs))
    layers = []
    for index in indices:
        spec = specs[index]
        if isinstance(spec, TiedLayerSpec):
            layers.append((index, module.tied_modules[spec.key]))
        else:
            layers.append((index, module.get_submodule(str(index))))
    return layers


def stage_state_dict(module: nn.Module, *, num_layers: int) -> dict[str, torch.Tensor]:
    """This stage's parameters under Hugging Face names (tensor-parallel shards under TP).

    With tied embeddings the stage running the head lists the tied weight as `lm_head.weight`
    (and the embedding's stage as `model.embed_tokens.weight`), so the union over stages has
    exactly the keys of `LlamaModel.state_dict()`. Tensors are the live parameters, detached.
    """
    state: dict[str, torch.Tensor] = {}
    for index, layer in _local_layers(module):
        for local_name, param in layer.named_parameters():
            state[canonical_name(index, local_name, num_layers=num_layers)] = param.detach()
    return state


__all__ = ["DecoderLayerPipe", "EmbeddingPipe", "FinalNormPipe", "LMHeadPipe", "PipelineLoss",
           "SequentialPipeline", "StageActivations", "canonical_name",
           "flatten", "head_logits", "pipeline_layer_specs",
           "pipeline_module", "pipeline_to_canonical_name", "sequential_pipeline",
           "stage_state_dict"]
