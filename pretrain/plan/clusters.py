"""Cluster descriptions for the planner, and the efficiency assumptions it predicts with.

A `Cluster` is what `pretrain plan` needs to know about the hardware: how many GPUs, how much
memory each has, its dense bf16 peak, and the bandwidth a GPU gets to its node neighbours
(NVLink) and to other nodes (its share of the InfiniBand / RoCE NICs).

The efficiency constants below are the planner's honest assumptions, one set for every cluster
and every run (they are not tuned per run; `tests/test_plan.py` checks the two published runs
with these same numbers):

- `MATMUL_EFFICIENCY`: the fraction of the data-sheet peak that large transformer GEMMs reach
  (cuBLAS on A100/H100 with hidden sizes >= 4096 sustains roughly 60-75%; we take the low end
  because layer norms, rotary, softmax and the optimizer step also take time and are not counted
  as FLOPs).
- `COLLECTIVE_EFFICIENCY`: the fraction of link bandwidth a ring all-reduce / reduce-scatter
  achieves as bus bandwidth (NCCL measures ~80% on NVLink and InfiniBand at large messages).
- Tensor-parallel collectives are *not* overlapped with compute (Megatron-style TP in this
  stack, and in DeepSpeed, runs them on the critical path).
- Data-parallel gradient communication overlaps only the backward pass of the micro-batch it
  runs alongside (the last one for ZeRO 0/1; every one for ZeRO 2/3, which reduce per
  micro-batch); what does not fit behind it is exposed.
- `MEMORY_BANDWIDTH_EFFICIENCY`: the fraction of the data-sheet memory bandwidth a
  memory-bound copy (a concatenation, a dtype-widening add) sustains (~80-90% for large
  contiguous copies on A100/H100; the low end).
- A GPU is usable up to `MEMORY_USABLE_FRACTION` of its memory: the rest goes to the CUDA
  context, NCCL buffers and allocator fragmentation, which the breakdown does not model.
- A pipeline schedule's fixed costs, per cluster (`Cluster.p2p_latency_us`,
  `pipeline_action_us`, `split_backward_layer_us`, `split_backward_fraction`; `pretrain.plan
  .step_time.pipeline_overhead`): each point-to-point message's latency, the schedule runtime's
  host work per action (a forward, a backward, a weight-gradient backward), and the split
  backward's second autograd pass (walking the graph for the weights, per layer, and a share of
  the backward's time: its weight products apart from the input ones). The GPU presets' values
  are estimates, not measured here (NCCL's send/receive of small messages takes ~10 us over
  NVLink in nccl-tests; torch.distributed.pipelining's runtime is Python, ~0.1 ms of host time
  per action; the split backward's graph walk is Python too; its extra share of the backward
  assumed 5%); the CPU ones are measured by
  `bench/pipeline_bubble.py --calibrate` (gloo ranks on one node).
"""
from __future__ import annotations

from dataclasses import dataclass

from pretrain.errors import ConfigError

MATMUL_EFFICIENCY = 0.60
COLLECTIVE_EFFICIENCY = 0.80
MEMORY_BANDWIDTH_EFFICIENCY = 0.80
MEMORY_USABLE_FRACTION = 0.90
# DeepSpeed's CPU Adam (AVX-512) updates roughly this many parameters per second per GPU's share
# of host cores (8-12 cores per GPU): used for the optimizer step under ZeRO-Offload.
CPU_ADAM_PARAMS_PER_S = 1.0e9


@dataclass(frozen=True)
class Cluster:
    """A homogeneous GPU cluster. Bandwidths are per GPU, one direction, in GB/s."""

    name: str
    nodes: int
    gpus_per_node: int
    gpu_memory_gb: float  # GiB of device memory per GPU
    peak_tflops: float  # dense bf16/fp16 peak per GPU (no sparsity)
    intra_node_gbps: float  # NVLink bandwidth of one GPU to its node's others
    inter_node_gbps: float  # one GPU's share of the node's NICs
    pcie_gbps: float = 25.0  # host <-> device, for CPU offload
    memory_gbps: float = 2039.0  # device memory bandwidth (HBM), for memory-bound copies
    fp8_tflops: float | None = None  # dense FP8 peak per GPU (None: no FP8 matmuls, train.fp8)
    # a pipeline schedule's fixed costs (estimates for GPUs: the module's docstring)
    p2p_latency_us: float = 10.0  # one point-to-point message (send or receive), besides bytes
    pipeline_action_us: float = 100.0  # the schedule runtime's host work per action
    split_backward_layer_us: float = 300.0  # a split backward's weight pass, per layer
    # a split backward's input and weight passes against one full backward: the extra share of
    # the backward's time (the weight products run apart from the input ones, re-reading the
    # activations)
    split_backward_fraction: float = 0.05
    # torch's grouped matmul kernel (CUDA compute capability 9.0 on, bf16): a mixture of
    # experts runs its routed experts as one grouped matmul, in bf16 even under train.fp8
    # (`pretrain.model.moe.grouped_mm_runs`); elsewhere as a loop over the experts
    grouped_matmul: bool = False

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"cluster {name}={getattr(self, name)!r}: must be a positive integer")
        if self.fp8_tflops is not None and self.fp8_tflops <= 0:
            raise ConfigError(f"cluster fp8_tflops={self.fp8_tflops!r}: must be positive")
        for name in ("gpu_memory_gb", "peak_tflops", "intra_node_gbps", "inter_node_gbps",
                     "pcie_gbps", "memory_gbps"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"cluster {name}={getattr(self, name)!r}: must be positive")
        for name in ("p2p_latency_us", "pipeline_action_us", "split_backward_layer_us",
                     "split_backward_fraction"):
            if getattr(self, name) < 0:
                raise ConfigError(f"cluster {name}={getattr(self, name)!r}: must be zero or more")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


