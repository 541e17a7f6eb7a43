"""What `train.engine: fsdp2` honours of a run config and its DeepSpeed JSON, checked before
launch (no torch import: the planner and the launchers' pre-flight run it).

The DeepSpeed JSON stays the one place that chooses sharding and offload, read this way:

- ZeRO-3: `fully_shard` with parameters freed after each block's forward and gathered again
  for its backward (`reshard_after_forward=True`), as ZeRO-3 does;
- ZeRO-1 and ZeRO-2: parameters kept gathered from a block's forward to its backward
  (`reshard_after_forward=False`); gradients and optimizer state are sharded either way, so
  both mean ZeRO-2 (FSDP2 has no replicated-gradient mode);
- ZeRO-0 (no sharding) is refused: that is plain data parallelism, DeepSpeed's engine's job;
- `offload_optimizer` or `offload_param` on "cpu": `CPUOffloadPolicy` (parameters, gradients
  and optimizer state in host memory, the optimizer step on the CPU); "nvme" is refused.

Mixtures of experts (`model.num_experts` > 0) run with expert parallelism 1, equal to the
tensor ranks, or on the expert grid (experts sharded over their expert-data ranks;
`layout_refusals` says what else is refused); the engine does for them what
DeepSpeed's does: the auxiliary losses' gradient scale, the router's gradient summed over the
tensor group once per step, whole experts counted once in the gradient norm, the DeepSeek-V3
bias stepped after each step and carried in the checkpoints.

Pipelines (`parallel.pipeline` > 1) run through `torch.distributed.pipelining` under any of
`parallel.pipeline_schedule`'s schedules (`pretrain.training.pipeline_schedules`), FSDP2 on each
stage; DeepSpeed's engine runs its own 1F1B only (`check_deepspeed_schedule`).
"""
from __future__ import annotations

from typing import Any

from pretrain.errors import ConfigError

# the schedules that split each backward into input and weight gradients (zero bubble)
SPLIT_BACKWARD = ("zero_bubble", "zbv", "dualpipe_v")


def reshards_after_forward(zero_stage: int) -> bool:
    """FSDP2's `reshard_after_forward` for the JSON's ZeRO stage (1 and 2: ZeRO-2-like)."""
    return zero_stage == 3


def offloads_to_cpu(ds: dict[str, Any]) -> bool:
    """Whether the JSON offloads the optimizer or the parameters to host memory."""
    zero = ds.get("zero_optimization", {})
    return any(zero.get(key, {}).get("device") == "cpu"
               for key in ("offload_optimizer", "offload_param"))


