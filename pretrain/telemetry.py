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
from pathlib import Path
from typing import Any

import torch

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


class MetricsSink:
    """Writes records to metrics.jsonl, tensorboard and wandb (rank 0 only; no-op elsewhere)."""

    def __init__(self, run_dir: Path, *, enabled: bool, tensorboard: bool, wandb_mode: str,
                 wandb_project: str, run_config: dict[str, Any]):
        self.enabled = enabled
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self._file = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        wandb_mode = resolve_wandb_mode(wandb_mode, project=wandb_project, env=os.environ)
        if wandb_mode != "disabled":
            import wandb

            self._wandb = wandb.init(project=wandb_project or "pretrain", dir=str(run_dir),
                                     mode=wandb_mode, config=run_config, name=run_dir.name,
                                     settings=wandb.Settings(silent=True, console="off"))
            url = getattr(self._wandb, "url", None)
            log(f"[wandb] {wandb_mode}: {url or run_dir / 'wandb'}")

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        step = record.get("step")
        numbers = {f"{record['kind']}/{k}": v for k, v in clean.items()
                   if isinstance(v, (int, float)) and v is not None and k != "step"}
        if self._tb is not None and step is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None and step is not None:
            self._wandb.log(numbers, step=step)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def log(msg: str, *, main: bool = True) -> None:
    """Print from rank 0 only, through tqdm so an active progress bar is not broken."""
    if not main:
        return
    from tqdm import tqdm

    tqdm.write(msg, file=sys.stdout)
    sys.stdout.flush()
