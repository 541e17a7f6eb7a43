"""`train.engine: fsdp2`'s pipelines: the model cut into stages run by one of
`torch.distributed.pipelining`'s schedules (`parallel.pipeline_schedule`), FSDP2 on each stage.

The stages are the DeepSpeed pipeline's layer specs (`pretrain.model.pipeline`: embedding,
decoder layers, final norm, head), cut into `parallel.pipeline x parallel.virtual_stages`
contiguous stages (`stage_spans`: the decoder layers split as evenly as they go, the first
stages taking the remainder; the embedding joins the first stage, the norm and head the last).
Each rank holds `virtual_stages` of them (`stage_indices`): looped (rank r holds r, r + pp, ...)
for 1F1B and the interleaved schedules, V-shaped (r and 2 pp - 1 - r) for ZBV and DualPipeV,
which torch places that way.

Each stage is a `StageModule`, its layers registered under their layer-spec index, as in a
one-stage `PipelineModule`; `PipelineStages` holds a rank's stages under those same names, so
`canonical_parameters` gives Hugging Face names, and initialisation, checkpoints (each rank's
file holds its stages' pieces) and `final/` treat it like any pipeline's stages. A stage takes
`StageActivations.wire()` tensors (the first: input_ids, and document_ids under
data.document_mask) and the micro-batch's labels as a keyword, which torch hands every stage:
the last stage computes the loss inside its forward (`PipelineLoss`, as DeepSpeed's last stage),
while its head's weight is gathered, and the schedule's loss function passes it on.

`PipelineDriver.train_step` runs one step's micro-batches through the schedule, each
micro-batch's loss divided by their number before backward (DeepSpeed's loss / accumulation, so
a mixture of experts' auxiliary losses take the same `moe.aux_loss_grad_scale` as in the flat
engine); the loss comes back on every rank of the pipeline, averaged over the micro-batches.
A stage holding mixture-of-experts layers runs them as the flat model does: the expert-parallel
all-to-all inside its forward (its tensor ranks), the auxiliary losses' gradients handed in by
their layers' backward, the router's gradient summed over the tensor group at the step's end
(`FSDP2Engine`). `PipelineDriver.evaluate` runs forwards
only, micro-batch by micro-batch and stage by stage, each wire tensor sent point to point.

Schedules (torch 2.13's `get_schedule_class` names), by the name a config gives:
`1f1b` (Schedule1F1B), `interleaved_1f1b` (ScheduleInterleaved1F1B), `zero_bubble`
(ScheduleInterleavedZeroBubble: backward split into input and weight gradients, the weight
gradients filling the bubble), `zbv` (ScheduleZBVZeroBubble), `dualpipe_v` (ScheduleDualPipeV).
"""
from __future__ import annotations

import types
from typing import Any, Iterator

import torch
import torch.distributed as torch_dist
import torch.nn as nn

from pretrain.arithmetic import V_SHAPED, stage_indices, stage_spans
from pretrain.config import Precision, RunConfig
from pretrain.model.moe import reset_stats
from pretrain.model.pipeline import (DecoderLayerPipe, PipelineLoss, SequentialPipeline,
                                     StageActivations, head_logits, pipeline_layer_specs)

# parallel.pipeline_schedule -> torch.distributed.pipelining's schedule class name
SCHEDULE_CLASSES = {"1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B",
                    "zero_bubble": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble",
                    "dualpipe_v": "DualPipeV"}
class StageModule(nn.Module):
    """One pipeline stage: its layer specs built and registered under their spec index."""

    def __init__(self, layers: dict[int, nn.Module], *, first: bool, last: bool,
                 loss: PipelineLoss) -> None:
        super().__init__()
        for index, layer in layers.items():
            self.add_module(str(index), layer)
        self.first, self.last, self.loss = first, last, loss

    def forward(self, *inputs: torch.Tensor, labels: torch.Tensor | None,
                logits_at: int | None = None) -> torch.Tensor | tuple:
        """The stage's layers on `inputs` (the previous stage's wire tensors; the first stage:
        input_ids, with document_ids under data.document_mask); the last stage returns the
        loss of `labels`, or with `labels=None` (evaluation) this rank's vocabulary shard of
        the logits, at position `logits_at` only where one is given; the others return the
        wire tensors for the next stage. Inside the forward, while FSDP2 holds the head's
        weight gathered."""
        x: Any = inputs if len(inputs) > 1 or not self.first else inputs[0]
        for layer in self.children():
            x = layer(x)
        if self.last and labels is None:  # x: the head's (hidden, weight) pair
            return head_logits(x, logits_at)
        if self.last:
            return self.loss(x, labels)
        return StageActivations.from_tuple(x).wire()


