"""`pretrain eval`: lm-eval-harness tasks on a checkpoint, in one process (`pretrain.evaluation`)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pretrain.commands.generate import add_loading_arguments


def _local_tasks() -> list[str]:
    """The local tasks' names, as `pretrain.resolve.eval_tasks.LOCAL_TASKS` finds them (read here
    without importing lm-eval and torch: `--help` stays light)."""
    tasks = Path(__file__).parents[1] / "evaluation" / "tasks"
    return sorted(p.stem for p in tasks.glob("*.yaml"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint",
                        help="a run directory, checkpoints/step<N>, final/, or a Hugging Face "
                             "Llama directory (what `pretrain generate` accepts)")
    parser.add_argument("--tasks", required=True,
                        help="comma-separated lm-eval task names: the local "
                             f"{', '.join(_local_tasks())}, or any task of lm-eval whose dataset "
                             "is in the Hugging Face cache (e.g. hellaswag,arc_easy)")
    parser.add_argument("--limit", type=int, default=None,
                        help="evaluate the first N examples of each task (default: all)")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per forward")
    parser.add_argument("--output", default=None,
                        help="JSON file of the scores (default: eval_<step or final>.json in the "
                             "run directory, else ./eval_scores.json)")
    add_loading_arguments(parser)


def run(args: argparse.Namespace) -> None:
    from pretrain.checkpoint.generate import load_for_inference
    from pretrain.errors import ConfigError
    from pretrain.evaluation import ModelRunner, check_tasks, evaluate

    tasks = [name.strip() for name in args.tasks.split(",") if name.strip()]
    if not tasks:
        raise ConfigError("--tasks: name at least one task")
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit {args.limit}: must be a positive number of examples")
    check_tasks(tasks, where="--tasks")
    model, tokenizer, weights, device = load_for_inference(
        args.checkpoint, tokenizer=args.tokenizer, device=args.device, dtype=args.dtype)
    runner = ModelRunner(model, vocab_size=weights.model.vocab_size,
                         seq_length=weights.model.seq_length, batch_size=args.batch_size,
                         device=device)
    scores = evaluate(runner, tokenizer, tasks=tasks, limit=args.limit)
    width = max(map(len, scores), default=0)
    for name, value in scores.items():
        sys.stdout.write(f"{name:<{width}}  {value:.4f}\n")
    out = Path(args.output) if args.output else _default_output(args.checkpoint, weights.step)
    record = {"checkpoint": str(args.checkpoint), "step": weights.step, "tasks": tasks,
              "limit": args.limit, "scores": scores}
    out.write_text(json.dumps(record, indent=2) + "\n")
    sys.stdout.write(f"[eval] scores in {out}\n")


def _default_output(checkpoint: str, step: int | None) -> Path:
    path = Path(checkpoint)
    run_dir = path if (path / "metrics.jsonl").is_file() else None
    if run_dir is None:
        return Path("eval_scores.json")
    return run_dir / f"eval_{'final' if step is None else f'step{step}'}.json"
