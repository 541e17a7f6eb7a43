"""The training loop and what runs beside it on every rank.

- `trainer`: `Trainer`, the loop over steps: data, engine, evaluations, saves, the run's lines;
- `engine`: the DeepSpeed engine (flat or pipelined) for a resolved run; `fsdp2`: PyTorch's
  `fully_shard` engine with the same interface;
- `evaluators`: the validation loss and the lm-eval tasks during the run;
- `loop_state`: `LoopState`, what a spike's rollback and the evaluations read and move of a
  run (its `Position`: step, samples consumed, newest checkpoint), built by the trainer;
- `faults`: signals, time limits, the save cadence and non-finite steps (`RunControl`,
  `NonFiniteGuard`); `spikes`: loss spikes; `stragglers`: slow ranks; `hang`, `hang_verdict`
  and `collective_log`: the watchdog that names the rank a collective waits for;
- `metrics`: each step's record and line (MFU, memory, throughput); `sinks`: metrics.jsonl
  and the configured trackers; `curves`: metrics.jsonl drawn as curves.png (also `pretrain
  plot`); `profiler`: the step profiler;
- `deepspeed_imports`: DeepSpeed's imports and builds a run never uses kept out of every
  process's start-up (installed by `pretrain/__init__.py`; the standard library only).
"""
