"""What a run's records hold (where they go is `sinks.py`): one "run" record when it starts (with
what the engine really built: `engine_facts`), one "train" record per optimizer step (loss, lr,
gradient norm, throughput, MFU / HFU, memory, GPU stats) and its step line, and the numbers
measured for them: the whole-model gradient norm DeepSpeed does not keep at ZeRO-0, each rank's
peak memory, NVML's GPU readings."""
from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as torch_dist

from pretrain.arithmetic import (expert_layout_label, expert_tensor_size,
                                 hardware_flops_per_token, model_flops_per_token, num_parameters)
from pretrain.config import Precision, RunConfig
from pretrain.data import BlendedSamples
from pretrain.data.build import Samples
from pretrain.dist import World, group_timeouts, wait_for_io
from pretrain.hardware import (cpu_mfu_peak, device_peak_tflops, format_flops,
                               measure_matmul_tflops)
from pretrain.resolve.layout import Layout
from pretrain.log import log
from pretrain.model import DTYPES
from pretrain.training.sinks import MetricsSink
from pretrain.resolve.topology import ProcessGroups


def global_grad_norm(parameters, groups: ProcessGroups, *, device: str) -> float:
    """L2 norm of the whole model's gradient, each element counted once across the grid.

    Tensor-parallel shards (`tensor_model_parallel`) count on every TP rank; replicated weights
    (norms) on TP rank 0 only; a pipeline-tied weight (`ds_pipe_replicated`) on its first stage
    only; then the squares are summed over the model-parallel (TP x PP) group. DeepSpeed's own
    `clip_grad_norm_` counts replicated weights on model-parallel rank 0 only, which drops the
    norms of every later pipeline stage.
    """
    tp_rank0 = groups.topology.my_coords.tensor == 0
    total = torch.zeros((), device=device)
    for p in parameters:
        if p.grad is None or getattr(p, "ds_pipe_replicated", False):
            continue
        if getattr(p, "tensor_model_parallel", False) or tp_rank0:
            total += p.grad.detach().float().pow(2).sum().to(device)
    if groups.topology.tensor * groups.topology.pipeline > 1:
        torch_dist.all_reduce(total, group=groups.model)
    return total.sqrt().item()


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
    mine = torch.tensor([peak_memory_gb()], dtype=torch.float64, device=device)
    if not torch_dist.is_initialized() or torch_dist.get_world_size() == 1:
        return [mine.item()]
    values = [torch.zeros_like(mine) for _ in range(torch_dist.get_world_size())]
    torch_dist.all_gather(values, mine)
    return [v.item() for v in values]


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


