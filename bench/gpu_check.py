"""Every CUDA-only path of the stack on one GPU: whether it ran and whether it matched its
reference. Run through `bash bench/gpu_check.sh` (which installs what the GPU machine's python
lacks); exit 0 when every row holds.

Rows (each imports what it needs itself, so a missing package fails its rows, not the check):
- sdpa_flash: bf16 causal SDPA under the kernels `llama.attention_backends` pins, on the
  FlashAttention or cuDNN kernel (kernel names read from `torch.profiler`), against fp32 math;
- varlen_documents: document attention (`model.documents`) on the variable-length kernel, as
  the installed `varlen_attn` is bound (GQA, muP's scale), forward and backward against the
  masked SDPA path in fp32;
- fused_adamw: `torch.optim.AdamW(fused=True)` (what `resolve.ds_config` asks DeepSpeed for on
  GPUs) stepping optimizer state built by hand as a reshard builds it (zero moments, the step
  count from `checkpoint.reshard.adam_step_tensor`: fp32 on the parameter's device), against
  the for-each AdamW;
- compile_layer: `model.compile_blocks` on a small Llama, loss and gradients against eager;
- moe: the MoE layer (`model.moe`) forward and backward against a token-by-token reference;
  in bf16 its experts as one grouped matmul (the layer's own choice on the GPU, forced in the
  dry run) against the looped experts, the grouped forward under CUDA's sync debug mode;
- process_group: a one-rank NCCL group (gloo in the dry run): all_reduce and broadcast of a
  device tensor;
- fsdp2: `fully_shard` of a small Llama on that group, loss and gradients equal to unsharded;
- fp8_tensorwise, fp8_rowwise: a model's block projections in FP8 (`model.fp8`; torchao
  emulating in the dry run), 5 AdamW steps, the loss within 2% of the same steps without FP8;
- selective_memory: peak CUDA memory of a forward and backward of the quickstart's model under
  none, selective and full recompute: selective >= 30% below none and above full;
- peak_memory_1b: one training step of the 1B preset (`pretrain.training.engine.build_engine`,
  DeepSpeed ZeRO-1 bf16, sequence 4096) against the planner's memory for that GPU;
- mfu_4096: the same engine's measured MFU against the planner's (`plan.search.estimate`,
  the device's peak from `pretrain.hardware`).

`--dry-run` runs the same rows on the CPU with tiny shapes; the rows only a GPU can run say
"skipped: <reason>" (the planner's predictions are still computed). The table goes to stdout,
the JSON to `$OUT/gpu_check.json` when OUT is set, else to the path given (if any).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BUDGET_S = 450  # rows left when this much has passed are skipped: the whole check fits 8 min
MEMORY_TOLERANCE = 0.25  # measured peak within 25% of the planner's
MFU_TOLERANCE = 0.30  # measured MFU within 30% (relative) of the planner's
ROWS = ("sdpa_flash", "varlen_documents", "fused_adamw", "compile_layer", "moe",
        "process_group", "fsdp2", "fp8_tensorwise", "fp8_rowwise", "selective_memory",
        "peak_memory_1b", "mfu_4096")
# FP8 against the same model's loss after a few AdamW steps: e4m3 rounds each projection operand
# by up to 2^-4 relatively, bf16 by 2^-8, so an FP8 run's loss moves ~16x bf16's rounding's
# share; 2% of the loss bounds it at these few steps (a broken scale moves it by far more).
FP8_LOSS_TOLERANCE = 0.02
FP8_STEPS = 5


@dataclass
class Result:
    row: str
    status: str = "ok"  # "ok", "FAIL", or "skipped: <reason>"
    ran: bool = False
    matched: bool | None = None
    detail: str = ""
    seconds: float = 0.0
    values: dict[str, Any] | None = None

    @property
    def holds(self) -> bool:
        return self.status != "FAIL"


class Skip(Exception):
    """A row that cannot run here; its message is the reason."""


class Check:
    """The rows' shared set-up: device, dtype, the one-rank process group, the big engine."""

    def __init__(self, *, dry_run: bool) -> None:
        import torch

        self.dry_run = dry_run
        self.cuda = torch.cuda.is_available() and not dry_run
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        self.half = torch.bfloat16 if self.cuda else torch.float32  # CPU: fp32, tiny shapes
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu_check_"))
        self.group_backend: str | None = None
        self.engine_run: dict[str, Any] | None = None
        if self.cuda:
            torch.backends.cuda.matmul.allow_tf32 = False  # references in true fp32
            torch.backends.cudnn.allow_tf32 = False

    def need_gpu(self, why: str) -> None:
        if not self.cuda:
            raise Skip(f"needs a GPU: {why}" + (" (dry run)" if self.dry_run else ""))

    def process_group(self) -> str:
        """A one-rank process group (NCCL on the GPU, gloo on the CPU), made once."""
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            backend = "nccl" if self.cuda else "gloo"
            kwargs = {"device_id": self.device} if self.cuda else {}
            if self.cuda:
                torch.cuda.set_device(self.device)
            # one rank as a launcher would describe it (DeepSpeed's engine asserts LOCAL_RANK)
            for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                               ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29512")):
                os.environ.setdefault(key, value)
            dist.init_process_group(backend, init_method=f"file://{self.tmp / 'store'}",
                                    rank=0, world_size=1, **kwargs)
            self.group_backend = backend
        return self.group_backend or dist.get_backend()


