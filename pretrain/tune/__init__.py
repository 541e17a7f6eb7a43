"""A hyper-parameter search over short `pretrain train` runs, with Optuna (`pretrain tune`).

- `space`: the search space (a YAML mapping of `--set` paths to ranges or lists), `Param`;
- `study`: the study the workers share (storage, lock, which trials count, stale trials retried);
- `worker`: one worker's loop, each trial a `pretrain train` run followed through its
  `metrics.jsonl` and pruned, stopped or failed;
- `results`: the best trial, the CSV, the plots and the summary.

Any number of workers (`--workers K` processes, or Slurm array tasks) share one study through its
storage; a restarted `pretrain tune` on the same study directory finishes the study, and
completed trials are not run again.
"""
