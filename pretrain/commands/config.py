"""`pretrain config`: the run config a command would run, resolved, with every field explained.

Loads the config exactly as `pretrain train` and `pretrain plan` do (same `--config`, `--set`,
`--deepspeed-config`) and prints it whole: the preset expanded, the overrides applied, the
defaults filled, every path absolute. Each field carries the comment written beside it in
`pretrain/config.py` and, where its value is not the default, the default. The YAML printed is a
run config: `pretrain train --config printed.yaml` runs the same config from any directory.
`model.vocab_size: auto` stays `auto` (train and plan read it from the tokenizer)::

    pretrain config --config configs/quickstart.yaml --set train.lr=1e-3
    pretrain config --config configs/llama_7b.yaml --json

Imports no torch: it answers at once, on a login node too.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import functools
import inspect
import io
import json
import textwrap
import tokenize
import typing
from typing import Any

import yaml

from pretrain.config import RunConfig, add_config_arguments, config_overrides, load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--json", action="store_true",
                        help="print the config as one JSON object, without comments")


def run(args: argparse.Namespace) -> RunConfig:
    from pretrain.resolve.ds_config import load_ds_json

    cfg = load_config(args.config, config_overrides(args))
    load_ds_json(cfg.deepspeed)  # a JSON that is missing or does not parse: exit 2, as in train
    if args.json:
        print(json.dumps(cfg.to_dict(), indent=2))
    else:
        print(commented_yaml(cfg), end="")
    return cfg


def commented_yaml(cfg: RunConfig) -> str:
    """`cfg` as YAML that `load_config` reads back to an equal config, one field a line, each
    with its comment from the source and the default where the value differs."""
    lines = ["# The resolved run config: preset expanded, overrides applied, defaults filled,",
             "# paths absolute. Run it with: pretrain train --config THIS_FILE",
             *_section_lines(RunConfig, cfg.to_dict(), defaults=load_config(None).to_dict(),
                             indent="")]
    return "\n".join(lines) + "\n"


def _section_lines(cls: type, values: dict[str, Any], *, defaults: dict[str, Any],
                   indent: str) -> list[str]:
    """The lines of one dataclass section; `defaults` are what an empty config loads to."""
    comments = field_comments(cls)
    hints = typing.get_type_hints(cls)
    lines = []
    for f in dataclasses.fields(cls):
        value, comment = values[f.name], comments.get(f.name, "")
        if dataclasses.is_dataclass(hints[f.name]):
            lines.append(f"{indent}{f.name}:{_comment(_summary(hints[f.name]))}")
            lines += _section_lines(hints[f.name], value, defaults=defaults[f.name],
                                    indent=indent + "  ")
            continue
        if value != defaults[f.name]:
            comment = f"{comment} (default {_flow(_written_default(f))})".strip()
        lines.append(f"{indent}{f.name}: {_flow(value)}{_comment(comment)}")
    return lines


def _comment(text: str) -> str:
    return f"  # {text}" if text else ""


def _flow(value: Any) -> str:
    """`value` as one line of YAML (flow style, quoted where YAML would misread it)."""
    return yaml.safe_dump([value], default_flow_style=True, width=float("inf")).strip()[1:-1]


def _written_default(f: dataclasses.Field) -> Any:
    """A field's default as the source writes it (`runs/default`, not the absolute path)."""
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return default.value if isinstance(default, enum.Enum) else default


def _summary(cls: type) -> str:
    """The first line of a section's docstring ('' when it has none: dataclass writes one)."""
    doc = cls.__doc__ or ""
    return "" if doc.startswith(f"{cls.__name__}(") else doc.strip().splitlines()[0]


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """{field: its comment} of the dataclass `cls`, read from its source, so the comments are
    written once, beside the fields. A field's comment is the one on its line, continued by the
    comment-only lines right below it, unless those lines sit right above a field without a
    comment of its own: then they are that field's."""
    source = textwrap.dedent(inspect.getsource(cls))
    body = ast.parse(source).body[0].body
    spans = {node.target.id: (node.lineno, node.end_lineno) for node in body
             if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    trailing, alone = _comments_by_line(source)
    uncommented_starts = {first for first, last in spans.values()
                          if not any(row in trailing for row in range(first, last + 1))}
    result = {}
    for name, (first, last) in spans.items():
        own = [trailing[row] for row in range(first, last + 1) if row in trailing]
        if own:
            below = _run_of(alone, last + 1, step=1)
            if last + 1 + len(below) not in uncommented_starts:
                own += below
            result[name] = " ".join(own)
        else:
            result[name] = " ".join(reversed(_run_of(alone, first - 1, step=-1)))
    return {name: text for name, text in result.items() if text}


def _comments_by_line(source: str) -> tuple[dict[int, str], dict[int, str]]:
    """({line: comment after code}, {line: comment alone on its line}), '#' stripped."""
    lines = source.splitlines()
    trailing, alone = {}, {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, column = token.start
            text = token.string.lstrip("#").strip()
            (alone if not lines[row - 1][:column].strip() else trailing)[row] = text
    return trailing, alone


def _run_of(rows: dict[int, str], start: int, *, step: int) -> list[str]:
    """The texts of consecutive `rows` from `start` on, in the direction of `step`."""
    run, row = [], start
    while row in rows:
        run.append(rows[row])
        row += step
    return run
