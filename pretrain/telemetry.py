"""Measured numbers for the step line and `metrics.jsonl`: memory, peak FLOP/s, MFU, sinks.

`metrics.jsonl` (rank 0, one JSON object per line, flushed as written) is the run's
machine-readable record. Fields:

``{"kind": "train", ...}`` once per optimizer step
    step, loss (mean over the global batch), lr, grad_norm (global, before clipping; null if
    DeepSpeed did not compute one), tokens_per_s (whole job), tflops_per_device (model FLOPs),
    mfu (model FLOPs utilisation against `peak_tflops`), hw_tflops_per_device and hfu (hardware
    FLOPs, counting the forward of recomputed layers), peak_mem_gb (this rank's allocator peak on
    GPUs; process peak RSS on CPU), peak_mem_gb_ranks (the same for every rank, in rank order),
    data_wait_s (time waiting for the data loader this step),
    step_time_s, consumed_samples, skipped_steps (cumulative, fp16 overflow), loss_scale (fp16),
    and on GPUs gpu_util_pct, gpu_temp_c, gpu_mem_used_gb (NVML, rank 0's device).
``{"kind": "eval", ...}`` once per validation pass
    step, loss, ppl, tokens.
``{"kind": "run", ...}`` first line: world size, layout, parameters, peak_tflops, versions.
"""
from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pretrain.config import LoggingConfig
from pretrain.errors import ConfigError
from pretrain.hardware import (KNOWN_GPU_PEAK_TFLOPS, cpu_mfu_peak, format_flops,
                               measure_matmul_tflops)


def peak_memory_gb() -> float:
    """Peak memory of this rank: the accelerator allocator's peak, or the process's peak RSS."""
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    if accel.device_name() != "cpu":
        return accel.max_memory_allocated() / 2**30
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux
    return kb / 2**20


def peak_memory_all_ranks(device: str) -> list[float]:
    """Every rank's `peak_memory_gb`, in rank order (a collective: all ranks call it)."""
    import torch.distributed as dist

    mine = torch.tensor([peak_memory_gb()], dtype=torch.float64, device=device)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine.item()]
    values = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(values, mine)
    return [v.item() for v in values]


def device_peak_tflops(dtype: torch.dtype, configured: float = 0.0) -> tuple[float, str]:
    """(peak TFLOP/s per device for `dtype`, where the number came from).

    `logging.peak_tflops` when set; a GPU's data sheet; else measured here: on CPUs with this
    rank's threads, the best 512^2 or 1024^2 matmul loop in `dtype` or fp32. Ranks measure at the
    same time (StepRecords waits for them all first), so a rank's share of the cores is what it
    measures.
    """
    if configured > 0:
        return configured, "logging.peak_tflops"
    from deepspeed.accelerator import get_accelerator

    name = str(dtype).split(".")[-1]
    if get_accelerator().device_name() == "cuda":
        gpu = torch.cuda.get_device_name()
        for key, peak in KNOWN_GPU_PEAK_TFLOPS.items():
            if key in gpu:
                return (peak if dtype != torch.float32 else peak / 2), f"data sheet ({gpu})"
        return measure_matmul_tflops(dtype, device="cuda"), f"measured {name} matmul ({gpu})"
    return cpu_mfu_peak(dtype)


def mfu(*, flops_per_token: float, tokens_per_s_per_device: float, peak_tflops: float) -> float:
    return flops_per_token * tokens_per_s_per_device / (peak_tflops * 1e12) if peak_tflops else 0.0


class GpuStats:
    """This rank's GPU utilisation (%), temperature (C) and used memory (GB), read through NVML.

    NVML is opened once, at the first reading, not every step. When it cannot be (no pynvml, no
    driver) or a reading fails (NotSupported on MIG and vGPU, NoPermission), the stats are off
    for the rest of the run after one log line: telemetry never stops a run. {} without a GPU.
    """

    def __init__(self, *, enabled: bool | None = None) -> None:
        self._on = torch.cuda.is_available() if enabled is None else enabled
        self._nvml: Any = None
        self._handle: Any = None

    def read(self) -> dict[str, float]:
        if not self._on:
            return {}
        try:
            if self._handle is None:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(_nvml_index())
            nvml, handle = self._nvml, self._handle
            return {"gpu_util_pct": float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                    "gpu_temp_c": float(nvml.nvmlDeviceGetTemperature(
                        handle, nvml.NVML_TEMPERATURE_GPU)),
                    "gpu_mem_used_gb": nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**30}
        except Exception as exc:  # noqa: BLE001 - pynvml raises its own NVMLError classes
            self._on = False
            log(f"[telemetry] GPU utilisation/temperature off for this run: NVML failed "
                f"({type(exc).__name__}: {exc})")
            return {}


