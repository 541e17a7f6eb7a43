"""What the machine a rank lands on computes natively, and the precision `auto` picks for it.

CPUs differ more than their names suggest: with AMX, a bf16 matmul runs several times faster than
fp32; with AVX2 only, torch emulates bf16 and the same matmul runs 30-80x *slower*. So
`train.precision: auto` (every shipped config) asks the device:

- CUDA: bf16 where the GPU computes it natively (Ampere and later), else fp32.
- CPU: bf16 when /proc/cpuinfo lists AMX-BF16 or AVX512-BF16, fp32 when it lists neither;
  when the flags cannot be read, a short matmul measurement decides.

fp16 is never chosen automatically (it needs loss scaling). An explicit `bf16` on a CPU that
emulates it still runs, after one warning that names the measured slowdown.

This module also owns the matmul measurement the MFU's peak comes from on CPUs and GPUs without
a data-sheet entry, and the data-sheet table itself.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pretrain.config import Fp8Recipe, Precision

# Dense bf16/fp16 tensor-core peaks (TFLOP/s, no sparsity) from the vendors' data sheets.
KNOWN_GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "A10G": 125.0,
                         "L40S": 362.0, "V100": 125.0}
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclass(frozen=True)
class CpuInfo:
    model: str  # "AMD EPYC 7B13", from /proc/cpuinfo's "model name"
    capability: str  # torch's kernels: DEFAULT, AVX2, AVX512, ...
    flags: frozenset[str] | None  # None where /proc/cpuinfo cannot be read

    @property
    def bf16_native(self) -> bool | None:
        """True / False from the CPU's flags; None when they are unknown."""
        return None if self.flags is None else any(f in self.flags for f in BF16_CPU_FLAGS)

    def describe(self) -> str:
        native = [f for f in BF16_CPU_FLAGS if self.flags and f in self.flags]
        extra = f", {'+'.join(native)}" if native else ""
        return f"{self.model} (torch capability {self.capability}{extra})"


def cpu_info(cpuinfo: str | Path | None = None) -> CpuInfo:
    """This machine's CPU model, torch's CPU capability and the CPU's flags, read from
    `cpuinfo`, else $PRETRAIN_CPUINFO (a container that hides the host's file; the tests'
    stand-in for another CPU), else /proc/cpuinfo."""
    cpuinfo = cpuinfo or os.environ.get("PRETRAIN_CPUINFO") or "/proc/cpuinfo"
    capability = torch.backends.cpu.get_cpu_capability()
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return CpuInfo(model="unknown CPU", capability=capability, flags=None)
    model, flags = "unknown CPU", None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown CPU":
            model = value.strip()
        elif key == "flags" and flags is None:
            flags = frozenset(value.split())
    return CpuInfo(model=model, capability=capability, flags=flags)


def measure_matmul_tflops(dtype: torch.dtype, *, device: str = "cpu", n: int = 1024,
                          seconds: float = 1.0, trials: int = 5) -> float:
    """Achieved TFLOP/s of an n x n matmul loop with this process's threads: the best of
    `trials` short windows (a peak, not a busy moment)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b  # warm-up (oneDNN / cuBLAS picks its kernel)
    best = 0.0
    for _ in range(trials):
        iters, start = 0, time.perf_counter()
        while iters == 0 or time.perf_counter() - start < seconds / trials:
            a @ b
            iters += 1
        if device != "cpu":
            torch.cuda.synchronize()
        best = max(best, 2.0 * n**3 * iters / (time.perf_counter() - start) / 1e12)
    return best


def cpu_peak_tflops(dtype: torch.dtype, *, threads: int | None = None, seconds: float = 1.2,
                    sizes: tuple[int, ...] = (512, 1024)) -> float:
    """The matmul rate of one rank on this CPU in `dtype`: the best loop over `sizes` (n x n),
    with `threads` intra-op threads (default: this process's). What the planner predicts step
    times from."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return max(measure_matmul_tflops(dtype, n=n, seconds=seconds / len(sizes), trials=3)
                   for n in sizes)
    finally:
        torch.set_num_threads(before)


def cpu_mfu_peak(dtype: torch.dtype, *, seconds: float = 1.2) -> tuple[float, str]:
    """(TFLOP/s, what was measured): the denominator of MFU on a CPU, the higher of the
    `dtype` and the fp32 matmul rate. A CPU that emulates bf16 still has its fp32 units, and
    small bf16 matmuls there run several times faster than a 1024^2 one: against the bf16 rate
    alone, MFU would pass 100%."""
    name = str(dtype).split(".")[-1]
    fp32 = cpu_peak_tflops(torch.float32, seconds=seconds)
    own = fp32
    if dtype != torch.float32:  # emulated: a 1024^2 bf16 matmul takes seconds, and loses anyway
        own = cpu_peak_tflops(dtype, seconds=seconds / 2, sizes=(512,))
        if own > fp32 / 2:
            own = max(own, cpu_peak_tflops(dtype, seconds=seconds / 2, sizes=(1024,)))
    threads = f"{torch.get_num_threads()} thread(s) per rank"
    if fp32 > own:
        return fp32, f"measured float32 matmul (above {name}'s {format_flops(own)}), {threads}"
    return own, f"measured {name} matmul, {threads}"


