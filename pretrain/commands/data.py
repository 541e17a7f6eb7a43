"""The data commands of `pretrain`: ``tokenizer``, ``preprocess`` and ``merge-datasets``.

Each command is an (add_arguments, run) pair registered in `pretrain.cli`. Imports of the data
pipeline happen inside `run`, so ``pretrain --help`` stays fast.
"""
from __future__ import annotations

import argparse
import os

_CORPUS_HELP = ("files, directories, globs, .jsonl/.parquet files, saved `datasets` directories, "
                "hf:NAME[:SPLIT] (hub, online), or python-stdlib (this interpreter's sources)")
# What `--tokenizer` takes (`pretrain.data.tokenizer.Tokenizer.load` reads both kinds).
TOKENIZER_HELP = ("a sentencepiece .model or a Hugging Face tokenizer directory (e.g. Llama 3's, "
                  "downloaded with `huggingface-cli download ... --include \"tokenizer*\"`)")
_TEXT_FIELD_HELP = "the text field of .jsonl rows, parquet columns and datasets (default: text)"


def _make_parent(path: str) -> None:
    if not path.startswith("s3://"):  # a prefix in the object store needs no directory
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def tokenizer_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--corpus", nargs="+", required=True, help=_CORPUS_HELP)
    parser.add_argument("--text-field", default="text", help=_TEXT_FIELD_HELP)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--output", required=True, help="path of the .model file to write")
    parser.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")


def run_tokenizer(args: argparse.Namespace) -> None:
    from pretrain.data import resolve_corpus, train_tokenizer

    prefix = args.output.removesuffix(".model")
    _make_parent(prefix)
    tokenizer = train_tokenizer(resolve_corpus(args.corpus), model_prefix=prefix,
                                vocab_size=args.vocab_size, model_type=args.model_type,
                                text_field=args.text_field)
    print(f"[tokenizer] wrote {tokenizer.path} ({tokenizer.vocab_size} tokens)")


def preprocess_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--corpus", nargs="+", required=True, help=_CORPUS_HELP)
    parser.add_argument("--text-field", default="text", help=_TEXT_FIELD_HELP)
    parser.add_argument("--tokenizer", required=True, help=TOKENIZER_HELP)
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2)),
                        help="tokenizer processes (default: all cores)")


def run_preprocess(args: argparse.Namespace) -> None:
    from pretrain.data import preprocess, resolve_corpus
    from pretrain.log import show_progress_bar

    _make_parent(args.output_prefix)
    stats = preprocess(resolve_corpus(args.corpus), tokenizer_path=args.tokenizer,
                       output_prefix=args.output_prefix, workers=args.workers,
                       text_field=args.text_field, show_progress=show_progress_bar())
    seconds = max(stats["seconds"], 1e-9)
    print(f"[preprocess] {stats['documents']:,} documents, {stats['tokens']:,} tokens in "
          f"{stats['seconds']:.1f}s ({stats['documents'] / seconds:,.0f} documents/s, "
          f"{stats['tokens'] / seconds:,.0f} tokens/s) -> {args.output_prefix}.bin/.idx")
    # What the model will see at a document's edges: the eos appended (a base and an instruct
    # tokenizer of one family may name different ones) and no bos.
    print(f"[preprocess] tokenizer {args.tokenizer}: {stats['vocab_size']:,} tokens "
          f"(model.vocab_size: auto takes them); each document ends with eos {stats['eos']}; "
          "no bos is added")


def merge_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--inputs", nargs="+", required=True, metavar="PREFIX",
                        help="dataset prefixes (without .bin/.idx), concatenated in this order")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")


def run_merge(args: argparse.Namespace) -> None:
    from pretrain.data import merge_datasets

    _make_parent(args.output_prefix)
    merged = merge_datasets(args.inputs, args.output_prefix)
    print(f"[merge-datasets] {len(args.inputs)} datasets, {merged.num_documents:,} documents, "
          f"{merged.num_tokens:,} tokens -> {args.output_prefix}.bin/.idx")
