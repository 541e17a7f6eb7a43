"""The `pretrain` command (also `python -m pretrain`): one subcommand per step of a run.

    pretrain tokenizer   train a sentencepiece BPE tokenizer on a corpus
    pretrain preprocess  tokenize a corpus into a Megatron .bin/.idx indexed dataset
    pretrain train       train under any launcher (deepspeed, torchrun, srun) or as one process
    pretrain generate    continue a prompt with a trained checkpoint

Errors in the user's input (config, data, checkpoint) print one `error:` line and exit 2.
"""
from __future__ import annotations

import argparse
import os
import sys

from pretrain.errors import EXIT_USER_ERROR


def _quiet_imports() -> None:
    # Name the accelerator up front so DeepSpeed does not warn that it fell back to the CPU.
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"


def _tokenizer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", nargs="+", required=True,
                   help="files, directories, globs, or python-stdlib (this interpreter's sources)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--output", required=True, help="path of the .model file to write")
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")


def _run_tokenizer(args: argparse.Namespace) -> None:
    from pretrain.data import resolve_corpus, train_tokenizer

    out = args.output[:-len(".model")] if args.output.endswith(".model") else args.output
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tokenizer = train_tokenizer(resolve_corpus(args.corpus), model_prefix=out,
                                vocab_size=args.vocab_size, model_type=args.model_type)
    print(f"[tokenizer] wrote {tokenizer.path} ({tokenizer.vocab_size} tokens)")


def _preprocess_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", nargs="+", required=True,
                   help="files, directories, globs, or python-stdlib (this interpreter's sources)")
    p.add_argument("--tokenizer", required=True, help="sentencepiece .model file")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2)),
                   help="tokenizer processes (default: all cores)")


def _run_preprocess(args: argparse.Namespace) -> None:
    from pretrain.data import preprocess, resolve_corpus

    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    stats = preprocess(resolve_corpus(args.corpus), tokenizer_path=args.tokenizer,
                       output_prefix=args.output_prefix, workers=args.workers)
    print(f"[preprocess] {stats['documents']:,} documents, {stats['tokens']:,} tokens in "
          f"{stats['seconds']:.1f}s -> {args.output_prefix}.bin/.idx")


def build_parser() -> argparse.ArgumentParser:
    from pretrain import generate, train

    parser = argparse.ArgumentParser(prog="pretrain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = {
        "tokenizer": ("train a sentencepiece BPE tokenizer (byte fallback) on a corpus",
                      _tokenizer_args, _run_tokenizer),
        "preprocess": ("tokenize a corpus into a Megatron-format .bin/.idx dataset",
                       _preprocess_args, _run_preprocess),
        "train": ("train a model (under deepspeed / torchrun / srun, or as one process)",
                  train.add_arguments, train.run),
        "generate": ("continue a prompt with a trained checkpoint", generate.add_arguments,
                     generate.run),
    }
    for name, (help_text, add_args, func) in commands.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        p.set_defaults(func=func)
    return parser


def main(argv: list[str] | None = None) -> None:
    from pretrain.errors import PretrainError

    args = build_parser().parse_args(argv)
    _quiet_imports()
    try:
        args.func(args)
    except PretrainError as exc:
        # Validation errors are the same on every rank: one line from rank 0 is enough.
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {exc}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


if __name__ == "__main__":
    main()
