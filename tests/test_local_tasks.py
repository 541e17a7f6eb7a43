"""The local tasks shipped in pretrain/evaluation/tasks/: what each example holds, without a model
(the adapter's scores on them are checked against lm-eval's HFLM in test_eval.py)."""
from __future__ import annotations

import json
import random
from collections import Counter

from pretrain.evaluation.next_line import CONTEXT_LINES, MIN_WORDS, reordered
from pretrain.resolve.eval_tasks import LOCAL_TASKS, TASKS_DIR


def _examples(task: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS_DIR / f"{task}.jsonl").read_text().splitlines()]


def test_word_order_choices_differ_only_in_the_order_of_their_words():
    examples = _examples("python_word_order")
    assert len(examples) == 200 and "python_word_order" in LOCAL_TASKS
    for example in examples:
        first, second = example["choices"]
        assert first != second and example["label"] in (0, 1)
        assert Counter(first.split()) == Counter(second.split())  # the same words ...
        indent = len(first) - len(first.lstrip())
        assert first[:indent] == second[:indent] and len(first) == len(second)  # ... and spacing
        assert example["context"].count("\n") == CONTEXT_LINES
    # the true line is not always in one place: a model that prefers a position scores ~0.5
    assert 0.35 < sum(e["label"] for e in examples) / len(examples) < 0.65


def test_a_reordered_line_keeps_its_indentation_and_words():
    line = "        return Call(Name(x), [expr], prefix=node.prefix)"
    other = reordered(line, random.Random(0))
    assert other != line
    assert other[:8] == " " * 8 and other[8] != " " and sorted(other.split()) == sorted(line.split())
    assert reordered("    x = y", random.Random(0)) is not None  # three distinct words
    assert reordered("    a a b", random.Random(0)) is None  # fewer than MIN_WORDS distinct words
    assert MIN_WORDS == 3