def check_fsdp2(cfg, ds: dict[str, Any], *, where: str) -> None:
    """ConfigError (exit 2 before launch) when `cfg` with the DeepSpeed JSON `ds` (named by
    `where`) asks fsdp2 for something it does not do."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    zero = ds.get("zero_optimization", {})
    refusals = layout_refusals(
        num_experts=m.num_experts,
        fp16=t.precision.value == "fp16",  # `auto` is settled before a run lays out
        zero_stage=int(zero.get("stage", 0)),
        offload=[zero.get(key, {}).get("device", "none")
                 for key in ("offload_optimizer", "offload_param")], where=where,
        expert=p.expert, tensor=p.tensor, expert_tensor=p.expert_tensor, fp8=t.fp8.value,
        optimizer=t.optimizer.value)
    if p.pipeline > 1 and p.pipeline_schedule in SPLIT_BACKWARD and reshards_after_forward(
            int(zero.get("stage", 0))):
        refusals.append(f"parallel.pipeline_schedule={p.pipeline_schedule} with {where}'s ZeRO "
                        "stage 3: the zero-bubble schedules compute weight gradients apart from "
                        "the input gradients, from the gathered weights of the forward, which "
                        "ZeRO-3 frees after it (the weights' gradients would be lost); use a "
                        "ZeRO-1/2 JSON (ds_configs/zero2.json: weights kept gathered from "
                        "forward to backward) or parallel.pipeline_schedule=interleaved_1f1b")
    refusals += _json_refusals(ds, where=where)
    raise_refusals(refusals)


def micro_batch_refusals(*, schedule: str, pipeline: int, virtual_stages: int,
                         micro_batches: int) -> list[str]:
    """The micro-batch counts a step of torch's schedules takes (what their constructors raise
    after launch): DualPipeV at least its stages; the interleaved ones a multiple of their
    rounds (micro-batches // pipeline, at least 1)."""
    refusals = []
    stages = pipeline * virtual_stages
    if schedule == "dualpipe_v" and micro_batches < stages:
        refusals.append(f"parallel.pipeline_schedule=dualpipe_v with {micro_batches} "
                        f"micro-batches a step: DualPipeV needs at least its {stages} stages "
                        "(train.global_batch_size / (train.micro_batch_size x data ranks)); raise "
                        "train.global_batch_size or choose parallel.pipeline_schedule=zbv")
    rounds = max(1, micro_batches // pipeline)
    if schedule in ("interleaved_1f1b", "zero_bubble") and micro_batches % rounds:
        refusals.append(f"parallel.pipeline_schedule={schedule} with {micro_batches} "
                        f"micro-batches a step: torch needs a multiple of its {rounds} rounds "
                        "(micro-batches // parallel.pipeline)")
    return refusals


def raise_refusals(refusals: list[str]) -> None:
    if refusals:
        raise ConfigError("train.engine=fsdp2 cannot run this config: " + "; ".join(refusals))


def check_deepspeed_schedule(cfg) -> None:
    """ConfigError (before launch) for a pipeline schedule DeepSpeed's engine does not run: its
    `PipelineEngine` is 1F1B over one stage per rank; the others are fsdp2's."""
    p = cfg.parallel
    if p.pipeline_schedule != "1f1b" or p.virtual_stages != 1:
        raise ConfigError(
            f"parallel.pipeline_schedule={p.pipeline_schedule} with parallel.virtual_stages="
            f"{p.virtual_stages}: DeepSpeed's engine runs its 1F1B schedule over one stage per "
            "rank only; set train.engine=fsdp2 (torch.distributed.pipelining's schedules) or "
            "parallel.pipeline_schedule=1f1b with parallel.virtual_stages=1")


def layout_refusals(*, num_experts: int, fp16: bool, zero_stage: int, offload: list[str],
                    where: str, expert: int = 1, tensor: int = 1, expert_tensor: int = 0,
                    fp8: str = "none", optimizer: str = "adamw") -> list[str]:
    """Why fsdp2 cannot run a layout (empty: it can): what the planner checks of a layout it
    plans, and `check_fsdp2` of a run config.

    Mixtures of experts run with expert parallelism 1, over the tensor ranks (each tensor rank's
    experts, split or whole, sharded over its data group like every other parameter) or on the
    expert grid (expert ranks taken from the data ranks: each layer's local experts a unit of
    their own, sharded over their expert-data ranks; `resolve.layout.expert_grid_refusal` says
    what of it is refused); FP8 matmuls of experts and Muon over whole experts are refused (not
    verified under fully_shard)."""
    refusals = []
    if num_experts and fp8 != "none":
        refusals.append(f"train.fp8={fp8} with model.num_experts={num_experts}: the experts' FP8 "
                        "matmuls under fully_shard are not verified; set train.fp8=none or use "
                        "train.engine=deepspeed")
    if num_experts and expert > 1 and optimizer == "muon":
        refusals.append(f"train.optimizer=muon with parallel.expert={expert}: Muon over experts "
                        "held whole by one tensor rank is not verified under fully_shard; use "
                        "train.optimizer=adamw, parallel.expert=1 or train.engine=deepspeed")
    if fp16:
        refusals.append("train.precision=fp16: fsdp2 has no loss scaling; use bf16 or fp32")
    if zero_stage == 0:
        refusals.append(f"{where} has ZeRO stage 0: fsdp2 always shards (ZeRO-3 as FSDP2, "
                        "ZeRO-1/2 as FSDP2 without resharding after forward); plain data "
                        "parallelism is train.engine=deepspeed")
    for key, device in zip(("offload_optimizer", "offload_param"), offload):
        if device not in ("none", "cpu"):
            refusals.append(f"{where} zero_optimization.{key}.device={device!r}: fsdp2 "
                            "offloads to cpu only (CPUOffloadPolicy)")
    return refusals


def _json_refusals(ds: dict[str, Any], *, where: str) -> list[str]:
    """What only the JSON says (its ZeRO stage and offload are in `layout_refusals`)."""
    refusals = []
    fp16 = ds.get("fp16", {})
    if fp16.get("enabled") is True:
        refusals.append(f"{where} enables fp16 (loss scaling): fsdp2 has none; use bf16")
    optimizer = ds.get("optimizer", {}).get("type", "AdamW")
    if str(optimizer).lower() != "adamw":
        refusals.append(f"{where} optimizer {optimizer!r}: fsdp2 steps torch's AdamW")
    return refusals
