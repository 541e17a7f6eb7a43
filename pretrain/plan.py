"""Memory and throughput planner: what a layout needs per GPU and how fast it should run.

All arithmetic, no torch: `estimate(model, layout, cluster)` gives a `Plan` with

- the per-GPU memory breakdown of the heaviest pipeline stage: parameters, gradients and optimizer
  states (by precision, ZeRO stage and offload), activations (by recompute mode and sequence
  parallelism after Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", with the micro-batches 1F1B keeps in flight: stage i holds pp - i), and
  DeepSpeed's communication buffers;
- the predicted step time split into compute, tensor-parallel communication, pipeline bubble,
  pipeline point-to-point, exposed data-parallel communication and offloaded optimizer step, and
  from it tokens/s, model FLOPs utilisation (MFU) and hardware FLOPs utilisation (HFU, counting
  recomputation).

`search(model, cluster, ...)` enumerates every valid layout and ranks those that fit. The
efficiency assumptions are in `pretrain.clusters` (one set for every run). The dry run of a full
config and the `pretrain plan` command are in `pretrain.plan_command`.

Bytes per parameter (P = compute dtype bytes: 2 for bf16/fp16, 4 for fp32):

==========  =======  =====  =====================================================
precision   params   grads  optimizer (sharded by dp from ZeRO 1)
==========  =======  =====  =====================================================
bf16/fp16   2        2      12: fp32 master + Adam m + v (bf16 at ZeRO 0 keeps no
                            master: 8, as counted in DeepSpeed 0.19.8)
fp32        4        4      8 at ZeRO 0 (m + v); 12 from ZeRO 1 (DeepSpeed clones
                            an fp32 master partition even of fp32 weights)
==========  =======  =====  =====================================================

ZeRO 2 shards gradients, ZeRO 3 also parameters; optimizer offload moves the optimizer states
(and, from ZeRO 2, the fp32 gradient partition) to the host, parameter offload (ZeRO 3) the
parameters.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pretrain.clusters import (COLLECTIVE_EFFICIENCY, CPU_ADAM_PARAMS_PER_S, MATMUL_EFFICIENCY,
                               MEMORY_USABLE_FRACTION, Cluster)
from pretrain.config import ModelConfig, Precision, Recompute
from pretrain.errors import ConfigError

GB = 2**30
DEEPSPEED_DEFAULT_BUCKET = 500_000_000  # reduce / allgather bucket elements when not configured


@dataclass(frozen=True)
class Layout:
    """How one training run is laid out over `tensor * pipeline * data` GPUs."""

    tensor: int = 1
    pipeline: int = 1
    data: int = 1
    micro_batch: int = 1
    global_batch: int = 1  # samples per optimizer step
    zero_stage: int = 0
    offload_optimizer: str = "none"  # none | cpu | nvme
    offload_param: str = "none"  # none | cpu | nvme (ZeRO 3)
    recompute: Recompute = Recompute.NONE
    recompute_interval: int = 1  # k of Recompute.EVERY_K
    sequence_parallel: bool = False
    precision: Precision = Precision.BF16
    partition: str = "parameters"  # pipeline stage partition (parallel.pipeline_partition)
    reduce_bucket: int = DEEPSPEED_DEFAULT_BUCKET  # elements (ZeRO 1/2 ipg, ZeRO 3 reduce)
    allgather_bucket: int = DEEPSPEED_DEFAULT_BUCKET  # elements (ZeRO 1/2), prefetch (ZeRO 3)
    max_live_parameters: int = 1_000_000_000  # ZeRO-3 stage3_max_live_parameters

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline * self.data

    @property
    def grad_accum(self) -> int:
        return self.global_batch // (self.micro_batch * self.data)

    def describe(self) -> str:
        off = [f"opt={self.offload_optimizer}"] if self.offload_optimizer != "none" else []
        off += [f"param={self.offload_param}"] if self.offload_param != "none" else []
        return (f"tp{self.tensor} pp{self.pipeline} dp{self.data} mbs{self.micro_batch} "
                f"ZeRO-{self.zero_stage}{' offload ' + ','.join(off) if off else ''} "
                f"recompute={self.recompute.value}{' sp' if self.sequence_parallel else ''}")


def check_layout(model: ModelConfig, layout: Layout) -> None:
    """Raise ConfigError for a layout the stack would refuse (same rules as the config checks)."""
    lay, m = layout, model
    for name in ("num_heads", "num_kv_heads", "ffn_hidden_size"):
        if getattr(m, name) % lay.tensor:
            raise ConfigError(f"tensor={lay.tensor} must divide model.{name}={getattr(m, name)}")
    if lay.pipeline > m.num_layers:
        raise ConfigError(f"pipeline={lay.pipeline} exceeds model.num_layers={m.num_layers}")
    if lay.global_batch % (lay.micro_batch * lay.data):
        raise ConfigError(f"global batch {lay.global_batch} is not a multiple of micro-batch x dp "
                          f"= {lay.micro_batch} x {lay.data}")
    if lay.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"ZeRO stage {lay.zero_stage}: must be 0, 1, 2 or 3")
    if lay.pipeline > 1 and lay.zero_stage > 1:
        raise ConfigError(f"ZeRO stage {lay.zero_stage} with pipeline={lay.pipeline}: DeepSpeed "
                          "pipelines support ZeRO 0 or 1 only")
    if lay.offload_param != "none" and lay.zero_stage != 3:
        raise ConfigError("parameter offload needs ZeRO stage 3")
    if "nvme" in (lay.offload_optimizer, lay.offload_param) and lay.zero_stage != 3:
        raise ConfigError("NVMe offload needs ZeRO stage 3")
    if lay.offload_optimizer != "none" and lay.zero_stage == 0:
        raise ConfigError("optimizer offload needs ZeRO stage 1 or more")
    if lay.sequence_parallel and (lay.tensor == 1 or m.seq_length % lay.tensor):
        raise ConfigError(f"sequence parallelism needs tensor > 1 dividing seq_length="
                          f"{m.seq_length}, got tensor={lay.tensor}")
    if lay.pipeline > 1 and lay.recompute == Recompute.EVERY_K:
        raise ConfigError("recompute every_k is not available with pipeline > 1 (use full)")


# ---- parameters and FLOPs per pipeline stage --------------------------------------------------

def _layer_params(m: ModelConfig) -> tuple[int, int]:
    """(tensor-parallel-sharded, replicated) parameters of one decoder layer."""
    kv = m.num_kv_heads * m.head_dim
    return 2 * m.hidden_size ** 2 + 2 * m.hidden_size * kv + 3 * m.hidden_size * m.ffn_hidden_size, \
        2 * m.hidden_size


def layer_forward_flops_per_token(m: ModelConfig) -> float:
    """Forward matmul FLOPs of one layer per token: 2 per weight plus causal attention's QK^T and
    AV counted whole (4 * seq * hidden), the convention of `ModelConfig.flops_per_token`."""
    return 2.0 * _layer_params(m)[0] + 4.0 * m.seq_length * m.hidden_size


def stage_items(m: ModelConfig, layout: Layout) -> list[list[str]]:
    """The pipeline stages as lists of 'embed' / 'layer' / 'head' items, cut like DeepSpeed:
    'uniform' splits decoder layers evenly; 'parameters' (and 'type:...') balance parameters,
    so stages holding the embedding or the output projection get fewer layers."""
    pp = layout.pipeline
    if pp == 1:
        return [["embed"] + ["layer"] * m.num_layers + ["head"]]
    if layout.partition == "uniform":
        sizes = [m.num_layers // pp + (1 if s < m.num_layers % pp else 0) for s in range(pp)]
        stages = [["layer"] * n for n in sizes]
        stages[0].insert(0, "embed")
        stages[-1].append("head")
        return stages
    vocab_weight = m.padded_vocab_size(layout.tensor) * m.hidden_size
    weights = {"embed": vocab_weight, "layer": sum(_layer_params(m)), "head": vocab_weight}
    items = ["embed"] + ["layer"] * m.num_layers + ["head"]
    lo, hi = max(weights.values()), sum(weights[i] for i in items)
    while lo < hi:  # smallest max-stage weight that cuts into <= pp contiguous stages
        mid = (lo + hi) // 2
        count, load = 1, 0
        for item in items:
            if load + weights[item] > mid:
                count, load = count + 1, 0
            load += weights[item]
        lo, hi = (mid + 1, hi) if count > pp else (lo, mid)
    stages, load = [[]], 0
    for i, item in enumerate(items):
        remaining_items, remaining_stages = len(items) - i, pp - len(stages)
        if stages[-1] and (load + weights[item] > lo or remaining_items <= remaining_stages):
            stages.append([])
            load = 0
        stages[-1].append(item)
        load += weights[item]
    return stages


def stage_parameters(m: ModelConfig, layout: Layout, items: list[str]) -> int:
    """Parameters one GPU of this stage holds (its tensor-parallel shard plus replicated norms),
    before ZeRO sharding."""
    sharded, replicated = _layer_params(m)
    vocab = m.padded_vocab_size(layout.tensor) * m.hidden_size // layout.tensor
    n = items.count("layer") * (sharded // layout.tensor + replicated)
    n += vocab * items.count("embed")
    if "head" in items:  # final norm + output projection (its own copy unless tied in one stage)
        tied_here = m.tie_embeddings and "embed" in items
        n += m.hidden_size + (0 if tied_here else vocab)
    return n


def stage_flops_per_token(m: ModelConfig, layout: Layout, items: list[str]) -> tuple[float, float]:
    """(model, hardware) training FLOPs per token of this stage on one GPU: forward + backward is
    3x forward; recomputed layers run their forward once more (hardware FLOPs only)."""
    layer_fwd = layer_forward_flops_per_token(m)
    layers = items.count("layer")
    model = 3.0 * layer_fwd * layers
    if "head" in items:
        model += 6.0 * m.vocab_size * m.hidden_size
    hardware = model + layer_fwd * _recomputed_layers(layout, layers)
    return model / layout.tensor, hardware / layout.tensor


def recomputed_layers(recompute: Recompute, *, interval: int, layers: int) -> int:
    """How many of `layers` decoder layers run their forward twice (layer i recomputes under
    every_k when i % interval == 0, as `LlamaModel.recomputes_layer`)."""
    if recompute == Recompute.FULL:
        return layers
    if recompute == Recompute.EVERY_K:
        return math.ceil(layers / interval)
    return 0


def _recomputed_layers(layout: Layout, layers: int) -> int:
    return recomputed_layers(layout.recompute, interval=layout.recompute_interval, layers=layers)


def hardware_flops_per_token(m: ModelConfig) -> float:
    """Training FLOPs per token the hardware executes: `ModelConfig.flops_per_token` plus the
    forward of every recomputed layer (the telemetry's HFU; MFU counts the former only)."""
    extra = recomputed_layers(m.activation_checkpointing,
                              interval=m.activation_checkpointing_interval, layers=m.num_layers)
    return m.flops_per_token() + extra * layer_forward_flops_per_token(m)


# ---- memory -------------------------------------------------------------------------------

def _bytes_per_param(layout: Layout) -> tuple[int, int, int]:
    """(params, grads, optimizer states) bytes per parameter before ZeRO sharding."""
    low = 4 if layout.precision == Precision.FP32 else 2
    if layout.precision == Precision.BF16 and layout.zero_stage == 0:
        return low, low, 8  # DeepSpeed's bf16 ZeRO-0 path: no fp32 master; 8 bytes of Adam state
        # per parameter counted tensor by tensor (bench/plan_memory.py)
    if layout.precision == Precision.FP32 and layout.zero_stage == 0:
        return low, low, 8
    return low, low, 12


def layer_activation_elements(m: ModelConfig, layout: Layout) -> tuple[float, float]:
    """Activation elements one decoder layer saves for backward per token (micro-batch of one
    sample), split into (replicated over TP unless sequence parallel, sharded over TP).

    Korthikanti et al. count 34*s*b*h bytes for a GPT layer; for this Llama block (SDPA's fused
    attention keeps no s x s scores, no dropout, SwiGLU) the saved tensors are, in units of h
    elements of the activation dtype: replicated: the two RMSNorms' inputs and outputs (4; 6 in
    16-bit, where the norm saves its fp32 upcast); sharded: q (1), k and v (2*kv/h), the attention
    output (1) and the output projection's input (1), and SwiGLU's gate, up, silu(gate) and
    product (4*f/h).
    """
    h = m.hidden_size
    kv = m.num_kv_heads * m.head_dim
    replicated = (4.0 if layout.precision == Precision.FP32 else 6.0) * h
    sharded = (3.0 * h + 2.0 * kv + 4.0 * m.ffn_hidden_size) / layout.tensor
    if layout.sequence_parallel:
        replicated /= layout.tensor
    return replicated, sharded


@dataclass
class MemoryBreakdown:
    """Per-GPU bytes of the heaviest pipeline stage (GiB in `to_gb`)."""

    stage: int
    parameters_count: int  # parameters this GPU's stage holds before ZeRO sharding
    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    host: float  # bytes kept in host memory by offload (per GPU)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    def to_gb(self) -> dict[str, float]:
        keys = ("params", "grads", "optimizer", "activations", "buffers", "host")
        out = {k: getattr(self, k) / GB for k in keys}
        out["total"] = self.total / GB
        return out


def stage_memory(m: ModelConfig, layout: Layout, stage: int, items: list[str]) -> MemoryBreakdown:
    lay = layout
    n = stage_parameters(m, lay, items)
    p_b, g_b, o_b = _bytes_per_param(lay)
    dp = lay.data
    params, grads, optimizer = n * p_b, n * g_b, n * o_b
    host = 0.0
    if lay.zero_stage >= 1:
        optimizer /= dp
    if lay.zero_stage >= 2:
        grads /= dp
    if lay.zero_stage >= 3:
        params /= dp
    if lay.offload_optimizer != "none":
        host += optimizer + (n * 4 / dp if lay.zero_stage >= 2 else 0)  # fp32 grad partition
        optimizer = 0.0
    if lay.offload_param != "none":
        host += params
        params = 0.0

    # Activations: 1F1B keeps pp - stage micro-batches in flight (all of them if fewer).
    act_bytes = 4 if lay.precision == Precision.FP32 else 2
    tokens = lay.micro_batch * m.seq_length
    in_flight = min(lay.pipeline - stage, lay.grad_accum)
    layers = items.count("layer")
    rep, shard = layer_activation_elements(m, lay)
    full_layer = (rep + shard) * tokens * act_bytes
    layer_input = m.hidden_size * tokens * act_bytes / (lay.tensor if lay.sequence_parallel else 1)
    recomputed = _recomputed_layers(lay, layers)
    per_micro = recomputed * layer_input + (layers - recomputed) * full_layer
    activations = in_flight * per_micro + (full_layer if recomputed else 0.0)  # + recompute workspace
    if "embed" in items:
        activations += in_flight * layer_input
    if "head" in items:  # logits shard in the compute dtype + fp32 softmax of the loss
        vocab = m.padded_vocab_size(lay.tensor) // lay.tensor
        activations += tokens * vocab * (act_bytes + 4) + tokens * m.hidden_size * act_bytes

    buffers = 0.0
    if lay.zero_stage in (1, 2) or (lay.zero_stage == 0 and dp > 1):
        buffers += min(lay.reduce_bucket, n) * g_b  # gradient reduction bucket
    if lay.zero_stage in (1, 2):
        buffers += min(lay.allgather_bucket, n) * p_b  # parameter all-gather after the step
    if lay.zero_stage == 3:
        # Gathered 16-bit parameters: DeepSpeed keeps up to stage3_max_live_parameters (1e9 by
        # default) of them, and parameters gathered in forward stay until their reuse in
        # backward (stage3_max_reuse_distance, also 1e9). Measured on CPU (bench/plan_memory.py):
        # about two gathered copies of a model under the limit; one layer at least.
        sharded, replicated = _layer_params(m)
        layer_full = (sharded // lay.tensor + replicated) * p_b
        gathered = 2 * min(n, lay.max_live_parameters) * p_b
        buffers += max(gathered, 2 * layer_full) + min(lay.reduce_bucket, n) * g_b
    if lay.zero_stage >= 1 and lay.offload_optimizer == "none" and lay.precision != Precision.FP32:
        buffers += n * 4 / dp  # fp32 gradient partition the optimizer steps on
    return MemoryBreakdown(stage=stage, parameters_count=n, params=params, grads=grads,
                           optimizer=optimizer, activations=activations, buffers=buffers,
                           host=host)


# ---- time -----------------------------------------------------------------------------------

@dataclass
class TimeBreakdown:
    """Seconds per optimizer step."""

    compute: float  # every micro-batch on the slowest stage (hardware FLOPs)
    tensor_comm: float  # TP all-reduces / reduce-scatters on the critical path
    bubble: float  # 1F1B fill and drain: (pp - 1) micro-batch slots
    pipeline_comm: float  # stage-to-stage activations and gradients
    data_comm: float  # exposed data-parallel gradient / parameter communication
    offload: float  # host <-> device copies and the CPU optimizer step

    @property
    def step(self) -> float:
        return (self.compute + self.tensor_comm + self.bubble + self.pipeline_comm
                + self.data_comm + self.offload)


def _ring_seconds(nbytes: float, ranks: int, gbps: float, *, passes: float) -> float:
    """Ring collective time: each GPU moves passes * (n - 1) / n of the bytes (all-reduce: 2)."""
    if ranks <= 1:
        return 0.0
    return passes * (ranks - 1) / ranks * nbytes / (gbps * 1e9 * COLLECTIVE_EFFICIENCY)


def estimate_time(m: ModelConfig, layout: Layout, cluster: Cluster,
                  stages: list[list[str]]) -> tuple[TimeBreakdown, float, float]:
    """(time breakdown, model FLOPs per GPU per step, hardware FLOPs per GPU per step)."""
    lay = layout
    tokens_mb = lay.micro_batch * m.seq_length
    flops = [stage_flops_per_token(m, lay, items) for items in stages]
    slow_model, slow_hw = max(flops, key=lambda f: f[1])
    sustained = cluster.peak_tflops * 1e12 * MATMUL_EFFICIENCY
    compute_mb = slow_hw * tokens_mb / sustained

    # TP: 2 collectives of the layer's activations forward, 2 backward, 2 more per recomputed layer.
    gpn = cluster.gpus_per_node
    act_bytes = 4 if lay.precision == Precision.FP32 else 2
    tp_bw = cluster.intra_node_gbps if lay.tensor <= gpn else cluster.inter_node_gbps
    layers = max(items.count("layer") for items in stages)
    collectives = 4 * layers + 2 * _recomputed_layers(lay, layers)
    tp_mb = collectives * _ring_seconds(tokens_mb * m.hidden_size * act_bytes, lay.tensor, tp_bw,
                                        passes=2)
    m_count = lay.grad_accum
    compute, tensor_comm = m_count * compute_mb, m_count * tp_mb
    bubble = (lay.pipeline - 1) * (compute_mb + tp_mb)
    cross_node = lay.tensor * lay.data >= gpn  # a stage fills at least one node
    p2p_bw = cluster.inter_node_gbps if cross_node else cluster.intra_node_gbps
    # DeepSpeed (pipe_partitioned) and Megatron split the boundary activations over TP ranks;
    # under sequence parallelism each TP rank holds its slice anyway.
    boundary = tokens_mb * m.hidden_size * act_bytes / lay.tensor
    pipeline_comm = 0.0 if lay.pipeline == 1 else \
        2 * (m_count + lay.pipeline - 2) * boundary / (p2p_bw * 1e9 * COLLECTIVE_EFFICIENCY)

    # DP: gradients (and ZeRO-3 parameters) over the data-parallel group.
    n = max(stage_parameters(m, lay, items) for items in stages)
    p_b, g_b, _ = _bytes_per_param(lay)
    dp_bw = cluster.intra_node_gbps if lay.tensor * lay.data <= gpn else cluster.inter_node_gbps
    backward_mb = compute_mb * 2.0 / 3.0
    if lay.zero_stage <= 1:  # one all-reduce (ZeRO 1: reduce-scatter + all-gather) per step
        comm = _ring_seconds(n * g_b, lay.data, dp_bw, passes=2)
        data_comm = max(0.0, comm - backward_mb)
    else:  # reduce-scatter every micro-batch; ZeRO 3 also gathers parameters forward and backward
        per_mb = _ring_seconds(n * g_b, lay.data, dp_bw, passes=1)
        if lay.zero_stage == 3:
            per_mb += _ring_seconds(n * p_b, lay.data, dp_bw, passes=2)
            hide = compute_mb
        else:
            hide = backward_mb
        data_comm = m_count * max(0.0, per_mb - hide)
        if lay.zero_stage == 2:  # updated parameters gathered once after the step
            data_comm += _ring_seconds(n * p_b, lay.data, dp_bw, passes=1)
    offload = 0.0
    if lay.offload_optimizer != "none":  # grads down, params up, CPU Adam on this GPU's share
        shard = n / lay.data
        offload = shard * (4 + p_b) / (cluster.pcie_gbps * 1e9) + shard / CPU_ADAM_PARAMS_PER_S
    if lay.offload_param != "none":  # every micro-batch fetches its parameters twice
        offload += m_count * 2 * n / lay.data * p_b / (cluster.pcie_gbps * 1e9)
    times = TimeBreakdown(compute=compute, tensor_comm=tensor_comm, bubble=bubble,
                          pipeline_comm=pipeline_comm, data_comm=data_comm, offload=offload)
    model_flops = m.flops_per_token() * lay.global_batch * m.seq_length / lay.world_size
    hardware_flops = model_flops * slow_hw / slow_model if slow_model else model_flops
    return times, model_flops, hardware_flops


# ---- the plan ---------------------------------------------------------------------------------

@dataclass
class Plan:
    layout: Layout
    cluster: Cluster
    memory: MemoryBreakdown  # heaviest stage
    time: TimeBreakdown
    tokens_per_s: float
    model_tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    mfu: float
    hfu: float
    fits: bool
    memory_limit_gb: float
    stages: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        lay = asdict(self.layout)
        lay.update(recompute=self.layout.recompute.value, precision=self.layout.precision.value,
                   grad_accum=self.layout.grad_accum, world_size=self.layout.world_size)
        t = asdict(self.time)
        t["step"] = self.time.step
        return {"layout": lay, "cluster": asdict(self.cluster),
                "memory_gb": {"stage": self.memory.stage, **self.memory.to_gb()},
                "time_s": t, "tokens_per_s": self.tokens_per_s,
                "model_tflops_per_gpu": self.model_tflops_per_gpu,
                "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu, "mfu": self.mfu,
                "hfu": self.hfu, "fits": self.fits, "memory_limit_gb": self.memory_limit_gb,
                "stages": self.stages}


def estimate(model: ModelConfig, layout: Layout, cluster: Cluster) -> Plan:
    """Memory and time of `layout`; raises ConfigError if the layout is invalid."""
    check_layout(model, layout)
    stages = stage_items(model, layout)
    memories = [stage_memory(model, layout, s, items) for s, items in enumerate(stages)]
    worst = max(memories, key=lambda mem: mem.total)
    times, model_flops, hw_flops = estimate_time(model, layout, cluster, stages)
    step = times.step
    peak = cluster.peak_tflops * 1e12
    limit = cluster.gpu_memory_gb * MEMORY_USABLE_FRACTION
    return Plan(layout=layout, cluster=cluster, memory=worst, time=times,
                tokens_per_s=layout.global_batch * model.seq_length / step,
                model_tflops_per_gpu=model_flops / step / 1e12,
                hardware_tflops_per_gpu=hw_flops / step / 1e12,
                mfu=model_flops / step / peak, hfu=hw_flops / step / peak,
                fits=worst.total / GB <= limit, memory_limit_gb=limit,
                stages=[{"stage": s, "layers": items.count("layer"),
                         "embedding": "embed" in items, "head": "head" in items,
                         "memory_gb": round(mem.total / GB, 3)}
                        for s, (items, mem) in enumerate(zip(stages, memories))])


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(model: ModelConfig, cluster: Cluster, *, global_batch: int,
           precision: Precision = Precision.BF16, micro_batches: tuple[int, ...] = (1, 2, 4, 8),
           allow_offload: bool = True) -> list[Plan]:
    """Every valid layout of `cluster.world_size` GPUs that fits, fastest first.

    TP stays inside a node (powers of two dividing the GPUs per node); PP divides the world;
    ZeRO 0-3 (0/1 with pipelines), optimizer offload to CPU from ZeRO 1, parameter offload with
    ZeRO 3, recompute none/full, sequence parallelism whenever tp > 1 (it only saves memory).
    """
    world = cluster.world_size
    base = Layout(precision=precision, global_batch=global_batch)
    plans = []
    tps = [t for t in _divisors(cluster.gpus_per_node) if t & (t - 1) == 0]
    for tp, pp in itertools.product(tps, _divisors(world)):
        if world % (tp * pp) or pp > model.num_layers:
            continue
        dp = world // (tp * pp)
        for mbs, stage, offload, recompute in itertools.product(
                micro_batches, (0, 1, 2, 3), ("none", "opt", "opt+param"),
                (Recompute.NONE, Recompute.FULL)):
            if offload != "none" and not allow_offload:
                continue
            layout = replace(base, tensor=tp, pipeline=pp, data=dp, micro_batch=mbs,
                             zero_stage=stage, recompute=recompute, sequence_parallel=tp > 1,
                             offload_optimizer="none" if offload == "none" else "cpu",
                             offload_param="cpu" if offload == "opt+param" else "none")
            try:
                plan = estimate(model, layout, cluster)
            except ConfigError:
                continue
            if plan.fits:
                plans.append(plan)
    plans.sort(key=lambda p: (-p.tokens_per_s, p.memory.total))
    return plans
