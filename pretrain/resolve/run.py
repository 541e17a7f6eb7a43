"""The resolved run: a run config with every `auto` settled, laid out on a world, built once.

`resolve_run` is the one place the rules that turn a config file into a run are applied, each
once per process, in this order:

1. `settle_config`: what the run needs of this machine (`run_checks.check_run`: its sinks'
   packages, its eval tasks), the data check (`check_run_data`, which settles
   `model.vocab_size: auto` from the tokenizer), the resume point (its global batch when the config has none), the
   precision (`auto` keeps the resumed checkpoint's, else `hardware.choose_precision` on the
   device the run uses); then the config is frozen: assigning a field raises.
2. `lay_out`: the `Topology` of the world (built here and nowhere else from a config), the
   `Layout` (`resolve_layout`: the config's rules, then the DeepSpeed JSON's engine), the
   resolved DeepSpeed dict and the layout a checkpoint records, which a resumed checkpoint's is
   compared with (`layout_change`; `same_layout_only` refuses another one).

`pretrain train`, `pretrain plan` (dry run, search, `--build`), the Slurm pre-flight, the
trainer, checkpoints and metrics take the `ResolvedRun`; nothing downstream re-derives a
setting or assigns to the config (tests/test_resolved_run.py holds that).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from pretrain.config import (Engine, Fp8Recipe, Optimizer, Precision, Recompute, RunConfig,
                             SpikeAction, freeze)
from pretrain.data.build import check_run_data
from pretrain.resolve.batch_ramp import check_batch_ramp
from pretrain.resolve.ds_config import engine_fields, fill_ds_config, read_run_json
from pretrain.resolve.fsdp2_rules import micro_batch_refusals, raise_refusals
from pretrain.errors import CheckpointError, ConfigError
from pretrain.hardware import PrecisionChoice, choose_precision, fp8_refusal
from pretrain.resolve.layout import (Layout, check_engine, check_expert_grid_engine,
                                     check_layout, planned_precision)
from pretrain.resolve.run_checks import check_run
from pretrain.resolve.topology import Topology


@dataclass(frozen=True)
class SettledConfig:
    """A run config whose `auto` fields are settled, frozen; what settling it found."""

    cfg: RunConfig
    precision: PrecisionChoice | None  # None: planned for GPUs, `auto` left to the run
    resume: Any = None  # the `checkpoint.ResumePoint` the run starts from, or None
    data_warnings: list[str] = field(default_factory=list)  # plan only: data not seen here


@dataclass(frozen=True)
class ResolvedRun:
    """Everything a run's settings resolve to, built once by `resolve_run` and handed down."""

    cfg: RunConfig  # frozen: assigning a field raises
    topology: Topology  # this rank's position in the world
    layout: Layout
    ds_config: dict[str, Any]  # the DeepSpeed JSON, every "auto" filled
    precision: PrecisionChoice | None
    resume: Any = None  # checkpoint.ResumePoint or None
    data_warnings: list[str] = field(default_factory=list)

    @property
    def checkpoint_layout(self) -> dict[str, Any]:
        """The layout a checkpoint records and resuming compares (`LAYOUT_KEYS`)."""
        lay = self.layout
        return {"tensor": lay.tensor, "pipeline": lay.pipeline, "data": lay.data,
                "context": lay.context, "expert": lay.expert, "world_size": lay.world_size,
                **({"expert_tensor": lay.expert_tensor} if lay.expert_tensor else {}),
                "zero_stage": lay.zero_stage, "offload": lay.offload_optimizer,
                "precision": self.cfg.train.precision.value,
                # only fsdp2 names itself: DeepSpeed's layouts stay as they were recorded
                **({"engine": "fsdp2"} if self.cfg.train.engine is Engine.FSDP2 else {})}


# ---- the layout a checkpoint records, compared on resuming --------------------------------------
# What makes two layouts the same for a checkpoint: every rank's files mean the same thing.
LAYOUT_KEYS = ("tensor", "pipeline", "data", "context", "expert", "zero_stage", "offload",
               "precision", "engine")


