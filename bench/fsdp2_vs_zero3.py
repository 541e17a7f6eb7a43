"""Step time and per-rank peak memory of `train.engine: fsdp2` against DeepSpeed's ZeRO-3, same
model, layout and data, measured in the same run.

Both engines train the same fp32 model (hidden 256, 4 layers, seq 256, vocab 8192: ~7M
parameters) with `ds_configs/zero3.json` on 2 data-parallel ranks forked as `pretrain train`'s
tests fork them (gloo), ROUNDS times each, alternating (fsdp2, ZeRO-3, fsdp2, ...) so that a
change in the machine's load falls on both. Step time: the median `step_time_s` of the steps
after WARMUP; memory: each rank's peak (the process's peak RSS on CPU ranks, the allocator's
peak on GPUs: `metrics.peak_memory_gb`), the largest over ranks. Ratios are fsdp2 / ZeRO-3.

With `--precision bf16` it compares memory only (both engines' bf16: FSDP2's
MixedPrecisionPolicy over fp32 shards, DeepSpeed's bf16 partitions with fp32 masters): bf16
matmuls are emulated 50-80x slower on CPUs without bf16 instructions, so that model is one whose
states are nearly all its vocabulary (hidden 128, 2 layers, seq 16, vocabulary 131072: 34M
parameters, 33.6M of them the embedding and the head), light to compute, and step times are
not reported.

    .venv/bin/python bench/fsdp2_vs_zero3.py            # ~2.5 minutes for 3 rounds on 2 cores
    .venv/bin/python bench/fsdp2_vs_zero3.py --precision bf16
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import machine, median, stdlib_dataset
from pretrain.testing.runs import train

MODEL = ["model.hidden_size=256", "model.num_layers=4", "model.num_heads=4",
         "model.num_kv_heads=4", "model.ffn_hidden_size=704", "model.seq_length=256",
         "model.vocab_size=auto"]
# bf16: memory only, a model of few FLOPs per parameter (see the docstring)
MODEL_BF16 = ["model.hidden_size=128", "model.num_layers=2", "model.num_heads=4",
              "model.num_kv_heads=4", "model.ffn_hidden_size=352", "model.seq_length=16",
              "model.vocab_size=131072"]
ENGINES = {"fsdp2": ["train.engine=fsdp2"], "zero3": []}
WARMUP = 2  # steps left out of the step time (first gathers, allocator growth)


def _measure(engine: str, data: dict[str, str], *, steps: int, out: Path,
             precision: str) -> tuple[float, float]:
    """(median step seconds, max over ranks of the peak memory in GB) of one run."""
    model = MODEL if precision == "fp32" else MODEL_BF16
    run = train(out, data, nprocs=2, name=engine, overrides=[
        *model, *ENGINES[engine], "deepspeed=ds_configs/zero3.json", f"train.steps={steps}",
        f"train.precision={precision}", "train.micro_batch_size=2", "train.global_batch_size=4",
        "train.warmup_steps=2"])
    records = [r for r in run.records if r["kind"] == "train"]
    return (median([r["step_time_s"] for r in records[WARMUP:]]),
            max(records[-1]["peak_mem_gb_ranks"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                        help="bf16: peak memory only, of a vocabulary-heavy model (docstring)")
    args = parser.parse_args()
    data = stdlib_dataset()
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in ENGINES}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for engine in ENGINES:
                results[engine].append(_measure(engine, data, steps=args.steps,
                                                out=Path(tmp) / f"round{round_}",
                                                precision=args.precision))
    print(f"machine: {machine()}; 2 gloo ranks, {args.precision}, ZeRO-3 JSON; "
          f"{args.rounds} rounds of {args.steps} steps (first {WARMUP} left out)")
    if args.precision == "bf16":
        _print_memory(results)
        return
    for round_ in range(args.rounds):
        (f_time, f_mem), (z_time, z_mem) = results["fsdp2"][round_], results["zero3"][round_]
        print(f"round {round_ + 1}: fsdp2 {f_time:.3f} s {f_mem:.3f} GB | zero3 {z_time:.3f} s "
              f"{z_mem:.3f} GB | step time ratio {f_time / z_time:.2f}")
    print(f"{'engine':>7} {'step s (median of rounds)':>26} {'peak GB/rank (max)':>19}")
    summary = {}
    for engine, rows in results.items():
        summary[engine] = (median([r[0] for r in rows]), max(r[1] for r in rows))
        print(f"{engine:>7} {summary[engine][0]:>26.3f} {summary[engine][1]:>19.3f}")
    print(f"fsdp2 / zero3: step time {summary['fsdp2'][0] / summary['zero3'][0]:.2f}x, "
          f"peak memory per rank {summary['fsdp2'][1] / summary['zero3'][1]:.2f}x")


def _print_memory(results: dict[str, list[tuple[float, float]]]) -> None:
    """bf16: the peak memory per rank of each round and the ratio (no step times)."""
    for round_, ((_, f_mem), (_, z_mem)) in enumerate(zip(results["fsdp2"], results["zero3"])):
        print(f"round {round_ + 1}: peak GB/rank fsdp2 {f_mem:.3f} | zero3 {z_mem:.3f} | "
              f"ratio {f_mem / z_mem:.2f}")
    f_max, z_max = (max(r[1] for r in results[e]) for e in ("fsdp2", "zero3"))
    print(f"fsdp2 / zero3 (bf16): peak memory per rank {f_max:.3f} / {z_max:.3f} GB = "
          f"{f_max / z_max:.2f}x")


if __name__ == "__main__":
    main()
