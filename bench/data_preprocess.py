"""Preprocessing throughput of `pretrain preprocess` against the tokenizer library's own batch
encoding of the same text, in the same run.

Ours: `pretrain.data.preprocess` with `--workers` processes, end to end: reading the files,
tokenizing in worker processes, appending eos, writing the .bin/.idx pair (tmp + rename).
Baseline: sentencepiece's own batch encoding, ``SentencePieceProcessor.encode(texts,
num_threads=workers)``, of the same documents already in memory (no reading, no writing).
The two are measured alternately `--rounds` times; each round prints the throughput ratio
ours / baseline (tokens/s), and the median of the rounds is the result. Target: >= 0.8.

    .venv/bin/python bench/data_preprocess.py                 # ~1-2 minutes on 2 cores
    .venv/bin/python bench/data_preprocess.py --megabytes 8 --rounds 2
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from common import CACHE, machine

from pretrain.data import Tokenizer, iter_documents, preprocess, resolve_corpus, train_tokenizer


def corpus_sample(megabytes: float) -> list[Path]:
    """A fixed, seeded sample of stdlib files totalling about `megabytes`."""
    files = resolve_corpus(["python-stdlib"])
    random.Random(0).shuffle(files)
    chosen, size = [], 0
    for path in files:
        if size >= megabytes * 1e6:
            break
        chosen.append(path)
        size += path.stat().st_size
    return sorted(chosen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=16.0, help="corpus size")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vocab-size", type=int, default=8192)
    args = parser.parse_args()

    files = corpus_sample(args.megabytes)
    CACHE.mkdir(parents=True, exist_ok=True)
    model = CACHE / f"stdlib_bpe{args.vocab_size}.model"
    if not model.exists():
        train_tokenizer(resolve_corpus(["python-stdlib"]), model_prefix=model.with_suffix(""),
                        vocab_size=args.vocab_size)
    tokenizer = Tokenizer.load(model)
    documents = list(iter_documents(files))
    megabytes = sum(len(d.encode("utf-8")) for d in documents) / 1e6
    print(f"machine: {machine()}")
    print(f"corpus: {len(documents)} stdlib files, {megabytes:.1f} MB; tokenizer: "
          f"{model.name}; workers: {args.workers}")

    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_number in range(1, args.rounds + 1):
            start = time.perf_counter()
            encoded = tokenizer.encode_batch(documents, num_threads=args.workers)
            baseline_s = time.perf_counter() - start
            baseline_tokens = sum(map(len, encoded)) + len(encoded)  # + eos, as ours writes

            stats = preprocess(files, tokenizer_path=model, output_prefix=Path(tmp) / "bench",
                               workers=args.workers, show_progress=False)
            assert stats["tokens"] == baseline_tokens, (stats["tokens"], baseline_tokens)
            ours, baseline = stats["tokens"] / stats["seconds"], baseline_tokens / baseline_s
            ratios.append(ours / baseline)
            print(f"round {round_number}: ours {ours:,.0f} tokens/s "
                  f"({stats['documents'] / stats['seconds']:,.0f} documents/s, "
                  f"{stats['seconds']:.2f} s), sentencepiece batch {baseline:,.0f} tokens/s "
                  f"({baseline_s:.2f} s), ratio {ratios[-1]:.2f}")
    print(f"ratio ours / sentencepiece batch encoding (median of {args.rounds} rounds): "
          f"{statistics.median(ratios):.2f}  (target >= 0.8)")


if __name__ == "__main__":
    main()