def _nvml_index() -> int:
    """NVML's index of this process's CUDA device (NVML ignores CUDA_VISIBLE_DEVICES)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    device = torch.cuda.current_device()
    if visible != [""] and visible[device].strip().isdigit():
        return int(visible[device])
    return device


class StepProfiler:
    """Torch profiler over optimizer steps `first..last` (1-based, inclusive), exported as a
    Chrome trace (chrome://tracing, Perfetto) per rank: <run_dir>/profile/rank<R>_steps<A>-<B>.json.

    The trainer calls `begin(step)` before and `end(step)` after each step; outside the range
    both do nothing.
    """

    def __init__(self, steps: tuple[int, int] | None, *, run_dir: Path, rank: int):
        self.steps, self.rank, self._prof = steps, rank, None
        self.path = None if steps is None else \
            Path(run_dir) / "profile" / f"rank{rank}_steps{steps[0]}-{steps[1]}.json"

    def begin(self, step: int) -> None:
        if self.steps is None or step != self.steps[0]:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(activities=activities, record_shapes=True)
        self._prof.start()

    def end(self, step: int) -> Path | None:
        """Stop and write the trace after the last profiled step; returns its path then."""
        if self._prof is None or step != self.steps[1]:
            return None
        self._prof.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._prof.export_chrome_trace(str(self.path))
        self._prof = None
        return self.path


def format_step_line(rec: dict[str, Any], total_steps: int) -> str:
    gn = rec.get("grad_norm")
    if rec.get("mfu") is None:  # the step beat the measured peak: no percentage is honest
        utilisation = f"MFU ? ({format_flops(rec['tflops_per_device'])}/device, peak unreliable)"
    else:
        utilisation = f"MFU {100 * rec['mfu']:.1f}%"
        if rec.get("hfu", rec["mfu"]) != rec["mfu"]:  # recomputation: the hardware did more
            utilisation += f" (HFU {100 * rec['hfu']:.1f}%)"
    parts = [f"step {rec['step']:>{len(str(total_steps))}}/{total_steps}",
             f"loss {rec['loss']:.4f}", f"lr {rec['lr']:.2e}",
             f"gnorm {gn:.3f}" if gn is not None else "gnorm -",
             f"{rec['tokens_per_s']:,.0f} tok/s", utilisation,
             f"mem {rec['peak_mem_gb']:.2f}GB", f"data {1000 * rec['data_wait_s']:.0f}ms"]
    if rec.get("skipped_steps"):
        parts.append(f"skipped {rec['skipped_steps']}")
    return " | ".join(parts)


def resolve_wandb_mode(mode: str, *, project: str, env) -> str:
    """"auto": online when the user named a project and wandb has a key (WANDB_API_KEY, or the
    netrc entry `wandb login` writes), else offline."""
    if mode != "auto":
        return mode
    return "online" if project and (env.get("WANDB_API_KEY") or _wandb_login(env)) else "offline"


def _wandb_login(env) -> bool:
    """Whether `wandb login` stored a key for the wandb host in the netrc file ($NETRC, else
    $HOME/.netrc; nothing when neither is in `env`)."""
    import netrc
    from urllib.parse import urlparse

    path = env.get("NETRC") or (str(Path(env["HOME"]) / ".netrc") if env.get("HOME") else None)
    if not path or not Path(path).is_file():
        return False
    host = urlparse(env.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        entry = netrc.netrc(path).authenticators(host)
    except (netrc.NetrcParseError, OSError):
        return False
    return bool(entry and entry[2])


class _TensorBoard:
    """Event files under <run_dir>/tensorboard."""

    def __init__(self, run_dir: Path, **_: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, numbers: dict[str, float], step: int) -> None:
        for key, value in numbers.items():
            self._writer.add_scalar(key, value, step)

    def close(self, status: str) -> None:
        self._writer.close()


class _Wandb:
    """A wandb run in `logging.wandb_mode` (see `resolve_wandb_mode`)."""

    def __init__(self, run_dir: Path, *, settings: LoggingConfig, run_config: dict[str, Any],
                 mode: str) -> None:
        import wandb

        self._run = wandb.init(project=settings.wandb_project or "pretrain", dir=str(run_dir),
                               mode=mode, config=run_config, name=run_dir.name,
                               settings=wandb.Settings(silent=True, console="off"))
        url = getattr(self._run, "url", None)
        log(f"[wandb] {mode}: {url or run_dir / 'wandb'}")

    def log(self, numbers: dict[str, float], step: int) -> None:
        self._run.log(numbers, step=step)

    def close(self, status: str) -> None:
        self._run.finish(exit_code=1 if status == "FAILED" else None)


def mlflow_local_uri(run_dir: Path) -> str:
    """The default MLflow store of a run: SQLite, <run_dir>/mlruns/mlflow.db. MLflow 3's own
    default is SQLite too; its file store (./mlruns) is in maintenance mode and refuses to open
    unless MLFLOW_ALLOW_FILE_STORE is set."""
    return "sqlite:///" + str((Path(run_dir) / "mlruns" / "mlflow.db").resolve())


def flatten_config(tree: dict[str, Any], *, prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1e-3}} -> {"train.lr": 1e-3}: MLflow's params are flat."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten_config(value, prefix=f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class _Mlflow:
    """An MLflow run named after the run directory, in experiment `logging.mlflow_experiment`:
    the flattened config as params, every numeric field of each record as a metric at its step.

    Each start of `pretrain train` is a run of its own (a resumed run may change the config, and
    MLflow refuses to change a logged param). MLflow's usage reports are off unless the user set
    MLFLOW_DISABLE_TELEMETRY: compute nodes are often offline.
    """

    def __init__(self, run_dir: Path, *, settings: LoggingConfig, run_config: dict[str, Any],
                 **_: Any) -> None:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.tracking import MlflowClient

        _set_library_logger("mlflow")  # importing mlflow set its logger to INFO
        local = not settings.mlflow_tracking_uri
        if local:
            (run_dir / "mlruns").mkdir(parents=True, exist_ok=True)
        self.uri = settings.mlflow_tracking_uri or mlflow_local_uri(run_dir)
        self._client = MlflowClient(tracking_uri=self.uri)
        experiment = self._experiment_id(
            settings.mlflow_experiment,
            artifacts=(run_dir / "mlruns" / "artifacts").resolve().as_uri() if local else None)
        self.run_id = self._client.create_run(experiment, run_name=run_dir.name).info.run_id
        self._log_params(flatten_config(run_config))
        log(f"[mlflow] {self.uri} run {self.run_id}")

    def _experiment_id(self, name: str, *, artifacts: str | None) -> str:
        """The experiment's id, created when missing (by another run at the same time too)."""
        found = self._client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self._client.create_experiment(name, artifact_location=artifacts)
        except Exception:  # noqa: BLE001 - MlflowException: another run created it just now
            found = self._client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def _log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        entries = [Param(key, (value if isinstance(value, str) else json.dumps(value))
                         [:MAX_PARAM_VAL_LENGTH]) for key, value in params.items()]
        for start in range(0, len(entries), MAX_PARAMS_TAGS_PER_BATCH):
            self._client.log_batch(self.run_id,
                                   params=entries[start:start + MAX_PARAMS_TAGS_PER_BATCH])

    def log(self, numbers: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[
            Metric(key, float(value), now, step) for key, value in numbers.items()])

    def close(self, status: str) -> None:
        self._client.set_terminated(self.run_id, status=status)


# logging.report_to: each sink's class and the packages it needs (checked before the run;
# MLflow's SQLite store needs SQLAlchemy and Alembic, which mlflow-skinny leaves out).
SINKS = {"tensorboard": (_TensorBoard, ("tensorboard",)), "wandb": (_Wandb, ("wandb",)),
         "mlflow": (_Mlflow, ("mlflow", "sqlalchemy", "alembic"))}


def check_sinks(report_to: list[str]) -> None:
    """Every sink of `logging.report_to` can be imported: checked before the process group,
    not hours into a run."""
    from importlib.util import find_spec

    for sink in report_to:
        missing = [package for package in SINKS[sink][1] if find_spec(package) is None]
        if missing:
            raise ConfigError(f"logging.report_to={report_to!r}: {sink} needs {', '.join(missing)}"
                              f", not installed here: bash launch/setup_env.sh (or pip install "
                              f"-c launch/constraints.txt -e .), or take {sink} off the list")


def _open_sinks(run_dir: Path, *, settings: LoggingConfig,
                run_config: dict[str, Any]) -> list[tuple[str, Any]]:
    """(name, sink) of each sink of `settings.report_to` that is on (wandb_mode may disable
    wandb)."""
    wandb_mode = resolve_wandb_mode(settings.wandb_mode, project=settings.wandb_project,
                                    env=os.environ)
    sinks = []
    for name in settings.report_to:
        if name == "wandb" and wandb_mode == "disabled":
            continue
        sinks.append((name, SINKS[name][0](run_dir, settings=settings, run_config=run_config,
                                           mode=wandb_mode)))
    return sinks


class MetricsSink:
    """Writes records to metrics.jsonl and the sinks of `logging.report_to` (rank 0 only;
    no-op elsewhere).

    A sink that fails while the run goes on (a tracking server that went away) is turned off
    after one warning line: telemetry never stops a run. `close` ends every sink with the run's
    status (MLflow's FINISHED, KILLED for a stop to be requeued, FAILED).
    """

    def __init__(self, run_dir: Path, *, enabled: bool, settings: LoggingConfig,
                 run_config: dict[str, Any]):
        self.enabled, self._closed = enabled, False
        self._sinks: list[tuple[str, Any]] = []
        if not enabled:
            return
        self._file = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self._sinks = _open_sinks(run_dir, settings=settings, run_config=run_config)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        step = record.get("step")
        numbers = {f"{record['kind']}/{k}": v for k, v in clean.items()
                   if isinstance(v, (int, float)) and v is not None and k != "step"}
        if step is None or not numbers:
            return
        for name, sink in list(self._sinks):
            self._guarded(name, sink.log, numbers, step)

    def _guarded(self, name: str, action, *args: Any) -> None:
        """`action(*args)` of sink `name`; on an error the sink is dropped after one line."""
        try:
            action(*args)
        except Exception as exc:  # noqa: BLE001 - each library raises its own errors
            self._sinks = [(n, s) for n, s in self._sinks if n != name]
            log(f"warning: [{name}] off for the rest of the run: {type(exc).__name__}: "
                f"{str(exc)[:300]}", level="warning")

    def close(self, *, status: str = "FINISHED") -> None:
        """Flush and close every sink once; later calls do nothing."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        self._file.close()
        for name, sink in list(self._sinks):
            self._guarded(name, sink.close, status)


# logging.level of our own lines; "result" (step and eval lines) is shown at every level.
_LEVELS = {"debug": 10, "info": 20, "warning": 30, "result": 100}
_threshold = _LEVELS["info"]


def library_level(level: str) -> str:
    """The level of DeepSpeed's and MLflow's loggers for our `logging.level`: their INFO lines
    (DeepSpeed's engine configuration is ~170 of them, some on every rank) only at debug; at info
    and warning their own default, WARNING."""
    return "debug" if level == "debug" else "warning"


def set_log_level(level: str) -> None:
    """Apply `logging.level`: our notes below it are not printed, and DeepSpeed's logger gets
    `library_level(level)`. Call it after DeepSpeed is imported (importing it sets its logger)
    and before the engine is built; a DeepSpeed JSON's "log_level" still wins from then on."""
    global _threshold
    from deepspeed.utils.logging import set_log_level_from_string

    _threshold = _LEVELS[level]
    set_log_level_from_string(library_level(level))


def _set_library_logger(name: str) -> None:
    """A library's logger at `library_level` of the level `set_log_level` applied."""
    import logging

    logging.getLogger(name).setLevel(
        logging.DEBUG if _threshold <= _LEVELS["debug"] else logging.WARNING)


def log(msg: str, *, main: bool = True, level: str = "info") -> None:
    """Print from rank 0 only, through tqdm so an active progress bar is not broken; below the
    `logging.level` threshold nothing is printed ("result": step and eval lines, always)."""
    if not main or _LEVELS[level] < _threshold:
        return
    from tqdm import tqdm

    tqdm.write(msg, file=sys.stdout)
    sys.stdout.flush()
