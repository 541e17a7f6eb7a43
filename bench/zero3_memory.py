"""ZeRO-3 per-rank model-state memory against the theory of 16 bytes per parameter / dp.

Mixed precision with Adam keeps, per parameter, a 16-bit weight (2 bytes), a 16-bit gradient (2),
an fp32 master weight (4) and Adam's two fp32 moments (8): 16 bytes, which ZeRO-3 divides by the
data-parallel size (Rajbhandari et al. 2020). The same 34M-parameter model as
`bench/plan_memory.py` trains one bf16 step with `ds_configs/zero3.json` on dp = 1, 2 and 4 gloo
ranks, and each rank's parameter partitions, gradient partition buffer, fp32 master partition and
Adam states are counted tensor by tensor (storage bytes, each storage once).

    .venv/bin/python bench/zero3_memory.py          # ~3 minutes on 2 cores
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from common import machine
from pretrain.testing.ranks import run_on_ranks
from plan_memory import MODEL, model_state_bytes


def _rank(rank: int, world_size: int) -> dict:
    import logging

    import deepspeed
    import torch

    from pretrain.arithmetic import num_parameters
    from pretrain.config import load_config
    from pretrain.resolve.run import resolve_ds_config
    from pretrain.model import build_model
    from pretrain.training.engine import param_groups

    deepspeed.utils.logger.setLevel(logging.WARNING)
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    overrides = [o for o in MODEL if not o.startswith("train.global_batch_size")]
    cfg = load_config(None, overrides + ["deepspeed=ds_configs/zero3.json", "train.precision=bf16",
                                         f"train.global_batch_size={2 * world_size}"])
    ds = resolve_ds_config(cfg, world_size=world_size, accelerator="cpu")
    model = build_model(cfg.model, seed=0)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, 0.1),
                                      config=ds)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length + 1))
    loss = engine(tokens[:, :-1], labels=tokens[:, 1:])
    engine.backward(loss)
    engine.step()
    return {"parameters": num_parameters(cfg.model), **model_state_bytes(engine)}


def main() -> None:
    print(f"machine: {machine()}; gloo ranks; shared with other jobs while it ran")
    print(f"{'dp':>3} {'rank':>4} {'params MiB':>11} {'grads MiB':>10} {'optim MiB':>10} "
          f"{'total MiB':>10} {'16 B x N / dp MiB':>18} {'ratio':>6}")
    worst = 0.0
    for dp in (1, 2, 4):
        with tempfile.TemporaryDirectory() as tmp:
            ranks = run_on_ranks(_rank, world_size=dp, tmp_path=Path(tmp), timeout_s=900)
        for rank, r in enumerate(ranks):
            total = r["params"] + r["grads"] + r["optimizer"]
            theory = 16 * r["parameters"] / dp
            worst = max(worst, abs(total / theory - 1))
            print(f"{dp:>3} {rank:>4} {r['params'] / 2**20:>11.2f} {r['grads'] / 2**20:>10.2f} "
                  f"{r['optimizer'] / 2**20:>10.2f} {total / 2**20:>10.2f} "
                  f"{theory / 2**20:>18.2f} {total / theory:>6.3f}")
    print(f"parameters: {ranks[0]['parameters']:,}; largest |measured/theory - 1| = {worst:.4f} "
          "(target < 0.10)")


if __name__ == "__main__":
    main()
