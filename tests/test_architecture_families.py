"""The seam between generic code and the model families: outside a family's own place
(`pretrain/families/`, the modules a family names, and Mixtral's, the llama family's MoE form),
no code names a projection or a norm of a decoder layer: it asks `pretrain.families`."""
from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "pretrain"

# a decoder layer's parameters, by the module names the families' tables hold
LAYER_NAMES = re.compile(r"\b(?:q|k|v|o|gate|up|down)_proj\b|\b[qk]_norm\b|input_layernorm|"
                         r"post_attention_layernorm|block_sparse_moe")

# the families' own modules: their tables, their building blocks, Mixtral's experts and names
FAMILY_PLACES = ("families/", "model/llama.py", "model/qwen3.py", "model/mla.py", "model/moe.py",
                 "model/mixtral.py", "model/expert_parallel.py", "testing/")


def _code_strings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string constant and name in `path`'s code, docstrings left out."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                       ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docstrings:
            found.append((node.lineno, node.value))
        elif isinstance(node, ast.Name):
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            found.append((node.lineno, node.attr))
    return found


def test_generic_code_names_no_layer_parameter():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where.startswith(FAMILY_PLACES):
            continue
        offenders += [f"{where}:{line}: {text!r}" for line, text in _code_strings(path)
                      if LAYER_NAMES.search(text)]
    assert not offenders, ("generic code names a family's parameters (ask pretrain.families "
                           "instead):\n" + "\n".join(offenders))


def test_the_check_finds_a_projection_name(tmp_path):
    """The scan sees a projection named in code, and not one named in a docstring."""
    module = tmp_path / "m.py"
    module.write_text('"""q_proj in a docstring."""\nNAME = "model.layers.0.self_attn.q_proj.weight"\n')
    assert [text for _, text in _code_strings(module) if LAYER_NAMES.search(text)] == \
        ["model.layers.0.self_attn.q_proj.weight"]


def test_the_model_package_imports_no_run_rule():
    """The model checks its own shape (`pretrain.families`' rules) and is handed the run's
    groups and ZeRO-3 config: no module of `pretrain/model/` imports `pretrain.resolve`."""
    found = []
    for path in sorted((PACKAGE / "model").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}: {n}" for n in names if n.startswith("pretrain.resolve")]
    assert not found, found