class PipelineStages(SequentialPipeline):
    """A rank's stages under their layer specs' names ("{spec index}.<local name>", as
    `pipeline_to_canonical_name` reads them): what the engine's `module` is, for parameters,
    checkpoints and hooks. Not run as one model: the schedule runs `stages`."""

    def __init__(self, stages: dict[int, StageModule]) -> None:
        nn.Module.__init__(self)  # SequentialPipeline's form, none of its specs
        self.stages = stages  # {stage index: module}, not registered: the layers are, below
        for stage in stages.values():
            for index, layer in stage.named_children():
                self.add_module(index, layer)

    def forward(self, *args, **kwargs):
        raise RuntimeError("fsdp2's pipeline stages run through their schedule "
                           "(FSDP2Engine.train_batch / eval_batch), not as one model")

    def register_forward_hook(self, hook, **kwargs):
        """The hook on every stage's forward (the trainer's beat after each one)."""
        handles = [stage.register_forward_hook(hook, **kwargs) for stage in self.stages.values()]
        return handles[0] if len(handles) == 1 else handles


def construct_stages(cfg: RunConfig, groups) -> PipelineStages:
    """This rank's stages of the run's model, not initialised (under `torch.device("meta")`
    nothing is allocated)."""
    p, m = cfg.parallel, cfg.model
    tp_group = groups.tensor if groups.topology.tensor > 1 else None
    specs = pipeline_layer_specs(m, tp_group=tp_group, sequence_parallel=p.sequence_parallel,
                                 cp_group=groups.context, expert_parallel=p.expert > 1,
                                 context_kind=p.context_kind)
    num_stages = p.pipeline * p.virtual_stages
    spans = stage_spans(m.num_layers, num_stages)
    loss = PipelineLoss(vocab_size=m.vocab_size, tp_group=tp_group,
                        chunk_tokens=m.loss_chunk_tokens, cp_group=groups.context)
    stages = {}
    for stage in stage_indices(groups.topology.my_coords.pipeline, pipeline=p.pipeline,
                               virtual_stages=p.virtual_stages, schedule=p.pipeline_schedule):
        start, stop = spans[stage]
        stages[stage] = StageModule({i: _build(specs[i]) for i in range(start, stop)},
                                    first=stage == 0, last=stage == num_stages - 1, loss=loss)
    return PipelineStages(stages)


def _build(spec) -> nn.Module:
    """A layer spec's module; the tied head (`model.tie_embeddings`) is a copy of the embedding
    module whose forward projects to the vocabulary (the spec's `forward_fn`), its weight kept
    equal to the first stage's by `FSDP2Engine` (one initial value by name, the two gradients
    summed every step)."""
    module = spec.build()
    forward_fn = getattr(spec, "forward_fn", None)
    if forward_fn is not None:
        module.forward = types.MethodType(forward_fn, module)
    return module


def tied_embedding_copies(model: nn.Module, cfg: RunConfig) -> tuple[Any, Any]:
    """(the embedding's weight, the tied head's copy of it) of this rank's stages under
    model.tie_embeddings: each None where the rank does not hold that stage; (None, None)
    without tied embeddings or a pipeline."""
    if not (cfg.model.tie_embeddings and isinstance(model, PipelineStages)):
        return None, None
    head = str(cfg.model.num_layers + 2)  # the layer spec index of the head
    params = dict(model.named_parameters())
    return params.get("0.embed_tokens.weight"), params.get(f"{head}.embed_tokens.weight")


