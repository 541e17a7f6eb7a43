"""Resolve a DeepSpeed JSON from `ds_configs/` against a run config.

The JSON files choose *how* to shard and offload (ZeRO stage, offload devices, buckets); the run
config chooses *what* to train (batch, optimizer, precision). Every ``"auto"`` value in the JSON is
filled from the run config here; an explicit value that contradicts the run config is an error,
raised before any process group exists. Which ZeRO stage / offload / pipeline combinations
DeepSpeed supports is decided by the layout rulebook (`pretrain.resolve.layout.check_engine`), asked here
with the JSON's stage and offload devices; what `train.engine: fsdp2` cannot honour of the JSON
by `pretrain.resolve.fsdp2_rules.check_fsdp2`, asked as the JSON is read (`read_run_json`). More things
DeepSpeed would silently get wrong are refused here:

- the pipeline's partitioned point-to-point transfers under sequence parallelism
  (`check_deepspeed_pipeline_config`);
- a misspelled key (`zero_optimisation`, `offload_optimiser`): DeepSpeed ignores an unknown
  top-level key and the run would train without the sharding it asked for; unknown top-level
  keys, anything DeepSpeed's own config models reject in the sections they model, and "aio"
  keys DeepSpeed does not read (`thread_count`, renamed `intra_op_parallelism`), are refused
  with the nearest valid name (`check_top_level_keys`, `check_sections`);
- the learning-rate schedule is ours (`pretrain.training.engine.warmup_cosine`), so a ``"scheduler"``
  block is refused rather than silently fighting it. DeepSpeed's WarmupCosineLR applies lr = 0 to
  the first update, which we do not want.
"""
from __future__ import annotations

import copy
import hashlib
import importlib
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

from pretrain.config import Engine, Optimizer, Precision, RunConfig, did_you_mean, read_user_file
from pretrain.errors import ConfigError
from pretrain.resolve.fsdp2_rules import check_deepspeed_schedule, check_fsdp2
from pretrain.resolve.layout import DEEPSPEED_DEFAULT_BUCKET, Layout
from pretrain.mounts import mount_of, network_filesystem, node_local_scratch

AUTO = "auto"


def load_ds_json(path: str | Path) -> dict[str, Any]:
    return read_user_file(path, "DeepSpeed config", language="JSON",
                          hint="choose one of ds_configs/*.json or set deepspeed=<path> in the "
                               "run config",
                          expect="a JSON object")


