"""Ways of starting `pretrain train`'s ranks from Python.

- `local`: the launcher command table of this machine (torchrun, deepspeed, one process) and a
  run started through it as a child process of another command (`pretrain sweep`, `pretrain
  tune`, a Ray worker's rank, the tests), in a session of its own, stopped with every process
  it started.
"""
