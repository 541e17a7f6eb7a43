"""What a run writes to its metrics sink: one "run" record when it starts, one "train" record
per optimizer step (loss, lr, gradient norm, throughput, MFU / HFU, memory), and the whole-model
gradient norm DeepSpeed does not keep at ZeRO-0."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as torch_dist

from pretrain import telemetry
from pretrain.arithmetic import hardware_flops_per_token, model_flops_per_token, num_parameters
from pretrain.config import Precision, RunConfig
from pretrain.dist import World, wait_for_io
from pretrain.ds_config import offload_devices, zero_stage
from pretrain.hardware import cpu_mfu_peak, format_flops
from pretrain.layout import Layout
from pretrain.model import DTYPES
from pretrain.topology import ProcessGroups


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


class StepRecords:
    """Builds the "train" record of each step; knows the model's FLOPs per token and the
    device's peak, so MFU and HFU are computed the same way every step."""

    def __init__(self, cfg: RunConfig, *, world_size: int, device: str, main: bool,
                 peak: tuple[float, str] | None = None, log=telemetry.log) -> None:
        """`peak`: (TFLOP/s per device, its source); measured on every rank at once when None
        (a collective then)."""
        self.cfg, self.world_size, self.device, self.main = cfg, world_size, device, main
        self.flops_per_token = model_flops_per_token(cfg.model)
        self._dtype = DTYPES[cfg.train.precision]
        if peak is None:
            wait_for_io()  # every rank measures at once: its share of the cores, not all of them
            peak = telemetry.device_peak_tflops(self._dtype, cfg.logging.peak_tflops)
        self.peak_tflops, self.peak_source = peak
        self.peak_reliable, self._remeasured = True, cfg.logging.peak_tflops > 0
        self._log = log
        self.gpu = telemetry.GpuStats(enabled=None if main else False)

    def _check_peak(self, achieved_tflops: float) -> None:
        """A step faster than the peak means the peak was measured low (a busy moment, a kernel
        the loop did not reach): measure it once more, longer; if the step still beats it,
        MFU is not printed for the rest of the run."""
        if not self.peak_reliable or achieved_tflops <= self.peak_tflops:
            return
        if not self._remeasured:
            self._remeasured = True
            if self.device.startswith("cuda"):
                again = telemetry.measure_matmul_tflops(self._dtype, device="cuda", seconds=2.0)
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
               grad_norm: float | None) -> dict[str, Any]:
        """`grad_norm`: ours, used when the engine reports none (ZeRO-0)."""
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
            name: telemetry.mfu(flops_per_token=flops, tokens_per_s_per_device=per_device,
                                peak_tflops=self.peak_tflops) if self.peak_reliable else None
            for name, flops in (("mfu", self.flops_per_token), ("hfu", hardware_flops))}
        rec: dict[str, Any] = {
            "kind": "train", "step": step, "loss": loss,
            "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
            "tflops_per_device": self.flops_per_token * tokens_per_s / self.world_size / 1e12,
            "mfu": utilisation["mfu"],
            "hw_tflops_per_device": hardware_flops * per_device / 1e12,
            "hfu": utilisation["hfu"],
            "peak_mem_gb": telemetry.peak_memory_gb(),
            "peak_mem_gb_ranks": telemetry.peak_memory_all_ranks(self.device),
            "data_wait_s": wait, "step_time_s": elapsed,
            "consumed_samples": consumed_samples, "skipped_steps": engine.skipped_steps,
        }
        if self.cfg.train.precision == Precision.FP16:
            rec["loss_scale"] = float(getattr(engine.optimizer, "cur_scale", float("nan")))
        rec.update(self.gpu.read())  # rank 0: NVML utilisation / temperature / memory on GPUs
        return rec


def announce_run(sink: telemetry.MetricsSink, cfg: RunConfig, world: World,
                 ds_config: dict[str, Any], steps: StepRecords, *, layout: Layout,
                 train_samples: int, run_dir: Path) -> None:
    """The "run" record (layout, ZeRO stage, sizes, versions) and its one-line summary."""
    stage = zero_stage(ds_config)
    opt_dev, param_dev = offload_devices(ds_config)
    n_params = num_parameters(cfg.model)
    dp_size, global_batch, grad_accum = layout.data, layout.global_batch, layout.grad_accum
    sink.write({"kind": "run", "world_size": world.world_size, "launcher": world.launcher,
                "tensor": cfg.parallel.tensor, "pipeline": cfg.parallel.pipeline,
                "data_parallel": dp_size, "zero_stage": stage,
                "parameters": n_params, "global_batch": global_batch,
                "grad_accum": grad_accum, "precision": cfg.train.precision.value,
                "peak_tflops": steps.peak_tflops, "peak_source": steps.peak_source,
                "deepspeed_config": cfg.deepspeed,
                "torch": torch.__version__,
                "deepspeed": deepspeed.__version__})
    telemetry.log(
        f"[run] {n_params / 1e6:.1f}M parameters | world {world.world_size} ({world.launcher}) = "
        f"tp {cfg.parallel.tensor} x pp {cfg.parallel.pipeline} x dp {dp_size} | "
        f"ZeRO-{stage} offload opt={opt_dev} param={param_dev} | {cfg.train.precision.value} | "
        f"global batch {global_batch} = micro {cfg.train.micro_batch_size} x accum "
        f"{grad_accum} x dp {dp_size} | {train_samples} train samples of "
        f"{cfg.model.seq_length} tokens | peak {format_flops(steps.peak_tflops)}/device "
        f"({steps.peak_source}) | run dir {run_dir}", main=world.is_main)
