"""The planner against two published large runs (`pretrain/plan/published.py`, the cases `tests/test_plan.py` asserts).

Megatron-Core's 70B GPT at TP 8 x PP 2 x DP 48 on 768 H100 (about 42% MFU, 420 TFLOP/s per GPU)
and BLOOM-176B at TP 4 x PP 12 x DP 8 on 384 A100-80GB (about 150 TFLOP/s per GPU counting
recomputation), predicted with one set of efficiency constants (`pretrain/plan/clusters.py`).
Pure arithmetic: runs in a second.

    .venv/bin/python bench/plan_published.py
"""
from __future__ import annotations

from pretrain.plan.clusters import COLLECTIVE_EFFICIENCY, MATMUL_EFFICIENCY
from pretrain.plan.memory import GB
from pretrain.plan.published import BLOOM_176B, MEGATRON_70B
from pretrain.plan.search import estimate


def main() -> None:
    print(f"constants: matmul efficiency {MATMUL_EFFICIENCY}, collective efficiency "
          f"{COLLECTIVE_EFFICIENCY}")
    for name, run, published, predicted_of in (
            ("Megatron-Core 70B, 768 H100, MFU", MEGATRON_70B, MEGATRON_70B["published_mfu"],
             lambda p: p.mfu),
            ("Megatron-Core 70B, model TFLOP/s/GPU", MEGATRON_70B, MEGATRON_70B["published_tflops"],
             lambda p: p.model_tflops_per_gpu),
            ("BLOOM-176B, 384 A100, hardware TFLOP/s/GPU", BLOOM_176B,
             BLOOM_176B["published_hw_tflops"], lambda p: p.hardware_tflops_per_gpu)):
        plan = estimate(run["model"], run["layout"], run["cluster"], ds=run["ds"])
        value = predicted_of(plan)
        t = plan.time
        print(f"{name:<44} published {published:>7.3g}  predicted {value:>7.3g}  ratio "
              f"{value / published:.3f}  | {plan.layout.describe()}; step {t.step:.2f} s = "
              f"compute {t.compute:.2f} + TP {t.tensor_comm:.2f} + bubble {t.bubble:.2f} + PP "
              f"{t.pipeline_comm:.2f} + DP {t.data_comm:.2f} + copies {t.memory_bound:.2f}; memory {plan.memory.total / GB:.1f} GB")


if __name__ == "__main__":
    main()