# Data-sheet numbers. A100: 312 TFLOP/s bf16 (no FP8), NVLink 3 (600 GB/s bidirectional), 8x HDR
# 200 Gb/s per node, HBM2e 2039 GB/s. H100 SXM: 989 TFLOP/s bf16, 1979 FP8 (dense), NVLink 4
# (900 GB/s bidirectional), 8x NDR 400 Gb/s, HBM3 3350 GB/s.
CLUSTER_PRESETS: dict[str, dict] = {
    "a100-80gb": dict(gpus_per_node=8, gpu_memory_gb=80.0, peak_tflops=312.0,
                      intra_node_gbps=300.0, inter_node_gbps=25.0, pcie_gbps=25.0,
                      memory_gbps=2039.0),
    "h100-80gb": dict(gpus_per_node=8, gpu_memory_gb=80.0, peak_tflops=989.0,
                      intra_node_gbps=450.0, inter_node_gbps=50.0, pcie_gbps=50.0,
                      memory_gbps=3350.0, fp8_tflops=1979.0, grouped_matmul=True),
}


# A CPU "cluster" (`pretrain plan --cluster cpu`): ranks share a node's memory bandwidth for
# their collectives (gloo / DeepSpeed's shared-memory all-reduce; a few GB/s per rank) and a
# commodity network between nodes; the offload "link" is the host itself; memory-bound copies
# run at a rank's share of the node's DRAM bandwidth.
CPU_INTRA_NODE_GBPS = 4.0
CPU_INTER_NODE_GBPS = 1.25
CPU_HOST_GBPS = 1000.0
CPU_MEMORY_GBPS = 20.0  # one rank's share of the node's DRAM bandwidth
# A pipeline schedule's fixed costs on gloo CPU ranks, measured by `bench/pipeline_bubble.py
# --calibrate` (2 ranks, 1 thread each, on 2 shared cores: BENCHMARKS.md) on a schedule no
# planner row is compared at (interleaved 1F1B with 3 stages a rank, m = 6, over the bench's
# residual MLP blocks): the runtime's own work per entry of torch's action list, which holds
# each send and receive as an action of its own (the step less the stages' compute, the waits
# and the posts, over the actions and messages: 134-171 us, mean 152, in seven runs on the AMD
# EPYC), and a message's cost, its entry and its post to gloo (492-589 us, mean 526; a gloo
# ping-pong's one-way time is 60-90 us of it); the split backward's extra per layer (a residual
# MLP block of width 16's input and weight passes against one full backward: 140 and 154 us) and
# its share of the backward at width 256 (0.040 and 0.084).
CPU_P2P_LATENCY_US = 525.0
CPU_PIPELINE_ACTION_US = 150.0
CPU_SPLIT_BACKWARD_LAYER_US = 150.0
CPU_SPLIT_BACKWARD_FRACTION = 0.06


def cpu_cluster(*, nodes: int, ranks_per_node: int, peak_tflops: float,
                memory_gb: float) -> Cluster:
    """This machine as a cluster of `ranks_per_node` CPU ranks per node: the peak is one rank's
    measured matmul rate (`pretrain.hardware.cpu_peak_tflops`), memory the node's split evenly."""
    return Cluster(name="cpu", nodes=nodes, gpus_per_node=ranks_per_node,
                   gpu_memory_gb=memory_gb / ranks_per_node, peak_tflops=peak_tflops,
                   intra_node_gbps=CPU_INTRA_NODE_GBPS, inter_node_gbps=CPU_INTER_NODE_GBPS,
                   pcie_gbps=CPU_HOST_GBPS, memory_gbps=CPU_MEMORY_GBPS,
                   p2p_latency_us=CPU_P2P_LATENCY_US, pipeline_action_us=CPU_PIPELINE_ACTION_US,
                   split_backward_layer_us=CPU_SPLIT_BACKWARD_LAYER_US,
                   split_backward_fraction=CPU_SPLIT_BACKWARD_FRACTION)


def make_cluster(preset: str, *, nodes: int, **overrides: float | int | None) -> Cluster:
    """A `Cluster` from a preset with any field overridden (None values are ignored)."""
    if preset not in CLUSTER_PRESETS:
        raise ConfigError(f"cluster preset {preset!r}: choose one of {', '.join(CLUSTER_PRESETS)}")
    fields = {**CLUSTER_PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}}
    return Cluster(name=preset, nodes=nodes, **fields)
