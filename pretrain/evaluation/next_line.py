"""Build the local multiple-choice tasks from the bundled corpus: `python_next_line`
(tasks/python_next_line.jsonl) and `python_word_order` (tasks/python_word_order.jsonl).

Each example is a passage of CONTEXT_LINES consecutive non-blank lines of one standard-library
source file (the `python-stdlib` corpus the quickstart trains on) and candidate next lines.
`python_next_line`: the true one and three lines drawn from other files (acc: chance 0.25).
`python_word_order`: the true one and the same line with its words in another order (the same
characters and indentation, so only the order can tell them apart; chance 0.5): what a model that
has learnt anything of Python's syntax gets right early in training. lm-eval scores both as
multiple choice by log-likelihood. The passages come from the training corpus: the tasks measure
what the model learnt of Python, not generalisation to unseen code.

    python -m pretrain.evaluation.next_line [--task python_next_line|python_word_order]
                                            [--examples 200] [--output PATH]

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
TASKS_DIR = Path(__file__).parent / "tasks"
MIN_WORDS = 3  # python_word_order: a line of fewer words has too few other orders


def _lines(path: Path) -> list[str]:
    text, _ = read_text(path)
    return [line.rstrip() for line in text.splitlines()
            if line.strip() and not TRACKER_CITATION.search(line)]


def _passages(seed: int):
    """Endless (file's lines, start, answer) draws: CONTEXT_LINES lines of one file, then the
    line after them, in the same order for the same standard library and seed."""
    rng = random.Random(seed)
    files = [lines for lines in map(_lines, resolve_corpus([PYTHON_STDLIB]))
             if len(lines) > CONTEXT_LINES + 1]
    while True:
        index = rng.randrange(len(files))
        lines = files[index]
        start = rng.randrange(len(lines) - CONTEXT_LINES)
        answer = lines[start + CONTEXT_LINES]
        if len(answer.strip()) >= MIN_LINE_CHARS:
            yield rng, files, index, "\n".join(lines[start:start + CONTEXT_LINES]) + "\n", answer


def build_examples(count: int, *, seed: int = SEED) -> list[dict]:
    """`python_next_line`: `count` examples {context, choices, label}, the same for the same
    standard library."""
    examples = []
    for rng, files, index, context, answer in _passages(seed):
        if len(examples) == count:
            break
        distractors: list[str] = []
        while len(distractors) < CHOICES - 1:
            other = rng.randrange(len(files))
            line = rng.choice(files[other])
            if other != index and len(line.strip()) >= MIN_LINE_CHARS \
                    and line not in distractors and line != answer:
                distractors.append(line)
        label = rng.randrange(CHOICES)
        choices = distractors[:label] + [answer] + distractors[label:]
        examples.append({"context": context, "choices": choices, "label": label})
    return examples


def reordered(line: str, rng: random.Random) -> str | None:
    """`line` with its whitespace-separated words in another order (its indentation and the
    single spaces between words kept), or None when it has fewer than MIN_WORDS distinct words."""
    indent = line[:len(line) - len(line.lstrip())]
    words = line.split()
    if len(set(words)) < MIN_WORDS:
        return None
    shuffled = words[:]
    while shuffled == words:
        rng.shuffle(shuffled)
    return indent + " ".join(shuffled)


def build_word_order_examples(count: int, *, seed: int = SEED) -> list[dict]:
    """`python_word_order`: `count` examples {context, choices, label}: the true next line and
    the same words in another order."""
    examples = []
    for rng, _, _, context, answer in _passages(seed):
        if len(examples) == count:
            break
        if " ".join(answer.split()) != answer.strip():
            continue  # runs of spaces inside the line: the reordering would change the spacing
        other = reordered(answer, rng)
        if other is None:
            continue
        label = rng.randrange(2)
        choices = [other, answer] if label else [answer, other]
        examples.append({"context": context, "choices": choices, "label": label})
    return examples


BUILDERS = {"python_next_line": build_examples, "python_word_order": build_word_order_examples}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=sorted(BUILDERS), default="python_next_line")
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--output", type=Path, help="default: tasks/<task>.jsonl here")
    args = parser.parse_args(argv)
    output = args.output or TASKS_DIR / f"{args.task}.jsonl"
    examples = BUILDERS[args.task](args.examples)
    with open(output, "w") as f:
        for example in examples:
            f.write(json.dumps(example) + "\n")
    print(f"{len(examples)} examples -> {output}")


if __name__ == "__main__":
    main()
