"""The planner's per-rank memory against the measured peak of real CPU runs, ZeRO 0-3, and
`train.engine: fsdp2` with the ZeRO-1 and ZeRO-3 JSONs (`--engines fsdp2`).

Two gloo ranks (data parallel 2) train a 34M-parameter Llama through DeepSpeed (or FSDP2, built
by `pretrain.training.engine.build_engine` as `pretrain train` builds it) with each
`ds_configs/zero<N>.json`, resolved exactly as `pretrain train` resolves it. Measured per rank:
the peak resident memory (VmHWM) over two steady-state steps minus the resident memory before the
model was built (imports, process groups and the Python heap are not the model's); the peak is
reset after a first warm-up step (`/proc/self/clear_refs`), so DeepSpeed's one-off flattening
copies at start-up do not count. glibc's mmap threshold is pinned so freed tensors return to the
OS. Predicted: `pretrain.plan.search.estimate` for the same layout (params + grads + optimizer +
activations + buffers). The model states are also counted tensor by tensor, against the theory
of 16 bytes per parameter / dp at ZeRO-3 (`bench/zero3_memory.py` prints that comparison).

    .venv/bin/python bench/plan_memory.py                  # fp32 and bf16, ~3 minutes on 2 cores
    .venv/bin/python bench/plan_memory.py --precision bf16
    .venv/bin/python bench/plan_memory.py --engines fsdp2 --precision fp32 --stages 1 3
"""
from __future__ import annotations

import argparse
import itertools
import os
import tempfile
from pathlib import Path

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # before the ranks start: fixed threshold

from common import machine
from pretrain.testing.memory import reset_peak, status_bytes
from pretrain.testing.ranks import run_on_ranks

MODEL = ["model.vocab_size=8192", "model.hidden_size=512", "model.num_layers=8",
         "model.num_heads=8", "model.num_kv_heads=8", "model.ffn_hidden_size=1376",
         "model.seq_length=128", "train.micro_batch_size=2", "train.global_batch_size=4"]
WORLD = 2