def read_run_json(cfg: RunConfig, *, source: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of the run's DeepSpeed JSON (`source`, else the file `cfg.deepspeed` names) as
    written, refused when a top-level key is misspelled or when it asks `train.engine: fsdp2`
    for what fsdp2 does not do (`check_fsdp2`); `fill_ds_config` resolves it."""
    ds = copy.deepcopy(source if source is not None else load_ds_json(cfg.deepspeed))
    check_top_level_keys(ds, where=cfg.deepspeed)  # a misspelled section changes what is read
    if cfg.train.engine is Engine.FSDP2:
        check_fsdp2(cfg, ds, where=cfg.deepspeed or "the DeepSpeed config")
    else:
        check_deepspeed_schedule(cfg)
    return ds


# DeepSpeed's top-level keys (its config documentation; `deepspeed.runtime.constants` adds any
# this list lacks); DeepSpeed itself ignores a key it does not know.
DEEPSPEED_KEYS = frozenset("""
    train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps optimizer
    scheduler communication_data_type seq_parallel_communication_data_type prescale_gradients
    gradient_predivide_factor sparse_gradients fp16 bf16 amp torch_autocast gradient_clipping
    zero_optimization zero_allow_untested_optimizer zero_force_ds_cpu_optimizer aio
    steps_per_print wall_clock_breakdown dump_state memory_breakdown flops_profiler
    activation_checkpointing sparse_attention data_efficiency curriculum_learning
    compression_training checkpoint data_types tensorboard wandb csv_monitor comet comms_logger
    autotuning elasticity pipeline hybrid_engine compile nebula weight_quantization eigenvalue
    progressive_layer_drop quantize_training timers disable_allgather dataloader_drop_last
    graph_harvesting use_data_before_expert_parallelism tensor_parallel zero_quantized_weights
""".split())
# Sections DeepSpeed validates with its own models (pydantic, unknown keys forbidden).
DEEPSPEED_MODELS = {
    "zero_optimization": ("deepspeed.runtime.zero.config", "DeepSpeedZeroConfig"),
    "bf16": ("deepspeed.runtime.precision_config", "DeepSpeedBF16Config"),
    "fp16": ("deepspeed.runtime.precision_config", "DeepSpeedFP16Config"),
    "tensorboard": ("deepspeed.monitor.config", "TensorBoardConfig"),
    "wandb": ("deepspeed.monitor.config", "WandbConfig"),
    "csv_monitor": ("deepspeed.monitor.config", "CSVConfig"),
    "comet": ("deepspeed.monitor.config", "CometConfig"),
    "comms_logger": ("deepspeed.comm.config", "CommsLoggerConfig"),
    "compile": ("deepspeed.compile.config", "CompileConfig"),
}


SHIPPED_DIR = Path(__file__).resolve().parents[2] / "ds_configs"


def shipped_ds_configs() -> dict[tuple[int, str, str], str]:
    """(ZeRO stage, optimizer offload device, parameter offload device) -> the shipped JSON
    (`ds_configs/<name>.json`) that selects it: what `plan --search` can tell a user to pass."""
    found: dict[tuple[int, str, str], str] = {}
    for path in sorted(SHIPPED_DIR.glob("*.json")):
        ds = json.loads(path.read_text())
        key = (zero_stage(ds), *offload_devices(ds))
        found.setdefault(key, f"ds_configs/{path.name}")
    return found


def _known_top_level_keys() -> frozenset[str]:
    from deepspeed.runtime import constants

    return DEEPSPEED_KEYS | {value for key, value in vars(constants).items()
                             if key.isupper() and isinstance(value, str)}


def check_top_level_keys(ds: dict[str, Any], *, where: str) -> None:
    """Refuse a top-level key DeepSpeed does not read (it would ignore it silently)."""
    known = _known_top_level_keys()
    for key in ds:
        if key not in known:
            hint = did_you_mean(key, DEEPSPEED_KEYS, cutoff=0.6, quote=True)
            raise ConfigError(f"{where}: unknown DeepSpeed key {key!r}{hint}: DeepSpeed would "
                              "ignore it")


def _model_fields(model: type, path: tuple) -> set[str]:
    """The keys (names and aliases) the DeepSpeed model nested at `path` in `model` accepts."""
    import typing

    import pydantic

    for part in path:
        field = next((f for n, f in model.model_fields.items() if part in (n, f.alias)), None)
        if field is None:
            return set()
        candidates = [field.annotation, *typing.get_args(field.annotation)]
        model = next((c for c in candidates if isinstance(c, type)
                      and issubclass(c, pydantic.BaseModel)), None)
        if model is None:
            return set()
    return {n for n in model.model_fields} | {f.alias for f in model.model_fields.values()
                                              if f.alias}


# "aio" keys DeepSpeed renamed: it reads only the new name and ignores the old one.
RENAMED_AIO_KEYS = {"thread_count": "intra_op_parallelism"}


def _aio_keys() -> frozenset[str]:
    """The keys of the "aio" section DeepSpeed reads (`deepspeed.runtime.swap_tensor.aio_config`,
    a plain dict without a model that would refuse the others)."""
    from deepspeed.runtime.swap_tensor import constants

    return frozenset(value for name, value in vars(constants).items()
                     if name.startswith("AIO_") and isinstance(value, str)
                     and value.isidentifier())


def check_sections(ds: dict[str, Any], *, where: str) -> None:
    """Validate the sections DeepSpeed models (ZeRO, bf16/fp16, monitors, ...) with DeepSpeed's
    own models, as `deepspeed.initialize` would on every rank, and the "aio" keys against the
    names DeepSpeed reads; one error naming the key."""
    import pydantic

    aio_keys = _aio_keys()
    for key in ds.get("aio") or {}:
        if key not in aio_keys:
            new = RENAMED_AIO_KEYS.get(key)
            hint = (f" (DeepSpeed renamed it {new!r})" if new
                    else did_you_mean(key, aio_keys, cutoff=0.6, quote=True))
            raise ConfigError(f"{where}: unknown DeepSpeed key aio.{key}{hint}: DeepSpeed would "
                              "ignore it")
    for section, (module, name) in DEEPSPEED_MODELS.items():
        if not isinstance(ds.get(section), dict):
            continue
        model = getattr(importlib.import_module(module), name)
        try:
            model(**ds[section])
        except pydantic.ValidationError as error:
            first = error.errors()[0]
            loc = tuple(str(part) for part in first["loc"])
            key = ".".join((section, *loc))
            if first["type"] == "extra_forbidden":
                hint = did_you_mean(loc[-1], _model_fields(model, loc[:-1]), cutoff=0.6,
                                    quote=True)
                raise ConfigError(f"{where}: unknown DeepSpeed key {key}{hint}") from None
            raise ConfigError(f"{where}: DeepSpeed rejects {key}={first.get('input')!r}: "
                              f"{first['msg']}") from None


def _fill(section: dict[str, Any], key: str, value: Any, *, where: str) -> None:
    """Set an "auto" (or absent) key; an explicit value must equal what the run config implies."""
    current = section.get(key, AUTO)
    if current == AUTO:
        section[key] = value
    elif current != value:
        raise ConfigError(f"DeepSpeed config {where}{key}={current!r} contradicts the run config, "
                          f"which gives {value!r}: set it to \"auto\" or change the run config")


def _find_auto(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _find_auto(v, f"{prefix}{k}.")]
    return [prefix.rstrip(".")] if node == AUTO else []


def _check_writable(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ConfigError(f"NVMe offload path {path!r} is not writable ({exc.strerror}): set "
                          "zero_optimization.offload_*.nvme_path to a writable local disk") from None


def nvme_swap_path(chosen: str, *, run_dir: str | Path, where: str) -> str:
    """Where NVMe offload swaps: `chosen`, or for "auto" a folder of this run in the node's
    scratch directory (`mounts.node_local_scratch`: $SLURM_TMPDIR, $TMPDIR, /tmp), named after
    the run directory so that runs sharing a node do not share swap files.

    Swapping is many O_DIRECT reads and writes at every step: on a network file system it is
    slow and may fail (no O_DIRECT). "auto" landing on one is refused; an explicit path on one is
    the user's choice and warned about, as is a tmpfs (memory, not a disk)."""
    if chosen == AUTO:
        run = Path(run_dir).resolve()
        tag = hashlib.sha256(str(run).encode()).hexdigest()[:8]
        path = str(node_local_scratch() / "pretrain_nvme_swap" / f"{run.name}-{tag}")
    else:
        path = chosen
    network = network_filesystem(path)
    if network and chosen == AUTO:
        raise ConfigError(f"{where}: \"auto\" gives {path!r}, which is on a {network} network "
                          "file system (from $SLURM_TMPDIR / $TMPDIR / /tmp): NVMe swap needs a "
                          "node-local disk; set nvme_path to one, or TMPDIR")
    mount = mount_of(path)
    if network or (mount is not None and mount.fstype == "tmpfs"):
        reason = (f"a {network} network file system: slow and maybe without O_DIRECT" if network
                  else "a tmpfs: the swap files take memory, not disk")
        warnings.warn(f"{where}={path!r} is on {reason}; NVMe offload wants a node-local disk",
                      stacklevel=2)
    _check_writable(path)
    return path


def zero_stage(ds: dict[str, Any]) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))