def device_peak_tflops(dtype: torch.dtype, configured: float = 0.0) -> tuple[float, str]:
    """(peak TFLOP/s per device for `dtype`, where the number came from).

    `logging.peak_tflops` when set; a GPU's data sheet; else measured here: on CPUs with this
    rank's threads, the best 512^2 or 1024^2 matmul loop in `dtype` or fp32. Ranks measure at the
    same time (`metrics.StepRecords` waits for them all first), so a rank's share of the cores
    is what it measures.
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


def host_memory_gb() -> float:
    """This machine's physical memory in GiB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def visible_gpus() -> list[tuple[str, float]] | None:
    """(name, memory in GiB) of each GPU this node's `nvidia-smi` lists; None without one (a
    login node, a CPU machine). No CUDA context is created: the pre-flight runs before srun."""
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    gpus = []
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        name, _, mib = line.rpartition(",")
        try:
            gpus.append((name.strip(), float(mib) / 1024))
        except ValueError:
            return None
    return gpus or None


def bf16_slowdown(*, n: int = 256, seconds: float = 0.4, rounds: int = 4) -> float:
    """fp32 over bf16 matmul throughput on this CPU: above 1 when bf16 is slower. The two are
    measured in alternating windows, each keeping its best: a busy moment (another process on
    the cores) slows one window of each, not the whole of one dtype's measurement."""
    fp32 = bf16 = 0.0
    for _ in range(rounds):
        fp32 = max(fp32, measure_matmul_tflops(torch.float32, n=n,
                                               seconds=seconds / (2 * rounds), trials=1))
        bf16 = max(bf16, measure_matmul_tflops(torch.bfloat16, n=n,
                                               seconds=seconds / (2 * rounds), trials=1))
    return fp32 / bf16


def format_flops(tflops: float) -> str:
    """989 TFLOP/s, 2.31 TFLOP/s, or 27.4 GFLOP/s below one TFLOP/s."""
    if tflops >= 100.0:
        return f"{tflops:.0f} TFLOP/s"
    if tflops >= 1.0:
        return f"{tflops:.3g} TFLOP/s"
    return f"{1000 * tflops:.3g} GFLOP/s"


@dataclass(frozen=True)
class PrecisionChoice:
    precision: Precision
    reason: str  # what the run line prints after the precision
    warning: str | None = None  # an explicit choice that will run slowly here


def choose_precision(requested: Precision, device_type: str, *, cpu: CpuInfo | None = None,
                     cuda_bf16: bool | None = None, measure=bf16_slowdown) -> PrecisionChoice:
    """The precision a run uses on this device: `requested` unless it is AUTO.

    `cpu`, `cuda_bf16` and `measure` default to this machine; tests pass their own.
    """
    if device_type == "cuda":
        name = torch.cuda.get_device_name() if cuda_bf16 is None else "this GPU"
        native = (torch.cuda.is_bf16_supported(including_emulation=False)
                  if cuda_bf16 is None else cuda_bf16)
        if requested != Precision.AUTO:
            return PrecisionChoice(requested, "as configured")
        if native:
            return PrecisionChoice(Precision.BF16, f"auto: {name} computes bf16 natively")
        return PrecisionChoice(Precision.FP32, f"auto: {name} has no native bf16")
    cpu = cpu or cpu_info()
    native = cpu.bf16_native
    slowdown = None
    if native is None and requested in (Precision.AUTO, Precision.BF16):
        slowdown = measure()
        native = slowdown <= 1.0
    if requested == Precision.AUTO:
        if native:
            how = "AMX / AVX512-BF16" if slowdown is None else f"bf16 matmul measured " \
                f"{1 / slowdown:.1f}x fp32"
            return PrecisionChoice(Precision.BF16, f"auto: {cpu.describe()} computes bf16 "
                                                   f"natively ({how})")
        how = "no AMX or AVX512-BF16" if slowdown is None else \
            f"bf16 matmul measured {slowdown:.1f}x slower than fp32"
        return PrecisionChoice(Precision.FP32, f"auto: {cpu.describe()} would emulate bf16 ({how})")
    if requested == Precision.BF16 and not native:
        slowdown = slowdown if slowdown is not None else measure()
        return PrecisionChoice(requested, "as configured", warning=(
            f"train.precision=bf16 on {cpu.describe()}, which has no AMX or AVX512-BF16: torch "
            f"emulates bf16 here and a bf16 matmul measured {slowdown:.0f}x slower than fp32. "
            f"Set train.precision=auto (fp32 on this CPU) unless bf16 numerics are the point."))
    return PrecisionChoice(requested, "as configured")


FP8_MIN_CAPABILITY = (8, 9)  # Ada (L4, L40S) and Hopper (H100, H200) multiply in FP8; A100 is 8.0


def gpu_capability() -> tuple[int, int]:
    """This process's GPU's compute capability (major, minor)."""
    return torch.cuda.get_device_capability()


def fp8_refusal(recipe: Fp8Recipe, device_type: str, *,
                capability=None) -> str | None:
    """Why `train.fp8: recipe` cannot run on this device, or None when it can: a GPU below
    compute capability 8.9 has no FP8 matmul (torch._scaled_mm refuses it) and emulating there
    would be slower than bf16. A CPU emulates FP8 (torchao's `emulate`: FP8 rounding, fp32
    matmuls), for tests. `capability()` answers the GPU's compute capability (default
    `gpu_capability`; tests pass a stand-in)."""
    if Fp8Recipe(recipe) is Fp8Recipe.NONE or device_type != "cuda":
        return None
    have = tuple((capability or gpu_capability)())
    if have >= FP8_MIN_CAPABILITY:
        return None
    return (f"train.fp8={Fp8Recipe(recipe).value}: this GPU's compute capability is "
            f"{have[0]}.{have[1]}; FP8 matmuls need {FP8_MIN_CAPABILITY[0]}."
            f"{FP8_MIN_CAPABILITY[1]} or newer (L4, L40S, H100, H200): set train.fp8=none")