def model_state_bytes(engine) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients and optimizer states, tensor by tensor
    (ZeRO-3: the partitions; flat buffers counted once by storage)."""
    seen: set[int] = set()

    def size(t) -> int:
        if t is None or not hasattr(t, "untyped_storage") or t.numel() == 0:
            return 0
        key = t.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return t.untyped_storage().nbytes()

    opt = engine.optimizer
    params = [p for p in engine.module.parameters()]
    if getattr(engine, "name", "") == "fsdp2":
        return _fsdp2_state_bytes(params, opt, size)
    out = {"params": 0, "grads": 0, "optimizer": 0}
    for p in params:
        out["params"] += size(getattr(p, "ds_tensor", None)) or size(p)
    for name in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):
        for t in getattr(opt, name, []) or []:
            out["optimizer"] += size(t)
    inner = getattr(opt, "optimizer", opt)
    for state in inner.state.values():
        for t in state.values():
            if hasattr(t, "dim") and t.dim() > 0:
                out["optimizer"] += size(t)
    if getattr(engine, "name", "") == "fsdp2":
        return _fsdp2_state_bytes(params, opt, size)
    grad_buffer = getattr(opt, "grad_partitions_flat_buffer", None)
    out["grads"] += size(grad_buffer)
    if grad_buffer is None:  # ZeRO 0-2: one gradient per parameter while it accumulates
        out["grads"] += sum(p.numel() * p.element_size() for p in params)
    return out


def _fsdp2_state_bytes(params, opt, size) -> dict[str, int]:
    """fsdp2: this rank's local shards of the DTensor parameters and of AdamW's moments; the
    gradients, freed after each step, as the fp32 shards they accumulate in during one."""
    local = [p.to_local() for p in params]
    return {"params": sum(size(t) for t in local),
            "grads": sum(t.numel() * t.element_size() for t in local),
            "optimizer": sum(size(t.to_local()) for state in opt.state.values()
                             for t in state.values() if hasattr(t, "to_local"))}


def _rank(rank: int, world_size: int, deepspeed_json: str, precision: str,
          engine_name: str) -> dict:
    import logging

    import deepspeed
    import torch

    from pretrain.config import load_config
    from pretrain.resolve.run import resolve_ds_config
    from pretrain.model import build_model
    from pretrain.training.engine import build_engine, param_groups
    from pretrain.resolve.topology import Topology

    deepspeed.utils.logger.setLevel(logging.WARNING)
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    cfg = load_config(None, MODEL + [f"deepspeed={deepspeed_json}", f"train.precision={precision}",
                                     f"train.engine={engine_name}",
                                     f"run_dir={tempfile.mkdtemp()}"])
    ds = resolve_ds_config(cfg, world_size=world_size, accelerator="cpu")
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size,
                                                     cfg.model.seq_length + 1))
    groups = Topology.from_parallel_config(cfg.parallel, world_size=world_size,
                                           rank=rank).create_groups()
    before = status_bytes("VmRSS")
    if engine_name == "fsdp2":
        engine = build_engine(cfg, ds, groups, main=False)
    else:  # as measured first: DeepSpeed over the plain model
        model = build_model(cfg.model, seed=0)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, 0.1),
                                          config=ds)

    def step() -> None:
        for _ in range(engine.gradient_accumulation_steps()):
            loss = engine(tokens[:, :-1], labels=tokens[:, 1:])
            engine.backward(loss)
            engine.step()

    step()  # warm-up: optimizer states exist from here on
    reset_peak()  # VmHWM := the current resident size
    step()
    step()
    return {"measured": status_bytes("VmHWM") - before, **model_state_bytes(engine)}


def predict(deepspeed_json: str, precision: str, engine: str):
    from pretrain.config import load_config
    from pretrain.plan.clusters import make_cluster
    from pretrain.plan.search import estimate
    from pretrain.resolve.run import lay_out_as_loaded

    cfg = load_config(None, MODEL + [f"deepspeed={deepspeed_json}", f"train.precision={precision}",
                                     f"train.engine={engine}"])
    layout = lay_out_as_loaded(cfg, world_size=WORLD).layout
    return estimate(cfg.model, layout, make_cluster("h100-80gb", nodes=1),
                    engine=cfg.train.engine), cfg


def _row(engine: str, precision: str, stage: int):
    """Print one engine x precision x ZeRO stage's prediction and measurement; (measured /
    predicted, the run config)."""
    ds_json = f"ds_configs/zero{stage}.json"
    plan, cfg = predict(ds_json, precision, engine)
    with tempfile.TemporaryDirectory() as tmp:
        ranks = run_on_ranks(_rank, world_size=WORLD, tmp_path=Path(tmp), timeout_s=600,
                             args=(ds_json, precision, engine))
    predicted = plan.memory.total
    measured = [r["measured"] for r in ranks]
    counted = sum(ranks[0][k] for k in ("params", "grads", "optimizer"))
    print(f"{engine:>9} {precision:>9} {stage:>4} {predicted / 2**20:>14.1f} "
          f"{measured[0] / 2**20:>12.1f}, {measured[1] / 2**20:>10.1f} "
          f"{max(measured) / predicted:>19.3f}   "
          f"{plan.memory.model_states / 2**20:.1f} / {counted / 2**20:.1f} MiB "
          f"(act {plan.memory.activations / 2**20:.1f}, buffers "
          f"{plan.memory.buffers / 2**20:.1f})", flush=True)
    return max(measured) / predicted, cfg


def main() -> None:
    from pretrain.arithmetic import num_parameters

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--stages", nargs="+", type=int, default=[0, 1, 2, 3])
    parser.add_argument("--engines", nargs="+", default=["deepspeed"],
                        choices=["deepspeed", "fsdp2"], help="fsdp2 skips ZeRO-0 (refused)")
    args = parser.parse_args()
    print(f"machine: {machine()}; {WORLD} gloo ranks (data parallel {WORLD}); shared with other "
          "jobs while it ran")
    print(f"{'engine':>9} {'precision':>9} {'ZeRO':>4} {'predicted MiB':>14} "
          f"{'measured MiB (rank 0, 1)':>25} {'measured/predicted':>19}   predicted states / "
          "counted states")
    worst, cfg = 0.0, None
    for engine, precision, stage in itertools.product(args.engines, args.precision, args.stages):
        if engine == "fsdp2" and stage == 0:
            continue
        ratio, cfg = _row(engine, precision, stage)
        worst = max(worst, abs(ratio - 1))
    print(f"parameters: {num_parameters(cfg.model):,}; largest |measured/predicted - 1| = "
          f"{worst:.3f} (target < 0.10)")


if __name__ == "__main__":
    main()