def expert_tensor(layout: dict[str, Any]) -> int:
    """The ranks splitting each expert in a recorded layout (`Topology`'s rule for an unset
    parallel.expert_tensor: the tensor ranks without expert parallelism, else 1)."""
    return layout.get("expert_tensor") or (layout.get("tensor", 1)
                                           if layout.get("expert", 1) == 1 else 1)


def describe(layout: dict[str, Any], *, other: dict[str, Any] | None = None) -> str:
    """`tp2 pp2 dp1 ZeRO-1`, with offload and precision when set (and, given `other`, when
    they differ from it)."""
    cp, ep = layout.get("context", 1), layout.get("expert", 1)
    etp = expert_tensor(layout) if ep > 1 else 1
    text = (f"tp{layout['tensor']} pp{layout['pipeline']}{f' cp{cp}' if cp > 1 else ''}"
            f"{f' ep{ep}' if ep > 1 else ''}{f' etp{etp}' if etp > 1 else ''} "
            f"dp{layout['data']} ZeRO-{layout['zero_stage']}")
    if layout.get("offload", "none") != "none":
        text += f" offload {layout['offload']}"
    if layout.get("precision") and (other is None or other.get("precision") != layout["precision"]):
        text += f" {layout['precision']}"
    if layout.get("engine", "deepspeed") != "deepspeed":
        text += f" {layout['engine']}"
    return text


def layout_change(saved: dict[str, Any], run: dict[str, Any]) -> str | None:
    """`tp2 pp2 dp1 ZeRO-1 -> tp1 pp1 dp2 ZeRO-3` when the layouts differ (keys saved by older
    versions, absent from `saved`, count as equal), else None."""
    # saved before context / expert parallelism: 1
    saved = {"context": 1, "expert": 1, **saved}
    # a layout without an engine is DeepSpeed's (every checkpoint before fsdp2, and DeepSpeed's)
    saved, run = {"engine": "deepspeed", **saved}, {"engine": "deepspeed", **run}
    if all(saved[k] == run[k] for k in LAYOUT_KEYS if k in saved and k in run) and \
            expert_tensor(saved) == expert_tensor(run):  # each expert whole or split
        return None
    return f"{describe(saved, other=run)} -> {describe(run, other=saved)}"


def refuse_another_layout(run: ResolvedRun) -> None:
    """`train --require-same-layout`: a `CheckpointError` when the checkpoint the run resumes
    was saved on another layout (a universal checkpoint has none)."""
    resume = run.resume
    if resume is None or resume.universal:
        return
    change = layout_change(resume.meta["layout"], run.checkpoint_layout)
    if change:
        raise CheckpointError(f"checkpoint {str(resume.path)!r} was saved on another layout "
                              f"({change}) and --require-same-layout is set: run it on its own "
                              "layout, or drop the flag to reshard it")


# ---- the resolver ----------------------------------------------------------------------------
def resolve_run(cfg: RunConfig, *, world_size: int, rank: int = 0, device_type: str = "cpu",
                on_this_machine: bool = True, data_required: bool = True,
                find_resume: Callable[[RunConfig], Any] | None = None,
                ds_json: dict[str, Any] | None = None,
                same_layout_only: bool = False) -> ResolvedRun:
    """`cfg` (as loaded, with `--set`) settled and laid out on `world_size` ranks; `rank` is
    this process. `device_type` is DeepSpeed's accelerator name; `on_this_machine` False plans
    for other hardware (precision `auto` is then planned as bf16 and left to the run);
    `data_required` False turns missing data into `data_warnings`; `find_resume(cfg)` returns
    the checkpoint to start from; `ds_json` replaces the file `cfg.deepspeed` names;
    `same_layout_only` refuses a checkpoint of another layout (`refuse_another_layout`)."""
    settled = settle_config(cfg, device_type=device_type, on_this_machine=on_this_machine,
                            data_required=data_required, find_resume=find_resume)
    return lay_out(settled, world_size=world_size, rank=rank, device_type=device_type,
                   ds_json=ds_json, same_layout_only=same_layout_only)


