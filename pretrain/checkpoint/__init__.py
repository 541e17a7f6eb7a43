"""Checkpoints: DeepSpeed engine checkpoints for resuming, a plain `final/` for using the model.

Layout of a run directory::

    <run_dir>/checkpoints/step<N>/...            DeepSpeed engine checkpoint (every rank's shards)
    <run_dir>/checkpoints/step<N>/rng_rank<R>.pt  Python / NumPy / torch RNG states of rank R
    <run_dir>/checkpoints/step<N>/meta.json      step, consumed samples, layout, config, tokenizer,
                                                 git commit (small: read without loading tensors)
    <run_dir>/checkpoints/step<N>/manifest.json  size and CRC32 of every file: written last, once
                                                 every rank's files are on disk, it marks the
                                                 checkpoint complete
    <run_dir>/checkpoints/latest                 the newest complete tag (DeepSpeed's format)
    <run_dir>/stopped.json                       written when a signal or time limit stopped the
                                                 run (exit 75): {"exit_code", "reason", "step"}
    <run_dir>/final/model.safetensors            consolidated fp32 weights, Hugging Face names
    <run_dir>/final/config.yaml, tokenizer.model the run config and the tokenizer

Modules, each on top of the previous ones:

- `paths`: the names above, which step directory a path means (`step_dirs`), the manifest check
  (`verify`) and the small files (`write_manifest`, `write_latest`, `mark_stopped`).
- `weights`: `Weights` and `load_weights`, the one reader of every checkpoint format (engine
  step dirs of any layout consolidated offline, final/, Hugging Face directories); `write_final`,
  the one writer of final/; `load_initial_weights` for `model.init_from`.
- `writer`: `ShardWriter`, DeepSpeed's checkpoint engine replaced by ours: each file written
  at once or from a host copy by a background thread, its CRC32 taken as it is written, synced.
- `saver`: saving (`Saver`: at most one save in flight, completed by `finish`, or through the
  rendezvous store by a hang watchdog) and pruning.
- `store`: a run directory at `s3://bucket/prefix`: the node-local copy the run works in, each
  completed save uploaded with its manifest last, the store pruned.
- `engine`: resuming and loading engine checkpoints, the universal conversion, and `save_final`
  (the in-training gather that `write_final` writes).
- `hf`: Hugging Face export and import, with the sentencepiece tokenizer conversion.
- `generate`: continue a prompt from any checkpoint (`pretrain generate`).

The names the trainer and `pretrain train` use are importable from the package itself.
"""
from pretrain.checkpoint.engine import (ResumePoint, checkpoint_meta, confirm_content, find_resume,
                                        load, save_final)
from pretrain.checkpoint.paths import clear_stopped, mark_stopped
from pretrain.checkpoint.saver import Saver
from pretrain.checkpoint.weights import load_initial_weights

__all__ = ["ResumePoint", "Saver", "checkpoint_meta", "clear_stopped", "confirm_content", "find_resume", "load",
           "load_initial_weights", "mark_stopped", "save_final"]