def _relative_error(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _losses_and_grads(models, cfg, c: "Check", *, seed: int) -> list[float]:
    """The loss of one forward and backward of each of `models` (gradients left on their
    parameters) on the same random batch of `cfg`'s shape, drawn on the check's device."""
    import torch

    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), device=c.device,
                           generator=torch.Generator(device=c.device).manual_seed(seed))
    losses = []
    for model in models:
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses.append(float(loss))
    return losses


def _tiny_model_cfg(**fields):
    from pretrain.config import load_config

    overrides = ["model.preset=tiny"] + [f"model.{k}={v}" for k, v in fields.items()]
    return load_config(None, overrides).model


# ---- the rows -------------------------------------------------------------------------------------

def row_sdpa_flash(c: Check, r: Result) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    from pretrain.model.llama import attention_backends

    c.need_gpu("FlashAttention and cuDNN attention are CUDA kernels")
    g = torch.Generator(device=c.device).manual_seed(0)
    q, k, v = (torch.randn(2, 16, 2048, 128, device=c.device, dtype=torch.bfloat16,
                           generator=g) for _ in range(3))
    backends = attention_backends("cuda", torch.bfloat16)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with sdpa_kernel(backends):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.cuda.synchronize()
    kernels = sorted({e.key for e in prof.key_averages()
                      if any(word in e.key.lower() for word in ("flash", "cudnn", "fmha", "sdpa",
                                                                 "attention"))})
    on_fast = any("flash" in name.lower() or "cudnn" in name.lower() for name in kernels)
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    error = _relative_error(y, reference)
    r.ran, r.matched = True, on_fast and error < 2e-2
    r.detail = f"kernels {kernels[:3]}; rel. error vs fp32 {error:.1e}"
    r.values = {"kernels": kernels, "relative_error": error}


