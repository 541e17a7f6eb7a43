"""The resolved run: from the config file, `--set`, the DeepSpeed JSON, the world and the
tokenizer to one frozen `ResolvedRun` (`pretrain.resolve.run.resolve_run`), built once per
process and handed down; nothing outside this package re-derives what it holds.

- `run`: `ResolvedRun` and the functions that settle a config (precision, global batch,
  vocabulary) and lay it out on a world; the refusal of a checkpoint's other layout;
- `layout`: `Layout`, the parallel layout's rules and arithmetic (valid sizes, batches);
- `topology`: `Topology`, the rank grid and its process groups;
- `world_fit`: which ranks of a world the layout can use, and what the others do;
- `ds_config`: the DeepSpeed JSON read, checked and filled from the run;
- `fsdp2_rules`: what `train.engine: fsdp2` cannot run, for the resolver and the planner;
- `run_checks`: what a run needs beyond its layout (its sinks' packages, its eval tasks),
  checked as its config is settled; `eval_tasks`: which lm-eval tasks a name means.
"""
