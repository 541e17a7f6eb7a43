"""Whether this CPU's flags tell its bf16 matmul speed: `cpu_info().bf16_native` (AVX512-BF16 or
AMX) against the measured fp32 / bf16 matmul throughput ratio (`bf16_slowdown`), the proxy that
`train.precision: auto` trusts. Prints the ratio and whether the flags agree with it; exits 1
when they do not. A timing ratio, so it lives here and not in the quick test tier.

    .venv/bin/python bench/bf16_speed.py            # a few seconds

Measured: uncontended ~0.5 with AVX512-BF16, 7.5 beside a training run; CPUs without bf16
hardware run bf16 50-80x slower than fp32. Agreement means below 10 with the flags, above 1.5
without.
"""
from __future__ import annotations

import sys

from common import machine
from pretrain.hardware import bf16_slowdown, cpu_info


def main() -> int:
    info = cpu_info()
    print(f"machine: {machine()}")
    print(f"flags: {info.describe()}")
    if info.bf16_native is None:
        print("/proc/cpuinfo has no flags here: nothing to compare")
        return 0
    slowdown = bf16_slowdown(seconds=2.0, rounds=8)
    agree = slowdown < 10.0 if info.bf16_native else slowdown > 1.5
    print(f"bf16 matmul is {slowdown:.2f}x slower than fp32 (fp32/bf16 throughput); the flags "
          f"say bf16 is {'native' if info.bf16_native else 'emulated'}: "
          f"{'agree' if agree else 'DISAGREE'}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