def row_varlen_documents(c: Check, r: Result) -> None:
    import torch
    import torch.nn.functional as F

    from pretrain.model import documents

    binding = documents.VARLEN
    described = ("unbound: " + binding.problem if binding.problem else
                 f"{binding.causal}, scale {'taken' if binding.takes_scale else 'folded into q'}"
                 f", GQA {'taken' if binding.takes_gqa else 'by repeated kv heads'}")
    r.values = {"binding": described}
    c.need_gpu(f"varlen_attn is FlashAttention's kernel (binding: {described})")
    kernel = documents.document_kernel("cuda", torch.bfloat16)
    g = torch.Generator(device=c.device).manual_seed(1)
    lengths = [300, 17, 1, 450, 256, 1024, 1000, 24]  # three rows of 1024 tokens
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).view(3, 1024)
    ids = ids.to(c.device)
    q = torch.randn(3, 8, 1024, 64, device=c.device, generator=g)
    k, v = (torch.randn(3, 2, 1024, 64, device=c.device, generator=g) for _ in range(2))
    scale = 0.1  # muP's attention scale is not 1/sqrt(head_dim)
    half = [t.bfloat16().requires_grad_(True) for t in (q, k, v)]
    y = documents.document_attention(*half, ids, scale=scale)
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(*full, attn_mask=documents.block_causal_mask(ids),
                                               enable_gqa=True, scale=scale)
    grad = torch.randn_like(reference)
    y.backward(grad.bfloat16())
    reference.backward(grad)
    errors = {"out": _relative_error(y, reference)}
    errors.update({f"d{n}": _relative_error(a.grad, b.grad)
                   for n, a, b in zip("qkv", half, full)})
    r.ran = True
    r.matched = kernel == "varlen" and max(errors.values()) < 3e-2
    r.detail = (f"kernel {kernel} ({described}); rel. errors vs fp32 masked SDPA "
                + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
    r.values.update(kernel=kernel, relative_errors=errors)


def row_fused_adamw(c: Check, r: Result) -> None:
    import torch

    from pretrain.checkpoint.reshard import adam_step_tensor
    from pretrain.testing.cuda_calls import adamw_arguments

    _, kwargs = adamw_arguments()  # the keywords the stack passes
    updates, steps = [], []
    for fused in (True, False):
        g = torch.Generator(device=c.device).manual_seed(2)
        p = torch.nn.Parameter(torch.randn(256, 512, device=c.device, generator=g))
        before = p.detach().clone()
        opt = torch.optim.AdamW([p], **{**kwargs, "fused": fused})
        state = opt.state[p]  # as `reshard` builds it before the optimizer's first step
        state["exp_avg"] = torch.randn(p.shape, device=c.device, generator=g) * 1e-3
        state["exp_avg_sq"] = torch.rand(p.shape, device=c.device, generator=g) * 1e-6
        state["step"] = adam_step_tensor(40, param=p, group=opt.param_groups[0])
        steps.append(state["step"])
        for _ in range(3):
            p.grad = torch.randn(p.shape, device=c.device, generator=g) * 1e-2
            opt.step()
        updates.append(p.detach() - before)
    error = _relative_error(updates[0], updates[1])  # of the updates, not of the weights
    step = steps[0]
    r.ran = True
    r.matched = (step.dtype == torch.float32 and step.device == c.device
                 and float(step) == 43.0 and error < 2e-5)
    r.detail = (f"step {step.dtype} on {step.device}, counted to {float(step):.0f}; "
                f"rel. error vs for-each {error:.1e}")
    r.values = {"relative_error": error}


def row_compile_layer(c: Check, r: Result) -> None:
    import copy

    import torch

    from pretrain.model import build_model, compile_blocks

    cfg = _tiny_model_cfg(seq_length=128) if c.dry_run else _tiny_model_cfg(
        hidden_size=512, num_heads=8, num_kv_heads=4, ffn_hidden_size=1408, seq_length=512,
        vocab_size=4096)
    eager = build_model(cfg, seed=0).to(c.device)
    compiled = copy.deepcopy(eager)
    if c.dry_run:  # the CPU: trace and partition through dynamo, no C++ code generation
        layers = 0
        for module in compiled.modules():
            if type(module).__name__ == "DecoderLayer":
                module.compile(backend="aot_eager")
                layers += 1
    else:
        layers = compile_blocks(compiled, cache_dir=c.tmp / "inductor")
    losses = _losses_and_grads((eager, compiled), cfg, c, seed=3)
    grad_error = max(_relative_error(a.grad, b.grad) for a, b in
                     zip(compiled.parameters(), eager.parameters()))
    loss_error = abs(losses[1] - losses[0]) / abs(losses[0])
    r.ran = True
    r.matched = layers == cfg.num_layers and loss_error < 1e-5 and grad_error < 1e-3
    r.detail = (f"{layers} layers compiled{' (aot_eager)' if c.dry_run else ''}; loss rel. "
                f"error {loss_error:.1e}, gradients {grad_error:.1e}")


def _moe_reference(layer, x, *, k: int):
    """Token by token: softmax router, top-k renormalised, each chosen expert's SwiGLU."""
    import torch
    import torch.nn.functional as F

    flat = x.reshape(-1, x.shape[-1])
    rows = []
    for token in flat:
        probs = torch.softmax((layer.gate.weight @ token).float(), dim=0)
        top = torch.topk(probs, k)
        out = torch.zeros_like(token)
        for w, e in zip(top.values / top.values.sum(), top.indices.tolist()):
            expert = layer.experts[e]
            hidden = F.silu(expert.gate_proj.weight @ token) * (expert.up_proj.weight @ token)
            out = out + w * (expert.down_proj.weight @ hidden)
        rows.append(out)
    return torch.stack(rows).view_as(x)


def row_moe(c: Check, r: Result) -> None:
    import dataclasses

    import torch

    from pretrain.model.llama import fused_projections
    from pretrain.model.moe import MoE

    cfg = dataclasses.replace(_tiny_model_cfg(seq_length=32), ffn_hidden_size=96, num_experts=4,
                              experts_per_token=2, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0)
    torch.manual_seed(4)
    layer = MoE(cfg, project=fused_projections).to(c.device)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.2)
    x = torch.randn(2, 32, cfg.hidden_size, device=c.device, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, ref = layer(x), _moe_reference(layer, x_ref, k=cfg.experts_per_token)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    errors = {"out": _relative_error(out, ref), "dx": _relative_error(x.grad, x_ref.grad)}
    grouped_errors, chosen, synced = _moe_grouped_against_looped(c, layer, x.detach(), g)
    r.ran = True
    r.matched = (max(errors.values()) < 1e-4 and max(grouped_errors.values()) < 2e-2
                 and (chosen or not c.cuda) and synced is None)
    r.detail = ("rel. errors vs per-token " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items())
                + f"; grouped ({'chosen' if chosen else 'forced'}) vs looped "
                + ", ".join(f"{n} {e:.1e}" for n, e in grouped_errors.items())
                + (f"; the grouped forward synced: {synced}" if synced else ""))
    r.values = {"relative_errors": errors, "grouped_relative_errors": grouped_errors,
                "grouped_chosen": chosen, "grouped_sync": synced}


