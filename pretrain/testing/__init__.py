"""Helpers shared by the test suite and the benchmarks (like `torch.testing`), importable wherever
the package is installed, so neither edits `sys.path` to borrow the other's code.

- `pretrain.testing.faults`: fault injection (NaN losses at chosen steps), in-process or in a
  spawned `pretrain` run,
- `pretrain.testing.memory`: resident memory and the peak a phase adds (/proc/self/status),
- `pretrain.testing.nccl_strict`: collectives that refuse host-resident tensors as NCCL does
  on GPUs (offloaded shards, gradients and optimizer state, by the engine's own account),
- `pretrain.testing.nondeterminism`: reruns that differ in the last bits, as GPU kernels' do,
- `pretrain.testing.numerics`: bf16 tolerances derived from rounding, fp64 reference losses,
  a tensor-parallel model's gradients gathered whole,
- `pretrain.testing.ranks`: run a function on N gloo ranks (spawned processes, file rendezvous),
- `pretrain.testing.runs`: run `pretrain` as a user would, through the real launchers, from the
  repository checkout (`REPO`: the launch scripts and configs live there).
"""
