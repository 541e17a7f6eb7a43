"""The `pretrain` command (also `python -m pretrain`): one subcommand per step of a run.

    pretrain tokenizer   train a sentencepiece BPE/unigram tokenizer on a corpus
    pretrain preprocess  tokenize a corpus into a Megatron .bin/.idx indexed dataset
    pretrain merge-datasets  concatenate .bin/.idx datasets (e.g. preprocessed shards) into one
    pretrain train       train under any launcher (deepspeed, torchrun, srun) or as one process
    pretrain generate    continue a prompt with a trained checkpoint
    pretrain eval        lm-eval-harness tasks (multiple choice, generation) on a checkpoint
    pretrain export-hf   write any checkpoint as a Hugging Face LlamaForCausalLM directory
    pretrain import-hf   turn a Hugging Face Llama directory into a run's initial weights
    pretrain convert-checkpoint  consolidated fp32 weights (--to fp32) or universal checkpoint
    pretrain launch      hostfile / .deepspeed_env / pre-flight for the launch scripts
    pretrain plan        dry-run a config for N ranks; memory / speed planner; --search
    pretrain sweep       short runs over ZeRO configs x micro-batches: CSV, table, plot
    pretrain tune        hyper-parameter search (Optuna): trials pruned as they run, best --set line
    pretrain plot        loss, learning rate and tokens/s of one or more runs, as one PNG
    pretrain config      print the resolved run config, every field with its comment

Errors in the user's input (config, data, checkpoint) print one `error:` line and exit 2. When
the reader of stdout goes away (`pretrain sweep --list | head -1`), the command ends quietly with
status 141, as a shell command killed by SIGPIPE does.
"""
from __future__ import annotations

import argparse
import os
import select
import signal
import sys

from pretrain.commands import config as config_command
from pretrain.commands import eval as eval_command
from pretrain.commands import (convert, data, export_hf, generate, import_hf, launch, plan, plot,
                               sweep, train, tune)
from pretrain.errors import EXIT_USER_ERROR, PretrainError

# name: (one-line help, add_arguments, run). Each command module imports torch and the rest of
# the stack inside its run functions, so building this parser (and `--help`) stays fast.
COMMANDS = {
    "tokenizer": ("train a sentencepiece BPE/unigram tokenizer (byte fallback) on a corpus",
                  data.tokenizer_arguments, data.run_tokenizer),
    "preprocess": ("tokenize a corpus into a Megatron-format .bin/.idx dataset",
                   data.preprocess_arguments, data.run_preprocess),
    "merge-datasets": ("concatenate .bin/.idx datasets (e.g. shards) into one",
                       data.merge_arguments, data.run_merge),
    "train": ("train a model (under deepspeed / torchrun / srun, or as one process)",
              train.add_arguments, train.run),
    "generate": ("continue a prompt with a trained checkpoint", generate.add_arguments,
                 generate.run),
    "eval": ("lm-eval-harness tasks on a checkpoint: scores printed and written as JSON",
             eval_command.add_arguments, eval_command.run),
    "export-hf": ("write any checkpoint as a Hugging Face LlamaForCausalLM directory",
                  export_hf.add_arguments, export_hf.run),
    "import-hf": ("turn a Hugging Face Llama directory into initial weights for a run",
                  import_hf.add_arguments, import_hf.run),
    "convert-checkpoint": ("consolidated fp32 weights (--to fp32) or a universal checkpoint",
                           convert.add_arguments, convert.run),
    "launch": ("helpers of launch/ and slurm/: hostfile, .deepspeed_env, preflight; k8s manifests; ray",
               launch.add_arguments, launch.run),
    "plan": ("dry-run a config for N ranks; per-GPU memory, step time and MFU; --search",
             plan.add_arguments, plan.run),
    "sweep": ("short runs over DeepSpeed configs x micro-batches -> CSV, Markdown, PNG",
              sweep.add_arguments, sweep.run),
    "tune": ("hyper-parameter search with Optuna over short runs: pruned, resumable, shared by "
             "workers", tune.add_arguments, tune.run),
    "plot": ("loss, learning rate and tokens/s of one or more runs against the step, as a PNG",
             plot.add_arguments, plot.run),
    "config": ("print the resolved run config as commented YAML (or --json)",
               config_command.add_arguments, config_command.run),
}
# Commands that answer without torch: `_quiet_imports` would load it to look for a GPU.
WITHOUT_TORCH = frozenset({"config", "plot"})


def _quiet_imports() -> None:
    # Name the accelerator up front so DeepSpeed does not warn that it fell back to the CPU.
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"


class _HelpWithDefaults(argparse.RawDescriptionHelpFormatter):
    """Shows an option's default after its help, when it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("%(default)" in text or default in (None, False, [], argparse.SUPPRESS)
                or not action.option_strings or "default" in text):
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    from pretrain import __version__

    parser = argparse.ArgumentParser(prog="pretrain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"pretrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_args, func) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           formatter_class=_HelpWithDefaults)
        add_args(p)
        p.set_defaults(func=func)
    return parser


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe or socket whose reader has closed it (Linux reports POLLERR on
    such a pipe): a BrokenPipeError from anything else is a real error, with its traceback."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll, or stdout closed or replaced
        return False


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command not in WITHOUT_TORCH:
        _quiet_imports()
    try:
        args.func(args)
        sys.stdout.flush()  # here, not at interpreter exit, where a broken pipe cannot be caught
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise
        # Python flushes stdout again at exit: point it at /dev/null so that flush succeeds.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(128 + int(signal.SIGPIPE))
    except PretrainError as exc:
        # Validation errors are the same on every rank: one line from rank 0 is enough.
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {exc}", file=sys.stderr)
        # bad input exits 2; an error more nodes would cure carries its own (requeue) status
        sys.exit(getattr(exc, "exit_code", EXIT_USER_ERROR))


if __name__ == "__main__":
    main()