class StepRecords:
    """Builds the "train" record of each step; knows the model's FLOPs per token and the
    device's peak, so MFU and HFU are computed the same way every step."""

    def __init__(self, cfg: RunConfig, *, world_size: int, device: str, main: bool,
                 peak: tuple[float, str] | None = None, log=log) -> None:
        """`peak`: (TFLOP/s per device, its source); measured on every rank at once when None
        (a collective then)."""
        self.cfg, self.world_size, self.device, self.main = cfg, world_size, device, main
        self.flops_per_token = model_flops_per_token(cfg.model)
        self._dtype = DTYPES[cfg.train.precision]
        if peak is None:
            wait_for_io()  # every rank measures at once: its share of the cores, not all of them
            peak = device_peak_tflops(self._dtype, cfg.logging.peak_tflops)
        self.peak_tflops, self.peak_source = peak
        self.peak_reliable, self._remeasured = True, cfg.logging.peak_tflops > 0
        self._log = log
        self.gpu = GpuStats(enabled=None if main else False)

    def _check_peak(self, achieved_tflops: float) -> None:
        """A step faster than the peak means the peak was measured low (a busy moment, a kernel
        the loop did not reach): measure it once more, longer; if the step still beats it,
        MFU is not printed for the rest of the run."""
        if not self.peak_reliable or achieved_tflops <= self.peak_tflops:
            return
        if not self._remeasured:
            self._remeasured = True
            if self.device.startswith("cuda"):
                again = measure_matmul_tflops(self._dtype, device="cuda", seconds=2.0)
            else:
                again = cpu_mfu_peak(self._dtype, seconds=2.0)[0]
            self._log(f"[telemetry] a step reached {format_flops(achieved_tflops)}/device, above "
                      f"the measured peak {format_flops(self.peak_tflops)}: re-measured "
                      f"{format_flops(again)}", main=self.main)
            self.peak_tflops = max(self.peak_tflops, again)
            self.peak_source += ", re-measured"
            if achieved_tflops <= self.peak_tflops:
                return
        self.peak_reliable = False
        self._log(f"[telemetry] the measured peak ({format_flops(self.peak_tflops)}) is below "
                  f"what training achieves: MFU is not reported for this run (set "
                  f"logging.peak_tflops to the device's real peak)", main=self.main)

    def record(self, engine: deepspeed.DeepSpeedEngine, *, step: int, loss: float, lr: float,
               wait: float, elapsed: float, tokens: int, consumed_samples: int,
               grad_norm: float | None, global_batch: int | None = None) -> dict[str, Any]:
        """`grad_norm`: ours, used when the engine reports none (ZeRO-0); `global_batch`: the
        step's samples (train.batch_ramp: its size at this step), recorded when given."""
        engine_norm = engine.get_global_grad_norm()
        if engine_norm is not None:
            grad_norm = engine_norm
        if isinstance(grad_norm, torch.Tensor):
            grad_norm = grad_norm.item()
        tokens_per_s = tokens / elapsed
        per_device = tokens_per_s / self.world_size
        hardware_flops = hardware_flops_per_token(self.cfg.model)  # + recomputed forwards
        self._check_peak(hardware_flops * per_device / 1e12)
        utilisation = {  # None once the peak proved unreliable: never a silent MFU over 100%
            name: mfu(flops_per_token=flops, tokens_per_s_per_device=per_device,
                                peak_tflops=self.peak_tflops) if self.peak_reliable else None
            for name, flops in (("mfu", self.flops_per_token), ("hfu", hardware_flops))}
        rec: dict[str, Any] = {
            "kind": "train", "step": step, "loss": loss,
            "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
            "tflops_per_device": self.flops_per_token * tokens_per_s / self.world_size / 1e12,
            "mfu": utilisation["mfu"],
            "hw_tflops_per_device": hardware_flops * per_device / 1e12,
            "hfu": utilisation["hfu"],
            "peak_mem_gb": peak_memory_gb(),
            "peak_mem_gb_ranks": peak_memory_all_ranks(self.device),
            "data_wait_s": wait, "step_time_s": elapsed,
            "consumed_samples": consumed_samples, "skipped_steps": engine.skipped_steps,
        }
        if global_batch is not None:
            rec["global_batch"] = global_batch
        if self.cfg.train.precision == Precision.FP16:
            rec["loss_scale"] = float(getattr(engine.optimizer, "cur_scale", float("nan")))
        rec.update(self.gpu.read())  # rank 0: NVML utilisation / temperature / memory on GPUs
        return rec


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
    if "moe_aux_loss" in rec:  # a mixture of experts (pretrain/model/moe.py)
        parts.append(f"aux {rec['moe_aux_loss']:.3f}")
        if "moe_load_max_mean_worst" in rec:  # the most unbalanced layer's tokens per expert
            parts.append(f"experts max/mean {rec['moe_load_max_mean_worst']:.2f}")
        if rec["moe_dropped_fraction"]:
            parts.append(f"dropped {100 * rec['moe_dropped_fraction']:.1f}%")
    if rec.get("skipped_steps"):
        parts.append(f"skipped {rec['skipped_steps']}")
    for slow in rec.get("stragglers", ()):  # pretrain.training.stragglers
        parts.append(f"straggler rank {slow['rank']} ({slow['host']}) {slow['slowdown']:.2f}x")
    return " | ".join(parts)


def _dtype_names(tensors) -> list[str]:
    return sorted({str(t.dtype).removeprefix("torch.") for t in tensors})


def _offload_targets(optimizer) -> tuple[str, str]:
    """(optimizer state, parameters): where DeepSpeed's ZeRO optimizer keeps them outside
    accelerator memory ('none': not offloaded), from the flags its step and gather code
    follows: `offload_optimizer` / `swap_optimizer` / `offload_param` /
    `params_in_nvme_and_cpu` at ZeRO-3, `cpu_offload` at ZeRO-1/2."""
    if getattr(optimizer, "offload_optimizer", False) is True:
        state = "nvme" if optimizer.swap_optimizer else "cpu"
    else:
        state = "cpu" if getattr(optimizer, "cpu_offload", False) is True else "none"
    params = "none"
    if getattr(optimizer, "offload_param", False) is True:
        params = "nvme" if optimizer.params_in_nvme_and_cpu else "cpu"
    return state, params


def _stepped_tensors(wrapper, inner) -> list:
    """The tensors the optimizer updates: the flat partitions of DeepSpeed's ZeRO-3, ZeRO-1/2
    and bf16 optimizers (ZeRO-3 hands its partitions to the inner optimizer only during a
    step), else the inner optimizer's parameters."""
    for name in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups",
                 "fp32_groups_flat_partition"):
        if getattr(wrapper, name, None):
            return list(getattr(wrapper, name))
    return [p for group in inner.param_groups for p in group["params"]]


