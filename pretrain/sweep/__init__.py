"""What `pretrain sweep` makes of its runs (the command itself: `pretrain/commands/sweep.py`).

- `results`: a row per run from its metrics.jsonl and ds_config.json; sweep.csv, sweep.md and
  sweep.png.
"""