def _moe_grouped_against_looped(c: Check, layer, x, g):
    """The layer's experts as one `torch._grouped_mm` against its loop, in the check's half
    precision: (relative errors of output, input and expert gradients, whether the layer chose
    the grouped kernel itself, the sync error of its forward or None)."""
    import copy

    import torch

    from pretrain.model.moe import grouped_mm_runs

    looped = copy.deepcopy(layer).to(c.half)
    grouped = copy.deepcopy(looped)
    looped.grouped = False
    chosen = grouped_mm_runs(x.to(c.half), list(grouped.experts))
    grouped.grouped = None if c.cuda else True  # the GPU: the layer's own choice
    outputs = []
    for model in (grouped, looped):
        inputs = x.to(c.half).requires_grad_(True)
        synced = None
        if c.cuda and model is grouped:
            torch.cuda.set_sync_debug_mode("error")  # a host read in the forward raises
        try:
            out = model(inputs)
        except RuntimeError as error:
            synced, out = str(error).splitlines()[0], None
        finally:
            if c.cuda:
                torch.cuda.set_sync_debug_mode(0)
        if out is None:  # rerun without the debug mode to compare the values still
            out = model(inputs)
        (out.float() * g).sum().backward()
        outputs.append((out, inputs.grad, model.experts[0].down_proj.weight.grad, synced))
    (out, dx, dw, synced), (ref, ref_dx, ref_dw, _) = outputs
    errors = {"out": _relative_error(out, ref), "dx": _relative_error(dx, ref_dx),
              "dw_down0": _relative_error(dw, ref_dw)}
    return errors, chosen, synced


def row_process_group(c: Check, r: Result) -> None:
    import torch
    import torch.distributed as dist

    backend = c.process_group()
    t = torch.arange(4, device=c.device, dtype=torch.float32) + 1
    dist.all_reduce(t)
    b = torch.full((3,), 7.0, device=c.device)
    dist.broadcast(b, src=0)
    if c.cuda:
        torch.cuda.synchronize()
    r.ran = True
    r.matched = t.tolist() == [1.0, 2.0, 3.0, 4.0] and b.tolist() == [7.0] * 3
    r.detail = f"{backend}, one rank: all_reduce and broadcast of a {c.device.type} tensor"
    if c.cuda and backend != "nccl":
        r.matched = False


