"""Per-rank model-state memory at tensor parallel 2 x pipeline parallel 2 against the theory.

Model state = parameters + gradients + AdamW's two moments, all fp32 (16 bytes per parameter),
read from the tensors each rank actually holds after one training step of the real pipeline
engine (gradients: one fp32 buffer per parameter, whether or not it is allocated at the moment
of reading). Ideal per rank: the full model's bytes (measured the same way on one rank) / (tp x
pp). Replicated weights are accounted for: each rank's expected bytes are its stage's sharded
parameters / tp plus its replicated RMSNorm weights, and the ratio measured / expected must be 1;
the ratio against the ideal shows what replication and stage imbalance cost (target within 5%).

    .venv/bin/python bench/model_memory.py             # ~1 minute on 2 cores
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from common import machine
from pretrain.testing.ranks import run_on_ranks

OVERRIDES = ["model.preset=small", "model.num_layers=8", "model.seq_length=64",
             "model.tie_embeddings=false"]


def _state_bytes(module, optimizer) -> dict:
    params = [p for p in module.parameters()]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.numel() * 4 for p in params)  # fp32 gradient buffer per parameter
    opt_bytes = sum(t.numel() * t.element_size() for state in optimizer.state.values()
                    for t in state.values() if hasattr(t, "numel") and t.dim() > 0)
    replicated = sum(p.numel() for p in params if not getattr(p, "tensor_model_parallel", False))
    sharded = sum(p.numel() for p in params if getattr(p, "tensor_model_parallel", False))
    return {"params": param_bytes, "grads": grad_bytes, "optimizer": opt_bytes,
            "replicated_numel": replicated, "sharded_numel": sharded}


def _rank(rank: int, world_size: int, tp: int, pp: int) -> dict:
    import logging

    import deepspeed
    import torch

    from pretrain.config import load_config
    from pretrain.model import build_model
    from pretrain.model import build_pipeline_model
    from pretrain.resolve.topology import Topology

    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    cfg = load_config(None, OVERRIDES).model
    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2,
              "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": {"stage": 0}}
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1))
    if pp == 1:
        model = build_model(cfg, seed=0)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config)
        loss = engine(tokens[:, :-1], labels=tokens[:, 1:])
        engine.backward(loss)
        engine.step()
    else:
        topology = Topology(tensor=tp, pipeline=pp, world_size=world_size, rank=rank)
        groups = topology.create_groups()
        module = build_pipeline_model(cfg, seed=0, num_stages=pp, topology=topology,
                                      tp_group=groups.tensor, partition_method="parameters")
        engine, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                          config=config)
        engine.train_batch(iter([(tokens[:, :-1], tokens[:, 1:])]))
    return _state_bytes(engine.module, engine.optimizer)


def main() -> None:
    tp, pp = 2, 2
    with tempfile.TemporaryDirectory() as tmp:
        (full,) = run_on_ranks(_rank, world_size=1, tmp_path=Path(tmp) / "one", args=(1, 1))
        ranks = run_on_ranks(_rank, world_size=tp * pp, tmp_path=Path(tmp) / "four",
                             timeout_s=600, args=(tp, pp))
    total = lambda r: r["params"] + r["grads"] + r["optimizer"]  # noqa: E731
    ideal = total(full) / (tp * pp)
    print(f"machine: {machine()}; gloo ranks")
    print(f"model: preset small with 8 layers, untied, fp32 + AdamW; full model state "
          f"{total(full) / 2**20:.1f} MiB on one rank ({total(full) / (full['params'] / 4):.1f} "
          f"bytes/parameter)")
    print(f"{'rank':>4} {'params MiB':>11} {'grads MiB':>10} {'optim MiB':>10} {'total MiB':>10} "
          f"{'/ ideal':>8} {'/ expected':>11} {'replicated params':>18}")
    for rank, r in enumerate(ranks):
        expected = 16 * (r["sharded_numel"] + r["replicated_numel"])
        print(f"{rank:>4} {r['params'] / 2**20:>11.2f} {r['grads'] / 2**20:>10.2f} "
              f"{r['optimizer'] / 2**20:>10.2f} {total(r) / 2**20:>10.2f} "
              f"{total(r) / ideal:>8.3f} {total(r) / expected:>11.3f} {r['replicated_numel']:>18,}")
    mean = sum(total(r) for r in ranks) / len(ranks)
    print(f"mean per rank / ideal (full / {tp * pp}): {mean / ideal:.3f}; "
          f"max / ideal: {max(total(r) for r in ranks) / ideal:.3f}  (target within 5%)")


if __name__ == "__main__":
    main()