def settle_config(cfg: RunConfig, *, device_type: str, on_this_machine: bool = True,
                  data_required: bool = True,
                  find_resume: Callable[[RunConfig], Any] | None = None) -> SettledConfig:
    """Step 1 of `resolve_run`: refuse what the run needs and lacks here (`check_run`: sinks,
    eval tasks), settle `cfg`'s `auto` fields in place, then freeze it."""
    check_run(cfg)
    warnings = check_run_data(cfg, required=data_required)  # first: vocab_size: auto
    resume = find_resume(cfg) if find_resume is not None else None
    if resume is not None and cfg.train.global_batch_size is None:
        # Resharding keeps the global batch: gradient accumulation follows the new dp size.
        cfg.train.global_batch_size = resume.meta["global_batch"]
    choice = None
    if on_this_machine:
        choice = settle_precision(cfg.train.precision, device_type, resume=resume)
        cfg.train.precision = choice.precision
        refusal = fp8_refusal(cfg.train.fp8, device_type)
        if refusal:
            raise ConfigError(refusal)
    return SettledConfig(freeze(cfg), choice, resume, warnings)


def settle_precision(requested: Precision, device_type: str, *, resume) -> PrecisionChoice:
    """`hardware.choose_precision`, except that `auto` resuming a checkpoint keeps the
    checkpoint's precision (its optimizer states are in that precision's layout)."""
    if requested == Precision.AUTO and resume is not None:
        saved = resume.meta.get("config", {}).get("train", {}).get("precision")
        if saved and saved != Precision.AUTO.value:
            return PrecisionChoice(Precision(saved), "auto: the precision of the checkpoint "
                                                     "being resumed")
    return choose_precision(requested, device_type)


def lay_out(settled: SettledConfig, *, world_size: int, rank: int = 0, device_type: str = "cpu",
            ds_json: dict[str, Any] | None = None, same_layout_only: bool = False) -> ResolvedRun:
    """Step 2 of `resolve_run`: the settled config on `world_size` ranks; `same_layout_only`
    refuses a resumed checkpoint of another layout (`refuse_another_layout`)."""
    cfg = settled.cfg
    source = read_run_json(cfg, source=ds_json)
    topology = Topology.from_parallel_config(cfg.parallel, world_size=world_size, rank=rank)
    layout = resolve_layout(cfg, topology, ds_json=source, where=cfg.deepspeed)
    ds_config = fill_ds_config(cfg, layout, source, accelerator=device_type)
    if settled.resume is not None and settled.resume.universal:
        ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}
    run = ResolvedRun(cfg=cfg, topology=topology, layout=layout, ds_config=ds_config,
                      precision=settled.precision, resume=settled.resume,
                      data_warnings=settled.data_warnings)
    if same_layout_only:
        refuse_another_layout(run)
    return run