def row_fsdp2(c: Check, r: Result) -> None:
    import copy

    import torch
    from torch.distributed.fsdp import fully_shard

    from pretrain.model import build_model

    backend = c.process_group()
    cfg = _tiny_model_cfg(seq_length=64)
    plain = build_model(cfg, seed=5).to(c.device)
    sharded = copy.deepcopy(plain)
    for module in sharded.modules():
        if type(module).__name__ == "DecoderLayer":
            fully_shard(module)
    fully_shard(sharded)
    losses = _losses_and_grads((plain, sharded), cfg, c, seed=6)
    grad_error = max(_relative_error(s.grad.full_tensor(), p.grad)
                     for s, p in zip(sharded.parameters(), plain.parameters()))
    loss_error = abs(losses[1] - losses[0]) / abs(losses[0])
    r.ran = True
    r.matched = loss_error < 1e-6 and grad_error < 1e-5
    r.detail = (f"fully_shard over {backend}, one rank: loss rel. error {loss_error:.1e}, "
                f"gradients {grad_error:.1e}")


def _fp8_row(c: Check, r: Result, recipe: str) -> None:
    """A few AdamW steps of a small model with its blocks' projections in FP8 (emulated in the
    dry run), against the same steps in the check's precision."""
    import copy

    import torch

    from pretrain.config import Fp8Recipe
    from pretrain.model import build_model
    from pretrain.model.fp8 import convert_to_fp8

    if c.cuda and torch.cuda.get_device_capability() < (8, 9):
        raise Skip(f"FP8 needs compute capability 8.9 (this GPU: "
                   f"{'.'.join(map(str, torch.cuda.get_device_capability()))})")
    cfg = _tiny_model_cfg(seq_length=64) if c.dry_run else _tiny_model_cfg(
        hidden_size=1024, num_heads=8, num_kv_heads=8, ffn_hidden_size=2816, seq_length=512)
    reference = build_model(cfg, seed=7).to(c.device, c.half)
    fp8 = copy.deepcopy(reference)
    converted = convert_to_fp8(fp8, Fp8Recipe(recipe), emulate=not c.cuda)
    losses = {}
    for name, model in (("reference", reference), ("fp8", fp8)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(FP8_STEPS):
            losses[name] = _losses_and_grads((model,), cfg, c, seed=100 + step)[0]
            optimizer.step()
            optimizer.zero_grad()
    error = abs(losses["fp8"] - losses["reference"]) / abs(losses["reference"])
    r.ran = True
    r.matched = 0 < error < FP8_LOSS_TOLERANCE
    r.values = {"fp8_projections": len(converted.fp8), "loss_rel_error": error}
    r.detail = (f"{converted.line()}; loss after {FP8_STEPS} steps rel. error {error:.1e} "
                f"(tolerance {FP8_LOSS_TOLERANCE:g}, not 0)")


def row_fp8_tensorwise(c: Check, r: Result) -> None:
    _fp8_row(c, r, "tensorwise")


def row_fp8_rowwise(c: Check, r: Result) -> None:
    _fp8_row(c, r, "rowwise")


def row_selective_memory(c: Check, r: Result) -> None:
    """Peak CUDA memory of one forward and backward of the quickstart's model (micro-batch 8)
    under none, selective and full recompute: selective at least 30% below none, above full."""
    import torch

    from pretrain.config import load_config
    from pretrain.model import build_model

    c.need_gpu("the CUDA allocator's peak")
    peaks = {}
    for mode in ("none", "selective", "full"):
        cfg = load_config(None, ["model.preset=small",
                                 f"model.activation_checkpointing={mode}"]).model
        model = build_model(cfg, seed=0).to(c.device, c.half)
        _losses_and_grads((model,), cfg, c, seed=1)  # gradients allocated first
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        tokens = torch.randint(0, cfg.vocab_size, (8, cfg.seq_length + 1), device=c.device)
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        peaks[mode] = torch.cuda.max_memory_allocated() - base
        del model
    r.ran = True
    r.matched = peaks["full"] < peaks["selective"] <= 0.7 * peaks["none"]
    r.values = {f"{mode}_mib": peak / 2**20 for mode, peak in peaks.items()}
    r.detail = ", ".join(f"{mode} {peak / 2**20:.0f} MiB" for mode, peak in peaks.items())


def _big_run_config(c: Check):
    from pretrain.config import load_config

    return load_config(None, [
        "model.preset=1b", "model.seq_length=4096", "train.micro_batch_size=1",
        "train.global_batch_size=1", "train.precision=bf16", "deepspeed=ds_configs/zero1.json",
        f"run_dir={c.tmp / 'run'}"])


def _prediction(c: Check, cfg) -> Any:
    """The planner's plan of `cfg` on one of this GPU (its memory and data-sheet peak)."""
    import torch

    from pretrain.hardware import device_peak_tflops
    from pretrain.plan.clusters import make_cluster
    from pretrain.plan.search import estimate
    from pretrain.resolve.run import lay_out_as_loaded

    if c.cuda:
        memory_gb = torch.cuda.get_device_properties(c.device).total_memory / 2**30
        peak, _ = device_peak_tflops(torch.bfloat16)
    else:  # the dry run plans for an H100's numbers: the arithmetic, not this machine
        memory_gb, peak = 80.0, 989.0
    layout = lay_out_as_loaded(cfg, world_size=1,
                               accelerator="cuda" if c.cuda else "cpu").layout
    cluster = make_cluster("h100-80gb", nodes=1, gpus_per_node=1, gpu_memory_gb=memory_gb,
                           peak_tflops=peak)
    return estimate(cfg.model, layout, cluster, engine=cfg.train.engine)


def _train_1b(c: Check) -> dict[str, Any]:
    """One engine of the 1B preset at sequence 4096 (as `pretrain train` builds it), its peak
    memory over one step after a warm-up step, and its step time over five more."""
    if c.engine_run is not None:
        return c.engine_run
    import torch

    import deepspeed
    from pretrain.resolve.run import resolve_ds_config
    from pretrain.resolve.topology import Topology
    from pretrain.training.engine import build_engine

    c.process_group()
    deepspeed.init_distributed(dist_backend="nccl", verbose=False)
    cfg = _big_run_config(c)
    ds = resolve_ds_config(cfg, world_size=1, accelerator="cuda")
    groups = Topology.from_parallel_config(cfg.parallel, world_size=1, rank=0).create_groups()
    engine = build_engine(cfg, ds, groups, main=False)
    g = torch.Generator(device=c.device).manual_seed(7)
    tokens = torch.randint(0, cfg.model.vocab_size, (1, cfg.model.seq_length + 1),
                           device=c.device, generator=g)

    def step() -> float:
        loss = engine(tokens[:, :-1], labels=tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    first = step()  # warm-up: the optimizer state exists from here on
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    start = time.perf_counter()
    for _ in range(5):
        last = step()
    torch.cuda.synchronize()
    c.engine_run = {"cfg": cfg, "peak_bytes": peak, "step_s": (time.perf_counter() - start) / 5,
                    "losses": (first, last)}
    return c.engine_run


def row_peak_memory_1b(c: Check, r: Result) -> None:
    cfg = _big_run_config(c)
    plan = _prediction(c, cfg)
    predicted = plan.memory.total
    r.values = {"predicted_gib": predicted / 2**30, "parameters": plan.memory.parameters_count}
    c.need_gpu(f"the CUDA allocator's peak (predicted {predicted / 2**30:.1f} GiB)")
    run = _train_1b(c)
    ratio = run["peak_bytes"] / predicted
    r.ran = True
    r.matched = abs(ratio - 1) <= MEMORY_TOLERANCE and all(map(math.isfinite, run["losses"]))
    r.detail = (f"{plan.memory.parameters_count / 1e9:.2f}B parameters, ZeRO-"
                f"{plan.layout.zero_stage} {plan.layout.precision.value}, sequence "
                f"{cfg.model.seq_length}: "
                f"measured {run['peak_bytes'] / 2**30:.1f} GiB, predicted "
                f"{predicted / 2**30:.1f} GiB (x{ratio:.2f})")
    r.values.update(measured_gib=run["peak_bytes"] / 2**30, ratio=ratio)


def row_mfu_4096(c: Check, r: Result) -> None:
    from pretrain.arithmetic import model_flops_per_token

    cfg = _big_run_config(c)
    plan = _prediction(c, cfg)
    r.values = {"predicted_mfu": plan.mfu, "peak_tflops": plan.cluster.peak_tflops}
    c.need_gpu(f"a timed training step (predicted MFU {plan.mfu:.3f})")
    run = _train_1b(c)
    tokens_per_s = cfg.model.seq_length / run["step_s"]
    measured = model_flops_per_token(cfg.model) * tokens_per_s / (plan.cluster.peak_tflops * 1e12)
    ratio = measured / plan.mfu
    r.ran = True
    r.matched = abs(ratio - 1) <= MFU_TOLERANCE
    r.detail = (f"{tokens_per_s:,.0f} tokens/s, step {run['step_s'] * 1e3:.0f} ms: MFU measured "
                f"{measured:.3f}, predicted {plan.mfu:.3f} (x{ratio:.2f}) of "
                f"{plan.cluster.peak_tflops:.0f} TFLOP/s")
    r.values.update(measured_mfu=measured, ratio=ratio, tokens_per_s=tokens_per_s)


ROW_FUNCTIONS: dict[str, Callable[[Check, Result], None]] = {
    name: globals()[f"row_{name}"] for name in ROWS}


# ---- running and reporting ------------------------------------------------------------------------

def run_rows(c: Check, names: tuple[str, ...] = ROWS, *, budget_s: float = BUDGET_S) -> list[Result]:
    results, start = [], time.perf_counter()
    for name in names:
        r = Result(name)
        began = time.perf_counter()
        if began - start > budget_s:
            r.status = f"skipped: the check's {budget_s:.0f} s budget was spent"
        else:
            try:
                ROW_FUNCTIONS[name](c, r)
                if r.matched is False:
                    r.status = "FAIL"
            except Skip as why:
                r.status = f"skipped: {why}"
            except Exception as exc:  # noqa: BLE001 - a row's failure is its own, not the check's
                r.status, r.matched = "FAIL", False
                r.detail = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
        r.seconds = round(time.perf_counter() - began, 2)
        results.append(r)
        print(f"[gpu_check] {name}: {r.status} ({r.seconds:.1f} s)", file=sys.stderr, flush=True)
    return results


def table(results: list[Result]) -> str:
    def mark(value: bool | None) -> str:
        return "-" if value is None else ("yes" if value else "NO")

    lines = [f"{'row':<18} {'status':<8} {'ran':<4} {'matched':<8} {'s':>6}  detail"]
    for r in results:
        status = r.status if len(r.status) <= 8 else "skipped"
        detail = r.detail or (r.status if status == "skipped" else "")
        lines.append(f"{r.row:<18} {status:<8} {mark(r.ran):<4} {mark(r.matched):<8} "
                     f"{r.seconds:>6.1f}  {detail}")
    return "\n".join(lines)


def environment(c: Check) -> dict[str, Any]:
    import torch

    return {"torch": torch.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name() if c.cuda else "cpu",
            "dry_run": c.dry_run, "python": sys.version.split()[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="the same rows on the CPU with tiny shapes; GPU-only rows skipped")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument("json_path", nargs="?", help="where the JSON goes ($OUT/gpu_check.json "
                                                     "when OUT is set)")
    args = parser.parse_args(argv)
    c = Check(dry_run=args.dry_run)
    if not c.cuda and not args.dry_run:
        print("gpu_check: no CUDA device (use --dry-run on a machine without one)",
              file=sys.stderr)
        return 2
    results = run_rows(c, tuple(args.rows))
    ok = all(r.holds for r in results)
    print(table(results))
    print(f"gpu_check: {'every row holds' if ok else 'FAILED'} "
          f"({sum(r.status == 'ok' for r in results)} ok, "
          f"{sum(r.status.startswith('skipped') for r in results)} skipped, "
          f"{sum(r.status == 'FAIL' for r in results)} failed)")
    report = {**environment(c), "ok": ok, "rows": [asdict(r) for r in results]}
    out = (Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT")
           else Path(args.json_path) if args.json_path else None)
    if out is not None:
        out.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"gpu_check: JSON in {out}")
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the report is written; tear-down is best effort
        pass
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