class PipelineDriver:
    """A rank's stages under the run's schedule: one training step's micro-batches, or
    forward-only evaluation."""

    def __init__(self, cfg: RunConfig, model: PipelineStages, groups, *, micro_batches: int,
                 device: torch.device) -> None:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import (PipelineScheduleSingle,
                                                            get_schedule_class)

        p = cfg.parallel
        self.model, self.device, self.group = model, device, groups.pipeline
        self.num_stages = p.pipeline * p.virtual_stages
        self.pipeline, self.schedule_name = p.pipeline, p.pipeline_schedule
        self.stages = [PipelineStage(module, index, self.num_stages, device, group=self.group)
                       for index, module in model.stages.items()]
        schedule = get_schedule_class(SCHEDULE_CLASSES[p.pipeline_schedule])
        single = issubclass(schedule, PipelineScheduleSingle)
        self.micro_batches = micro_batches
        self._losses: list[torch.Tensor] = []  # the last stage's, undivided, of this step
        # torch infers the stages' inputs and outputs at the first step by one forward and
        # backward of each stage on made-up tensors (torch 2.13's dynamic metadata inference),
        # the loss function included: what it adds to the router statistics is forgotten
        # after that forward, and only the step's last `micro_batches` losses are its own
        self._inferred: set[int] = set()
        for index, module in model.stages.items():
            module.register_forward_hook(self._forget_metadata_inference(index))
        # the loss of each micro-batch divided by their number before backward (not torch's
        # `scale_grads`, which divides the gradients after): DeepSpeed's loss / accumulation,
        # which the auxiliary losses' gradients (`moe.aux_loss_grad_scale`) follow too
        self.schedule = schedule(self.stages[0] if single else self.stages,
                                 n_microbatches=micro_batches, loss_fn=self._divided_loss,
                                 scale_grads=False)
        self.sequence_shards = groups.topology.tensor if p.sequence_parallel else 1
        self.hidden_size, self.num_layers = cfg.model.hidden_size, cfg.model.num_layers
        # what a stage sends: bf16 under bf16's MixedPrecisionPolicy (the shards stay fp32)
        self.activation_dtype = (torch.bfloat16 if cfg.train.precision is Precision.BF16
                                 else torch.float32)

    def _forget_metadata_inference(self, index: int):
        """A hook on stage `index`: after its first training forward (torch's metadata
        inference, before any micro-batch), its mixture-of-experts layers' statistics are
        reset (the trainer collects them after the step)."""
        def hook(module, _args, _output) -> None:
            if module.training and index not in self._inferred:
                self._inferred.add(index)
                reset_stats(module)
        return hook

    def _divided_loss(self, output: torch.Tensor, _labels) -> torch.Tensor:
        """The schedule's loss function: the last stage's forward already returns the loss,
        kept for the step's mean and back-propagated divided by the micro-batches."""
        self._losses.append(output.detach())
        return output / self.micro_batches

    def describe(self) -> str:
        """The schedule torch runs and the stages of this rank, for the run's log."""
        spans = stage_spans(self.num_layers, self.num_stages)
        mine = ", ".join(f"{index} (layer specs {spans[index][0]}-{spans[index][1] - 1})"
                         for index in self.model.stages)
        return (f"[pipeline] {self.schedule_name} ({type(self.schedule).__name__}): "
                f"{self.num_stages} stages over {self.pipeline} ranks, {self.micro_batches} "
                f"micro-batches a step; this rank holds stage {mine}")

    def owner(self, stage: int) -> int:
        """The pipeline-group rank holding `stage`."""
        if self.schedule_name in V_SHAPED and stage >= self.pipeline:
            return 2 * self.pipeline - 1 - stage
        return stage % self.pipeline

    def _mean_over_pipeline(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The mean of the last stage's micro-batch losses, on every rank of the pipeline."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        if losses:
            total += torch.stack([loss.detach().float() for loss in losses]).mean()
        torch_dist.all_reduce(total, group=self.group)
        return total

    def train_step(self, pairs: list[tuple[Any, torch.Tensor]]) -> torch.Tensor:
        """Forward and backward of `pairs` ((inputs, labels) micro-batches) under the schedule;
        the gradients are summed into the FSDP2 shards and divided by their number. Returns
        the mean loss on every rank of the pipeline."""
        inputs, labels = self._batch(pairs)
        self._losses = []
        has_first = any(stage.is_first for stage in self.stages)
        # the labels reach the last stage's forward as a keyword (every stage gets it); torch
        # also wants them as the target of its loss function, which divides the loss
        self.schedule.step(*(inputs if has_first else ()), labels=labels, target=labels,
                           losses=[], return_outputs=False)
        return self._mean_over_pipeline(self._losses[-self.micro_batches:])

    def _batch(self, pairs) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """The micro-batches' inputs (input_ids[, document_ids]) and labels, concatenated along
        the batch: the schedule splits them back into the same micro-batches."""
        firsts = [p[0] if isinstance(p[0], tuple) else (p[0],) for p in pairs]
        inputs = tuple(torch.cat(parts).to(self.device) for parts in zip(*firsts))
        return inputs, torch.cat([p[1] for p in pairs]).to(self.device)

    @torch.no_grad()
    def evaluate(self, pairs: Iterator, count: int) -> torch.Tensor:
        """The mean loss of the next `count` pairs, forwards only: each micro-batch through the
        stages in order, a stage's wire tensors sent to the next stage's rank (whose buffers
        are shaped from its own copy of the micro-batch). On every rank of the pipeline."""
        me = torch_dist.get_rank(self.group)
        modules, dtype = self.model.stages, self.activation_dtype
        losses = []
        for _ in range(count):
            inputs, labels = self._batch([next(pairs)])
            x: tuple[torch.Tensor, ...] = ()
            for stage in range(self.num_stages):
                if self.owner(stage) != me:
                    continue
                if stage and self.owner(stage - 1) != me:
                    x = self._receive(inputs, labels, dtype, src=self.owner(stage - 1))
                out = modules[stage](*(inputs if stage == 0 else x), labels=labels)
                if stage == self.num_stages - 1:
                    losses.append(out)
                    continue
                x = out
                if self.owner(stage + 1) != me:
                    for tensor in x:
                        torch_dist.send(tensor.contiguous(),
                                        group_dst=self.owner(stage + 1), group=self.group)
        return self._mean_over_pipeline(losses).reshape(1)

    def inference_hops(self) -> list:
        """This rank's stages for forwards outside the schedule (`pretrain.evaluation
        .pipeline_decoding`: scoring and cached decoding), in pipeline order, each run as its
        FSDP2 root's forward; the neighbours' ranks are global."""
        from pretrain.evaluation.pipeline_decoding import StageHop

        me = torch_dist.get_rank(self.group)
        last = self.num_stages - 1

        def neighbour(stage: int) -> int | None:  # another rank's stage, by global rank
            owner = self.owner(stage)
            return None if owner == me else torch_dist.get_global_rank(self.group, owner)

        def runner(module: StageModule):
            def run(x, position):
                inputs = (x,) if isinstance(x, torch.Tensor) else tuple(x)
                return module(*inputs, labels=None, logits_at=position)
            return run

        return [StageHop(run=runner(module), first=stage == 0, last=stage == last,
                         source=None if stage == 0 else neighbour(stage - 1),
                         destination=None if stage == last else neighbour(stage + 1),
                         layers=tuple(m for m in module.modules()
                                      if isinstance(m, DecoderLayerPipe)))
                for stage, module in sorted(self.model.stages.items())]

    def _receive(self, inputs, labels, dtype, *, src: int) -> tuple[torch.Tensor, ...]:
        """The previous stage's wire tensors: hidden (B, T / sequence shards, C), and the
        document ids (B, whole sequence) when the inputs carry them."""
        rows, tokens = labels.shape
        hidden = torch.empty(rows, tokens // self.sequence_shards, self.hidden_size,
                             dtype=dtype, device=self.device)
        wire = (hidden,) + tuple(torch.empty_like(t) for t in inputs[1:])
        for tensor in wire:
            torch_dist.recv(tensor, group_src=src, group=self.group)
        return wire