def resolve_layout(cfg: RunConfig, topology: Topology, *, ds_json: dict[str, Any] | None = None,
                   where: str = "") -> Layout:
    """The checked layout of `cfg` on `topology`: the run config's own rules first, then the
    DeepSpeed JSON's engine (ZeRO stage, offload, buckets; ZeRO 0 without one), whose errors
    name the JSON file `where`."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    layout = Layout(tensor=p.tensor, pipeline=p.pipeline, data=topology.data,
                    micro_batch=t.micro_batch_size,
                    global_batch=t.global_batch_size or t.micro_batch_size * topology.data,
                    recompute=m.activation_checkpointing,
                    recompute_interval=m.activation_checkpointing_interval,
                    sequence_parallel=p.sequence_parallel,
                    precision=planned_precision(t.precision),
                    partition=p.pipeline_partition, context=p.context,
                    context_kind=p.context_kind, expert=p.expert,
                    expert_tensor=p.expert_tensor,
                    fsdp2_replicas=t.fsdp2_replicas,
                    engine=t.engine.value, schedule=p.pipeline_schedule,
                    virtual_stages=p.virtual_stages, fp8=Fp8Recipe(t.fp8).value,
                    optimizer=Optimizer(t.optimizer).value)
    check_layout(m, layout)
    if layout.engine == "fsdp2" and layout.pipeline > 1:  # what torch's schedules raise late
        raise_refusals(micro_batch_refusals(
            schedule=layout.schedule, pipeline=layout.pipeline,
            virtual_stages=layout.virtual_stages, micro_batches=layout.grad_accum))
    check_batch_ramp(cfg, micro_batch=layout.micro_batch, data=layout.data,
                     pipeline=layout.pipeline)
    if Fp8Recipe(t.fp8) is not Fp8Recipe.NONE and layout.precision is Precision.FP16:
        raise ConfigError(f"train.fp8={Fp8Recipe(t.fp8).value} with train.precision=fp16: "
                          "torchao's float8 recipes scale each operand themselves and take "
                          "bf16 or fp32 operands; fp16's loss scaling is not one of them: use "
                          "train.precision=bf16")
    if t.on_loss_spike is SpikeAction.SKIP and p.pipeline > 1:
        raise ConfigError(
            f"train.on_loss_spike=skip with parallel.pipeline={p.pipeline}: a pipeline applies "
            "its update inside DeepSpeed's schedule, before the step's loss is known; use "
            "train.on_loss_spike=rollback (or log)")
    if ds_json is None:
        return layout
    try:
        layout = replace(layout, **engine_fields(ds_json))
        check_engine(layout)
        check_expert_grid_engine(layout)
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None
    if (layout.recompute is Recompute.SELECTIVE and layout.zero_stage == 3
            and Engine(t.engine) is Engine.DEEPSPEED):
        raise ConfigError(
            f"model.activation_checkpointing=selective with DeepSpeed's ZeRO-3 ({where}): its "
            "hooks gather each parameter inside the recomputed layer, and gather it again "
            "differently when backward recomputes it, while selective recompute replays the "
            "layer's operators exactly; use full recompute, ZeRO 0-2 or train.engine=fsdp2")
    return layout


# ---- a config as loaded (nothing settled, not frozen) through the same rules ---------------------
def lay_out_as_loaded(cfg: RunConfig, *, world_size: int, accelerator: str = "cpu",
                      source: dict[str, Any] | None = None) -> ResolvedRun:
    """`cfg` on `world_size` ranks as it stands: the layout and DeepSpeed checks of a config
    whose `auto` fields its own run settles later (a sweep's runs, a tune trial's values), or
    a test's config; precision `auto` is planned as bf16."""
    return lay_out(SettledConfig(cfg, precision=None), world_size=world_size,
                   device_type=accelerator, ds_json=source)


def saved_topology(cfg: RunConfig, *, world_size: int) -> Topology:
    """The ranks' places of a saved run's config on `world_size` ranks (where a checkpoint's
    reader finds each rank's files)."""
    return Topology.from_parallel_config(cfg.parallel, world_size=world_size)


def layout_on(cfg: RunConfig, *, world_size: int) -> Layout:
    """The layout of `cfg` as loaded on `world_size` ranks, without the DeepSpeed JSON (ZeRO 0)."""
    return resolve_layout(cfg, saved_topology(cfg, world_size=world_size))


def resolve_ds_config(cfg: RunConfig, *, world_size: int, accelerator: str = "cpu",
                      source: dict[str, Any] | None = None) -> dict[str, Any]:
    """The resolved DeepSpeed dict of `cfg` as loaded on `world_size` ranks."""
    return lay_out_as_loaded(cfg, world_size=world_size, accelerator=accelerator,
                             source=source).ds_config