def engine_facts(engine: deepspeed.DeepSpeedEngine) -> dict[str, Any]:
    """What DeepSpeed built, read from the engine and the model instead of the config that asked
    for it, so a setting DeepSpeed or the model builder dropped shows in the run record: the
    ZeRO stage and optimizer wrapper, the inner optimizer (DeepSpeed's CPU Adam when the
    optimizer state is offloaded), the dtypes of the module's parameters (what forward computes
    in) and of the tensors the optimizer steps (the fp32 masters of a bf16 run at ZeRO >= 1),
    where the optimizer state and parameters are offloaded, and whether every layer of the
    model splits sequences over the tensor-parallel ranks, and fsdp2's HSDP replica groups."""
    wrapper = engine.optimizer
    inner = getattr(wrapper, "optimizer", wrapper)
    offload_state, offload_params = (engine.offload_targets() if hasattr(engine, "offload_targets")
                                     else _offload_targets(wrapper))  # fsdp2: its policy
    flags = {m.sequence_parallel for m in engine.module.modules()
             if isinstance(getattr(m, "sequence_parallel", None), bool)}
    return {"engine": getattr(engine, "name", "deepspeed"),  # train.engine as built
            "zero_stage": engine.zero_optimization_stage(),
            "zero_optimizer": type(wrapper).__name__, "optimizer": type(inner).__name__,
            "param_dtypes": (engine.compute_dtypes() if hasattr(engine, "compute_dtypes")
                             else _dtype_names(engine.module.parameters())),
            "master_dtypes": _dtype_names(_stepped_tensors(wrapper, inner)),
            "offload_optimizer": offload_state, "offload_param": offload_params,
            "sequence_parallel": flags == {True},
            "fsdp2_replicas": getattr(engine, "replica_groups", 1)}  # HSDP's replica groups


def announce_run(sink: MetricsSink, cfg: RunConfig, world: World,
                 engine: deepspeed.DeepSpeedEngine, steps: StepRecords, *, layout: Layout,
                 train_data: Samples, run_dir: Path) -> None:
    """The "run" record (layout, what the engine built, sizes, the training samples and, for a
    blend, how many of them each source gives, versions) and its one-line summary."""
    facts = engine_facts(engine)
    train_samples = len(train_data)
    per_source = train_data.counts().tolist() if isinstance(train_data, BlendedSamples) else None
    n_params = num_parameters(cfg.model)
    dp_size, global_batch, grad_accum = layout.data, layout.global_batch, layout.grad_accum
    sink.write({"kind": "run", "world_size": world.world_size, "launcher": world.launcher,
                "tensor": cfg.parallel.tensor, "pipeline": cfg.parallel.pipeline,
                "context": cfg.parallel.context, "context_kind": cfg.parallel.context_kind,
                "expert": layout.expert, "expert_tensor": expert_tensor_size(layout),
                "data_parallel": dp_size, **facts,
                "parameters": n_params, "global_batch": global_batch,
                "grad_accum": grad_accum, "precision": cfg.train.precision.value,
                "train_samples": train_samples, "train_samples_per_source": per_source,
                "peak_tflops": steps.peak_tflops, "peak_source": steps.peak_source,
                "deepspeed_config": cfg.deepspeed, "timeouts_minutes": group_timeouts(),
                "torch": torch.__version__,
                "deepspeed": deepspeed.__version__})
    p = cfg.parallel
    context = (f" x cp {p.context}{' (allgather)' if p.context_kind == 'allgather' else ''}"
               if p.context > 1 else "")
    replicas = facts["fsdp2_replicas"]
    shards = dp_size * p.context // replicas
    hsdp = (f" (hsdp: {replicas} replica groups x {shards} shard{'s' * (shards > 1)})"
            if replicas > 1 else "")
    log(
        f"[run] {n_params / 1e6:.1f}M parameters | world {world.world_size} ({world.launcher}) = "
        f"tp {cfg.parallel.tensor} x pp {cfg.parallel.pipeline}"
        f"{context} x dp {dp_size}{hsdp}{expert_layout_label(layout)} | "
        f"ZeRO-{facts['zero_stage']} offload opt={facts['offload_optimizer']} "
        f"param={facts['offload_param']} | {cfg.train.precision.value} | "
        f"global batch {global_batch} = micro {cfg.train.micro_batch_size} x accum "
        f"{grad_accum} x dp {dp_size} | {train_samples} train samples of "
        f"{cfg.model.seq_length} tokens | peak {format_flops(steps.peak_tflops)}/device "
        f"({steps.peak_source}) | run dir {run_dir}", main=world.is_main)
