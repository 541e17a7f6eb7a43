"""The planner: what a layout needs per GPU and how fast it should run, all arithmetic, no torch.

- `pretrain.plan.memory`: per-GPU memory of the heaviest pipeline stage (model states by
  precision, ZeRO stage and offload; activations; DeepSpeed's buffers), and of the same layout
  under `train.engine: fsdp2` (FSDP2's shards, gathered units and gradients in flight);
- `pretrain.plan.step_time`: the predicted step time split into compute and communication
  (data-parallel communication and offload as DeepSpeed's or FSDP2's);
- `pretrain.plan.search`: `estimate` (one layout -> `Plan`, with MFU and HFU) and `search`
  (every valid layout of a cluster that fits, fastest first);
- `pretrain.plan.clusters`: cluster presets and the efficiency assumptions (one set for all);
- `pretrain.plan.dry_run` and `pretrain.plan.report`: the dry run of a full run config and the
  text `pretrain plan` prints.

Which layouts are valid is decided by `pretrain.resolve.layout`; parameter and FLOP counts come from
`pretrain.arithmetic`.
"""
