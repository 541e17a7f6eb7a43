"""Build the local task `python_next_line` (tasks/python_next_line.jsonl) from the bundled corpus.

Each example is a passage of CONTEXT_LINES consecutive non-blank lines of one standard-library
source file (the `python-stdlib` corpus the quickstart trains on), and four candidate next
lines: the true one and three lines drawn from other files. lm-eval scores it as multiple
choice by log-likelihood (acc: chance is 0.25). The passages come from the training corpus: the
task measures what the model learnt of Python, not generalisation to unseen code.

    python -m pretrain.evaluation.next_line [--examples 200] [--output PATH]

The shipped file was built on CPython 3.11 with the defaults (a different interpreter's standard
library gives other passages).
"""
from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from pretrain.data.corpus import PYTHON_STDLIB, read_text, resolve_corpus

CONTEXT_LINES = 8
CHOICES = 4
MIN_LINE_CHARS = 12  # the answer and distractors: no bare `else:` / `)` lines
# Lines that cite an entry of CPython's bug tracker (a comment naming an issue and its number):
# left out, so that the shipped task file carries no issue numbers of another project
TRACKER_CITATION = re.compile(r"(issue|bpo)[ _-]?#?\d{3,}", re.IGNORECASE)
SEED = 0
DEFAULT_OUTPUT = Path(__file__).parent / "tasks" / "python_next_line.jsonl"


def _lines(path: Path) -> list[str]:
    text, _ = read_text(path)
    return [line.rstrip() for line in text.splitlines()
            if line.strip() and not TRACKER_CITATION.search(line)]


def build_examples(count: int, *, seed: int = SEED) -> list[dict]:
    """`count` examples {context, choices, label}, the same for the same standard library."""
    rng = random.Random(seed)
    files = [lines for lines in map(_lines, resolve_corpus([PYTHON_STDLIB]))
             if len(lines) > CONTEXT_LINES + 1]
    examples = []
    while len(examples) < count:
        index = rng.randrange(len(files))
        lines = files[index]
        start = rng.randrange(len(lines) - CONTEXT_LINES)
        answer = lines[start + CONTEXT_LINES]
        if len(answer.strip()) < MIN_LINE_CHARS:
            continue
        distractors: list[str] = []
        while len(distractors) < CHOICES - 1:
            other = rng.randrange(len(files))
            line = rng.choice(files[other])
            if other != index and len(line.strip()) >= MIN_LINE_CHARS \
                    and line not in distractors and line != answer:
                distractors.append(line)
        label = rng.randrange(CHOICES)
        choices = distractors[:label] + [answer] + distractors[label:]
        context = "\n".join(lines[start:start + CONTEXT_LINES]) + "\n"
        examples.append({"context": context, "choices": choices, "label": label})
    return examples


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    examples = build_examples(args.examples)
    with open(args.output, "w") as f:
        for example in examples:
            f.write(json.dumps(example) + "\n")
    print(f"{len(examples)} examples -> {args.output}")


if __name__ == "__main__":
    main()