def offload_devices(ds: dict[str, Any]) -> tuple[str, str]:
    """(optimizer offload device, parameter offload device); 'none' when not offloaded."""
    zero = ds.get("zero_optimization", {})
    return (zero.get("offload_optimizer", {}).get("device", "none"),
            zero.get("offload_param", {}).get("device", "none"))


def engine_fields(ds: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed JSON's part of a `pretrain.resolve.layout.Layout`: ZeRO stage, offload devices and
    bucket sizes (DeepSpeed's defaults where the JSON has none)."""
    zero = ds.get("zero_optimization", {})
    stage = zero_stage(ds)
    opt_dev, param_dev = offload_devices(ds)
    gather_key = "stage3_prefetch_bucket_size" if stage == 3 else "allgather_bucket_size"
    return dict(zero_stage=stage, offload_optimizer=opt_dev, offload_param=param_dev,
                reduce_bucket=_bucket(zero, "reduce_bucket_size", DEEPSPEED_DEFAULT_BUCKET),
                allgather_bucket=_bucket(zero, gather_key, DEEPSPEED_DEFAULT_BUCKET),
                max_live_parameters=_bucket(zero, "stage3_max_live_parameters",
                                            Layout.max_live_parameters))


def _bucket(zero: dict[str, Any], key: str, default: int) -> int:
    """A bucket size of the JSON; "auto" (filled later from the model) counts as the default."""
    value = zero.get(key, default)
    if value == AUTO:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ConfigError(f"DeepSpeed config zero_optimization.{key}={value!r}: must be a whole "
                          "number of elements or \"auto\"")
    return int(value)


def check_deepspeed_pipeline_config(ds_config: dict, *, sequence_parallel: bool) -> None:
    """Refuse DeepSpeed "pipeline" settings that silently break the pipelined model; called on
    the resolved DeepSpeed config before `deepspeed.initialize`.

    With tensor parallelism DeepSpeed sends each TP rank's 1/tp part of the stage output and
    all-gathers it on the next stage (`pipe_partitioned`, and `grad_partitioned` for the
    gradients; both on by default), which assumes every TP rank holds the same activations.
    Under sequence parallelism each holds a different T/tp slice of the sequence, and the
    gathered tensor mixes them: measured at tp=2 x pp=2, the first loss is off by 7e-4 and no
    error is raised. Both must be false then (each rank sends its own slice whole).
    """
    section = ds_config.get("pipeline", {})
    if sequence_parallel:
        on = [key for key in ("pipe_partitioned", "grad_partitioned") if section.get(key, True)]
        if on:
            raise ConfigError(
                f"DeepSpeed pipeline {' and '.join(on)} (default true) with sequence "
                "parallelism mixes the tensor-parallel ranks' sequence slices between stages: "
                'set "pipeline": {"pipe_partitioned": false, "grad_partitioned": false} in '
                "the DeepSpeed config")


def _gradient_dtype(precision: Precision, *, zero_stage: int, pipeline: bool = False) -> str:
    """The dtype micro-batch gradients are summed and reduced in: fp32 for bf16 under ZeRO and
    in pipelines (like Megatron-LM: bf16's 8-bit mantissa drops the small terms of a long sum),
    else the model's. A bf16 pipeline at ZeRO-0 steps in DeepSpeed's BF16_Optimizer, whose
    gradient buffer has this dtype (`pretrain.training.engine` lets DeepSpeed build it with fp32 there);
    the flat ZeRO-0 engine (FP16_UnfusedOptimizer) cannot: it sums in bf16. fp16 keeps its own
    dtype and loss scaling."""
    if precision == Precision.BF16 and (zero_stage >= 1 or pipeline):
        return "fp32"
    return {Precision.FP32: "fp32", Precision.BF16: "bf16", Precision.FP16: "fp16"}[precision]


def _resolve_gradient_dtypes(ds: dict[str, Any], precision: Precision, *, zero_stage: int,
                             pipeline: bool, where: str) -> None:
    """Fill "auto" grad_accum_dtype / communication_data_type (`_gradient_dtype`); an explicit
    one is the user's choice, refused only where DeepSpeed would refuse it at start-up."""
    grads = _gradient_dtype(precision, zero_stage=zero_stage, pipeline=pipeline)
    data_types = ds.setdefault("data_types", {})
    for section, key in ((data_types, "grad_accum_dtype"), (ds, "communication_data_type")):
        if section.get(key, AUTO) == AUTO:
            section[key] = grads
    model = _gradient_dtype(precision, zero_stage=0)
    if zero_stage == 0 and data_types["grad_accum_dtype"] not in (model, grads):
        raise ConfigError(f"{where}: data_types.grad_accum_dtype="
                          f"{data_types['grad_accum_dtype']!r} needs ZeRO >= 1 (DeepSpeed sums "
                          f"ZeRO-0 gradients in the model's dtype, {model!r}): set it to \"auto\"")


def _resolve_immediate_grad_update(bf16: dict[str, Any], precision: Precision) -> None:
    """Fill an absent or "auto" bf16.immediate_grad_update: true for bf16 runs. DeepSpeed's
    BF16_Optimizer (bf16 at ZeRO-1, bf16 pipelines) then adds each parameter's bf16 gradient
    into its fp32 sum in the gradient's own backward hook and frees it, instead of keeping every
    bf16 gradient to the end of backward and adding them all then: the same fp32 sum of the same
    bf16 gradients (one rounding each), without a bf16 gradient of the whole stage held from one
    backward to the next (2 bytes per parameter) or autograd's accumulation into it. In a
    pipeline it is also what makes the sum right: without it, DeepSpeed's pipeline engine adds
    every stage but the last's bf16 gradients into fp32 after each micro-batch without clearing
    them, so micro-batch k's gradient is counted (n - k + 1) times
    (tests/test_train_zero.py::test_bf16_pipeline_stages_accumulate_each_micro_batch_once).
    Other optimizers do not read it. An explicit value is the user's choice."""
    if precision == Precision.BF16 and bf16.get("immediate_grad_update", AUTO) == AUTO:
        bf16["immediate_grad_update"] = True


DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def gradient_dtypes(layout: Layout, ds: dict[str, Any] | None = None) -> tuple[str, str]:
    """(data_types.grad_accum_dtype, communication_data_type) of a run of `layout`: those of its
    resolved DeepSpeed JSON `ds`, or, where `ds` is None or leaves them "auto" (every shipped
    JSON), what `fill_ds_config` fills in. The planner counts the data-parallel bytes and
    DeepSpeed's choice of optimizer wrapper from them."""
    rule = _gradient_dtype(layout.precision, zero_stage=layout.zero_stage,
                           pipeline=layout.pipeline > 1)
    ds = ds or {}
    accum = (ds.get("data_types") or {}).get("grad_accum_dtype", AUTO)
    communication = ds.get("communication_data_type", AUTO)
    return (rule if accum == AUTO else accum), (rule if communication == AUTO else communication)


def immediate_grad_update(layout: Layout, ds: dict[str, Any] | None = None) -> bool:
    """bf16.immediate_grad_update of a run of `layout` (`_resolve_immediate_grad_update`'s rule
    where `ds` is None or leaves it "auto")."""
    value = ((ds or {}).get("bf16") or {}).get("immediate_grad_update", AUTO)
    return layout.precision == Precision.BF16 if value == AUTO else bool(value)


def _check_muon_layout(cfg: RunConfig, layout: Layout) -> None:
    """ConfigError for a layout whose optimizer wrapper `training/muon.py` cannot read (where a
    matrix's pieces lie): DeepSpeed's optimizer offload, pipeline stages (their groups differ
    per stage), and bf16/fp16 at ZeRO-0/1 (DeepSpeed's FP16_UnfusedOptimizer, BF16_Optimizer).
    fsdp2 takes any of its layouts."""
    if Engine(cfg.train.engine) is Engine.FSDP2:
        return
    why = None
    if layout.offload_optimizer != "none":
        why = f"optimizer offload ({layout.offload_optimizer})"
    elif layout.pipeline > 1:
        why = f"pipeline parallelism ({layout.pipeline} stages)"
    elif layout.precision != Precision.FP32 and layout.zero_stage < 2:
        why = f"{Precision(layout.precision).value} at ZeRO-{layout.zero_stage}"
    if why:
        raise ConfigError(f"train.optimizer=muon under DeepSpeed does not take {why}: use "
                          "ZeRO-2/3 (any precision) or fp32 at ZeRO-0/1 without pipeline "
                          "stages or optimizer offload, or train.engine=fsdp2")


def fill_ds_config(cfg: RunConfig, layout: Layout, ds: dict[str, Any], *,
                   accelerator: str = "cpu") -> dict[str, Any]:
    """Fill every "auto" of the DeepSpeed JSON `ds` (a copy of it: changed in place and
    returned) from `cfg` and its checked `layout` (`pretrain.resolve.run.resolve_layout`); raise
    ConfigError on conflicts. `accelerator` is DeepSpeed's accelerator name ("cpu", "cuda",
    ...): it decides whether the optimizer is torch's AdamW (CPU, no offload) or DeepSpeed's
    fused / CPU Adam.
    """
    where_file = cfg.deepspeed
    t = cfg.train
    _fill(ds, "train_micro_batch_size_per_gpu", t.micro_batch_size, where="")
    _fill(ds, "gradient_accumulation_steps", layout.grad_accum, where="")
    # samples per step, each context rank's chunk counted (DeepSpeed's data parallelism is
    # data x context): layout.global_batch x parallel.context
    _fill(ds, "train_batch_size", layout.deepspeed_batch, where="")
    _fill(ds, "gradient_clipping", float(t.grad_clip), where="")
    stage = layout.zero_stage
    if layout.pipeline > 1 and layout.sequence_parallel:
        section = ds.setdefault("pipeline", {})
        section.setdefault("pipe_partitioned", False)
        section.setdefault("grad_partitioned", False)
        check_deepspeed_pipeline_config(ds, sequence_parallel=True)
    if "scheduler" in ds:
        raise ConfigError(f"{where_file}: remove the \"scheduler\" block: the schedule is set by "
                          "train.lr, train.min_lr, train.warmup_steps and train.steps")

    zero = ds.setdefault("zero_optimization", {"stage": 0})
    h = cfg.model.hidden_size
    if stage == 3:  # the Hugging Face Trainer's sizing rules for ZeRO-3 buckets
        _fill(zero, "reduce_bucket_size", h * h, where="zero_optimization.")
        _fill(zero, "stage3_prefetch_bucket_size", int(0.9 * h * h), where="zero_optimization.")
        _fill(zero, "stage3_param_persistence_threshold", 10 * h, where="zero_optimization.")
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key, {})
        if section.get("device") == "nvme":
            section["nvme_path"] = nvme_swap_path(section.get("nvme_path", AUTO),
                                                  run_dir=cfg.run_dir, where=f"{where_file}: "
                                                  f"zero_optimization.{key}.nvme_path")

    if t.optimizer is Optimizer.MUON:  # the engine hands DeepSpeed its own (training/muon.py)
        _check_muon_layout(cfg, layout)
        ds.pop("optimizer", None)
        ds["zero_allow_untested_optimizer"] = True
    opt = ds.get("optimizer")
    if opt is not None:
        params = opt.setdefault("params", {})
        _fill(params, "lr", t.lr, where="optimizer.params.")
        _fill(params, "betas", [t.beta1, t.beta2], where="optimizer.params.")
        _fill(params, "eps", t.eps, where="optimizer.params.")
        _fill(params, "weight_decay", t.weight_decay, where="optimizer.params.")
        # torch's AdamW unless the optimizer is offloaded (then DeepSpeed's CPU Adam, a host op):
        # fused on GPUs, where DeepSpeed's FusedAdam would JIT-compile with nvcc on every rank at
        # the first step (a compiler on the compute nodes, and a lock a cancelled build leaves).
        use_torch = layout.offload_optimizer == "none"
        _fill(params, "torch_adam", use_torch, where="optimizer.params.")
        if use_torch and accelerator != "cpu":
            params.setdefault("fused", True)

    precision = layout.precision  # `auto` resolved (a run resolves it on its device first)
    bf16 = ds.setdefault("bf16", {})
    fp16 = ds.setdefault("fp16", {})
    _fill(bf16, "enabled", precision == Precision.BF16, where="bf16.")
    _fill(fp16, "enabled", precision == Precision.FP16, where="fp16.")
    _resolve_gradient_dtypes(ds, precision, zero_stage=stage, pipeline=layout.pipeline > 1,
                             where=where_file)
    _resolve_immediate_grad_update(bf16, precision)

    left = _find_auto(ds)
    if left:
        raise ConfigError(f"{where_file}: no run-config value for \"auto\" field {left[0]}: "
                          "set it explicitly")
    check_sections(ds, where=where_file)
    return ds
